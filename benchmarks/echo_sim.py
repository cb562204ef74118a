"""Simulated EP=8 / EP=16 on one GPU: time every rank's expert GEMMs (grouped SwiGLU fwd+bwd, bf16)
under its load before and after ECHO, and report the straggler (slowest rank) time saved.

Loads come from the planner benchmark's routing model (T tokens per rank, K choices, Zipf or one
dominant expert, hot experts on random ranks). Each rank's rows per local expert (home experts,
then its echo slots) are timed with the same grouped-GEMM path the layer uses.

    python benchmarks/echo_sim.py [--out DIR]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks.common import environment, markdown_table, time_ms, write_results
from benchmarks.planner import routing_counts
from components.moe_echo.experts import grouped_swiglu
from components.moe_echo.planner import plan_echo

D, H, E = 2048, 1408, 64


def rank_rows(counts_RE, plan, R, S):
    """Rows per local expert on each rank: before = home experts; after = home minus moved, + slots."""
    e = E // R
    L = counts_RE.sum(0)
    slot_load = plan.quota_RG.sum(0)
    moved = torch.zeros(E, dtype=torch.int64).scatter_add_(0, plan.slot_expert_G.clamp(min=0), slot_load)
    before = [L[d * e:(d + 1) * e] for d in range(R)]
    after = [torch.cat([(L - moved)[d * e:(d + 1) * e], slot_load[d * S:(d + 1) * S]]) for d in range(R)]
    return before, after


def gemm_ms(rows_e: torch.Tensor, w, cache) -> float:
    key = tuple(rows_e.tolist())
    if key not in cache:
        n = int(rows_e.sum())
        x = torch.randn(max(n, 1), D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        counts = rows_e.cuda()
        ne = len(rows_e)
        w1, w2, w3 = (t[:ne].detach().requires_grad_() for t in w)

        def fn():
            y = grouped_swiglu(x[:n] if n else x[:0], w1, w2, w3, counts)
            y.float().sum().backward()

        cache[key] = time_ms(fn, warmup=3, iters=10)
    return cache[key]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    w = tuple(torch.randn(E, *s, device="cuda", dtype=torch.bfloat16) * 0.02 for s in ((H, D), (D, H), (H, D)))
    rows = []
    for R in (8, 16):
        for dist in ("zipf1.2", "dominant"):
            for S in (1, 2):
                counts = routing_counts(R, E, dist, seed=R)
                counts = counts * 6 // 8  # K = 6
                plan = plan_echo(counts, S)
                before, after = rank_rows(counts, plan, R, S)
                cache = {}
                t_before = [gemm_ms(r, w, cache) for r in before]
                t_after = [gemm_ms(r, w, cache) for r in after]
                rows.append({"EP": R, "routing": dist, "S": S,
                             "load_before": float(plan.load_before_R.max() / plan.load_before_R.float().mean()),
                             "load_after": float(plan.load_after_R.max() / plan.load_after_R.float().mean()),
                             "straggler_ms_before": max(t_before), "straggler_ms_after": max(t_after),
                             "mean_rank_ms": sum(t_before) / R,
                             "speedup": max(t_before) / max(t_after)})
                print(rows[-1], flush=True)
    env = environment()
    table = markdown_table(rows, list(rows[0]))
    stem = write_results("echo_sim", env, rows, table, a.out)
    print(f"\nSimulated EP ranks' expert GEMM time (fwd+bwd, D={D}, H={H}, E={E}, K=6, 4096 tokens/rank) on "
          f"{env['gpu']} ({stem}.json)\n{table}")


if __name__ == "__main__":
    main()
