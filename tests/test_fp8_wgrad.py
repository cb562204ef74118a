"""The experts' FP8 weight-gradient pieces (kernels/fp8_wgrad.py): the per-expert scales and the transposed
requantiser against their definitions, the grouped GEMM against fp64 — random row counts, every row to one expert,
empty experts, experts whose rows start and end inside a 128-row block, one hot expert, zero rows — and, on CPU, the
GEMM's Triton kernel in the interpreter (compiled for sm_90 too, the other two kernels as well); on a Hopper GPU
every kernel against the torch path and a CUDA graph."""

import pytest
import torch

from kernels import fp8_wgrad as fw
from kernels.fp8 import FP8, quant_rows, quant_rows_torch
from test_kernels import needs_cpu_interpreter, run_in_interpreter
from conftest import hopper

CASES = {  # row counts per expert
    "random": [37, 5, 200, 64, 1, 90],
    "one_expert": [0, 0, 300, 0],
    "empty_ends": [0, 17, 0, 0, 149, 0],
    "mid_block": [100, 56, 130, 3],  # boundaries at 100, 156, 286: inside blocks
    "one_hot": [20, 900, 20, 20],
    "single": [512],  # one expert (a dense feed-forward's): a plain GEMM over every row
}


def _rows(counts, P, Q, seed=0, device="cpu"):
    """a [R, P], b [R, Q] bf16 (R = Σ counts + 9 rows past them), rows and columns of very different sizes, a few
    rows zero (ignored tokens' gradients)."""
    g = torch.Generator().manual_seed(seed)
    R = sum(counts) + 9
    a = torch.randn(R, P, generator=g) * torch.logspace(-2, 2, R)[:, None] * torch.logspace(-1, 1, P)[None, :]
    b = torch.randn(R, Q, generator=g) * torch.logspace(1, -1, R)[:, None]
    b[::7] = 0
    offs = torch.cumsum(torch.tensor(counts), 0).int()
    return a.bfloat16().to(device), b.bfloat16().to(device), offs.to(device)


def _fp64(a, b, offs):
    ends = [0] + offs.tolist()
    return torch.stack([a[r0:r1].double().t() @ b[r0:r1].double() for r0, r1 in zip(ends[:-1], ends[1:])])


def test_expert_scales_are_the_largest_nonzero_rows():
    """s_e = the largest scale of expert e's nonzero rows, 0 for an expert without one; a zero row (scale 1) does not
    count; rows past the experts' are not read."""
    x = torch.randn(40, 24) * 1e-4
    x[3] *= 100  # expert 0's largest row
    x[10:20] = 0  # expert 2: zero rows only
    x[25] = 0  # a zero row among expert 3's tiny ones
    q, s = quant_rows_torch(x)
    s[33:] = float("nan")  # past the experts' rows
    offs = torch.tensor([10, 10, 20, 33], dtype=torch.int32)
    got = fw.expert_scales(q, s, offs)
    assert s[25] == 1 and s[12] == 1
    assert got.tolist() == [float(s[:10].max()), 0.0, 0.0, float(torch.cat([s[20:25], s[26:33]]).max())]
    assert got[0] == s[3] and got[3] < 2**-10


def test_capacity_bounds_every_routing_and_is_exact_for_one_expert():
    g = torch.Generator().manual_seed(0)
    for E in (1, 2, 7, 64):
        for _ in range(50):
            counts = torch.randint(0, 400, (E,), generator=g)
            counts[torch.randint(0, E, (1,), generator=g)] = 0
            R = int(counts.sum())
            end = int(fw.aligned_offsets(torch.cumsum(counts, 0).int())[-1])
            assert end <= fw.capacity(R, E) and fw.capacity(R, E) % 128 == 0
            assert E > 1 or end == fw.capacity(R, E)


