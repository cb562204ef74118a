"""[model] shape keys (n_layers, dim, num_experts, top_k, ...): they change the built model as
counted by hand, bad values are one-line errors naming the key, a checkpoint keeps the shape it
was saved with (a resume or fine-tune with another shape is refused, naming the key); "did you
mean" for typos; --help marks refused keys and describes every key in full."""

import json
import os
import subprocess
import sys

import pytest

from components.errors import UserError
from components.moe_echo.config import MoEEchoConfig
from components.moe_echo.models import build_model, shape_overrides
from components.train.config import help_text, load_config
from conftest import ROOT
from run_env import run_env

CONFIG = os.path.join(ROOT, "train_configs", "debug_cpu.toml")


def _deepseek_params(a) -> int:
    """torchtitan's DeepSeek-V3 with our MoE layer, q_lora_rank 0 (as the tiny flavour)."""
    qk, nope, rope, v, kv = 48, 32, 16, 32, 64  # the tiny flavour's MLA head sizes
    attn = (a["dim"] * a["n_heads"] * qk + a["dim"] * (kv + rope) + kv + kv * a["n_heads"] * (nope + v)
            + a["n_heads"] * v * a["dim"])
    norms = 2 * a["dim"]
    dense = 3 * a["dim"] * a["inter_dim"]
    moe = (a["dim"] * a["num_experts"] + 3 * a["num_experts"] * a["dim"] * a["moe_inter_dim"]
           + 3 * a["dim"] * a["moe_inter_dim"] * a["num_shared_experts"])
    blocks = a["n_dense_layers"] * (attn + norms + dense) + (a["n_layers"] - a["n_dense_layers"]) * (attn + norms + moe)
    return 2 * a["vocab_size"] * a["dim"] + a["dim"] + blocks


def _qwen3_params(a) -> int:
    """torchtitan's Qwen3 with our MoE layer in every block (no shared experts in tiny_moe)."""
    hd = a["head_dim"]
    attn = a["dim"] * hd * (2 * a["n_heads"] + 2 * a["n_kv_heads"]) + 2 * hd
    moe = a["dim"] * a["num_experts"] + 3 * a["num_experts"] * a["dim"] * a["moe_inter_dim"]
    return 2 * a["vocab_size"] * a["dim"] + a["dim"] + a["n_layers"] * (attn + 2 * a["dim"] + moe)


TINY = {"vocab_size": 512, "dim": 128, "n_layers": 4, "n_dense_layers": 1, "n_heads": 4, "inter_dim": 384,
        "moe_inter_dim": 128, "num_experts": 8, "num_shared_experts": 1, "top_k": 2}
TINY_MOE = {"vocab_size": 512, "dim": 128, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "head_dim": 32,
            "moe_inter_dim": 128, "num_experts": 8, "num_shared_experts": 0, "top_k": 2,
            "inter_dim": 384}  # hidden_dim: unused (every block is MoE), recorded all the same
CASES = {
    "deepseek_v3": ("tiny", TINY, _deepseek_params,
                    {"n_layers": 6, "n_dense_layers": 2, "dim": 64, "n_heads": 2, "inter_dim": 160, "vocab_size": 384,
                     "moe_inter_dim": 96, "num_experts": 16, "num_shared_experts": 2, "top_k": 4}),
    "qwen3": ("tiny_moe", TINY_MOE, _qwen3_params,
              {"n_layers": 2, "dim": 96, "n_heads": 6, "n_kv_heads": 3, "head_dim": 16, "moe_inter_dim": 48,
               "num_experts": 12, "top_k": 3}),
}


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(CASES))
def test_shape_keys_change_the_built_model_as_counted_by_hand(name):
    flavor, base, count, over = CASES[name]
    args = [f"--model.{k}={v}" for k, v in over.items()]
    cfg = load_config(["--model.name", name, "--model.flavor", flavor, *args])
    assert shape_overrides(cfg.model) == over
    plain = build_model(name, flavor, MoEEchoConfig(), seq_len=16, seed=0)
    shaped = build_model(name, flavor, MoEEchoConfig(), seq_len=16, seed=0, overrides=shape_overrides(cfg.model))
    assert _count(plain) == count(base)
    assert _count(shaped) == count({**base, **over}) != count(base)
    assert len(shaped.layers) == over["n_layers"]
    assert shaped.model_shape == {"name": name, "flavor": flavor, **base, **over}
    moe = [blk.moe for blk in shaped.layers.values() if getattr(blk, "moe_enabled", False)]
    assert moe and all(m.router.top_k == over["top_k"] for m in moe)


