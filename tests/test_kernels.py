"""Row gather-reduce kernels and the differentiable row ops, against naive loops (fp64)."""

import os
import subprocess
import sys
from functools import partial

import pytest
import torch

from background import Runs, selected
from components.moe_echo.row_ops import gather_rows, weighted_combine
from conftest import ROOT
from kernels import moe_rows
from run_env import run_env


def _perm_case(T, K, D, dtype=torch.float64, seed=0, hot=False):
    g = torch.Generator().manual_seed(seed)
    if hot:  # every token's rows packed at the front; still a permutation
        idx = torch.arange(T * K).view(T, K)
    else:
        idx = torch.randperm(T * K, generator=g).view(T, K)
    y = torch.randn(T * K, D, generator=g, dtype=dtype)
    w = torch.rand(T, K, generator=g, dtype=dtype)
    gr = torch.randn(T, D, generator=g, dtype=dtype)
    return y, w, idx, gr


def _naive(y, w, idx, gr):
    T, K = idx.shape
    out = torch.zeros(T, y.shape[1], dtype=y.dtype)
    gy = torch.zeros_like(y)
    gw = torch.zeros_like(w)
    for t in range(T):
        for k in range(K):
            r = idx[t, k]
            out[t] += w[t, k] * y[r]
            gy[r] = w[t, k] * gr[t]
            gw[t, k] = (gr[t] * y[r]).sum()
    return out, gy, gw


