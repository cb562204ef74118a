"""benchmarks/probe_fp8_wgrad.py's torch references (the probe checks its Triton kernel against them on a GPU):
the group scales and the transposed, group-scaled, 16-aligned FP8 operand of the weight gradients, against a
per-expert loop."""

import torch

from benchmarks.probe_fp8_wgrad import group_scales, padded_offsets, requant_t_grouped_torch
from kernels.fp8 import FP8, quant_rows_torch


def test_weight_gradient_operand_against_a_loop_over_experts():
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 17, 16, 33, 1])  # an empty expert, an aligned one, ragged ones
    R, C = int(counts.sum()) + 6, 40  # 6 padding rows, never read
    x = torch.randn(R, C, generator=g) * torch.logspace(-2, 2, R)[:, None]  # row magnitudes over 4 decades
    q, s = quant_rows_torch(x)
    s[-6:] = float("nan")  # padding rows' scales are garbage
    offs, offs_pad = torch.cumsum(counts, 0, dtype=torch.int32), padded_offsets(counts)
    assert offs_pad.tolist() == [16, 16, 48, 64, 112, 128]
    s_E = group_scales(s, offs)
    out = requant_t_grouped_torch(q, s, s_E, offs, offs_pad, 144)
    assert out.dtype == FP8 and out.shape == (C, 144)
    r0 = p0 = 0
    for e, n in enumerate(counts.tolist()):
        if n == 0:
            assert s_E[e] == 1
        else:
            assert s_E[e] == s[r0:r0 + n].max()  # the largest row scale of the group
        block = out[:, p0:p0 + n].float().t() * s_E[e]
        exact = q[r0:r0 + n].float() * s[r0:r0 + n, None]
        # rescaling by a power of two ≤ 1 is exact above e4m3's subnormals (2^-6 · s_E), within half a step below
        normal = exact.abs() >= 2**-6 * s_E[e]
        assert torch.equal(block[normal], exact[normal])
        assert ((block - exact).abs()[~normal] <= 2**-10 * s_E[e]).all()
        pad_end = int(offs_pad[e])
        assert (out[:, p0 + n:pad_end].float() == 0).all()  # alignment padding is zero
        r0, p0 = r0 + n, pad_end
