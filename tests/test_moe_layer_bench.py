"""benchmarks/moe_layer.py's derived columns (the published fractions and speedups) from its measured times."""

import pytest

from benchmarks.moe_layer import fp8_row, quack_row

T, D, H, E, K = 16384, 2048, 1408, 64, 6
FLOPS = 18 * T * K * D * H


def _bf16_row(ms=10.0, graph_ms=8.0, gemm=800.0):
    """The bf16 torch row as run_case + main build it (times in ms, rates in TFLOP/s)."""
    tf = FLOPS / (ms * 1e-3) / 1e12
    row = {"T": T, "ours_ms": ms, "ours_tflops": tf, "ours_graph_ms": graph_ms, "torchtitan_ms": 20.0,
           "dense_ms": 9.0, "megatron_ms": 15.0, "fp8_ms": 8.0, "fp8_graph_ms": 6.4, "quack_ms": 9.0,
           "fp8_copies_ms": 7.0, "fp8_copies_graph_ms": 5.6, "fp8_copy_write_ms": 0.4,
           "quack_graph_ms": 7.2, "quack_out_rel_diff": 0.004, "quack_gathered_ms": 9.5,
           "quack_gathered_graph_ms": None, "quack_gathered_out_rel_diff": 0.004}
    return row, gemm


def test_fp8_row_divides_by_the_fp8_gemm_and_the_bf16_times():
    row, gemm = _bf16_row()
    r = fp8_row(row, 1600.0)
    assert r["precision"] == "fp8" and r["ours_ms"] == 8.0
    assert r["fp8_speedup_vs_bf16"] == pytest.approx(10.0 / 8.0)
    assert r["fp8_speedup_vs_bf16_graph"] == pytest.approx(8.0 / 6.4)
    assert r["frac_of_peak_gemm"] == pytest.approx(FLOPS / 8e-3 / 1e12 / 1600.0)
    assert r["frac_of_peak_gemm_graph"] == pytest.approx(FLOPS / 6.4e-3 / 1e12 / 1600.0)
    assert r["speedup_vs_torchtitan"] == pytest.approx(20.0 / 8.0)
    assert r["speedup_vs_megatron"] == pytest.approx(15.0 / 8.0)


def test_fp8_copies_row_charges_the_optimizers_copy_write_to_the_layer():
    row, gemm = _bf16_row()
    r = fp8_row(row, 1600.0, "copies")
    assert r["fp8_weights"] == "copies" and r["ours_ms"] == pytest.approx(7.4) and r["fp8_copy_write_ms"] == 0.4
    assert r["fp8_speedup_vs_bf16"] == pytest.approx(10.0 / 7.4)
    assert r["fp8_speedup_vs_bf16_graph"] == pytest.approx(8.0 / 6.0)
    assert fp8_row(row, 1600.0)["fp8_copy_write_ms"] is None  # the per-call cast row pays nothing there
    row["fp8_copies_graph_ms"] = None  # a failed capture stays empty
    assert fp8_row(row, 1600.0, "copies")["ours_graph_ms"] is None


def test_quack_rows_take_their_own_times_and_a_failed_capture_stays_empty():
    row, gemm = _bf16_row()
    q = quack_row(row, gemm)
    assert q["experts_gemm"] == "quack" and q["ours_ms"] == 9.0 and q["ours_graph_ms"] == 7.2
    assert q["frac_of_peak_gemm_graph"] == pytest.approx(FLOPS / 7.2e-3 / 1e12 / gemm)
    assert q["quack_speedup_vs_torch"] == pytest.approx(10.0 / 9.0)
    assert q["fp8_speedup_vs_bf16_graph"] is None  # not an FP8 row
    g = quack_row(row, gemm, "quack_gathered")
    assert g["ours_ms"] == 9.5 and g["ours_graph_ms"] is None and g["frac_of_peak_gemm_graph"] is None
