"""ECHO planner quality (CPU) and speed (GPU, replayed in a CUDA graph), in one run.

Quality, on drifting multi-step routing: expert popularity starts as Zipf(1.2) over the E experts
(hot experts on random ranks) and drifts log-normally from step to step (log p ← log p + 0.3·N(0, 1),
renormalised); each of T = 4096 tokens per rank picks K = 8 distinct experts by popularity (Gumbel
top-K). For EP ∈ {8, 16, 64}, E ∈ {64, 256}, S ∈ {1, 2} slots per rank and every step: rank load
max/mean before and after planning, for ECHO's rules (fill, the default; greedy; bestfit), for
  (a) EPLB: DeepSeek's published replication + balanced packing (our implementation), given the
      same R·S extra replicas, re-placing every expert (a freer layout than ECHO's fixed homes);
  (b) the optimum of ECHO's own problem (fixed homes, ≤ S clones per rank, splittable loads) as a
      mixed-integer program (scipy.optimize.milp) where it solves within the time limit, else the
      bound of its LP relaxation (a lower bound on the optimum; EP=64, E=256 is too large).
Reported per configuration: the mean over steps and the worst step.
Speed: planner time per layer on the GPU, captured once and replayed in a CUDA graph.

    python benchmarks/planner.py [--skip-quality] [--time] [--out DIR] [--steps N] [--ilp-time-limit S]
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch

from benchmarks.common import environment, markdown_table, write_results
from components.moe_echo.planner import plan_echo

K, TOKENS_PER_RANK = 8, 4096
ZIPF, DRIFT = 1.2, 0.3
CONFIGS = [(8, 64), (16, 64), (64, 256)]  # (EP, E), each with S = 1, 2
RULES = ("fill", "greedy", "bestfit")


def drifting_counts(R: int, E: int, steps: int, seed: int, tokens: int = TOKENS_PER_RANK, k: int = K,
                    zipf: float = ZIPF, drift: float = DRIFT) -> list[torch.Tensor]:
    """counts_RE per step: popularity p starts Zipf(zipf) on a random permutation of the experts,
    log p drifts by drift·N(0, 1) per step (renormalised); every rank's tokens pick k distinct
    experts by p (Gumbel top-k: sampling without replacement)."""
    g = torch.Generator().manual_seed(seed)
    logp = -zipf * torch.log(torch.arange(1, E + 1, dtype=torch.float64))
    logp = logp[torch.randperm(E, generator=g)]
    out = []
    for t in range(steps):
        if t:
            logp = logp + drift * torch.randn(E, generator=g, dtype=torch.float64)
        logp = logp - torch.logsumexp(logp, 0)
        counts = torch.zeros(R, E, dtype=torch.int64)
        for r in range(R):
            gumbel = -torch.log(-torch.log(torch.rand(tokens, E, generator=g).clamp(1e-9, 1 - 1e-9)))
            ids = (logp.float() + gumbel).topk(k, dim=-1).indices
            counts[r] = torch.bincount(ids.flatten(), minlength=E)
        out.append(counts)
    return out


def routing_counts(R: int, E: int, dist: str, seed: int) -> torch.Tensor:
    """Static counts_RE (benchmarks/echo_sim.py): T tokens per rank choosing K distinct experts by popularity (+ Gumbel noise)."""
    g = torch.Generator().manual_seed(seed)
    if dist == "uniform":
        logp = torch.zeros(E)
    elif dist.startswith("zipf"):
        s = float(dist[4:])
        logp = -s * torch.log(torch.arange(1, E + 1).float())
    else:  # one dominant expert: chosen by every token, the rest uniform
        logp = torch.zeros(E)
        logp[0] = 50.0
    logp = logp[torch.randperm(E, generator=g)]  # hot experts land on random ranks
    counts = torch.zeros(R, E, dtype=torch.int64)
    for r in range(R):
        gumbel = -torch.log(-torch.log(torch.rand(TOKENS_PER_RANK, E, generator=g).clamp(1e-9, 1 - 1e-9)))
        ids = (logp + gumbel).topk(K, dim=-1).indices
        counts[r] = torch.bincount(ids.flatten(), minlength=E)
    return counts


def imbalance(load_R) -> float:
    load_R = np.asarray(load_R, dtype=np.float64)
    return float(load_R.max() / load_R.mean())


def eplb(load_E: np.ndarray, R: int, S: int) -> float:
    """DeepSeek EPLB (global policy): give R·S extra replicas one by one to the expert with the
    largest load per replica, then pack the replicas (load split evenly among an expert's replicas)
    heaviest first onto the least-loaded rank that still has a free place (E/R + S places each)."""
    E = len(load_E)
    reps = np.ones(E, dtype=np.int64)
    for _ in range(R * S):
        reps[np.argmax(load_E / reps)] += 1
    items = np.repeat(load_E / reps, reps)
    order = np.argsort(-items, kind="stable")
    cap = E // R + S
    loads, used = np.zeros(R), np.zeros(R, dtype=np.int64)
    for i in order:
        open_ = np.where(used < cap)[0]
        d = open_[np.argmin(loads[open_])]
        loads[d] += items[i]
        used[d] += 1
    return imbalance(loads)


def milp_optimum(load_E: np.ndarray, R: int, S: int, upper: float | None = None, time_limit: float = 20.0,
                 relax: bool = False) -> float | None:
    """min makespan z with fixed homes, ≤ S clones per rank, loads splittable, over max/mean:
        Σ_d a[x, d] = L_x;  a[x, d] ≤ M_x·y[x, d] for d ≠ home(x), y binary;  Σ_x a[x, d] ≤ z;  Σ_x y[x, d] ≤ S.
    ``upper``: a known feasible makespan (tightens M_x = min(L_x, upper) and bounds z; the optimum
    stays inside). ``relax``: y continuous in [0, 1], a lower bound on the optimum. None when the
    solver stops without proving optimality (time limit)."""
    import scipy.sparse as sp
    from scipy.optimize import Bounds, LinearConstraint, milp

    load_E = np.asarray(load_E, dtype=np.float64)
    E = len(load_E)
    home = np.arange(E) // (E // R)
    ub = np.inf if upper is None else float(upper)
    M = np.minimum(load_E, ub)
    na = E * R  # a[x, d] at x·R + d; y[x, d] at na + x·R + d; z last
    nv = 2 * na + 1
    rows, cols, vals, lo, hi = [], [], [], [], []

    def add(cs, vs, lower, upper_):
        k = len(lo)
        rows.extend([k] * len(cs)), cols.extend(cs), vals.extend(vs), lo.append(lower), hi.append(upper_)

    for x in range(E):
        add([x * R + d for d in range(R)], [1.0] * R, load_E[x], load_E[x])
        for d in range(R):
            if d != home[x]:
                add([x * R + d, na + x * R + d], [1.0, -M[x]], -np.inf, 0.0)
    for d in range(R):
        add([x * R + d for x in range(E)] + [nv - 1], [1.0] * E + [-1.0], -np.inf, 0.0)
        ys = [na + x * R + d for x in range(E) if home[x] != d]
        add(ys, [1.0] * len(ys), -np.inf, float(S))
    A = sp.csr_matrix((vals, (rows, cols)), shape=(len(lo), nv))
    c = np.zeros(nv)
    c[-1] = 1.0
    integrality = np.zeros(nv)
    if not relax:
        integrality[na:2 * na] = 1
    upper_b = np.full(nv, np.inf)
    upper_b[na:2 * na] = 1
    upper_b[na + np.arange(E) * R + home] = 0
    upper_b[-1] = ub
    res = milp(c, constraints=LinearConstraint(A, lo, hi), integrality=integrality,
               bounds=Bounds(np.zeros(nv), upper_b), options={"time_limit": time_limit})
    if res.status != 0 or res.x is None:
        return None
    return float(res.x[-1] / (load_E.sum() / R))


def _summary(values: list[float]) -> tuple[float, float]:
    return float(np.mean(values)), float(np.max(values))


def quality(steps: int, ilp_limit: float, seed: int = 0) -> list[dict]:
    rows = []
    for R, E in CONFIGS:
        trace = drifting_counts(R, E, steps, seed=seed + R * 1000 + E)
        for S in (1, 2):
            per = {k: [] for k in ("before", *RULES, "eplb", "opt", "fill_over_opt")}
            kinds = set()
            for counts in trace:
                load_E = counts.sum(0).numpy().astype(np.float64)
                plans = {rule: plan_echo(counts, S, rule) for rule in RULES}
                per["before"].append(imbalance(plans["fill"].load_before_R.numpy()))
                for rule in RULES:
                    per[rule].append(imbalance(plans[rule].load_after_R.numpy()))
                per["eplb"].append(eplb(load_E, R, S))
                upper = float(min(p.load_after_R.max() for p in plans.values()))
                opt = milp_optimum(load_E, R, S, upper, ilp_limit) if R * E <= 1024 else None
                if opt is None:
                    opt = milp_optimum(load_E, R, S, upper, ilp_limit, relax=True)
                    kinds.add("LP bound")
                else:
                    kinds.add("MILP")
                per["opt"].append(opt)
                per["fill_over_opt"].append(per["fill"][-1] / opt)
            row = {"EP": R, "E": E, "S": S, "steps": steps, "optimum": " / ".join(sorted(kinds))}
            for k, v in per.items():
                row[f"{k}_mean"], row[f"{k}_worst"] = _summary(v)
            row["per_step"] = {k: v for k, v in per.items()}
            rows.append(row)
            print({k: v for k, v in row.items() if k != "per_step"}, flush=True)
    return rows


def speed(R: int, E: int, S: int, rule: str, iters: int = 200) -> dict:
    counts = drifting_counts(R, E, 1, seed=7)[0].cuda()  # step 0: Zipf(1.2)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            plan_echo(counts, S, rule)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan_echo(counts, S, rule)
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        graph.replay()
    torch.cuda.synchronize()
    graph_us = (time.perf_counter() - t0) / iters * 1e6
    t0 = time.perf_counter()
    for _ in range(20):
        plan_echo(counts, S, rule)
    torch.cuda.synchronize()
    eager_us = (time.perf_counter() - t0) / 20 * 1e6
    return {"EP": R, "E": E, "S": S, "rule": rule, "graph_us": graph_us, "eager_us": eager_us}


def _cell(row: dict, key: str) -> str:
    return f"{row[key + '_mean']:.4f} [{row[key + '_worst']:.4f}]"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--time", action="store_true", help="also time the planner on the GPU (CUDA graph)")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--steps", type=int, default=20, help="steps of drifting routing per configuration")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ilp-time-limit", type=float, default=20.0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    env = environment()
    if not a.skip_quality:
        rows = quality(a.steps, a.ilp_time_limit, a.seed)
        keys = ["before", "fill", "greedy", "bestfit", "eplb", "opt", "fill_over_opt"]
        cells = [{"EP": r["EP"], "E": r["E"], "S": r["S"], **{k: _cell(r, k) for k in keys}, "optimum": r["optimum"]}
                 for r in rows]
        table = markdown_table(cells, ["EP", "E", "S", *keys, "optimum"])
        env_q = {**env, "gpu": "cpu", "routing": f"drifting Zipf({ZIPF}), log-normal drift {DRIFT}/step, "
                 f"T={TOKENS_PER_RANK}/rank, K={K}, {a.steps} steps, seed {a.seed}"}
        stem = write_results("planner_quality", env_q, rows, table, a.out)
        print(f"\nECHO planner balance, max/mean rank load, mean over {a.steps} drifting steps [worst step] "
              f"(T={TOKENS_PER_RANK}/rank, K={K}) ({stem}.json)\n{table}")
    if a.time:
        shapes = [(2, 64, 2), (8, 256, 2), (16, 256, 2), (64, 256, 1), (64, 256, 2)]
        rows = [speed(R, E, S, rule) for R, E, S in shapes for rule in ("fill", "greedy")]
        table = markdown_table(rows, ["EP", "E", "S", "rule", "graph_us", "eager_us"])
        stem = write_results("planner_time", env, rows, table, a.out)
        print(f"\nECHO planner time per layer on {env['gpu']} ({stem}.json)\n{table}")


if __name__ == "__main__":
    main()
