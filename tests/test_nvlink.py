"""The ``nvlink`` dispatcher's logic on CPU: R ranks as threads sharing buffers (tests/threaded_ranks.py),
against an independent fp64 reference — random and adversarial routing, overflow accounting, and
the peer-copy kernels themselves in the Triton interpreter."""

from functools import partial

import pytest
import torch

from background import Runs, selected
from components.moe_echo.comm import fp8_rows, rows_of_fp8
from components.moe_echo.nvlink_dispatch import NVLinkDispatcher, nvlink_capacity
from test_kernels import _interpret, needs_cpu_interpreter, run_in_interpreter
from threaded_ranks import run_ranks

T, K, D, E_LOCAL = 24, 3, 8, 4


def _routing(kind: str, R: int, rank: int, gen: torch.Generator) -> torch.Tensor:
    E = R * E_LOCAL
    if kind == "random":
        return torch.rand(T, E, generator=gen).topk(K, dim=-1).indices
    if kind == "skewed":  # 70% of tokens pick K of rank 0's experts, the rest pick at random
        scores = torch.rand(T, E, generator=gen)
        scores[torch.rand(T, generator=gen) < 0.7, :E_LOCAL] += 1.0
        return scores.topk(K, dim=-1).indices
    if kind == "all_to_one":  # every token of every rank picks experts 0..K-1 (all on rank 0)
        return torch.arange(K).expand(T, K).clone()
    if kind == "one_hot_per_rank":  # token t: the first K experts of rank t % R (expert 0 of each rank is
        # hot, the last of each rank gets no token)
        return ((torch.arange(T) % R) * E_LOCAL)[:, None] + torch.arange(K)[None, :]
    raise ValueError(kind)


