"""benchmarks/step_breakdown.py attributes each GPU kernel to the ops that launched it."""

import json

from benchmarks.step_breakdown import breakdown


def _trace(tmp_path, events):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


def _op(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid}


def _launch(corr, ts, tid=1):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "tid": tid,
            "args": {"correlation": corr}}


def _kernel(corr, ts, dur, name="k"):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": 7, "args": {"correlation": corr}}


def test_kernels_go_to_the_innermost_matching_op_and_steps_divide(tmp_path):
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 0, "dur": 1000, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#4", "ts": 1000, "dur": 1000, "tid": 1},
        _op("aten::linear", 10, 50), _op("aten::mm", 12, 40), _launch(1, 20), _kernel(1, 100, 400, "sm90_gemm"),
        _op("aten::_grouped_mm", 200, 30), _launch(2, 210), _kernel(2, 500, 300),
        _op("Optimizer.step#AdamW.step", 1100, 200), _op("aten::_fused_adamw_", 1110, 50), _launch(3, 1120),
        _kernel(3, 1200, 200),
        _op("aten::_to_copy", 1400, 20), _op("aten::copy_", 1405, 10), _launch(4, 1407), _kernel(4, 1500, 100),
        _launch(5, 1600), _kernel(5, 1700, 100, "elementwise_kernel"),  # launched outside any op: by name
        _op("aten::mul", 60, 5, tid=2), _launch(6, 61, tid=2), _kernel(6, 150, 300),  # a second stream, overlapped
    ]
    r = breakdown(_trace(tmp_path, events))
    assert r["steps"] == 2
    assert r["ms"]["dense GEMMs"] == 0.4 / 2
    assert r["ms"]["routed experts"] == 0.3 / 2
    assert r["ms"]["optimizer"] == 0.2 / 2
    assert r["ms"]["casts/copies"] == 0.1 / 2
    assert r["ms"]["other"] == (0.1 + 0.3) / 2
    assert abs(sum(r["pct"].values()) - 100) < 1e-9
    # kernel intervals 100-500, 500-800, 1200-1400, 1500-1600, 1700-1800 and one overlapping 150-450: 1100 us
    assert abs(r["busy_ms"] - 1.1 / 2) < 1e-12


def test_fused_cross_entropy_is_loss(tmp_path):
    """kernels/cross_entropy.py: its record_function spans, its autograd node, or the kernel names alone."""
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 1000, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": "cross_entropy_fwd", "ts": 10, "dur": 50, "tid": 1},
        _launch(1, 20), _kernel(1, 100, 100, "_cross_entropy_fwd_kernel"),
        _op("aten::sum", 30, 10), _launch(2, 35), _kernel(2, 200, 10, "reduce_kernel"),
        _op("autograd::engine::evaluate_function: _CrossEntropyBackward", 300, 50),
        _op("_CrossEntropyBackward", 305, 40), _launch(3, 310), _kernel(3, 400, 200, "_cross_entropy_bwd_kernel"),
        _launch(4, 700), _kernel(4, 800, 50, "_cross_entropy_fwd_kernel"),  # no launching op recorded
    ]
    r = breakdown(_trace(tmp_path, events))
    assert abs(r["ms"]["loss"] - 0.36) < 1e-12 and abs(r["pct"]["loss"] - 100) < 1e-9


def test_nccl_kernels_are_collectives_whatever_launched_them(tmp_path):
    """FSDP launches its all-gather under copy ops: the kernel name decides; peer-copy kernels are dispatch."""
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 1000, "tid": 1},
        _op("aten::copy_", 10, 50), _launch(1, 20), _kernel(1, 100, 300, "ncclDevKernel_AllGather_RING_LL(x)"),
        _launch(2, 70), _kernel(2, 400, 100, "_peer_scatter_kernel"),  # launched outside any op
    ]
    r = breakdown(_trace(tmp_path, events))
    assert abs(r["ms"]["collectives"] - 0.3) < 1e-12 and abs(r["ms"]["dispatch"] - 0.1) < 1e-12


