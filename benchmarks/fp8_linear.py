"""The attention's projections in FP8 — the dense linear layers float8 converts besides the feed-forwards — as
torchao's Float8Linear against ``Fp8RowsLinear`` (the FP8 experts' recipe, components/train/fp8_linear.py), bf16
beside, each compiled as one graph the way the step compiles an attention: would moving them onto those kernels
pay?

    python benchmarks/fp8_linear.py --shapes 16384x2048

A shape is TOKENSxDIM; the projections are v2lite_1b's for that dim (16 heads): wq D → 3072, wkv_a D → 576,
wkv_b 512 → 4096, wo 2048 → D. The block runs a pre-norm, the four projections with the attention replaced by an
elementwise stand-in (the projections' neighbours, which compile fuses torchao's scaling into), and the residual
add, forward and backward, in a CUDA graph:

    bf16      nn.Linear in bf16
    torchao   torchao's Float8Linear, tensorwise (what ``[model] converters = ["float8"]`` runs)
    rows      Fp8RowsLinear (``[moe_echo] dense_linear_kernels = "experts"``): one scale per token row and per
              weight, FP8 weight gradients, each pass one custom op in the compiled graph

``rel_err`` is the largest relative error (Frobenius) of the output and the gradients of x and the four weights
against fp64; the run stops where a variant is off by more than 15% (bf16: 2%).
"""

import argparse
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import (checked_fwd_bwd, environment, fp64_fwd_bwd, graphed, markdown_table, shape_arg,  # noqa: E402
                               time_ms, write_results)
from components.train.fp8_linear import Fp8RowsLinear  # noqa: E402

PROJECTIONS = ("wq", "wkv_a", "wkv_b", "wo")


class Projections(nn.Module):
    """x + wo(q · sigmoid(kv)), q = wq(norm x), kv = wkv_b(norm(wkv_a(norm x)[:512])): an attention's four
    projections (DeepSeek-V3's, no query compression) around an elementwise stand-in for the attention."""

    def __init__(self, D: int, heads: int = 16):
        super().__init__()
        self.norm, self.kv_norm = nn.RMSNorm(D, eps=1e-6), nn.RMSNorm(512, eps=1e-6)
        self.wq = nn.Linear(D, heads * 192, bias=False)
        self.wkv_a = nn.Linear(D, 512 + 64, bias=False)
        self.wkv_b = nn.Linear(512, heads * 256, bias=False)
        self.wo = nn.Linear(heads * 128, D, bias=False)
        self.v = heads * 128

    def forward(self, x):
        h = self.norm(x)
        q = self.wq(h)[..., :self.v]
        kv = self.wkv_b(self.kv_norm(self.wkv_a(h)[..., :512]))[..., :self.v]
        return x + self.wo(q * torch.sigmoid(kv))


def _grads(block, x):
    return [x.grad] + [getattr(block, n).weight.grad for n in PROJECTIONS]


def _flops(block, T: int) -> int:
    """Forward and both backward GEMMs of the four projections."""
    return 6 * T * sum(getattr(block, n).weight.numel() for n in PROJECTIONS)


def measure(T: int, D: int, iters: int) -> list[dict]:
    torch.manual_seed(0)
    base = Projections(D).cuda().bfloat16()
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    want = fp64_fwd_bwd(base, x, dy, _grads)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    blocks = {"bf16": copy.deepcopy(base), "torchao": copy.deepcopy(base), "rows": copy.deepcopy(base)}
    convert_to_float8_training(blocks["torchao"], config=Float8LinearConfig.from_recipe_name("tensorwise"))
    for n in PROJECTIONS:
        Fp8RowsLinear.from_linear(getattr(blocks["rows"], n))
    rows = []
    for name, block in blocks.items():
        block.forward = torch.compile(block.forward, fullgraph=True, dynamic=False)
        step, err = checked_fwd_bwd(block, x, dy, want, _grads, f"fp8_linear: {name} at {T}x{D}",
                                    limit=0.02 if name == "bf16" else 0.15)
        ms = time_ms(graphed(step), iters=iters)
        rows.append(dict(tokens=T, dim=D, variant=name, ms=ms, gemm_tflops=_flops(base, T) / ms / 1e9, rel_err=err))
    by = {r["variant"]: r["ms"] for r in rows}
    for r in rows:
        r["vs_bf16"], r["vs_torchao"] = by["bf16"] / r["ms"], by["torchao"] / r["ms"]
    return rows


_shape = shape_arg("TOKENSxDIM", "16384x2048")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", type=_shape, default=[_shape("16384x2048")])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        raise SystemExit("fp8_linear: needs a Hopper (compute capability 9.0+) GPU")
    rows = [r for shape in args.shapes for r in measure(*shape, args.iters)]
    table = markdown_table(rows, ["tokens", "dim", "variant", "ms", "gemm_tflops", "vs_bf16", "vs_torchao", "rel_err"])
    print(table)
    write_results("fp8_linear", environment(), rows, table, args.out)


if __name__ == "__main__":
    main()
