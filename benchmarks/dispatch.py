"""Dispatch + combine across EP ranks: nvlink (ours: Triton over symmetric memory, sync-free) vs
alltoall (NCCL, host-sized) vs padded (NCCL, sync-free) vs PyTorch symmetric-memory
all_to_all_vdev (NVSHMEM, where it runs) vs a raw peer-to-peer copy of the same bytes (the NVLink
ceiling), all in one run; plus nvlink's time against the SMs (CTAs) its kernels may use.

    torchrun --nproc_per_node 2 benchmarks/dispatch.py [--out DIR]

Bytes each backend moves, twice (dispatch there, combine back), × D × 2 B, from the busiest rank:
``alltoall``, ``padded`` and ``vdev`` send one row per (token, choice) on another rank (``remote_MB``);
``nvlink`` sends one row per (token, other rank it goes to) (``remote_token_MB``). GB/s = a backend's
bytes / the slowest rank's time. The ceiling (``peer_copy_ms``) moves nvlink's bytes with one
cudaMemcpy-style copy into the peer GPU each way; ``slot_copy_ms`` moves the per-choice bytes.
E=64, K=8, bf16.

The sync-free backends also run captured in a CUDA graph (``*_graph_ms``: how the training step
runs them, without the host's launch cost); alltoall cannot be captured (it reads the split sizes
on the host). The sweep varies the CTAs (``--sweep``) and tokens per CTA iteration (``--block-t``)
of the nvlink kernels, graphed, on the first and the last shape.

``gathered_*``: the movement of ``[moe_echo] gathered_experts`` over nvlink (``gathered_round_trip``): each token
once into every rank it goes to, no expert-major copy of the received tokens; the owner's per-token sums
pulled back. Same bytes as nvlink's rows; ``gathered_rel_err`` compares its value (identity experts) with
nvlink's dispatch + combine.

``nvlink_fp8_*``: nvlink with the fp8 wire (``dispatch_precision = "fp8"``: token rows cross as e4m3 + a scale,
``fp8_wire_bytes_frac`` of bf16's bytes), dispatch alone and dispatch + combine (which stays bf16), graphed, at the
main table's CTAs; ``fp8_*_speedup``: bf16's time over fp8's.

SM budgets (``--sms 24,64``; the main table runs nvlink at the first): nvlink and DeepEP's intranode kernels
(the ``deepep`` dispatcher, where ``deep_ep`` imports; eager only: its normal mode sizes buffers on the host)
at each budget, eager, one row per shape and budget. nvlink's budget is its kernels' CTAs, DeepEP's the SMs of
``deep_ep.Buffer.set_num_sms`` (one CTA each). ``nvlink_vs_deepep``: deepep_ms / nvlink_ms (over 1: nvlink
faster); ``deepep_kernels_ms``: DeepEP's layout + dispatch + combine alone (no expansion to expert-major rows);
``deepep_rel_err``: its combined tokens (identity experts) against nvlink's. ``--only-sms``: that table alone
(``dispatch_ep<N>_<label>``, label ``sms`` by default), nothing else timed.
"""

import argparse
import copy
import importlib
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

from benchmarks.common import beside, environment, host_ms, markdown_table, routing_ids, slowest, time_ms, write_results
from components.moe_echo.deepep_dispatch import DeepEPDispatcher, _buffer, release_buffers
from components.moe_echo.ep_dispatch import AllToAllDispatcher, PaddedDispatcher, padded_capacity
from components.moe_echo.gathered_experts import _to_rows
from components.moe_echo.nvlink_dispatch import (NVLinkDispatcher, fp8_wire_bytes, nvlink_capacity, owner_sums,
                                                 send_tokens, sum_back)
from kernels.peer_rows import peer_gather_sum, peer_scatter

E, K = 64, 8


def routing(T, kind, gen, dev):
    return routing_ids(T, E, K, kind, gen, dev)


def peer_copy_ms(nbytes: int, rank: int, world: int) -> float:
    """Copy nbytes from this GPU into the next GPU and back (same-process P2P copies), all ranks at once."""
    peer = (rank + 1) % world
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=f"cuda:{rank}").normal_()
    dst = torch.empty_like(src, device=f"cuda:{peer}")

    def fn():
        dst.copy_(src, non_blocking=True)
        src.copy_(dst, non_blocking=True)

    dist.barrier()
    return time_ms(fn)


