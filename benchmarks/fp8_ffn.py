"""A dense SwiGLU feed-forward in FP8 — the shape of the shared experts and of the dense layers' FFN, which
torchao's Float8Linear converts today — against the routed experts' FP8 kernels run as one expert that every
token reaches: would moving them onto those kernels pay?

    python benchmarks/fp8_ffn.py --shapes 16384x2048x1536 16384x2048x10944

A shape is TOKENSxDIMxHIDDEN (v2lite_1b: its shared experts' 2 x 768, its dense layer's 10944). Each variant
runs RMSNorm, the feed-forward and the residual add, forward and backward, in a CUDA graph:

    bf16                nn.Linear in bf16, compiled
    torchao             torchao's Float8Linear, tensorwise (what ``[model] converters = ["float8"]`` runs), compiled
    experts             ``fp8_grouped_swiglu`` with one expert: one scale per token row, the SwiGLU writing its
                        FP8 rows, FP8 weight copies as the optimizer writes them, FP8 weight gradients, cuBLAS's
                        GEMMs (one expert); the norm and the residual add compiled around it
    experts_bf16_wgrad  the same, the weight gradients in bf16
    experts_cast        the same as ``experts`` without weight copies: the weights cast in every call (what
                        ``[moe_echo] dense_ffn_kernels = "experts"`` runs)

``rel_err`` is the largest relative error (Frobenius) of the output and the four gradients against fp64; the run
stops where a variant is off by more than 15% (bf16: 2%). ``vs_bf16`` and ``vs_torchao``: their time over the
row's.
"""

import argparse
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import (checked_fwd_bwd, environment, fp64_fwd_bwd, graphed, markdown_table, shape_arg,  # noqa: E402
                               time_ms, write_results)
from components.moe_echo.fp8_experts import Fp8WeightCopies, fp8_grouped_swiglu  # noqa: E402


class FFN(nn.Module):
    """x + w2(silu(w1(norm(x))) · w3(norm(x))), torchtitan's FeedForward behind a pre-norm."""

    def __init__(self, D: int, H: int):
        super().__init__()
        self.norm = nn.RMSNorm(D, eps=1e-6)
        self.w1, self.w3 = nn.Linear(D, H, bias=False), nn.Linear(D, H, bias=False)
        self.w2 = nn.Linear(H, D, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def _add(a, b):
    return a + b


class ExpertsFFN(nn.Module):
    """The same block, its feed-forward through the FP8 experts' kernels as expert 0 of one."""

    def __init__(self, ffn: FFN, copies: bool, wgrad_fp8: bool):
        super().__init__()
        self.norm = ffn.norm
        self.w1, self.w2, self.w3 = (nn.Parameter(w.weight.detach()[None].clone()) for w in (ffn.w1, ffn.w2, ffn.w3))
        self.wgrad_fp8 = wgrad_fp8
        self.copies = None
        if copies:
            E, H, D = self.w1.shape
            self.copies = Fp8WeightCopies(E, H, D, self.w1.device)
            self.copies.write_(self.w1, self.w2, self.w3)
        self.hint_2E = torch.zeros(2, 1, device=self.w1.device)
        # compiled as compile_dense compiles a norm (its forward: a built-in module itself would not be)
        self.norm_fn = torch.compile(self.norm.forward, fullgraph=True, dynamic=False)
        self.add = torch.compile(_add, fullgraph=True, dynamic=False)

    def forward(self, x):
        T = x.shape[0]
        counts = torch.full((1,), T, dtype=torch.int64, device=x.device)
        y = fp8_grouped_swiglu(self.norm_fn(x), self.w1, self.w2, self.w3, counts, self.hint_2E, copies=self.copies,
                               wgrad_fp8=self.wgrad_fp8)
        return self.add(x, y)


def _grads(block, xg):
    ws = (block.w1, block.w2, block.w3)
    return [xg.grad] + [(w.weight if isinstance(w, nn.Linear) else w).grad.reshape(-1) for w in ws]


def measure(T: int, D: int, H: int, iters: int) -> list[dict]:
    torch.manual_seed(0)
    ffn = FFN(D, H).cuda().bfloat16()
    for w in (ffn.w1, ffn.w2, ffn.w3):
        nn.init.normal_(w.weight, std=w.weight.shape[1] ** -0.5)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    want = fp64_fwd_bwd(ffn, x, dy, _grads)  # y, dx, dw1, dw2, dw3
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    ao = copy.deepcopy(ffn)
    convert_to_float8_training(ao, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    blocks = {"bf16": copy.deepcopy(ffn), "torchao": ao}
    for b in blocks.values():
        b.forward = torch.compile(b.forward, fullgraph=True, dynamic=False)
    blocks["experts"] = ExpertsFFN(copy.deepcopy(ffn), copies=True, wgrad_fp8=True)
    blocks["experts_bf16_wgrad"] = ExpertsFFN(copy.deepcopy(ffn), copies=True, wgrad_fp8=False)
    blocks["experts_cast"] = ExpertsFFN(copy.deepcopy(ffn), copies=False, wgrad_fp8=True)
    rows = []
    for name, block in blocks.items():
        step, err = checked_fwd_bwd(block, x, dy, want, _grads, f"fp8_ffn: {name} at {T}x{D}x{H}",
                                    limit=0.02 if name == "bf16" else 0.15)
        ms = time_ms(graphed(step), iters=iters)
        rows.append(dict(tokens=T, dim=D, hidden=H, variant=name, ms=ms, gemm_tflops=18 * T * D * H / ms / 1e9,
                         rel_err=err))
    by = {r["variant"]: r["ms"] for r in rows}
    for r in rows:
        r["vs_bf16"] = by["bf16"] / r["ms"]
        r["vs_torchao"] = by["torchao"] / r["ms"]
    return rows


_shape = shape_arg("TOKENSxDIMxHIDDEN", "16384x2048x1536")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", type=_shape, default=[_shape("16384x2048x1536"), _shape("16384x2048x10944")])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        raise SystemExit("fp8_ffn: needs a Hopper (compute capability 9.0+) GPU")
    rows = [r for shape in args.shapes for r in measure(*shape, args.iters)]
    table = markdown_table(rows, ["tokens", "dim", "hidden", "variant", "ms", "gemm_tflops", "vs_bf16", "vs_torchao",
                                  "rel_err"])
    print(table)
    write_results("fp8_ffn", environment(), rows, table, args.out)


if __name__ == "__main__":
    main()
