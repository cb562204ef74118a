"""torchtitan 0.2.2 models (deepseek_v3, qwen3) carrying moe-echo's MoE layer.

- ``swap_moe(model, cfg)`` replaces every ``block.moe`` of a built torchtitan model with a
  ``MoELayer`` of the same hyper-parameters; parameters already initialised are carried over, so
  the swapped model computes the same function (test: tests/test_models.py).
- ``FLAVORS`` adds moe-echo's own flavours next to torchtitan's (tiny CPU model, ~1B one-GPU
  model, small Qwen3-30B-A3B-shaped model).
- ``build_model`` builds (optionally on the meta device) and swaps.

The TrainSpecs that run these models in torchtitan's own trainer (with our expert parallelism)
live in components/train/torchtitan_spec.py: they need components/parallel, a floor above this one.
"""

import copy
import dataclasses

import torch
from torch import nn
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3ModelArgs, deepseekv3_args
from torchtitan.models.moe import MoEArgs
from torchtitan.models.qwen3 import Qwen3Model, Qwen3ModelArgs, qwen3_args

from .config import MoEEchoConfig
from .layer import MoELayer

MODEL_CLASSES = {"deepseek_v3": DeepSeekV3Model, "qwen3": Qwen3Model}

_OUR_DEEPSEEK = {
    # ~1.5M params: the CPU main job. Byte tokenizer (258 ids) fits vocab 512.
    "tiny": DeepSeekV3ModelArgs(
        vocab_size=512, dim=128, inter_dim=384, moe_inter_dim=128, n_layers=4, n_dense_layers=1,
        n_heads=4, q_lora_rank=0, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, max_seq_len=1024,
        moe_args=MoEArgs(num_experts=8, num_shared_experts=1, top_k=2, score_func="sigmoid",
                         route_norm=True, score_before_experts=False),
    ),
    # DeepSeek-V2-Lite-like at ~1.1B total params for one GPU: dim 2048, 64 experts top-6, 2 shared.
    "v2lite_1b": DeepSeekV3ModelArgs(
        vocab_size=32768, dim=2048, inter_dim=10944, moe_inter_dim=768, n_layers=4, n_dense_layers=1,
        n_heads=16, q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, mscale=0.70, max_seq_len=4096,
        moe_args=MoEArgs(num_experts=64, num_shared_experts=2, top_k=6, score_func="softmax",
                         route_norm=False, score_before_experts=False),
    ),
}
_OUR_QWEN3 = {
    "tiny_moe": Qwen3ModelArgs(
        vocab_size=512, max_seq_len=1024, head_dim=32, dim=128, n_layers=3, n_heads=4, n_kv_heads=2,
        qk_norm=True, hidden_dim=384, moe_enabled=True, moe_inter_dim=128,
        moe_args=MoEArgs(num_experts=8, num_shared_experts=0, top_k=2, score_func="softmax",
                         route_norm=True, score_before_experts=False),
    ),
    # Qwen3-30B-A3B layer shape (128 experts top-8, hidden 768, dim 2048), 2 layers: ~1.4B total.
    "30b_a3b_small": Qwen3ModelArgs(
        vocab_size=32768, max_seq_len=4096, head_dim=128, dim=2048, n_layers=2, n_heads=32,
        n_kv_heads=4, qk_norm=True, hidden_dim=6144, moe_enabled=True, moe_inter_dim=768,
        moe_args=MoEArgs(num_experts=128, num_shared_experts=0, top_k=8, score_func="softmax",
                         route_norm=True, score_before_experts=False),
    ),
}
# The v2lite_1b block at DeepSeek-V2-Lite's expert width (1408), 12 layers: ~6.6B total, ~1B active,
# sized to fill 4 GPUs at EP=4 (the scaling runs).
_OUR_DEEPSEEK["v2lite_6b"] = dataclasses.replace(_OUR_DEEPSEEK["v2lite_1b"], moe_inter_dim=1408, n_layers=12)
FLAVORS = {
    "deepseek_v3": {**deepseekv3_args, **_OUR_DEEPSEEK},
    "qwen3": {**qwen3_args, **_OUR_QWEN3},
}


def model_args_for(name: str, flavor: str):
    """A private copy of the flavour's args (callers may edit it)."""
    args = copy.deepcopy(FLAVORS[name][flavor])
    if isinstance(args, DeepSeekV3ModelArgs):
        args.moe_impl = "standard"  # torchtitan sets this in update_from_config
    return args


def is_moe_block(block: nn.Module) -> bool:
    return bool(getattr(block, "moe_enabled", False)) and hasattr(block, "moe")


def moe_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(block name, moe module) of every MoE block, in layer order."""
    return [(name, blk.moe) for name, blk in model.layers.items() if is_moe_block(blk)]


def swap_moe(model: nn.Module, cfg: MoEEchoConfig | None = None) -> nn.Module:
    """Replace each torchtitan ``MoE`` in ``model.layers`` with a ``MoELayer`` (in place)."""
    cfg = cfg or MoEEchoConfig()
    moe_args = model.model_args.moe_args
    for block in model.layers.values():
        if not is_moe_block(block) or isinstance(block.moe, MoELayer):
            continue
        old = block.moe
        E, H, D = old.experts.w1.shape
        with torch.device(old.experts.w1.device):
            new = MoELayer(moe_args, D, H, cfg)
        if old.experts.w1.device.type != "meta":
            new.load_state_dict(old.state_dict(), strict=False)
            new.to(old.experts.w1.dtype)
            new.expert_bias.data = new.expert_bias.float()
            new.tokens_per_expert.data = new.tokens_per_expert.float()
        new.train(old.training)
        block.moe = new
    return model


def build_model(name: str, flavor: str, cfg: MoEEchoConfig, seq_len: int | None = None,
                device: torch.device | str = "cpu", seed: int | None = None) -> nn.Module:
    """Build torchtitan's ``name``/``flavor`` with our MoE swapped in, initialised on ``device``."""
    args = model_args_for(name, flavor)
    if seq_len is not None:
        args.max_seq_len = max(seq_len, getattr(args, "max_seq_len", seq_len))
    with torch.device("meta"):
        model = MODEL_CLASSES[name](args)
    if cfg.enable:
        swap_moe(model, cfg)
    model.to_empty(device=device)
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device(device))
    return model
