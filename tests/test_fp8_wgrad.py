"""The experts' FP8 weight-gradient pieces (kernels/fp8_wgrad.py): the transposed block quantiser against its
definition, the grouped GEMM against fp64 — random row counts, every row to one expert, empty experts, experts
whose rows start and end inside a 128-row block, one hot expert — and, on CPU, the GEMM's Triton kernel in the
interpreter (compiled for sm_90 too, the quantiser's as well); on a Hopper GPU both kernels against the torch
path and a CUDA graph."""

import pytest
import torch

from kernels import fp8_wgrad as fw
from kernels.fp8 import FP8, FP8_MAX
from test_kernels import needs_cpu_interpreter, run_in_interpreter

CASES = {  # row counts per expert
    "random": [37, 5, 200, 64, 1, 90],
    "one_expert": [0, 0, 300, 0],
    "empty_ends": [0, 17, 0, 0, 149, 0],
    "mid_block": [100, 56, 130, 3],  # boundaries at 100, 156, 286: inside blocks
    "one_hot": [20, 900, 20, 20],
}


def _rows(counts, P, Q, seed=0, dtype=torch.bfloat16):
    """a [R, P], b [R, Q] (R = Σ counts + 9 rows past them), rows and columns of very different sizes."""
    g = torch.Generator().manual_seed(seed)
    R = sum(counts) + 9
    a = torch.randn(R, P, generator=g) * torch.logspace(-2, 2, R)[:, None] * torch.logspace(-1, 1, P)[None, :]
    b = torch.randn(R, Q, generator=g) * torch.logspace(1, -1, R)[:, None]
    return a.to(dtype), b.to(dtype), torch.cumsum(torch.tensor(counts), 0).int()


def _fp64(a, b, offs):
    ends = [0] + offs.tolist()
    return torch.stack([a[r0:r1].double().t() @ b[r0:r1].double() for r0, r1 in zip(ends[:-1], ends[1:])])


def test_quant_blocks_t_is_its_definition():
    """q[c, r] = e4m3(x[r, c] / s[r // 128, c]), s the smallest power of two with |x| / s <= 448 over the block's
    column (1 for a zero column); rows past R zeros; dequantised within e4m3's rounding (2^-4 relative, or half
    its smallest subnormal step)."""
    x = torch.randn(300, 70, dtype=torch.float64) * torch.logspace(-6, 6, 300)[:, None]
    x[:, 3] = 0  # a zero column
    x[130, 5] = 1e12  # a spike: only its block's scale of column 5 moves
    q, s = fw.quant_blocks_t(x)
    assert q.dtype == FP8 and q.shape == (70, 384) and s.shape == (3, 70)
    blocks = torch.zeros(384, 70, dtype=torch.float64)
    blocks[:300] = x
    amax = blocks.view(3, 128, 70).abs().amax(1)
    assert torch.equal(torch.log2(s), torch.log2(s).round()) and (amax / s.double() <= FP8_MAX).all()
    assert ((amax == 0) | (amax / s.double() > FP8_MAX / 2)).all() and (s[:, 3] == 1).all()
    assert s[1, 5] > 1e5 * s[0, 5] and s[1, 5] > 1e5 * s[2, 5]
    deq = fw.dequant_blocks_t(q, s).double()
    assert not deq[:, 300:].any()
    err = (deq[:, :300] - x.t()).abs()
    assert (err <= x.t().abs() * 2**-4 + s.repeat_interleave(128, 0)[:300].t().double() * 2**-10).all()