def gathered_round_trip(disp, x_TD, ids_TK, w_TK, y_ND=None):
    """The data movement of ``gathered_experts`` over nvlink: route, each token once into every rank it goes to
    (dispatch), then each owner sums its rows' weighted expert outputs per source token and the sources pull the
    sums (combine). The experts' output rows ``y_ND`` [capacity, D] are a given buffer (the time of the movement
    alone) or, where None, each row's own token (identity experts: the value of nvlink's dispatch + combine)."""
    x_c, _, h = disp.route(x_TD, ids_TK, w_TK)
    send_tokens(disp, h, x_c)
    if y_ND is None:
        U, K = h.meta_row.local.shape
        cap = nvlink_capacity(*ids_TK.shape, disp.capacity_factor)
        tok_N = _to_rows(torch.arange(U, device=x_TD.device)[:, None].expand(U, K), h.meta_row.local, cap, torch.int64)
        y_ND = h.tok.local.index_select(0, tok_N)
    sums = disp.ws.buffer(f"{disp.name}/sums/{y_ND.dtype}", tuple(h.tok.local.shape), y_ND.dtype, y_ND.device)
    return sum_back(disp, h, y_ND, sums, weighted=True, out_dtype=h.out_dtype)


FEW_CTAS = 24  # the copy kernels also timed at this many CTAs: what they reach while leaving the SMs to the GEMMs
PHASES = ["route", "route_send", "send_kernel", "barrier", "owner_sum", "pull_kernel", f"send_kernel_c{FEW_CTAS}",
          f"pull_kernel_c{FEW_CTAS}", "send_tokens", "send_tokens_ce", "sum_back", "sum_back_ce"]


def gathered_phases(disp, x_TD, ids_TK, w_TK, y_ND, timed) -> dict:
    """Graphed ms of the gathered round trip's parts: ``route`` (counts exchange, layout, meta rows: one barrier),
    ``route_send`` (+ the tokens into their ranks: two barriers), and each kernel alone on a fixed routing:
    ``send_kernel`` (the token rows' peer writes), ``barrier`` (one device barrier of the two ranks),
    ``owner_sum`` (the owner's weighted per-token sums, local), ``pull_kernel`` (the sources' reads of those sums);
    ``*_c24``: the two copy kernels at ``FEW_CTAS`` CTAs instead of the dispatcher's; ``send_tokens`` and
    ``send_tokens_ce``: the token send with its barrier, by the kernel and by the copy engines (``nvlink_copy``);
    ``sum_back`` and ``sum_back_ce``: the whole combine (owner sums, barrier, the sources' sums) both ways."""
    def run(fn):
        def go():
            with torch.no_grad():
                fn()
        return timed(go, graph=True)

    with torch.no_grad():
        x_c, _, h = disp.route(x_TD, ids_TK, w_TK)
    sums = disp.ws.buffer(f"{disp.name}/sums/{y_ND.dtype}", tuple(h.tok.local.shape), y_ND.dtype, y_ND.device)
    kw = dict(programs=disp.programs, block_t=disp.block_t)
    ce = copy.copy(disp)
    ce.copies = "copy_engine"
    with torch.no_grad():
        h_ce = ce.route(x_TD, ids_TK, w_TK)[2]
    return {
        "route": run(lambda: disp.route(x_TD, ids_TK, w_TK)),
        "route_send": run(lambda: send_tokens(disp, *disp.route(x_TD, ids_TK, w_TK)[2:], x_c)),
        "send_kernel": run(lambda: peer_scatter(x_c, h.rank_TR, h.row_TR, h.tok.ptrs_R, h.tok.peers, **kw)),
        "barrier": run(lambda: disp.ws.barrier(h.tok)),
        "owner_sum": run(lambda: owner_sums(y_ND, h, sums, weighted=True)),
        "pull_kernel": run(lambda: peer_gather_sum(h.rank_TR, h.row_TR, sums.ptrs_R, sums.peers,
                                                   out_dtype=h.out_dtype, **kw)),
        f"send_kernel_c{FEW_CTAS}": run(lambda: peer_scatter(x_c, h.rank_TR, h.row_TR, h.tok.ptrs_R, h.tok.peers,
                                                             programs=FEW_CTAS, block_t=disp.block_t)),
        f"pull_kernel_c{FEW_CTAS}": run(lambda: peer_gather_sum(h.rank_TR, h.row_TR, sums.ptrs_R, sums.peers,
                                                                out_dtype=h.out_dtype, programs=FEW_CTAS,
                                                                block_t=disp.block_t)),
        "send_tokens": run(lambda: send_tokens(disp, h, x_c)),
        "send_tokens_ce": run(lambda: send_tokens(ce, h, x_c)),
        "sum_back": run(lambda: sum_back(disp, h, y_ND, sums, weighted=True, out_dtype=h.out_dtype)),
        "sum_back_ce": run(lambda: sum_back(ce, h_ce, y_ND, sums, weighted=True, out_dtype=h.out_dtype)),
    }


