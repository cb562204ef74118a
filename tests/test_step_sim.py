"""benchmarks/step_sim.py on CPU: the straggler arithmetic against hand-computed cases, ECHO's
traffic bookkeeping, ECHO never slower in GEMM than off, and the calibration fits reproducing
their own points within the residuals they state."""

import json
import math
import os
from dataclasses import replace

import numpy as np
import pytest
import torch

from benchmarks import step_sim as sim
from components.moe_echo.planner import plan_echo

RESULTS = sim.RESULTS
SHAPE = sim.ModelShape()


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def toy_calibration() -> sim.Calibration:
    """Round constants so every term can be computed by hand."""
    return sim.Calibration(
        gpu="toy", gemm=sim.LinearFit(0.5, 1e-4), gemm_hidden=SHAPE.hidden,
        comm={("nvlink", 2): sim.LinearFit(1.0, 4.0), ("padded", 2): sim.LinearFit(2.0, 5.0)},
        planner_us={(2, 2): 50.0, (8, 2): 80.0}, step_1gpu_ms=100.0, router_ms=0.1, local_permute_ms=1.0,
        token_ms=40.0, param_ms_per_param=1e-8, optimizer_share=0.5)


def test_straggler_layer_and_step_equal_hand_computation():
    cal, R, E = toy_calibration(), 2, 4
    # source rows: rank 0 -> experts 0,1 (rank 0) and 2,3 (rank 1)
    counts = torch.tensor([[3000, 1000, 500, 500], [2000, 2000, 400, 100]])
    load = sim.layer_load(counts, 0)
    assert load.rows_R.tolist() == [8000, 1500]
    cfg = sim.SimConfig(R, experts=E, backend="nvlink")
    t = sim.layer_ms(load, cfg, cal, SHAPE)
    gemm = [0.5 + 1e-4 * 8000, 0.5 + 1e-4 * 1500]
    # nvlink: busiest rank sends or receives 1000 (rank 0 -> 1) vs 4000 (rank 1 -> 0) remote rows
    gb = 2 * 4000 * SHAPE.dim * 2 / 1e9
    comm = 2 * (1.0 + 4.0 * gb)
    assert t["gemm"] == pytest.approx(max(gemm))
    assert t["gemm_mean"] == pytest.approx(sum(gemm) / 2)
    assert t["comm"] == pytest.approx(comm)
    assert t["echo"] == 0.0
    assert t["total"] == pytest.approx(0.1 + comm + max(gemm))
    # step: non-MoE (token + parameters / R + FSDP bytes at the padded fit's ms per GB) + Σ layers
    step = sim.simulate_step([load, load, load], cfg, cal, SHAPE)
    params = (SHAPE.dense_params + SHAPE.expert_params(E)) / R
    fsdp_gb = ((2 * SHAPE.dense_params - SHAPE.root_params) * 2 + SHAPE.dense_params * 4) / 2 / 1e9
    expect = 40.0 + 1e-8 * params + 5.0 * fsdp_gb + 3 * t["total"]
    assert step["step_ms"] == pytest.approx(expect)
    assert step["tokens_per_s"] == pytest.approx(R * SHAPE.tokens_per_rank / expect * 1e3)


def test_padded_comm_depends_on_capacity_not_routing():
    cal = toy_calibration()
    a = sim.layer_load(torch.tensor([[3000, 1000, 500, 500], [2000, 2000, 400, 100]]), 0)
    b = sim.layer_load(torch.tensor([[1250, 1250, 1250, 1250], [1250, 1250, 1250, 1250]]), 0)
    cfg = sim.SimConfig(2, experts=4, backend="padded", capacity_factor=1.5)
    C = sim.padded_capacity(SHAPE.tokens_per_rank, SHAPE.top_k, 2, 1.5)
    expect = 2 * (2.0 + 5.0 * 2 * C * SHAPE.dim * 2 / 1e9)
    assert sim.layer_ms(a, cfg, cal, SHAPE)["comm"] == pytest.approx(expect)
    assert sim.layer_ms(b, cfg, cal, SHAPE)["comm"] == pytest.approx(expect)


