"""Fine-tuning on CPU: recipes/finetune.py from a pretrain DCP checkpoint and from HF safetensors
(torchtitan's adapters), the run's own checkpoint winning over initial_load_path, and one-line
errors for a missing option, a missing path and weights of the other model family."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from background import Jobs, Runs
from conftest import ROOT
from run_env import run_env
from test_recipe import CONFIG, SMALL, losses, run

from components.moe_echo.models import build_model
from components.train.config import load_config
from components.train.data import TokenBatchLoader, build_token_stream
from components.train.hf_weights import load_initial_weights
from components.train.tokenizer import build_tokenizer

pytestmark = pytest.mark.slow  # end-to-end runs in subprocesses

FINETUNE = os.path.join(ROOT, "recipes", "finetune.py")
QUIET = ["--metrics.enable_tensorboard", "false", "--metrics.log_freq", "1"]
FAMILIES = {"deepseek_v3": "tiny", "qwen3": "tiny_moe"}


def finetune(dump, *args, check=True):
    cmd = [sys.executable, FINETUNE, "--job.config_file", CONFIG, "--job.dump_folder", str(dump), *SMALL,
           "--training.steps", "3", *QUIET, *args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=run_env(args, OMP_NUM_THREADS="1"), timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}\nstdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}")
    return p


def one_line_error(p) -> str:
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert p.returncode == 2, p.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    return lines[0]


def _cfg(*args):
    return load_config(["--job.config_file", CONFIG, *SMALL, *args])


def _model(cfg, seed, name="deepseek_v3"):
    return build_model(name, FAMILIES[name], cfg.moe_echo, seq_len=cfg.training.seq_len, seed=seed)


def _pretrain(dump):
    run(dump, "--training.steps", "4", "--checkpoint.interval", "4", *QUIET)
    step_dir = os.path.join(dump, "checkpoint", "step-4")
    assert os.path.isfile(os.path.join(step_dir, "COMPLETE"))
    return step_dir


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory, hf_models):
    """This module's launches that need no earlier one, started together in the order the tests read
    them (each spends ~10 s importing on one core); ``launches[name]`` is (result, its folder)."""
    jobs = Jobs(request, tmp_path_factory)
    add = jobs.add

    qwen_folder = hf_models["qwen3"][1]
    add("test_finetune_from_dcp_starts_from_pretrained_weights_and_resume_wins", "pretrained", _pretrain)
    add("test_finetune_from_hf_end_to_end", "from_hf", lambda d: finetune(
        d, "--model.name", "qwen3", "--model.flavor", "tiny_moe", "--checkpoint.initial_load_in_hf", "true",
        "--checkpoint.initial_load_path", qwen_folder))
    add("test_finetune_without_initial_load_path_is_one_line_error", "no_path", lambda d: finetune(d, check=False))
    add("test_finetune_from_missing_path_is_one_line_error", "missing_path", lambda d: finetune(
        d, "--checkpoint.initial_load_path", str(d / "no_such_step-7"), check=False))
    add("test_finetune_from_other_model_family_is_one_line_error", "other_family", lambda d: finetune(
        d, "--checkpoint.initial_load_in_hf", "true", "--checkpoint.initial_load_path", qwen_folder, check=False))
    runs = Runs(jobs)
    yield runs
    runs.close()


@pytest.fixture(scope="module")
def pretrained(launches):
    return launches["pretrained"][0]


def test_finetune_from_dcp_starts_from_pretrained_weights_and_resume_wins(tmp_path, pretrained):
    # the weights load_initial_weights gives == the checkpoint's model tensors, exactly
    cfg = _cfg()
    model = _model(cfg, seed=123)
    assert "DCP" in load_initial_weights(model, pretrained, False, "deepseek_v3")
    dcp_to_torch_save(pretrained, tmp_path / "full.pt")
    saved = torch.load(tmp_path / "full.pt", weights_only=False)["app"]["model"]
    got = model.state_dict()
    assert set(saved) == set(got) and any(k.endswith("moe.expert_bias") for k in got)
    for k in got:
        assert torch.equal(got[k], saved[k]), k
    assert any(float(v.abs().max()) > 0 for k, v in got.items() if k.endswith("expert_bias"))  # trained biases

    # the fine-tune's step-1 loss is these weights' loss on the first batch
    dump = tmp_path / "ft"
    p = finetune(dump, "--checkpoint.initial_load_path", pretrained)
    assert "initial weights:" in p.stdout and "run summary" in p.stdout
    ft = losses(dump)
    assert sorted(ft) == [1, 2, 3]
    t = cfg.training
    tokens = build_token_stream(t.dataset, t.dataset_path, build_tokenizer(cfg.model.hf_assets_path),
                                text_field=t.text_field, max_bytes=t.max_corpus_mb * 1_000_000)
    x, y = TokenBatchLoader(tokens, t.local_batch_size, t.seq_len, rank=0, world_size=1, seed=t.seed).next_batch()
    with torch.no_grad():
        loss = float(F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()))
        fresh = float(F.cross_entropy(_model(cfg, seed=t.seed)(x).flatten(0, 1).float(), y.flatten()))
    assert ft[1] == pytest.approx(loss, rel=1e-5) and abs(fresh - loss) > 0.1

    # a second launch resumes from the fine-tune's own checkpoint, not from initial_load_path
    p = finetune(dump, "--checkpoint.initial_load_path", pretrained, "--training.steps", "4")
    assert "resumed from" in p.stdout and "step-3" in p.stdout and "initial weights" not in p.stdout
    assert sorted(losses(dump)) == [1, 2, 3, 4]


def _adapter(name, model):
    from torchtitan.models.deepseek_v3.model.state_dict_adapter import DeepSeekV3StateDictAdapter
    from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

    cls = {"deepseek_v3": DeepSeekV3StateDictAdapter, "qwen3": Qwen3StateDictAdapter}[name]
    return cls(model.model_args, None)


def _save_hf(model, name, folder, shards=1):
    """HF safetensors of ``model`` via torchtitan's adapter: one file, or ``shards`` files + index."""
    hf = {k: v.contiguous().clone() for k, v in _adapter(name, model).to_hf(model.state_dict()).items()}
    os.makedirs(folder, exist_ok=True)
    if shards == 1:
        save_file(hf, os.path.join(folder, "model.safetensors"))
        return folder
    keys = sorted(hf)
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[i::shards]
        save_file({k: hf[k] for k in part}, os.path.join(folder, fname))
        weight_map.update({k: fname for k in part})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return folder


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """(original model, safetensors dir) per family; deepseek in one file, qwen3 in 3 shards."""
    cfg = _cfg()
    out = {}
    for name in FAMILIES:
        model = _model(cfg, seed=7, name=name)
        with torch.no_grad():
            for k, b in model.named_buffers():
                if k.endswith("expert_bias"):
                    b.uniform_(-1, 1)
        folder = str(tmp_path_factory.mktemp(f"hf_{name}"))
        out[name] = (model, _save_hf(model, name, folder, shards=1 if name == "deepseek_v3" else 3))
    return out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_hf_safetensors_round_trip_is_exact(hf_models, name):
    original, folder = hf_models[name]
    model = _model(_cfg(), seed=99, name=name)
    desc = load_initial_weights(model, folder, True, name)
    assert "safetensors" in desc
    want = dict(original.named_parameters())
    for k, p in model.named_parameters():
        assert torch.equal(p, want[k]), k
    if name == "deepseek_v3":  # e_score_correction_bias carries the router bias; Qwen3 has none
        for k, b in model.named_buffers():
            if k.endswith("expert_bias"):
                assert torch.equal(b, dict(original.named_buffers())[k]), k


def test_finetune_from_hf_end_to_end(launches):
    p, dump = launches["from_hf"]
    assert "initial weights:" in p.stdout and "safetensors" in p.stdout and "run summary" in p.stdout
    assert sorted(losses(dump)) == [1, 2, 3]


def test_finetune_without_initial_load_path_is_one_line_error(launches):
    line = one_line_error(launches["no_path"][0])
    assert "--checkpoint.initial_load_path" in line


def test_finetune_from_missing_path_is_one_line_error(launches):
    p, dump = launches["missing_path"]
    missing = str(dump / "no_such_step-7")
    line = one_line_error(p)
    assert missing in line


def test_finetune_from_other_model_family_is_one_line_error(launches, hf_models):
    _, qwen_folder = hf_models["qwen3"]  # into the config's deepseek_v3/tiny
    p, _ = launches["other_family"]
    line = one_line_error(p)
    assert qwen_folder in line and "deepseek_v3" in line
    assert "Traceback" not in p.stderr
