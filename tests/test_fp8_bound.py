"""benchmarks/fp8_bound.py: the linear FLOPs it splits (against the model's shapes by hand) and Amdahl's bound."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.fp8_bound import bound, linear_flops  # noqa: E402
from components.moe_echo.models import model_args_for  # noqa: E402


def test_kept_flops_are_the_output_head_and_the_router_gates():
    a = model_args_for("deepseek_v3", "tiny", None)
    converted, kept = linear_flops("deepseek_v3", "tiny")
    moe_layers = a.n_layers - a.n_dense_layers
    assert kept == 2 * a.dim * a.vocab_size + moe_layers * 2 * a.dim * a.moe_args.num_experts
    everything, gates_only = linear_flops("deepseek_v3", "tiny", kept=())
    assert everything + gates_only == converted + kept and gates_only == kept - 2 * a.dim * a.vocab_size


def test_bound_is_amdahl():
    assert bound(0.0, 2.0) == 1.0 and bound(1.0, 2.0) == pytest.approx(2.0)
    assert bound(0.5, 2.0) == pytest.approx(1 / 0.75) and bound(0.5, 1.5) < bound(0.5, 2.0)


def test_the_script_writes_its_table(tmp_path):
    profile = os.path.join(ROOT, "benchmarks/results/step_breakdown_v2lite_1b_gpu_graph_compile_ep1_vs_ep2_2xH200.json")
    p = subprocess.run([sys.executable, "benchmarks/fp8_bound.py", profile, "--config", "v2lite_1b_gpu",
                        "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = json.load(open(tmp_path / "fp8_bound_v2lite_1b_gpu_H200_cpu.json"))["rows"]
    both = next(r for r in rows if r["fp8_on"] == "both")
    parts = [r["share_of_step_pct"] for r in rows[:2]]
    assert both["share_of_step_pct"] == pytest.approx(sum(parts), abs=0.11)
    assert 1.0 < both["bound_1.5x_gemms"] < both["bound_2.0x_gemms"] < 2.0
    # the converted head adds 2/3 of its share: v2lite_1b's head (2048 x 32768) is ~31% of the dense GEMM FLOPs
    # (1 - 69%), so its two FP8 GEMMs add 2/3 x 31/69 of the converted dense layers' share
    head = rows[3]
    assert head["fp8_on"].startswith("both, the output head converted (output, grad_weight)")
    added = head["share_of_step_pct"] - both["share_of_step_pct"]
    assert added == pytest.approx(rows[0]["share_of_step_pct"] * 2 / 3 * 31 / 69, rel=0.05)
    assert head["bound_1.5x_gemms"] > both["bound_1.5x_gemms"]