@pytest.mark.parametrize("R,E,S,seed", [(4, 32, 1, 0), (4, 32, 2, 1), (8, 64, 2, 2), (8, 64, 1, 3)])
def test_echo_traffic_matches_plan(R, E, S, seed):
    counts = sim.zipf_counts(R, E, 1.2, 512, 4, seed)
    load = sim.layer_load(counts, S)
    plan = plan_echo(counts, S)
    assert torch.equal(load.rows_R, plan.load_after_R)  # rows computed = the planner's loads
    assert torch.equal(load.traffic_RR.sum(1), counts.sum(1))  # every source's rows go somewhere
    used = int((plan.slot_expert_G >= 0).sum())
    assert int(load.clones_recv_R.sum()) == used == int(load.clones_send_R.sum())
    assert (load.clones_recv_R <= S).all()


@pytest.mark.parametrize("seed", range(4))
def test_echo_on_never_slower_gemm_than_off(seed):
    """With the planner's plan the straggler GEMM is never slower than off; with the padded
    dispatcher (traffic fixed by the capacity) the layer is never slower than off plus ECHO's own
    costs (planner + multicast)."""
    cal, R, E = toy_calibration(), 8, 64
    counts = sim.zipf_counts(R, E, 1.2, 512, 6, seed) * 32
    load_off, load_on = sim.layer_load(counts, 0), sim.layer_load(counts, 2)
    assert load_on.load_after <= load_on.load_before
    for backend in ("nvlink", "padded"):
        off = sim.layer_ms(load_off, sim.SimConfig(R, experts=E, backend=backend), cal, SHAPE)
        on = sim.layer_ms(load_on, sim.SimConfig(R, experts=E, slots=2, backend=backend), cal, SHAPE)
        assert on["gemm"] <= off["gemm"] + 1e-9
        assert on["echo"] > 0
        if backend == "padded":
            assert on["total"] <= off["total"] + on["echo"] + 1e-9


def test_balanced_load_gains_nothing_but_pays_echo():
    cal, R, E = toy_calibration(), 2, 4
    counts = torch.full((R, E), 1000)
    off = sim.layer_ms(sim.layer_load(counts, 0), sim.SimConfig(R, experts=E), cal, SHAPE)
    load = sim.layer_load(counts, 2)
    on = sim.layer_ms(load, sim.SimConfig(R, experts=E, slots=2), cal, SHAPE)
    assert int(load.clones_recv_R.sum()) == 0
    assert on["gemm"] == pytest.approx(off["gemm"])
    assert on["echo"] == pytest.approx(50e-3)  # the planner runs anyway; nothing to multicast


@pytest.fixture(scope="module")
def h200():
    torch.set_num_threads(1)
    return sim.calibrate("H200", RESULTS, SHAPE)


def test_gemm_fit_reproduces_its_points_within_stated_residual(h200):
    fit = h200.gemm
    assert len(fit.points) == 24
    assert fit.rms_rel < 0.05 and fit.max_rel < 0.10  # the stated quality of the adopted form
    pts = sim.echo_sim_points(os.path.join(RESULTS, "echo_sim_1xH200.json"))
    rel = []
    for (kind, ranks, ms), p in zip(pts, fit.points):
        t = h200.gemm_ms(torch.stack([r.sum() for r in ranks]), h200.gemm_hidden)
        pred = float(t.max() if kind == "max" else t.mean())
        rel.append(pred / ms - 1)
        assert rel[-1] == pytest.approx(p["rel_err"], abs=1e-9)
    assert max(map(abs, rel)) <= fit.max_rel + 1e-12
    assert math.sqrt(np.mean(np.square(rel))) == pytest.approx(fit.rms_rel)
    # 1408-wide rows cost more than the 768-wide ones (FLOP scaling), and both are positive
    rows = torch.tensor([1000, 50000])
    assert (h200.gemm_ms(rows, 768) < h200.gemm_ms(rows, 1408)).all() and (h200.gemm_ms(rows, 768) > 0).all()