def test_echo_claims_what_runs_inside_its_ops_and_its_planner_kernels(tmp_path):
    """ECHO's cost in one place: a cat inside the clone extension, its backward's index_add, the counts'
    copy inside echo_route, and the planner's kernels by name; a cat elsewhere stays casts/copies."""
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 2000, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": "echo_route", "ts": 10, "dur": 80, "tid": 1},
        _op("aten::copy_", 20, 10), _launch(1, 25), _kernel(1, 100, 10, "elementwise_kernel"),
        _launch(2, 40), _kernel(2, 120, 20, "_fill_kernel"),
        _op("_ExtendWithClones", 200, 50), _op("aten::cat", 210, 20), _launch(3, 215),
        _kernel(3, 300, 30, "CatArrayBatchedCopy"),
        _op("_ExtendWithClonesBackward", 400, 50), _op("aten::index_add_", 410, 20), _launch(4, 415),
        _kernel(4, 500, 40, "indexFuncLargeIndex"),
        _op("aten::cat", 600, 20), _launch(5, 605), _kernel(5, 700, 50, "CatArrayBatchedCopy"),
    ]
    r = breakdown(_trace(tmp_path, events))
    assert abs(r["ms"]["echo"] - 0.1) < 1e-12 and abs(r["ms"]["casts/copies"] - 0.05) < 1e-12
    # the category's own list, largest first, names the op each kernel ran in
    echo = r["by_category"]["echo"]
    assert [t["kernel"] for t in echo] == ["indexFuncLargeIndex", "CatArrayBatchedCopy", "_fill_kernel",
                                           "elementwise_kernel"]
    assert echo[0]["ops"].startswith("aten::index_add_ < _ExtendWithClonesBackward")
    assert [t["kernel"] for t in r["by_category"]["casts/copies"]] == ["CatArrayBatchedCopy"]


def test_detail_lists_a_categorys_kernels_in_the_table(tmp_path):
    import subprocess
    import sys

    events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 2000, "tid": 1},
              _op("_ExtendWithClones", 200, 50), _op("aten::cat", 210, 20), _launch(3, 215),
              _kernel(3, 300, 30, "CatArrayBatchedCopy")]
    path = _trace(tmp_path, events)
    out = subprocess.run([sys.executable, "benchmarks/step_breakdown.py", f"a={path}", "--detail", "echo"],
                         capture_output=True, text=True, check=True).stdout
    assert "Largest echo kernels of a" in out and "| 0.03 | aten::cat < _ExtendWithClones | CatArrayBatchedCopy |" in out
    bad = subprocess.run([sys.executable, "benchmarks/step_breakdown.py", path, "--detail", "nope"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_cutlass_grouped_gemm_without_an_op_is_routed_experts(tmp_path):
    name = ("_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversal"
            "INS5_15GroupProblemShapeIN4cute5tupleIJiiiEEEEENS5_10collective13CollectiveMmaINS5_"
            "41MainloopSm90ArrayTmaGmmaWarpSpecializedEEEvE")
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 1000, "tid": 1},
        _launch(1, 20), _kernel(1, 100, 300, name),
        _launch(2, 30), _kernel(2, 400, 100, "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xIdense"),
    ]
    r = breakdown(_trace(tmp_path, events))
    assert abs(r["ms"]["routed experts"] - 0.3) < 1e-12 and abs(r["ms"]["dense GEMMs"] - 0.1) < 1e-12


