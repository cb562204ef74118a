"""The row-grouped FP8 GEMM (kernels/fp8_gemm.py) against an fp64 reference of the same e4m3 operands and scales:
random row counts, every row to one expert, empty experts (first, middle, last), one-row experts, widths that are
not a multiple of the tile, and rows past the routed ones left untouched. On CPU through Triton's interpreter
(compiled for sm_90 as well); on a Hopper GPU for every tile configuration, and beside torch._scaled_grouped_mm."""

import pytest
import torch

from conftest import hopper
from test_kernels import needs_cpu_interpreter, run_in_interpreter

CASES = {  # row counts per expert
    "random": [37, 5, 120, 64, 1, 90],
    "one_expert": [0, 0, 300, 0],
    "empty_ends": [0, 17, 0, 0, 49, 0],
    "one_row_each": [1, 1, 1, 1, 1],
}


def _case(counts, N, K, extra=7, device="cpu", seed=0):
    """(a_q, s_M, b_q, s_EN, offs_E, (reference, reference of |a|·|b|): [M, N] fp64 on the routed rows); ``extra``
    rows past them."""
    from kernels.fp8 import quant_rows_torch
    g = torch.Generator().manual_seed(seed)
    counts_E = torch.tensor(counts)
    M, E = int(counts_E.sum()) + extra, len(counts)
    a = torch.randn(M, K, generator=g) * torch.logspace(-2, 2, M)[:, None]  # rows of very different sizes
    b = torch.randn(E, N, K, generator=g) * torch.logspace(-1, 1, N)[None, :, None]
    a_q, s_M = quant_rows_torch(a)
    b_q, s_R = quant_rows_torch(b.reshape(E * N, K))
    b_q, s_EN = b_q.view(E, N, K), s_R.view(E, N)
    ref, mag, r = torch.zeros(M, N, dtype=torch.float64), torch.zeros(M, N, dtype=torch.float64), 0
    for e, c in enumerate(counts):
        a_e, b_e = a_q[r:r + c].double() * s_M[r:r + c, None], b_q[e].double() * s_EN[e][:, None]
        ref[r:r + c], mag[r:r + c] = a_e @ b_e.t(), a_e.abs() @ b_e.abs().t()
        r += c
    offs = torch.cumsum(counts_E, 0).int()
    to = lambda t: t.to(device)
    return to(a_q), to(s_M), to(b_q), to(s_EN), to(offs), (ref, mag)


def _check(out, refs, used, sentinel):
    """Each element within bf16 rounding of the exact product (2^-8 of it) plus a reduced-precision accumulation's
    error (2^-8 of the sum of |terms|: Hopper's FP8 tensor cores, like Triton's interpreter, do not accumulate in
    full fp32), the whole within 1% of it; rows past ``used`` still ``sentinel``."""
    ref, mag = refs
    got = out.double().cpu()
    excess = (got[:used] - ref[:used]).abs() - 2 ** -8 * (ref[:used].abs() + mag[:used])
    assert used == 0 or float(excess.max()) <= 0, f"off by more than rounding: {float(excess.max())}"
    assert used == 0 or float((got[:used] - ref[:used]).norm() / ref[:used].norm()) < 1e-2
    assert bool((got[used:] == sentinel).all()), "rows past the routed ones were written"


_SCRIPT = r"""
import torch
from kernels.fp8_gemm import grouped_mm_fp8
from test_fp8_gemm import CASES, _case, _check
for name, counts in CASES.items():
    for N, K in ((48, 64), (40, 48)):  # N = 40: a partial column tile; K = 48: a partial last K block
        a_q, s_M, b_q, s_EN, offs, refs = _case(counts, N, K)
        for config in ("tiny", "tinyf"):  # tinyf: the tile and K loops flattened into one
            out = torch.full((a_q.shape[0], N), 3.0, dtype=torch.bfloat16)
            grouped_mm_fp8(a_q, s_M, b_q, s_EN, offs, out=out, config=config)
            _check(out, refs, int(offs[-1]), 3.0)
print("FP8-GEMM-OK")
"""


@needs_cpu_interpreter
def test_grouped_fp8_gemm_in_interpreter():
    run_in_interpreter(_SCRIPT, "FP8-GEMM-OK")


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("case", sorted(CASES))
def test_grouped_fp8_gemm_on_gpu_every_config(case):
    from kernels.fp8_gemm import CONFIGS, grouped_mm_fp8
    counts = [c * 13 for c in CASES[case]]  # several row blocks per expert, none aligned
    for N, K in ((768, 2048), (200, 272)):  # 200: a partial column tile; 272: a partial K block
        a_q, s_M, b_q, s_EN, offs, refs = _case(counts, N, K, device="cuda")
        used = int(offs[-1])
        for config in CONFIGS:
            out = torch.full((a_q.shape[0], N), 3.0, dtype=torch.bfloat16, device="cuda")
            grouped_mm_fp8(a_q, s_M, b_q, s_EN, offs, out=out, config=config)
            _check(out, refs, used, 3.0)
        if N % 16 == 0 and used:  # torch's grouped FP8 GEMM on the same operands: the same bf16 products
            theirs = torch._scaled_grouped_mm(a_q, b_q.transpose(-2, -1), s_M, s_EN, offs=offs,
                                              out_dtype=torch.bfloat16, use_fast_accum=True)
            ours = grouped_mm_fp8(a_q, s_M, b_q, s_EN, offs)
            rel = (ours[:used].double() - theirs[:used].double()).norm() / theirs[:used].double().norm()
            assert float(rel) < 4e-3
