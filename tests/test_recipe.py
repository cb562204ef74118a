"""The pretrain recipe end to end on CPU: loss falls, TensorBoard readback, exact resume,
SIGKILL during a checkpoint write, and one-line errors for bad input."""

import io
import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow  # end-to-end runs in subprocesses

RECIPE = os.path.join(ROOT, "recipes", "pretrain.py")
CONFIG = os.path.join(ROOT, "train_configs", "debug_cpu.toml")
SMALL = ["--training.max_corpus_mb", "1", "--training.seq_len", "64", "--training.local_batch_size", "8"]


def run(dump, *args, env=None, check=True):
    cmd = [sys.executable, RECIPE, "--job.config_file", CONFIG, "--job.dump_folder", str(dump), *SMALL, *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "2", **(env or {})}
    p = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}\nstdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}")
    return p


def losses(dump) -> dict[int, float]:
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def test_trains_loss_falls_and_tensorboard_holds_scalars_and_heatmaps(tmp_path):
    p = run(tmp_path, "--training.steps", "60", "--metrics.log_freq", "5", "--moe_echo.load_heatmap_freq", "20",
            "--checkpoint.enable", "false")
    assert "run summary" in p.stdout
    ls = losses(tmp_path)
    first, last = ls[1], sum(ls[s] for s in (50, 55, 60)) / 3
    assert last < first - 1.0, ls  # byte-level loss starts near ln(512) = 6.2

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(tmp_path, "tb"), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    tags = acc.Tags()
    for tag in ("loss", "lr", "grad_norm", "tokens_per_s", "moe/layer1/load_max_over_mean",
                "moe/layer3/load_max_over_mean"):
        assert tag in tags["scalars"], (tag, tags["scalars"])
    tb_loss = {e.step: e.value for e in acc.Scalars("loss")}
    assert tb_loss[60] == pytest.approx(ls[60], rel=1e-6)
    assert all(e.value >= 1.0 for e in acc.Scalars("moe/layer1/load_max_over_mean"))
    imgs = acc.Images("moe/layer1/load_heatmap")
    assert [i.step for i in imgs] == [20, 40, 60]
    from PIL import Image

    from components.train.metrics import heatmap_size

    for img in imgs:  # the documented size (8 experts), the same however many steps it shows
        png = Image.open(io.BytesIO(img.encoded_image_string))
        assert png.size == (img.width, img.height) == heatmap_size(8)[::-1], (png.size, img.width, img.height)
        assert min(png.size) >= 200
    assert p.stderr.count("60/60") == 1, p.stderr[-1000:]  # the progress bar's final line, once