def test_dispatch_fits_are_physical_and_within_stated_residual(h200):
    for (backend, ep), fit in h200.comm.items():
        gbs = 1e3 / fit.slope
        assert 50 < gbs < 900, (backend, ep, gbs)  # between PCIe-like and the NVLink line rate
        assert 0 < fit.intercept < 5
        assert max(abs(p["rel_err"]) for p in fit.points) == pytest.approx(fit.max_rel)
        for p in fit.points:
            assert fit(p["GB"]) / p["ms"] - 1 == pytest.approx(p["rel_err"], abs=1e-9)


def test_one_gpu_step_is_the_calibration_anchor(h200):
    """EP=1 with the 1-GPU token count reproduces the measured 1-GPU step (non-MoE is its remainder)."""
    counts = sim.hot_counts(1, 64, 8, SHAPE.tokens_per_rank, SHAPE.top_k, 0)
    step = sim.simulate([[counts] * SHAPE.moe_layers], sim.SimConfig(1), h200, SHAPE)
    assert step["step_ms"] == pytest.approx(h200.step_1gpu_ms)
    assert 0 < step["nonmoe"]["param"] < step["nonmoe"]["token"]


def test_measured_windows_are_quoted_from_their_files():
    for run in sim.measured_runs():
        with open(os.path.join(RESULTS, run.source)) as f:
            assert run.windows in f.read(), run.name
        assert 1e5 < run.tokens_per_s() < 1e6


# ----------------------------------------------------------------------------- across hosts

def test_dispatch_bytes_equal_hand_computation():
    """H=2, L=2, T=64, K=6, cf=1.25, D=16 (bf16 rows of 32 B):
    flat C = round_up(ceil(1.25·64·6/4), 8) = 120: (4 - 2)·120 rows over the network, 1·120 over NVLink;
    C1 = min(64, round_up(240, 8)) = 64, C2 = round_up(ceil(1.25·384/2), 8) = 240."""
    cl = sim.Cluster(2, 2, nvlink_gbs=400.0, network_gbs=50.0)
    assert sim.hier_capacities(64, 6, 2, 2, 1.25) == (64, 240)
    flat = sim.dispatch_legs("padded", cl, 64, 16, 6, 1.25)
    assert [(l.network_bytes, l.nvlink_bytes) for l in flat["dispatch"]] == [(2 * 120 * 32, 120 * 32)]
    assert [(l.network_bytes, l.nvlink_bytes) for l in flat["combine"]] == [(2 * 120 * 32, 120 * 32)]
    hier = sim.dispatch_legs("hierarchical", cl, 64, 16, 6, 1.25)
    # network leg: 64 rows of 32 B + 6 int32 ids + 6 fp32 weights each; NVLink leg: 240 rows of 32 B
    assert [(l.network_bytes, l.nvlink_bytes) for l in hier["dispatch"]] == [(64 * (32 + 48), 0), (0, 240 * 32)]
    assert [(l.network_bytes, l.nvlink_bytes) for l in hier["combine"]] == [(0, 240 * 32), (64 * 32, 0)]
    assert sim.network_bytes(flat) == 15360 and sim.network_bytes(hier) == 7168
    # all ranks together: 4 × what one sends (every rank sends its fixed blocks)
    assert sim.network_bytes(flat, total=True) == 4 * 15360 and sim.network_bytes(hier, total=True) == 4 * 7168
    # time: fixed 0.1 ms per collective + the slower link class; legs in sequence
    flat_ms = 2 * (0.1 + max(7680 / 50, 3840 / 400) / 1e6)
    hier_ms = 4 * 0.1 + (5120 / 50 + 7680 / 400 + 7680 / 400 + 2048 / 50) / 1e6
    assert sim.round_trip_ms(flat, cl, 0.1) == pytest.approx(flat_ms, rel=1e-12)
    assert sim.round_trip_ms(hier, cl, 0.1) == pytest.approx(hier_ms, rel=1e-12)
    # one host: no network leg; one GPU per host: no NVLink leg
    assert [l.name for l in sim.dispatch_legs("hierarchical", sim.Cluster(1, 4), 64, 16, 6, 1.25)["dispatch"]] == ["nvlink"]
    assert [l.name for l in sim.dispatch_legs("hierarchical", sim.Cluster(2, 1), 64, 16, 6, 1.25)["dispatch"]] == ["network"]


