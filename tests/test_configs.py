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