@pytest.mark.parametrize("case", sorted(CASES))
def test_grouped_wgrad_fp8_against_fp64(case):
    """The torch path: each expert's Σ aᵀ b over its rows, from the block-quantised operands, equals fp64's product
    of those dequantised operands (1e-6), and stays within FP8's error of fp64's product of the bf16 rows; an
    expert without rows gets zeros; rows past the last expert are not read."""
    counts = CASES[case]
    a, b, offs = _rows(counts, 48, 40, seed=len(case))
    at, sa = fw.quant_blocks_t(a)
    bt, sb = fw.quant_blocks_t(b)
    got = fw.grouped_wgrad_fp8(at, sa, bt, sb, offs, out_dtype=torch.float32)
    exact = _fp64(fw.dequant_blocks_t(at, sa).t(), fw.dequant_blocks_t(bt, sb).t(), offs)
    want = _fp64(a, b, offs)
    for e, c in enumerate(counts):
        if c == 0:
            assert not got[e].any(), e
            continue
        assert float((got[e].double() - exact[e]).norm() / exact[e].norm()) < 1e-6, e
        assert float((got[e].double() - want[e]).norm() / want[e].norm()) < 0.08, e
    junk = at.clone()
    junk[:, int(offs[-1]):] = 448.0  # rows past the experts' (e4m3's largest value): never read
    assert torch.equal(fw.grouped_wgrad_fp8(junk, sa, bt, sb, offs, out_dtype=torch.float32), got)


_SCRIPT = r"""
import os, torch
from kernels import fp8_wgrad as fw
from test_fp8_wgrad import CASES, _rows
for name, counts in CASES.items():
    a, b, offs = _rows(counts, 48, 40)
    at, sa = fw.quant_blocks_t_torch(a)  # e4m3 made by torch: the interpreter's own rounding to e4m3 is not RNE
    bt, sb = fw.quant_blocks_t_torch(b)
    assert fw._use_triton(at, offs)
    got = fw.grouped_wgrad_fp8(at, sa, bt, sb, offs, out_dtype=torch.float32, config="tiny")
    want = fw.grouped_wgrad_fp8_torch(at, sa, bt, sb, offs, out_dtype=torch.float32)
    err = float((got - want).norm() / want.norm())
    assert err < 1e-5, (name, err)
    assert not got[[e for e, c in enumerate(counts) if c == 0]].any(), name
print("FP8-WGRAD-OK")
# the quantiser's kernel, recorded and compiled for sm_90 (not run: the interpreter cannot round to e4m3)
os.environ["SM90_COMPILE_ONLY"] = "1"
x = torch.randn(300, 70, dtype=torch.bfloat16)
fw._quant_blocks_t_kernel[(3, 2)](x, torch.empty(70, 384, dtype=torch.uint8), torch.empty(3, 70), 300, 70, 384, 70,
                                  BLOCK_R=128, BLOCK_C=64, num_warps=4)
"""


@needs_cpu_interpreter
def test_kernels_in_interpreter():
    run_in_interpreter(_SCRIPT, "FP8-WGRAD-OK")


hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                            reason="needs a Hopper (sm90+) GPU")


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("R, C", [(98304, 2048), (300, 70), (1, 16)])
def test_quant_blocks_t_kernel_equals_torch(R, C):
    x = (torch.randn(R, C, device="cuda") * torch.logspace(-4, 4, R, device="cuda")[:, None]).bfloat16()
    q, s = fw.quant_blocks_t(x)
    rq, rs = fw.quant_blocks_t_torch(x)
    assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("config", sorted(c for c in fw.CONFIGS if c != "tiny"))
def test_grouped_wgrad_fp8_kernel_equals_torch_and_replays(case, config):
    """The kernel against the torch path on the same e4m3 operands (fp32 out: 1e-5, the order of fp32 sums), at a
    width past one tile; an expert without rows zeros; a CUDA graph of the call replays to the same output."""
    from cuda_graphs import warm_up_and_capture

    counts = [c * 7 for c in CASES[case]]
    a, b, offs = _rows(counts, 1536, 2048)
    a, b, offs = a.cuda(), b.cuda(), offs.cuda()
    at, sa = fw.quant_blocks_t(a)
    bt, sb = fw.quant_blocks_t(b)
    got = fw.grouped_wgrad_fp8(at, sa, bt, sb, offs, out_dtype=torch.float32, config=config)
    want = fw.grouped_wgrad_fp8_torch(at, sa, bt, sb, offs, out_dtype=torch.float32)
    assert float((got - want).norm() / want.norm()) < 1e-5
    assert not got[[e for e, c in enumerate(counts) if c == 0]].any()
    graph, out = warm_up_and_capture(lambda: fw.grouped_wgrad_fp8(at, sa, bt, sb, offs, config=config))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fw.grouped_wgrad_fp8(at, sa, bt, sb, offs, config=config))
