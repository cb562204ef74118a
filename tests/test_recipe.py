"""The pretrain recipe end to end on CPU: loss falls, TensorBoard readback, exact resume,
SIGKILL during a checkpoint write, and one-line errors for bad input."""

import io
import json
import os
import signal
import subprocess
import sys

import pytest

from background import Jobs, Runs, selected
from conftest import ROOT
from run_env import run_env

pytestmark = pytest.mark.slow  # end-to-end runs in subprocesses

RECIPE = os.path.join(ROOT, "recipes", "pretrain.py")
CONFIG = os.path.join(ROOT, "train_configs", "debug_cpu.toml")
SMALL = ["--training.max_corpus_mb", "1", "--training.seq_len", "64", "--training.local_batch_size", "8"]


def run(dump, *args, env=None, check=True):
    cmd = [sys.executable, RECIPE, "--job.config_file", CONFIG, "--job.dump_folder", str(dump), *SMALL, *args]
    full_env = run_env(args, OMP_NUM_THREADS="1", **(env or {}))
    p = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}\nstdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}")
    return p


def losses(dump) -> dict[int, float]:
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def _trained(dump):
    return run(dump, "--training.steps", "30", "--metrics.log_freq", "5", "--moe_echo.load_heatmap_freq", "10",
               "--checkpoint.enable", "false")


def test_trains_loss_falls_and_tensorboard_holds_scalars_and_heatmaps(launches):
    p, dump = launches["trained"]
    assert "run summary" in p.stdout
    ls = losses(dump)
    first, last = ls[1], sum(ls[s] for s in (20, 25, 30)) / 3
    assert last < first - 1.0, ls  # byte-level loss starts near ln(512) = 6.2

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(dump, "tb"), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    tags = acc.Tags()
    for tag in ("loss", "lr", "grad_norm", "tokens_per_s", "moe/layer1/load_max_over_mean",
                "moe/layer3/load_max_over_mean"):
        assert tag in tags["scalars"], (tag, tags["scalars"])
    tb_loss = {e.step: e.value for e in acc.Scalars("loss")}
    assert tb_loss[30] == pytest.approx(ls[30], rel=1e-6)
    assert all(e.value >= 1.0 for e in acc.Scalars("moe/layer1/load_max_over_mean"))
    imgs = acc.Images("moe/layer1/load_heatmap")
    assert [i.step for i in imgs] == [10, 20, 30]
    from PIL import Image

    from components.train.metrics import heatmap_size

    for img in imgs:  # the documented size (8 experts), the same however many steps it shows
        png = Image.open(io.BytesIO(img.encoded_image_string))
        assert png.size == (img.width, img.height) == heatmap_size(8)[::-1], (png.size, img.width, img.height)
        assert min(png.size) >= 200
    assert p.stderr.count("30/30") == 1, p.stderr[-1000:]  # the progress bar's final line, once


RESUME = ["--training.steps", "12", "--lr_scheduler.total_steps", "12", "--lr_scheduler.warmup_steps", "3",
          "--metrics.log_freq", "1", "--checkpoint.interval", "4", "--metrics.enable_tensorboard", "false"]


def _uninterrupted(dump):
    run(dump, *RESUME, "--checkpoint.enable", "false")
    return losses(dump)


@pytest.fixture(scope="module")
def uninterrupted(launches):
    return launches["uninterrupted"][0]


def test_resume_continues_with_identical_losses(launches, uninterrupted):
    _, dump = launches["stopped_at_6"]
    p = run(dump, *RESUME)
    assert "resumed from" in p.stdout and "step-6" in p.stdout
    resumed = losses(dump)
    for step in range(7, 13):
        assert resumed[step] == uninterrupted[step], step  # bit-identical on CPU
    for step in range(1, 7):
        assert resumed[step] == uninterrupted[step]


def test_sigkill_during_checkpoint_write_resumes_from_previous(launches, uninterrupted):
    p, dump = launches["killed_at_8"]
    assert p.returncode == -signal.SIGKILL
    ckpt = os.path.join(dump, "checkpoint")
    assert sorted(os.listdir(ckpt)) == ["step-4", "step-8.partial"]
    p = run(dump, *RESUME)
    assert "step-4" in p.stdout and "resumed from" in p.stdout
    assert not os.path.exists(os.path.join(ckpt, "step-8.partial"))
    assert sorted(os.listdir(ckpt)) == ["step-12", "step-8"]  # keep_latest_k = 2
    resumed = losses(dump)
    for step in range(5, 13):
        assert resumed[step] == uninterrupted[step], step


def _bad_cmd(tmp_path, *args, toml_extra=None) -> list[str]:
    config = CONFIG
    if toml_extra is not None:
        config = os.path.join(tmp_path, "bad.toml")
        with open(CONFIG) as f, open(config, "w") as g:
            g.write(f.read() + "\n" + toml_extra)
    return [sys.executable, RECIPE, "--job.config_file", config, "--job.dump_folder", str(tmp_path / "out"), *SMALL,
            "--training.steps", "2", *args]