def test_requant_expert_t_is_its_definition():
    """Each expert's rows start on a 128-row block, padded with zeros to the next; dequantised at the expert's scale
    they equal the rows' own q · s exactly where that stays in e4m3's normal range, within half its smallest
    subnormal step elsewhere; a zero row stays zero."""
    counts = [100, 0, 300, 5]
    offs = torch.cumsum(torch.tensor(counts), 0).int()
    x = torch.randn(405 + 9, 70, dtype=torch.float64) * torch.logspace(-6, 2, 414)[:, None]
    x[150] = 0
    q, s = quant_rows_torch(x)
    qt, s_E, aoffs = fw.requant_expert_t(q, s, offs)
    A = fw.capacity(414, 4)
    assert qt.dtype == FP8 and qt.shape == (70, A) and aoffs.tolist() == [128, 128, 512, 640]
    assert s[150] == 1 and s_E[1] == 0 and s_E[2] == torch.cat([s[100:150], s[151:400]]).max()
    assert torch.equal(torch.log2(s_E[s_E > 0]).round(), torch.log2(s_E[s_E > 0]))
    rows = q.double() * s.double()[:, None]
    aligned = torch.zeros(A, 70, dtype=torch.float64)
    aligned[0:100], aligned[128:428], aligned[512:517] = rows[0:100], rows[100:400], rows[400:405]
    s_A = torch.zeros(A, 1, dtype=torch.float64)
    s_A[0:128], s_A[128:512], s_A[512:640] = s_E[0], s_E[2], s_E[3]
    deq = fw.dequant_t(qt, s_E, aoffs).double().t()
    normal = aligned.abs() >= s_A * 2**-6
    assert torch.equal(deq[normal], aligned[normal]) and normal.sum() > 0.5 * aligned.count_nonzero()
    assert ((deq - aligned).abs()[~normal] <= (s_A * 2**-10).expand(-1, 70)[~normal]).all()
    assert not deq[100:128].any() and not deq[428:512].any() and not deq[128 + 50].any()


@pytest.mark.parametrize("case", sorted(CASES))
def test_grouped_wgrad_fp8_against_fp64(case):
    """The torch path: each expert's Σ aᵀ b over its rows, from the requantised operands, equals fp64's product
    of those dequantised operands (1e-6), and stays within FP8's error of fp64's product of the bf16 rows; an
    expert without rows gets zeros; rows past the last expert are not read."""
    counts = CASES[case]
    a, b, offs = _rows(counts, 48, 40, seed=len(case))
    at, sa, aoffs = fw.requant_expert_t(*quant_rows(a), offs)
    bt, sb, _ = fw.requant_expert_t(*quant_rows(b), offs)
    got = fw.grouped_wgrad_fp8(at, sa, bt, sb, aoffs, out_dtype=torch.float32)
    exact = _fp64(fw.dequant_t(at, sa, aoffs).t(), fw.dequant_t(bt, sb, aoffs).t(), aoffs)
    want = _fp64(a, b, offs)
    for e, c in enumerate(counts):
        if c == 0:
            assert not got[e].any(), e
            continue
        assert float((got[e].double() - exact[e]).norm() / exact[e].norm()) < 1e-6, e
        assert float((got[e].double() - want[e]).norm() / want[e].norm()) < 0.08, e
    junk = at.clone()
    junk[:, int(aoffs[-1]):] = 448.0  # blocks past the experts' (e4m3's largest value): never read
    assert torch.equal(fw.grouped_wgrad_fp8(junk, sa, bt, sb, aoffs, out_dtype=torch.float32), got)


