"""Whole training steps on GPU (skipped without CUDA): 20 steps under
torch.cuda.set_sync_debug_mode("error") raise nothing — local path on 1 GPU, ECHO + nvlink on
2 GPUs — and the CUDA-graphed run gives the eager run's losses."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import ROOT

pytestmark = pytest.mark.gpu
STEPS = 20


def run_recipe(tmp, name, nproc, extra):
    dump = os.path.join(tmp, name)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           os.path.join(ROOT, "recipes", "pretrain.py"), "--job.config_file",
           os.path.join(ROOT, "train_configs", "debug_gpu.toml"), "--job.dump_folder", dump,
           "--training.steps", str(STEPS), "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
           "--training.sync_debug", "true", *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert p.returncode == 0, f"{name}: {p.stderr[-4000:]}"
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r["loss"] for r in rows], p.stdout


CASES = {
    "local_1gpu": (1, []),
    "echo_nvlink_2gpu": (2, ["--parallelism.expert_parallel_degree", "2", "--moe_echo.dispatcher", "nvlink",
                             "--moe_echo.echo", "true", "--moe_echo.echo_slots_per_rank", "2",
                             "--moe_echo.capacity_factor", "2.0"]),
    "padded_2gpu": (2, ["--parallelism.expert_parallel_degree", "2", "--moe_echo.dispatcher", "padded",
                        "--moe_echo.capacity_factor", "2.0"]),
}
# FP8 experts with optimizer-written weight copies (Hopper): MasterAdamW on one GPU, AdamWWithCopies at EP=2
CASES["fp8_copies_1gpu"] = (1, ["--moe_echo.expert_precision", "fp8"])
CASES["fp8_copies_nvlink_2gpu"] = (2, CASES["padded_2gpu"][1][:2] + ["--moe_echo.dispatcher", "nvlink",
                                                                    "--moe_echo.capacity_factor", "2.0",
                                                                    "--moe_echo.expert_precision", "fp8"])
# the tokens of each layer in 2 pipelined chunks (dispatch beside the experts on a side stream), ECHO on
CASES["fp8_copies_echo_nvlink_2gpu"] = (2, CASES["fp8_copies_nvlink_2gpu"][1] + ["--moe_echo.echo", "true",
                                                                              "--moe_echo.echo_slots_per_rank", "2"])
CASES["overlap_echo_padded_2gpu"] = (2, CASES["padded_2gpu"][1] + ["--moe_echo.overlap_chunks", "2",
                                                                   "--moe_echo.echo", "true"])
# the whole step in FP8: torchao's rowwise Float8Linear for the dense layers, FP8 routed experts
CASES["float8_rowwise_1gpu"] = (1, ["--model.converters", "float8", "--quantize.linear.float8.recipe_name", "rowwise"])
# tensorwise, the output head in FP8 too (filter_fqns naming only what is always kept), compiled: the head is
# components/train/fp8_head.py's (eager), its logits and weight gradient in FP8
CASES["float8_head_compiled_1gpu"] = (1, ["--model.converters", "float8", "--quantize.linear.float8.filter_fqns",
                                          "router.gate", "--compile.enable", "true"])
# the dense feed-forwards (shared experts, the dense layer's) through the FP8 experts' kernels, uncompiled
CASES["float8_dense_ffn_experts_1gpu"] = (1, CASES["float8_head_compiled_1gpu"][1] + ["--moe_echo.dense_ffn_kernels",
                                                                                      "experts"])
# the attention projections on the FP8 experts' kernels too (Fp8RowsLinear: custom ops inside the compiled attention)
CASES["float8_dense_all_experts_1gpu"] = (1, CASES["float8_dense_ffn_experts_1gpu"][1] + [
    "--moe_echo.dense_linear_kernels", "experts"])
CASES["overlap_echo_nvlink_2gpu"] = (2, CASES["echo_nvlink_2gpu"][1] + ["--moe_echo.overlap_chunks", "2"])
# the same with the shared experts on half the tokens at each end of the pipeline (on the main stream)
CASES["overlap_ends_nvlink_2gpu"] = (2, CASES["overlap_echo_nvlink_2gpu"][1] + ["--moe_echo.shared_experts_stream",
                                                                               "ends"])
# FSDP reduce-scatters the dense gradients in bf16 (half the bytes of the fp32 default)
CASES["bf16_reduce_nvlink_2gpu"] = (2, CASES["echo_nvlink_2gpu"][1] + ["--training.mixed_precision_reduce", "bfloat16"])
CASES["echo_nvlink_quack_2gpu"] = (2, CASES["echo_nvlink_2gpu"][1] + ["--moe_echo.experts_gemm", "quack"])
CASES["gathered_quack_1gpu"] = (1, ["--moe_echo.experts_gemm", "quack", "--moe_echo.gathered_experts", "true"])
CASES["gathered_echo_nvlink_quack_2gpu"] = (2, CASES["echo_nvlink_quack_2gpu"][1] + ["--moe_echo.gathered_experts", "true"])

# EP=4 with the defaults: echo = "auto" turns ECHO on for nvlink, and overlap_chunks = "auto" then pipelines each
# layer's dispatch in 2 chunks
CASES["echo_nvlink_4gpu"] = (4, ["--parallelism.expert_parallel_degree", "4", "--moe_echo.dispatcher", "nvlink",
                                 "--moe_echo.echo_slots_per_rank", "2", "--moe_echo.capacity_factor", "2.0"])


@pytest.mark.parametrize("case", list(CASES))
def test_sync_free_steps_and_graph_equals_eager(case, tmp_path):
    nproc, extra = CASES[case]
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    if "quack" in case:  # ECHO's clone weights, or token rows read by index, through QuACK's GEMMs
        pytest.importorskip("quack")
    if "fp8" in case and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("FP8 experts need a Hopper GPU")
    eager, _ = run_recipe(str(tmp_path), "eager", nproc, extra)
    graphed, out = run_recipe(str(tmp_path), "graphed", nproc, extra + ["--training.cuda_graph", "true"])
    assert "cuda graph: captured" in out, out[-3000:]
    if case == "echo_nvlink_4gpu":
        assert "echo: auto = on (nvlink dispatcher at EP=4" in out, out[-3000:]
        assert "2 token chunks per layer (overlap_chunks = auto)" in out, out[-3000:]
    if case == "float8_head_compiled_1gpu":
        said = [line for line in out.splitlines() if "float8: " in line and "linear layers in FP8" in line]
        assert said and said[0].endswith("kept: router gates, router.gate"), out[-3000:]  # the head converted
        assert "float8: the output head's grad_input GEMM in bf16" in out, out[-3000:]  # Fp8Head's default
        assert ("float8: the loss writes the logits' gradient in FP8 (e5m2) for the output head's grad_weight GEMM"
                in out), out[-3000:]
    if case in ("float8_dense_ffn_experts_1gpu", "float8_dense_all_experts_1gpu"):
        assert "dense feed-forwards (shared experts, dense layers) through the FP8 experts' kernels" in out, out[-3000:]
    if case == "float8_dense_all_experts_1gpu":
        assert "linear layers (attention projections) through the FP8 experts' kernels (Fp8RowsLinear)" in out, \
            out[-3000:]
    if "fp8" in case:  # rowwise dense layers: the experts' weights scaled per output channel, cast each pass
        per = "channel" if "rowwise" in case else "expert"
        assert f"fp8 experts: weight scales per {per}; weight copies written by the optimizer step in" in out, \
            out[-3000:]
        assert "; weight gradients in fp8" in out, out[-3000:]  # expert_wgrad_precision = "auto" with FP8 experts
    if case == "fp8_copies_echo_nvlink_2gpu":  # ECHO's clones read from the copies: every layer has them
        assert re.search(r"optimizer step in (\d+) of \1 MoE layers", out), out[-3000:]
    assert len(eager) == len(graphed) == STEPS
    for s, (a, b) in enumerate(zip(eager, graphed), 1):
        assert abs(a - b) <= 2e-3 * abs(a), f"step {s}: eager loss {a} vs graphed {b}"
    print(f"{case}: eager {eager[0]:.4f}->{eager[-1]:.4f}, graphed {graphed[0]:.4f}->{graphed[-1]:.4f}")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("graph", ["off", "eager", "recapture"])
def test_nvlink_overflow_is_replayed_to_the_exact_result(tmp_path, graph):
    """A tiny nvlink capacity with a hot expert overflows: the steps are gated on the device and
    replayed on the exact path; losses and final weights equal an alltoall run's (bf16 tolerance),
    eager and CUDA-graphed (after a replay: run eagerly, or capture again)."""
    from test_expert_parallel import _final_weights

    common = ["--parallelism.expert_parallel_degree", "2", "--moe_echo.debug_hot_experts", "1",
              "--moe_echo.bias_update_rate", "0", "--checkpoint.enable", "true", "--checkpoint.interval", str(STEPS)]
    exact, _ = run_recipe(str(tmp_path), "exact", 2, common + ["--moe_echo.dispatcher", "alltoall",
                                                              "--training.sync_debug", "false"])
    nvlink, out = run_recipe(str(tmp_path), "nvlink", 2, common + ["--moe_echo.dispatcher", "nvlink",
                                                                  "--moe_echo.capacity_factor", "1.0",
                                                                  "--moe_echo.grow_capacity_after", "0",
                                                                  "--training.cuda_graph", str(graph != "off").lower(),
                                                                  "--training.cuda_graph_after_replay",
                                                                  "recapture" if graph == "recapture" else "eager"])
    assert "gated and replayed" in out
    for s, (a, b) in enumerate(zip(exact, nvlink), 1):
        assert abs(a - b) <= 2e-3 * abs(a), f"step {s}: exact {a} vs nvlink+replay {b}"
    w_exact, w_nvlink = _final_weights(tmp_path / "exact"), _final_weights(tmp_path / "nvlink")
    for k in w_exact:
        torch.testing.assert_close(w_nvlink[k].float(), w_exact[k].float(), rtol=1e-2, atol=1e-3,
                                   msg=lambda m: f"{k}: {m}")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nvlink_capacity_grows_to_fit_and_steps_are_timed_on_the_gpu(tmp_path):
    """A hot expert overflows capacity 1.0: the first two steps are replayed and the capacity grows
    to what they needed + 10%. The hot expert's share keeps growing as the router trains, so a
    grown capacity can overflow again (measured on 2xH200: replays at steps 1-2, 4-5, 16-17; 1.0 ->
    1.47 -> ... -> 2.30): each overflow replays one pair of steps and grows once more. Every step's
    tokens/s comes from CUDA events: the last one is not inflated (host timing read it far too high)."""
    _, out = run_recipe(str(tmp_path), "grow", 2, ["--parallelism.expert_parallel_degree", "2",
                                                    "--moe_echo.dispatcher", "nvlink", "--moe_echo.debug_hot_experts",
                                                    "1", "--moe_echo.bias_update_rate", "0",
                                                    "--moe_echo.capacity_factor", "1.0",
                                                    "--moe_echo.grow_capacity_after", "1"])
    assert "capacity_factor grown to" in out, out[-3000:]
    with open(os.path.join(tmp_path, "grow", "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    replayed = [r["step"] for r in rows if r["moe/replayed"]]
    grown = [float(g) for g in re.findall(r"step \d+: overflow replayed; capacity_factor grown to ([0-9.]+)", out)]
    pairs = [replayed[i:i + 2] for i in range(0, len(replayed), 2)]
    assert replayed[:2] == [1, 2] and all(len(p) == 2 and p[1] == p[0] + 1 for p in pairs), replayed
    assert len(grown) == len(pairs) <= 4 and grown == sorted(grown) and grown[0] > 1.0, (grown, replayed)
    assert rows[-1]["memory/peer_gib"] > 0 and "of peer (symmetric) buffers" in out  # reported apart from torch's
    timed = [r for r in rows if "tokens_per_s" in r]  # a replayed step's row carries no rate
    rates = sorted(r["tokens_per_s"] for r in timed[2:-1])
    assert timed[-1]["step"] == rows[-1]["step"] and timed[-1]["tokens_per_s"] < 2 * rates[len(rates) // 2], \
        (timed[-1], rates)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_bf16_params_with_fp32_masters_track_autocast_and_checkpoint_fp32(tmp_path):
    """One GPU: bf16 parameters + fp32 masters in the optimizer (the default) follow the fp32-parameter
    autocast run's losses within bf16 noise, and the checkpoint holds the fp32 masters (values that
    bf16 cannot represent), not the bf16 copies; a run resumed from it continues the loss curve."""
    from test_expert_parallel import _final_weights

    ck = ["--checkpoint.enable", "true", "--checkpoint.interval", "10"]
    master, _ = run_recipe(str(tmp_path), "master", 1, ck)
    autocast, _ = run_recipe(str(tmp_path), "autocast", 1, ck + ["--training.master_weights", "false"])
    for s, (a, b) in enumerate(zip(autocast, master), 1):
        assert abs(a - b) <= 3e-2 * abs(a), f"step {s}: autocast {a} vs master weights {b}"
    assert master[-1] < 0.8 * master[0]
    w = _final_weights(tmp_path / "master")
    big = [t for k, t in w.items() if k.endswith("weight") and t.numel() > 1000]
    assert big and all(t.dtype == torch.float32 for t in big)
    assert all((t != t.bfloat16().float()).float().mean() > 0.5 for t in big)  # not bf16 values
    # resume from step 10 into a fresh folder: steps 11..20 match the uninterrupted run
    os.makedirs(tmp_path / "resumed")
    import shutil
    shutil.copytree(tmp_path / "master" / "checkpoint" / "step-10", tmp_path / "resumed" / "checkpoint" / "step-10")
    resumed, out = run_recipe(str(tmp_path), "resumed", 1, ck)
    assert "resumed from" in out and len(resumed) == STEPS - 10
    for s, (a, b) in enumerate(zip(master[10:], resumed), 11):
        assert abs(a - b) <= 2e-3 * abs(a), f"step {s}: uninterrupted {a} vs resumed {b}"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_expert_copies_written_by_the_optimizer_train_as_the_per_step_cast(tmp_path):
    """EP=2 on 2 GPUs (experts outside FSDP): the optimizer writing the experts' bf16 copies (the default)
    gives the per-step cast path's losses (``master_weights = false``), graphed, and a run resumed from
    its step-10 checkpoint (copies rewritten from the loaded weights) continues its loss curve."""
    ep = ["--parallelism.expert_parallel_degree", "2", "--moe_echo.dispatcher", "nvlink",
          "--moe_echo.capacity_factor", "2.0", "--training.cuda_graph", "true"]
    ck = ["--checkpoint.enable", "true", "--checkpoint.interval", "10"]
    copies, _ = run_recipe(str(tmp_path), "copies", 2, ep + ck)
    cast, _ = run_recipe(str(tmp_path), "cast", 2, ep + ["--training.master_weights", "false"])
    assert abs(copies[0] - cast[0]) <= 1e-5 * abs(cast[0])  # same weights, same bf16 compute
    for s, (a, b) in enumerate(zip(cast, copies), 1):
        assert abs(a - b) <= 2e-3 * abs(a), f"step {s}: per-step cast {a} vs optimizer-written copies {b}"
    import shutil
    shutil.copytree(tmp_path / "copies" / "checkpoint" / "step-10", tmp_path / "resumed" / "checkpoint" / "step-10")
    resumed, out = run_recipe(str(tmp_path), "resumed", 2, ep + ck)
    assert "resumed from" in out and len(resumed) == STEPS - 10
    for s, (a, b) in enumerate(zip(copies[10:], resumed), 11):
        assert abs(a - b) <= 2e-3 * abs(a), f"step {s}: uninterrupted {a} vs resumed {b}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_graphed_run_resumes_graphed_and_eagerly(tmp_path):
    """A CUDA-graphed run's checkpoint (its lr a device tensor while it trains) resumes both graphed and eagerly
    from step 10, and both continue the uninterrupted run's loss curve."""
    import shutil

    ck = ["--checkpoint.enable", "true", "--checkpoint.interval", "10"]
    graphed, _ = run_recipe(str(tmp_path), "graphed", 1, ck + ["--training.cuda_graph", "true"])
    for name, graph in (("resumed_graphed", "true"), ("resumed_eager", "false")):
        shutil.copytree(tmp_path / "graphed" / "checkpoint" / "step-10", tmp_path / name / "checkpoint" / "step-10")
        resumed, out = run_recipe(str(tmp_path), name, 1, ck + ["--training.cuda_graph", graph])
        assert "resumed from" in out and len(resumed) == STEPS - 10
        for s, (a, b) in enumerate(zip(graphed[10:], resumed), 11):
            assert abs(a - b) <= 2e-3 * abs(a), f"{name} step {s}: uninterrupted {a} vs resumed {b}"


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs a Hopper GPU")
def test_fp8_copies_are_rewritten_on_resume_and_the_loss_curve_continues(tmp_path):
    """FP8 experts, graphed, one GPU: a run resumed from its step-10 checkpoint (the FP8 weight copies rewritten
    from the loaded fp32 masters) continues the uninterrupted run's loss curve."""
    import shutil

    args = ["--moe_echo.expert_precision", "fp8", "--training.cuda_graph", "true", "--checkpoint.enable", "true",
            "--checkpoint.interval", "10"]
    whole, _ = run_recipe(str(tmp_path), "whole", 1, args)
    shutil.copytree(tmp_path / "whole" / "checkpoint" / "step-10", tmp_path / "resumed" / "checkpoint" / "step-10")
    resumed, out = run_recipe(str(tmp_path), "resumed", 1, args)
    assert "resumed from" in out and len(resumed) == STEPS - 10
    for s, (a, b) in enumerate(zip(whole[10:], resumed), 11):
        assert abs(a - b) <= 2e-3 * abs(a), f"step {s}: uninterrupted {a} vs resumed {b}"


