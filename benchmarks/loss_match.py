"""How closely one run's loss curve tracks another's: the logged steps both runs share, the largest
per-step relative difference, the mean per-step relative difference over the last third of the run
(the two gated), and the signed relative difference of the two runs' mean losses over that third
(``tail_loss_rel``: the other run's tail mean over the reference's, minus 1; reported, not gated).

    python benchmarks/loss_match.py REFERENCE/metrics.jsonl OTHER/metrics.jsonl [--max-rel 0.025 --tail-rel 0.01]
        [--floor CONTROL/metrics.jsonl] [--plot curves.png]

``--floor``: a run equivalent to the reference (the same math, other rounding: e.g. compiled) measures the noise
floor; then the gate is that OTHER's mean loss over the last third is off the reference's by no more than the
control's mean per-step difference there (an offset within the drift of two equivalent runs). ``--plot``: the
curves (smoothed) and OTHER's and the control's per-step difference from the reference, as a PNG.

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


def within_floor(r: dict, control: dict) -> bool:
    """OTHER's tail offset (``tail_loss_rel``) within the control's per-step drift over the tail."""
    return abs(r["tail_loss_rel"]) <= control["tail_mean_rel"]


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` points."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(path: str, runs: dict[str, dict[int, float]], reference: str) -> None:
    """Loss curves (trailing mean over 1/50 of the steps) and each run's per-step relative difference from
    ``reference``, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=(2, 1))
    ref = runs[reference]
    for name, d in runs.items():
        steps = sorted(d)
        top.plot(steps, smooth([d[s] for s in steps], max(1, len(steps) // 50)), label=name, linewidth=1)
        if name != reference:
            shared = sorted(set(d) & set(ref))
            bottom.plot(shared, smooth([100 * (d[s] / ref[s] - 1) for s in shared], max(1, len(shared) // 50)),
                        label=f"{name} vs {reference}", linewidth=1)
    top.set_ylabel("loss")
    top.legend()
    bottom.axhline(0, color="gray", linewidth=0.5)
    bottom.set_ylabel("difference, %")
    bottom.set_xlabel("step")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("reference")
    ap.add_argument("other")
    ap.add_argument("--max-rel", type=float, default=0.025)
    ap.add_argument("--tail-rel", type=float, default=0.01)
    ap.add_argument("--floor", default=None, metavar="CONTROL", help="a run equivalent to the reference")
    ap.add_argument("--plot", default=None, metavar="PNG")
    ap.add_argument("--names", default="reference,other,control",
                    help="the three runs' names in the plot's legend (reference, other, control)")
    a = ap.parse_args()
    ref, other = losses(a.reference), losses(a.other)
    r = compare(ref, other)
    print(json.dumps(r))
    ok = r["max_rel"] <= a.max_rel and r["tail_mean_rel"] <= a.tail_rel
    print(f"loss curves {'match' if ok else 'DIFFER'}: largest step difference {100 * r['max_rel']:.2f}% "
          f"(bound {100 * a.max_rel:.1f}%), mean over the last third {100 * r['tail_mean_rel']:.2f}% "
          f"(bound {100 * a.tail_rel:.1f}%) over {r['steps']} logged steps; mean loss over the last third "
          f"{r['other_tail_loss']:.4f} vs {r['ref_tail_loss']:.4f} ({100 * r['tail_loss_rel']:+.2f}%)")
    if a.floor:
        control = compare(ref, losses(a.floor))
        ok = within_floor(r, control)
        print(f"noise floor: the control's mean per-step difference over the last third is "
              f"{100 * control['tail_mean_rel']:.2f}%; the other run's mean loss there is off by "
              f"{100 * r['tail_loss_rel']:+.2f}%: {'within' if ok else 'OUTSIDE'} the floor")
    if a.plot:
        n_ref, n_other, n_control = a.names.split(",")
        runs = {n_ref: ref, **({n_control: losses(a.floor)} if a.floor else {}), n_other: other}
        plot(a.plot, runs, n_ref)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