@pytest.mark.parametrize("L", [1, 2, 8])
@pytest.mark.parametrize("K", [2, 4, 6, 8])
def test_hierarchical_sends_fewer_network_bytes_than_flat_at_two_hosts(L, K):
    """Flat sends (H - 1)·L·C ≈ cf·T·K/2 rows to the other host, hierarchical at most T (+ 8·K bytes of
    ids and weights per row): fewer bytes and less network time for K ≥ 2 at cf ≥ 1.1 and D ≥ 256."""
    cl = sim.Cluster(2, L)
    for T in (64, 1000, 16384):
        for cf in (1.1, 1.25, 2.0):
            for D in (256, 2048):
                flat = sim.dispatch_legs("padded", cl, T, D, K, cf)
                hier = sim.dispatch_legs("hierarchical", cl, T, D, K, cf)
                assert sim.network_bytes(hier) < sim.network_bytes(flat), (T, cf, D)
                net_ms = lambda legs: sum(l.network_bytes for l in legs["dispatch"] + legs["combine"]) / 50  # noqa: E731
                assert net_ms(hier) < net_ms(flat)


def test_routing_ids_are_the_count_models_draws():
    ids = sim.routing_ids(4, 32, 6, "zipf1.2", 256, 5)
    counts = torch.stack([torch.bincount(ids[r].flatten(), minlength=32) for r in range(4)])
    assert torch.equal(counts, sim.zipf_counts(4, 32, 1.2, 256, 6, 5))
    hot = sim.routing_ids(4, 32, 6, "hot8", 256, 3)
    counts = torch.stack([torch.bincount(hot[r].flatten(), minlength=32) for r in range(4)])
    assert torch.equal(counts, sim.hot_counts(4, 32, 8, 256, 6, 3))
    assert all(len(set(t.tolist())) == 6 for t in ids[0])  # K distinct experts per token