@pytest.mark.skipif(torch.cuda.device_count() < 2 or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs 2 Hopper GPUs")
def test_float8_all_gather_trains_as_the_bf16_gather_and_graphs(tmp_path):
    """Tensorwise FP8 dense layers under FSDP (2 GPUs, EP=2): weights all-gathered in FP8 with scales
    precomputed after the optimizer step give the losses of the bf16 all-gather (the same FP8 GEMMs, the
    weight rounded once instead of twice); graphed, the scales written in place keep the eager losses, and a
    checkpoint of the FP8-gathered weights is saved."""
    f8 = ["--parallelism.expert_parallel_degree", "2", "--moe_echo.dispatcher", "nvlink",
          "--moe_echo.capacity_factor", "2.0", "--model.converters", "float8",
          "--quantize.linear.float8.recipe_name", "tensorwise"]
    gather = ["--quantize.linear.float8.enable_fsdp_float8_all_gather",
              "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"]
    bf16_gather, _ = run_recipe(str(tmp_path), "bf16_gather", 2, f8)
    eager, out = run_recipe(str(tmp_path), "fp8_gather", 2, f8 + gather)
    assert "all-gathered in FP8" in out, out[-3000:]
    graphed, out = run_recipe(str(tmp_path), "fp8_gather_graphed", 2, f8 + gather + [
        "--training.cuda_graph", "true", "--checkpoint.enable", "true", "--checkpoint.interval", "10"])
    assert "cuda graph: captured" in out, out[-3000:]
    saved = os.listdir(os.path.join(tmp_path, "fp8_gather_graphed", "checkpoint"))
    assert any(re.fullmatch(r"step-\d+", d) for d in saved), saved
    for s, (a, b, c) in enumerate(zip(bf16_gather, eager, graphed), 1):
        assert abs(a - b) <= 1e-2 * abs(a), f"step {s}: bf16 all-gather loss {a} vs FP8 all-gather {b}"
        assert abs(b - c) <= 2e-3 * abs(b), f"step {s}: eager loss {b} vs graphed {c}"
    print(f"float8 all-gather: bf16 gather {bf16_gather[0]:.4f}->{bf16_gather[-1]:.4f}, "
          f"fp8 gather {eager[0]:.4f}->{eager[-1]:.4f}, graphed {graphed[0]:.4f}->{graphed[-1]:.4f}")