def _launch(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _one_line_exit_2(p: subprocess.CompletedProcess) -> str:
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert p.returncode == 2, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    return lines[0]


def _bad(tmp_path, *args, toml_extra=None):
    return _one_line_exit_2(_launch(_bad_cmd(tmp_path, *args, toml_extra=toml_extra)))


BAD_INPUT = {  # id: (args, toml_extra, expected in the error line)
    "unknown_toml_section": ((), "[moe_echo_typo]\nslots = 3\n", "moe_echo_typo"),
    "invalid_toml": ((), "[moe_echo]\nslots = 3\n", "not valid TOML"),  # a second [moe_echo] table
    "unknown_cli_key": (("--training.stepz", "3"), None, "stepz"),
    "wrong_type": (("--training.steps", "ten"), None, "training.steps"),
    "out_of_range": (("--moe_echo.capacity_factor", "0.5"), None, "capacity_factor"),
    "missing_data": (("--training.dataset", "local", "--training.dataset_path", "/no/such/data.jsonl"), None,
                     "/no/such/data.jsonl"),
    "missing_tokenizer": (("--model.hf_assets_path", "/no/such/tokenizer"), None, "/no/such/tokenizer"),
    "unknown_flavor": (("--model.flavor", "huge"), None, "flavor"),
    "nvlink_without_gpus": (("--moe_echo.dispatcher", "nvlink"), None, "needs CUDA GPUs"),
    "graph_warmup": (("--training.cuda_graph_warmup", "0"), None, "cuda_graph_warmup"),
    "quack_without_hopper": (("--moe_echo.experts_gemm", "quack"), None, 'set experts_gemm = "torch"'),
}
BAD_TOML = {"unknown_key": '[training]\nsteps = 2\nlr = 0.1\n', "wrong_type": '[training]\nsteps = "two"\n'}


def _toml_only(dump, text):
    (dump / "bad.toml").write_text(text)
    return _launch([sys.executable, RECIPE, "--job.config_file", str(dump / "bad.toml")])


GATHERED = ["--training.steps", "3", "--metrics.log_freq", "1", "--checkpoint.enable", "false",
            "--metrics.enable_tensorboard", "false"]


def _corrupt_checkpoint(dump):
    run(dump, "--training.steps", "2", "--checkpoint.interval", "2", "--metrics.enable_tensorboard", "false")


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory):
    """This module's launches that need no earlier one, started together in the order the tests read
    them (each spends ~10 s importing on one core); ``launches[name]`` is (result, its folder)."""
    jobs = Jobs(request, tmp_path_factory)
    add = jobs.add

    resume = "test_resume_continues_with_identical_losses"
    sigkill = "test_sigkill_during_checkpoint_write_resumes_from_previous"
    add("test_trains_loss_falls_and_tensorboard_holds_scalars_and_heatmaps", "trained", _trained)
    add(f"{resume} {sigkill}", "uninterrupted", _uninterrupted)
    add(resume, "stopped_at_6", lambda d: run(d, *RESUME, "--training.steps", "6"))
    add(sigkill, "killed_at_8", lambda d: run(d, *RESUME, env={"MOE_ECHO_FAULT_KILL_AT_CHECKPOINT": "8"}, check=False))
    for case in sorted(selected(request, "test_bad_input_is_one_line_exit_2"), key=list(BAD_INPUT).index):
        args, toml_extra, _ = BAD_INPUT[case]
        add("test_bad_input_is_one_line_exit_2", case,
            lambda d, args=args, toml_extra=toml_extra: _launch(_bad_cmd(d, *args, toml_extra=toml_extra)))
    for name, text in BAD_TOML.items():
        add("test_unknown_toml_key_and_wrong_toml_type", f"toml_{name}", lambda d, text=text: _toml_only(d, text))
    add("test_corrupt_checkpoint_is_one_line_error", "corrupt_checkpoint", _corrupt_checkpoint)
    gathered = "test_gathered_experts_train_as_the_dispatched_path"
    add(gathered, "dispatched", lambda d: run(d, *GATHERED))
    add(gathered, "gathered", lambda d: run(d, *GATHERED, "--moe_echo.gathered_experts", "true"))
    runs = Runs(jobs)
    yield runs
    runs.close()


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line_exit_2(launches, case):
    line = _one_line_exit_2(launches[case][0])
    assert BAD_INPUT[case][2] in line


def test_unknown_toml_key_and_wrong_toml_type(launches):
    p, _ = launches["toml_unknown_key"]
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0
    assert "'lr'" in p.stderr and "[training]" in p.stderr
    p, _ = launches["toml_wrong_type"]
    assert p.returncode == 2 and "[training] steps" in p.stderr and "int" in p.stderr


def test_corrupt_checkpoint_is_one_line_error(launches):
    _, dump = launches["corrupt_checkpoint"]
    step_dir = os.path.join(dump, "checkpoint", "step-2")
    data = [f for f in os.listdir(step_dir) if f.endswith(".distcp")]
    assert data
    with open(os.path.join(step_dir, data[0]), "r+b") as f:  # truncate the tensor data
        f.truncate(100)
    with open(os.path.join(step_dir, ".metadata"), "r+b") as f:
        f.write(b"garbage!" * 8)
    line = _bad(dump, "--checkpoint.interval", "2", "--training.steps", "4",
                "--job.dump_folder", str(dump))
    assert "step-2" in line and "could not be loaded" in line


def test_gathered_experts_train_as_the_dispatched_path(launches):
    """[moe_echo] gathered_experts on CPU (the experts read token rows and apply the combine): the same
    losses as the dispatched path, step by step."""
    a, b = losses(launches["dispatched"][1]), losses(launches["gathered"][1])
    assert len(a) == 3 and a.keys() == b.keys()
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-5 * abs(a[step]), (step, a[step], b[step])