def beside_gemm(fn, gemm, timed) -> float:
    """Graphed ms of ``fn`` with ``gemm`` on a side stream at the same time (forked before, joined after): what a
    transfer costs while other work wants the SMs (the shared experts run beside dispatch and combine)."""
    return timed(beside(fn, gemm), graph=True)


def graphed(fn):
    """``fn`` captured once in a CUDA graph (after eager warm-up); returns the replay."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    return g.replay


def vdev_ms(x_send, send_splits, group):
    """torch.ops.symm_mem.all_to_all_vdev there and back, or the reason it does not run."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        if not symm_mem.is_nvshmem_available():
            return None, "NVSHMEM not available"
        symm_mem.set_backend("NVSHMEM")
        n, D = x_send.shape
        inp = symm_mem.empty(n, D, dtype=x_send.dtype, device=x_send.device).copy_(x_send)
        out = symm_mem.empty(n * 2, D, dtype=x_send.dtype, device=x_send.device)
        back = symm_mem.empty(n * 2, D, dtype=x_send.dtype, device=x_send.device)
        world = dist.get_world_size(group)
        # schema (torch 2.11): all_to_all_vdev(input, out, in_splits[W], out_splits_offsets[2, W], group)
        in_splits = symm_mem.empty(world, dtype=torch.int64, device=x_send.device)
        out_so = symm_mem.empty(2, world, dtype=torch.int64, device=x_send.device)
        back_so = symm_mem.empty(2, world, dtype=torch.int64, device=x_send.device)
        name = group.group_name
        for t in (inp, out, back, in_splits, out_so, back_so):
            symm_mem.rendezvous(t, name)

        def fn():
            in_splits.copy_(send_splits)
            torch.ops.symm_mem.all_to_all_vdev(inp, out, in_splits, out_so, name)
            torch.ops.symm_mem.all_to_all_vdev(out, back, out_so[0], back_so, name)

        return time_ms(fn), ""
    except Exception as err:  # report, never hide: the table says why
        return None, f"{type(err).__name__}: {str(err).splitlines()[0][:80]}"


def deepep_missing() -> str:
    """'' where ``deep_ep`` imports, else why not (one line)."""
    try:
        importlib.import_module("deep_ep")
    except Exception as err:  # an ImportError, or a build that does not load here
        return f"{type(err).__name__}: {str(err).splitlines()[0][:100] if str(err) else ''}"
    return ""


def deepep_kernels(x, ids, w, group, sms):
    """DeepEP's own layout + dispatch + combine of the received tokens at ``sms`` SMs (no expert-major expansion)."""
    import deep_ep

    deep_ep.Buffer.set_num_sms(sms)
    buf, cfg_d, cfg_c = _buffer(group, x.shape[1] * x.element_size())
    ids = ids.to(deep_ep.topk_idx_t).contiguous()

    def fn():
        n_rank, _, n_expert, in_rank, _ = buf.get_dispatch_layout(ids, E)
        recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=ids, topk_weights=w, num_tokens_per_rank=n_rank,
                                                  is_token_in_rank=in_rank, num_tokens_per_expert=n_expert,
                                                  config=cfg_d)
        buf.combine(recv_x, handle, config=cfg_c)
    return fn


