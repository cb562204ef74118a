"""How closely one run's loss curve tracks another's: the logged steps both runs share, the largest
per-step relative difference, the mean per-step relative difference over the last third of the run
(the two gated), and the signed relative difference of the two runs' mean losses over that third
(``tail_loss_rel``: the other run's tail mean over the reference's, minus 1; reported, not gated).

    python benchmarks/loss_match.py REFERENCE/metrics.jsonl OTHER/metrics.jsonl [--max-rel 0.025 --tail-rel 0.01]

Exit code 1 when a bound is exceeded (so a suite can gate on it).
"""

import argparse
import json
import sys


def losses(path: str) -> dict[int, float]:
    with open(path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def compare(ref: dict[int, float], other: dict[int, float]) -> dict:
    steps = sorted(set(ref) & set(other))
    if not steps:
        raise SystemExit("loss_match: the two runs share no logged step; log both with the same metrics.log_freq")
    rel = [abs(other[s] - ref[s]) / abs(ref[s]) for s in steps]
    tail = [r for s, r in zip(steps, rel) if s > steps[-1] * 2 // 3]
    worst = max(range(len(steps)), key=rel.__getitem__)
    tail_steps = [s for s in steps if s > steps[-1] * 2 // 3]
    ref_tail, other_tail = (sum(d[s] for s in tail_steps) / len(tail_steps) for d in (ref, other))
    return {"steps": len(steps), "last_step": steps[-1], "max_rel": rel[worst], "max_rel_step": steps[worst],
            "tail_mean_rel": sum(tail) / len(tail), "tail_loss_rel": other_tail / ref_tail - 1,
            "ref_tail_loss": ref_tail, "other_tail_loss": other_tail,
            "ref_last": ref[steps[-1]], "other_last": other[steps[-1]]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("reference")
    ap.add_argument("other")
    ap.add_argument("--max-rel", type=float, default=0.025)
    ap.add_argument("--tail-rel", type=float, default=0.01)
    a = ap.parse_args()
    r = compare(losses(a.reference), losses(a.other))
    print(json.dumps(r))
    ok = r["max_rel"] <= a.max_rel and r["tail_mean_rel"] <= a.tail_rel
    print(f"loss curves {'match' if ok else 'DIFFER'}: largest step difference {100 * r['max_rel']:.2f}% "
          f"(bound {100 * a.max_rel:.1f}%), mean over the last third {100 * r['tail_mean_rel']:.2f}% "
          f"(bound {100 * a.tail_rel:.1f}%) over {r['steps']} logged steps; mean loss over the last third "
          f"{r['other_tail_loss']:.4f} vs {r['ref_tail_loss']:.4f} ({100 * r['tail_loss_rel']:+.2f}%)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
