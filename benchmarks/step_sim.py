"""Step-time model of one training step per EP rank, ECHO on vs off, calibrated from measurements.

A step is, per EP rank (R ranks, T tokens each, bf16, eager):

    step = non-MoE(token part + parameter part / R + FSDP traffic)
         + Σ_MoE layers [ router + dispatch/combine (fwd + bwd) + max_r GEMM_r + ECHO extras ]

where max_r is the straggler: every layer ends in the combine, which waits for the slowest rank.
Terms and where each constant comes from (benchmarks/results/, nothing else):

- GEMM_r: grouped SwiGLU fwd+bwd of rank r's rows (home experts minus what moved, plus echo
  slots): ms = a + b · rows · H / H_cal, (a, b) fitted to echo_sim_1x<GPU>.json (every simulated
  rank's time at H_cal = 1408, the straggler before/after ECHO and the mean rank; the rows are
  rebuilt exactly from its seeds and its planner rule). Per-group terms did not improve the fit
  (reported as alternatives); hidden H scales b by FLOPs.
- dispatch + combine: ms = t0 + GB / (GB/s) per backend and EP, fitted to dispatch_ep{2,4}_{2,4}x<GPU>.json
  (eager columns). GB = rows the bottleneck rank moves there and back × D × 2 B: padded moves its
  fixed blocks ((R - 1) · C rows, C from the capacity factor); nvlink moves real rows, and the
  bottleneck is the rank that sends or receives the most. Backward = forward (an assumption).
- ECHO: planner (planner_time_1x<GPU>.json, CUDA-graph µs) + clone weight multicast forward and the
  clones' gradient return backward, bytes / the backend's fitted GB/s (padded: every (home, slot)
  block of R·S per weight; nvlink: only the clones).
- non-MoE: the 1-GPU step (scaling_4x<GPU>.md, EP=1 row) minus its modelled MoE layers; split by the
  1-GPU profile (step_breakdown_v2lite_1b_gpu_*_1xH100.json) into a per-token part (same on every rank)
  and a per-parameter part (optimizer, weight casts, clipping: FSDP2/EP shard them, so ∝ the
  rank's parameters). FSDP2's all-gathers and reduce-scatters of the dense parameters are added
  as exposed (no overlap), at the NCCL rate of the padded fit.
- beyond EP=4 (nothing measured there): the EP=4 dispatch fit (per-GPU bandwidth kept, one NVLink
  domain), or with ``gpus_per_host`` off-host bytes at an assumed ``inter_host_gbs`` (50 GB/s).
Loads: the routing model of benchmarks/planner.py (Gumbel top-K over a popularity; Zipf on a random
expert permutation, optionally drifting; or N hot experts on rank 0 like --moe_echo.debug_hot_experts;
SAMPLE_TOKENS drawn per rank, counts scaled to T), plans from the real planner
(components/moe_echo/planner.plan_echo, rule "fill"). Not modelled: host launch time (eager steps),
overlap of any kind, overflow replays, ECHO's routing rewrite and clone-weight concatenation.

The validation table compares the model with the EP=2 / EP=4 training runs (none of which is used
by any fit); only then come the EP=8 / 16 / 64 predictions.

Across hosts (the host tables, printed last): H hosts × L GPUs, EP rank r on host r // L, two link
classes per GPU and direction, NVLink inside a host (--nvlink-gbs, 400) and the network between hosts
(--network-gbs, 50; assumed, one NIC per GPU). Per MoE layer and direction (dispatch, combine; the
backward moves the same bytes again), bf16 rows of D:
- flat ``padded``: one all_to_all of C = round_up(ceil(cf·T·K/R), 8) rows per (source, destination):
  (R - L)·C rows over the network and (L - 1)·C over NVLink, at once.
- ``hierarchical``: a network leg of C1 = min(round_up(T, 8), round_up(ceil(cf·T·(1-(1-1/H)^K)), 8)) rows per
  (source, host) to the same local index there ((H - 1)·C1 rows, + K int32 ids and K fp32 weights per
  row on dispatch), then an NVLink leg of C2 = round_up(ceil(cf·T·K/L), 8) rows per (entry, owner)
  ((L - 1)·C2 rows); combine runs the NVLink leg back, then one partial sum per (token, host) crosses.
A leg costs a fixed ms per collective (--collective-ms; default half the one-host padded fit's
intercept: launch, layout and latency together) + max over link classes of bytes / GB/s; legs run one
after the other. Time uses the fixed (padded) sizes, which is what moves; the rows with data (flat:
(token, expert) pairs; hierarchical: unique (token, host) pairs, from per-token routing after ECHO's
rewrite) are reported beside them, with the fullest block over its capacity (``fill`` > 1: an
overflow, replayed in training, not modelled). ECHO plans with the hosts' source shares (each clone fed
from its own host first); its clone weights and gradients move in the transports' fixed blocks of S
experts, used or not: (H − 1)·S per rank with ``hierarchical`` (relayed host by host), (R − L)·S flat
(counted apart: ``clone_net_GB``; on a shared network all ranks' blocks at once). Non-MoE = the one-host model (token
part ∝ T, FSDP traffic at the network rate).
A cluster (the predictions): one NIC per GPU (``Cluster.shared_network`` off): a leg's network time is the
busiest rank's bytes / the per-GPU rate, FSDP fully exposed. The emulated cluster (two torchrun agents on one
machine, NCCL over NET/Socket between them; benchmarks/results/dispatch_hosts*.json, e2e_hosts*.json:
{"rows": [...]}) is modelled as what it is: one socket path that every rank's network bytes share
(``shared_network`` on: all ranks' bytes of a leg / one aggregate GB/s per machine, so a GPU at 2 × 2 gets
half of its rate at 2 × 1); FSDP's ring crosses the hosts H times on that path, a fitted share
(``fsdp_exposed``) of it on the critical path; non-network ms are the one-host model's, scaled to the row's
GPU by the ratio of the one-GPU graphed steps (e2e_1x<GPU>.json). ``calibrate_hosts`` fits the dispatch +
combine rows first (each machine's aggregate GB/s, the ms per collective), then the step rows for what those
leave open (FSDP's exposed share, the aggregate of a machine without dispatch rows), checks every row (±15%)
and names in its markdown the rows outside the band and the measured spread between rows the model cannot
tell apart. Not modelled across hosts: overlap of legs or of communication
with compute (but the emulated fit's FSDP share), congestion and network topology (full bisection assumed), the NVLink leg's per-row ids,
the extra permutes of the hierarchical path beyond its collectives' fixed cost, overflow replays.

    python benchmarks/step_sim.py [--gpu H200] [--steps 8] [--out DIR]     (~3 min on 2 CPU cores)
        -> step_sim_<GPU>_cpu.{json,md} (a CPU run; <GPU>: the calibration's)
    python benchmarks/step_sim.py --hosts-only [--gpus-per-host 8] [--nvlink-gbs 400] [--network-gbs 50]
        [--capacity-factor 1.25] [--collective-ms MS] [--host-steps 2]          (~30 s: the host tables only)
"""

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch

from benchmarks.common import RESULTS, environment, gpu_short, markdown_table, results_stem, write_results
from benchmarks.planner import drifting_counts
from components.moe_echo.comm import wire_scales
from components.moe_echo.ep_dispatch import padded_capacity
from components.moe_echo.hierarchical_dispatch import host_capacity
from components.moe_echo.planner import RULES, plan_echo

BYTES = 2  # bf16 activations and weights


# ----------------------------------------------------------------------------- shapes and configs

SAMPLE_TOKENS = 4096  # tokens per rank drawn from the routing model; counts are scaled up to T (as echo_sim does)


@dataclass
class ModelShape:
    """v2lite_1b (components/moe_echo/models.py): dim 2048, 4 layers (1 dense), 3 MoE layers of 64
    experts top-6, expert hidden 768, 2 shared experts; 4 x 4096 tokens per rank."""
    dim: int = 2048
    hidden: int = 768
    experts: int = 64
    top_k: int = 6
    moe_layers: int = 3
    tokens_per_rank: int = 16384
    dense_params: float = 285.233152e6  # everything but the routed experts (counted on the meta model)
    root_params: float = 134.219776e6  # embeddings + output + final norm: FSDP's root, not resharded

    def expert_params(self, experts: int | None = None) -> float:
        return self.moe_layers * (experts or self.experts) * 3 * self.dim * self.hidden


@dataclass
class SimConfig:
    """One simulated run. slots = 0: ECHO off."""
    ep: int
    experts: int = 64
    slots: int = 0
    backend: str = "nvlink"  # "padded" (fixed blocks of C rows per peer) | "nvlink" (real rows)
    capacity_factor: float = 1.5  # padded: C = round_up(cf · T · K / R, 8)
    gpus_per_host: int | None = None  # None: one NVLink domain; else off-host bytes at inter_host_gbs
    inter_host_gbs: float = 50.0  # assumed (400 Gb/s NIC per GPU), never measured here
    param_scaling: str = "sharded"  # "sharded": all parameter-sized work / R; "optimizer": only AdamW / R
    fsdp_exposed: bool = True  # FSDP2 parameter traffic on the critical path (no overlap)


@dataclass
class LinearFit:
    """ms = intercept + slope · x, and its relative residuals on the calibration points."""
    intercept: float
    slope: float
    rms_rel: float = 0.0
    max_rel: float = 0.0
    points: list = field(default_factory=list)

    def __call__(self, x: float) -> float:
        return self.intercept + self.slope * x


@dataclass
class Calibration:
    gpu: str
    gemm: LinearFit  # ms = intercept + slope · rows (at hidden gemm_hidden)
    gemm_hidden: int
    comm: dict  # (backend, EP) -> LinearFit, x = GB there and back through the bottleneck rank
    planner_us: dict  # (EP, S) -> µs per layer (CUDA graph)
    step_1gpu_ms: float
    router_ms: float  # per MoE layer
    local_permute_ms: float  # per MoE layer, EP=1 only (at EP > 1 the dispatcher's fit has it)
    token_ms: float  # non-MoE work per rank that scales with its tokens
    param_ms_per_param: float  # non-MoE work per parameter held by the rank
    optimizer_share: float  # of the parameter part: AdamW (param_scaling = "optimizer")
    notes: dict = field(default_factory=dict)

    def gemm_ms(self, rows_R: torch.Tensor, hidden: int) -> torch.Tensor:
        """[R] ms of each rank's grouped SwiGLU fwd+bwd."""
        return self.gemm.intercept + self.gemm.slope * rows_R.double() * hidden / self.gemm_hidden

    def comm_fit(self, backend: str, ep: int) -> LinearFit:
        """The fit measured at this EP, else the one at the largest measured EP below it (per-GPU
        bandwidth carried over: an assumption for EP > 4)."""
        below = [e for b, e in self.comm if b == backend and e <= ep]
        return self.comm[(backend, max(below))]

    def planner(self, ep: int, slots: int) -> float:
        """µs per layer: the measured (EP, S), else log-linear in EP over the S = 2 rows."""
        if (ep, slots) in self.planner_us:
            return self.planner_us[(ep, slots)]
        pts = sorted((e, us) for (e, s), us in self.planner_us.items() if s == 2)
        x = [math.log(e) for e, _ in pts]
        return float(np.interp(math.log(ep), x, [us for _, us in pts]))


# ----------------------------------------------------------------------------- routing (benchmarks/planner.py's model)

