"""Every shipped train config parses and validates; its model flavour builds on the meta device."""

import glob
import os

import pytest
import torch

from components.moe_echo.models import MODEL_CLASSES, model_args_for, moe_layers, swap_moe
from components.train.config import load_config
from conftest import ROOT

CONFIGS = sorted(glob.glob(os.path.join(ROOT, "train_configs", "*.toml")))


@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.basename(p) for p in CONFIGS])
def test_config_loads_and_model_builds_on_meta(path):
    cfg = load_config(["--job.config_file", path])
    with torch.device("meta"):
        model = MODEL_CLASSES[cfg.model.name](model_args_for(cfg.model.name, cfg.model.flavor))
    swap_moe(model, cfg.moe_echo)
    assert moe_layers(model)
    n = sum(p.numel() for p in model.parameters())
    if "1b" in os.path.basename(path) or "30b" in os.path.basename(path):
        assert 0.9e9 < n < 1.6e9, n  # the ~1B one-GPU configs
    if "6b" in os.path.basename(path):
        assert 6.0e9 < n < 7.2e9, n  # the ~6.6B two-GPU config


def test_echo_takes_true_false_auto_and_a_bare_flag():
    base = ["--job.config_file", os.path.join(ROOT, "train_configs", "debug_cpu.toml")]
    assert load_config(base).moe_echo.echo == "auto"  # EP=1: ECHO stays off (parallelize resolves it)
    ep2 = base + ["--parallelism.expert_parallel_degree", "2"]
    for args, want in ((["--moe_echo.echo"], True), (["--moe_echo.echo", "true"], True),
                       (["--moe_echo.echo", "false"], False), (["--moe_echo.echo", "auto"], "auto"),
                       (["--moe_echo.echo", "--training.steps", "3"], True)):
        assert load_config(ep2 + args).moe_echo.echo == want, args
    from components.errors import UserError

    with pytest.raises(UserError, match=r"--moe_echo.echo 'sometimes' is not valid.*bool or 'auto'"):
        load_config(ep2 + ["--moe_echo.echo", "sometimes"])
    with pytest.raises(UserError, match="echo = true needs"):
        load_config(base + ["--moe_echo.echo", "true"])
    with pytest.raises(UserError, match="--moe_echo.overlap_chunks needs a value"):
        load_config(ep2 + ["--moe_echo.overlap_chunks"])


def test_fp8_weight_gradients_need_fp8_experts():
    from components.errors import UserError

    base = ["--job.config_file", os.path.join(ROOT, "train_configs", "debug_cpu.toml")]
    with pytest.raises(UserError, match="expert_wgrad_precision = 'fp8' needs expert_precision = 'fp8'") as err:
        load_config(base + ["--moe_echo.expert_wgrad_precision", "fp8"])
    assert "\n" not in str(err.value)
    cfg = load_config(base + ["--moe_echo.expert_wgrad_precision", "fp8", "--moe_echo.expert_precision", "fp8"])
    assert cfg.moe_echo.expert_wgrad_precision == "fp8"
