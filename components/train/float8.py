"""FP8 training of the dense linear layers through torchao, the way torchtitan does it.

    [model]
    converters = ["float8"]            # or torchtitan 0.2's name, "quantize.linear.float8"
    [quantize.linear.float8]
    recipe_name = "rowwise"            # torchao's recipes: "tensorwise" (default), "rowwise", "rowwise_with_gw_hp"
    filter_fqns = ["output"]           # linear layers left in bf16 (default: the output head)
    emulate = false                    # true: FP8 emulated in higher precision (CPU tests; not with compile)

Every ``nn.Linear`` of the model whose name matches none of ``filter_fqns`` and whose both dimensions
are multiples of 16 becomes torchao's ``Float8Linear`` before parallelisation: attention projections,
dense feed-forwards and the shared experts. Same parameters, same names (checkpoints load either way);
the forward and both backward GEMMs run in FP8 with scales computed on the device. The routers' gates
always stay as they are (top-k is decided on their logits). The routed experts follow the same switch
through their own key: ``[moe_echo] expert_precision`` becomes "fp8" unless the config sets it (or
``emulate`` is on: the FP8 experts have no emulation).
"""

import dataclasses

import torch
from torch import nn

from components.errors import UserError

NAMES = ("float8", "quantize.linear.float8")  # torchtitan's older and 0.2 names of the converter
ALWAYS_KEPT = ("router.gate",)  # routing decisions stay on unquantised logits
DEFAULT_KEPT = ("output",)  # where filter_fqns is empty: the output head


def requested(cfg) -> bool:
    """True where ``[model] converters`` asks for float8; one-line error for a converter this recipe lacks."""
    unknown = [c for c in cfg.model.converters if c not in NAMES]
    if unknown:
        raise UserError(f"[model] converters = {cfg.model.converters!r}: {unknown[0]!r} is not applied by this "
                        f"recipe; the one it applies is \"float8\" (FP8 linear layers through torchao)")
    return bool(cfg.model.converters)


def check_float8(cfg, device: torch.device) -> None:
    """One-line error where float8 cannot run: torchao missing, a GPU below compute capability 8.9 (or no
    GPU) without ``emulate``, or ``emulate`` with torch.compile."""
    f8 = cfg.quantize.linear.float8
    try:
        import torchao.float8  # noqa: F401  (imported to check that it is installed)
    except ImportError:
        raise UserError('[model] converters = ["float8"] needs torchao: pip install "moe-echo[float8]"') from None
    compiled = cfg.compile.enable and "model" in cfg.compile.components
    if f8.emulate:
        if compiled:
            raise UserError("[quantize.linear.float8] emulate = true does not work with torch.compile; "
                            "set [compile] enable = false (emulate is for tests)")
        return
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if cap is None or cap < (8, 9):
        where = f"{torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}" if cap else f"this run is on {device.type}"
        raise UserError(f'[model] converters = ["float8"] needs a CUDA GPU of compute capability 8.9 or newer '
                        f"({where}); remove it, or set [quantize.linear.float8] emulate = true to test")


def uncompiled_note(cfg) -> str | None:
    """The advice printed where FP8 runs without torch.compile (measured: the step at 0.56x bf16's)."""
    f8, compiled = cfg.quantize.linear.float8, cfg.compile.enable and "model" in cfg.compile.components
    if f8.emulate or compiled:
        return None
    return ("float8: without torch.compile torchao scales each tensor in kernels of its own and the step runs "
            "slower than bf16; set [compile] enable = true")


def torchao_config(cfg):
    """torchao's Float8LinearConfig for ``[quantize.linear.float8]`` (recipe_name, emulate)."""
    from torchao.float8 import Float8LinearConfig

    f8 = cfg.quantize.linear.float8
    config = Float8LinearConfig.from_recipe_name(f8.recipe_name or "tensorwise")
    return dataclasses.replace(config, emulate=f8.emulate) if f8.emulate else config


def kept(fqn: str, module: nn.Module, filter_fqns) -> bool:
    """True for a module float8 leaves as it is: not an nn.Linear, a router gate, named in ``filter_fqns``
    (substring, as torchtitan matches), or a dimension not a multiple of 16 (FP8 GEMMs need it)."""
    if type(module) is not nn.Linear:
        return True
    if any(k in fqn for k in (*ALWAYS_KEPT, *filter_fqns)):
        return True
    return module.in_features % 16 != 0 or module.out_features % 16 != 0


def convert_float8(model: nn.Module, cfg) -> list[str]:
    """Swap the model's dense linear layers for torchao's Float8Linear in place (see ``kept``); returns the
    names of the swapped layers."""
    from torchao.float8 import convert_to_float8_training

    filter_fqns = tuple(cfg.quantize.linear.float8.filter_fqns) or DEFAULT_KEPT
    swapped = [fqn for fqn, m in model.named_modules() if not kept(fqn, m, filter_fqns)]
    convert_to_float8_training(model, config=torchao_config(cfg),
                               module_filter_fn=lambda m, fqn: not kept(fqn, m, filter_fqns))
    return swapped
