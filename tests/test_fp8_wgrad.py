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


@pytest.mark.parametrize("scales", fw.SCALES)
def test_quant_expert_blocks_t_is_its_definition(scales):
    """Each expert's rows start on a 128-row block and are padded with zeros to the next; q[c, a] = e4m3(x[r, c] /
    s), s the smallest power of two with |x| / s <= 448 over the column of the 128-row block ("block") or of the
    expert's rows ("expert"), 1 for a zero column; dequantised within e4m3's rounding (2^-4 relative, or half its
    smallest subnormal step)."""
    counts = [100, 0, 300, 5]
    offs = torch.cumsum(torch.tensor(counts), 0).int()
    x = torch.randn(405 + 9, 70, dtype=torch.float64) * torch.logspace(-6, 6, 414)[:, None]
    x[:, 3] = 0  # a zero column
    x[130, 5] = 1e12  # a spike in expert 2's 31st row: only its block's (or expert's) scale of column 5 moves
    q, s, aoffs = fw.quant_expert_blocks_t(x, offs, scales)
    A = fw.capacity(414, 4)
    assert q.dtype == FP8 and q.shape == (70, A) and aoffs.tolist() == [128, 128, 512, 640]
    aligned = torch.zeros(A, 70, dtype=torch.float64)
    aligned[0:100], aligned[128:428], aligned[512:517] = x[0:100], x[100:400], x[400:405]
    if scales == "block":
        assert s.shape == (A // 128, 70)
        amax = aligned.view(-1, 128, 70).abs().amax(1)
        assert s[1, 5] > 1e5 * s[0, 5] and s[1, 5] > 1e5 * s[2, 5]
        s_A = s.repeat_interleave(128, 0)
    else:
        assert s.shape == (4, 70)
        amax = torch.stack([x[0:100].abs().amax(0), torch.zeros(70, dtype=torch.float64), x[100:400].abs().amax(0),
                            x[400:405].abs().amax(0)])
        assert s[2, 5] > 1e5 * s[2, 4] and s[0, 5] < 1e5 * s[0, 4]
        s_A = torch.ones(A, 70)
        s_A[0:128], s_A[128:512], s_A[512:640] = s[0], s[2], s[3]
    assert torch.equal(torch.log2(s), torch.log2(s).round()) and (amax / s.double() <= FP8_MAX).all()
    assert ((amax == 0) | (amax / s.double() > FP8_MAX / 2)).all() and (s[:, 3] == 1).all()
    deq = fw.dequant_t(q, s, aoffs, scales).double().t()
    err = (deq - aligned).abs()
    assert (err <= aligned.abs() * 2**-4 + s_A.double() * 2**-10).all()
    assert not deq[100:128].any() and not deq[428:512].any()  # the padding


@pytest.mark.parametrize("scales", fw.SCALES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_grouped_wgrad_fp8_against_fp64(case, scales):
    """The torch path: each expert's Σ aᵀ b over its rows, from the quantised operands, equals fp64's product
    of those dequantised operands (1e-6), and stays within FP8's error of fp64's product of the bf16 rows; an
    expert without rows gets zeros; rows past the last expert are not read."""
    counts = CASES[case]
    a, b, offs = _rows(counts, 48, 40, seed=len(case))
    at, sa, aoffs = fw.quant_expert_blocks_t(a, offs, scales)
    bt, sb, _ = fw.quant_expert_blocks_t(b, offs, scales)
    got = fw.grouped_wgrad_fp8(at, sa, bt, sb, aoffs, scales, out_dtype=torch.float32)
    exact = _fp64(fw.dequant_t(at, sa, aoffs, scales).t(), fw.dequant_t(bt, sb, aoffs, scales).t(), aoffs)
    want = _fp64(a, b, offs)
    for e, c in enumerate(counts):
        if c == 0:
            assert not got[e].any(), e
            continue
        assert float((got[e].double() - exact[e]).norm() / exact[e].norm()) < 1e-6, e
        assert float((got[e].double() - want[e]).norm() / want[e].norm()) < 0.08, e
    junk = at.clone()
    junk[:, int(aoffs[-1]):] = 448.0  # blocks past the experts' (e4m3's largest value): never read
    assert torch.equal(fw.grouped_wgrad_fp8(junk, sa, bt, sb, aoffs, scales, out_dtype=torch.float32), got)


_SCRIPT = r"""
import torch
from kernels import fp8_wgrad as fw
from test_fp8_wgrad import CASES, _rows
for scales in fw.SCALES:
    for name, counts in CASES.items():
        a, b, offs = _rows(counts, 48, 40)
        at, sa, aoffs = fw.quant_expert_blocks_t_torch(a, offs, scales)  # e4m3 by torch: the interpreter's is not RNE
        bt, sb, _ = fw.quant_expert_blocks_t_torch(b, offs, scales)
        assert fw._use_triton(at, aoffs)
        got = fw.grouped_wgrad_fp8(at, sa, bt, sb, aoffs, scales, out_dtype=torch.float32, config="tiny")
        want = fw.grouped_wgrad_fp8_torch(at, sa, bt, sb, aoffs, scales, out_dtype=torch.float32)
        err = float((got - want).norm() / want.norm())
        assert err < 1e-5, (scales, name, err)
        assert not got[[e for e, c in enumerate(counts) if c == 0]].any(), name
print("FP8-WGRAD-OK")
# the quantiser's kernel in its three modes, recorded and compiled for sm_90 (its e4m3 bytes are checked on a GPU)
x, offs = torch.randn(300, 70, dtype=torch.bfloat16), torch.tensor([100, 250, 300], dtype=torch.int32)
A = fw.capacity(300, 3)
for mode, s in ((0, torch.empty(A // 128, 70)), (1, torch.zeros(3, 70)), (2, torch.ones(3, 70))):
    fw._quant_expert_t_kernel[(A // 128, 2)](x, torch.empty(70, A, dtype=torch.uint8), s, offs, 3, 70, A, 70,
                                             MODE=mode, E_POW2=4, BLOCK_R=128, BLOCK_C=64, num_warps=4)
"""


@needs_cpu_interpreter
def test_kernels_in_interpreter():
    run_in_interpreter(_SCRIPT, "FP8-WGRAD-OK")


hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                            reason="needs a Hopper (sm90+) GPU")


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("scales", fw.SCALES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_quant_expert_blocks_t_kernel_equals_torch(case, scales):
    """Every byte and scale the GEMM reads (the experts' blocks), the kernel against the torch path."""
    counts = [c * 97 for c in CASES[case]]
    R = sum(counts) + 5
    x = (torch.randn(R, 2048, device="cuda") * torch.logspace(-4, 4, R, device="cuda")[:, None]).bfloat16()
    offs = torch.cumsum(torch.tensor(counts, device="cuda"), 0).int()
    q, s, aoffs = fw.quant_expert_blocks_t(x, offs, scales)
    rq, rs, raoffs = fw.quant_expert_blocks_t_torch(x.cpu(), offs.cpu(), scales)
    used = int(aoffs[-1])
    assert torch.equal(aoffs.cpu(), raoffs)
    assert torch.equal(s[:used // 128].cpu(), rs[:used // 128]) if scales == "block" else torch.equal(s.cpu(), rs)
    assert torch.equal(q[:, :used].view(torch.uint8).cpu(), rq[:, :used].view(torch.uint8))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("scales", fw.SCALES)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("config", sorted(c for c in fw.CONFIGS if c != "tiny"))
def test_grouped_wgrad_fp8_kernel_equals_torch_and_replays(case, config, scales):
    """The kernel against the torch path on the same e4m3 operands (fp32 out, within 1e-3: Hopper's FP8 MMA sums in
    less than fp32), and within FP8's error of the bf16 rows' fp64 product; an expert without rows zeros; a CUDA
    graph of the call replays to the same output."""
    from cuda_graphs import warm_up_and_capture

    counts = [c * 7 for c in CASES[case]]
    a, b, offs = _rows(counts, 1536, 2048)
    a, b, offs = a.cuda(), b.cuda(), offs.cuda()
    at, sa, aoffs = fw.quant_expert_blocks_t(a, offs, scales)
    bt, sb, _ = fw.quant_expert_blocks_t(b, offs, scales)
    run = lambda dtype=torch.bfloat16: fw.grouped_wgrad_fp8(at, sa, bt, sb, aoffs, scales, dtype, config)
    got = run(torch.float32)
    want = fw.grouped_wgrad_fp8_torch(at.cpu(), sa.cpu(), bt.cpu(), sb.cpu(), aoffs.cpu(), scales, torch.float32)
    assert float((got.cpu() - want).norm() / want.norm()) < 1e-3
    exact = _fp64(a.cpu(), b.cpu(), offs.cpu())
    assert float((got.cpu().double() - exact).norm() / exact.norm()) < 0.08
    assert not got[[e for e, c in enumerate(counts) if c == 0]].any()
    graph, out = warm_up_and_capture(run)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, run())
