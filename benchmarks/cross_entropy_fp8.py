"""The cross-entropy's backward in the forms an FP8 output head reads, against the bf16 backward and the cast the
head would do itself, on one GPU (v2lite_1b's logits: 16384 × 32768 bf16). Rows, median ms of a CUDA-graph replay:

- ``bf16``: the plain backward (``cross_entropy_bwd``, one program per row): reads 2 bytes a logit, writes 2;
- ``bf16 + head cast``: that, then ``cast_both`` of the gradient (an amax pass, then a pass writing both FP8
  layouts): what an FP8 head does without the loss's FP8 forms;
- ``fp8: plain + cols`` (the default head's: bf16 for the input gradient, FP8 transposed for the weight
  gradient), ``fp8: rows + cols`` (all three of the head's GEMMs in FP8), ``fp8: plain + rows`` (the input
  gradient's GEMM in FP8, the weight gradient's in bf16): ``cross_entropy_bwd_fp8``, the backward's one pass
  writing the bf16 and FP8 rows, then a byte transpose of the FP8 rows where the weight gradient reads them.

Each row also gives the bytes it moves per logit and the rate that makes (GB/s).

    python benchmarks/cross_entropy_fp8.py [--tokens 16384 --vocab 32768]
"""

import argparse

import torch

from benchmarks.common import environment, graphed, markdown_table, time_ms, write_results
from kernels import cross_entropy as ce
from kernels.fp8 import FP8_GRAD, cast_both


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = p.parse_args()
    N, V = args.tokens, args.vocab
    torch.manual_seed(0)
    x_NV = (torch.randn(N, V, device="cuda") * 2).bfloat16()
    labels_N = torch.randint(0, V, (N,), device="cuda")
    _, lse_N = ce.cross_entropy_fwd(x_NV, labels_N, -100)
    n_valid, grad_loss = (labels_N != -100).sum().float(), torch.ones((), device="cuda")
    args_ = (x_NV, labels_N, lse_N, grad_loss, n_valid, -100)

    def fp8(rows, cols, plain):
        return lambda: ce.cross_entropy_bwd_fp8(*args_, FP8_GRAD, rows, cols, plain)

    def timed(fn):
        return time_ms(graphed(fn), iters=args.iters)

    cases = [("bf16", 4, lambda: ce.cross_entropy_bwd(*args_)),
             ("bf16 + head cast", 10, lambda: cast_both(ce.cross_entropy_bwd(*args_), FP8_GRAD)),
             ("fp8: plain + cols", 7, fp8(False, True, True)),
             ("fp8: rows + cols", 5, fp8(True, True, False)),
             ("fp8: plain + rows", 5, fp8(True, False, True))]
    rows = []
    for name, bytes_per, fn in cases:
        ms = timed(fn)
        rows.append({"backward": name, "tokens": N, "vocab": V, "ms": round(ms, 3), "bytes_per_logit": bytes_per,
                     "GB_s": int(bytes_per * N * V / ms / 1e6)})
    base = {r["backward"]: r["ms"] for r in rows}
    for r in rows:
        r["vs_bf16_and_cast"] = round(base["bf16 + head cast"] / r["ms"], 3)
    table = markdown_table(rows, ["backward", "tokens", "vocab", "ms", "bytes_per_logit", "GB_s", "vs_bf16_and_cast"])
    print(table)
    print(write_results("cross_entropy_fp8", environment(), rows, table, args.out))


if __name__ == "__main__":
    main()