def test_graphed_steps_count_as_graph_launches(tmp_path):
    """A graphed window of 2 profiler steps holding 3 replays (the last launched before the window
    closed) and the kernels of one launched before it: per-step figures divide by the 3 replays and count
    only their kernels, and the replayed kernels go by name."""
    def graph_launch(corr, ts):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch_v10000", "ts": ts, "dur": 5, "tid": 1,
                "args": {"correlation": corr}}

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#11", "ts": 0, "dur": 100, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#12", "ts": 100, "dur": 100, "tid": 1},
        graph_launch(1, 10), graph_launch(2, 110), graph_launch(3, 190),
    ]
    for corr in (0, 1, 2, 3):  # 0: a replay launched before the window, running inside it: not counted
        events += [_kernel(corr, 1000 * corr, 600, "nvjet_sm90_tst_256x128"), _kernel(corr, 1000 * corr + 600, 300,
                                                                                     "_gather_sum_kernel")]
    r = breakdown(_trace(tmp_path, events))
    assert r["steps"] == 3
    assert abs(r["ms"]["dense GEMMs"] - 0.6) < 1e-12 and abs(r["ms"]["dispatch"] - 0.3) < 1e-12
    assert abs(r["kernel_ms"] - 0.9) < 1e-12


def test_barrier_waits_are_reported_inside_dispatch_and_json_keeps_full_names(tmp_path):
    from benchmarks.step_breakdown import table

    long = "c10d::symmetric_memory::barrier_kernel(unsigned int**, int, int, int, " + "x" * 80
    events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 100, "tid": 1},
              _launch(1, 10), _launch(2, 20), _kernel(1, 100, 400, long), _kernel(2, 600, 600, "_peer_scatter_kernel")]
    r = breakdown(_trace(tmp_path, events))
    assert abs(r["ms"]["dispatch"] - 1.0) < 1e-12 and abs(r["barrier_ms"] - 0.4) < 1e-12
    assert any(t["kernel"] == long for t in r["top"])  # not cut to the table's width
    r["label"] = "x"
    assert "| of which barriers (a rank waiting for its peers) | 0.40 | 40.0 |" in table([r])


def test_exposed_communication_is_what_no_other_kernel_covers(tmp_path):
    """A GEMM 100-500 on one stream; NCCL 300-700 and a peer copy 650-900 on another; a barrier 950-1000:
    communication covers 300-900 and 950-1000 (650 us), of which 500-900 and 950-1000 (450 us) run alone."""
    from benchmarks.step_breakdown import table

    events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 100, "tid": 1}]
    for corr, (ts, dur, name) in enumerate([(100, 400, "nvjet_sm90_tst_256x128"),
                                            (300, 400, "ncclDevKernel_AllGather_RING_LL"),
                                            (650, 250, "_peer_scatter_kernel"),
                                            (950, 50, "c10d::symmetric_memory::barrier_kernel")], 1):
        events += [_launch(corr, corr), _kernel(corr, ts, dur, name)]
    r = breakdown(_trace(tmp_path, events))
    assert abs(r["comm_ms"] - 0.65) < 1e-12 and abs(r["comm_exposed_ms"] - 0.45) < 1e-12
    assert abs(r["busy_ms"] - 0.85) < 1e-12
    # by kernel: NCCL 300-700 exposed 500-700; the peer copy 650-900 all of it (its overlap with NCCL counts for
    # both); the barrier all of it
    by = {t["kernel"]: (round(t["ms"], 9), round(t["exposed_ms"], 9)) for t in r["comm_by_kernel"]}
    assert by == {"ncclDevKernel_AllGather_RING_LL": (0.4, 0.2), "_peer_scatter_kernel": (0.25, 0.25),
                  "c10d::symmetric_memory::barrier_kernel": (0.05, 0.05)}
    assert r["comm_by_kernel"][0]["kernel"] == "_peer_scatter_kernel"  # most exposed first
    r["label"] = "x"
    assert "| of which exposed (no other kernel running) | 0.45 | 52.9 |" in table([r])
    # a step without communication: no rows for it
    r2 = breakdown(_trace(tmp_path, events[:3]))
    assert r2["comm_ms"] == 0 and "communication" not in table([{**r2, "label": "y"}])