def test_shape_keys_from_toml(tmp_path):
    toml = tmp_path / "shaped.toml"
    toml.write_text('[model]\nflavor = "tiny"\nn_layers = 3\ntop_k = 1\n')
    m = load_config(["--job.config_file", str(toml), "--model.n_layers", "5"]).model
    assert (m.n_layers, m.top_k, m.dim) == (5, 1, None)  # the CLI wins over the file; unset keys stay None


BAD = {  # id: (args, expected in the one-line message)
    "zero_layers": (("--model.n_layers", "0"), "[model] n_layers = 0 is out of range; expected >= 1"),
    "top_k_over_experts": (("--model.top_k", "9"), "[model] top_k = 9 is out of range"),
    "experts_under_top_k": (("--model.num_experts", "4", "--model.top_k", "6"), "[model] top_k = 6"),
    "experts_below_flavour_top_k": (("--model.num_experts", "1"), "[model] num_experts = 1"),
    "unaligned_dim": (("--model.dim", "100"), "[model] dim = 100 is out of range; expected a multiple of 16"),
    "no_moe_layer": (("--model.n_dense_layers", "4"), "[model] n_dense_layers = 4"),
    "negative_shared": (("--model.num_shared_experts", "-1"), "[model] num_shared_experts = -1"),
    "kv_heads_on_deepseek": (("--model.n_kv_heads", "2"), "[model] n_kv_heads applies to qwen3 models only"),
    "kv_heads_not_dividing": (("--model.name", "qwen3", "--model.flavor", "tiny_moe", "--model.n_kv_heads", "3"),
                              "[model] n_kv_heads = 3"),
    "dense_width_on_all_moe": (("--model.name", "qwen3", "--model.flavor", "tiny_moe", "--model.inter_dim", "64"),
                               "[model] inter_dim sizes dense FFN layers"),
    "wrong_type": (("--model.n_layers", "six"), "--model.n_layers 'six' is not valid"),
    "unknown_key": (("--model.n_layer", "6"), "did you mean 'n_layers'?"),
    "hot_experts_past_shape": (("--model.num_experts", "4", "--moe_echo.debug_hot_experts", "6"),
                               "debug_hot_experts = 6 is out of range; expected in [0, 4]"),
    "flavour_typo": (("--model.flavor", "v2lite_1"), "did you mean 'v2lite_1b'?"),
    "flavour_typo_spaced": (("--model.flavor", "v2lite_1 b"), "did you mean 'v2lite_1b'?"),
    "flavour_split_by_space": (("--model.flavor", "v2lite_1", "b"), "did you mean --model.flavor 'v2lite_1b'?"),
    "flavour_of_other_family": (("--model.flavor", "tiny_moe"), "set [model] name = 'qwen3'"),
    "name_typo": (("--model.name", "deepseek_v2"), "did you mean 'deepseek_v3'?"),
    "choice_typo": (("--moe_echo.dispatcher", "alltoal"), "did you mean 'alltoall'?"),
    "reduce_dtype_typo": (("--training.mixed_precision_reduce", "bfloat"), "did you mean 'bfloat16'?"),
    "tensor_parallel": (("--parallelism.tensor_parallel_degree", "2"),
                        "not supported by this recipe: [parallelism] tensor_parallel_degree = 2 (tensor parallelism"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_value_is_one_line_error_naming_the_key(case):
    args, expected = BAD[case]
    with pytest.raises(UserError) as err:
        load_config(list(args))
    message = str(err.value)
    assert "\n" not in message and expected in message, message


@pytest.mark.parametrize("text, expected", [
    ("[modle]\nname = 'qwen3'\n", "did you mean 'model'?"),
    ("[model]\nn_layer = 3\n", "did you mean 'n_layers'?"),
    ("[model]\nflavor = 'v2lite_1'\n", "did you mean 'v2lite_1b'?"),
    ("[moe_echo]\ndispatcher = 'paded'\n", "did you mean 'padded'?"),
])
def test_toml_typos_get_did_you_mean(tmp_path, text, expected):
    (tmp_path / "t.toml").write_text(text)
    with pytest.raises(UserError, match="did you mean") as err:
        load_config(["--job.config_file", str(tmp_path / "t.toml")])
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_help_marks_refused_keys_and_describes_every_key_in_full():
    text = help_text(["--model.flavor", "v2lite_1b", "--model.n_layers", "6"])
    lines = text.splitlines()
    assert "…" not in text and not any(line.rstrip().endswith(" ...") for line in lines)
    assert "(no description)" not in text
    for key in ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree",
                "expert_tensor_parallel_degree"):
        i = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{key} = "))
        assert lines[i].endswith("[refused]") and lines[i + 1].strip().startswith("Refused: "), lines[i:i + 2]
    assert not any(line.strip().startswith("expert_parallel_degree = ") and "[refused]" in line for line in lines)
    # the end of a long torchtitan description (cut at 160 characters before), on wrapped lines of <= 100
    assert "the third containing layers.3 and layers.4" in " ".join(line.strip() for line in lines)
    assert max(len(line) for line in lines if line.startswith("      ")) <= 100
    # shape keys: the value given, or the flavour's; the flavours are listed
    assert "  n_layers = 6 (int or none)" in text
    assert "  dim = None (int or none; flavour 'v2lite_1b': 2048)" in text
    assert "v2lite_1b" in text and "30b_a3b_small" in text


RECIPE = os.path.join(ROOT, "recipes", "pretrain.py")
FINETUNE = os.path.join(ROOT, "recipes", "finetune.py")
SMALL = ["--training.max_corpus_mb", "1", "--training.seq_len", "32", "--training.local_batch_size", "4",
         "--metrics.enable_tensorboard", "false", "--checkpoint.interval", "2"]


def _launch(recipe, dump, *args) -> subprocess.Popen:
    cmd = [sys.executable, recipe, "--job.config_file", CONFIG, "--job.dump_folder", str(dump), *SMALL, *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=run_env(args, OMP_NUM_THREADS="1"))


def _finish(p: subprocess.Popen) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=300)
    return p.returncode, out, err


