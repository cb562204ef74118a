"""benchmarks/nvlink_bound.py: each part-sum of the round trip against the peer-copy ceiling."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.nvlink_bound import of_ceiling  # noqa: E402


def test_parts_against_the_ceiling():
    row = {"T": 16, "D": 8, "routing": "balanced", "nvlink_sms": 64, "peer_copy_ms": 1.0, "gathered_graph_ms": 2.0,
           "owner_sum_graph_ms": 0.75, "send_kernel_graph_ms": 0.5, "barrier_graph_ms": 0.1, "pull_kernel_graph_ms": 0.4,
           "send_kernel_c24_graph_ms": 1.0, "pull_kernel_c24_graph_ms": 0.9, "send_tokens_ce_graph_ms": 0.6,
           "sum_back_ce_graph_ms": 0.65}
    got = of_ceiling(row)
    assert got["round_trip_pct"] == 50.0 and got["sums_hidden_pct"] == 80.0 and got["wire_pct"] == 100.0
    assert got["wire_24_ctas_pct"] == 50.0 and got["copy_engines_pct"] == 80.0
    older = {k: v for k, v in row.items() if "c24" not in k and "_ce_" not in k}  # results from before those parts
    assert "wire_24_ctas_pct" not in of_ceiling(older) and "copy_engines_pct" not in of_ceiling(older)


def test_the_script_reads_the_committed_parts(tmp_path):
    src = os.path.join(ROOT, "benchmarks/results/dispatch_ep2_copy_engine_2xH200.json")
    p = subprocess.run([sys.executable, "benchmarks/nvlink_bound.py", src, "--out", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = json.load(open(tmp_path / "nvlink_bound_H200_cpu.json"))["rows"]
    assert len(rows) == 8
    for r in rows:  # each part left out brings the time closer to the ceiling; fewer CTAs move less
        assert r["round_trip_pct"] < r["sums_hidden_pct"] < r["wire_pct"]
        assert r["wire_24_ctas_pct"] < r["wire_pct"]


def test_results_without_parts_are_one_line(tmp_path):
    bad = tmp_path / "plain.json"
    bad.write_text(json.dumps({"rows": [{"T": 1, "peer_copy_ms": 1.0}]}))
    p = subprocess.run([sys.executable, "benchmarks/nvlink_bound.py", str(bad), "--out", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "has no round-trip parts" in p.stderr
