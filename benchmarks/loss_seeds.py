"""Whether one run kind's loss departs from another's beyond the seed-to-seed noise: loss_match.py over several seeds.

One pair of runs cannot tell an offset from noise when two equivalent runs already drift apart by as much. Over
seeds s, with three runs each — the reference (e.g. bf16), a control of the same math (e.g. bf16 compiled) and
the run under test (e.g. FP8 compiled) — this takes each run's mean loss over the last third against the
reference's of its seed (``tail_loss_rel``, as loss_match.py) and reports, over the seeds:

    other    the test run's offsets: mean, standard deviation, and the mean's 95% interval (mean ± t · s / √n)
    control  the control's offsets, the same: how far two equivalent runs land apart
    paired   other − control, seed by seed (both compiled, say: what the test run adds beyond the control)

The test run is ``within`` when the paired mean's 95% interval includes 0 (no offset beyond the control's
shown), or its |mean| is within the control's own root mean square offset. Files are ``DIR/<name>_s<seed>.jsonl``
(as ``run.sh fp8_step PART=s`` writes them) or ``DIR/<name>.jsonl`` for seed 0.

    python benchmarks/loss_seeds.py DIR --reference f8_loss_bf16 --control f8_loss_bf16_compile \\
        --other f8_loss_fp8_head [--seeds 0 1 2 3]
"""

import argparse
import glob
import math
import os
import re
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.loss_match import compare, losses  # noqa: E402

T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}  # Student's t, 95%, df


def path_of(folder: str, name: str, seed: int) -> str | None:
    for p in (os.path.join(folder, f"{name}_s{seed}.jsonl"), *([os.path.join(folder, f"{name}.jsonl")] * (seed == 0))):
        if os.path.exists(p):
            return p
    return None


def seeds_in(folder: str, name: str) -> list[int]:
    found = {int(m.group(1)) for p in glob.glob(os.path.join(folder, f"{name}_s*.jsonl"))
             if (m := re.search(r"_s(\d+)\.jsonl$", p))}
    if os.path.exists(os.path.join(folder, f"{name}.jsonl")):
        found.add(0)
    return sorted(found)


def summary(values: list[float]) -> dict:
    n = len(values)
    mean = sum(values) / n
    sd = statistics.stdev(values) if n > 1 else float("nan")
    half = T95.get(n - 1, 1.96) * sd / math.sqrt(n) if n > 1 else float("nan")
    return {"n": n, "mean": mean, "sd": sd, "ci95": (mean - half, mean + half),
            "rms": math.sqrt(sum(v * v for v in values) / n)}


def analyse(folder: str, reference: str, control: str, other: str, seeds: list[int] | None = None) -> dict:
    """Per seed the control's and the test run's tail offsets from the reference; over seeds their summaries, the
    paired difference's, and the verdict (module docstring). Seeds missing any of the three runs are skipped."""
    seeds = seeds if seeds is not None else seeds_in(folder, reference)
    rows = []
    for s in seeds:
        paths = [path_of(folder, n, s) for n in (reference, control, other)]
        if None in paths:
            continue
        ref, ctl, oth = (losses(p) for p in paths)
        c, o = compare(ref, ctl), compare(ref, oth)
        rows.append({"seed": s, "control": c["tail_loss_rel"], "other": o["tail_loss_rel"],
                     "control_drift": c["tail_mean_rel"]})
    if not rows:
        raise SystemExit(f"loss_seeds: no seed in {folder} has all of {reference}, {control} and {other}")
    ctl = summary([r["control"] for r in rows])
    oth = summary([r["other"] for r in rows])
    paired = summary([r["other"] - r["control"] for r in rows])
    lo, hi = paired["ci95"]
    within = (len(rows) > 1 and lo <= 0 <= hi) or abs(oth["mean"]) <= ctl["rms"]
    return {"seeds": rows, "control": ctl, "other": oth, "paired": paired, "within": within}


def report(r: dict, names: tuple[str, str, str]) -> str:
    reference, control, other = names
    pct = lambda v: f"{100 * v:+.2f}%"
    lines = [f"| seed | {control} vs {reference} | {other} vs {reference} | {other} − {control} |", "|---|---|---|---|"]
    lines += [f"| {s['seed']} | {pct(s['control'])} | {pct(s['other'])} | {pct(s['other'] - s['control'])} |"
              for s in r["seeds"]]
    for key, label in (("control", control), ("other", other), ("paired", f"{other} − {control}")):
        m = r[key]
        ci = "" if m["n"] < 2 else f", 95% interval [{pct(m['ci95'][0])}, {pct(m['ci95'][1])}]"
        lines.append(f"\n{label}: mean {pct(m['mean'])}, sd {100 * m['sd']:.2f}%, rms {100 * m['rms']:.2f}%{ci} "
                     f"over {m['n']} seed{'s' * (m['n'] > 1)}")
    lines.append(f"\n{other}: {'within' if r['within'] else 'OUTSIDE'} the noise of {control} vs {reference}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder")
    ap.add_argument("--reference", default="f8_loss_bf16")
    ap.add_argument("--control", default="f8_loss_bf16_compile")
    ap.add_argument("--other", default="f8_loss_fp8_head")
    ap.add_argument("--seeds", type=int, nargs="*", default=None, help="default: every seed the reference has")
    a = ap.parse_args()
    r = analyse(a.folder, a.reference, a.control, a.other, a.seeds)
    print(report(r, (a.reference, a.control, a.other)))
    sys.exit(0 if r["within"] else 1)


if __name__ == "__main__":
    main()
