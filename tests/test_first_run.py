"""What a first run meets: Ctrl-C (one process and under torchrun) stops with one line, keeps the logs
and checkpoints, and the same command resumes; the run summary after a resume; the fine-tuning
schedule's defaults; a damaged initial checkpoint of a fine-tune; the measure behind the busy-machine
warning."""

import importlib.util
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from run_env import run_env
from test_recipe import CONFIG, RECIPE, SMALL

from components.train.checkpoint import complete_checkpoints, verify
from components.train.config import load_config
from components.train.metrics import RunSummary

FINETUNE = os.path.join(ROOT, "recipes", "finetune.py")
STOPPED = re.compile(r"^stopped at step (\d+); the last checkpoint is step-(\d+); run the same command to resume$")
ENV = run_env(OMP_NUM_THREADS="1")  # no run here compiles


def _lines(text: str) -> list[str]:
    """Lines as a terminal would show them (the progress bar redraws with carriage returns)."""
    return [l.strip() for l in re.split(r"[\r\n]", text) if l.strip()]


def _rows(dump) -> list[int]:
    try:
        with open(os.path.join(dump, "metrics.jsonl")) as f:
            return [json.loads(l)["step"] for l in f if l.endswith("\n")]
    except FileNotFoundError:
        return []


def _interrupt(cmd, dump, tmp_path, rows: int = 5, timeout: float = 300):
    """Start ``cmd``, send SIGINT once ``rows`` steps are logged; (exit code, stdout, stderr, seconds the
    stop took)."""
    out, err = open(tmp_path / "stdout", "w+"), open(tmp_path / "stderr", "w+")
    p = subprocess.Popen(cmd, stdout=out, stderr=err, env=ENV)
    deadline = time.monotonic() + timeout
    while len(_rows(dump)) < rows:
        assert p.poll() is None, f"the run ended before step {rows}: exit {p.returncode}"
        assert time.monotonic() < deadline, "no steps logged"
        time.sleep(0.2)
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    code = p.wait(timeout=120)
    took = time.monotonic() - t0
    out.seek(0), err.seek(0)
    return code, out.read(), err.read(), took


def _stop_line(stderr: str) -> tuple[int, int]:
    found = [STOPPED.match(l) for l in _lines(stderr) if l.startswith("stopped")]
    assert len(found) == 1 and found[0], stderr[-3000:]
    return int(found[0].group(1)), int(found[0].group(2))