def test_the_combines_peer_reads_give_an_upper_bound_of_exposed_communication(tmp_path):
    """A GEMM 100-500, a peer copy 400-600, nvlink's combine pull (_gather_sum_kernel) 600-800 beside a
    norm 700-750: exposed communication 500-600 (100 us) as a lower bound; with the pull counted 500-700 and
    750-800 (250 us). Without such a kernel the bound is the exposed time itself and the table has no row."""
    from benchmarks.step_breakdown import table

    events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 100, "tid": 1}]
    for corr, (ts, dur, name) in enumerate([(100, 400, "nvjet_sm90_tst_256x128"), (400, 200, "_peer_scatter_kernel"),
                                            (600, 200, "_gather_sum_kernel"), (700, 50, "rms_norm_kernel")], 1):
        events += [_launch(corr, corr), _kernel(corr, ts, dur, name)]
    r = breakdown(_trace(tmp_path, events))
    assert abs(r["comm_exposed_ms"] - 0.1) < 1e-12 and abs(r["comm_exposed_upper_ms"] - 0.25) < 1e-12
    r["label"] = "x"
    assert "| exposed, counting the combine's peer reads (`_gather_sum_kernel`) too | 0.25 | 35.7 |" in table([r])
    r2 = breakdown(_trace(tmp_path, events[:6]))
    assert r2["comm_exposed_upper_ms"] == r2["comm_exposed_ms"] and "peer reads" not in table([{**r2, "label": "y"}])


def test_fp8_scaling_is_its_own_category_and_fp8_gemms_stay_gemms(tmp_path):
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 1000, "tid": 1},
        _launch(1, 20), _kernel(1, 100, 100, "triton_red_fused__to_copy_abs_amax_clamp_0"),  # inductor, no op
        _launch(2, 30), _kernel(2, 200, 300, "sm90_xmma_gemm_e4m3e4m3_e4m3f32_f32_tn_n_tilesize128x128x128"),
        _launch(3, 40), _kernel(3, 500, 50, "_quant_rows_kernel"),
        _op("aten::_scaled_mm", 50, 10), _launch(4, 55), _kernel(4, 600, 200, "nvjet_sm90_qqtst_128x256"),
        _launch(5, 70), _kernel(5, 800, 40, "triton_poi_fused__to_copy_1"),  # a plain cast stays a cast
    ]
    r = breakdown(_trace(tmp_path, events))
    assert abs(r["ms"]["fp8 scaling"] - 0.15) < 1e-12
    assert abs(r["ms"]["dense GEMMs"] - 0.5) < 1e-12 and abs(r["ms"]["casts/copies"] - 0.04) < 1e-12


def _phases_trace(tmp_path):
    """One step of every phase (the two tests below describe it)."""
    events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 100, "tid": 1}]
    for corr, (ts, dur, name) in enumerate([(100, 200, "nvjet_sm90_tst_256x128"), (250, 150, "_peer_scatter_kernel"),
                                            (400, 50, "_cross_entropy_fwd_kernel"), (450, 50, "_peer_scatter_kernel"),
                                            (500, 200, "nvjet_sm90_tst_256x128"), (650, 100, "_gather_sum_kernel"),
                                            (750, 50, "_adamw_kernel"), (800, 100, "ncclDevKernel_AllGather_RING_LL"),
                                            (900, 100, "cudnn_generated_fort_native_sdpa_sm90_flash_fprop"),
                                            (1000, 20, "c10d::symmetric_memory::barrier_kernel")], 1):
        events += [_launch(corr, corr), _kernel(corr, ts, dur, name)]
    return _trace(tmp_path, events)