@pytest.mark.parametrize("seed", range(3))
def test_echo_token_rewrite_reproduces_plan_traffic(seed):
    """Applying the planner's quotas token by token sends exactly layer_load's rows per (source, destination)."""
    R, E, S = 4, 16, 2
    ids = sim.routing_ids(R, E, 4, "hot4" if seed == 0 else "zipf1.2", 300, seed)
    counts = torch.stack([torch.bincount(ids[r].flatten(), minlength=E) for r in range(R)])
    plan = plan_echo(counts, S)
    load = sim.layer_load(counts, S, plan=plan)
    assert int((plan.quota_RG > 0).sum()) > 0
    for r in range(R):
        dest = sim.echo_dest_TK(ids[r], ids[r] // (E // R), plan.quota_RG[r], plan.slot_expert_G, S)
        assert torch.equal(torch.bincount(dest.flatten(), minlength=R), load.traffic_RR[r])


def test_unique_host_rows_and_clone_bytes():
    """Hierarchical real rows are unique (token, host) pairs: at most T per host and fewer than the flat
    (token, expert) pairs at K ≥ 2; ECHO's clones of host 0's hot experts placed on host 1 cross the network."""
    cl, E, K, T = sim.Cluster(2, 2), 16, 4, 512
    shape = sim.ModelShape(experts=E, top_k=K, tokens_per_rank=T, moe_layers=1)
    ids = sim.routing_ids(4, E, K, "zipf1.2", T, 0)
    layer = sim.host_layer(ids, E, 0, cl)
    assert (layer.unique_RH <= T).all() and (layer.unique_RH.sum(1) >= T).all()
    host_TK = ids[0] // (E // 4) // 2
    assert int(layer.unique_RH[0, 1]) == int((host_TK == 1).any(1).sum())
    flat = sim.real_network_gb(layer, sim.HostRun(cl, "padded", E), shape)
    hier = sim.real_network_gb(layer, sim.HostRun(cl, "hierarchical", E), shape)
    assert 0 < hier < flat
    hot_ids = sim.routing_ids(4, E, K, "hot4", T, 0)  # experts 0-3: rank 0, host 0
    hot = sim.host_layer(hot_ids, E, 2, cl)
    off = int((hot.clone_home_G // 2 != hot.clone_rank_G // 2).sum())
    assert off > 0 and (hot.clone_home_G == 0).all()
    cal = toy_calibration()
    t = sim.host_layer_ms(hot, sim.HostRun(cl, "hierarchical", E, slots=2), cal, shape)
    flat_t = sim.host_layer_ms(hot, sim.HostRun(cl, "padded", E, slots=2), cal, shape)
    w = 3 * shape.dim * shape.hidden * 2
    # fixed blocks of S = 2 experts, forward and back: one per other host (hierarchical), one per other-host rank
    assert t["clone_network_gb"] == pytest.approx(2 * 1 * 2 * w / 1e9)
    assert flat_t["clone_network_gb"] == pytest.approx(2 * 2 * 2 * w / 1e9)
    # every choice on rank 0 overflows its blocks without ECHO; the plan's rewrite spreads them to fit
    run_off = sim.HostRun(cl, "hierarchical", E)
    assert sim.host_fill(sim.host_layer(hot_ids, E, 0, cl), run_off, T, K) > 1.5 >= 1.0 >= t["fill"]
    assert t["comm"] == pytest.approx(2 * sim.round_trip_ms(
        sim.dispatch_legs("hierarchical", cl, T, shape.dim, K, 1.25), cl, sim.default_collective_ms(cal)))


def synthetic_rows(network_gbs: float, collective_ms: float, shared: bool = True, machine: str = "m1") -> list[dict]:
    """Dispatch + combine rows at 2 × 1 and 2 × 2, generated by the model itself (``network_gbs``: the
    aggregate with ``shared``, else per GPU); alltoall with a skewed busiest rank (its network_rows)."""
    rows = []
    for disp in ("padded", "hierarchical", "alltoall"):
        for L in (1, 2):
            for T in (2048, 8192):
                r = {"dispatcher": disp, "hosts": 2, "gpus_per_host": L, "tokens_per_rank": T, "hidden": 2048,
                     "top_k": 6, "experts": 64, "capacity_factor": 1.25, "machine": machine}
                if disp == "alltoall":
                    r["network_rows"] = 0.8 * T * 6
                r["dispatch_combine_ms"] = sim.predicted_round_trip_ms(r, network_gbs, collective_ms,
                                                                       shared_network=shared)
                rows.append(r)
    return rows


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("gbs,lat", [(3.0, 0.4), (20.0, 0.05), (150.0, 1.0)])
def test_calibrate_hosts_recovers_the_generating_bandwidth(gbs, lat, shared):
    """Shared: the aggregate GB/s of one machine's socket path; else per GPU. Each recovered within 1%."""
    got = sim.calibrate_hosts(synthetic_rows(gbs, lat, shared), shared_network=shared)
    assert got["fit_rows"] == 12
    assert got["network_gbs"] == {"m1": pytest.approx(gbs, rel=0.01)}
    assert got["collective_ms"] == pytest.approx(lat, rel=0.01)
    assert all(c["within_15pct"] for c in got["checks"]) and len(got["checks"]) == 12
    assert got["rms_rel"] < 1e-6


def test_shared_link_fit_recovers_aggregate_per_machine_and_fsdp_share():
    """Two machines on shared links: m1 with dispatch rows (aggregate 4 GB/s, 0.8 ms per collective) and
    step rows, m2 (aggregate 7 GB/s) with step rows only; every step generated at FSDP exposed share 0.4.
    The fit recovers each within 1%."""
    cal, A1, A2, lat, phi = toy_calibration(), 4.0, 7.0, 0.8, 0.4
    rows = synthetic_rows(A1, lat)
    for disp, machine in (("padded", "m1"), ("hierarchical", "m1"), ("padded", "m2"), ("hierarchical", "m2")):
        r = {"dispatcher": disp, "hosts": 2, "gpus_per_host": 2 if machine == "m2" else 1, "tokens_per_rank": 1024,
             "hidden": 2048, "top_k": 6, "experts": 64, "capacity_factor": 2.0, "machine": machine, "step_ms": 1.0}
        model = sim._row_models([sim.host_row(r)], 400.0, True, cal, SHAPE, 1, {})[0]
        r["step_ms"] = model.ms(lat, A1 if machine == "m1" else A2, phi)
        rows.append(r)
    got = sim.calibrate_hosts(rows, cal=cal, steps=1)
    assert got["network_gbs"] == {"m1": pytest.approx(A1, rel=0.01), "m2": pytest.approx(A2, rel=0.01)}
    assert got["collective_ms"] == pytest.approx(lat, rel=0.01)
    assert got["fsdp_exposed"] == pytest.approx(phi, abs=0.002)
    assert got["rows_per_machine"] == {"m1": {"dispatch": 12, "step": 2}, "m2": {"dispatch": 0, "step": 2}}
    assert all(c["within_15pct"] for c in got["checks"]) and got["rms_rel"] < 1e-3


def test_shared_link_halves_per_gpu_rate_at_two_by_two_for_flat_padded():
    """T=64, K=6, cf=1.25, D=16 (rows of 32 B), one aggregate A = 10 GB/s shared by every rank.
    2 × 1: C = round_up(ceil(1.25·64·6/2), 8) = 240, each rank sends 1·240 rows = 7680 B to the other host;
    2 ranks send at once: 15360 B over A, so each GPU moves its 7680 B at A/2 = 5 GB/s.
    2 × 2: C = 120, each rank sends (4 - 2)·120 rows = 7680 B (the same) but 4 ranks send at once: 30720 B
    over A, A/4 = 2.5 GB/s per GPU: half. Per-GPU links (one NIC each) give both 7680 B at the per-GPU rate.
    Hierarchical at 2 × 2: C1 = 64 rows (+ 48 B of ids and weights on dispatch), 2 pairs = 4 ranks at once."""
    A = 10.0
    one = sim.Cluster(2, 1, network_gbs=A, shared_network=True)
    two = sim.Cluster(2, 2, network_gbs=A, shared_network=True)
    leg1 = sim.dispatch_legs("padded", one, 64, 16, 6, 1.25)["dispatch"][0]
    leg2 = sim.dispatch_legs("padded", two, 64, 16, 6, 1.25)["dispatch"][0]
    assert (leg1.network_bytes, leg1.network_total_bytes) == (7680, 15360)
    assert (leg2.network_bytes, leg2.network_total_bytes, leg2.nvlink_bytes) == (7680, 30720, 3840)
    ms1, ms2 = sim.leg_ms(leg1, one, 0.0), sim.leg_ms(leg2, two, 0.0)
    assert ms1 == pytest.approx(15360 / A / 1e6, rel=1e-12) and ms2 == pytest.approx(30720 / A / 1e6, rel=1e-12)
    gpu_rate = lambda leg, ms: leg.network_bytes / ms / 1e6  # noqa: E731  GB/s one GPU sees
    assert gpu_rate(leg1, ms1) == pytest.approx(A / 2) and gpu_rate(leg2, ms2) == pytest.approx(A / 4)
    per_gpu = [sim.leg_ms(l, replace(c, shared_network=False), 0.0) for l, c in ((leg1, one), (leg2, two))]
    assert per_gpu[0] == per_gpu[1] == pytest.approx(7680 / A / 1e6, rel=1e-12)
    hier = sim.dispatch_legs("hierarchical", two, 64, 16, 6, 1.25)["dispatch"][0]
    assert (hier.network_bytes, hier.network_total_bytes) == (64 * 80, 4 * 64 * 80)
    assert sim.leg_ms(hier, two, 0.1) == pytest.approx(0.1 + 4 * 64 * 80 / A / 1e6, rel=1e-12)
    # alltoall: all ranks together move (R - L)·T·K rows whatever the skew
    a2a = sim.dispatch_legs("alltoall", two, 64, 16, 6, 1.25)["combine"][0]
    assert a2a.network_total_bytes == 2 * 64 * 6 * 32


def test_fsdp_on_a_shared_link_crosses_the_hosts_on_the_ring():
    """FSDP: a rank sends (R - 1)/R of fsdp_gb; per-GPU links: that at the per-GPU rate (the one-host
    model's value, so the predictions keep it); shared: the ring's H = 2 host-crossing edges each carry it,
    at the aggregate rate, × fsdp_exposed."""
    gb = sim.fsdp_gb(SHAPE) * 3 / 4
    ms, total = sim.host_fsdp(sim.Cluster(2, 2, network_gbs=8.0, shared_network=True, fsdp_exposed=0.5), SHAPE)
    assert total == pytest.approx(2 * gb) and ms == pytest.approx(0.5 * 2 * gb * 1e3 / 8.0)
    ms, _ = sim.host_fsdp(sim.Cluster(2, 2, network_gbs=50.0), SHAPE)
    cfg = sim.SimConfig(4, gpus_per_host=2, inter_host_gbs=50.0)
    assert ms == pytest.approx(sim.nonmoe_ms(cfg, toy_calibration(), SHAPE)["fsdp"], rel=1e-12)


def test_compute_scale_is_the_ratio_of_one_gpu_steps(h200):
    h100 = sim.one_gpu_step_ms("NVIDIA H100 80GB HBM3")
    assert h100 and sim.one_gpu_step_ms("NVIDIA H200")
    assert sim.compute_scale("NVIDIA H100 80GB HBM3", h200) == pytest.approx(h100 / sim.one_gpu_step_ms("NVIDIA H200"))
    assert sim.compute_scale("NVIDIA H200", h200) == 1.0 and sim.compute_scale("no such GPU", h200) == 1.0


def test_emulated_measurements_within_15pct(h200):
    """The committed emulated-cluster rows: every one within 15% of the shared-network model, except rows
    no model of bytes can fit (a group of rows with the same bytes measured more than 1.15 / 0.85 apart) and the
    one named below."""
    got = sim.calibrate_hosts(sim.read_host_rows(RESULTS), cal=h200, shape=SHAPE)
    assert got["fit_rows"] >= 37 and got["rms_rel"] < 0.1
    unfittable = {r for g in got["spread"] if g["max_over_min"] > 1.15 / 0.85 for r in g["rows"]}
    off = [(c["source"], c["dispatcher"], c["quantity"], round(c["ratio"], 3)) for c in got["checks"]
           if not c["within_15pct"] and c["row"] not in unfittable]
    # one fittable row misses: hierarchical, skewed, T=4096 on 2 x 1 H200 measured 22.8 ms against its uniform twin's
    # 18.8 (same bytes; predicted 18.0). Any other row outside 15%, or this one further off, fails
    assert [o[:3] for o in off] in ([], [("dispatch_hosts_fp8_wire_2xH200.json", "hierarchical", "dispatch_combine_ms")])
    assert all(o[3] > 0.75 for o in off)
    assert sum(not c["within_15pct"] for c in got["checks"]) <= 3
    assert 0 < got["fsdp_exposed"] < 1 and got["collective_ms"] >= 0


def test_calibrate_hosts_flags_a_row_off_by_30pct():
    rows = synthetic_rows(3.0, 0.4)
    rows[5]["dispatch_combine_ms"] *= 1.3
    got = sim.calibrate_hosts(rows)
    flags = {c["row"]: c["within_15pct"] for c in got["checks"]}
    assert flags[5] is False
    assert all(ok for i, ok in flags.items() if i != 5)
    # with FSDP's share given, a step row has no parameter of its own: one 30% above the model's own
    # prediction is flagged, the prediction itself passes
    cal = toy_calibration()
    step = {"dispatcher": "hierarchical", "hosts": 2, "gpus_per_host": 2, "tokens_per_rank": 1024, "hidden": 2048,
            "top_k": 6, "experts": 64, "capacity_factor": 1.25, "step_ms": 100.0, "network_gbs": 3.0, "machine": "m1"}
    pred = [c for c in sim.calibrate_hosts(rows[:4] + [step], cal=cal, steps=1, fsdp_exposed=1.0)["checks"]
            if c["quantity"] == "step_ms"]
    p = pred[0]["predicted"]
    assert p > 0
    got = sim.calibrate_hosts(rows[:4] + [{**step, "step_ms": p}, {**step, "step_ms": 1.3 * p}], cal=cal, steps=1,
                              fsdp_exposed=1.0)
    steps = [c for c in got["checks"] if c["quantity"] == "step_ms"]
    assert [c["within_15pct"] for c in steps] == [True, False]
    assert steps[1]["ratio"] == pytest.approx(1 / 1.3)


def test_read_host_rows_skips_missing_files_and_incomplete_rows(tmp_path):
    assert sim.read_host_rows(str(tmp_path)) == []
    good = {"dispatcher": "padded", "hosts": 2, "gpus_per_host": 2, "tokens_per_rank": 4096, "hidden": 2048,
            "top_k": 6, "experts": 64, "capacity_factor": 1.25, "dispatch_combine_ms": 12.5}
    rows = [good, {**good, "hidden": None}, {**good, "dispatcher": "nccl"}, {**good, "dispatch_combine_ms": None},
            {k: v for k, v in good.items() if k != "capacity_factor"}, "not a row",
            {**good, "dispatcher": "alltoall", "capacity_factor": None, "network_gbs": "2.5",
             "dispatch_combine_ms": None}]
    (tmp_path / "dispatch_hosts_2x2.json").write_text(json.dumps({"env": {}, "rows": rows}))
    (tmp_path / "e2e_hosts_2x2.json").write_text("{not json")
    (tmp_path / "e2e_hosts_empty.json").write_text(json.dumps({"rows": "none"}))
    (tmp_path / "dispatch_ep2_x.json").write_text(json.dumps({"rows": [good]}))  # not a host file
    got = sim.read_host_rows(str(tmp_path))
    assert [(r["dispatcher"], r["dispatch_combine_ms"], r["network_gbs"]) for r in got] == [
        ("padded", 12.5, None), ("alltoall", None, 2.5)]
    assert {r["source"] for r in got} == {"dispatch_hosts_2x2.json"}
    assert {r["machine"] for r in got} == {"2x2"}
    # alltoall moves its measured real rows when the row has them: 1000 rows across, 500 on NVLink (L - 1 = 1 of 2)
    a2a = {**good, "dispatcher": "alltoall", "network_rows": 1000}
    ms = sim.predicted_round_trip_ms(sim.host_row(a2a), 50.0, 0.1)
    assert ms == pytest.approx(3 * 0.1 + 2 * max(1000 * 4096 / 50, 500 * 4096 / 400) / 1e6)
    # on a shared link all ranks together move (R - L)·T·K = 2·4096·6 rows, whatever the busiest rank sends
    ms = sim.predicted_round_trip_ms(sim.host_row(a2a), 50.0, 0.1, shared_network=True)
    assert ms == pytest.approx(3 * 0.1 + 2 * max(2 * 4096 * 6 * 4096 / 50, 500 * 4096 / 400) / 1e6)


def test_fp8_wire_shrinks_only_the_legs_toward_the_experts():
    """dispatch_precision = "fp8" in the model: the dispatch legs' rows are D + 4·D/128 bytes, the combine legs keep
    2·D."""
    cl = sim.Cluster(2, 4)
    for disp in ("padded", "hierarchical", "alltoall"):
        bf, f8 = (sim.dispatch_legs(disp, cl, 4096, 2048, 6, 1.25, wire=w) for w in ("bf16", "fp8"))
        assert [l.network_bytes for l in f8["combine"]] == [l.network_bytes for l in bf["combine"]]
        out_bf, out_f8 = (sum(l.network_bytes + l.nvlink_bytes for l in legs["dispatch"]) for legs in (bf, f8))
        meta = 0 if disp != "hierarchical" else (2 - 1) * sim.hier_capacities(4096, 6, 2, 4, 1.25)[0] * sim.META_BYTES * 6
        assert abs((out_f8 - meta) / (out_bf - meta) - (2048 + 4 * 16) / (2 * 2048)) < 1e-12, disp