RESUME = ["--training.steps", "12", "--lr_scheduler.total_steps", "12", "--lr_scheduler.warmup_steps", "3",
          "--metrics.log_freq", "1", "--checkpoint.interval", "4", "--metrics.enable_tensorboard", "false"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    dump = tmp_path_factory.mktemp("full")
    run(dump, *RESUME, "--checkpoint.enable", "false")
    return losses(dump)


def test_resume_continues_with_identical_losses(tmp_path, uninterrupted):
    run(tmp_path, *RESUME, "--training.steps", "6")
    p = run(tmp_path, *RESUME)
    assert "resumed from" in p.stdout and "step-6" in p.stdout
    resumed = losses(tmp_path)
    for step in range(7, 13):
        assert resumed[step] == uninterrupted[step], step  # bit-identical on CPU
    for step in range(1, 7):
        assert resumed[step] == uninterrupted[step]


def test_sigkill_during_checkpoint_write_resumes_from_previous(tmp_path, uninterrupted):
    p = run(tmp_path, *RESUME, env={"MOE_ECHO_FAULT_KILL_AT_CHECKPOINT": "8"}, check=False)
    assert p.returncode == -signal.SIGKILL
    ckpt = os.path.join(tmp_path, "checkpoint")
    assert sorted(os.listdir(ckpt)) == ["step-4", "step-8.partial"]
    p = run(tmp_path, *RESUME)
    assert "step-4" in p.stdout and "resumed from" in p.stdout
    assert not os.path.exists(os.path.join(ckpt, "step-8.partial"))
    assert sorted(os.listdir(ckpt)) == ["step-12", "step-8"]  # keep_latest_k = 2
    resumed = losses(tmp_path)
    for step in range(5, 13):
        assert resumed[step] == uninterrupted[step], step


def _bad(tmp_path, *args, toml_extra=None):
    config = CONFIG
    if toml_extra is not None:
        config = os.path.join(tmp_path, "bad.toml")
        with open(CONFIG) as f, open(config, "w") as g:
            g.write(f.read() + "\n" + toml_extra)
    cmd = [sys.executable, RECIPE, "--job.config_file", config, "--job.dump_folder", str(tmp_path / "out"), *SMALL,
           "--training.steps", "2", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert p.returncode == 2, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    return lines[0]


@pytest.mark.parametrize(
    "args, toml_extra, expect",
    [
        ((), "[moe_echo_typo]\nslots = 3\n", "moe_echo_typo"),
        ((), "[moe_echo]\nslots = 3\n", "not valid TOML"),  # a second [moe_echo] table
        (("--training.stepz", "3"), None, "stepz"),
        (("--training.steps", "ten"), None, "training.steps"),
        (("--moe_echo.capacity_factor", "0.5"), None, "capacity_factor"),
        (("--training.dataset", "local", "--training.dataset_path", "/no/such/data.jsonl"), None, "/no/such/data.jsonl"),
        (("--model.hf_assets_path", "/no/such/tokenizer"), None, "/no/such/tokenizer"),
        (("--model.flavor", "huge"), None, "flavor"),
        (("--moe_echo.dispatcher", "nvlink"), None, "needs CUDA GPUs"),
        (("--training.cuda_graph_warmup", "0"), None, "cuda_graph_warmup"),
    ],
    ids=["unknown_toml_section", "invalid_toml", "unknown_cli_key", "wrong_type", "out_of_range", "missing_data",
         "missing_tokenizer", "unknown_flavor", "nvlink_without_gpus", "graph_warmup"],
)
def test_bad_input_is_one_line_exit_2(tmp_path, args, toml_extra, expect):
    line = _bad(tmp_path, *args, toml_extra=toml_extra)
    assert expect in line


def test_unknown_toml_key_and_wrong_toml_type(tmp_path):
    bad = os.path.join(tmp_path, "bad.toml")
    with open(bad, "w") as f:
        f.write('[training]\nsteps = 2\nlr = 0.1\n')
    p = subprocess.run([sys.executable, RECIPE, "--job.config_file", bad], capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0
    assert "'lr'" in p.stderr and "[training]" in p.stderr
    with open(bad, "w") as f:
        f.write('[training]\nsteps = "two"\n')
    p = subprocess.run([sys.executable, RECIPE, "--job.config_file", bad], capture_output=True, text=True)
    assert p.returncode == 2 and "[training] steps" in p.stderr and "int" in p.stderr


def test_corrupt_checkpoint_is_one_line_error(tmp_path):
    run(tmp_path, "--training.steps", "2", "--checkpoint.interval", "2", "--metrics.enable_tensorboard", "false")
    step_dir = os.path.join(tmp_path, "checkpoint", "step-2")
    data = [f for f in os.listdir(step_dir) if f.endswith(".distcp")]
    assert data
    with open(os.path.join(step_dir, data[0]), "r+b") as f:  # truncate the tensor data
        f.truncate(100)
    with open(os.path.join(step_dir, ".metadata"), "r+b") as f:
        f.write(b"garbage!" * 8)
    line = _bad(tmp_path, "--checkpoint.interval", "2", "--training.steps", "4",
                "--job.dump_folder", str(tmp_path))
    assert "step-2" in line and "could not be loaded" in line
