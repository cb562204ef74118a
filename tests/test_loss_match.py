"""benchmarks/loss_match.py: two runs' per-step losses compared (largest and last-third differences), and the gate
on the drift of two equivalent runs (the noise floor) that FP8 and other numerics changes are judged by."""

import os
import subprocess
import sys

from benchmarks.loss_match import compare, losses
from conftest import ROOT


def test_loss_match_reports_the_largest_and_tail_differences(tmp_path):
    ref, other = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    ref.write_text("".join(f'{{"step": {s}, "loss": {10 / s}}}\n' for s in range(1, 31)) + '{"step": 31}\n')
    other.write_text("".join(f'{{"step": {s}, "loss": {10 / s * (1.05 if s == 7 else 1.002)}}}\n'
                             for s in range(1, 31, 2)))
    r = compare(losses(str(ref)), losses(str(other)))
    assert r["steps"] == 15 and r["max_rel_step"] == 7 and abs(r["max_rel"] - 0.05) < 1e-9
    assert abs(r["tail_mean_rel"] - 0.002) < 1e-9
    assert abs(r["tail_loss_rel"] - 0.002) < 1e-9  # every shared tail step 0.2% higher: the tail means too
    assert r["other_tail_loss"] > r["ref_tail_loss"]


def test_loss_match_gates_on_the_noise_floor_and_plots(tmp_path):
    """--floor: an offset within the control's per-step drift passes, one beyond it fails; --plot writes a PNG."""
    def write(name, factor):
        path = tmp_path / name
        path.write_text("".join(f'{{"step": {s}, "loss": {(10 / s + 1) * factor(s)}}}\n' for s in range(1, 301)))
        return str(path)

    ref = write("ref.jsonl", lambda s: 1.0)
    control = write("control.jsonl", lambda s: 1.01 if s % 2 else 0.99)  # 1% drift each step, no offset
    near = write("near.jsonl", lambda s: 1.005)  # 0.5% offset: inside the floor
    far = write("far.jsonl", lambda s: 1.02)  # 2%: outside
    script = os.path.join(ROOT, "benchmarks", "loss_match.py")
    for other, code in ((near, 0), (far, 1)):
        p = subprocess.run([sys.executable, script, ref, other, "--floor", control, "--plot", str(tmp_path / "c.png")],
                           capture_output=True, text=True)
        assert p.returncode == code, p.stdout + p.stderr
        assert ("within the floor" if code == 0 else "OUTSIDE the floor") in p.stdout
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
