"""benchmarks/loss_seeds.py: the per-seed offsets it reads, its summaries against hand computation, and the
verdict on a run with and without an offset beyond the control's noise."""

import json
import math
import statistics

import pytest

from benchmarks.loss_seeds import analyse, report


def _write(path, scale, steps=30, base=3.0):
    with open(path, "w") as f:
        for s in range(1, steps + 1):
            f.write(json.dumps({"step": s, "loss": base / math.sqrt(s) * scale}) + "\n")


def _runs(tmp_path, control, other, seed0_plain=True):
    """Runs whose losses are the reference's times (1 + offset) at every step: tail offsets exactly those."""
    for s, (c, o) in enumerate(zip(control, other)):
        suffix = "" if s == 0 and seed0_plain else f"_s{s}"
        _write(tmp_path / f"ref{suffix}.jsonl", 1.0)
        _write(tmp_path / f"ctl{suffix}.jsonl", 1 + c)
        _write(tmp_path / f"oth{suffix}.jsonl", 1 + o)


def test_offsets_and_summaries_by_hand(tmp_path):
    control, other = [0.004, -0.006, 0.002, -0.001], [0.010, 0.002, 0.006, 0.003]
    _runs(tmp_path, control, other)
    r = analyse(str(tmp_path), "ref", "ctl", "oth")
    assert [s["seed"] for s in r["seeds"]] == [0, 1, 2, 3]  # seed 0 read from the unsuffixed files
    for s, c, o in zip(r["seeds"], control, other):
        assert s["control"] == pytest.approx(c, abs=1e-12) and s["other"] == pytest.approx(o, abs=1e-12)
    d = [o - c for c, o in zip(control, other)]
    half = 3.18 * statistics.stdev(d) / 2  # t(3) · s / √4
    assert r["paired"]["mean"] == pytest.approx(sum(d) / 4)
    assert r["paired"]["ci95"][0] == pytest.approx(sum(d) / 4 - half)
    assert r["control"]["rms"] == pytest.approx(math.sqrt(sum(c * c for c in control) / 4))
    # the paired interval [+0.25%, +0.85%] excludes 0 and |mean| 0.525% > the control's rms 0.377%: outside
    assert not r["within"] and "oth: OUTSIDE the noise of ctl vs ref" in report(r, ("ref", "ctl", "oth"))


def test_an_offset_beyond_the_noise_is_outside_and_noise_alone_within(tmp_path):
    noise = [0.004, -0.005, 0.003, -0.002, 0.001]
    _runs(tmp_path, noise, [0.03 + n / 2 for n in noise])  # a 3% offset: far past the control's ±0.5%
    r = analyse(str(tmp_path), "ref", "ctl", "oth")
    assert not r["within"] and "OUTSIDE" in report(r, ("ref", "ctl", "oth"))
    _runs(tmp_path, noise, [-n for n in noise])  # the same size of drift, no offset
    assert analyse(str(tmp_path), "ref", "ctl", "oth")["within"]


def test_seeds_missing_a_run_are_skipped_and_none_is_an_error(tmp_path):
    _runs(tmp_path, [0.001, 0.002], [0.0, 0.001], seed0_plain=False)
    (tmp_path / "oth_s1.jsonl").unlink()
    assert [s["seed"] for s in analyse(str(tmp_path), "ref", "ctl", "oth")["seeds"]] == [0]
    with pytest.raises(SystemExit, match="no seed in .* has all of ref, ctl and missing"):
        analyse(str(tmp_path), "ref", "ctl", "missing")
