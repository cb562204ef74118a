"""ECHO planner quality (CPU) and speed (GPU, replayed in a CUDA graph), in one run.

Quality: max/mean per-rank load before and after, for EP ∈ {2, 8, 16, 64}, E ∈ {64, 256}, K=8,
slots per rank S ∈ {1, 2, 4}, routing uniform / Zipf(0.8) / Zipf(1.2) / one dominant expert,
compared on the same loads with
  (a) EPLB: DeepSeek's published replication + balanced packing (our implementation), given the
      same R·S extra replicas, re-placing every expert (a freer layout than ECHO's fixed homes);
  (b) the optimum of ECHO's own problem (fixed homes, ≤ S clones per rank, splittable loads) as a
      mixed-integer program (scipy.optimize.milp), where it solves within the time limit.
Speed: planner time per layer on the GPU, captured once and replayed in a CUDA graph.

    python benchmarks/planner.py [--time] [--out DIR]
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


def routing_counts(R: int, E: int, dist: str, seed: int) -> torch.Tensor:
    """counts_RE for T tokens per rank choosing K distinct experts by popularity (+ Gumbel noise)."""
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


def ilp_optimum(load_E: np.ndarray, R: int, S: int, time_limit: float) -> float | None:
    """min max-rank-load with fixed homes and ≤ S clones per rank (loads splittable)."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    E = len(load_E)
    e = E // R
    home = np.arange(E) // e
    na = E * R  # a[x, d] tokens of x on d ; y[x, d] copy of x on d (non-home) ; z
    nv = 2 * na + 1
    c = np.zeros(nv)
    c[-1] = 1.0
    A, lo, hi = [], [], []

    def row():
        return np.zeros(nv)

    for x in range(E):  # Σ_d a = L_x
        r = row()
        r[x * R:(x + 1) * R] = 1
        A.append(r), lo.append(load_E[x]), hi.append(load_E[x])
    for x in range(E):  # a ≤ L_x · y for non-home d
        for d in range(R):
            if d == home[x]:
                continue
            r = row()
            r[x * R + d] = 1
            r[na + x * R + d] = -load_E[x]
            A.append(r), lo.append(-np.inf), hi.append(0.0)
    for d in range(R):  # rank load ≤ z ; clones ≤ S
        r = row()
        r[[x * R + d for x in range(E)]] = 1
        r[-1] = -1
        A.append(r), lo.append(-np.inf), hi.append(0.0)
        r = row()
        r[[na + x * R + d for x in range(E) if home[x] != d]] = 1
        A.append(r), lo.append(-np.inf), hi.append(S)
    integrality = np.zeros(nv)
    integrality[na:2 * na] = 1
    ub = np.full(nv, np.inf)
    ub[na:2 * na] = 1
    for x in range(E):
        ub[na + x * R + home[x]] = 0
    res = milp(c, constraints=LinearConstraint(np.array(A), lo, hi), integrality=integrality,
               bounds=Bounds(np.zeros(nv), ub), options={"time_limit": time_limit})
    if res.status != 0 or res.x is None:
        return None
    return float(res.x[-1] / (load_E.sum() / R))


def quality(ilp_limit: float) -> list[dict]:
    rows = []
    for R in (2, 8, 16, 64):
        for E in (64, 256):
            for dist in ("uniform", "zipf0.8", "zipf1.2", "dominant"):
                counts = routing_counts(R, E, dist, seed=R * 1000 + E)
                load_E = counts.sum(0).numpy().astype(np.float64)
                for S in (1, 2, 4):
                    plan = plan_echo(counts, S, "greedy")
                    best = plan_echo(counts, S, "bestfit")
                    before = imbalance(plan.load_before_R.numpy())
                    opt = ilp_optimum(load_E, R, S, ilp_limit) if R * E <= 512 else None
                    after = imbalance(plan.load_after_R.numpy())
                    rows.append({
                        "EP": R, "E": E, "routing": dist, "S": S, "before": before, "echo_greedy": after,
                        "echo_bestfit": imbalance(best.load_after_R.numpy()), "eplb": eplb(load_E, R, S),
                        "ilp_opt": opt if opt is not None else float("nan"),
                        "greedy_over_opt": after / opt if opt else float("nan"),
                        "clones": int((plan.slot_expert_G >= 0).sum()),
                    })
                    print(rows[-1], flush=True)
    return rows


def speed(R: int, E: int, S: int, iters: int = 200) -> dict:
    counts = routing_counts(R, E, "zipf1.2", seed=7).cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            plan_echo(counts, S)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan_echo(counts, S)
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        graph.replay()
    torch.cuda.synchronize()
    graph_us = (time.perf_counter() - t0) / iters * 1e6
    t0 = time.perf_counter()
    for _ in range(20):
        plan_echo(counts, S)
    torch.cuda.synchronize()
    eager_us = (time.perf_counter() - t0) / 20 * 1e6
    return {"EP": R, "E": E, "S": S, "graph_us": graph_us, "eager_us": eager_us}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--time", action="store_true", help="also time the planner on the GPU (CUDA graph)")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--ilp-time-limit", type=float, default=20.0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    env = environment()
    if not a.skip_quality:
        rows = quality(a.ilp_time_limit)
        cols = ["EP", "E", "routing", "S", "before", "echo_greedy", "echo_bestfit", "eplb", "ilp_opt",
                "greedy_over_opt", "clones"]
        table = markdown_table(rows, cols)
        env_q = {**env, "gpu": "cpu"}
        stem = write_results("planner_quality", env_q, rows, table, a.out)
        print(f"\nECHO planner balance, max/mean rank load (T={TOKENS_PER_RANK}/rank, K={K}) ({stem}.json)\n{table}")
    if a.time:
        rows = [speed(R, E, S) for R, E, S in [(2, 64, 2), (8, 256, 2), (16, 256, 2), (64, 256, 1), (64, 256, 2)]]
        table = markdown_table(rows, ["EP", "E", "S", "graph_us", "eager_us"])
        stem = write_results("planner_time", env, rows, table, a.out)
        print(f"\nECHO planner time per layer on {env['gpu']} ({stem}.json)\n{table}")


if __name__ == "__main__":
    main()