@pytest.mark.parametrize("hot", [False, True])
def test_torch_paths_match_naive(hot):
    y, w, idx, gr = _perm_case(7, 3, 5, hot=hot)
    out, gy, gw = _naive(y, w, idx, gr)
    torch.testing.assert_close(moe_rows.gather_sum_torch(y, idx, w), out, rtol=1e-14, atol=1e-14)
    gy2, gw2 = moe_rows.combine_backward_torch(gr, y, w, idx)
    torch.testing.assert_close(gy2, gy, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(gw2, gw, rtol=1e-14, atol=1e-14)


def test_combine_backward_zero_fills_unused_rows():
    y, w, idx, gr = _perm_case(4, 2, 3)
    y_pad = torch.cat([y, torch.randn(5, 3, dtype=y.dtype)])  # 5 padding rows
    gy, _ = moe_rows.combine_backward_torch(gr, y_pad, w, idx)
    assert gy[8:].abs().max() == 0


def test_given_buffers_keep_the_rows_no_slot_writes():
    """combine_backward(grad_y_out=...) writes the rows some (t, k) maps to and leaves the rest (the
    nvlink dispatcher's shared gradient buffer); gather_sum(out=...) fills its buffer (torch path)."""
    y, w, idx, gr = _perm_case(6, 3, 5)
    idx[1, 2] = -1
    ref_gy, ref_gw = moe_rows.combine_backward_torch(gr, y, w, idx)
    gy_out = torch.full((20, 5), 7.0, dtype=torch.float64)
    gy, gw = moe_rows.combine_backward(gr, torch.cat([y, y[:2]]), w, idx, grad_y_out=gy_out)
    hit = torch.zeros(20, dtype=torch.bool)
    hit[idx[idx >= 0]] = True
    assert gy is gy_out and bool((gy[~hit] == 7.0).all()) and int(hit.sum()) == 17
    torch.testing.assert_close(gy[:18][hit[:18]], ref_gy[hit[:18]], rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(gw, ref_gw, rtol=1e-14, atol=1e-14)
    out = torch.full((6, 5), 7.0, dtype=torch.float64)
    assert moe_rows.gather_sum(y, idx, w, out=out) is out
    torch.testing.assert_close(out, moe_rows.gather_sum_torch(y, idx, w), rtol=1e-14, atol=1e-14)


def test_row_ops_gradcheck():
    y, w, idx, _ = _perm_case(5, 3, 4)
    token_of_row = torch.empty(15, dtype=torch.long).scatter_(0, idx.reshape(-1), torch.arange(5).repeat_interleave(3))
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: gather_rows(x, token_of_row, idx), (x,))
    y.requires_grad_()
    w.requires_grad_()
    assert torch.autograd.gradcheck(lambda y, w: weighted_combine(y, w, idx), (y, w))


_INTERPRET_SCRIPT = r"""
import torch
from kernels import moe_rows
for T, K, D, hot in [(6, 3, 40, False), (5, 2, 1030, False), (4, 4, 8, True), (5, 3, 16, "drop")]:
    g = torch.Generator().manual_seed(T)
    idx = torch.arange(T * K).view(T, K) if hot is True else torch.randperm(T * K, generator=g).view(T, K)
    if hot == "drop": idx[0, 1] = -1; idx[3, 2] = -1
    y = torch.randn(T * K, D, generator=g); w = torch.rand(T, K, generator=g); gr = torch.randn(T, D, generator=g)
    assert moe_rows._use_triton(y)
    torch.testing.assert_close(moe_rows.gather_sum(y, idx, w), moe_rows.gather_sum_torch(y, idx, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(moe_rows.gather_sum(y, idx), moe_rows.gather_sum_torch(y, idx), rtol=1e-5, atol=1e-5)
    for bt, progs in [(2, None), (4, 1), (8, 2)]:  # blocks of rows, a persistent grid smaller than the blocks
        torch.testing.assert_close(moe_rows.gather_sum(y, idx, w, programs=progs, block_t=bt),
                                   moe_rows.gather_sum_torch(y, idx, w), rtol=1e-5, atol=1e-5)
    a, b = moe_rows.combine_backward(gr, y, w, idx), moe_rows.combine_backward_torch(gr, y, w, idx)
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=1e-4)
    # written into given buffers: every output row of gather_sum; only the referenced rows of grad_y
    out = torch.full((T, D), 7.0)
    assert moe_rows.gather_sum(y, idx, w, out=out) is out
    torch.testing.assert_close(out, moe_rows.gather_sum_torch(y, idx, w), rtol=1e-5, atol=1e-5)
    gy_out = torch.full((T * K + 2, D), 7.0)
    gy, gw = moe_rows.combine_backward(gr, torch.cat([y, y[:2]]), w, idx, grad_y_out=gy_out)
    hit = torch.zeros(T * K + 2, dtype=torch.bool); hit[idx[idx >= 0]] = True
    torch.testing.assert_close(gy[hit], b[0][hit[:T * K]], rtol=1e-5, atol=1e-5)
    assert gy is gy_out and bool((gy[~hit] == 7.0).all())
    torch.testing.assert_close(gw, b[1], rtol=1e-5, atol=1e-4)
print("INTERPRET-OK")
"""


needs_cpu_interpreter = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CUDA present: the real kernels are tested instead (gpu tests)")


def _interpret(script: str) -> subprocess.CompletedProcess:
    env = run_env(TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    return subprocess.run([sys.executable, "-c", "import sm90_compile\n" + script], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)


def run_in_interpreter(script: str, marker: str, done: subprocess.CompletedProcess | None = None) -> str:
    """Run ``script`` in a fresh process with TRITON_INTERPRET=1 (kernels on CPU tensors), or take
    ``done``, its finished run; its stdout. Every kernel it launched must also compile for sm_90
    (``sm90_compile``): the interpreter alone accepts code the compiler rejects."""
    pytest.importorskip("triton")
    p = _interpret(script) if done is None else done
    assert marker in p.stdout, p.stderr[-3000:]
    assert p.returncode == 0 and "SM90-COMPILED" in p.stderr, p.stderr[-3000:]
    return p.stdout


@pytest.fixture(scope="module")
def interpreted(request):
    """This module's interpreter scripts, started together, the longest first (each uses one core)."""
    scripts = {"test_planner_kernel_equals_torch_loop_in_interpreter": _PLANNER_SCRIPT,
               "test_fill_kernel_equals_torch_in_interpreter": _FILL_SCRIPT,
               "test_triton_kernels_in_interpreter": _INTERPRET_SCRIPT,
               "test_swiglu_kernel_in_interpreter": _SWIGLU_SCRIPT}
    runs = Runs({test: partial(_interpret, script) for test, script in scripts.items() if selected(request, test)})
    yield runs
    runs.close()


@needs_cpu_interpreter
def test_triton_kernels_in_interpreter(interpreted, request):
    run_in_interpreter(_INTERPRET_SCRIPT, "INTERPRET-OK", interpreted[request.node.originalname])


@pytest.mark.gpu
@pytest.mark.parametrize("T, K, D", [(4096, 8, 2048), (1000, 6, 7168), (333, 1, 100)])
def test_triton_kernels_on_gpu_bf16(T, K, D):
    g = torch.Generator(device="cuda").manual_seed(0)
    idx = torch.randperm(T * K, device="cuda", generator=g).view(T, K)
    y = torch.randn(T * K, D, device="cuda", generator=g).bfloat16()
    w = torch.rand(T, K, device="cuda", generator=g)
    gr = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    ref = moe_rows.gather_sum_torch(y.double(), idx, w.double())
    for bt, progs in [(None, None), (2, None), (4, 132), (8, 64)]:
        out = moe_rows.gather_sum(y, idx, w, programs=progs, block_t=bt)
        assert ((out.double() - ref).norm() / ref.norm()) < 1e-2, (bt, progs)
    gy, gw = moe_rows.combine_backward(gr, y, w, idx)
    gy_ref, gw_ref = moe_rows.combine_backward_torch(gr.double(), y.double(), w.double(), idx)
    assert ((gy.double() - gy_ref).norm() / gy_ref.norm()) < 1e-2
    assert ((gw.double() - gw_ref).norm() / gw_ref.norm()) < 1e-3


_SWIGLU_SCRIPT = r"""
import torch
import torch.nn.functional as F
from kernels.swiglu import swiglu
a = torch.randn(3, 1000, requires_grad=True); b = torch.randn(3, 1000, requires_grad=True); g = torch.randn(3, 1000)
h = swiglu(a, b); h.backward(g)
a2 = a.detach().clone().requires_grad_(); b2 = b.detach().clone().requires_grad_()
h2 = F.silu(a2) * b2; h2.backward(g)
torch.testing.assert_close(h, h2); torch.testing.assert_close(a.grad, a2.grad); torch.testing.assert_close(b.grad, b2.grad)
assert type(h.grad_fn).__name__ == "_SwiGLUBackward", type(h.grad_fn)
# bounded to the used rows: rows below the bound equal the reference, the padding rows (NaN here) are never read
for used in (0, 1, 7, 64):
    a3 = torch.randn(64, 37); b3 = torch.randn(64, 37); g3 = torch.randn(64, 37)
    for t in (a3, b3, g3):
        t[used:] = float("nan")
    rows = torch.tensor([used], dtype=torch.int32)
    a3.requires_grad_(); b3.requires_grad_()
    h3 = swiglu(a3, b3, rows); h3.backward(g3)
    a4 = a3.detach()[:used].clone().requires_grad_(); b4 = b3.detach()[:used].clone().requires_grad_()
    (F.silu(a4) * b4).backward(g3[:used])
    torch.testing.assert_close(h3[:used], (F.silu(a4) * b4).detach())
    torch.testing.assert_close(a3.grad[:used], a4.grad); torch.testing.assert_close(b3.grad[:used], b4.grad)
# [N, 2H] = [gate | up] in one tensor (rows possibly strided), its gradient one [N, 2H] tensor
from kernels.swiglu import swiglu13
for N, H, used in ((37, 300, 37), (64, 37, 7), (5, 1, 0)):
    big = torch.randn(N, 2 * H + 3)  # a row stride larger than 2H
    ab = big[:, :2 * H]; g = torch.randn(N, H)
    ab[used:] = float("nan"); g[used:] = float("nan")
    ab.requires_grad_()
    h = swiglu13(ab, torch.tensor([used], dtype=torch.int32)); h.backward(g)
    assert type(h.grad_fn).__name__ == "_SwiGLU13Backward", type(h.grad_fn)
    ref = ab.detach()[:used].clone().requires_grad_()
    h_ref = F.silu(ref[:, :H]) * ref[:, H:]; h_ref.backward(g[:used])
    torch.testing.assert_close(h[:used], h_ref.detach()); torch.testing.assert_close(ab.grad[:used], ref.grad)
ab = torch.randn(9, 16, requires_grad=True); g = torch.randn(9, 8)  # unbounded: every row
swiglu13(ab).backward(g)
ab2 = ab.detach().clone().requires_grad_(); (F.silu(ab2[:, :8]) * ab2[:, 8:]).backward(g)
torch.testing.assert_close(ab.grad, ab2.grad)
print("SWIGLU-OK")
"""


@needs_cpu_interpreter
def test_swiglu_kernel_in_interpreter(interpreted, request):
    run_in_interpreter(_SWIGLU_SCRIPT, "SWIGLU-OK", interpreted[request.node.originalname])


@pytest.mark.gpu
def test_swiglu_kernel_on_gpu_bf16():
    from kernels.swiglu import swiglu

    a = torch.randn(4096, 1408, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn_like(a, requires_grad=True)
    g = torch.randn_like(a)
    swiglu(a, b).backward(g)
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    (torch.nn.functional.silu(a64) * b64).backward(g.double())
    for got, want in ((a.grad, a64.grad), (b.grad, b64.grad)):
        assert ((got.double() - want).norm() / want.norm()) < 1e-2
    used = 3000  # bounded to the used rows: padding rows (NaN) never read, results on the used rows unchanged
    a2, b2, g2 = (t.detach().clone() for t in (a, b, g))
    for t in (a2, b2, g2):
        t[used:] = float("nan")
    a2.requires_grad_(); b2.requires_grad_()
    h2 = swiglu(a2, b2, torch.tensor([used], device="cuda", dtype=torch.int32))
    h2.backward(g2)
    assert torch.equal(h2[:used], swiglu(a, b)[:used])
    assert torch.equal(a2.grad[:used], a.grad[:used]) and torch.equal(b2.grad[:used], b.grad[:used])
    # [gate | up] in one tensor: the same values and gradients as the two-tensor kernels
    from kernels.swiglu import swiglu13

    ab = torch.cat([a.detach(), b.detach()], dim=1).requires_grad_()
    h13 = swiglu13(ab, torch.tensor([used], device="cuda", dtype=torch.int32))
    h13.backward(g)
    assert torch.equal(h13[:used], swiglu(a, b)[:used])
    assert torch.equal(ab.grad[:used], torch.cat([a.grad, b.grad], dim=1)[:used])


def test_missing_slots_contribute_nothing_and_get_no_gradient():
    y, w, idx, gr = _perm_case(6, 3, 4)
    idx = idx.clone()
    idx[1, 2] = -1
    idx[4, 0] = -1
    out = moe_rows.gather_sum_torch(y, idx, w)
    keep = (idx >= 0).to(y.dtype)
    ref, _, _ = _naive(y, w * keep, idx.clamp_min(0), gr)
    torch.testing.assert_close(out, ref, rtol=1e-14, atol=1e-14)
    gy, gw = moe_rows.combine_backward_torch(gr, y, w, idx)
    assert gw[1, 2] == 0 and gw[4, 0] == 0
    used = torch.zeros(len(y), dtype=torch.bool)
    used[idx[idx >= 0]] = True
    assert gy[~used].abs().max() == 0 and gy[used].abs().min() > 0


def planner_cases(big: bool):
    """(counts_RE, S, rule) for the kernel-vs-reference checks: random, heavy-tailed and adversarial
    loads (all to one expert, none, balanced, hot experts packed on rank 0: the optimum then lies
    above the mean and the search's second round runs)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(2, 64, 2), (8, 256, 2), (16, 256, 1), (64, 256, 1), (64, 256, 2), (64, 256, 4)] if big else \
        [(2, 8, 1), (4, 16, 2), (8, 64, 2)]
    cases = []
    for R, E, S in shapes:
        counts = torch.randint(0, 50, (R, E), generator=g)
        counts[:, torch.randint(0, E, (3,), generator=g)] += 3000
        cases += [(counts, S, rule) for rule in (("fill", "greedy", "bestfit") if big else ("fill", "bestfit"))]
        packed = torch.zeros(R, E, dtype=torch.int64)
        packed[0] = (torch.randn(E, generator=g) * 1.5).exp().mul(1000).long().sort(descending=True).values
        one = torch.zeros(R, E, dtype=torch.int64)
        one[:, E // 2] = 777
        balanced = torch.zeros(R, E, dtype=torch.int64)
        balanced[:, ::E // R] = 500
        cases += [(packed, S, "fill"), (packed, 1, "fill"), (one, S, "fill"), (balanced, S, "fill")]
    cases.append((torch.zeros(R, E, dtype=torch.int64), S, "fill"))
    return cases


_PLANNER_SCRIPT = r"""
import sys, torch
sys.path.insert(0, "tests")
from test_kernels import planner_cases
from components.moe_echo.planner import plan_echo
from kernels.echo_plan import can_use_kernel
for counts, S, rule in planner_cases(big=False):
    assert can_use_kernel(counts)
    ref = plan_echo(counts, S, rule, kernel=False)
    got = plan_echo(counts, S, rule, kernel=True)
    for a, b in zip((ref.slot_expert_G, ref.quota_RG, ref.load_after_R), (got.slot_expert_G, got.quota_RG, got.load_after_R)):
        assert torch.equal(a, b), (counts.shape, S, rule, a, b)
print("PLANNER-OK")
"""


@needs_cpu_interpreter
def test_planner_kernel_equals_torch_loop_in_interpreter(interpreted, request):
    run_in_interpreter(_PLANNER_SCRIPT, "PLANNER-OK", interpreted[request.node.originalname])


def fill_cases():
    """(counts_RE, S, B) for the fill kernel against its torch reference: Zipf loads (drifting, as
    benchmarks/planner.py), all tokens to one expert, idle experts, one hot expert per rank (equal
    loads: nothing moves, the loop stops at step 0), hot experts packed on rank 0 (round 2 runs),
    equal loads and caps (ties), no tokens; loads scaled past 2**25 and 2**29 take the kernel's
    int32-value/int64-key and int64 arithmetic."""
    from benchmarks.planner import drifting_counts

    g = torch.Generator().manual_seed(0)

    def make(kind, R, E):
        e = E // R
        counts = torch.zeros(R, E, dtype=torch.int64)
        if kind == "zipf":
            counts = drifting_counts(R, E, 1, seed=R, tokens=64, k=min(4, E))[0]
        elif kind == "one":
            counts[:, E // 2 + 1] = 100
        elif kind == "idle":
            counts[:, ::2] = torch.arange(E // 2) ** 2 + 1
        elif kind == "hot":
            counts[:, ::e] = 700
            counts += 1
        elif kind == "packed":
            counts[0] = (torch.randn(E, generator=g) * 1.5).exp().mul(100).long().sort(descending=True).values
        elif kind == "ties":
            counts[:] = 7
            counts[:, torch.randperm(E, generator=g)[:max(2, E // 4)]] = 300
        return counts

    plan = [((2, 8, 1), ["zipf", "one", "hot", "ties", "none"]), ((3, 12, 3), ["zipf", "idle", "packed"]),
            ((4, 16, 2), ["zipf", "ties", "one"]), ((8, 64, 2), ["zipf", "idle", "hot", "packed"]),
            ((16, 256, 1), ["zipf", "hot", "ties"])]
    cases = [(make(kind, R, E), S, 4) for (R, E, S), kinds in plan for kind in kinds]
    cases += [(make("packed", 8, 64), 1, 4), (make("zipf", 4, 16) << 20, 2, 4), (make("zipf", 4, 16) << 26, 2, 3),
              (make("packed", 8, 64) << 24, 1, 3)]
    cases += [(make("zipf", 64, 256), 2, 3), (make("packed", 64, 256), 1, 2)]  # EP = 64
    return cases


_FILL_SCRIPT = r"""
import sys, torch
sys.path.insert(0, "tests")
from test_kernels import fill_cases
from components.moe_echo.planner import _fill_search
from kernels.echo_plan import fill_search
seen = set()
for counts, S, B in fill_cases():
    R, E = counts.shape
    L_E = counts.sum(0)
    load_R = L_E.view(R, -1).sum(1)
    ref = _fill_search(L_E, load_R, S, B)
    ref += (torch.zeros_like(L_E).scatter_add_(0, ref[0].clamp(min=0), ref[1]),)
    got = fill_search(L_E, load_R, S, B)
    for name, a, b in zip(("slot_expert", "slot_amount", "slot_start", "load_after", "moved"), ref, got):
        assert torch.equal(a, b), (tuple(counts.shape), S, B, name, a, b)
    small_vb = 29 - max((E - 1).bit_length(), max(1, (R - 1).bit_length()) + S.bit_length())
    hi = int(load_R.max())
    seen.add("int32 keys" if hi < 2 ** small_vb else "int64 keys" if hi < 2 ** 29 else "int64 values")
    if ref[3].max() > (load_R.sum() + R - 1) // R:  # no round-1 target reached ceil(mean)
        seen.add("round 2")
    if hi > 0 and (ref[0] == -1).all():
        seen.add("nothing moves")
    if (ref[2] > 0).any():
        seen.add("split expert")
print("FILL-OK", sorted(seen))
"""


@needs_cpu_interpreter
def test_fill_kernel_equals_torch_in_interpreter(interpreted, request):
    """fill_search (the Triton kernels) equals the torch reference in every output, and the cases take
    every arithmetic tier, both search rounds, the stop at step 0 and experts split over slots."""
    out = run_in_interpreter(_FILL_SCRIPT, "FILL-OK", interpreted[request.node.originalname])
    for path in ("int32 keys", "int64 keys", "int64 values", "round 2", "nothing moves", "split expert"):
        assert repr(path) in out, (path, out)


@pytest.mark.gpu
def test_fill_kernel_equals_torch_on_gpu():
    from components.moe_echo.planner import _fill_search
    from kernels.echo_plan import fill_search

    for counts, S, B in fill_cases() + [(c, S, 16) for c, S, rule in planner_cases(big=True) if rule == "fill"]:
        R = counts.shape[0]
        L_E = counts.sum(0)
        load_R = L_E.view(R, -1).sum(1)
        ref = _fill_search(L_E, load_R, S, B)
        ref += (torch.zeros_like(L_E).scatter_add_(0, ref[0].clamp(min=0), ref[1]),)
        got = fill_search(L_E.cuda(), load_R.cuda(), S, B)
        for name, a, b in zip(("slot_expert", "slot_amount", "slot_start", "load_after", "moved"), ref, got):
            assert torch.equal(a, b.cpu()), (tuple(counts.shape), S, B, name)


@pytest.mark.gpu
def test_planner_kernel_equals_torch_loop_on_gpu():
    from components.moe_echo.planner import plan_echo

    for counts, S, rule in planner_cases(big=True):
        ref = plan_echo(counts, S, rule, kernel=False)
        got = plan_echo(counts.cuda(), S, rule, kernel=True)
        for a, b in zip((ref.slot_expert_G, ref.quota_RG, ref.load_after_R), (got.slot_expert_G, got.quota_RG, got.load_after_R)):
            assert torch.equal(a, b.cpu()), (counts.shape, S, rule)
        R = counts.shape[0]
        if R % 2 == 0:  # two hosts: the host-aware source shares, on the device, equal the CPU's
            ref = plan_echo(counts, S, rule, kernel=False, ranks_per_host=R // 2)
            got = plan_echo(counts.cuda(), S, rule, kernel=True, ranks_per_host=R // 2)
            assert torch.equal(ref.quota_RG, got.quota_RG.cpu()), (counts.shape, S, rule, "hosts")


@pytest.mark.gpu
def test_planner_replays_in_a_cuda_graph():
    from components.moe_echo.planner import plan_echo

    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(8, 256, dtype=torch.int64)  # hot experts packed on rank 0: both search rounds run
    counts[0] = (torch.randn(256, generator=g) * 1.5).exp().mul(1000).long().sort(descending=True).values
    counts, S = counts.cuda(), 1
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager = plan_echo(counts, S)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.stream(stream):
        eager_hosts = plan_echo(counts, S, ranks_per_host=4)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan = plan_echo(counts, S)
        plan_hosts = plan_echo(counts, S, ranks_per_host=4)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(plan.slot_expert_G, eager.slot_expert_G) and torch.equal(plan.quota_RG, eager.quota_RG)
    assert torch.equal(plan_hosts.quota_RG, eager_hosts.quota_RG)