def gumbel_counts(R: int, logp_E: torch.Tensor, tokens: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """counts_RE: every rank's tokens pick k distinct experts by popularity exp(logp_E) (Gumbel top-k)."""
    E = logp_E.shape[0]
    counts = torch.zeros(R, E, dtype=torch.int64)
    for r in range(R):
        g = -torch.log(-torch.log(torch.rand(tokens, E, generator=gen).clamp(1e-9, 1 - 1e-9)))
        counts[r] = torch.bincount((logp_E.float() + g).topk(k, dim=-1).indices.flatten(), minlength=E)
    return counts


def hot_counts(R: int, E: int, n_hot: int, tokens: int, k: int, seed: int) -> torch.Tensor:
    """counts_RE with experts 0..n_hot-1 preferred by every token (on the first ranks, as
    --moe_echo.debug_hot_experts places them): each token picks k of them at random (Gumbel top-k
    over the hot experts only: the others' chance, e^-50 in benchmarks/planner.py's "dominant", is nil)."""
    counts = torch.zeros(R, E, dtype=torch.int64)
    counts[:, :n_hot] = gumbel_counts(R, torch.zeros(n_hot), tokens, k, torch.Generator().manual_seed(seed))
    return counts


def zipf_counts(R: int, E: int, s: float, tokens: int, k: int, seed: int) -> torch.Tensor:
    """counts_RE for Zipf(s) popularity on a random permutation of the experts (no drift)."""
    g = torch.Generator().manual_seed(seed)
    logp = -s * torch.log(torch.arange(1, E + 1, dtype=torch.float64))
    return gumbel_counts(R, logp[torch.randperm(E, generator=g)], tokens, k, g)


def imbalance(counts_RE: torch.Tensor, R: int) -> float:
    load_R = counts_RE.sum(0).view(R, -1).sum(1).double()
    return float(load_R.max() / load_R.mean())


def zipf_for_imbalance(R: int, E: int, target: float, k: int, seeds: list[int], tokens: int = 2048) -> float:
    """The Zipf exponent whose mean rank max/mean load over ``seeds`` (same draws for every
    exponent) is ``target``: bisection on [0, 3]."""
    lo, hi = 0.0, 3.0
    for _ in range(14):
        mid = (lo + hi) / 2
        got = statistics.mean(imbalance(zipf_counts(R, E, mid, tokens, k, s), R) for s in seeds)
        lo, hi = (mid, hi) if got < target else (lo, mid)
    return (lo + hi) / 2


# ----------------------------------------------------------------------------- one layer

@dataclass
class LayerLoad:
    """Where one layer's rows go. traffic_RR[r, d]: rows source r sends to rank d (after ECHO's
    rewrite; the diagonal stays local); clones_send_R / clones_recv_R: expert weight copies each
    rank multicasts / receives. Invariant: traffic_RR.sum(0) = rows each rank computes."""
    traffic_RR: torch.Tensor
    clones_send_R: torch.Tensor
    clones_recv_R: torch.Tensor
    load_before: float
    load_after: float

    @property
    def rows_R(self) -> torch.Tensor:
        return self.traffic_RR.sum(0)


def layer_load(counts_RE: torch.Tensor, slots: int, rule: str = "fill", plan=None) -> LayerLoad:
    """Rows per (source, destination) with ECHO's plan (slots > 0; ``plan``: one already made from
    these counts) or without."""
    R, E = counts_RE.shape
    e = E // R
    home_RR = counts_RE.view(R, R, e).sum(2)
    zero = torch.zeros(R, dtype=torch.int64)
    before = imbalance(counts_RE, R)
    if slots == 0:
        return LayerLoad(home_RR, zero, zero.clone(), before, before)
    plan = plan if plan is not None else plan_echo(counts_RE, slots, rule)
    x_G, q_RG = plan.slot_expert_G, plan.quota_RG
    used_G = x_G >= 0
    moved_RE = torch.zeros(R, E, dtype=torch.int64).index_add_(1, x_G.clamp(min=0), q_RG * used_G)
    slot_RR = q_RG.view(R, R, slots).sum(2)  # source r -> rank d's slots
    traffic = (counts_RE - moved_RE).view(R, R, e).sum(2) + slot_RR
    recv = used_G.view(R, slots).sum(1).long()
    home_G = (x_G.clamp(min=0) // e)[used_G]
    send = torch.zeros(R, dtype=torch.int64).index_add_(0, home_G, torch.ones_like(home_G))
    after = float(plan.load_after_R.max() / plan.load_after_R.double().mean())
    return LayerLoad(traffic, send, recv, before, after)


def bottleneck_rows(traffic_RR: torch.Tensor, gpus_per_host: int | None) -> tuple[float, float]:
    """(on-host, off-host) remote rows of the busiest rank: max over ranks of what it sends or
    receives (each part separately; a one-host domain has no off-host part)."""
    R = traffic_RR.shape[0]
    host = torch.arange(R) // (gpus_per_host or R)
    same = host[:, None] == host[None, :]
    remote = traffic_RR * ~torch.eye(R, dtype=torch.bool)
    on, off = remote * same, remote * ~same
    busiest = lambda m: float(torch.maximum(m.sum(0), m.sum(1)).max())  # noqa: E731
    return busiest(on), busiest(off)


def layer_ms(load: LayerLoad, cfg: SimConfig, cal: Calibration, shape: ModelShape) -> dict:
    """Milliseconds of one MoE layer, fwd + bwd, for the straggler. Keys: router, comm, gemm
    (the slowest rank), gemm_mean, echo (planner + multicast), total."""
    R, D, H, T, K = cfg.ep, shape.dim, shape.hidden, shape.tokens_per_rank, shape.top_k
    gemm_R = cal.gemm_ms(load.rows_R, H)
    fit = cal.comm_fit(cfg.backend, R) if R > 1 else None
    off_ms_per_gb = 1e3 / cfg.inter_host_gbs
    if R == 1:
        comm = cal.local_permute_ms
    elif cfg.backend == "padded":
        C = padded_capacity(T, K, R, cfg.capacity_factor)
        comm = 2 * fit(2 * (R - 1) * C * D * BYTES / 1e9)  # fwd + bwd
    else:
        on, off = bottleneck_rows(load.traffic_RR, cfg.gpus_per_host)
        gb_on, gb_off = 2 * on * D * BYTES / 1e9, 2 * off * D * BYTES / 1e9
        comm = 2 * (fit.intercept + max(gb_on * fit.slope, gb_off * off_ms_per_gb))
    echo = 0.0
    if cfg.slots and R > 1:
        w_gb = 3 * D * H * BYTES / 1e9  # one expert's w1, w2, w3
        if cfg.backend == "padded":  # every (home, destination) pair exchanges S blocks per weight
            mc = (R - 1) * cfg.slots * w_gb * fit.slope
        else:  # only the clones; the busiest home (sends) or clone rank (receives)
            n = float(torch.maximum(load.clones_send_R, load.clones_recv_R).max())
            off_host = cfg.gpus_per_host is not None and cfg.gpus_per_host < R
            mc = n * w_gb * (off_ms_per_gb if off_host else fit.slope)
        echo = cal.planner(R, cfg.slots) / 1e3 + 2 * mc  # multicast forward, gradients back
    gemm = float(gemm_R.max())
    return {"router": cal.router_ms, "comm": comm, "gemm": gemm, "gemm_mean": float(gemm_R.mean()),
            "echo": echo, "total": cal.router_ms + comm + gemm + echo}


def fsdp_gb(shape: ModelShape) -> float:
    """GB of FSDP2 traffic per step if one rank held all dense parameters: all-gather bf16 (forward: all;
    backward: the resharded blocks) and reduce-scatter fp32 gradients; a rank of R sends (R - 1) / R of it."""
    return ((2 * shape.dense_params - shape.root_params) * 2 + shape.dense_params * 4) / 1e9


def nonmoe_ms(cfg: SimConfig, cal: Calibration, shape: ModelShape) -> dict:
    """Per-rank non-MoE milliseconds: token part, parameter part, exposed FSDP traffic."""
    R = cfg.ep
    params_R = (shape.dense_params + shape.expert_params(cfg.experts)) / R
    params_1 = shape.dense_params + shape.expert_params()  # the calibrated 1-GPU model
    if cfg.param_scaling == "sharded":
        param = cal.param_ms_per_param * params_R
    else:  # only AdamW shrinks with the shard; the rest stays at its 1-GPU size
        p1 = cal.param_ms_per_param * params_1
        param = p1 * (1 - cal.optimizer_share) + p1 * cal.optimizer_share * params_R / params_1
    fsdp = 0.0
    if R > 1 and cfg.fsdp_exposed:
        gb = fsdp_gb(shape) * (R - 1) / R
        host = cfg.gpus_per_host is not None and cfg.gpus_per_host < R
        fsdp = gb * (1e3 / cfg.inter_host_gbs if host else cal.comm_fit("padded", R).slope)
    return {"token": cal.token_ms, "param": param, "fsdp": fsdp}


def simulate_step(loads: list[LayerLoad], cfg: SimConfig, cal: Calibration, shape: ModelShape) -> dict:
    """One step: non-MoE + Σ over the MoE layers (``loads``, one per layer) of the straggler layer time."""
    layers = [layer_ms(ld, cfg, cal, shape) for ld in loads]
    nm = nonmoe_ms(cfg, cal, shape)
    moe = {k: sum(l[k] for l in layers) for k in layers[0]}
    step = sum(nm.values()) + moe["total"]
    return {"step_ms": step, "tokens_per_s": cfg.ep * shape.tokens_per_rank / step * 1e3,
            "nonmoe": nm, "moe": moe, "rows_max": max(float(ld.rows_R.max()) for ld in loads),
            "load_before": statistics.mean(l.load_before for l in loads),
            "load_after": statistics.mean(l.load_after for l in loads)}


def mean_steps(sims: list[dict], cfg: SimConfig, shape: ModelShape) -> dict:
    """The mean step of several simulated steps (tokens/s from the mean step time)."""
    step = statistics.mean(s["step_ms"] for s in sims)
    return {"step_ms": step, "tokens_per_s": cfg.ep * shape.tokens_per_rank / step * 1e3,
            "nonmoe": {k: statistics.mean(s["nonmoe"][k] for s in sims) for k in sims[0]["nonmoe"]},
            "moe": {k: statistics.mean(s["moe"][k] for s in sims) for k in sims[0]["moe"]},
            "rows_max": max(s["rows_max"] for s in sims),
            "load_before": statistics.mean(s["load_before"] for s in sims),
            "load_after": statistics.mean(s["load_after"] for s in sims)}


def simulate(counts: list[list[torch.Tensor]], cfg: SimConfig, cal: Calibration, shape: ModelShape) -> dict:
    """Mean over steps; counts[step][layer] = counts_RE."""
    return mean_steps([simulate_step([layer_load(c, cfg.slots) for c in step], cfg, cal, shape) for step in counts],
                      cfg, shape)


# ----------------------------------------------------------------------------- calibration

def _load(name: str, results: str) -> object:
    with open(os.path.join(results, name)) as f:
        return json.load(f)


def result_name(benchmark: str, gpu: str, gpus: int = 1, ext: str = "json") -> str:
    """The results file of ``benchmark`` measured on ``gpus`` GPUs of kind ``gpu`` (any spelling: ``H200``,
    ``NVIDIA H200``): ``<benchmark>_<N>x<GPU>.<ext>``."""
    return f"{results_stem(benchmark, gpu, gpus)}.{ext}"


def _rows(data) -> list:
    """A results file's rows: ``{"rows": [...]}``, or the bare list older step_breakdown files hold."""
    return data["rows"] if isinstance(data, dict) else data


def echo_sim_points(path: str) -> list[tuple[str, list[torch.Tensor], float]]:
    """(kind, rows per rank [e or e + S groups each], ms) of every echo_sim measurement: the
    straggler ("max") before and after ECHO and the mean rank before. The counts are rebuilt from
    echo_sim's seeds; its planner rule is the one whose loads after match the file."""
    from benchmarks.echo_sim import E as E_SIM, rank_rows
    from benchmarks.planner import routing_counts

    points = []
    for row in _load(os.path.basename(path), os.path.dirname(path))["rows"]:
        R, S = row["EP"], row["S"]
        counts = routing_counts(R, E_SIM, row["routing"], seed=R) * 6 // 8
        for rule in RULES:
            plan = plan_echo(counts, S, rule)
            after = float(plan.load_after_R.max() / plan.load_after_R.float().mean())
            if abs(after - row["load_after"]) < 1e-4:
                break
        else:
            raise ValueError(f"{path}: no planner rule reproduces load_after={row['load_after']} (EP={R}, S={S})")
        before, after_rows = rank_rows(counts, plan, R, S)
        points += [("max", before, row["straggler_ms_before"]), ("max", after_rows, row["straggler_ms_after"]),
                   ("mean", before, row["mean_rank_ms"])]
    return points


def fit_gemm(points, features=lambda r: [1.0, float(r.sum())], iters: int = 50) -> tuple[np.ndarray, np.ndarray]:
    """Least squares in relative error of ms = θ · features(rows of a rank), where a "max" point is
    the slowest rank under θ (fixed-point iteration: pick each straggler, refit, until it stops
    changing). Returns θ and the relative residuals."""
    y = np.array([p[2] for p in points])
    F = [np.array([features(r) for r in ranks]) for _, ranks, _ in points]
    theta = np.zeros(F[0].shape[1])
    for _ in range(iters):
        A = np.array([f[np.argmax(f @ theta)] if kind == "max" else f.mean(0) for (kind, _, _), f in zip(points, F)])
        new = np.linalg.lstsq(A / y[:, None], np.ones_like(y), rcond=None)[0]
        if np.allclose(new, theta, rtol=1e-12, atol=0):
            break
        theta = new
    pred = np.array([(f @ theta).max() if kind == "max" else (f @ theta).mean() for (kind, _, _), f in zip(points, F)])
    return theta, (pred - y) / y


def _fit_line(x: list[float], y: list[float]) -> LinearFit:
    """Least squares in relative error."""
    x_, y_ = np.array(x), np.array(y)
    A = np.stack([np.ones_like(x_), x_], 1) / y_[:, None]
    a, b = np.linalg.lstsq(A, np.ones_like(y_), rcond=None)[0]
    rel = (a + b * x_ - y_) / y_
    return LinearFit(float(a), float(b), float(np.sqrt(np.mean(rel ** 2))), float(np.abs(rel).max()),
                     [{"GB": float(u), "ms": float(v), "rel_err": float(r)} for u, v, r in zip(x_, y_, rel)])


def dispatch_benchmark_rows(R: int, T: int, kind: str, seed: int = 0) -> tuple[float, float]:
    """(send, receive) remote rows of the busiest rank under benchmarks/dispatch.py's routing
    (E=64, K=8; "skewed" = Zipf(1.2) popularity on experts 0.. in order, so rank 0 receives most),
    sampled on CPU (the benchmark drew on the GPU: same distribution, other draws)."""
    E, K = 64, 8
    g = torch.Generator().manual_seed(seed)
    logp = -1.2 * torch.log(torch.arange(1, E + 1).float()) if kind == "skewed" else torch.zeros(E)
    counts = gumbel_counts(R, logp, T, K, g)
    remote = counts.view(R, R, E // R).sum(2) * ~torch.eye(R, dtype=torch.bool)
    return float(remote.sum(1).max()), float(remote.sum(0).max())


def fit_dispatch(path: str) -> dict:
    """(backend, EP) -> LinearFit of eager dispatch + combine ms on GB there and back through the
    bottleneck rank: padded (R - 1)·C rows (its fixed blocks), nvlink max(send, receive) real rows."""
    data = _load(os.path.basename(path), os.path.dirname(path))
    pts = {"padded": ([], []), "nvlink": ([], [])}
    cache = {}
    for r in data["rows"]:
        R, T, D = r["ranks"], r["T"], r["D"]
        if (R, T, r["routing"]) not in cache:
            cache[(R, T, r["routing"])] = dispatch_benchmark_rows(R, T, r["routing"])
        send, recv = cache[(R, T, r["routing"])]
        pts["padded"][0].append(2 * (R - 1) * r["padded_rows_per_peer"] * D * BYTES / 1e9)
        pts["padded"][1].append(r["padded_ms"])
        pts["nvlink"][0].append(2 * max(send, recv) * D * BYTES / 1e9)
        pts["nvlink"][1].append(r["nvlink_ms"])
    R = data["rows"][0]["ranks"]
    return {(b, R): _fit_line(*xy) for b, xy in pts.items()}


def scaling_step_ms(path: str, gpus: int) -> float:
    """ms per step of the ``gpus`` row of a scaling table (tokens/s over all GPUs, 16384 tokens each)."""
    with open(path) as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells and cells[0] == str(gpus):
                return gpus * ModelShape().tokens_per_rank / float(cells[3].replace(",", "")) * 1e3
    raise ValueError(f"{path}: no row for {gpus} GPU(s)")


def calibrate(gpu: str = "H200", results: str = RESULTS, shape: ModelShape | None = None,
              profile_gpu: str = "H100") -> Calibration:
    """Every constant from its measurement; none from the EP=2 / EP=4 training runs."""
    from benchmarks.echo_sim import H as gemm_hidden

    shape = shape or ModelShape()
    gpu = gpu_short(gpu)
    pts = echo_sim_points(os.path.join(results, result_name("echo_sim", gpu)))
    theta, rel = fit_gemm(pts)
    gemm = LinearFit(float(theta[0]), float(theta[1]), float(np.sqrt(np.mean(rel ** 2))), float(np.abs(rel).max()),
                     [{"kind": k, "rows_max": int(max(int(r.sum()) for r in rs)), "ms": ms, "rel_err": float(e)}
                      for (k, rs, ms), e in zip(pts, rel)])
    comm = {}
    for ep in (2, 4):
        comm.update(fit_dispatch(os.path.join(results, result_name(f"dispatch_ep{ep}", gpu, ep))))
    planner_us = {(r["EP"], r["S"]): r["graph_us"] for r in _load(result_name("planner_time", gpu), results)["rows"]
                  if r.get("rule", "fill") == "fill"}  # files without a rule column timed the only rule then
    step1 = scaling_step_ms(os.path.join(results, result_name("scaling", gpu, 4, "md")), 1)
    before = _rows(_load(result_name("step_breakdown_v2lite_1b_gpu_autocast", profile_gpu), results))[0]
    after = _rows(_load(result_name("step_breakdown_v2lite_1b_gpu_master_weights", profile_gpu), results))[0]
    ms = before["ms"]
    to_gpu = step1 / before["kernel_ms"]  # the profile's shares, on this GPU's measured 1-GPU step
    router = ms["router"] / shape.moe_layers * to_gpu
    permute = ms["dispatch"] / shape.moe_layers * to_gpu
    moe_1gpu = shape.moe_layers * (router + permute + float(
        gemm.intercept + gemm.slope * shape.tokens_per_rank * shape.top_k * shape.hidden / gemm_hidden))
    nonmoe = step1 - moe_1gpu
    # parameter-sized work: AdamW, plus the casts and elementwise passes that went away when the
    # parameters became bf16 with fp32 masters (the same run's two profiles)
    opt = ms["optimizer"]
    param_kernel = opt + (ms["casts/copies"] - after["ms"]["casts/copies"]) + (ms["other"] - after["ms"]["other"])
    nonmoe_kernel = before["kernel_ms"] - ms["routed experts"] - ms["dispatch"] - ms["router"]
    param_ms = nonmoe * param_kernel / nonmoe_kernel
    return Calibration(
        gpu=gpu, gemm=gemm, gemm_hidden=gemm_hidden, comm=comm, planner_us=planner_us, step_1gpu_ms=step1,
        router_ms=router, local_permute_ms=permute, token_ms=nonmoe - param_ms,
        param_ms_per_param=param_ms / (shape.dense_params + shape.expert_params()), optimizer_share=opt / param_kernel,
        notes={"moe_1gpu_ms": moe_1gpu, "nonmoe_1gpu_ms": nonmoe, "param_1gpu_ms": param_ms,
               "param_share_of_nonmoe": param_kernel / nonmoe_kernel, "profile_to_gpu": to_gpu})


def gemm_alternatives(points) -> list[dict]:
    """Other GEMM model forms on the same points (the adopted one first)."""
    forms = [("a + b·rows", lambda r: [1.0, float(r.sum())]),
             ("a + b·rows + c·non-empty groups", lambda r: [1.0, float(r.sum()), float((r > 0).sum())]),
             ("a + b·rows + c·groups", lambda r: [1.0, float(r.sum()), float(len(r))]),
             ("a + b·Σ round_up(rows_g, 256)", lambda r: [1.0, float(((r + 255) // 256 * 256).sum())])]
    out = []
    for name, f in forms:
        theta, rel = fit_gemm(points, f)
        out.append({"model": name, "coefficients": ", ".join(f"{t:.4g}" for t in theta),
                    "rms_rel": float(np.sqrt(np.mean(rel ** 2))), "max_rel": float(np.abs(rel).max())})
    return out


# ----------------------------------------------------------------------------- validation

@dataclass
class MeasuredRun:
    """A training run to compare with: its logged tokens/s windows (all GPUs) as quoted in ``source``."""
    name: str
    source: str
    windows: str  # the cells as written in the source table
    cfg: SimConfig
    routing: str  # "hot8" | "natural"
    imbalance: float  # rank load max/mean without ECHO, as logged
    use: str = ""  # which windows count (the last one of a run reads high: timed on the host)
    steady: bool = True

    def tokens_per_s(self) -> float:
        cells = re.findall(r"(\d+(?:,\d{3})*)(k?)", self.windows)  # "240,374" or "536k"
        vals = [float(n.replace(",", "")) * (1e3 if k else 1) for n, k in cells]
        if self.use == "drop_last":
            vals = vals[:-1]
        return statistics.median(vals)


def measured_runs() -> list[MeasuredRun]:
    P, N = "padded", "nvlink"
    return [
        MeasuredRun("EP=2, 8 hot, padded cf 2.0, ECHO off", "echo_e2e_2xH200.md", "240,374 / 240,093 / 240,661",
                    SimConfig(2, backend=P, capacity_factor=2.0), "hot8", 2.0),
        MeasuredRun("EP=2, 8 hot, padded cf 2.0, ECHO on (4 slots)", "echo_e2e_2xH200.md", "243,004 / 242,855 / 243,034",
                    SimConfig(2, slots=4, backend=P, capacity_factor=2.0), "hot8", 2.0),
        MeasuredRun("EP=2, 8 hot, padded cf 1.25, ECHO on (4 slots)", "echo_e2e_2xH200.md", "260,687 / 246,806 / 242,642",
                    SimConfig(2, slots=4, backend=P, capacity_factor=1.25), "hot8", 2.0),
        MeasuredRun("EP=2, natural, padded cf 1.5, ECHO on (2 slots)", "scaling_4xH200.md", "260,632",
                    SimConfig(2, slots=2, backend=P, capacity_factor=1.5), "natural", 1.18),
        MeasuredRun("EP=4, natural, padded cf 1.5, ECHO on (2 slots)", "ep4_training_4xH200.md",
                    "530,346 / 529,060 / 527,487 / 583,238", SimConfig(4, slots=2, backend=P, capacity_factor=1.5),
                    "natural", 1.35, use="drop_last"),
        MeasuredRun("EP=4, 8 hot, padded cf 1.5, ECHO on (4 slots)", "ep4_training_4xH200.md",
                    "501,756 / 501,865 / 496,052 / 565,638", SimConfig(4, slots=4, backend=P, capacity_factor=1.5),
                    "hot8", 4.0, use="drop_last"),
        MeasuredRun("EP=4, natural, nvlink, ECHO off", "ep4_nvlink_training_4xH200.md", "536k, 364k, 517k, 538k, 547k, 451k",
                    SimConfig(4, backend=N), "natural", 1.45, use="drop_last", steady=False),
        MeasuredRun("EP=4, natural, nvlink, ECHO on (2 slots)", "ep4_nvlink_training_4xH200.md",
                    "548k, 543k, 548k, 545k, 550k, 574k", SimConfig(4, slots=2, backend=N), "natural", 1.45, use="drop_last"),
        MeasuredRun("EP=4, 8 hot, nvlink, ECHO off", "ep4_nvlink_training_4xH200.md", "357k, 357k, 357k, 356k, 337k, 362k",
                    SimConfig(4, backend=N), "hot8", 4.0, use="drop_last"),
        MeasuredRun("EP=4, 8 hot, nvlink, ECHO on (4 slots)", "ep4_nvlink_training_4xH200.md",
                    "535k, 536k, 532k, 529k, 534k, 551k", SimConfig(4, slots=4, backend=N), "hot8", 4.0, use="drop_last"),
    ]


RATIO_PAIRS = [  # (ECHO on, ECHO off) of the same configuration
    ("EP=2, 8 hot, padded cf 2.0, ECHO on (4 slots)", "EP=2, 8 hot, padded cf 2.0, ECHO off"),
    ("EP=4, 8 hot, nvlink, ECHO on (4 slots)", "EP=4, 8 hot, nvlink, ECHO off"),
    ("EP=4, natural, nvlink, ECHO on (2 slots)", "EP=4, natural, nvlink, ECHO off"),
]


def run_counts(run: MeasuredRun, shape: ModelShape, steps: int, seed: int = 0) -> tuple[list, float | None]:
    """counts[step][layer] for a run's routing (natural: the Zipf exponent whose draws, these
    seeds, give the run's logged rank imbalance)."""
    R, E, K = run.cfg.ep, run.cfg.experts, shape.top_k
    up = shape.tokens_per_rank // SAMPLE_TOKENS
    seeds = [seed + 101 * i for i in range(steps * shape.moe_layers)]
    if run.routing == "hot8":
        flat = [hot_counts(R, E, 8, SAMPLE_TOKENS, K, s) * up for s in seeds]
        s_fit = None
    else:
        s_fit = zipf_for_imbalance(R, E, run.imbalance, K, seeds)
        flat = [zipf_counts(R, E, s_fit, SAMPLE_TOKENS, K, s) * up for s in seeds]
    L = shape.moe_layers
    return [flat[i * L:(i + 1) * L] for i in range(steps)], s_fit


def zipf_imbalance(R: int, E: int, s: float, k: int, perms: int = 16) -> tuple[float, float]:
    """Mean and spread (sd) of the rank max/mean load under Zipf(s) over random expert permutations."""
    v = [imbalance(zipf_counts(R, E, s, 1024, k, 9000 + i), R) for i in range(perms)]
    return statistics.mean(v), statistics.pstdev(v)


def validate(cal: Calibration, shape: ModelShape, results: str, steps: int) -> tuple[list[dict], list[dict]]:
    rows = []
    for run in measured_runs():
        with open(os.path.join(results, run.source)) as f:
            if run.windows not in f.read():
                raise ValueError(f"{run.source} no longer holds {run.windows!r}")
        counts, s_fit = run_counts(run, shape, steps)
        sim = simulate(counts, run.cfg, cal, shape)
        alt_a = simulate(counts, replace(run.cfg, param_scaling="optimizer"), cal, shape)
        alt_c = simulate(counts, replace(run.cfg, fsdp_exposed=False), cal, shape)
        meas = run.tokens_per_s()
        rows.append({
            "run": run.name, "source": run.source, "steady": run.steady,
            "zipf_fitted": s_fit, "load_logged": run.imbalance,
            "load_sim": f"{sim['load_before']:.2f}" + (f" -> {sim['load_after']:.2f}" if run.cfg.slots else ""),
            "measured_tok_s": meas, "sim_tok_s": sim["tokens_per_s"], "err_pct": 100 * (sim["tokens_per_s"] / meas - 1),
            "measured_ms": run.cfg.ep * shape.tokens_per_rank / meas * 1e3, "sim_ms": sim["step_ms"],
            "alt_optimizer_only_err_pct": 100 * (alt_a["tokens_per_s"] / meas - 1),
            "alt_fsdp_hidden_err_pct": 100 * (alt_c["tokens_per_s"] / meas - 1),
            "alt_tok_s": {"optimizer_only": alt_a["tokens_per_s"], "fsdp_hidden": alt_c["tokens_per_s"]},
            "terms_ms": {**{f"nonmoe_{k}": v for k, v in sim["nonmoe"].items()},
                         **{f"moe_{k}": v for k, v in sim["moe"].items()}},
        })
        print({k: v for k, v in rows[-1].items() if k != "terms_ms"}, flush=True)
    by = {r["run"]: r for r in rows}
    ratios = []
    for on, off in RATIO_PAIRS:
        m = by[on]["measured_tok_s"] / by[off]["measured_tok_s"]
        s = by[on]["sim_tok_s"] / by[off]["sim_tok_s"]
        alt = {k: by[on]["alt_tok_s"][k] / by[off]["alt_tok_s"][k] for k in by[on]["alt_tok_s"]}
        ratios.append({"pair": f"{on} / off", "measured_on_over_off": m, "sim_on_over_off": s,
                       "err_pct": 100 * (s / m - 1), "steady": by[on]["steady"] and by[off]["steady"],
                       "alt_optimizer_only_err_pct": 100 * (alt["optimizer_only"] / m - 1),
                       "alt_fsdp_hidden_err_pct": 100 * (alt["fsdp_hidden"] / m - 1)})
    return rows, ratios


# ----------------------------------------------------------------------------- predictions

PREDICT = [(8, 64), (16, 64), (64, 256)]  # (EP, E): like benchmarks/planner.py


def predict(cal: Calibration, shape: ModelShape, steps: int, adjust: dict, drift_steps: int = 2,
            seed: int = 0) -> list[dict]:
    """ECHO off vs on (1 and 2 slots) at EP=8/16/64, nvlink dispatch: natural Zipf(1.2) drifting
    routing (benchmarks/planner.py; steps // drift_steps independent expert placements per layer,
    each drifting for drift_steps steps) and 8 hot experts on rank 0. ``adjust``: constant ms
    offsets {"on", "off"} (the validation's mean residuals) for the `speedup_adj` column only."""
    traces = max(1, steps // drift_steps)
    steps = traces * drift_steps
    rows = []
    rows_cal = max(p["rows_max"] for p in cal.gemm.points)  # largest rank the GEMM fit saw (at gemm_hidden)
    K, L, up = shape.top_k, shape.moe_layers, shape.tokens_per_rank // SAMPLE_TOKENS
    for ep, E in PREDICT:
        sh = replace(shape, experts=E)
        routings = {
            "Zipf(1.2), drifting": lambda l: [c * up for t in range(traces) for c in drifting_counts(
                ep, E, drift_steps, seed + 7 * l + 1000 * t, tokens=SAMPLE_TOKENS, k=K, zipf=1.2)],
            "8 hot experts": lambda l: [hot_counts(ep, E, 8, SAMPLE_TOKENS, K, seed + 7 * l + 1000 * s) * up
                                        for s in range(steps)],
        }
        for name, gen in routings.items():
            t0 = time.time()
            per_layer = [gen(l) for l in range(L)]  # [layer][step]
            counts = [[per_layer[l][s] for l in range(L)] for s in range(steps)]
            base = {}
            for S in (0, 1, 2):
                loads = [[layer_load(c, S) for c in step] for step in counts]
                out = {}
                for scen, hosts in (("nvlink_domain", None), ("8_per_host", 8)):
                    cfg = SimConfig(ep, experts=E, slots=S, backend="nvlink", gpus_per_host=hosts)
                    out[scen] = mean_steps([simulate_step(ld, cfg, cal, sh) for ld in loads], cfg, sh)
                if S == 0:
                    base = out
                d, h = out["nvlink_domain"], out["8_per_host"]
                off_ms = base["nvlink_domain"]["step_ms"]
                rows.append({
                    "EP": ep, "E": E, "routing": name, "S": S if S else "off",
                    "load": f"{d['load_before']:.2f}" if S == 0 else f"{d['load_before']:.2f} -> {d['load_after']:.3f}",
                    "rows_over_calibrated": d["rows_max"] * shape.hidden / cal.gemm_hidden / rows_cal,
                    "gemm_ms_per_layer": d["moe"]["gemm"] / L, "comm_ms_per_layer": d["moe"]["comm"] / L,
                    "echo_ms_per_layer": d["moe"]["echo"] / L, "nonmoe_ms": sum(d["nonmoe"].values()),
                    "step_ms": d["step_ms"],
                    "tok_s_per_gpu": d["tokens_per_s"] / ep,
                    "speedup": off_ms / d["step_ms"],
                    "speedup_adj": (off_ms + adjust["off"]) / (d["step_ms"] + adjust["on" if S else "off"]),
                    "step_ms_8_per_host": h["step_ms"],
                    "speedup_8_per_host": base["8_per_host"]["step_ms"] / h["step_ms"],
                })
                print(rows[-1], flush=True)
            print(f"  ({name}, EP={ep}: {time.time() - t0:.1f} s)", flush=True)
    return rows


def residual_offsets(val: list[dict]) -> dict:
    """Mean measured − simulated ms of the steady validation runs with ECHO on / off: fitted to the
    validation, used only for the labelled `speedup_adj` column, never inside the model."""
    on = [r["measured_ms"] - r["sim_ms"] for r in val if r["steady"] and "ECHO on" in r["run"]]
    off = [r["measured_ms"] - r["sim_ms"] for r in val if r["steady"] and "ECHO off" in r["run"]]
    return {"on": statistics.mean(on), "off": statistics.mean(off)}


def cross_checks(cal: Calibration, shape: ModelShape, results: str,
                 other_gpu: str = "H100") -> list[dict]:
    """The calibrated terms against 1-GPU measurements they were not fitted to."""
    out = []
    rows_1gpu = shape.tokens_per_rank * shape.top_k
    prof = _rows(_load(result_name("step_breakdown_v2lite_1b_gpu_autocast", "H100"), results))[0]["ms"]
    theta, rel = fit_gemm(echo_sim_points(os.path.join(results, result_name("echo_sim", other_gpu))))
    model = theta[0] + theta[1] * rows_1gpu * shape.hidden / cal.gemm_hidden
    rms = np.sqrt(np.mean(rel ** 2))
    out.append({"check": f"GEMM fit on {other_gpu} echo_sim (a={theta[0]:.3f}, b={theta[1]:.3e}, rms {rms:.3f}) at "
                         f"H={shape.hidden}, {rows_1gpu} rows / 64 experts vs the H100 profile's routed experts per layer",
                "model_ms": float(model), "measured_ms": prof["routed experts"] / shape.moe_layers})
    for r in _load(result_name("moe_layer", cal.gpu), results)["rows"]:
        if r["routing"] != "balanced":
            continue
        n = r["T"] * r["K"]
        model = float(cal.gemm_ms(torch.tensor([n]), r["H"])[0]) + cal.router_ms + cal.local_permute_ms * n / rows_1gpu
        out.append({"check": f"one MoE layer fwd+bwd on one GPU (moe_layer: T={r['T']}, H={r['H']}, E={r['E']}, "
                             f"K={r['K']}): GEMM fit + router + local permute (per row)",
                    "model_ms": model, "measured_ms": r["ours_ms"]})
    for c in out:
        c["model_over_measured"] = c["model_ms"] / c["measured_ms"]
    return out


# ----------------------------------------------------------------------------- hosts: flat vs hierarchical dispatch

DISPATCHERS = ("padded", "hierarchical", "alltoall")
META_BYTES = 8  # per choice of a hierarchical network row, dispatch only: an expert id (4 B) and a weight (fp32)
TOLERANCE = 0.15  # predicted / measured within ±15%: the model's form holds on that row
HOST_PREDICT = [(16, 64), (32, 128), (64, 256)]  # (EP, E): 4 experts per rank, as the EP=16 / 64 predictions
HOST_ROUTINGS = {"Zipf(1.2)": "zipf1.2", "8 hot experts": "hot8"}


@dataclass
class Cluster:
    """H hosts × L GPUs; EP rank r lives on host r // L. Rates in GB/s per direction: NVLink per GPU inside
    a host; the network between hosts per GPU (``shared_network`` False: one NIC each, a cluster) or one
    aggregate rate that all ranks' concurrent network bytes share (True: one machine's socket path, the
    emulated hosts). ``collective_ms``: fixed ms of one data-moving collective (launch, layout, latency);
    None: half the one-host padded fit's intercept (its round trip is two collectives). ``fsdp_exposed``:
    share of FSDP's network time on the step's critical path (1: none of it overlapped)."""
    hosts: int
    gpus_per_host: int
    nvlink_gbs: float = 400.0
    network_gbs: float = 50.0
    collective_ms: float | None = None
    shared_network: bool = False
    fsdp_exposed: float = 1.0

    @property
    def ranks(self) -> int:
        return self.hosts * self.gpus_per_host

    def host_R(self) -> torch.Tensor:
        return torch.arange(self.ranks) // self.gpus_per_host


@dataclass
class HostRun:
    """One configuration on a cluster. dispatcher: "padded" (flat, C rows per (source, destination)),
    "hierarchical" (network leg then NVLink leg, fixed C1 / C2) or "alltoall" (flat, real rows, split
    sizes read on the host). slots = 0: ECHO off. compute_scale: the calibration's non-network ms (GEMM,
    router, planner, non-MoE) × this, for another GPU than the calibration's."""
    cluster: Cluster
    dispatcher: str = "padded"
    experts: int = 64
    slots: int = 0
    capacity_factor: float = 1.25
    compute_scale: float = 1.0
    wire: str = "bf16"  # "fp8": rows toward the experts cross as D + 4·ceil(D/128) bytes (dispatch_precision)


@dataclass
class Leg:
    """One collective of one direction: bytes the busiest rank sends over each link class (receives the
    same), and network_total_bytes: what all ranks of the collective send over the network together."""
    name: str
    network_bytes: float
    nvlink_bytes: float
    network_total_bytes: float = 0.0


def hier_capacities(T: int, K: int, hosts: int, gpus_per_host: int, cf: float) -> tuple[int, int]:
    """(C1, C2) rows of the hierarchical legs, as the dispatcher sizes them: C1 per (source rank, destination
    host) block, min(round_up(T, 8), round_up(ceil(cf·T·(1 − (1 − 1/H)^K)), 8)) (hierarchical_dispatch.
    host_capacity); C2 per (entry rank, owner rank) block of the NVLink fan-out, round_up(ceil(cf·T·K/L), 8)."""
    c1 = host_capacity(T, K, hosts, cf)
    return c1, padded_capacity(T, K, gpus_per_host, cf)


def dispatch_legs(dispatcher: str, cluster: Cluster, T: int, D: int, K: int, cf: float,
                  traffic_RR: torch.Tensor | None = None, wire: str = "bf16") -> dict[str, list[Leg]]:
    """{"dispatch": legs, "combine": legs} of one forward round trip, per rank, bf16 rows of D (``wire = "fp8"``:
    the dispatch legs' rows are D e4m3 bytes + a 4-byte scale per 128 columns; the backward's legs toward the experts, the
    output gradients, cross the same way, so the round trip stands for the backward too).

    padded: one collective each way; (R - L)·C rows to other hosts, (L - 1)·C over NVLink.
    hierarchical: dispatch = network leg ((H - 1)·C1 rows + K ids and K weights per row) then NVLink
    leg ((L - 1)·C2 rows); combine = the NVLink leg back, then (H - 1)·C1 partial sums over the network.
    alltoall: real rows (the busiest rank's, from ``traffic_RR``; else T·K/R per pair, balanced) plus
    a bytes-free split exchange on dispatch. Totals over ranks: R × the fixed blocks; alltoall the
    off-host entries of ``traffic_RR``, else (R - L)·T·K rows."""
    H, L = cluster.hosts, cluster.gpus_per_host
    R, row = H * L, D * BYTES
    out = D + 4 * wire_scales(D) if wire == "fp8" else row  # bytes of a row toward the experts
    if dispatcher == "padded":
        C = padded_capacity(T, K, R, cf)
        leg = Leg("all_to_all", (R - L) * C * row, (L - 1) * C * row, R * (R - L) * C * row)
        there = Leg("all_to_all", (R - L) * C * out, (L - 1) * C * out, R * (R - L) * C * out)
        return {"dispatch": [there], "combine": [leg]}
    if dispatcher == "hierarchical":
        C1, C2 = hier_capacities(T, K, H, L, cf)
        net_out, net_back = [], []
        if H > 1:
            out_b, back_b = (H - 1) * C1 * (out + META_BYTES * K), (H - 1) * C1 * row
            net_out = [Leg("network", out_b, 0.0, R * out_b)]
            net_back = [Leg("network", back_b, 0.0, R * back_b)]
        host = [Leg("nvlink", 0.0, (L - 1) * C2 * row)] if L > 1 else []
        host_out = [Leg("nvlink", 0.0, (L - 1) * C2 * out)] if L > 1 else []
        return {"dispatch": net_out + host_out, "combine": host + net_back}
    if dispatcher == "alltoall":
        if traffic_RR is None:
            n = T * K / R
            on, off, total = (L - 1) * n, (R - L) * n, (R - L) * T * K
        else:
            on, off = bottleneck_rows(traffic_RR, L)
            host_R = torch.arange(R) // L
            total = float((traffic_RR * (host_R[:, None] != host_R[None, :])).sum())
        leg = Leg("all_to_all", off * row, on * row, total * row)
        there = Leg("all_to_all", off * out, on * out, total * out)
        return {"dispatch": [Leg("splits", 0.0, 0.0), there], "combine": [leg]}
    raise ValueError(f"unknown dispatcher {dispatcher!r}; expected one of {DISPATCHERS}")


def leg_ms(leg: Leg, cluster: Cluster, collective_ms: float) -> float:
    """Fixed cost + the slower link class (both classes move at once inside one collective); the network
    moves the busiest rank's bytes at its per-GPU rate, or on a shared network all ranks' bytes at the
    aggregate rate."""
    net = leg.network_total_bytes if cluster.shared_network else leg.network_bytes
    return collective_ms + max(net / cluster.network_gbs, leg.nvlink_bytes / cluster.nvlink_gbs) / 1e6


def default_collective_ms(cal: Calibration) -> float:
    """Half the intercept of the padded fit at the largest measured EP (two collectives per round trip)."""
    ep = max(e for b, e in cal.comm if b == "padded")
    return cal.comm[("padded", ep)].intercept / 2


def round_trip_ms(legs: dict[str, list[Leg]], cluster: Cluster, collective_ms: float) -> float:
    """ms of dispatch + combine (forward); legs run one after the other (no overlap)."""
    return sum(leg_ms(l, cluster, collective_ms) for l in legs["dispatch"] + legs["combine"])


def network_bytes(legs: dict[str, list[Leg]], total: bool = False) -> float:
    """Bytes one rank (``total``: all ranks together) sends to other hosts in one forward round trip."""
    return sum(l.network_total_bytes if total else l.network_bytes for l in legs["dispatch"] + legs["combine"])


# routing with token identity: the hierarchical leg's rows are unique (token, host) pairs

def gumbel_ids(R: int, logp_E: torch.Tensor, tokens: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """ids_RTK: the choices behind gumbel_counts (same draws, same order)."""
    E = logp_E.shape[0]
    ids = torch.empty(R, tokens, k, dtype=torch.int64)
    for r in range(R):
        g = -torch.log(-torch.log(torch.rand(tokens, E, generator=gen).clamp(1e-9, 1 - 1e-9)))
        ids[r] = (logp_E.float() + g).topk(k, dim=-1).indices
    return ids


def routing_ids(R: int, E: int, k: int, routing: str, tokens: int, seed: int) -> torch.Tensor:
    """ids_RTK for "zipf<s>" (Zipf(s) on a random expert permutation: zipf_counts' draws), "hot<N>"
    (experts 0..N-1 only: hot_counts' draws) or "uniform"."""
    g = torch.Generator().manual_seed(seed)
    if routing.startswith("zipf"):
        logp = -float(routing[4:]) * torch.log(torch.arange(1, E + 1, dtype=torch.float64))
        return gumbel_ids(R, logp[torch.randperm(E, generator=g)], tokens, k, g)
    if routing.startswith("hot"):
        return gumbel_ids(R, torch.zeros(int(routing[3:])), tokens, k, g)
    if routing == "uniform":
        return gumbel_ids(R, torch.zeros(E), tokens, k, g)
    raise ValueError(f"unknown routing {routing!r}")


def echo_dest_TK(ids_TK: torch.Tensor, home_TK: torch.Tensor, quota_G: torch.Tensor, slot_expert_G: torch.Tensor,
                 slots: int) -> torch.Tensor:
    """dest_TK: the rank each choice of one source goes to after ECHO's rewrite: the first quota_G[g]
    choices (in token order) of expert slot_expert_G[g] go to slot g's rank (g // slots), in slot order."""
    used = (slot_expert_G >= 0) & (quota_G > 0)
    if not bool(used.any()):
        return home_TK
    G = slot_expert_G.numel()
    g_s = used.nonzero().flatten()
    g_s = g_s[torch.argsort(slot_expert_G[g_s] * G + g_s)]
    x_s, q_s = slot_expert_G[g_s], quota_G[g_s]
    cs = torch.cumsum(q_s, 0)
    first = torch.ones_like(x_s, dtype=torch.bool)
    first[1:] = x_s[1:] != x_s[:-1]
    end_s = cs - (cs - q_s)[first][torch.cumsum(first.long(), 0) - 1]  # cumulative quota within the expert
    f = ids_TK.reshape(-1)
    N = f.numel()
    sorted_f, order = torch.sort(f, stable=True)
    occ = torch.empty_like(f)
    occ[order] = torch.arange(N) - torch.searchsorted(sorted_f, sorted_f)  # choice's place among its expert's
    big = N + 1
    i = torch.searchsorted(x_s * big + end_s, f * big + occ, right=True)  # first slot of f ending past occ
    ic = i.clamp(max=g_s.numel() - 1)
    hit = (i < g_s.numel()) & (x_s[ic] == f)
    return torch.where(hit, g_s[ic] // slots, home_TK.reshape(-1)).view_as(ids_TK)


@dataclass
class HostLayer:
    """One MoE layer's routing on a cluster. load: rows per (source, destination) after ECHO (the GEMM,
    the flat blocks' fill); unique_RH[r, h]: tokens of source r with a choice on host h (after ECHO's
    rewrite: the hierarchical network rows); clone_home_G / clone_rank_G: home rank and rank of each
    used echo slot."""
    load: LayerLoad
    unique_RH: torch.Tensor
    clone_home_G: torch.Tensor
    clone_rank_G: torch.Tensor


def host_layer(ids_RTK: torch.Tensor, E: int, slots: int, cluster: Cluster, up: int = 1) -> HostLayer:
    """A layer from sampled choices (counts × ``up`` to the modelled T; the plan is made on the scaled
    counts, its quotas applied to the sample as round(q / up))."""
    R, L, H = cluster.ranks, cluster.gpus_per_host, cluster.hosts
    e = E // R
    counts_RE = torch.stack([torch.bincount(ids_RTK[r].flatten(), minlength=E) for r in range(R)]) * up
    plan = plan_echo(counts_RE, slots, ranks_per_host=L if H > 1 else None) if slots else None
    load = layer_load(counts_RE, slots, plan=plan)
    home_RTK = ids_RTK // e
    unique_RH = torch.zeros(R, H, dtype=torch.int64)
    for r in range(R):
        dest = home_RTK[r]
        if plan is not None:
            quota = torch.round(plan.quota_RG[r].double() / up).long()
            dest = echo_dest_TK(ids_RTK[r], dest, quota, plan.slot_expert_G, slots)
        need_TH = torch.zeros(dest.shape[0], H, dtype=torch.int64).scatter_(1, dest // L, 1)
        unique_RH[r] = need_TH.sum(0) * up
    if plan is None:
        none = torch.zeros(0, dtype=torch.int64)
        return HostLayer(load, unique_RH, none, none.clone())
    used = plan.slot_expert_G >= 0
    return HostLayer(load, unique_RH, plan.slot_expert_G[used] // e, used.nonzero().flatten() // slots)


def host_fill(layer: HostLayer, run: HostRun, T: int, K: int) -> float:
    """Fullest fixed block over its capacity (> 1: overflow, a replayed step; not modelled). padded:
    (token, expert) rows per (source, destination); hierarchical: unique (token, host) rows per C1 block,
    (token, expert) rows per (entry, owner) C2 block (entry (h, j) gathers the sources of local index j)."""
    cl = run.cluster
    R, L, H = cl.ranks, cl.gpus_per_host, cl.hosts
    t = layer.load.traffic_RR
    if run.dispatcher == "padded":
        return float(t.max()) / padded_capacity(T, K, R, run.capacity_factor)
    if run.dispatcher == "hierarchical":
        C1, C2 = hier_capacities(T, K, H, L, run.capacity_factor)
        entry = t.view(H, L, R).sum(0)  # [local index j of the source, destination rank]
        host_leg = max(float(entry[:, h * L:(h + 1) * L].max()) for h in range(H))
        return max(float(layer.unique_RH.max()) / C1, host_leg / C2)
    return 0.0  # alltoall: variable sizes


def real_network_gb(layer: HostLayer, run: HostRun, shape: ModelShape) -> float:
    """GB the mean rank sends to other hosts in rows with data, one layer fwd + bwd: flat, its (token,
    expert) pairs on other hosts × 2 ways; hierarchical, its unique (token, remote host) pairs (+ ids and
    weights on dispatch) and one partial sum back per pair."""
    cl = run.cluster
    host_R = cl.host_R()
    D, K = shape.dim, shape.top_k
    if run.dispatcher == "hierarchical":
        remote_R = (layer.unique_RH * (torch.arange(cl.hosts)[None, :] != host_R[:, None])).sum(1)
        real = float(remote_R.double().mean()) * (2 * D * BYTES + META_BYTES * K)
    else:
        off_RR = host_R[:, None] != host_R[None, :]
        real = float((layer.load.traffic_RR * off_RR).sum(1).double().mean()) * 2 * D * BYTES
    return 2 * real / 1e9


def host_layer_ms(layer: HostLayer, run: HostRun, cal: Calibration, shape: ModelShape) -> dict:
    """One MoE layer, fwd + bwd, on a cluster (ms, for the straggler) and its network bytes per rank
    (GB, fwd + bwd: the backward moves the forward's bytes again). network_gb: what moves (fixed blocks);
    network_gb_real: the rows with data (mean rank); clone_network_gb: ECHO's weights and gradients
    between hosts (mean rank); network_total_gb: what all ranks put on the network (fixed blocks and
    clones). On a shared network the clones' bytes of all ranks share the aggregate rate; on per-GPU
    links the busiest rank's set the time. Non-network ms × run.compute_scale."""
    cl = run.cluster
    R = cl.ranks
    T, D, K, Hx = shape.tokens_per_rank, shape.dim, shape.top_k, shape.hidden
    lat = cl.collective_ms if cl.collective_ms is not None else default_collective_ms(cal)
    legs = dispatch_legs(run.dispatcher, cl, T, D, K, run.capacity_factor,
                         layer.load.traffic_RR if run.dispatcher == "alltoall" else None, run.wire)
    comm = 2 * round_trip_ms(legs, cl, lat)
    gemm_R = cal.gemm_ms(layer.load.rows_R, Hx) * run.compute_scale
    router = cal.router_ms * run.compute_scale
    echo, clone_gb, clone_total_gb = 0.0, 0.0, 0.0
    if run.slots:
        w = 3 * D * Hx * BYTES  # one expert's w1, w2, w3
        # the transports' fixed blocks of S experts (static shapes, used or not), per rank and direction:
        # hierarchical (HostTransport) one to each other host's rank of its local index, relayed inside the
        # host; flat (CollectiveTransport) one to every rank on another host
        H, L, S = cl.hosts, cl.gpus_per_host, run.slots
        blocks = (H - 1) * S if run.dispatcher == "hierarchical" else (R - L) * S
        net = (R if cl.shared_network else 1) * blocks * w / cl.network_gbs
        inside = (L - 1) * (H if run.dispatcher == "hierarchical" else 1) * S * w / cl.nvlink_gbs
        mc = max(net, inside) / 1e6
        echo = cal.planner(R, run.slots) / 1e3 * run.compute_scale + 2 * mc  # multicast forward, gradients back
        clone_gb = 2 * blocks * w / 1e9
        clone_total_gb = clone_gb * R
    gemm = float(gemm_R.max())
    return {"router": router, "comm": comm, "gemm": gemm, "gemm_mean": float(gemm_R.mean()), "echo": echo,
            "total": router + comm + gemm + echo, "network_gb": 2 * network_bytes(legs) / 1e9,
            "network_gb_real": real_network_gb(layer, run, shape), "clone_network_gb": clone_gb,
            "network_total_gb": 2 * network_bytes(legs, total=True) / 1e9 + clone_total_gb,
            "fill": host_fill(layer, run, T, K)}


def host_fsdp(cluster: Cluster, shape: ModelShape) -> tuple[float, float]:
    """(ms on the critical path, GB all ranks send over the network) of one step's FSDP2 traffic once EP
    spans hosts: a rank sends (R - 1) / R of fsdp_gb; per-GPU links: that at the per-GPU rate; a shared
    network: the H host-crossing edges of NCCL's ring each carry that, at the aggregate rate. × fsdp_exposed."""
    R, H = cluster.ranks, cluster.hosts
    gb = fsdp_gb(shape) * (R - 1) / R
    total = H * gb
    on_link = total if cluster.shared_network else gb
    return cluster.fsdp_exposed * on_link * 1e3 / cluster.network_gbs, total


def host_step(layers: list[HostLayer], run: HostRun, cal: Calibration, shape: ModelShape) -> dict:
    """One step on a cluster: the one-host model's non-MoE part (token part ∝ T; FSDP traffic over the
    network once EP spans hosts: host_fsdp) + Σ over the MoE layers of host_layer_ms. network_total_gb:
    what all ranks put on the network in the step (MoE legs, clones, FSDP)."""
    cl = run.cluster
    cfg = SimConfig(cl.ranks, experts=run.experts, slots=run.slots, backend="padded",
                    capacity_factor=run.capacity_factor, gpus_per_host=cl.gpus_per_host if cl.hosts > 1 else None,
                    inter_host_gbs=cl.network_gbs)
    nm = nonmoe_ms(cfg, cal, shape) if cl.ranks > 1 else {"token": cal.token_ms, "param": cal.param_ms_per_param * (
        shape.dense_params + shape.expert_params(run.experts)), "fsdp": 0.0}
    nm["token"] *= shape.tokens_per_rank / ModelShape().tokens_per_rank  # calibrated at 16384 tokens
    nm["token"] *= run.compute_scale
    nm["param"] *= run.compute_scale
    fsdp_total_gb = 0.0
    if cl.hosts > 1 and cl.ranks > 1:
        nm["fsdp"], fsdp_total_gb = host_fsdp(cl, shape)
    per = [host_layer_ms(l, run, cal, shape) for l in layers]
    moe = {k: sum(p[k] for p in per) for k in per[0] if k != "fill"}
    step = sum(nm.values()) + moe["total"]
    return {"step_ms": step, "tokens_per_s_per_gpu": shape.tokens_per_rank / step * 1e3, "nonmoe": nm, "moe": moe,
            "network_total_gb": moe["network_total_gb"] + fsdp_total_gb,
            "fill": max(p["fill"] for p in per),
            "load_before": statistics.mean(l.load.load_before for l in layers),
            "load_after": statistics.mean(l.load.load_after for l in layers)}


def host_mean(steps: list[dict], shape: ModelShape) -> dict:
    """Mean of several simulated steps (tokens/s from the mean step; fill: the fullest)."""
    step = statistics.mean(s["step_ms"] for s in steps)
    return {"step_ms": step, "tokens_per_s_per_gpu": shape.tokens_per_rank / step * 1e3,
            "network_total_gb": statistics.mean(s["network_total_gb"] for s in steps),
            "nonmoe": {k: statistics.mean(s["nonmoe"][k] for s in steps) for k in steps[0]["nonmoe"]},
            "moe": {k: statistics.mean(s["moe"][k] for s in steps) for k in steps[0]["moe"]},
            "fill": max(s["fill"] for s in steps),
            "load_before": statistics.mean(s["load_before"] for s in steps),
            "load_after": statistics.mean(s["load_after"] for s in steps)}


def host_layers(cluster: Cluster, E: int, routing: str, slots_list: list[int], steps: int, shape: ModelShape,
                seed: int = 0, tokens: int = SAMPLE_TOKENS) -> dict[int, list[list[HostLayer]]]:
    """{slots: layers[step][layer]}: the same sampled routing for every slot count (``tokens`` drawn
    per rank, scaled to the shape's T)."""
    up = max(1, shape.tokens_per_rank // tokens)
    out = {s: [] for s in slots_list}
    for t in range(steps):
        ids = [routing_ids(cluster.ranks, E, shape.top_k, routing, tokens, seed + 7 * l + 1000 * t)
               for l in range(shape.moe_layers)]
        for s in slots_list:
            out[s].append([host_layer(i, E, s, cluster, up) for i in ids])
    return out


def predict_hosts(cal: Calibration, shape: ModelShape, gpus_per_host: int = 8, nvlink_gbs: float = 400.0,
                  network_gbs: float = 50.0, capacity_factor: float = 1.25, collective_ms: float | None = None,
                  steps: int = 2, slots: int = 2, seed: int = 0, plan=HOST_PREDICT) -> list[dict]:
    """Flat padded vs hierarchical × ECHO off / on × Zipf(1.2) / 8 hot experts at EP = 16 / 32 / 64."""
    rows = []
    for ep, E in plan:
        cl = Cluster(ep // gpus_per_host, gpus_per_host, nvlink_gbs, network_gbs, collective_ms)
        sh = replace(shape, experts=E)
        for name, routing in HOST_ROUTINGS.items():
            t0 = time.time()
            layers = host_layers(cl, E, routing, [0, slots], steps, sh, seed)
            flat = {}
            for S in (0, slots):
                for disp, wire in (("padded", "bf16"), ("hierarchical", "bf16"), ("hierarchical", "fp8")):
                    run = HostRun(cl, disp, E, S, capacity_factor, wire=wire)
                    m = host_mean([host_step(ls, run, cal, sh) for ls in layers[S]], sh)
                    if disp == "padded":
                        flat[S] = m
                    rows.append({
                        "EP": ep, "hosts": f"{cl.hosts}x{gpus_per_host}", "E": E, "routing": name,
                        "dispatch": "flat padded" if disp == "padded" else f"hierarchical{', fp8 wire' if wire == 'fp8' else ''}",
                        "ECHO": f"S={S}" if S else "off",
                        "load": f"{m['load_before']:.2f}" + (f" -> {m['load_after']:.2f}" if S else ""),
                        "fill": m["fill"], "net_GB": m["moe"]["network_gb"], "net_GB_real": m["moe"]["network_gb_real"],
                        "clone_net_GB": m["moe"]["clone_network_gb"], "comm_ms": m["moe"]["comm"],
                        "gemm_ms": m["moe"]["gemm"], "echo_ms": m["moe"]["echo"], "fsdp_ms": m["nonmoe"]["fsdp"],
                        "step_ms": m["step_ms"], "tok_s_per_gpu": m["tokens_per_s_per_gpu"],
                        "vs_flat": flat[S]["step_ms"] / m["step_ms"]})
            print(f"  (hosts: EP={ep}, {name}: {time.time() - t0:.1f} s)", flush=True)
    return rows


def network_ratios(shape: ModelShape, capacity_factor: float = 1.25, steps: int = 2, seed: int = 0,
                   clusters: tuple = ((2, 1), (2, 2), (2, 8)), E: int = 64) -> list[dict]:
    """Network GB per step per rank, flat padded vs hierarchical, ECHO off, at 2 hosts (bytes only:
    no calibration needed). padded: the fixed blocks that move; real: rows with data (mean rank)."""
    rows = []
    for H, L in clusters:
        cl = Cluster(H, L)
        sh = replace(shape, experts=E)
        for name, routing in HOST_ROUTINGS.items():
            layers = [ls for st in host_layers(cl, E, routing, [0], steps, sh, seed)[0] for ls in st]
            gb = {}
            for disp in ("padded", "hierarchical"):
                legs = dispatch_legs(disp, cl, sh.tokens_per_rank, sh.dim, sh.top_k, capacity_factor)
                run = HostRun(cl, disp, E, 0, capacity_factor)
                real = statistics.mean(real_network_gb(l, run, sh) for l in layers)
                gb[disp] = (2 * network_bytes(legs) * sh.moe_layers / 1e9, real * sh.moe_layers,
                            max(host_fill(l, run, sh.tokens_per_rank, sh.top_k) for l in layers))
            (fp, fr, ff), (hp, hr, hf) = gb["padded"], gb["hierarchical"]
            rows.append({"hosts": f"{H}x{L}", "E": E, "K": sh.top_k, "routing": name, "flat_padded_GB": fp,
                         "hier_padded_GB": hp, "hier_over_flat_padded": hp / fp, "flat_real_GB": fr, "hier_real_GB": hr,
                         "hier_real_over_flat_real": hr / fr, "hier_real_over_flat_padded": hr / fp,
                         "flat_fill": ff, "hier_fill": hf, "target_45pct": "met" if hp / fp <= 0.45 else "missed"})
    return rows


# calibration against measured multi-host rows (emulated hosts)

MEASURED_KEYS = ("dispatch_combine_ms", "step_ms", "network_gbs")


def _num(v) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def host_row(row: dict) -> dict | None:
    """A measured row normalised (ints, floats), or None when it lacks what the model needs: dispatcher,
    hosts, gpus_per_host, tokens_per_rank, hidden, top_k (+ capacity_factor unless alltoall) and at least
    one positive measurement. Optional: experts, slots, routing, network_rows. Rows of a pipelined layer
    (``overlap_chunks`` > 1) are left out: the model has no overlap of communication with compute."""
    if not isinstance(row, dict) or row.get("dispatcher") not in DISPATCHERS:
        return None
    if (_num(row.get("overlap_chunks")) or 1) > 1:
        return None
    out = dict(row)
    for k in ("hosts", "gpus_per_host", "tokens_per_rank", "hidden", "top_k"):
        v = _num(row.get(k))
        if v is None or v < 1 or v != int(v):
            return None
        out[k] = int(v)
    cf = _num(row.get("capacity_factor"))
    if cf is None and row["dispatcher"] != "alltoall":
        return None
    out["capacity_factor"] = cf
    for k in ("experts", "slots"):
        v = _num(row.get(k))
        out[k] = int(v) if v is not None else None
    v = _num(row.get("network_rows"))
    out["network_rows"] = v if v is not None and v >= 0 else None
    measured = 0
    for k in MEASURED_KEYS:
        v = _num(row.get(k))
        out[k] = v if v is not None and v > 0 else None
        measured += out[k] is not None
    return out if measured else None


def machine_of(name: str, env: dict) -> str:
    """The machine a results file was measured on: its name's ``_<N>x<GPU>`` suffix (e.g. 2xH100), else its
    env's gpu. Rows of one machine share its network."""
    m = re.search(r"_(\d+x[A-Za-z0-9]+)\.json$", name)
    return m.group(1) if m else str(env.get("gpu", ""))


def read_host_rows(results: str = RESULTS) -> list[dict]:
    """The usable rows of ``dispatch_hosts*.json`` and ``e2e_hosts*.json`` ({"rows": [...]}), each tagged
    with its file (``source``), its machine (``machine``: machine_of) and its GPU (``gpu``, the env's name);
    missing or unreadable files and incomplete rows are skipped."""
    import glob

    rows = []
    names = sorted(glob.glob(os.path.join(results, "dispatch_hosts*.json"))) + \
        sorted(glob.glob(os.path.join(results, "e2e_hosts*.json")))
    for path in names:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            continue
        env = data["env"] if isinstance(data.get("env"), dict) else {}
        base = os.path.basename(path)
        for row in data["rows"]:
            r = host_row(row)
            if r is not None:
                rows.append({**r, "source": base, "machine": machine_of(base, env),
                             "gpu": str(env.get("gpu_name") or env.get("gpu") or "")})
    return rows


def one_gpu_step_ms(gpu: str, results: str = RESULTS) -> float | None:
    """ms of the unlabelled one-GPU v2lite_1b ``ours_graph`` row of e2e_1x<GPU>.json (the graphed recipe, as
    the e2e host rows ran), or None."""
    try:
        data = _load(result_name("e2e", gpu), results)
    except (OSError, ValueError):
        return None
    for r in data.get("rows", []) if isinstance(data, dict) else []:
        if (isinstance(r, dict) and r.get("config") == "v2lite_1b_gpu" and r.get("gpus") == 1
                and r.get("run") == "ours_graph" and not r.get("label") and not r.get("variant")
                and _num(r.get("step_ms"))):
            return float(r["step_ms"])
    return None


def compute_scale(gpu: str, cal: Calibration, results: str = RESULTS) -> float:
    """Non-network ms on ``gpu`` over the calibration GPU's: the ratio of their one-GPU steps
    (one_gpu_step_ms); 1 on the calibration's GPU or where either is missing."""
    if not gpu or gpu_short(gpu) == gpu_short(cal.gpu):
        return 1.0
    a, b = one_gpu_step_ms(gpu, results), one_gpu_step_ms(cal.gpu, results)
    return a / b if a and b else 1.0


def _row_legs(row: dict, nvlink_gbs: float) -> tuple[Cluster, dict[str, list[Leg]]]:
    """A measured row's legs; alltoall with ``network_rows`` (the busiest rank's (token, choice) rows to
    other hosts, one way) moves those, and on-host rows in the same proportion per peer; all ranks together
    move (R - L)·T·K rows to other hosts whatever the skew (every rank routes from one distribution)."""
    cl = Cluster(row["hosts"], row["gpus_per_host"], nvlink_gbs)
    legs = dispatch_legs(row["dispatcher"], cl, row["tokens_per_rank"], row["hidden"], row["top_k"],
                         row["capacity_factor"] or 1.0)
    off = row.get("network_rows")
    if row["dispatcher"] == "alltoall" and off is not None and cl.hosts > 1:
        L, R, b = cl.gpus_per_host, cl.ranks, row["hidden"] * BYTES
        leg = Leg("all_to_all", off * b, off * (L - 1) / (R - L) * b, legs["combine"][0].network_total_bytes)
        legs = {"dispatch": [legs["dispatch"][0], leg], "combine": [leg]}
    return cl, legs


def predicted_round_trip_ms(row: dict, network_gbs: float, collective_ms: float, nvlink_gbs: float = 400.0,
                            shared_network: bool = False) -> float:
    """Forward dispatch + combine ms of a measured row's configuration (alltoall: its ``network_rows``,
    else balanced rows); ``network_gbs`` per GPU, or the aggregate with ``shared_network``."""
    cl, legs = _row_legs(row, nvlink_gbs)
    return round_trip_ms(legs, replace(cl, network_gbs=network_gbs, shared_network=shared_network), collective_ms)


@dataclass
class RowModel:
    """One measured time as the model predicts it: ms(collective_ms, network_gbs, fsdp_exposed) -> ms, and
    network_gb: what all ranks put on the network in that time (GB)."""
    row: int
    quantity: str  # "dispatch_combine_ms" | "step_ms"
    measured: float
    machine: str
    ms: object
    network_gb: float


def _row_models(rows: list[dict], nvlink_gbs: float, shared: bool, cal: Calibration | None, shape: ModelShape,
                steps: int, layers_cache: dict, results: str = RESULTS) -> list[RowModel]:
    """RowModels of every measured time in ``rows``: dispatch_combine_ms (round_trip_ms of the row's legs)
    and step_ms (host_step over ``steps`` sampled steps; needs experts; routing "natural" = "zipf1.2",
    "zipf<s>", "hot<N>", default "uniform"; non-network ms scaled to the row's GPU by compute_scale). The
    sampled layers are kept in ``layers_cache`` (by row) for the next call."""
    out = []
    for i, r in enumerate(rows):
        if r["dispatch_combine_ms"] is not None:
            cl, legs = _row_legs(r, nvlink_gbs)
            f = (lambda c, g, phi, r=r: predicted_round_trip_ms(r, g, c, nvlink_gbs, shared))  # noqa: E731
            out.append(RowModel(i, "dispatch_combine_ms", r["dispatch_combine_ms"], r.get("machine") or "",
                                f, network_bytes(legs, total=True) / 1e9))
        if r["step_ms"] is not None and r["experts"]:
            sh = replace(shape, dim=r["hidden"], top_k=r["top_k"], experts=r["experts"],
                         tokens_per_rank=r["tokens_per_rank"])
            run = HostRun(Cluster(r["hosts"], r["gpus_per_host"], nvlink_gbs, 1.0, 0.0, shared), r["dispatcher"],
                          r["experts"], r["slots"] or 0, r["capacity_factor"] or 1.0,
                          compute_scale(r.get("gpu", ""), cal, results))
            if i not in layers_cache:
                routing = r.get("routing") or "uniform"
                routing = "zipf1.2" if routing == "natural" else routing
                tokens = min(SAMPLE_TOKENS, r["tokens_per_rank"])
                layers_cache[i] = host_layers(run.cluster, r["experts"], routing, [run.slots], steps, sh,
                                              tokens=tokens)[run.slots]
            layers = layers_cache[i]

            def step(c, g, phi, run=run, sh=sh, layers=layers):
                at = replace(run, cluster=replace(run.cluster, network_gbs=g, collective_ms=c, fsdp_exposed=phi))
                return host_mean([host_step(ls, at, cal, sh) for ls in layers], sh)

            out.append(RowModel(i, "step_ms", r["step_ms"], r.get("machine") or "",
                                lambda c, g, phi, step=step: step(c, g, phi)["step_ms"],
                                step(1.0, 1.0, 1.0)["network_total_gb"]))
    return out


def _solve(models: list[RowModel], c: float, gbs: dict, phi: float, free_c: bool, free: set, free_phi: bool,
           iters: int = 30) -> tuple[float, dict, float]:
    """Least squares in relative error of the free parameters among c (ms per collective), 1 / gbs[machine]
    for the machines in ``free`` and phi (FSDP's exposed share, on a grid of [0, 1] in steps of 0.001). A
    prediction is piecewise linear in (c, 1 / gbs, phi / gbs) (c + the slower link class per leg), so:
    linearise at the current point (finite differences, exact inside a piece), solve, repeat until the point
    stops moving. A free machine without network bytes in its rows keeps gbs None; too few rows for a
    free c: c stays."""
    s = {m: 1.0 / g for m, g in gbs.items() if g}
    for _ in range(iters):
        k, n, g0, f1 = (np.zeros(len(models)) for _ in range(4))
        for j, m in enumerate(models):
            sm = s[m.machine]
            e0 = m.ms(c, 1 / sm, phi)
            n[j] = m.ms(c + 1.0, 1 / sm, phi) - e0
            d = 1e-3 * sm
            G = (m.ms(c, 1 / (sm + d), phi) - e0) / d
            f1[j] = (m.ms(c, 1 / sm, phi + 1.0) - e0) / sm
            k[j], g0[j] = e0 - c * n[j] - sm * G, G - phi * f1[j]
        y = np.array([m.measured for m in models])
        mach = np.array([m.machine for m in models])
        live = sorted(mm for mm in free if np.any(np.abs((g0 + f1)[mach == mm]) > 0))
        grid = np.linspace(0, 1, 1001) if free_phi and np.any(np.abs(f1) > 0) else np.array([phi])
        best = None
        for mode in (["fit", "zero"] if free_c else ["keep"]):  # a negative fitted c: refit at c = 0
            use_c, c_fix = mode == "fit", (0.0 if mode == "zero" else c)
            for ph in grid:
                gx = g0 + ph * f1
                rhs = y - k - (0.0 if use_c else c_fix * n)
                rhs = rhs - sum(s[mm] * gx * (mach == mm) for mm in s if mm not in live)
                cols = ([n] if use_c else []) + [gx * (mach == mm) for mm in live]
                if not cols:
                    theta = np.zeros(0)
                else:
                    A = np.stack(cols, 1) / y[:, None]
                    if np.linalg.matrix_rank(A) < A.shape[1]:
                        continue
                    theta = np.linalg.lstsq(A, rhs / y, rcond=None)[0]
                    if np.any(theta[int(use_c):] <= 0) or (use_c and theta[0] < 0):
                        continue
                pred = y - rhs + (np.stack(cols, 1) @ theta if cols else 0.0)
                rms = float(np.sqrt(np.mean((pred / y - 1) ** 2)))
                if best is None or rms < best[0] - 1e-15:
                    best = (rms, c_fix, use_c, float(ph), theta)
            if best is not None:
                break
        if best is None:
            raise ValueError("emulated-cluster fit: no positive network rate fits these rows")
        _, c_fix, use_c, ph, theta = best
        c_new = float(theta[0]) if use_c else c_fix
        s_new = {**s, **{mm: float(t) for mm, t in zip(live, theta[int(use_c):])}}
        done = (np.isclose(c_new, c, rtol=1e-10, atol=1e-12) and ph == phi
                and all(np.isclose(s_new[mm], s.get(mm, 0.0), rtol=1e-10, atol=0) for mm in s_new))
        c, s, phi = c_new, s_new, ph
        if done:
            break
    return c, {m: (1 / s[m] if m in s else None) for m in set(gbs) | set(s)}, phi


def _fit_form(models: list[RowModel], per_machine: bool, collective_ms: float | None,
              fsdp_exposed: float | None) -> dict:
    """The network fitted in two stages: the dispatch + combine rows fix GB/s (per machine, or one for all)
    and the ms per collective (unless given); the step rows then fix only what those cannot: FSDP's exposed
    share (unless given) and the GB/s of a machine without dispatch rows. Returns the parameters and, per
    model, its prediction at them."""
    key = (lambda m: m.machine) if per_machine else (lambda m: "all")  # noqa: E731
    ms = [replace(m, machine=key(m)) for m in models]
    disp = [m for m in ms if m.quantity == "dispatch_combine_ms"]
    step = [m for m in ms if m.quantity == "step_ms"]
    machines = sorted({m.machine for m in ms})
    c, phi = collective_ms if collective_ms is not None else 0.5, fsdp_exposed if fsdp_exposed is not None else 1.0
    gbs = {m: 1.0 for m in machines}
    if disp:
        c, got, _ = _solve(disp, c, gbs, phi, collective_ms is None, {m.machine for m in disp}, False)
        gbs.update({m: g for m, g in got.items() if g})
    fixed = {m.machine for m in disp}
    if step:
        c, got, phi = _solve(step, c, gbs, phi, collective_ms is None and not disp,
                             {m.machine for m in step} - fixed, fsdp_exposed is None)
        gbs.update({m: g for m, g in got.items() if g})
    pred = [m.ms(c, gbs[m.machine], phi) for m in ms]
    rel = np.array([p / m.measured - 1 for p, m in zip(pred, ms)])
    rms = lambda sel: float(np.sqrt(np.mean(rel[sel] ** 2))) if np.any(sel) else None  # noqa: E731
    q = np.array([m.quantity for m in ms])
    return {"network_gbs": gbs, "collective_ms": c, "fsdp_exposed": phi, "predicted": pred,
            "rms_rel": rms(np.ones(len(ms), dtype=bool)), "rms_rel_dispatch": rms(q == "dispatch_combine_ms"),
            "rms_rel_step": rms(q == "step_ms"), "max_rel": float(np.abs(rel).max()),
            "outside_15pct": int((np.abs(rel) > TOLERANCE).sum()),
            "rows_per_machine": {mm: {"dispatch": sum(m.machine == mm for m in disp),
                                      "step": sum(m.machine == mm for m in step)} for mm in machines}}


# forms compared with the adopted one (shared network, GB/s per machine, FSDP's exposed share fitted)
HOST_FORMS = [("per-GPU network, one GB/s, FSDP exposed", False, False, 1.0),
              ("per-GPU network, GB/s per machine, FSDP share fitted", False, True, None),
              ("shared network, one GB/s for both machines, FSDP share fitted", True, False, None),
              ("shared network, GB/s per machine, FSDP exposed", True, True, 1.0),
              ("shared network, GB/s per machine, FSDP hidden", True, True, 0.0)]


def calibrate_hosts(measured: list[dict], nvlink_gbs: float = 400.0, cal: Calibration | None = None,
                    shape: ModelShape | None = None, collective_ms: float | None = None, steps: int = 2,
                    shared_network: bool = True, per_machine: bool = True, fsdp_exposed: float | None = None,
                    alternatives: bool = False, results: str = RESULTS) -> dict:
    """Fit the emulated cluster's network to the measured rows (_fit_form: the dispatch + combine rows fix
    GB/s and ms per collective, the step rows FSDP's exposed share and the GB/s of machines without dispatch
    rows), then predicted vs measured for every usable row and quantity: dispatch_combine_ms, step_ms (needs
    experts; ``cal`` made from the default GPU's results when not given) and network_gbs (the measured
    all_to_all rate per peer: shared, the aggregate / (R·(H - 1)), each rank sending to its H - 1 peers at
    once; per-GPU, the rate itself). ``shared_network``: one aggregate GB/s per machine (all ranks' network
    bytes share it), else per GPU; ``per_machine``: one rate per machine (row key ``machine``), else one for
    all. Returns {"shared_network", "network_gbs": {machine: GB/s}, "collective_ms", "fsdp_exposed", "form",
    "fit_rows", "rms_rel" (every fitted row), "rms_rel_dispatch", "rms_rel_step", "checks": [...],
    "spread": [...] (rows the model cannot tell apart: same machine, quantity and prediction),
    "alternatives": [...] (with ``alternatives``: HOST_FORMS, same rows)}; each check has predicted, measured,
    ratio and within_15pct."""
    rows = [r for r in (host_row(m) for m in measured) if r is not None]
    shape = shape or ModelShape()
    out = {"shared_network": shared_network, "network_gbs": {}, "collective_ms": None, "fsdp_exposed": None,
           "nvlink_gbs": nvlink_gbs, "form": "no measured times", "fit_rows": 0, "rms_rel": None,
           "rms_rel_dispatch": None, "rms_rel_step": None, "checks": [], "spread": [], "alternatives": []}
    if cal is None and any(r["step_ms"] is not None and r["experts"] for r in rows):
        cal = calibrate()
    cache = {}
    models = {sh: _row_models(rows, nvlink_gbs, sh, cal, shape, steps, cache, results)
              for sh in ({shared_network, False, True} if alternatives else {shared_network})}
    if not models[shared_network]:
        return out
    fit = _fit_form(models[shared_network], per_machine, collective_ms, fsdp_exposed)
    link = "shared network: aggregate" if shared_network else "per-GPU network:"
    out.update({k: fit[k] for k in ("network_gbs", "collective_ms", "fsdp_exposed", "rms_rel", "rms_rel_dispatch",
                                    "rms_rel_step", "rows_per_machine")},
               compute_scale={r.get("gpu") or "": compute_scale(r.get("gpu") or "", cal, results)
                              for r in rows if r["step_ms"] is not None and r["experts"]},
               form=f"{link} {'GB/s per machine' if per_machine else 'GB/s for all'}; ms per collective "
                    f"{'given' if collective_ms is not None else 'fitted'}; FSDP's exposed share "
                    f"{'given' if fsdp_exposed is not None else 'fitted'}",
               fit_rows=len(models[shared_network]))
    by_row, rate_seen = {}, set()
    for m, p in zip(models[shared_network], fit["predicted"]):
        by_row.setdefault(m.row, []).append((m, p))
    for i, r in enumerate(rows):
        label = {k: r[k] for k in ("dispatcher", "hosts", "gpus_per_host", "tokens_per_rank", "hidden", "top_k",
                                   "capacity_factor", "slots")}
        label.update(source=r.get("source", ""), machine=r.get("machine") or "", routing=r.get("routing") or "uniform")
        checks = [(m.quantity, p, m.measured, m.network_gb) for m, p in by_row.get(i, [])]
        if r["network_gbs"] is not None and (r.get("source"), r["network_gbs"]) not in rate_seen:
            rate_seen.add((r.get("source"), r["network_gbs"]))
            g = fit["network_gbs"].get((r.get("machine") or "") if per_machine else "all")
            if g:
                H, R = r["hosts"], r["hosts"] * r["gpus_per_host"]
                checks.append(("network_gbs", g / (R * (H - 1)) if shared_network else g, r["network_gbs"], None))
        for q, pred, meas, gb in checks:
            ratio = pred / meas
            out["checks"].append({"row": i, **label, "quantity": q, "network_GB": gb, "predicted": pred,
                                  "measured": meas, "ratio": ratio, "within_15pct": abs(ratio - 1) <= TOLERANCE})
    groups = {}
    for m, p in zip(models[shared_network], fit["predicted"]):
        groups.setdefault((m.machine, m.quantity, round(p, 9)), []).append(m)
    for (mach, q, p), ms in groups.items():
        if len(ms) > 1:
            lo, hi = min(ms, key=lambda m: m.measured), max(ms, key=lambda m: m.measured)
            out["spread"].append({"machine": mach, "quantity": q, "predicted": p, "rows": [m.row for m in ms],
                                  "measured_min": lo.measured, "measured_max": hi.measured,
                                  "max_over_min": hi.measured / lo.measured,
                                  "label": ", ".join(f"{rows[m.row]['dispatcher']} {rows[m.row].get('routing')} "
                                                     f"T={rows[m.row]['tokens_per_rank']}" for m in (hi, lo))})
    if alternatives:
        for name, sh, pm, phi in HOST_FORMS:
            try:
                alt = _fit_form(models[sh], pm, collective_ms, phi)
            except ValueError as e:
                out["alternatives"].append({"form": name, "worst": str(e)})
                continue
            rel = [p / m.measured - 1 for p, m in zip(alt["predicted"], models[sh])]
            worst = int(np.argmax(np.abs(rel)))
            w = rows[models[sh][worst].row]
            out["alternatives"].append({
                "form": name, "network_gbs": ", ".join(f"{k} {v:.3g}" for k, v in sorted(alt["network_gbs"].items())),
                "collective_ms": alt["collective_ms"], "fsdp_exposed": alt["fsdp_exposed"], "rms_rel": alt["rms_rel"],
                "max_rel": alt["max_rel"], "outside_15pct": alt["outside_15pct"],
                "worst": f"{w['dispatcher']} {w['hosts']}x{w['gpus_per_host']} {models[sh][worst].quantity} "
                         f"{1 + rel[worst]:.2f}"})
    return out


def hosts_report(cal: Calibration, shape: ModelShape, pred: list[dict], ratios: list[dict], measured: dict,
                 args: dict) -> str:
    """The host section: 2-host network bytes, emulated-cluster calibration, EP = 16 / 32 / 64 predictions."""
    f = markdown_table
    lat = args["collective_ms"] if args["collective_ms"] is not None else default_collective_ms(cal)
    out = [
        "## Across hosts: flat padded vs hierarchical dispatch",
        "",
        f"EP rank r on host r // L; NVLink {args['nvlink_gbs']:g} GB/s and network {args['network_gbs']:g} GB/s per GPU "
        f"and direction; capacity factor {args['capacity_factor']:g}; {lat:.3f} ms fixed per collective "
        f"({'given' if args['collective_ms'] is not None else 'half the one-host padded fit intercept'}); legs "
        "sequential, no overlap. Flat padded: C = round_up(cf·T·K/R, 8) rows per (source, destination), (R - L)·C "
        "over the network each way. Hierarchical: C1 = min(T, round_up(cf·T·(1-(1-1/H)^K), 8)) rows per (source, host) over the "
        f"network (+{META_BYTES}·K bytes of ids and weights per row on dispatch), then C2 = round_up(cf·T·K/L, 8) rows "
        "per (entry, owner) over NVLink; combine reverses both. Backward moves the forward's bytes again.",
        "",
        f"### Network bytes per step per rank at 2 hosts (v2lite_1b routing: E=64, K={shape.top_k}, T={shape.tokens_per_rank}, "
        f"{shape.moe_layers} MoE layers, ECHO off)",
        "",
        "`padded`: the fixed blocks that move (what the time uses); `real`: rows with data, mean rank (flat: "
        "(token, expert) pairs on other hosts; hierarchical: unique (token, remote host) pairs). `fill`: fullest block / "
        "its capacity over the sampled layers (> 1: overflow, a replayed step, not modelled). Target: hierarchical ≤ "
        "45% of flat padded at the same capacity factor.",
        "",
        f(ratios, ["hosts", "routing", "flat_padded_GB", "hier_padded_GB", "hier_over_flat_padded", "flat_real_GB",
                   "hier_real_GB", "hier_real_over_flat_real", "hier_real_over_flat_padded", "flat_fill", "hier_fill",
                   "target_45pct"]),
        "",
        "### Calibration against the emulated cluster",
        "",
    ]
    out += emulated_report(measured)
    out += [
        "",
        f"### Predictions, EP = 16 / 32 / 64 at {args['gpus_per_host']} GPUs per host ({cal.gpu} calibration)",
        "",
        f"v2lite_1b shapes (D={shape.dim}, H={shape.hidden}, K={shape.top_k}, T={shape.tokens_per_rank}), 4 experts per "
        f"rank (E = 64 / 128 / 256), {args['steps']} simulated steps of {SAMPLE_TOKENS} sampled tokens per rank; Zipf(1.2) "
        "on a random expert placement per layer, or 8 hot experts (0-7). `net_GB`: dispatch bytes to other hosts per "
        "step per rank (fixed blocks); `net_GB_real`: rows with data; `clone_net_GB`: ECHO's clone weights and gradients "
        "between hosts (mean rank); ms are per step (MoE terms summed over layers); `fsdp_ms`: the dense parameters' "
        "exposed all-gathers / reduce-scatters at the network rate; `vs_flat`: flat padded step / this step (same "
        "routing and ECHO).",
        "",
        f([{**r, "tok_s_per_gpu": f"{r['tok_s_per_gpu']:,.0f}", "vs_flat": f"{r['vs_flat']:.2f}x"} for r in pred],
          ["EP", "hosts", "E", "routing", "dispatch", "ECHO", "load", "fill", "net_GB", "net_GB_real", "clone_net_GB",
           "comm_ms", "gemm_ms", "echo_ms", "fsdp_ms", "step_ms", "tok_s_per_gpu", "vs_flat"]),
        "",
        host_summary(pred),
    ]
    return "\n".join(out)


def emulated_report(m: dict) -> list[str]:
    """Markdown lines of calibrate_hosts' result: the model, the fitted parameters, every row, the spread
    between rows the model cannot tell apart, what stays outside 15%, other forms on the same rows."""
    if not m["checks"]:
        return ["No usable rows in benchmarks/results/dispatch_hosts*.json or e2e_hosts*.json: nothing fitted."]
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    rates = ", ".join(f"{k or 'all'} {v:.3g} GB/s" for k, v in sorted(m["network_gbs"].items()) if v)
    per = m.get("rows_per_machine", {})
    own = [k for k, v in per.items() if v["dispatch"] == 0 and v["step"] > 0]
    scales = ", ".join(f"{g} × {x:.3f}" for g, x in sorted(m.get("compute_scale", {}).items()) if x != 1.0)
    fit = [c for c in m["checks"] if c["quantity"] != "network_gbs"]
    ok = sum(c["within_15pct"] for c in fit)
    lines = [
        "Emulated hosts are GPUs of one machine whose NCCL traffic between hosts goes over NET/Socket on that "
        "machine, so every rank's network bytes share one socket path. Modelled so (`Cluster(shared_network=True)`): "
        "a leg's network time is the bytes all ranks send to other hosts together over one aggregate GB/s of the "
        "machine (flat padded at 2 × 2: 4 ranks × (R - L)·C; hierarchical: the 2 pairs of its network leg, 4 ranks "
        "× (H - 1)·C1; alltoall: (R - L)·T·K rows whatever the skew), + a fixed ms per collective; FSDP2's "
        "all-gathers and reduce-scatters cross the hosts on the H edges of NCCL's ring, each carrying (R - 1)/R of "
        "the dense traffic, on the same path, of which the share `fsdp_exposed` adds to the step (the rest runs "
        "beside the dispatch's all_to_alls: FSDP2 issues them on its own streams and communicator). Non-network "
        "ms: the one-host model (its GPU's calibration)"
        + (f", scaled for other GPUs by the ratio of the one-GPU graphed v2lite_1b steps in e2e_1x<GPU>.json "
           f"({scales})" if scales else "") + ".",
        "",
        f"Fitted ({m['form']}) in two stages: the {sum(v['dispatch'] for v in per.values())} dispatch + combine rows "
        f"(eager) fix each machine's aggregate and the ms per collective (rms {pct(m['rms_rel_dispatch'])}); the "
        f"{sum(v['step'] for v in per.values())} step rows (graphed) then fix only what those cannot, FSDP's "
        f"exposed share" + (f" and the aggregate of {', '.join(own)} (no dispatch rows there: its "
                            f"{', '.join(str(per[k]['step']) for k in own)} step rows carry that one parameter, so "
                            "they test the flat / hierarchical ratio, not the rate)" if own else "")
        + f" (rms {pct(m['rms_rel_step'])}). Result: {rates}; {m['collective_ms']:.3f} ms per collective; FSDP "
        f"exposed share {m['fsdp_exposed']:.3f}; rms over every fitted row {pct(m['rms_rel'])}, {ok} of {len(fit)} "
        "within 15%. `network_GB`: what all ranks put on the network in the measured time (a forward round trip; "
        "a step: MoE legs, clones, FSDP). `network_gbs` rows: NCCL's all_to_all rate per peer between the hosts "
        "against the aggregate / (R·(H - 1)) (each rank sending to its H - 1 peers at once).",
        "",
        markdown_table([{**c, "within_15pct": "yes" if c["within_15pct"] else "NO",
                         "network_GB": "" if c["network_GB"] is None else c["network_GB"],
                         "slots": c["slots"] or ""} for c in m["checks"]],
                       ["source", "dispatcher", "routing", "hosts", "gpus_per_host", "tokens_per_rank",
                        "capacity_factor", "slots", "quantity", "network_GB", "predicted", "measured", "ratio",
                        "within_15pct"]),
        "",
    ]
    spread = [x for x in m["spread"] if x["max_over_min"] > 1.05]
    if spread:
        lines += ["Rows the model cannot tell apart (same machine, same bytes on the shared path) measured apart: "
                  + "; ".join(f"{x['label']}: {x['measured_max']:.1f} vs {x['measured_min']:.1f} ms "
                              f"({x['max_over_min']:.2f}x)" for x in spread)
                  + ". No model of bytes predicts such a pair closer than ±(ratio − 1)/2 around its mean: that "
                  "spread bounds the fit.", ""]
    off = [c for c in m["checks"] if not c["within_15pct"]]
    if off:
        lines += ["Outside 15%: " + "; ".join(f"{c['source']} {c['dispatcher']} {c['routing']} "
                                              f"T={c['tokens_per_rank']} {c['quantity']} (ratio {c['ratio']:.2f})"
                                              for c in off) + ".", ""]
    else:
        one = [a for a in m["alternatives"] if a["form"] == HOST_FORMS[2][0] and "rms_rel" in a]
        lines += ["Every row within 15%"
                  + (f"; the aggregate of {', '.join(own)} rests on its own step rows" if own else "")
                  + (f" (with one aggregate for every machine, the third form below: {one[0]['outside_15pct']} rows "
                     f"outside, worst {one[0]['worst']})" if own and one else "") + ".", ""]
    if m["alternatives"]:
        lines += ["Other forms, same rows and stages:", "",
                  markdown_table([{**a, "fsdp_exposed": a.get("fsdp_exposed", "")} for a in m["alternatives"]],
                                 ["form", "network_gbs", "collective_ms", "fsdp_exposed", "rms_rel", "max_rel",
                                  "outside_15pct", "worst"]), ""]
    lines.append("These rates are the emulated machines', not a cluster's: the predictions below keep one NIC per GPU "
                 "(`shared_network` off) at the assumed rate, and FSDP fully exposed.")
    return lines


def host_summary(pred: list[dict]) -> str:
    """One paragraph read off the prediction rows (Zipf(1.2), ECHO off): network bytes hierarchical / flat."""
    parts = []
    for ep in sorted({r["EP"] for r in pred}):
        pick = {r["dispatch"]: r for r in pred if r["EP"] == ep and r["ECHO"] == "off" and r["routing"] == "Zipf(1.2)"}
        if len(pick) == 2:
            f, h = pick["flat padded"], pick["hierarchical"]
            parts.append(f"EP={ep} ({h['hosts']}): {h['net_GB'] / f['net_GB']:.2f} of flat's fixed blocks, "
                         f"{h['net_GB_real'] / f['net_GB']:.2f} in rows with data, step {h['vs_flat']:.2f}x")
    return ("Hierarchical network bytes per step, Zipf(1.2), ECHO off: " + "; ".join(parts) + ". C1 = cf·T·(1-(1-1/H)^K) "
            "reserves a row per token that needs the host under even routing; skewed routing fills some blocks "
            "more (`fill`), and the extra leg's fixed cost stays.")


def run_hosts(cal: Calibration, shape: ModelShape, a) -> tuple[str, dict]:
    """The host tables (markdown, JSON rows) from the CLI arguments."""
    args = {"gpus_per_host": a.gpus_per_host, "nvlink_gbs": a.nvlink_gbs, "network_gbs": a.network_gbs,
            "capacity_factor": a.capacity_factor, "collective_ms": a.collective_ms, "steps": a.host_steps}
    ratios = network_ratios(shape, a.capacity_factor, a.host_steps)
    measured = calibrate_hosts(read_host_rows(RESULTS), a.nvlink_gbs, cal, shape, alternatives=True)
    pred = predict_hosts(cal, shape, a.gpus_per_host, a.nvlink_gbs, a.network_gbs, a.capacity_factor, a.collective_ms,
                         a.host_steps)
    return hosts_report(cal, shape, pred, ratios, measured, args), {
        "settings": args, "network_ratios": ratios, "emulated_calibration": measured, "predictions": pred}


# ----------------------------------------------------------------------------- report

def validation_summary(val: list[dict], ratios: list[dict]) -> str:
    """One paragraph of numbers read off the validation tables."""
    steady = [r for r in val if r["steady"]]
    errs = [r["err_pct"] for r in steady]
    on = [r["measured_ms"] - r["sim_ms"] for r in steady if "ECHO on" in r["run"]]
    off = [r["measured_ms"] - r["sim_ms"] for r in steady if "ECHO off" in r["run"]]
    rat = [r["err_pct"] for r in ratios if r["steady"]]
    sign = ("overstates" if all(e > 0 for e in rat) else "understates" if all(e < 0 for e in rat)
            else "misses (both signs)")
    return (f"Steady runs: simulated tokens/s {min(errs):+.1f}% to {max(errs):+.1f}% off the measured (mean |error| "
            f"{statistics.mean(map(abs, errs)):.1f}%). Measured minus simulated step: "
            f"ECHO on {min(on):+.1f} to {max(on):+.1f} ms, "
            f"ECHO off {min(off):+.1f} to {max(off):+.1f} ms. On the steady on/off pairs the model {sign} ECHO's gain "
            f"({', '.join(f'{e:+.1f}%' for e in rat)} on the ratio).")


def report(cal: Calibration, alts: list[dict], checks: list[dict], zipf_check: list[dict], val: list[dict],
           ratios: list[dict], adjust: dict, pred: list[dict], shape: ModelShape, steps: int) -> str:
    fits = [{"backend": b, "EP": e, "t0_ms": f.intercept, "GB_per_s": 1e3 / f.slope, "rms_rel": f.rms_rel,
             "max_rel": f.max_rel, "points": len(f.points)} for (b, e), f in sorted(cal.comm.items())]
    n = cal.notes
    out = [
        f"Simulated training step (CPU model) of {shape.moe_layers} MoE layers like v2lite_1b (D={shape.dim}, "
        f"H={shape.hidden}, K={shape.top_k}, {shape.tokens_per_rank} tokens per rank), calibrated from "
        f"measurements on {cal.gpu} (`python benchmarks/step_sim.py`; model and assumptions in its docstring).",
        "",
        "## Calibration (no EP=2/EP=4 training run is used)",
        "",
        f"- Grouped SwiGLU fwd+bwd per rank (echo_sim, H={cal.gemm_hidden}, {len(cal.gemm.points)} points: straggler "
        f"before/after ECHO and mean rank, 8 configurations): ms = {cal.gemm.intercept:.3f} + "
        f"{cal.gemm.slope * 1e3:.4f}e-3 · rows · H/{cal.gemm_hidden}; "
        f"relative residual rms {100 * cal.gemm.rms_rel:.1f}%, max {100 * cal.gemm.max_rel:.1f}% "
        "(repeats of the same rows in the file differ by up to 2.5%). Other forms on the same points:",
        "",
        markdown_table(alts, ["model", "coefficients", "rms_rel", "max_rel"]),
        "",
        "- Dispatch + combine, eager (dispatch_ep2/ep4): ms = t0 + GB / GB/s; GB through the bottleneck rank, there "
        "and back.",
        "",
        markdown_table(fits, ["backend", "EP", "t0_ms", "GB_per_s", "rms_rel", "max_rel", "points"]),
        "",
        f"- Non-MoE: 1-GPU step {cal.step_1gpu_ms:.1f} ms (scaling, EP=1) minus its modelled MoE part "
        f"{n['moe_1gpu_ms']:.1f} ms "
        f"(GEMM fit + router {cal.router_ms:.3f} + local permute {cal.local_permute_ms:.2f} ms per layer, the profile's "
        f"shares ×{n['profile_to_gpu']:.3f}) = {n['nonmoe_1gpu_ms']:.1f} ms, of which "
        f"{100 * n['param_share_of_nonmoe']:.0f}% "
        f"parameter-sized ({n['param_1gpu_ms']:.1f} ms: AdamW {100 * cal.optimizer_share:.0f}% of it, weight casts and "
        f"clipping the rest) and {cal.token_ms:.1f} ms per-token.",
        "- Planner µs per layer (CUDA graph): "
        + ", ".join(f"EP={e} S={s}: {us:.0f}" for (e, s), us in sorted(cal.planner_us.items())) + ".",
        "",
        "Cross-checks against 1-GPU measurements outside the fits:",
        "",
        markdown_table(checks, ["check", "model_ms", "measured_ms", "model_over_measured"]),
        "",
        "Zipf(1.2) (benchmarks/planner.py's natural routing) against the rank imbalance logged in training with bias "
        "balancing (16 random expert placements, K=6):",
        "",
        markdown_table(zipf_check, ["EP", "E", "logged", "zipf1.2_mean", "zipf1.2_sd"]),
        "",
        "## Validation against the EP=2 / EP=4 training runs (2x / 4x H200, v2lite_1b, eager)",
        "",
        "Measured = median of the logged windows (a run's last window dropped where it was host-timed and reads high). "
        "`alt_optimizer_only`: the model with only AdamW shrinking with the shard (weight casts and clipping kept at "
        "their 1-GPU size); `alt_fsdp_hidden`: with FSDP traffic fully overlapped. Natural routing: the Zipf exponent "
        "whose draws give the run's logged max/mean rank load (`zipf`).",
        "",
        markdown_table([{**r, "zipf": "" if r["zipf_fitted"] is None else f"{r['zipf_fitted']:.2f}",
                         "steady": "yes" if r["steady"] else "no (replays)",
                         "measured_tok_s": f"{r['measured_tok_s']:,.0f}", "sim_tok_s": f"{r['sim_tok_s']:,.0f}",
                         "measured_minus_sim_ms": r["measured_ms"] - r["sim_ms"],
                         **{k: f"{r[k]:+.1f}" for k in ("err_pct", "alt_optimizer_only_err_pct",
                                                         "alt_fsdp_hidden_err_pct")}} for r in val],
                       ["run", "steady", "zipf", "load_sim", "measured_tok_s", "sim_tok_s", "err_pct", "measured_ms", "sim_ms",
                        "measured_minus_sim_ms", "alt_optimizer_only_err_pct", "alt_fsdp_hidden_err_pct"]),
        "",
        markdown_table([{**r, "steady": "yes" if r["steady"] else "no (off replays)",
                         **{k: f"{r[k]:+.1f}" for k in ("err_pct", "alt_optimizer_only_err_pct",
                                                         "alt_fsdp_hidden_err_pct")}} for r in ratios],
                       ["pair", "steady", "measured_on_over_off", "sim_on_over_off", "err_pct",
                        "alt_optimizer_only_err_pct", "alt_fsdp_hidden_err_pct"]),
        "",
        validation_summary(val, ratios),
        "",
        "Simulated terms per step (ms; MoE terms summed over the layers):",
        "",
        markdown_table([{"run": r["run"], **{k: v for k, v in r["terms_ms"].items() if k != "moe_total"}} for r in val],
                       ["run", "nonmoe_token", "nonmoe_param", "nonmoe_fsdp", "moe_router", "moe_comm", "moe_gemm",
                        "moe_gemm_mean", "moe_echo"]),
        "",
        "## Predictions, EP=8 / 16 / 64 (nvlink dispatch at the EP=4 fit's GB/s, H200 calibration)",
        "",
        f"Zipf(1.2) drifting = benchmarks/planner.py's routing (log-normal drift 0.3 per step), {steps} simulated steps: "
        f"{steps // 2} random expert placements per MoE layer, each drifting for 2 steps; "
        f"{SAMPLE_TOKENS} tokens per rank drawn and scaled to {shape.tokens_per_rank}; 8 hot experts = "
        "experts 0-7 (rank 0, or ranks 0-1 at E=256). `speedup` = ECHO-off step / this step. `8_per_host`: EP spans hosts "
        "of 8 GPUs and off-host bytes (dispatch, clones, FSDP) move at an assumed 50 GB/s per GPU (not measured). "
        "`rows_over_calibrated`: the straggler's rows (FLOP-equivalent at H=1408) over the largest rank in the GEMM fit "
        "(> 1: extrapolated). "
        f"`speedup_adj`: the same with the validation's mean residuals added as constants (ECHO on {adjust['on']:+.1f} ms, "
        f"off {adjust['off']:+.1f} ms per step; fitted to the validation runs, not part of the model).",
        "",
        markdown_table([{**r, "tok_s_per_gpu": f"{r['tok_s_per_gpu']:,.0f}",
                         "speedup": f"{r['speedup']:.2f}x", "speedup_adj": f"{r['speedup_adj']:.2f}x",
                         "speedup_8_per_host": f"{r['speedup_8_per_host']:.2f}x"} for r in pred],
                       ["EP", "E", "routing", "S", "load", "rows_over_calibrated", "gemm_ms_per_layer", "comm_ms_per_layer",
                        "echo_ms_per_layer", "nonmoe_ms", "step_ms", "tok_s_per_gpu", "speedup", "speedup_adj",
                        "step_ms_8_per_host", "speedup_8_per_host"]),
    ]
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", default="H200", help="calibration source: results files of this GPU (H200, H100)")
    ap.add_argument("--steps", type=int, default=8,
                    help="simulated steps per configuration (3 MoE layers each; an even number)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--hosts-only", action="store_true", help="only the host tables (flat vs hierarchical dispatch)")
    ap.add_argument("--gpus-per-host", type=int, default=8, help="host tables: GPUs per host (one NVLink domain)")
    ap.add_argument("--nvlink-gbs", type=float, default=400.0, help="host tables: NVLink GB/s per GPU and direction")
    ap.add_argument("--network-gbs", type=float, default=50.0, help="host tables: network GB/s per GPU and direction")
    ap.add_argument("--capacity-factor", type=float, default=1.25, help="host tables: both dispatchers' factor")
    ap.add_argument("--collective-ms", type=float, default=None,
                    help="host tables: fixed ms per collective (default: half the one-host padded fit's intercept)")
    ap.add_argument("--host-steps", type=int, default=2, help="host tables: simulated steps per configuration")
    a = ap.parse_args()
    torch.set_num_threads(1)  # small tensors: one thread is faster, more so on a busy machine
    shape = ModelShape()
    t0 = time.time()
    cal = calibrate(a.gpu, RESULTS, shape)
    if a.hosts_only:
        table, data = run_hosts(cal, shape, a)
        env = {**environment(), "gpu": "cpu", "calibration_gpu": cal.gpu}
        stem = write_results(f"step_sim_hosts_{cal.gpu}", env, [data], table, a.out)
        print(f"\n{table}\n\n({stem}.md, {time.time() - t0:.0f} s)")
        return
    alts = gemm_alternatives(echo_sim_points(os.path.join(RESULTS, result_name("echo_sim", cal.gpu))))
    print(f"calibrated in {time.time() - t0:.1f} s: GEMM {cal.gemm.intercept:.3f} + {cal.gemm.slope:.3e}·rows "
          f"(rms {cal.gemm.rms_rel:.3f}), non-MoE {cal.notes['nonmoe_1gpu_ms']:.1f} ms", flush=True)
    checks = cross_checks(cal, shape, RESULTS)
    zipf_check = []
    for run in measured_runs():
        if run.routing == "natural" and run.steady:
            m, sd = zipf_imbalance(run.cfg.ep, run.cfg.experts, 1.2, shape.top_k)
            zipf_check.append({"EP": run.cfg.ep, "E": run.cfg.experts, "logged": f"{run.imbalance} ({run.source})",
                               "zipf1.2_mean": m, "zipf1.2_sd": sd})
    val, ratios = validate(cal, shape, RESULTS, a.steps)
    adjust = residual_offsets(val)
    pred = predict(cal, shape, a.steps, adjust)
    env = {**environment(), "gpu": "cpu", "calibration_gpu": cal.gpu, "calibration": {
        "gemm": result_name("echo_sim", cal.gpu),
        "dispatch": [result_name("dispatch_ep2", cal.gpu, 2), result_name("dispatch_ep4", cal.gpu, 4)],
        "planner": result_name("planner_time", cal.gpu), "step_1gpu": f"{result_name('scaling', cal.gpu, 4, 'md')} (EP=1 row)",
        "profile": "step_breakdown_v2lite_1b_gpu_{autocast,master_weights}_1xH100.json"}}
    cal_json = {**asdict(cal), "comm": {f"{b}_ep{e}": asdict(f) for (b, e), f in cal.comm.items()},
                "planner_us": {f"ep{e}_s{s}": us for (e, s), us in cal.planner_us.items()}}
    table = report(cal, alts, checks, zipf_check, val, ratios, adjust, pred, shape, a.steps)
    host_table, host_data = run_hosts(cal, shape, a)
    table += "\n\n" + host_table
    stem = write_results(f"step_sim_{cal.gpu}", env, [{"calibration": cal_json, "gemm_alternatives": alts, "cross_checks": checks,
                                             "zipf_check": zipf_check, "validation": val, "ratios": ratios,
                                             "predictions": pred, "hosts": host_data}], table, a.out)
    print(f"\n{table}\n\n({stem}.md, {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