_SCRIPT = r"""
import torch
from kernels import fp8_wgrad as fw
from kernels.fp8 import quant_rows_torch
from test_fp8_wgrad import CASES, _rows
for name, counts in CASES.items():
    a, b, offs = _rows(counts, 48, 40)
    at, sa, aoffs = fw.requant_expert_t_torch(*quant_rows_torch(a), offs)  # e4m3 by torch: the interpreter's is not RNE
    bt, sb, _ = fw.requant_expert_t_torch(*quant_rows_torch(b), offs)
    assert fw._use_triton(at, aoffs)
    want = fw.grouped_wgrad_fp8_torch(at, sa, bt, sb, aoffs, out_dtype=torch.float32)
    for config in ("tiny", "tinyp"):  # tinyp: the persistent form, operands through TMA
        got = fw.grouped_wgrad_fp8(at, sa, bt, sb, aoffs, out_dtype=torch.float32, config=config)
        err = float((got - want).norm() / want.norm())
        assert err < 1e-5, (name, config, err)
        assert not got[[e for e, c in enumerate(counts) if c == 0]].any(), (name, config)
print("FP8-WGRAD-OK")
# the scale and requantiser kernels, recorded and compiled for sm_90 (their results are checked on a GPU)
x = torch.randn(300, 70)
x[7] = 0  # a zero row (scale 1)
x[8] = -0.0  # a zero row of negative zeros (e4m3 byte 0x80)
x[120] *= 300 / x[120].abs().max()  # a nonzero row of scale 1: expert 1's largest
x[250:] = 0  # expert 2: zero rows only
x[95] *= 16  # expert 0's largest, in its last block
q, s = quant_rows_torch(x)
assert s[7] == 1 and s[8] == 1 and s[120] == 1 and (s[9:120] < 1).all()
offs = torch.tensor([100, 250, 300], dtype=torch.int32)
A, s_E = fw.capacity(300, 3), torch.zeros(3)
aoffs = torch.zeros(3, dtype=torch.int32)
fw._expert_scale_kernel[(3, 2)](q.view(torch.uint8), s, s_E, aoffs, offs, 3, 70, 70, E_POW2=4, BLOCK_R=32,
                                BLOCK_C=16, ALIGN=128, num_warps=4)
assert torch.equal(aoffs, fw.aligned_offsets(offs)) and aoffs.tolist() == [128, 384, 512]
outs = []
for row_blocks, col_tiles in ((1, 1), (2, 2), (4, 1)):  # one tile a program; programs looping over blocks, tiles
    out = torch.zeros(70, A, dtype=torch.uint8)
    fw._requant_t_kernel[(-(-A // (128 * row_blocks)), -(-70 // (32 * col_tiles)))](
        q, s, s_E, out, offs, 3, 70, A, 70, E_POW2=4, BLOCK_R=128, BLOCK_C=32, ROW_BLOCKS=row_blocks,
        COL_TILES=col_tiles, ZERO_TAIL=False, num_warps=4)
    outs.append(out)
assert torch.equal(s_E, fw.expert_scales_torch(q, s, offs)) and s_E[1] == 1 and s_E[2] == 0 and s_E[0] == s[95]
assert all(torch.equal(o, outs[0]) for o in outs[1:])
rq = fw.requant_expert_t_torch(q, s, offs)[0]  # torch's e4m3 is RNE, the interpreter's not: equal within one step
deq = lambda b: fw.dequant_t(b.view(torch.float8_e4m3fn), s_E, fw.aligned_offsets(offs))
got, want = deq(outs[0]), deq(rq.view(torch.uint8))
assert ((got - want).abs() <= want.abs() / 8 + 2**-9 * s_E.max()).all()
assert deq(outs[0]).count_nonzero() > 0.9 * q.float().count_nonzero()
one = torch.tensor([100], dtype=torch.int32)  # one expert: its blocks as with three, zeros past them
tail = torch.full((70, fw.capacity(300, 1)), 0x7F, dtype=torch.uint8)
fw._requant_t_kernel[(3, 3)](q, s, s_E[:1], tail, one, 1, 70, tail.shape[1], 70, E_POW2=1, BLOCK_R=128, BLOCK_C=32,
                            ROW_BLOCKS=1, COL_TILES=1, ZERO_TAIL=True, num_warps=4)
assert torch.equal(tail[:, :100], outs[0][:, :100]) and not tail[:, 128:].any()
"""