def _expected_dropped(ids_R: list[torch.Tensor], R: int, cap: int) -> list[torch.Tensor]:
    """Per source rank, the [T, K] mask of slots that do not fit: on each destination, slots are
    ordered by (local expert, source rank, t·K + k) and rows >= cap are not sent."""
    drops = [torch.zeros(T, K, dtype=torch.bool) for _ in range(R)]
    for dest in range(R):
        slots = [(int(ids[t, k]) % E_LOCAL, src, t * K + k) for src, ids in enumerate(ids_R)
                 for t in range(T) for k in range(K) if int(ids[t, k]) // E_LOCAL == dest]
        for p, (_, src, n) in enumerate(sorted(slots)):
            if p >= cap:
                drops[src][n // K, n % K] = True
    return drops


def _poison(ws) -> None:
    """Every shared buffer of this rank: NaN (floating) or 2**30 (integer), then a barrier: a step that reads a row
    it did not write this step (a token routed elsewhere, a meta row not rewritten) gives NaN or fails."""
    for _, peers in ws.shared.buffers.values():
        buf = peers[ws.rank]
        buf.fill_(float("nan") if buf.is_floating_point() else 2**30)
    ws.barrier(None)


def _run(R: int, kind: str, capacity_factor: float, dtype=torch.float64, tol: float = 1e-12, copies: str = "kernel",
         poison: bool = False, wire: str = "bf16", quantised_reference: bool = False):
    """fp64 runs the torch path; fp32 under TRITON_INTERPRET=1 runs the kernels themselves. ``copies``: the
    dispatcher's ``nvlink_copy`` (``copy_engine`` sends whole blocks: rows of tokens routed elsewhere cross too).
    ``poison``: a first step builds the buffers, every shared buffer is poisoned, and the second step is checked.
    ``wire``: the dispatcher's; ``quantised_reference``: the reference takes the tokens and the output gradients
    through the fp8 wire's quantisation (comm.fp8_rows) first."""
    E = R * E_LOCAL
    scale_E = torch.linspace(0.5, 2.0, E, dtype=torch.float64)  # "expert e" multiplies its rows by scale[e]
    inputs = []
    for rank in range(R):
        gen = torch.Generator().manual_seed(100 + rank)
        ids = _routing(kind, R, rank, gen)
        inputs.append((torch.randn(T, D, generator=gen, dtype=torch.float64), ids,
                       torch.rand(T, K, generator=gen, dtype=torch.float64), torch.randn(T, D, generator=gen,
                                                                                      dtype=torch.float64)))

    def rank_fn(rank, ws):
        disp = NVLinkDispatcher(E, None, R, capacity_factor, workspace=ws, name="layer", copies=copies)
        disp.wire = wire
        if poison:
            step(rank, disp)
            _poison(ws)
        return step(rank, disp)

    def step(rank, disp):
        x, ids, w, g = (t.to(dtype).clone() if t.is_floating_point() else t.clone() for t in inputs[rank])  # fresh leaves
        x.requires_grad_()
        w.requires_grad_()
        x_ND, counts_e, h = disp.dispatch(x, ids, w)
        used = int(counts_e.sum())
        local_id = torch.repeat_interleave(torch.arange(E_LOCAL), counts_e)
        f_N = torch.zeros(x_ND.shape[0], dtype=dtype)
        f_N[:used] = scale_E[rank * E_LOCAL + local_id].to(dtype)
        y_TD = disp.combine(x_ND * f_N[:, None], h)
        (y_TD * g).sum().backward()
        return (y_TD.detach().double(), x.grad.double(), w.grad.double(), int(h.dropped), x_ND.shape[0],
                float(h.needed_factor))

    outs = run_ranks(R, rank_fn)
    cap = outs[0][4]
    assert cap == nvlink_capacity(T, K, capacity_factor)
    drops = _expected_dropped([inp[1] for inp in inputs], R, cap)
    received_R = torch.bincount(torch.cat([inp[1].reshape(-1) for inp in inputs]) // E_LOCAL, minlength=R)
    assert all(o[5] == pytest.approx(float(received_R.max()) / (T * K)) for o in outs)  # same on every rank
    _run.needed = outs[0][5]
    for rank, ((x, ids, w, g), (y, gx, gw, dropped, *_)) in enumerate(zip(inputs, outs)):
        if quantised_reference:
            x, g = (rows_of_fp8(fp8_rows(t), torch.float64) for t in (x, g))
        keep_TK = (~drops[rank]).double()
        f_TK = scale_E[ids] * keep_TK
        y_ref = ((w * f_TK)[:, :, None] * x[:, None, :]).sum(1)
        torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol)
        torch.testing.assert_close(gx, (w * f_TK).sum(1, keepdim=True) * g, rtol=tol, atol=tol)
        torch.testing.assert_close(gw, f_TK * (x @ g.t()).diagonal()[:, None], rtol=tol, atol=tol)
        assert dropped == int(drops[rank].sum())
    return sum(o[3] for o in outs)


COPIES = pytest.mark.parametrize("copies", ["kernel", "copy_engine"])


@COPIES
@pytest.mark.parametrize("R", [2, 4])
@pytest.mark.parametrize("kind", ["random", "one_hot_per_rank"])
def test_nvlink_dispatch_equals_reference(R, kind, copies):
    assert _run(R, kind, capacity_factor=float(R), copies=copies) == 0  # room for the worst case: nothing dropped


@COPIES
def test_nvlink_all_tokens_to_one_rank(copies):
    assert _run(2, "all_to_one", capacity_factor=2.0, copies=copies) == 0  # rank 0 receives 2·T·K rows = its capacity
    cap = nvlink_capacity(T, K, 2.0)  # 256 rows: round_up(2·T·K, 128)
    assert _run(4, "all_to_one", capacity_factor=2.0, copies=copies) == 4 * T * K - cap  # the rows past capacity: counted


@COPIES
def test_nvlink_overflow_is_counted_never_silent(copies):
    dropped = _run(4, "skewed", capacity_factor=1.0, copies=copies)
    assert dropped > 0  # the reference above checked which slots, the outputs and the gradients
    needed = _run.needed  # the capacity_factor the fullest rank needed: the gate grows to it
    assert needed > 1.0 and _run(4, "skewed", capacity_factor=needed, copies=copies) == 0


@COPIES
@pytest.mark.parametrize("R, kind", [(2, "random"), (4, "random"), (4, "one_hot_per_rank")])
def test_rows_not_written_this_step_are_never_read(R, kind, copies):
    """The copy-engine send relies on it (rows of tokens routed elsewhere cross but must not count), and so does
    buffer reuse across steps: with every shared buffer poisoned between two steps, the second is still exact."""
    assert _run(R, kind, capacity_factor=float(R), copies=copies, poison=True) == 0


@COPIES
@pytest.mark.parametrize("R, kind", [(2, "random"), (4, "skewed"), (4, "all_to_one")])
def test_fp8_wire_equals_ep1_through_the_same_quantisation(R, kind, copies):
    """``wire = "fp8"``: tokens and output gradients cross as e4m3 rows; outputs and both gradients equal, in fp64,
    the exact layer fed the quantised tokens and gradients (overflow included: skewed at capacity 1.0 drops rows),
    with every shared buffer poisoned between two steps (a wire row not sent this step is never read)."""
    dropped = _run(R, kind, capacity_factor=1.0 if kind == "skewed" else float(R), copies=copies, poison=True,
                   wire="fp8", quantised_reference=True)
    assert (dropped > 0) == (kind == "skewed")


def test_fp8_wire_is_not_the_exact_wire():
    """The check above can fail: the fp8 wire against the unquantised reference, and the bf16 wire against the
    quantised one, both miss."""
    with pytest.raises(AssertionError):
        _run(2, "random", capacity_factor=2.0, wire="fp8")
    with pytest.raises(AssertionError):
        _run(2, "random", capacity_factor=2.0, quantised_reference=True)


def test_nvlink_copy_is_checked():
    with pytest.raises(ValueError, match="nvlink_copy"):
        NVLinkDispatcher(8, None, 2, 1.0, workspace=object(), copies="dma")


_PEER_KERNELS = r"""
import torch
from kernels import peer_rows as pr
for T, K, D, R, N in [(7, 3, 40, 2, 30), (5, 2, 1030, 3, 12), (4, 4, 8, 4, 16)]:
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, D, generator=g); w = torch.rand(T, K, generator=g); gr = torch.randn(T, D, generator=g)
    rank = torch.randint(0, R, (T, K), generator=g)
    row = torch.randperm(N * R, generator=g)[:T * K].view(T, K) % N  # may collide across ranks only
    row = torch.where(torch.rand(T, K, generator=g) < 0.2, -1, row)
    flat = rank * N + row; flat = torch.where(row < 0, -1, flat)
    uniq = torch.zeros(T * K, dtype=torch.bool)  # keep one writer per (rank, row)
    seen = set()
    for i, v in enumerate(flat.reshape(-1).tolist()):
        uniq[i] = v >= 0 and v not in seen; seen.add(v)
    row = torch.where(uniq.view(T, K), row, -1)
    assert pr.use_triton(x)
    x_big = torch.randn(T + 5, D, generator=g)  # rows sent through src (some twice, some never)
    src = torch.randint(0, T + 5, (T,), generator=g)
    for fn, bt in [(f, bt) for f in ("scatter", "gather", "scatter_local", "scatter_src", "gather_add",
                                     "gather_add_rows") for bt in (1, 4)]:
        bufs = {m: [torch.randn(N, D, generator=g) for _ in range(R)] for m in ("y",)}
        ref = {m: [b.clone() for b in v] for m, v in bufs.items()}
        ptrs = {m: torch.tensor([b.data_ptr() for b in v]) for m, v in bufs.items()}
        if fn == "scatter":
            pr.peer_scatter(x, rank, row, ptrs["y"], bufs["y"], w, programs=3, block_t=bt)
            pr.peer_scatter_torch(x, rank, row, ref["y"], w)
        elif fn == "gather":
            a = pr.peer_gather_sum(rank, row, ptrs["y"], bufs["y"], w, programs=2, block_t=bt)
            torch.testing.assert_close(a, pr.peer_gather_sum_torch(rank, row, ref["y"], w), rtol=1e-5, atol=1e-5)
        elif fn == "gather_add":  # sums added into a given buffer; rows with no slot keep their values
            row_none = row.clone(); row_none[::3] = -1
            base = torch.randn(T, D, generator=g)
            got = pr.peer_gather_sum(rank, row_none, ptrs["y"], bufs["y"], w, programs=2, block_t=bt,
                                     add_into=base.clone())
            torch.testing.assert_close(got, base + pr.peer_gather_sum_torch(rank, row_none, ref["y"], w),
                                       rtol=1e-5, atol=1e-5)
            assert torch.equal(got[::3], base[::3])
        elif fn == "gather_add_rows":  # sum t added into row dst[t] of a taller buffer (distinct rows, any order)
            row_none = row.clone(); row_none[1::3] = -1
            base = torch.randn(T + 6, D, generator=g)
            dst = torch.randperm(T + 6, generator=g)[:T]
            got = pr.peer_gather_sum(rank, row_none, ptrs["y"], bufs["y"], w, programs=2, block_t=bt,
                                     add_into=base.clone(), out_rows_T=dst)
            want = base.clone()
            want[dst] += pr.peer_gather_sum_torch(rank, row_none, ref["y"], w)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            untouched = torch.ones(T + 6, dtype=torch.bool); untouched[dst[(row_none >= 0).any(1)]] = False
            assert torch.equal(got[untouched], base[untouched])
        elif fn == "scatter_src":  # each slot row reads row src[t] of x_big; K = 1 rows sent nowhere are not read
            pr.peer_scatter(x_big, rank, row, ptrs["y"], bufs["y"], w, programs=3, block_t=bt, src_T=src)
            pr.peer_scatter_torch(x_big[src], rank, row, ref["y"], w)
            pr.peer_scatter(x_big, rank[:, :1], row[:, :1], ptrs["y"], bufs["y"], programs=2, block_t=bt, src_T=src)
            pr.peer_scatter_torch(x_big[src], rank[:, :1], row[:, :1], ref["y"])
        else:  # one destination (rank_TK None): rows that collide only across ranks become -1 here
            local = torch.where(rank == 0, row, -1)
            pr.peer_scatter(x, None, local, ptrs["y"][:1], bufs["y"][:1], programs=2, block_t=bt)
            pr.peer_scatter_torch(x, None, local, ref["y"][:1])
        for m in bufs:
            for p, q in zip(bufs[m], ref[m]):
                torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    # the routing meta rows on every rank and the token routes, in one launch (src = 1: rows T..2T-1)
    from components.moe_echo.symmetric import SymmBuffer
    def meta(dtype):
        peers = [torch.full((R * T, K), 7, dtype=dtype) for _ in range(R)]
        return SymmBuffer(peers[1 % R], peers, torch.tensor([p.data_ptr() for p in peers]))
    (mr, mw), (rr, rw) = (meta(torch.int32), meta(torch.float32)), (meta(torch.int32), meta(torch.float32))
    e = 3  # local ids per rank; rows = base[id] + rank in id, -1 from N on
    ids = torch.randint(0, R * e, (T, K), generator=g)
    rid = torch.randint(0, 4, (T, K), generator=g, dtype=torch.int32)
    base = torch.randint(0, N, (R * e,), generator=g)
    rid[0, 0], rid[0, 1], base[ids[0, 1]] = N, 0, 0  # one slot past capacity, one at row 0
    got = pr.peer_route_meta(ids, rid, base, e, N, w, mr, mw, 1 % R, programs=2)
    want = pr.peer_route_meta_torch(ids, rid, base, e, N, w, rr, rw, 1 % R)
    assert bool((want[1] < 0).any()) and bool((want[1] >= 0).any())
    for a, b in zip(got, want):
        assert torch.equal(a, b), (a, b)
    for a, b in zip(mr.peers + mw.peers, rr.peers + rw.peers):
        assert torch.equal(a, b)
# ECHO's gradient pull as its transport launches it: no weights, rank ρ in column ρ, the default rows a block (32 and
# 128 at these widths, the layouts where Triton 3.6 once failed to compile the destination rows' load)
for D in (64, 256):
    g = torch.Generator().manual_seed(D)
    R, T, N = 2, 40, 30
    bufs = [torch.randn(N, D, generator=g) for _ in range(R)]
    ptrs = torch.tensor([b.data_ptr() for b in bufs])
    rank = torch.arange(R).expand(T, R).contiguous()
    row = torch.where(torch.rand(T, R, generator=g) < 0.3, -1, torch.randint(0, N, (T, R), generator=g))
    base, dst = torch.randn(T + 6, D, generator=g), torch.randperm(T + 6, generator=g)[:T]
    got = pr.peer_gather_sum(rank, row, ptrs, bufs, add_into=base.clone(), out_rows_T=dst)
    want = base.clone()
    want[dst] += pr.peer_gather_sum_torch(rank, row, bufs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
print("PEER-OK")
"""


@needs_cpu_interpreter
def test_peer_kernels_in_interpreter(interpreted):
    run_in_interpreter(_PEER_KERNELS, "PEER-OK", interpreted["peer"])


_DISPATCHER_KERNELS = r"""
import sys, threading, torch
import triton.runtime.interpreter as interpreter
sys.path.insert(0, "tests")
from test_nvlink import T, K, _run
from components.moe_echo.nvlink_dispatch import nvlink_capacity
from kernels.peer_rows import use_triton

# the interpreter is not thread-safe: one kernel launch at a time across the rank threads
lock, call = threading.Lock(), interpreter.GridExecutor.__call__
def one_at_a_time(self, *args, **kwargs):
    with lock:
        return call(self, *args, **kwargs)
interpreter.GridExecutor.__call__ = one_at_a_time
assert use_triton(torch.zeros(1))
# fp32 through the real kernels (token scatter, local expand, partial sums, pulls, combine backward)
assert _run(3, "one_hot_per_rank", 3.0, torch.float32, 1e-5) == 0
assert _run(2, "all_to_one", 1.0, torch.float32, 1e-5) == 2 * T * K - nvlink_capacity(T, K, 1.0)  # counted
# the fp8 wire: packed rows moved as 4-byte words by the same kernels
assert _run(2, "random", 2.0, torch.float32, 1e-5, wire="fp8", quantised_reference=True) == 0
print("DISPATCHER-OK")
"""


@needs_cpu_interpreter
def test_nvlink_dispatcher_kernels_in_interpreter(interpreted):
    """The dispatcher end to end through its Triton kernels (interpreted, threads as ranks) against
    the same independent reference as the fp64 torch path, dropped slots included."""
    run_in_interpreter(_DISPATCHER_KERNELS, "DISPATCHER-OK", interpreted["dispatcher"])


@pytest.mark.parametrize("shape", [(2, 3, 5), (2, 5, 3)])  # w1/w3-like [e, H, D] and w2-like [e, D, H]
@pytest.mark.parametrize("into", ["cat", "spare_rows"])
def test_nvlink_weight_multicast_and_gradient_reduce_back(shape, into):
    """Extended weights over peer memory: rows [:e] are the home experts, clone slot s of rank r holds expert
    x = slot_expert[r·S + s] (zeros if unused); the home experts' gradient is their rows' gradient plus the
    sum of their clones' gradients — fp64, against direct indexing. ``spare_rows``: the home weights are rows
    [:e] of an [e + S] buffer (the experts' compute copies) and the clones are written into its last rows:
    the extended weights are that buffer, no copy of the home experts."""
    from components.moe_echo.echo_transport import PeerMemoryTransport, extend_with_clones

    R, S = 3, 2
    e = shape[0]
    slot_expert_G = torch.tensor([3, -1, 0, 5, 3, -1])  # expert 3 cloned twice, rank 2's slot 1 unused
    gen = torch.Generator().manual_seed(0)
    w_R = [torch.randn(*shape, generator=gen, dtype=torch.float64) for _ in range(R)]
    g_R = [torch.randn(e + S, *shape[1:], generator=gen, dtype=torch.float64) for _ in range(R)]

    def rank_fn(rank, ws):
        full = torch.full((e + S, *shape[1:]), float("nan"), dtype=torch.float64) if into == "spare_rows" else None
        if full is None:
            w = w_R[rank].clone().requires_grad_()
        else:
            full[:e] = w_R[rank]
            w = full[:e].requires_grad_()
        out = extend_with_clones(w, slot_expert_G, PeerMemoryTransport(ws, "layer", rank, S, e), index=0, out=full)
        assert full is None or out.data_ptr() == full.data_ptr()  # the buffer itself
        (out * g_R[rank]).sum().backward()
        w2 = w_R[rank].clone().requires_grad_()  # an expanded gradient (of a sum): each clone adds ones
        extend_with_clones(w2, slot_expert_G, PeerMemoryTransport(ws, "layer2", rank, S, e), index=0).sum().backward()
        mine = [x % e for x in slot_expert_G.tolist() if x >= 0 and x // e == rank]
        assert torch.equal(w2.grad, 1 + torch.bincount(torch.tensor(mine, dtype=torch.long), minlength=e)
                           .to(w2.grad).view(-1, *[1] * (len(shape) - 1)).expand(shape))
        return out.detach(), w.grad

    outs = run_ranks(R, rank_fn)
    for rank, (out, grad) in enumerate(outs):
        torch.testing.assert_close(out[:e], w_R[rank], rtol=0, atol=0)
        for s in range(S):
            x = int(slot_expert_G[rank * S + s])
            want = w_R[x // e][x % e] if x >= 0 else torch.zeros(shape[1:], dtype=torch.float64)
            torch.testing.assert_close(out[e + s], want, rtol=0, atol=0)
        want_grad = g_R[rank][:e].clone()
        for g, x in enumerate(slot_expert_G.tolist()):
            if x >= 0 and x // e == rank:
                want_grad[x % e] += g_R[g // S][e + g % S]
        torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("slot_expert", [[8, 4], [-1, 4], [-1, -1], [6, 0]])
def test_clone_gradients_pull_only_the_cloned_experts_rows(slot_expert):
    """More home experts than slots (e = 5, G = 2: two of the five experts' rows are read): each home expert's
    gradient is its rows' plus its clones', fp64, whichever experts the slots clone (the last one, none, some)."""
    from components.moe_echo.echo_transport import PeerMemoryTransport, extend_with_clones

    from kernels.echo_routes import pull_routes

    R, S, e = 2, 1, 5
    slot_expert_G = torch.tensor(slot_expert)
    gen = torch.Generator().manual_seed(1)
    w_R = [torch.randn(e, 3, 4, generator=gen, dtype=torch.float64) for _ in range(R)]
    g_R = [torch.randn(e + S, 3, 4, generator=gen, dtype=torch.float64) for _ in range(R)]
    transports = []

    def rank_fn(rank, ws):
        w = w_R[rank].clone().requires_grad_()
        t = PeerMemoryTransport(ws, "layer", rank, S, e)
        transports.append(t)
        (extend_with_clones(w, slot_expert_G, t) * g_R[rank]).sum().backward()
        return w.grad

    grads = run_ranks(R, rank_fn)
    assert pull_routes(slot_expert_G, 0, S, e, 3)[0].shape == (2 * 3, R)  # C = 2 experts' rows, not 5
    for rank, grad in enumerate(grads):
        want = g_R[rank][:e].clone()
        for g, x in enumerate(slot_expert):
            if x >= 0 and x // e == rank:
                want[x % e] += g_R[g // S][e + g % S]
        torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-12)


def test_fp8_clones_over_peer_memory_are_the_home_experts_copies():
    """ECHO's FP8 clones over peer memory (``clone_fp8_weights_`` with the nvlink transport): each used slot holds
    its home expert's FP8 copy bytes (plain and transposed) and scale, bit for bit; an unused slot zero bytes at
    scale 1; the home rows untouched; only the slots' own rows written."""
    from components.moe_echo.echo_transport import PeerMemoryTransport, clone_fp8_weights_
    from components.moe_echo.fp8_experts import Fp8WeightCopies

    R, S, e, H, D = 3, 2, 2, 16, 32
    slot_expert_G = torch.tensor([3, -1, 0, 5, 3, -1])  # expert 3 cloned twice, rank 2's slot 1 unused
    gen = torch.Generator().manual_seed(0)
    ws_R = [[torch.randn(e, *shape, generator=gen) * 10.0 ** r for shape in ((H, D), (D, H), (H, D))]
            for r in range(R)]
    copies_R = []
    for r in range(R):
        c = Fp8WeightCopies(e, H, D, torch.device("cpu"), slots=S)
        c.write_(*ws_R[r])
        copies_R.append(c)

    def rank_fn(rank, ws):
        c = copies_R[rank]
        home = [t.view(torch.uint8).clone() for t in (c.plain13_E2HD, c.t2_EHD)] + [c.scale_2E.clone()]
        w = clone_fp8_weights_(c.with_slots, e, slot_expert_G, PeerMemoryTransport(ws, "layer", rank, S, e))
        assert w is c.with_slots
        assert all(torch.equal(a, b) for a, b in zip(home, [c.plain13_E2HD.view(torch.uint8),
                                                            c.t2_EHD.view(torch.uint8), c.scale_2E]))
        return w

    outs = run_ranks(R, rank_fn)
    b = lambda t: t.view(torch.uint8)  # noqa: E731
    for rank, w in enumerate(outs):
        for s in range(S):
            x = int(slot_expert_G[rank * S + s])
            for name in ("plain13_E2HD", "plain2_EDH", "t13_ED2H", "t2_EHD"):
                got = b(getattr(w, name)[e + s])
                want = b(getattr(copies_R[x // e], name)[x % e]) if x >= 0 else torch.zeros_like(got)
                assert torch.equal(got, want), (rank, s, name)
            want_s = copies_R[x // e].scale_2E[:, x % e] if x >= 0 else torch.ones(2)
            assert torch.equal(w.scale_2E[:, e + s], want_s), (rank, s)


@pytest.mark.parametrize("R, routing, recompute", [(R, routing, False) for R in (2, 4) for routing in
                                                   ("random", "all_to_one", "one_hot_per_rank", "more_hot_than_slots")]
                         + [(2, "random", True), (4, "one_hot_per_rank", True), (4, "random", "poison")])
@pytest.mark.parametrize("gathered, copies", [(False, "kernel"), (True, "kernel"), (False, "copy_engine"),
                                            (True, "copy_engine")],
                         ids=["dispatched", "gathered", "dispatched-ce", "gathered-ce"])
def test_echo_layer_over_nvlink_equals_ep1(R, routing, recompute, gathered, copies, chunks=1, shared="auto"):
    """The whole MoE layer with ECHO on the nvlink backend (plan, rewrite, peer dispatch, clone
    weights and gradient reduce-back over peer memory, combine) against the same layer at EP=1:
    outputs, input gradients, expert gradients and replicated gradients, fp64 to 1e-12. With
    ``recompute`` the layer runs under activation checkpointing: its backward re-runs dispatch and
    combine, rewriting the peer buffers of the same step, and must give the same gradients. ``recompute =
    "poison"``: a first step, then every shared buffer poisoned (NaN / 2**30), then the checked step (nothing
    written in an earlier step is read).
    ``gathered``: the experts read the received token rows by index and sum per token themselves
    (``gathered_experts``) instead of the dispatcher expanding them into expert rows. ``copies``: ``nvlink_copy``."""
    import copy
    import dataclasses

    from components.moe_echo.echo import Echo
    from components.moe_echo.echo_transport import build_transport
    from ep_worker import _layer

    E, K, T_rank, S = 8, 2, 10, 1 if routing == "more_hot_than_slots" else 2
    e = E // R
    ref = _layer(E, K, shared=1, seed=0)
    bias = torch.zeros(E)
    if routing == "all_to_one":
        bias[:] = -50.0
        bias[E - 1] = 50.0
    elif routing == "one_hot_per_rank":
        bias[::e] = 50.0
    elif routing == "more_hot_than_slots":
        bias[: E // 2] = 50.0
    ref.expert_bias.copy_(bias)
    layers = [copy.deepcopy(ref) for _ in range(R)]
    g = torch.Generator().manual_seed(1)
    x_all = torch.randn(R, T_rank, 12, generator=g, dtype=torch.float64)
    gy_all = torch.randn(R, T_rank, 12, generator=g, dtype=torch.float64)
    x_ref = x_all.clone().requires_grad_()
    y_ref = ref(x_ref)
    (y_ref * gy_all).sum().backward()

    def rank_fn(rank, ws):
        layer = layers[rank]
        layer.cfg = dataclasses.replace(layer.cfg, gathered_experts=gathered, overlap_chunks=chunks,
                                        shared_experts_stream=shared)
        for name in ("w1", "w2", "w3"):
            full = getattr(layer.experts, name).data
            setattr(layer.experts, name, torch.nn.Parameter(full[rank * e:(rank + 1) * e].clone()))
        disp = NVLinkDispatcher(R * (e + S), None, R, float(R), workspace=ws, name="layer", copies=copies)
        layer.dispatcher, layer.ep_size = disp, R
        layer.echo = Echo(E, R, rank, S, "greedy", build_transport(disp, None, R, rank, S, e))  # counts over the workspace too
        if recompute == "poison":
            layer(x_all[rank:rank + 1].clone().requires_grad_()).sum().backward()
            layer.zero_grad(set_to_none=True)
            _poison(ws)
        x = x_all[rank:rank + 1].clone().requires_grad_()
        y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False) if recompute is True else layer(x)
        (y * gy_all[rank:rank + 1]).sum().backward()
        return y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}, layer.echo_stats.clone()

    outs = run_ranks(R, rank_fn)
    tol = dict(rtol=1e-12, atol=1e-12)
    ref_grads = dict(ref.named_parameters())
    clones = 0.0
    for rank, (y, gx, grads, stats) in enumerate(outs):
        torch.testing.assert_close(y, y_ref[rank:rank + 1].detach(), **tol)
        torch.testing.assert_close(gx, x_ref.grad[rank:rank + 1], **tol)
        for name in ("w1", "w2", "w3"):
            torch.testing.assert_close(grads[f"experts.{name}"], ref_grads[f"experts.{name}"].grad[rank * e:(rank + 1) * e],
                                       **tol)
        assert stats[1] <= stats[0] + 1e-9  # rank load after ECHO <= before
        clones += float(stats[2])
    for name, p in ref_grads.items():  # replicated parameters: the ranks' gradients sum to the reference
        if not name.startswith("experts."):
            torch.testing.assert_close(sum(o[2][name] for o in outs), p.grad, **tol)
    if routing in ("all_to_one", "more_hot_than_slots") or float(outs[0][3][0]) > 1.2:
        assert clones >= 1  # ECHO really cloned (and so the multicast really ran)


@pytest.mark.parametrize("R, routing, recompute", [(2, "random", False), (4, "one_hot_per_rank", False),
                                                   (4, "all_to_one", "poison")])
@pytest.mark.parametrize("copies", ["kernel", "copy_engine"])
def test_pipelined_echo_layer_over_nvlink_equals_ep1(R, routing, recompute, copies):
    """The same layer with its tokens in 3 pipelined chunks (``overlap_chunks``): each chunk dispatches into
    buffers of its own while the others are in flight; equal to EP=1 to 1e-12, also after every shared buffer
    was poisoned."""
    test_echo_layer_over_nvlink_equals_ep1(R, routing, recompute, False, copies, chunks=3)


@pytest.mark.parametrize("R, routing", [(2, "random"), (4, "all_to_one")])
def test_pipelined_layer_with_shared_experts_at_the_ends_equals_ep1(R, routing):
    """``shared_experts_stream = "ends"``: the shared experts run on half the tokens at each end of the pipeline
    (beside the first chunk's dispatch and the last chunk's combine); the layer still equals EP=1 to 1e-12,
    outputs and every gradient (the shared experts' included)."""
    test_echo_layer_over_nvlink_equals_ep1(R, routing, False, False, "kernel", chunks=3, shared="ends")


_LAUNCHES = r"""
import collections, sys, threading, torch
import triton.runtime.interpreter as interpreter
from torch.utils._python_dispatch import TorchDispatchMode
sys.path.insert(0, "tests")
from threaded_ranks import run_ranks
from components.moe_echo.nvlink_dispatch import NVLinkDispatcher

NO_KERNEL = {"empty", "view", "detach", "slice", "select", "alias", "lift_fresh", "unsqueeze", "squeeze", "expand",
             "_unsafe_view", "as_strided"}  # allocations and views: no device kernel
tls, lock, call = threading.local(), threading.Lock(), interpreter.GridExecutor.__call__
triton_launches = collections.Counter()
def counted(self, *args, **kwargs):
    with lock:
        if getattr(tls, "count", None) is not None:
            triton_launches[tls.phase] += 1
        tls.inside = True
        try:
            return call(self, *args, **kwargs)
        finally:
            tls.inside = False
interpreter.GridExecutor.__call__ = counted

class TorchKernels(TorchDispatchMode):
    def __init__(self, phase):
        super().__init__(); self.phase, self.ops = phase, []
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not getattr(tls, "inside", False) and name not in NO_KERNEL:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))

T, K, D, E, R = 16, 6, 32, 16, 2  # launch counts do not depend on T; the interpreter time does
ops = {}
def rank_fn(rank, ws):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, D, generator=g, requires_grad=True); w = torch.rand(T, K, generator=g, requires_grad=True)
    ids = torch.rand(T, E, generator=g).topk(K, dim=-1).indices
    disp = NVLinkDispatcher(E, None, R, 2.0, workspace=ws, name="layer", copies=COPIES)
    for step in range(2):  # the second step is counted (the first builds buffers and caches)
        phases = [("dispatch", lambda: disp.dispatch(x, ids, w)), ("experts", lambda: out[0] * 2),
                  ("combine", lambda: disp.combine(out[1], out[2])), ("backward", lambda: out[3].sum().backward())]
        out = [None] * 4
        for i, (phase, fn) in enumerate(phases):
            if rank == 0 and step == 1 and phase != "experts":
                tls.count, tls.phase = True, phase
                with TorchKernels(phase) as m:
                    res = fn()
                tls.count = None
                ops[phase] = m.ops
            else:
                res = fn()
            if phase == "dispatch":
                out[0], _, out[2] = res
            elif phase == "experts":
                out[1] = res
            elif phase == "combine":
                out[3] = res
run_ranks(R, rank_fn)
for phase in ("dispatch", "combine", "backward"):
    print(f"LAUNCHES {phase} torch={len(ops[phase])} {ops[phase]} triton={triton_launches[phase]}")
"""


def _launches(copies: str) -> str:
    return _LAUNCHES.replace("copies=COPIES", f"copies={copies!r}")


@pytest.fixture(scope="module")
def interpreted(request):
    """This module's interpreter scripts (single-threaded: the interpreter runs one launch at a time),
    started together, the longest first; ``interpreted[name]`` waits for that one's finished run."""
    scripts = {}
    for copies in sorted(selected(request, "test_nvlink_eager_launches_stay_few")):
        scripts[f"launches[{copies}]"] = _launches(copies)
    if selected(request, "test_nvlink_dispatcher_kernels_in_interpreter"):
        scripts["dispatcher"] = _DISPATCHER_KERNELS
    if selected(request, "test_peer_kernels_in_interpreter"):
        scripts["peer"] = _PEER_KERNELS
    order = ["dispatcher", "launches[copy_engine]", "launches[kernel]", "peer"]
    runs = Runs({name: partial(_interpret, scripts[name]) for name in order if name in scripts})
    yield runs
    runs.close()


@needs_cpu_interpreter
@COPIES
def test_nvlink_eager_launches_stay_few(interpreted, copies):
    """The eager step is host-bound: each torch op and Triton launch costs host time (~10-30 µs).
    Dispatch's layout is four kernels (kernels.route_layout, peer_route_meta), not ~45 torch ops."""
    out = run_in_interpreter(_launches(copies), "LAUNCHES backward", interpreted[f"launches[{copies}]"])
    got = {line.split()[1]: (int(line.split("torch=")[1].split()[0]), int(line.rsplit("triton=", 1)[1]))
           for line in out.splitlines() if line.startswith("LAUNCHES")}
    print(out)
    # kernel: the counts' clone (+ x's cast under autocast); Triton: slot ranks (3), counts to peers, layout, meta,
    # token send, expansion. copy_engine: + the staging rows (ge, where) and R copies instead of the token send.
    # backward: 5 torch ops of the test's own (the sum's and the experts' backward, two leaf-gradient adds).
    if copies == "kernel":
        assert got["dispatch"][0] <= 2 and got["dispatch"][1] <= 8, out
        assert got["combine"][0] == 0 and got["combine"][1] <= 2, out
        assert got["backward"][0] <= 11 and got["backward"][1] <= 4, out
    else:  # at R = 2: one pull per sum-back; Triton: the owner's sums (peers', own) and the add of the blocks
        assert got["dispatch"][0] <= 5 and got["dispatch"][1] <= 7, out
        assert got["combine"][0] <= 1 and got["combine"][1] <= 3, out
        assert got["backward"][0] <= 14 and got["backward"][1] <= 4, out
