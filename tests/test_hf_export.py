"""HF safetensors export (``[checkpoint] last_save_in_hf``): ``export_hf`` then
``load_initial_weights(..., in_hf=True)`` gives back the model state — bit-identical in float32,
rounded in bfloat16 —, for deepseek_v3 and qwen3, in one file or in shards; bad input and failed
writes are one-line UserErrors and leave no half-written folder."""

import json
import os

import pytest
import torch
from safetensors import safe_open

from conftest import ROOT

from components.errors import UserError
from components.moe_echo.models import build_model
from components.train.config import load_config
from components.train.hf_weights import export_hf, load_initial_weights

CONFIG = os.path.join(ROOT, "train_configs", "debug_cpu.toml")
FAMILIES = {"deepseek_v3": "tiny", "qwen3": "tiny_moe"}


def _model(name, seed):
    cfg = load_config(["--job.config_file", CONFIG])
    return build_model(name, FAMILIES[name], cfg.moe_echo, seq_len=64, seed=seed)


def _trained(name, seed=7, bias=True):
    """A model whose every float tensor is random (as after training), router biases included."""
    model = _model(name, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, t in model.state_dict().items():
            if t.is_floating_point() and (bias or not key.endswith("expert_bias")):
                t.copy_(torch.randn(t.shape, generator=g) * 0.3)
    if bias:
        assert all(v.abs().min() > 0 for k, v in model.state_dict().items() if k.endswith("moe.expert_bias"))
    return model


def _hf_files(folder):
    return sorted(os.listdir(folder))


def _hf_keys(folder):
    keys = {}
    for f in _hf_files(folder):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(folder, f), "pt") as st:
                keys.update({k: st.get_slice(k).get_dtype() for k in st.keys()})
    return keys


def _reloaded(name, folder):
    fresh = _model(name, seed=99)
    desc = load_initial_weights(fresh, folder, True, name)
    assert "safetensors" in desc
    return fresh


@pytest.mark.parametrize("name", list(FAMILIES))
def test_float32_export_reloads_bit_identical(tmp_path, name):
    original = _trained(name)
    folder = str(tmp_path / "step-5-hf")
    assert export_hf(original, folder, name) == folder
    assert _hf_files(folder) == ["model.safetensors"] and _hf_files(tmp_path) == ["step-5-hf"]  # no .partial
    keys = _hf_keys(folder)
    assert set(keys.values()) == {"F32"}
    # the router bias travels as e_score_correction_bias (DeepSeek's name; Qwen3's adapter has none)
    n_moe = sum(k.endswith("moe.expert_bias") for k in original.state_dict())
    assert sum(k.endswith("mlp.gate.e_score_correction_bias") for k in keys) == n_moe > 0

    fresh = _reloaded(name, folder)
    want, got = original.state_dict(), fresh.state_dict()
    assert set(want) == set(got)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    assert not all(torch.equal(v, _model(name, seed=99).state_dict()[k]) for k, v in want.items())


def test_qwen3_without_router_bias_exports_only_standard_hf_names(tmp_path):
    original = _trained("qwen3", bias=False)
    folder = export_hf(original, str(tmp_path / "hf"), "qwen3")
    assert not any("e_score_correction_bias" in k for k in _hf_keys(folder))
    got = _reloaded("qwen3", folder).state_dict()
    for k, v in original.state_dict().items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("name", list(FAMILIES))
def test_bfloat16_export_reloads_the_rounded_weights(tmp_path, name):
    original = _trained(name)
    folder = export_hf(original, str(tmp_path / "hf"), name, "bfloat16")
    assert set(_hf_keys(folder).values()) == {"BF16"}
    got = _reloaded(name, folder).state_dict()
    rounded_somewhere = False
    for k, w in original.state_dict().items():
        assert got[k].dtype == w.dtype, k
        assert torch.equal(got[k], w.bfloat16().float()), k
        rounded_somewhere |= not torch.equal(got[k], w)
    assert rounded_somewhere


def test_large_export_is_sharded_with_index(tmp_path):
    original = _trained("deepseek_v3")
    total = sum(v.numel() * 4 for v in original.state_dict().values())
    folder = export_hf(original, str(tmp_path / "hf"), "deepseek_v3", max_shard_bytes=total // 3)
    files = _hf_files(folder)
    shards = [f for f in files if f.endswith(".safetensors")]
    assert "model.safetensors.index.json" in files and len(shards) >= 3
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert sorted(set(index["weight_map"].values())) == shards and set(index["weight_map"]) == set(_hf_keys(folder))
    got = _reloaded("deepseek_v3", folder).state_dict()
    for k, v in original.state_dict().items():
        assert torch.equal(got[k], v), k


def test_export_replaces_an_older_export_and_partial_leftovers(tmp_path):
    folder = str(tmp_path / "hf")
    export_hf(_trained("deepseek_v3", seed=1), folder, "deepseek_v3", max_shard_bytes=1 << 16)  # shards
    os.makedirs(folder + ".partial")  # a killed export
    newer = _trained("deepseek_v3", seed=2)
    export_hf(newer, folder, "deepseek_v3")
    assert _hf_files(folder) == ["model.safetensors"] and _hf_files(tmp_path) == ["hf"]
    got = _reloaded("deepseek_v3", folder).state_dict()
    for k, v in newer.state_dict().items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("dtype", ["fp32", "int8", "float64", ""])
def test_bad_export_dtype_is_one_line_user_error(tmp_path, dtype):
    with pytest.raises(UserError) as err:
        export_hf(_model("deepseek_v3", 0), str(tmp_path / "hf"), "deepseek_v3", dtype)
    msg = str(err.value)
    assert "\n" not in msg and "export_dtype" in msg and repr(dtype) in msg and "'bfloat16'" in msg
    assert not os.listdir(tmp_path)


def test_unknown_model_family_is_one_line_user_error(tmp_path):
    with pytest.raises(UserError) as err:
        export_hf(_model("deepseek_v3", 0), str(tmp_path / "hf"), "llama3")
    msg = str(err.value)
    assert "\n" not in msg and "last_save_in_hf" in msg and "'llama3'" in msg
    assert not os.listdir(tmp_path)


def test_failed_write_is_one_line_user_error(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    folder = str(blocker / "step-3-hf")
    with pytest.raises(UserError) as err:
        export_hf(_model("qwen3", 0), folder, "qwen3")
    msg = str(err.value)
    assert "\n" not in msg and folder in msg and "last_save_in_hf" in msg