@pytest.mark.slow
def test_ctrl_c_stops_with_one_line_keeps_the_logs_and_the_same_command_resumes(tmp_path):
    dump = tmp_path / "run"
    cmd = [sys.executable, RECIPE, "--job.config_file", CONFIG, "--job.dump_folder", str(dump), *SMALL,
           "--training.steps", "60", "--checkpoint.interval", "3", "--metrics.log_freq", "1",
           "--moe_echo.load_heatmap_freq", "0"]
    code, out, err, took = _interrupt(cmd, dump, tmp_path)
    assert code == 130, err[-3000:]
    assert "Traceback" not in out + err and "error:" not in err, err[-3000:]
    step, last = _stop_line(err)
    assert took < 10, took

    # nothing already written is lost: every logged step, in metrics.jsonl and TensorBoard
    rows = _rows(dump)
    assert rows == list(range(1, len(rows) + 1)) and step <= rows[-1] <= step + 1, (rows, step)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(dump, "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    assert {e.step for e in acc.Scalars("loss")} >= set(range(1, step + 1))
    # the checkpoint named is the newest complete one, and it verifies
    done = complete_checkpoints(os.path.join(dump, "checkpoint"))
    assert done and done[-1][0] == last and 3 <= last <= step and verify(done[-1][1]) is None

    # the same command resumes there; the summary counts what this run trained
    p = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"resumed from {done[-1][1]} (step {last})" in p.stdout, p.stdout
    assert f"steps          {last + 1}..60 (resumed after step {last})" in p.stdout, p.stdout
    assert f"tokens         {(60 - last) * 8 * 64:,}  (" in p.stdout, p.stdout
    assert _rows(dump) == list(range(1, 61))  # each step logged once


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_ctrl_c_under_the_launcher_prints_one_line_from_rank_0(tmp_path):
    """moe-echo-run (torchrun with the recipes' report) forwards the SIGINT to both ranks: rank 0 alone
    prints the line; no traceback, no torchrun report; exit 130."""
    dump = tmp_path / "run"
    cmd = [sys.executable, "-m", "components.train.launch", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), RECIPE, "--job.config_file", CONFIG, "--job.dump_folder", str(dump), *SMALL,
           "--parallelism.expert_parallel_degree", "2", "--training.steps", "200", "--checkpoint.interval", "3",
           "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false"]
    code, out, err, took = _interrupt(cmd, dump, tmp_path, rows=4)
    step, last = _stop_line(err)
    assert "error:" not in err and "Traceback" not in err and "torch/distributed" not in err, err[-4000:]
    assert took < 30, took  # before torchrun's SIGKILL
    done = complete_checkpoints(os.path.join(dump, "checkpoint"))
    assert done[-1][0] == last <= step and verify(done[-1][1]) is None
    assert code == 130, (code, err[-3000:])


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (Linux: SigCgt in /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(l.split()[1], 16) for l in f if l.startswith("SigCgt:"))
    return bool(mask >> (sig - 1) & 1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_while_the_recipe_imports_is_one_line():
    """Ctrl-C in the first second (torch and torchtitan still importing): the starting line, exit 130."""
    from components.train.starting import STARTING_LINE

    p = subprocess.Popen([sys.executable, RECIPE, "--job.config_file", CONFIG], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.monotonic() + 30
    while not _catches(p.pid, signal.SIGTERM):  # the recipe's first statement installed its handlers
        assert p.poll() is None and time.monotonic() < deadline, "the recipe never installed its signal handlers"
        time.sleep(0.01)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and _lines(err) == [STARTING_LINE], (p.returncode, err[-3000:])


def test_summary_after_a_resume_counts_the_steps_this_run_trained():
    s = RunSummary()
    for step in range(31, 61):
        s.count_step(step, 1024)
        if step % 10 == 0:
            s.losses.append((step, 2.0))
    text = s.text({})
    assert "steps          31..60 (resumed after step 30)" in text
    assert "tokens         30,720  (" in text
    fresh = RunSummary()
    fresh.count_step(1, 1024)
    assert "steps          1..1\n" in fresh.text({}) + "\n"


def _finetune_module():
    spec = importlib.util.spec_from_file_location("finetune_recipe", FINETUNE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("args, lr, warmup", [
    ((), 3e-4, 3),                                                  # 0.1 x debug_cpu's 3e-3; 5% of 50 steps
    (("--optimizer.lr", "1e-4"), 1e-4, 3),
    (("--optimizer.lr=2e-5", "--lr_scheduler.warmup_steps", "0"), 2e-5, 0),
    (("--training.steps", "7"), 3e-4, 1),
])
def test_finetune_defaults_to_its_own_schedule_unless_the_command_line_sets_it(args, lr, warmup):
    argv = ["--job.config_file", CONFIG, "--training.steps", "50", *args]
    cfg = load_config(argv)
    said = _finetune_module().finetune_schedule(cfg, argv)
    assert cfg.optimizer.lr == pytest.approx(lr) and cfg.lr_scheduler.warmup_steps == warmup
    assert said.startswith(f"fine-tuning schedule: lr {lr:g} (") and f"warm-up {warmup} steps" in said


@pytest.mark.slow
def test_finetune_from_a_damaged_checkpoint_is_one_line_naming_the_file(tmp_path):
    dump = tmp_path / "pretrained"
    subprocess.run([sys.executable, RECIPE, "--job.config_file", CONFIG, "--job.dump_folder", str(dump), *SMALL,
                    "--training.steps", "2", "--checkpoint.interval", "2", "--metrics.enable_tensorboard", "false"],
                   check=True, capture_output=True, env=ENV, timeout=600)
    step_dir = os.path.join(dump, "checkpoint", "step-2")
    data = sorted(f for f in os.listdir(step_dir) if f.endswith(".distcp"))
    with open(os.path.join(step_dir, data[0]), "r+b") as f:  # the tail: the optimizer state, not the weights
        f.truncate(os.path.getsize(os.path.join(step_dir, data[0])) - 64)
    for recipe, name in ((FINETUNE, "ft"), (RECIPE, "pt")):  # pretrain's initial_load_path is checked alike
        p = subprocess.run([sys.executable, recipe, "--job.config_file", CONFIG, "--job.dump_folder",
                            str(tmp_path / name), *SMALL, "--training.steps", "2", "--checkpoint.initial_load_path",
                            step_dir], capture_output=True, text=True, env=ENV, timeout=600)
        lines = [l for l in p.stderr.splitlines() if l.strip()]
        assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
        assert lines[0].startswith("error: [checkpoint] initial_load_path") and data[0] in lines[0], lines[0]
        assert "failed verification" in lines[0] and "copy it again" in lines[0]
        assert not os.path.exists(tmp_path / name / "metrics.jsonl")  # stopped before any step


def test_other_load_measures_the_cores_other_processes_keep_busy():
    from components.train.loop import OtherLoad

    load = OtherLoad(min_s=1.5)
    assert load.cores() is None  # not yet measured long enough
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(2.0)
        busy = load.cores()
    finally:
        spinner.kill()
        spinner.wait()
    assert busy is not None and busy >= 0.7, busy  # the spinner's core (plus whatever else runs here)
    assert busy <= (os.cpu_count() or 1) + 0.1


def test_a_signal_while_a_checkpoint_is_written_stops_the_run_after_it(tmp_path):
    from components.train.entry import Interrupted, StopRequest

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    stop = StopRequest(grace_s=math.inf)  # no forced exit of this test process
    stop.install(rank=0)
    try:
        written = []
        with pytest.raises(Interrupted):
            with stop.deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.2)  # the handler runs here and only records the signal
                written.append("checkpoint")
        assert written == ["checkpoint"] and stop.signum == signal.SIGTERM and stop.exit_code == 143
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    stop.track(7, str(tmp_path))
    assert stop.line() == "stopped at step 7; no checkpoint was saved; the same command starts over"
    os.makedirs(tmp_path / "step-5")
    (tmp_path / "step-5" / "COMPLETE").write_text("5\n")
    assert STOPPED.match(stop.line()).groups() == ("7", "5")