@needs_cpu_interpreter
def test_kernels_in_interpreter():
    run_in_interpreter(_SCRIPT, "FP8-WGRAD-OK")


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("tile", sorted(fw.REQUANT_TILES))
def test_requant_kernels_equal_torch(case, tile):
    """Every scale and every byte the GEMM reads (the experts' blocks), the kernels against the torch path, from the
    Triton row quantiser's rows (zero rows among them), at every requantiser tile."""
    counts = [c * 97 for c in CASES[case]]
    R = sum(counts) + 5
    x = (torch.randn(R, 2048, device="cuda") * torch.logspace(-4, 4, R, device="cuda")[:, None]).bfloat16()
    x[::5] = 0
    offs = torch.cumsum(torch.tensor(counts, device="cuda"), 0).int()
    q, s = quant_rows(x)
    qt, s_E, aoffs = fw.requant_expert_t(q, s, offs, tile)
    rq, rs, raoffs = fw.requant_expert_t_torch(q.cpu(), s.cpu(), offs.cpu())
    used = int(aoffs[-1])
    assert torch.equal(aoffs.cpu(), raoffs) and torch.equal(s_E.cpu(), rs)
    assert torch.equal(qt[:, :used].view(torch.uint8).cpu(), rq[:, :used].view(torch.uint8))
    if len(counts) == 1:  # one expert: its plain GEMM reads every block, so those past its rows are zeros
        assert not qt[:, used:].view(torch.uint8).any()


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("tile", sorted(fw.SCALE_TILES))
def test_scale_tiles_equal_torch(tile):
    """Each scale tile's scales equal the torch path's, over experts with zero rows only, no rows, a hot one."""
    counts = [0, 3000, 5, 0, 700, 1, 128, 129]
    x = (torch.randn(sum(counts), 1408, device="cuda") * torch.logspace(-4, 4, sum(counts), device="cuda")[:, None])
    x[::3] = 0
    x[3005:3010] = 0  # expert 4: zero rows first, then (row 3100) a nonzero row of scale 1
    x[3100] *= 448 / x[3100].abs().max()
    q, s = quant_rows(x.bfloat16())
    offs = torch.cumsum(torch.tensor(counts, device="cuda"), 0).int()
    assert torch.equal(fw.expert_scales(q, s, offs, tile).cpu(), fw.expert_scales_torch(q.cpu(), s.cpu(), offs.cpu()))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("config", sorted(c for c in fw.CONFIGS if not c.startswith("tiny")))
def test_grouped_wgrad_fp8_kernel_equals_torch_and_replays(case, config):
    """The kernel against the torch path on the same e4m3 operands (fp32 out, within 1e-3: Hopper's FP8 MMA sums in
    less than fp32), and within FP8's error of the bf16 rows' fp64 product; an expert without rows zeros; a CUDA
    graph of the requantisers and the call replays to the same output."""
    from cuda_graphs import warm_up_and_capture

    counts = [c * 7 for c in CASES[case]]
    a, b, offs = _rows(counts, 1536, 2048, device="cuda")
    qa, qb = quant_rows(a), quant_rows(b)
    at, sa, aoffs = fw.requant_expert_t(*qa, offs)
    bt, sb, _ = fw.requant_expert_t(*qb, offs)
    got = fw.grouped_wgrad_fp8(at, sa, bt, sb, aoffs, torch.float32, config)
    want = fw.grouped_wgrad_fp8_torch(at.cpu(), sa.cpu(), bt.cpu(), sb.cpu(), aoffs.cpu(), torch.float32)
    assert float((got.cpu() - want).norm() / want.norm()) < 1e-3
    exact = _fp64(a.cpu(), b.cpu(), offs.cpu())
    assert float((got.cpu().double() - exact).norm() / exact.norm()) < 0.08
    assert not got[[e for e, c in enumerate(counts) if c == 0]].any()
    run = lambda: fw.grouped_wgrad_fp8(*fw.requant_expert_t(*qa, offs)[:2], *fw.requant_expert_t(*qb, offs),
                                       out_dtype=torch.bfloat16, config=config)
    graph, out = warm_up_and_capture(run)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, run())
