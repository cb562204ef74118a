"""The optimizer's pass over one layer's routed experts (one EP rank's share), two ways, on one GPU:

- ``cast``: fp32 weights, torch's fused AdamW, plus what the step pays around it on this path: the bf16 cast
  of each weight the forward reads and the cast-and-divide of each bf16 gradient to fp32 (``_ComputeCast``);
- ``copies``: ``AdamWWithCopies`` (kernels/adamw.py): fp32 master, moments, bf16 gradient in, bf16 copy out,
  in one pass (w1/w3 as the halves of one [w1; w3], QuACK's layout).

Each row: median ms, the bytes each path must move (cast: 28 B/param in AdamW + 12 B/param of casts;
copies: 28 B/param), its GB/s, and the fraction of a device-to-device copy's rate measured in the same run.

    python benchmarks/optimizer_pass.py --experts 32 --hidden 1408 --dim 2048    (v2lite_6b_2gpu, per rank)
"""

import argparse

import torch

from benchmarks.common import environment, markdown_table, time_ms, write_results
from components.moe_echo.experts import GroupedExperts, _ComputeCast
from components.moe_echo.fp8_experts import Fp8WeightCopies
from components.train.master_adamw import AdamWWithCopies
from kernels.adamw import adamw_master_

HP = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)


def experts(args, copies: bool) -> GroupedExperts:
    ge = GroupedExperts(args.dim, args.hidden, args.experts, gemm="quack").cuda()
    ge.init_weights(0.02)
    ge.compute_dtype = torch.bfloat16
    ge.set_gradient_divide_factor(2.0)
    if copies:
        ge.enable_compute_copies()
    return ge


def fp8_copies_pass_ms(w1_EHD: torch.Tensor, w2_EDH: torch.Tensor, w3_EHD: torch.Tensor) -> dict:
    """The fused AdamW pass (kernels/adamw.py: fp32 masters and moments, bf16 gradients and weights) over one
    layer's three expert weights (fp32, CUDA), median ms: ``adamw_ms`` alone, ``with_fp8_copies_ms`` also writing
    their FP8 copies (``Fp8WeightCopies``: the plain copy in the pass, then ``finish_``), and ``finish_ms``, the
    ``finish_`` alone once no scale moves."""
    ws = (w1_EHD, w2_EDH, w3_EHD)
    copies = Fp8WeightCopies(*w1_EHD.shape, w1_EHD.device)
    copies.write_(*ws)
    state = [(torch.zeros_like(w), torch.zeros_like(w), torch.randn_like(w).bfloat16(), w.bfloat16()) for w in ws]
    step = torch.ones((), device=w1_EHD.device)
    finish = lambda: copies.finish_(dict(zip((1, 2, 3), ws)), {1, 2, 3}, None)  # noqa: E731

    def adamw(fp8: bool):
        def fn():
            for role, w, (m, v, g, p) in zip((1, 2, 3), ws, state):
                adamw_master_(p, g, w, m, v, 1e-5, step, 0.9, 0.95, 1e-8, 0.1, fp8=copies.copy(role) if fp8 else None)
            if fp8:
                finish()
        return fn

    return {"adamw_ms": time_ms(adamw(False)), "with_fp8_copies_ms": time_ms(adamw(True)), "finish_ms": time_ms(finish)}


def copy_rate_gbs() -> float:
    """Device-to-device copy rate (read + write bytes per second) of 1 GiB of fp32."""
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / time_ms(lambda: dst.copy_(src)) / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--hidden", type=int, default=1408)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    ceiling = copy_rate_gbs()
    rows = []

    ge = experts(args, copies=False)
    params = (ge.w1, ge.w2, ge.w3)
    opt = torch.optim.AdamW(params, **HP)
    grads = [torch.randn_like(w, dtype=torch.bfloat16) for w in params]

    def cast_step():
        for w, g in zip(params, grads):  # forward's weight cast, backward's gradient cast-and-divide
            _ComputeCast.apply(w, torch.bfloat16, 0.5).backward(g)
        opt.step()
        opt.zero_grad(set_to_none=True)

    n = sum(w.numel() for w in params)
    rows.append(dict(path="cast", ms=time_ms(cast_step), bytes_per_param=40))
    del ge, params, opt, grads
    torch.cuda.empty_cache()

    ge = experts(args, copies=True)
    opt = AdamWWithCopies([ge.w1, ge.w2, ge.w3], copies=ge.copies, **HP)
    g13 = torch.randn(args.experts, 2 * args.hidden, args.dim, device="cuda", dtype=torch.bfloat16)
    g2 = torch.randn_like(ge.w2, dtype=torch.bfloat16)

    c1, c2, c3 = (ge.copies[w] for w in (ge.w1, ge.w2, ge.w3))

    def copies_step():  # the backward leaves w1's and w3's gradients as the halves of one [w1; w3]
        c1.grad, c3.grad, c2.grad = g13[:, :args.hidden], g13[:, args.hidden:], g2
        opt.step()

    rows.append(dict(path="copies", ms=time_ms(copies_step), bytes_per_param=28))
    for r in rows:
        r.update(experts=args.experts, hidden=args.hidden, dim=args.dim, params=n)
        r["gbs"] = r["bytes_per_param"] * n / r["ms"] / 1e6
        r["frac_of_copy"] = r["gbs"] / ceiling
        r["copy_gbs"] = ceiling
    rows[1]["speedup_vs_cast"] = rows[0]["ms"] / rows[1]["ms"]
    cols = ["path", "experts", "hidden", "dim", "ms", "bytes_per_param", "gbs", "frac_of_copy", "speedup_vs_cast"]
    table = markdown_table(rows, cols)
    print(table)
    write_results("optimizer_pass", environment(), rows, table, args.out)


if __name__ == "__main__":
    main()
