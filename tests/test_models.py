"""Swap-in: torchtitan deepseek_v3 / qwen3 with our MoE layer; TrainSpec registration."""

import pytest
import torch
import torch.nn.functional as F

from components.moe_echo.config import MoEEchoConfig
from components.moe_echo.layer import MoELayer
from components.moe_echo.models import MODEL_CLASSES, build_model, model_args_for, moe_layers, swap_moe

CASES = [("deepseek_v3", "tiny"), ("qwen3", "tiny_moe")]


@pytest.mark.parametrize("name, flavor", CASES)
def test_forward_backward_with_our_layer(name, flavor):
    model = build_model(name, flavor, MoEEchoConfig(aux_loss_coeff=0.01), seq_len=32, seed=0)
    layers = moe_layers(model)
    assert layers and all(isinstance(m, MoELayer) for _, m in layers)
    tokens = torch.randint(0, 256, (2, 32))
    logits = model(tokens)
    assert logits.shape == (2, 32, model.model_args.vocab_size)
    F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
    for _, moe in layers:
        assert moe.router.gate.weight.grad.abs().max() > 0
        assert moe.experts.w2.grad.abs().max() > 0
        assert moe.tokens_per_expert.sum() == 2 * 32 * moe.router.top_k


@pytest.mark.parametrize("name, flavor", CASES)
def test_swap_keeps_parameters_and_state_dict_keys(name, flavor):
    torch.manual_seed(0)
    args = model_args_for(name, flavor)
    model = MODEL_CLASSES[name](args)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    swap_moe(model, MoEEchoConfig())
    after = model.state_dict()
    assert set(before) == set(after)
    for k in before:
        assert torch.equal(before[k], after[k]), k
    assert all(isinstance(m, MoELayer) for _, m in moe_layers(model))


def test_disabled_keeps_torchtitan_moe():
    from torchtitan.models.moe import MoE

    model = build_model("qwen3", "tiny_moe", MoEEchoConfig(enable=False), seq_len=16, seed=0)
    assert all(type(m) is MoE for _, m in moe_layers(model))


def test_train_spec_registration_builds_swapped_models():
    from torchtitan.protocols.train_spec import get_train_spec

    import components.train.torchtitan_spec as spec_mod

    assert spec_mod.TRAIN_SPECS == ["moe_echo_deepseek_v3", "moe_echo_qwen3"]
    for spec_name, flavor in [("moe_echo_deepseek_v3", "tiny"), ("moe_echo_qwen3", "tiny_moe")]:
        spec = get_train_spec(spec_name)
        args = spec.model_args[flavor]
        if "deepseek" in spec_name:
            args.moe_impl = "standard"  # torchtitan's trainer sets it in update_from_config
        with torch.device("meta"):
            model = spec.model_cls(args)
        assert all(isinstance(m, MoELayer) for _, m in moe_layers(model))
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device("cpu"))
        out = model(torch.randint(0, 256, (1, 8)))
        assert torch.isfinite(out).all()
