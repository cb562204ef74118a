"""Probe: what the optimizer pays for FP8 experts' weight copies (``Fp8WeightCopies``), on one GPU.

    python benchmarks/probe_fp8_copies.py

For the two ``moe_layer.py`` expert shapes (64 × 1408 and 128 × 768, dim 2048): the transposed FP8 copy written
by ``transpose_copy_`` (128×128 byte tiles) against the transposed cast kernel at scale 1 (bytes compared, ms and
TB/s of read + write), then the optimizer's fused AdamW pass over the three expert weights without and with the
FP8 copies (``benchmarks/optimizer_pass.py: fp8_copies_pass_ms``).
Prints its measurements; the numbers in docs/performance.md (*FP8 weight copies written by the optimizer*) came
from this probe on one H200.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks.common import time_ms
from benchmarks.optimizer_pass import fp8_copies_pass_ms
from kernels import fp8

SHAPES = ((64, 1408, 2048), (128, 768, 2048))  # (E, H, D)


def transposes(E: int, H: int, D: int) -> None:
    for P, I in ((2 * H, D), (D, H)):  # [w1; w3] and w2
        plain = (torch.randn(E, P, I, device="cuda") * 50).to(fp8.FP8)
        new = torch.empty(E, I, P, dtype=fp8.FP8, device="cuda")
        old = torch.empty(E, I, P, dtype=fp8.FP8, device="cuda")
        ones = torch.ones(E, device="cuda")
        fp8.transpose_copy_(plain, new)
        fp8.cast_experts_t(plain, ones, old, 0)
        same = torch.equal(new.view(torch.uint8), plain.view(torch.uint8).transpose(1, 2)) and torch.equal(
            new.view(torch.uint8), old.view(torch.uint8))
        t_new = time_ms(lambda: fp8.transpose_copy_(plain, new))
        t_old = time_ms(lambda: fp8.cast_experts_t(plain, ones, old, 0))
        gb = 2 * plain.numel() / 1e9
        print(f"E={E} [{P}x{I}]: equal {same}; byte tiles {t_new:.3f} ms ({gb / t_new:.2f} TB/s), "
              f"cast kernel {t_old:.3f} ms ({gb / t_old:.2f} TB/s)", flush=True)


def optimizer_pass(E: int, H: int, D: int) -> None:
    ws = [torch.randn(E, *s, device="cuda") * 0.02 for s in ((H, D), (D, H), (H, D))]
    t = fp8_copies_pass_ms(*ws)
    a, b = t["adamw_ms"], t["with_fp8_copies_ms"]
    print(f"E={E} H={H}: AdamW pass {a:.3f} ms, with FP8 copies {b:.3f} ms (+{b - a:.3f}; finish_ alone "
          f"{t['finish_ms']:.3f})", flush=True)


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("probe_fp8_copies.py needs a CUDA GPU")
    for E, H, D in SHAPES:
        transposes(E, H, D)
        optimizer_pass(E, H, D)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