@pytest.mark.slow
def test_checkpoint_keeps_its_shape_resume_or_finetune_with_another_is_refused(tmp_path):
    """Saved with n_layers = 3: the same shape resumes; n_layers = 4 (a resume, or a fine-tune from the
    checkpoint) stops with one line naming the key and the value to set."""
    dump = tmp_path / "run"
    rc, out, err = _finish(_launch(RECIPE, dump, "--model.n_layers", "3", "--training.steps", "2"))
    assert rc == 0, err[-3000:]
    step2 = os.path.join(dump, "checkpoint", "step-2")
    with open(os.path.join(step2, "COMPLETE")) as f:
        assert json.load(f)["model"] == {"name": "deepseek_v3", "flavor": "tiny", **TINY, "n_layers": 3}
    same = _launch(RECIPE, dump, "--model.n_layers", "3", "--training.steps", "3")
    other = _launch(RECIPE, dump, "--training.steps", "4")  # the flavour's 4 layers
    finetune = _launch(FINETUNE, tmp_path / "ft", "--training.steps", "2", "--checkpoint.initial_load_path", step2)
    rc, out, err = _finish(same)
    assert rc == 0 and "resumed from" in out, err[-3000:]
    for p, what in ((other, "checkpoint"), (finetune, "[checkpoint] initial_load_path")):
        rc, out, err = _finish(p)
        lines = [line for line in err.splitlines() if line.strip()]
        assert rc == 2 and len(lines) == 1, err[-3000:]
        assert lines[0].startswith(f"error: {what}") and "[model] n_layers = 3 (the config asks for 4);" in lines[0]
        assert "--model.n_layers 3" in lines[0], lines[0]


class _Holder:
    """A Stateful holding a model, as the recipe's model-and-optimizer state does."""

    def __init__(self, model):
        self.model = model

    def state_dict(self):
        return {"model": self.model.state_dict()}

    def load_state_dict(self, sd):
        self.model.load_state_dict(sd["model"])


def test_checkpoint_load_refuses_another_shape_naming_every_differing_key(tmp_path):
    from components.train import checkpoint

    def tiny(**over):
        return build_model("deepseek_v3", "tiny", MoEEchoConfig(), seq_len=16, seed=0, overrides=over)

    path = checkpoint.save(str(tmp_path), 2, {"app": _Holder(tiny(n_layers=3))})
    assert checkpoint.saved_model_shape(path)["n_layers"] == 3
    checkpoint.load(path, {"app": _Holder(tiny(n_layers=3))})  # the same shape loads
    with pytest.raises(UserError) as err:
        checkpoint.load(path, {"app": _Holder(tiny(top_k=1))})
    message = str(err.value)
    assert "\n" not in message
    assert "[model] n_layers = 3 (the config asks for 4), top_k = 2 (the config asks for 1)" in message
    assert "set --model.n_layers 3 --model.top_k 2" in message
