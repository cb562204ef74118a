"""Runs a user can trust: the step gate skips non-finite steps on the device, the guard stops a
diverging run (exit 3) naming where it went non-finite and never saving non-finite weights, every
torchtitan key is honoured or refused, and metrics never mix runs."""

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest
import torch

from background import Jobs, Runs, selected
from components.train.optim import build_optimizer
from components.train.overflow import StepGate, StepPipeline
from conftest import ROOT
from run_env import run_env
from test_recipe import CONFIG, RECIPE, SMALL, _bad, losses, run


class _Opt:
    name, lr, beta1, beta2, eps, weight_decay, implementation = "AdamW", 1e-2, 0.9, 0.95, 1e-8, 0.1, "fused"


def _model_and_grads(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    model(torch.randn(16, 8)).square().mean().backward()
    return model


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_gate_skips_a_nonfinite_step_on_the_device(bad):
    model = _model_and_grads()
    opt = build_optimizer(model, _Opt(), gated=True)
    gate = StepGate([], opt, torch.device("cpu"))
    before = [p.detach().clone() for p in model.parameters()]
    gate.gate(torch.tensor(bad), torch.tensor(1.0))  # loss not finite
    opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(float(s["step"]) == 0 for s in opt.state.values())  # not even the step count moved
    gate.gate(torch.tensor(1.0), torch.tensor(bad))  # gradient norm not finite
    opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    gate.gate(torch.tensor(1.0), torch.tensor(1.0))  # finite: applied
    opt.step()
    assert not torch.equal(before[0], model.weight)
    assert int(gate.nonfinite_total) == 2


def test_pipeline_counts_consecutive_nonfinite_steps_one_step_late():
    model = _model_and_grads()
    opt = build_optimizer(model, _Opt(), gated=True)
    gate = StepGate([], opt, torch.device("cpu"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    pattern = {1: 1.0, 2: float("nan"), 3: float("nan"), 4: 1.0, 5: float("inf")}

    def run_step(batch, exact):
        from components.parallel.host_copy import HostCopy

        gate.gate(torch.tensor(pattern[batch[0]]), torch.tensor(1.0))
        return HostCopy(torch.tensor(batch[0]))

    pipe = StepPipeline(run_step, gate, sched)
    seen = []
    for step in range(1, 6):
        done = pipe.submit(step, (step,), settle=step == 5)
        assert all(c.step < step for c in done) or step == 5  # confirmed one step late
        seen += [(c.step, c.nonfinite, pipe.nonfinite_streak) for c in done]
    assert [s for s, _, _ in seen] == [1, 2, 3, 4, 5]
    assert [n for _, n, _ in seen] == [False, True, True, False, True]


def test_beta2_changes_the_update():
    outs = []
    for beta2 in (0.95, 0.5):
        model = _model_and_grads()
        opt_cfg = _Opt()
        opt_cfg.beta2 = beta2
        opt = build_optimizer(model, opt_cfg)
        assert opt.param_groups[0]["betas"] == (0.9, beta2)
        for _ in range(3):
            opt.step()
        outs.append(model.weight.detach().clone())
    assert not torch.equal(*outs)


def _diverging(dump):
    return run(dump, "--optimizer.lr", "1e30", "--lr_scheduler.warmup_steps", "0", "--training.steps", "12",
               "--checkpoint.interval", "5", "--checkpoint.keep_latest_k", "2", "--metrics.log_freq", "1", check=False)


def _nan_weights(dump):
    return run(dump, "--training.steps", "12", "--checkpoint.interval", "5", "--checkpoint.keep_latest_k", "1",
               "--metrics.log_freq", "1", env={"MOE_ECHO_FAULT_NAN_AT_STEP": "7"}, check=False)


MORE_BAD = {"lr_inf": (("--optimizer.lr", "inf"), "finite"),
            "async_checkpoint": (("--checkpoint.async_mode", "async"), "not supported by this recipe")}


def _bad_bytes_toml(dump):
    bad = dump / "bad.toml"
    bad.write_bytes(b"[training]\nsteps = 2\n# \xff\xfe\n")
    return subprocess.run([sys.executable, RECIPE, "--job.config_file", str(bad)], capture_output=True, text=True,
                          timeout=300)


def _dump_folder_is_a_file(dump):
    f = dump / "a_file"
    f.write_text("x")
    return _bad(dump, "--job.dump_folder", str(f))


def _hung_peer(dump):
    t0 = time.monotonic()
    p = _torchrun(dump, "--training.steps", "30", "--checkpoint.enable", "false", "--comm.train_timeout_seconds",
                  "15", env={"MOE_ECHO_FAULT_STOP_AT_STEP": "4"})
    return p, time.monotonic() - t0


def _profiled(dump):
    return run(dump, "--training.steps", "4", "--checkpoint.interval", "4", "--checkpoint.last_save_in_hf",
               "--profiling.enable_profiling", "--profiling.profile_freq", "2", "--profiling.profiler_warmup", "0",
               "--metrics.enable_tensorboard", "false")


FRESH = ["--training.steps", "6", "--metrics.log_freq", "1", "--checkpoint.interval", "3"]


def _snapshot(dump):
    """(path, size) of every file under ``dump``."""
    return sorted((os.path.relpath(os.path.join(d, f), dump), os.path.getsize(os.path.join(d, f)))
                  for d, _, files in os.walk(dump) for f in files)


def _fresh_twice_then_resumed(dump):
    """A run, the same run again (fresh: no checkpoint to resume), then a resume from its step-3 whose log
    already reached step 6; what each left, read as the test reads it."""
    import shutil

    run(dump, *FRESH, "--checkpoint.enable", "false")
    first = losses(dump)
    run(dump, *FRESH)  # fresh again (no checkpoint to resume): the old log moves aside
    again = {"listing": sorted(os.listdir(dump)), "losses": losses(dump),
             "tb_prev": os.path.isdir(os.path.join(dump, "tb.prev-1"))}
    shutil.rmtree(os.path.join(dump, "checkpoint", "step-6"))
    run(dump, *FRESH)
    return first, again


def _nothing_to_do(dump):
    """A finished 2-step run launched again: (first launch, files and metrics before, second launch)."""
    first = run(dump, "--training.steps", "2", "--checkpoint.interval", "2")
    before = _snapshot(dump)
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        metrics_before = f.read()
    return first, before, metrics_before, run(dump, "--training.steps", "2", "--checkpoint.interval", "2")


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory):
    """This module's independent launches, started together: the hung-peer run first (it mostly
    waits for its timeout), then in the order the tests read them. Each job gets its own folder."""
    jobs = Jobs(request, tmp_path_factory)
    add = jobs.add

    if not torch.cuda.is_available():
        add("test_a_hung_peer_ends_the_run_within_the_timeout_after_a_hang_report", "hung_peer", _hung_peer)
    add("test_diverging_run_stops_with_exit_3_and_saves_no_nonfinite_checkpoint", "diverging", _diverging)
    add("test_nonfinite_weights_are_named_and_the_last_good_checkpoint_is_kept", "nan_weights", _nan_weights)
    add("test_fresh_run_moves_old_metrics_aside_and_resume_logs_each_step_once", "fresh", _fresh_twice_then_resumed)
    add("test_nothing_to_do_prints_one_line_and_writes_nothing", "nothing_to_do", _nothing_to_do)
    for case in selected(request, "test_more_bad_input_is_one_line_exit_2"):
        args = MORE_BAD[case][0]
        add("test_more_bad_input_is_one_line_exit_2", case, lambda dump, args=args: _bad(dump, *args))
    add("test_bad_bytes_in_toml_and_dump_folder_that_is_a_file", "bad_bytes", _bad_bytes_toml)
    add("test_bad_bytes_in_toml_and_dump_folder_that_is_a_file", "dump_is_file", _dump_folder_is_a_file)
    add("test_profiling_and_hf_export_keys_are_honoured", "profiled", _profiled)
    if not (torch.cuda.is_available() and torch.cuda.device_count() < 2):
        add("test_bad_key_under_the_launcher_is_one_error_line_and_exit_2", "launcher_bad_key",
            lambda dump: _torchrun(dump, "--training.stepz", "3", launcher=True))
    runs = Runs(jobs, workers=3)  # the hung-peer run holds one of them, mostly waiting for its timeout
    yield runs
    runs.close()


@pytest.mark.slow
def test_diverging_run_stops_with_exit_3_and_saves_no_nonfinite_checkpoint(launches):
    p, dump = launches["diverging"]
    lines = [l for l in p.stderr.splitlines() if l.startswith("error:")]
    assert p.returncode == 3, p.stderr[-2000:]
    assert "Traceback" not in p.stderr and len(lines) == 1, p.stderr[-2000:]
    assert "consecutive non-finite steps" in lines[0] and "first non-finite: " in lines[0]
    rows = [json.loads(l) for l in open(os.path.join(dump, "metrics.jsonl"))]
    stop = rows[-1]["step"]
    assert stop < 12 and rows[-1]["nonfinite_skipped_steps"] >= 3
    ckpt = os.path.join(dump, "checkpoint")
    for name in os.listdir(ckpt) if os.path.isdir(ckpt) else []:
        assert int(name.split("-")[1]) < stop - 2  # only from before the non-finite streak


@pytest.mark.slow
def test_nonfinite_weights_are_named_and_the_last_good_checkpoint_is_kept(launches):
    p, dump = launches["nan_weights"]
    lines = [l for l in p.stderr.splitlines() if l.startswith("error:")]
    assert p.returncode == 3 and len(lines) == 1, p.stderr[-2000:]
    assert "step 9: 3 consecutive" in lines[0], lines[0]
    assert "layers.1.moe.experts" in lines[0], lines[0]  # where the NaN weight sits (first MoE layer)
    assert "weights themselves are not finite" in lines[0]
    assert sorted(os.listdir(os.path.join(dump, "checkpoint"))) == ["step-5"]
    rows = {r["step"]: r for r in map(json.loads, open(os.path.join(dump, "metrics.jsonl")))}
    assert rows[6]["nonfinite_skipped_steps"] == 0 and rows[9]["nonfinite_skipped_steps"] == 3


@pytest.mark.slow
def test_fresh_run_moves_old_metrics_aside_and_resume_logs_each_step_once(launches):
    (first, again), tmp_path = launches["fresh"]
    assert again["listing"].count("metrics.jsonl.prev-1") == 1
    assert list(again["losses"]) == [1, 2, 3, 4, 5, 6]
    assert again["tb_prev"]
    # resumed from step-3 of a run whose log already reached step 6: steps 4..6 logged once
    steps = [json.loads(l)["step"] for l in open(os.path.join(tmp_path, "metrics.jsonl"))]
    assert steps == [1, 2, 3, 4, 5, 6]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(tmp_path, "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3, 4, 5, 6]
    assert first[1] == losses(tmp_path)[1]


@pytest.mark.slow
def test_nothing_to_do_prints_one_line_and_writes_nothing(launches):
    (first, before, metrics_before, p), tmp_path = launches["nothing_to_do"]
    assert first.stderr.count("2/2") == 1, first.stderr  # final bar line once, also after the checkpoint line
    assert p.stdout.strip().count("\n") == 0 and "nothing to do" in p.stdout
    assert "step/s" not in p.stderr  # no progress bar
    assert _snapshot(tmp_path) == before  # no new event file, nothing moved aside to *.prev-N
    with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
        assert f.read() == metrics_before


@pytest.mark.parametrize(
    "args, toml_extra, expect",
    [
        (("--optimizer.lr", "inf"), None, "finite"),
        (("--optimizer.beta1", "2.0"), None, "beta1"),
        (("--training.seed", "100000000000000000000000"), None, "seed"),
        (("--training.steps", "100000000000000000000"), None, "64-bit"),
        ((), "[validation]\nsteps = 100000000000000000000\n", "64-bit"),
        (("--moe_echo.debug_hot_experts", "-3"), None, "debug_hot_experts"),
        (("--job.dump_folder", ""), None, "dump_folder"),
        (("--job.config_file", CONFIG), None, "given 2 times"),
        (("--training.stepss", "3"), None, "did you mean 'steps'"),
        (("--checkpoint.async_mode", "async"), None, "not supported by this recipe: [checkpoint] async_mode"),
        (("--validation.enable",), None, "not supported by this recipe: [validation] enable"),
        (("--metrics.enable_wandb",), None, "not supported by this recipe: [metrics] enable_wandb"),
        (("--model.converters", "mx"), None, "[model] converters = ['mx']: 'mx' is not applied by this recipe"),
        (("--training.global_batch_size", "64"), None, "global_batch_size"),
        (("--optimizer.implementation", "foreach"), None, "fused"),
        (("--compile.components", "model,optimizer"), None, "'optimizer' is not compiled by this recipe"),
        (("--compile.enable", "true", "--compile.backend", "inductr"), None, "not a torch.compile backend"),
        (("--moe_echo.dispatcher", "padded", "--moe_echo.nvlink_copy", "copy_engine"), None,
         "nvlink_copy = 'copy_engine' applies to the nvlink dispatcher only"),
        (("--moe_echo.nvlink_copy", "dma"), None, "nvlink_copy"),
    ],
    ids=["lr_inf", "beta1", "seed_int64", "steps_int64", "toml_int64", "hot_experts_negative", "dump_empty",
         "second_config", "did_you_mean", "async_checkpoint", "validation", "wandb", "converters",
         "grad_accumulation", "foreach_with_guard", "compile_component", "compile_backend", "send_without_nvlink",
         "send_unknown"],
)
def test_more_bad_input_is_a_user_error_before_any_work(tmp_path, args, toml_extra, expect):
    """In process (each case as a subprocess would cost seconds of imports; the one-line exit-2
    plumbing is checked by test_recipe.py's bad-input tests and the cases below)."""
    from components.errors import UserError
    from components.train.config import check_global_batch, load_config

    config = CONFIG
    if toml_extra is not None:
        config = str(tmp_path / "bad.toml")
        with open(CONFIG) as f, open(config, "w") as g:
            g.write(f.read() + "\n" + toml_extra)
    with pytest.raises(UserError) as err:
        check_global_batch(load_config(["--job.config_file", config, "--job.dump_folder", str(tmp_path / "out"),
                                        *args]), world=1)
    assert expect in str(err.value) and "\n" not in str(err.value)
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.slow
@pytest.mark.parametrize("case", list(MORE_BAD))
def test_more_bad_input_is_one_line_exit_2(launches, case):
    line, _ = launches[case]
    assert MORE_BAD[case][1] in line


@pytest.mark.slow
def test_bad_bytes_in_toml_and_dump_folder_that_is_a_file(launches):
    p, _ = launches["bad_bytes"]
    assert p.returncode == 2 and "UTF-8" in p.stderr and "Traceback" not in p.stderr
    line, _ = launches["dump_is_file"]
    assert "existing file" in line


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(tmp_path, *args, env=None, timeout=300, launcher: bool = False):
    """The recipe on 2 ranks under torchrun (``launcher``: under moe-echo-run, components/train/launch.py)."""
    run = "components.train.launch" if launcher else "torch.distributed.run"
    cmd = [sys.executable, "-m", run, "--nproc_per_node", "2", "--master_port", str(_free_port()),
           RECIPE, "--job.config_file", CONFIG, "--job.dump_folder", str(tmp_path / "out"), *SMALL,
           "--parallelism.expert_parallel_degree", "2", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=run_env(args, OMP_NUM_THREADS="1", **(env or {})))


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs 2 ranks")
def test_bad_key_under_the_launcher_is_one_error_line_and_exit_2(launches):
    """moe-echo-run (torchrun with the recipes' report): the one line from rank 0, nothing from torchrun."""
    p, _ = launches["launcher_bad_key"]
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "did you mean 'steps'" in lines[0], p.stderr[-3000:]
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo on CPU; under NCCL the watchdog aborts the process")
def test_a_hung_peer_ends_the_run_within_the_timeout_after_a_hang_report(launches):
    (p, elapsed), _ = launches["hung_peer"]
    assert p.returncode != 0 and elapsed < 240, (elapsed, p.stderr[-3000:])
    report = p.stderr.find("no training step has finished")
    error = p.stderr.find("error: [rank 0] a collective timed out")
    assert 0 <= report < error, p.stderr[-3000:]
    assert "Traceback" not in p.stderr[error:].split("\n")[0]


@pytest.mark.slow
def test_profiling_and_hf_export_keys_are_honoured(launches):
    from components.moe_echo.config import MoEEchoConfig
    from components.moe_echo.models import build_model
    from components.train.hf_weights import load_initial_weights

    p, dump = launches["profiled"]
    traces = sorted(os.listdir(os.path.join(dump, "profile_traces")))
    assert traces == ["iteration_2", "iteration_4"], traces
    with open(os.path.join(dump, "profile_traces", "iteration_4", "rank0_trace.json")) as f:
        assert json.load(f)["traceEvents"]
    assert "HF export:" in p.stdout
    ckpt = os.path.join(dump, "checkpoint")
    dcp_model, hf_model = (build_model("deepseek_v3", "tiny", MoEEchoConfig(), seq_len=64, seed=s) for s in (1, 2))
    load_initial_weights(dcp_model, os.path.join(ckpt, "step-4"), False, "deepseek_v3")
    load_initial_weights(hf_model, os.path.join(ckpt, "step-4-hf"), True, "deepseek_v3")
    a, b = dcp_model.state_dict(), hf_model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k  # the export holds exactly the final weights


def test_error_lines_of_ranks_sharing_a_stderr_never_run_into_each_other():
    """Ranks of a host print their error lines into their agent's one stderr at the same moment (a lost peer):
    each line is one write, so none is split by another's, even unbuffered (PYTHONUNBUFFERED: print writes the
    text and its newline apart)."""
    writer = ("import sys; sys.path.insert(0, sys.argv[2]); from components.train.entry import say_line\n"
              "for i in range(300): say_line(f'error: [rank {sys.argv[1]}] line {i} ' + 'x' * 200)")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    r, w = os.pipe()
    procs = [subprocess.Popen([sys.executable, "-c", writer, str(rank), ROOT], stderr=w, env=env) for rank in range(4)]
    os.close(w)
    with os.fdopen(r) as f:
        lines = f.read().splitlines()
    assert all(p.wait(timeout=120) == 0 for p in procs)
    good = [l for l in lines if re.fullmatch(r"error: \[rank \d\] line \d+ x{200}", l)]
    assert len(good) == len(lines) == 4 * 300, [l for l in lines if l not in good][:3]