def profile_nvlink(T: int, D: int, sms: int, group, dev, iters: int = 5) -> list[dict]:
    """Kernel time per call of nvlink dispatch + combine + their backward (eager, balanced routing):
    rows {phase, kernel, ms, calls}, phase = the autograd node or forward op around the launch."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile, record_function

    world = dist.get_world_size(group)
    gen = torch.Generator(device=dev).manual_seed(7)
    ids = routing(T, "balanced", gen, dev)
    w = torch.rand(T, K, device=dev, generator=gen).requires_grad_()
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_()
    g = torch.randn(T, D, device=dev, dtype=torch.bfloat16, generator=gen)
    disp = NVLinkDispatcher(E, group, world, 1.5, programs=sms, name="profile")

    def step():
        with record_function("nvlink.dispatch"):
            x_nd, _, h = disp.dispatch(x, ids, w)
        with record_function("nvlink.combine"):
            y = disp.combine(x_nd * 1, h)
        with record_function("nvlink.backward"):
            y.backward(g)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    spans = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events  # host-side ranges only
                   if e.get("cat") == "user_annotation" and e.get("name", "").startswith("nvlink."))
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")  # Triton: cuLaunchKernel
                and "correlation" in e.get("args", {})}
    total: dict = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "kernel":
            continue
        at = launches.get(e["args"].get("correlation"), e["ts"])
        phase = next((n.split(".")[1] for s, t, n in spans if s <= at <= t), "other")
        key = (phase, e["name"][:90])
        ms, calls = total.get(key, (0.0, 0))
        total[key] = (ms + e["dur"] / 1e3, calls + 1)
    rows = [{"phase": p, "kernel": k, "ms": ms / iters, "calls": c / iters} for (p, k), (ms, c) in total.items()]
    order = {"dispatch": 0, "combine": 1, "backward": 2, "other": 3}
    return sorted(rows, key=lambda r: (order[r["phase"]], -r["ms"]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--hidden", default="2048,7168")
    ap.add_argument("--sms", default="64", help="SM budgets: nvlink CTAs for the main table (the first; the nvlink_sms "
                    "default) and, for each, nvlink vs deepep eager (the SM-budget table)")
    ap.add_argument("--only-sms", action="store_true", help="only the SM-budget table (nvlink, deepep, alltoall)")
    ap.add_argument("--label", default="", help="results name: dispatch_ep<N>_<label> (--only-sms: sms by default)")
    ap.add_argument("--sweep", default="8,16,32,64,132", help="nvlink CTAs swept (graphed)")
    ap.add_argument("--block-t", default="1,2,4", help="nvlink tokens per CTA iteration swept (graphed)")
    ap.add_argument("--no-vdev", action="store_true")
    ap.add_argument("--profile", default="", help="TxD: also profile nvlink forward + backward there (kernel table)")
    a = ap.parse_args()
    budgets = [int(s) for s in a.sms.split(",")]
    main_sms = budgets[0]
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    group = dist.group.WORLD
    rows, sweep, by_sms = [], [], []
    no_deepep = deepep_missing()
    if rank == 0 and no_deepep:
        print(f"deepep: skipped (deep_ep does not import: {no_deepep})", flush=True)
    by_budget = a.only_sms or len(budgets) > 1 or not no_deepep  # else the table would repeat the main one
    shapes = [(int(T), int(D)) for T in a.tokens.split(",") for D in a.hidden.split(",")]
    sweep_shapes = {shapes[0], shapes[-1]}
    vdev_note = ""
    for T in map(int, a.tokens.split(",")):
        for D in map(int, a.hidden.split(",")):
            for kind in ("balanced", "skewed"):
                gen = torch.Generator(device=dev).manual_seed(1000 * rank + T + D)
                ids = routing(T, kind, gen, dev)
                w = torch.rand(T, K, device=dev, generator=gen)
                x = torch.randn(T, D, device=dev, dtype=torch.bfloat16, generator=gen)
                e = E // world
                dest_counts = torch.bincount(ids.flatten() // e, minlength=world)
                remote_rows = torch.tensor(float(T * K - dest_counts[rank]), device=dev)
                dist.all_reduce(remote_rows, op=dist.ReduceOp.MAX)  # the busiest rank sets the time
                remote_rows = float(remote_rows)
                need = dest_counts.max().clone()
                dist.all_reduce(need, op=dist.ReduceOp.MAX)
                cf = max(1.0, math.ceil(float(need) * world / (T * K) * 20) / 20)  # no drops, 0.05 steps
                nbytes = int(2 * remote_rows * D * 2)
                dest_TR = (ids // e).unsqueeze(-1) == torch.arange(world, device=dev)
                tokens_R = dest_TR.any(1).sum(0)  # tokens this rank sends to each rank
                remote_tokens = torch.tensor(float(tokens_R.sum() - tokens_R[rank]), device=dev)
                dist.all_reduce(remote_tokens, op=dist.ReduceOp.MAX)
                tok_bytes = int(2 * float(remote_tokens) * D * 2)

                def timed(fn, graph=False, host=False):
                    if host:  # eager: the host's time to issue the call
                        return slowest(host_ms(fn))
                    return slowest(time_ms(graphed(fn) if graph else fn))

                def bench(disp, graph=False, dispatch_only=False, host=False):
                    def fn():
                        with torch.no_grad():
                            x_nd, _, h = disp.dispatch(x, ids, w)
                            if not dispatch_only:
                                disp.combine(x_nd, h)
                    return timed(fn, graph, host)

                t_a2a = bench(AllToAllDispatcher(E, group, world))
                recv_rows = dest_counts.clone()
                dist.all_reduce(recv_rows)  # rows each rank receives
                cf_nv = max(1.0, math.ceil(float(recv_rows.max()) / (T * K) * 100) / 100)  # no drops

                def nvlink(sms, block_t=None, copies="kernel"):
                    return NVLinkDispatcher(E, group, world, cf_nv, programs=sms, name="bench", block_t=block_t,
                                            copies=copies)

                tok_gbs = lambda ms: tok_bytes / (ms * 1e-3) / 1e9  # nvlink's rows: one per (token, rank)
                for sms in budgets if by_budget else []:  # nvlink vs deepep at each SM budget, eager (deepep: no graph)
                    nv = nvlink(sms)
                    with torch.no_grad():
                        x_nd, _, h = nv.dispatch(x, ids, w)
                        want = nv.combine(x_nd, h).float()
                    assert int(h.dropped) == 0
                    r = {"T": T, "D": D, "routing": kind, "ranks": world, "sms": sms,
                         "remote_token_MB": tok_bytes / 2 / 1e6, "alltoall_ms": t_a2a, "nvlink_ms": bench(nv),
                         "nvlink_graph_ms": bench(nv, graph=True)}
                    r["nvlink_GBs"] = tok_gbs(r["nvlink_ms"])
                    if not no_deepep:
                        dp = DeepEPDispatcher(E, group, world, num_sms=sms)
                        with torch.no_grad():
                            x_nd, _, h = dp.dispatch(x, ids, w)
                            got = dp.combine(x_nd, h).float()
                        r["deepep_ms"] = bench(dp)
                        r["deepep_kernels_ms"] = timed(deepep_kernels(x, ids, w, group, sms))
                        r["deepep_GBs"] = tok_gbs(r["deepep_ms"])
                        r["nvlink_vs_deepep"] = r["deepep_ms"] / r["nvlink_ms"]
                        r["deepep_rel_err"] = float((got - want).norm() / want.norm())
                    by_sms.append(r)
                    if rank == 0:
                        print(r, flush=True)
                if a.only_sms:
                    continue
                padded = PaddedDispatcher(E, group, world, cf)
                with torch.no_grad():
                    _, _, h = padded.dispatch(x, ids, w)
                assert int(h.dropped) == 0
                t_pad = bench(padded)

                with torch.no_grad():
                    _, _, h = nvlink(main_sms).dispatch(x, ids, w)
                assert int(h.dropped) == 0
                t_nv = bench(nvlink(main_sms))
                t_nv_host = bench(nvlink(main_sms), host=True)
                t_nv_g = bench(nvlink(main_sms), graph=True)
                t_nv_disp_g = bench(nvlink(main_sms), graph=True, dispatch_only=True)
                fp8 = nvlink(main_sms)  # dispatch_precision = "fp8": token rows cross as e4m3 + a scale per 128 columns
                fp8.wire = "fp8"
                t_fp8_disp_g, t_fp8_g = bench(fp8, graph=True, dispatch_only=True), bench(fp8, graph=True)
                t_pad_g = bench(padded, graph=True)
                # gathered experts' movement (no expert-major copy of the received tokens), checked against
                # nvlink's dispatch + combine with identity experts (both sum bf16 rows in fp32; the owner's
                # per-token sums are rounded to bf16 once before the pull)
                gd = nvlink(main_sms)
                with torch.no_grad():
                    x_nd, _, h = gd.dispatch(x, ids, w)
                    want = gd.combine(x_nd, h).float()
                    got = gathered_round_trip(gd, x, ids, w).float()
                gathered_err = float((got - want).norm() / want.norm())
                y_ND = torch.zeros(nvlink_capacity(T, K, cf_nv), D, device=dev, dtype=torch.bfloat16)

                def gathered_fn():
                    with torch.no_grad():
                        gathered_round_trip(gd, x, ids, w, y_ND)

                t_gat, t_gat_g = timed(gathered_fn), timed(gathered_fn, graph=True)
                # token rows by the copy engines (nvlink_copy = "copy_engine"): same sums in the same order, bitwise equal
                ce = nvlink(main_sms, copies="copy_engine")
                with torch.no_grad():
                    x_nd, _, h = ce.dispatch(x, ids, w)
                    ce_equal = torch.equal(ce.combine(x_nd, h).float(), want)
                    ce_equal &= torch.equal(gathered_round_trip(ce, x, ids, w).float(), got)

                def gathered_ce_fn():
                    with torch.no_grad():
                        gathered_round_trip(ce, x, ids, w, y_ND)

                t_nv_ce, t_nv_ce_g = bench(ce), bench(ce, graph=True)
                t_gat_ce_g = timed(gathered_ce_fn, graph=True)
                mm_a, mm_b = (torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16) for _ in range(2))
                gemm = lambda: torch.mm(mm_a, mm_b)  # noqa: E731
                t_gemm = timed(gemm, graph=True)

                def round_trip(disp):
                    def fn():
                        with torch.no_grad():
                            x_nd, _, h = disp.dispatch(x, ids, w)
                            disp.combine(x_nd, h)
                    return fn

                t_nv_gemm = beside_gemm(round_trip(nvlink(main_sms)), gemm, timed)
                t_nv_ce_gemm = beside_gemm(round_trip(ce), gemm, timed)
                ph = gathered_phases(gd, x, ids, w, y_ND, timed)
                if (T, D) in sweep_shapes and kind == "balanced":
                    def combined(disp):
                        with torch.no_grad():
                            x_nd, _, h = disp.dispatch(x, ids, w)
                            return disp.combine(x_nd, h).clone()

                    ref = combined(nvlink(main_sms, 1))
                    for sms in map(int, a.sweep.split(",")):
                        for bt in map(int, a.block_t.split(",")):
                            same = torch.equal(combined(nvlink(sms, bt)), ref)  # same fp32 sums: bitwise equal
                            ms = bench(nvlink(sms, bt), graph=True)
                            sweep.append({"T": T, "D": D, "routing": kind, "nvlink_sms": sms, "block_t": bt,
                                          "graph_ms": ms, "GBs": tok_bytes / (ms * 1e-3) / 1e9, "equal": same})
                own_slots = int(2 * float(T * K - dest_counts[rank]) * D * 2)
                own_tokens = int(2 * float(tokens_R.sum() - tokens_R[rank]) * D * 2)
                t_copy = slowest(peer_copy_ms(max(own_tokens // 2, 2), rank, world))
                t_slot_copy = slowest(peer_copy_ms(max(own_slots // 2, 2), rank, world))
                # vdev baseline: exact splits of the rank-major send buffer
                from components.moe_echo.ep_layout import send_layout

                lay = send_layout(ids, E, world)
                x_send = x.index_select(0, lay.token_of_sorted_N)
                t_vdev, note = (None, "skipped (--no-vdev)") if a.no_vdev else vdev_ms(x_send, lay.counts_Re.sum(1),
                                                                                         group)
                vdev_note = vdev_note or note
                gbs = lambda ms: nbytes / (ms * 1e-3) / 1e9 if ms else float("nan")  # per-choice rows
                row = {
                    "T": T, "D": D, "routing": kind, "ranks": world, "remote_MB": nbytes / 2 / 1e6,
                    "remote_token_MB": tok_bytes / 2 / 1e6, "slot_copy_ms": t_slot_copy,
                    "padded_cf": cf, "padded_rows_per_peer": padded_capacity(T, K, world, cf),
                    "alltoall_ms": t_a2a, "padded_ms": t_pad, "nvlink_ms": t_nv, "nvlink_host_ms": t_nv_host, "nvlink_sms": main_sms,
                    "nvlink_graph_ms": t_nv_g, "nvlink_dispatch_graph_ms": t_nv_disp_g, "padded_graph_ms": t_pad_g,
                    "fp8_wire_bytes_frac": fp8_wire_bytes(D) / (2 * D), "nvlink_fp8_dispatch_graph_ms": t_fp8_disp_g,
                    "fp8_dispatch_speedup": t_nv_disp_g / t_fp8_disp_g, "nvlink_fp8_graph_ms": t_fp8_g,
                    "fp8_round_trip_speedup": t_nv_g / t_fp8_g,
                    "nvlink_GBs": tok_gbs(t_nv), "nvlink_graph_GBs": tok_gbs(t_nv_g), "nvlink_vs_alltoall": t_a2a / t_nv,
                    "nvlink_graph_vs_alltoall": t_a2a / t_nv_g, "nvlink_frac_of_ceiling": t_copy / t_nv,
                    "nvlink_graph_frac_of_ceiling": t_copy / t_nv_g,
                    "vdev_ms": slowest(t_vdev) if t_vdev else float("nan"), "peer_copy_ms": t_copy,
                    "alltoall_GBs": gbs(t_a2a), "padded_GBs": gbs(t_pad),
                    "vdev_GBs": gbs(t_vdev) if t_vdev else float("nan"), "peer_copy_GBs": tok_gbs(t_copy),
                    "padded_vs_alltoall": t_a2a / t_pad, "padded_frac_of_ceiling": t_copy / t_pad,
                    "gathered_ms": t_gat, "gathered_graph_ms": t_gat_g, "gathered_graph_GBs": tok_gbs(t_gat_g),
                    "gathered_vs_alltoall": t_a2a / t_gat, "gathered_graph_vs_alltoall": t_a2a / t_gat_g,
                    "gathered_graph_frac_of_ceiling": t_copy / t_gat_g, "gathered_rel_err": gathered_err,
                    "nvlink_ce_ms": t_nv_ce, "nvlink_ce_graph_ms": t_nv_ce_g, "gathered_ce_graph_ms": t_gat_ce_g,
                    "nvlink_ce_graph_frac_of_ceiling": t_copy / t_nv_ce_g,
                    "gathered_ce_graph_frac_of_ceiling": t_copy / t_gat_ce_g, "ce_equal": bool(ce_equal),
                    "gemm_ms": t_gemm, "nvlink_beside_gemm_ms": t_nv_gemm, "nvlink_ce_beside_gemm_ms": t_nv_ce_gemm,
                    # one direction of the ceiling against one kernel's writes (send) or reads (pull) of the same bytes
                    "send_kernel_frac_of_copy": t_copy / 2 / ph["send_kernel"],
                    "pull_kernel_frac_of_copy": t_copy / 2 / ph["pull_kernel"],
                    f"send_kernel_c{FEW_CTAS}_frac_of_copy": t_copy / 2 / ph[f"send_kernel_c{FEW_CTAS}"],
                    f"pull_kernel_c{FEW_CTAS}_frac_of_copy": t_copy / 2 / ph[f"pull_kernel_c{FEW_CTAS}"],
                    **{f"{k}_graph_ms": v for k, v in ph.items()},
                }
                rows.append(row)
                if rank == 0:
                    print(row, flush=True)
    profile = a.profile and not a.only_sms
    kernels = profile_nvlink(*map(int, a.profile.split("x")), main_sms, group, dev) if profile else []
    sms_cols = ["T", "D", "routing", "sms", "remote_token_MB", "nvlink_ms"] + \
        ([] if no_deepep else ["deepep_ms", "nvlink_vs_deepep", "deepep_kernels_ms"]) + \
        ["nvlink_graph_ms", "alltoall_ms", "nvlink_GBs"] + ([] if no_deepep else ["deepep_GBs", "deepep_rel_err"])
    sms_note = (f"nvlink vs deepep (DeepEP's intranode kernels, eager) at SM budgets {a.sms}"
                + (f"; deepep skipped ({no_deepep})" if no_deepep else "") + ":\n\n")
    if a.only_sms:
        if rank == 0:
            env = environment()
            env["ranks"] = world
            env["deepep"] = no_deepep or "ran"
            table = sms_note + markdown_table(by_sms, sms_cols)
            stem = write_results(f"dispatch_ep{world}_{a.label or 'sms'}", env, by_sms, table, a.out, gpus=world)
            print(f"\ndispatch+combine by SM budget, EP={world}, {env['gpu']}, torch {env['torch']} ({stem}.json)\n"
                  f"{table}")
        if not no_deepep:
            release_buffers()
        dist.destroy_process_group()
        return
    if rank == 0:
        env = environment()
        env["ranks"] = world
        env["nvlink_kernels"] = kernels
        env["vdev"] = vdev_note or "ran"
        env["nvlink_sms_sweep"] = sweep
        env["sm_budgets"] = by_sms
        env["deepep"] = no_deepep or "ran"
        cols = ["T", "D", "routing", "remote_MB", "remote_token_MB", "alltoall_ms", "padded_ms", "nvlink_ms", "nvlink_host_ms", "vdev_ms",
                "slot_copy_ms", "peer_copy_ms", "padded_graph_ms", "nvlink_graph_ms", "nvlink_dispatch_graph_ms", "alltoall_GBs", "nvlink_GBs",
                "nvlink_graph_GBs", "peer_copy_GBs", "nvlink_vs_alltoall", "nvlink_graph_vs_alltoall",
                "nvlink_frac_of_ceiling", "nvlink_graph_frac_of_ceiling", "padded_vs_alltoall", "gathered_ms",
                "gathered_graph_ms", "gathered_graph_GBs", "gathered_vs_alltoall", "gathered_graph_vs_alltoall",
                "gathered_graph_frac_of_ceiling", "gathered_rel_err"]
        table = markdown_table(rows, cols)
        table += ("\n\nThe fp8 wire (``dispatch_precision = \"fp8\"``), graphed: bytes a token row crosses as, against "
                  "bf16's, and dispatch / dispatch + combine against bf16 at the same CTAs:\n\n"
                  + markdown_table(rows, ["T", "D", "routing", "fp8_wire_bytes_frac", "nvlink_dispatch_graph_ms",
                                          "nvlink_fp8_dispatch_graph_ms", "fp8_dispatch_speedup", "nvlink_graph_ms",
                                          "nvlink_fp8_graph_ms", "fp8_round_trip_speedup"]))
        table += ("\n\nThe gathered round trip in parts, graphed (``gathered_phases``; *_frac_of_copy: one direction of the "
                  "ceiling against that kernel alone):\n\n"
                  + markdown_table(rows, ["T", "D", "routing", "peer_copy_ms", "gathered_graph_ms"]
                                   + [f"{k}_graph_ms" for k in PHASES]
                                   + ["send_kernel_frac_of_copy", "pull_kernel_frac_of_copy",
                                      f"send_kernel_c{FEW_CTAS}_frac_of_copy", f"pull_kernel_c{FEW_CTAS}_frac_of_copy"]))
        table += ("\n\nToken rows by the copy engines (``nvlink_copy = \"copy_engine\"``: the sends and the combine's "
                  "pull) against the kernels (graphed "
                  "unless named eager; ``*_beside_gemm``: the round trip with an 8192³ bf16 GEMM on a side stream):\n\n"
                  + markdown_table(rows, ["T", "D", "routing", "peer_copy_ms", "send_tokens_graph_ms",
                                          "send_tokens_ce_graph_ms", "sum_back_graph_ms", "sum_back_ce_graph_ms",
                                          "nvlink_graph_ms", "nvlink_ce_graph_ms",
                                          "nvlink_ms", "nvlink_ce_ms", "gathered_graph_ms", "gathered_ce_graph_ms",
                                          "nvlink_ce_graph_frac_of_ceiling", "gathered_ce_graph_frac_of_ceiling",
                                          "gemm_ms", "nvlink_beside_gemm_ms", "nvlink_ce_beside_gemm_ms",
                                          "ce_equal"]))
        table += ("\n\nnvlink dispatch + combine (graphed) vs CTAs (≈ SMs) and tokens per CTA iteration:\n\n"
                  + markdown_table(sweep, ["T", "D", "routing", "nvlink_sms", "block_t", "graph_ms", "GBs", "equal"]))
        if by_sms:
            table += "\n\n" + sms_note + markdown_table(by_sms, sms_cols)
        if kernels:
            table += (f"\n\nnvlink forward + backward at {a.profile} (balanced, eager, rank 0's kernels, ms per "
                      "call; barriers include waiting for the peer):\n\n"
                      + markdown_table(kernels, ["phase", "kernel", "ms", "calls"]))
        stem = write_results(f"dispatch_ep{world}" + (f"_{a.label}" if a.label else ""), env, rows, table, a.out,
                             gpus=world)
        print(f"\ndispatch+combine, EP={world}, {env['gpu']}, torch {env['torch']} ({stem}.json); "
              f"all_to_all_vdev: {env['vdev']}\n{table}")
    if not no_deepep:
        release_buffers()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
