"""torchtitan 0.2.2 models (deepseek_v3, qwen3) carrying moe-echo's MoE layer.

- ``swap_moe(model, cfg)`` replaces every ``block.moe`` of a built torchtitan model with a
  ``MoELayer`` of the same hyper-parameters; parameters already initialised are carried over, so
  the swapped model computes the same function (test: tests/test_models.py).
- ``FLAVORS`` adds moe-echo's own flavours next to torchtitan's (tiny CPU model, ~1B one-GPU
  model, small Qwen3-30B-A3B-shaped model).
- ``SHAPE_KEYS``: the ``[model]`` keys that override a flavour's dimensions (layers, widths,
  experts, top-k); ``model_args_for(name, flavor, overrides)`` applies them.
- ``build_model`` builds (optionally on the meta device) and swaps; the model's ``model_shape``
  records its name, flavour and dimensions (checkpoints save it, so a resume rebuilds that model).

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


# [model] key -> {model name: attribute path in its args}; torchtitan's names (Qwen3 calls its dense
# FFN width hidden_dim). A key absent for a model does not apply to it.
SHAPE_KEYS: dict[str, dict[str, str]] = {
    "vocab_size": {"deepseek_v3": "vocab_size", "qwen3": "vocab_size"},
    "dim": {"deepseek_v3": "dim", "qwen3": "dim"},
    "n_layers": {"deepseek_v3": "n_layers", "qwen3": "n_layers"},
    "n_dense_layers": {"deepseek_v3": "n_dense_layers"},
    "n_heads": {"deepseek_v3": "n_heads", "qwen3": "n_heads"},
    "n_kv_heads": {"qwen3": "n_kv_heads"},
    "head_dim": {"qwen3": "head_dim"},
    "inter_dim": {"deepseek_v3": "inter_dim", "qwen3": "hidden_dim"},
    "moe_inter_dim": {"deepseek_v3": "moe_inter_dim", "qwen3": "moe_inter_dim"},
    "num_experts": {"deepseek_v3": "moe_args.num_experts", "qwen3": "moe_args.num_experts"},
    "num_shared_experts": {"deepseek_v3": "moe_args.num_shared_experts", "qwen3": "moe_args.num_shared_experts"},
    "top_k": {"deepseek_v3": "moe_args.top_k", "qwen3": "moe_args.top_k"},
}


def shape_overrides(model_cfg) -> dict[str, int]:
    """The shape keys a ``[model]`` config section sets (None: the flavour's value)."""
    return {k: v for k in SHAPE_KEYS if (v := getattr(model_cfg, k, None)) is not None}


def _get(args, path: str):
    for part in path.split("."):
        args = getattr(args, part)
    return args


def _set(args, path: str, value) -> None:
    *parents, last = path.split(".")
    for part in parents:
        args = getattr(args, part)
    setattr(args, last, value)


def shape_of(name: str, args) -> dict[str, int]:
    """Every shape key that applies to ``name``, with its value in ``args``."""
    return {k: _get(args, paths[name]) for k, paths in SHAPE_KEYS.items() if name in paths}


def model_args_for(name: str, flavor: str, overrides: dict | None = None):
    """A private copy of the flavour's args (callers may edit it), with the ``SHAPE_KEYS`` in
    ``overrides`` applied (a key that does not apply to ``name`` is a ``KeyError``)."""
    args = copy.deepcopy(FLAVORS[name][flavor])
    if isinstance(args, DeepSeekV3ModelArgs):
        args.moe_impl = "standard"  # torchtitan sets this in update_from_config
    for key, value in (overrides or {}).items():
        _set(args, SHAPE_KEYS[key][name], value)
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
                device: torch.device | str = "cpu", seed: int | None = None,
                overrides: dict | None = None) -> nn.Module:
    """Build torchtitan's ``name``/``flavor`` (with the ``SHAPE_KEYS`` in ``overrides``) with our MoE
    swapped in, initialised on ``device``; ``model.model_shape`` says which model it is."""
    args = model_args_for(name, flavor, overrides)
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
    model.model_shape = {"name": name, "flavor": flavor, **shape_of(name, args)}
    return model