def test_exposed_communication_splits_by_phase_of_the_step(tmp_path):
    """Forward: a GEMM 100-300, its dispatch 250-400 (exposed 300-400); the loss 400-450; backward: a peer copy
    450-500 alone, then a GEMM 500-700 with the pull 650-750 beside it (upper bound adds 700-750); the optimizer
    750-800; the next step's all-gather 800-900 before its attention 900-1000 (optimizer phase, all exposed); then
    that forward's barrier 1000-1020 alone."""
    from benchmarks.step_breakdown import phase_of, table

    assert phase_of(["attention", "loss", "dense GEMMs", "optimizer", "collectives", "other", "norms", "loss"]) == [
        "forward", "backward", "backward", "optimizer", "optimizer", "optimizer", "forward", "backward"]
    r = breakdown(_phases_trace(tmp_path))
    got = {ph: (round(v["ms"], 9), round(v["upper_ms"], 9)) for ph, v in r["comm_exposed_by_phase"].items()}
    assert got == {"forward": (0.12, 0.12), "backward": (0.05, 0.1), "optimizer": (0.1, 0.1)}
    assert abs(sum(v["ms"] for v in r["comm_exposed_by_phase"].values()) - r["comm_exposed_ms"]) < 1e-12
    r["label"] = "x"
    assert "| exposed, backward | 0.05 |" in table([r]) and "| exposed with the peer reads, backward | 0.10 |" in table([r])


def test_kernel_time_splits_by_phase_per_category(tmp_path):
    """The trace above: forward 100-400 (a GEMM 0.2 ms, the dispatch 0.15 ms, then the next step's attention 0.1 and
    barrier 0.02), backward (the loss 0.05, a peer copy 0.05, a GEMM 0.2, the pull 0.1), optimizer (AdamW 0.05, the
    all-gather 0.1); per phase the categories sum to the phase's kernel time, and the phases to the step's."""
    from benchmarks.step_breakdown import phase_table

    r = breakdown(_phases_trace(tmp_path))
    got = {ph: {c: round(v, 9) for c, v in cats.items() if v} for ph, cats in r["ms_by_phase"].items()}
    assert got == {"forward": {"dense GEMMs": 0.2, "dispatch": 0.17, "attention": 0.1},
                   "backward": {"loss": 0.05, "dispatch": 0.15, "dense GEMMs": 0.2},
                   "optimizer": {"optimizer": 0.05, "collectives": 0.1}}
    assert abs(sum(sum(c.values()) for c in r["ms_by_phase"].values()) - r["kernel_ms"]) < 1e-12
    r["label"] = "x"
    text = phase_table([r])
    assert "| dispatch | 0.17 / 0.15 / 0.00 |" in text and "| **kernel time** | 0.47 / 0.40 / 0.15 |" in text
    assert phase_table([{"label": "old"}]) == ""  # results written before the split have no such table


def test_the_nvlink_kernels_on_local_memory_are_not_communication(tmp_path):
    """With the pull in ``_peer_gather_sum_kernel``, the local kernels (``_scatter_rows_kernel``: the expansion,
    ``_gather_sum_kernel``: the owner's sums) are dispatch work, not communication, and there is no upper bound:
    a GEMM 100-300, the send 300-400 alone, the expansion 400-500 alone, the owner's sums 500-600 alone, the pull
    600-700 beside a norm 650-700: exposed 300-400 and 600-650 (0.15 ms)."""
    from benchmarks.step_breakdown import table

    events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 100, "tid": 1}]
    for corr, (ts, dur, name) in enumerate([(100, 200, "nvjet_sm90_tst_256x128"), (300, 100, "_peer_scatter_kernel"),
                                            (400, 100, "_scatter_rows_kernel"), (500, 100, "_gather_sum_kernel"),
                                            (600, 100, "_peer_gather_sum_kernel"), (650, 50, "rms_norm_kernel")], 1):
        events += [_launch(corr, corr), _kernel(corr, ts, dur, name)]
    r = breakdown(_trace(tmp_path, events))
    assert abs(r["comm_exposed_ms"] - 0.15) < 1e-12 and r["comm_exposed_upper_ms"] == r["comm_exposed_ms"]
    assert {t["kernel"] for t in r["comm_by_kernel"]} == {"_peer_scatter_kernel", "_peer_gather_sum_kernel"}
    assert abs(r["ms"]["dispatch"] - 0.4) < 1e-12  # all four are dispatch work
    r["label"] = "x"
    assert "peer reads" not in table([r])
