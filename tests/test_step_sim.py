"""benchmarks/step_sim.py on CPU: the straggler arithmetic against hand-computed cases, ECHO's
traffic bookkeeping, ECHO never slower in GEMM than off, and the calibration fits reproducing
their own points within the residuals they state."""

import math
import os

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
    return sim.calibrate("NVIDIA_H200", RESULTS, SHAPE)


def test_gemm_fit_reproduces_its_points_within_stated_residual(h200):
    fit = h200.gemm
    assert len(fit.points) == 24
    assert fit.rms_rel < 0.05 and fit.max_rel < 0.10  # the stated quality of the adopted form
    pts = sim.echo_sim_points(os.path.join(RESULTS, "echo_sim_NVIDIA_H200.json"))
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
