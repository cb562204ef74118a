"""FP8 training of the dense linear layers through torchao, the way torchtitan does it.

    [model]
    converters = ["float8"]            # or torchtitan 0.2's name, "quantize.linear.float8"
    [quantize.linear.float8]
    recipe_name = "tensorwise"         # torchao's recipes: "tensorwise" (default), "rowwise", "rowwise_with_gw_hp"
    filter_fqns = ["output"]           # linear layers left in bf16 (default: the output head); torchtitan's flag
                                       # "auto_filter_small_kn" also keeps those torchao measures too small to pay
    emulate = false                    # true: FP8 emulated in higher precision (CPU tests; not with compile)
    enable_fsdp_float8_all_gather = true               # tensorwise + FSDP: weights all-gathered in FP8
    precompute_float8_dynamic_scale_for_fsdp = true    # their scales from one all-reduce after the optimizer step

Every ``nn.Linear`` of the model whose name matches none of ``filter_fqns`` and whose both dimensions
are multiples of 16 becomes torchao's ``Float8Linear`` before parallelisation: attention projections,
dense feed-forwards and the shared experts. Same parameters, same names (checkpoints load either way);
the forward and both backward GEMMs run in FP8 with scales computed on the device. An output head in FP8
(``filter_fqns`` not naming it) with tensorwise scaling becomes ``Fp8Head`` instead, its logits and weight
gradient in FP8 and its input gradient in bf16 (components/train/fp8_head.py): measured over 500 steps, runs with
all three of its GEMMs in FP8 (torchao's tensorwise head) ended ~2% above bf16's loss, with the input gradient
in bf16 within bf16's noise; a run whose head has both backward GEMMs in FP8 (torchao's head, as rowwise
converts it) says so. The default keeps the head in
bf16, as torchtitan does. The routers' gates
always stay as they are (top-k is decided on their logits). With ``"auto_filter_small_kn"`` in ``filter_fqns``
(torchtitan's flag) so do the layers whose (in, out) torchao's size thresholds for the recipe rule out
(tensorwise: in ≤ 4096 and out ≤ 1024; rowwise: out ≤ 2048, in ≤ 1024, or out ≤ 4096 and in ≤ 2048). The
routed experts follow the same switch through their own key: ``[moe_echo] expert_precision`` becomes "fp8"
unless the config sets it (or ``emulate`` is on: the FP8 experts have no emulation).

With FSDP and tensorwise scaling, ``enable_fsdp_float8_all_gather`` casts each weight shard to FP8 before
FSDP's all-gather (half the bytes of bf16), and ``precompute_float8_dynamic_scale_for_fsdp`` computes all of
their scales after the optimizer step with one all-reduce instead of one per weight in the forward. Those
scales are written into the same tensors every step, so a captured step's replays read the new ones.
"""

import dataclasses
import types
from collections.abc import Callable

import torch
from torch import nn

from components.errors import UserError

from .fp8_head import Fp8Head

NAMES = ("float8", "quantize.linear.float8")  # torchtitan's older and 0.2 names of the converter
ALWAYS_KEPT = ("router.gate",)  # routing decisions stay on unquantised logits
HEAD = "output"  # the model's output head (torchtitan's name)
DEFAULT_KEPT = (HEAD,)  # where filter_fqns is empty: the output head
AUTO_FILTER = "auto_filter_small_kn"  # torchtitan's flag in filter_fqns: torchao's per-recipe size thresholds
AUTO_RECIPES = ("tensorwise", "rowwise")  # the recipes torchao has thresholds for


def requested(cfg) -> bool:
    """True where ``[model] converters`` asks for float8; one-line error for a converter this recipe lacks."""
    unknown = [c for c in cfg.model.converters if c not in NAMES]
    if unknown:
        raise UserError(f"[model] converters = {cfg.model.converters!r}: {unknown[0]!r} is not applied by this "
                        f"recipe; the one it applies is \"float8\" (FP8 linear layers through torchao)")
    return bool(cfg.model.converters)


def check_float8(cfg, device: torch.device) -> None:
    """One-line error where float8 cannot run: torchao missing, a GPU below compute capability 8.9 (or no
    GPU) without ``emulate``, ``emulate`` with torch.compile, or ``emulate`` on a GPU with the FP8 experts'
    kernels for dense layers (``dense_ffn_kernels`` / ``dense_linear_kernels = "experts"``: emulated on CPU only,
    their GPU path is Hopper's FP8)."""
    f8 = cfg.quantize.linear.float8
    try:
        import torchao.float8  # noqa: F401  (imported to check that it is installed)
    except ImportError:
        raise UserError('[model] converters = ["float8"] needs torchao: pip install "moe-echo[float8]"') from None
    compiled = cfg.compile.enable and "model" in cfg.compile.components
    experts = [k for k in ("dense_ffn_kernels", "dense_linear_kernels") if getattr(cfg.moe_echo, k) == "experts"]
    if f8.emulate:
        if compiled:
            raise UserError("[quantize.linear.float8] emulate = true does not work with torch.compile; "
                            "set [compile] enable = false (emulate is for tests)")
        if experts and device.type == "cuda":
            raise UserError(f'[moe_echo] {experts[0]} = "experts" runs the FP8 experts\' kernels, emulated on CPU '
                            f'only; on a GPU set [quantize.linear.float8] emulate = false, or {experts[0]} = '
                            f'"torchao"')
        return
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if cap is None or cap < (8, 9):
        where = f"{torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}" if cap else f"this run is on {device.type}"
        raise UserError(f'[model] converters = ["float8"] needs a CUDA GPU of compute capability 8.9 or newer '
                        f"({where}); remove it, or set [quantize.linear.float8] emulate = true to test")
    if experts:
        from components.moe_echo.fp8_experts import check_fp8_supported

        check_fp8_supported(device)  # the FP8 experts' kernels: Hopper or newer


def check_keys(cfg) -> None:
    """One-line error for ``[quantize.linear.float8]`` keys that cannot go together (read at config time)."""
    f8 = cfg.quantize.linear.float8
    if f8.enable_fsdp_float8_all_gather and (f8.recipe_name or "tensorwise") != "tensorwise":
        raise UserError(f"[quantize.linear.float8] enable_fsdp_float8_all_gather = true needs recipe_name = "
                        f"\"tensorwise\" (one scale per weight), not {f8.recipe_name!r}; set one or the other")
    if AUTO_FILTER in f8.filter_fqns and (f8.recipe_name or "tensorwise") not in AUTO_RECIPES:
        raise UserError(f"[quantize.linear.float8] filter_fqns = [\"{AUTO_FILTER}\"] has size thresholds for "
                        f"recipe_name \"tensorwise\" and \"rowwise\" only, not {f8.recipe_name!r}; name the layers "
                        f"to keep in bf16 instead")
    if cfg.moe_echo.dense_ffn_kernels == "experts" and not cfg.model.converters:
        raise UserError('[moe_echo] dense_ffn_kernels = "experts" chooses how FP8 runs the dense feed-forwards and '
                        'needs [model] converters = ["float8"]; set both, or leave it "torchao"')
    if cfg.moe_echo.dense_linear_kernels == "experts" and not cfg.model.converters:
        raise UserError('[moe_echo] dense_linear_kernels = "experts" chooses how FP8 runs the dense linear layers '
                        'and needs [model] converters = ["float8"]; set both, or leave it "torchao"')
    if f8.precompute_float8_dynamic_scale_for_fsdp and not f8.enable_fsdp_float8_all_gather:
        raise UserError("[quantize.linear.float8] precompute_float8_dynamic_scale_for_fsdp = true needs "
                        "enable_fsdp_float8_all_gather = true (the scales it computes are the all-gather's)")


def fp8_all_gather(cfg, fsdp: bool) -> bool:
    """True where the dense FP8 weights are all-gathered in FP8: asked for, and FSDP shards them."""
    return fsdp and cfg.quantize.linear.float8.enable_fsdp_float8_all_gather


def uncompiled_note(cfg) -> str | None:
    """The advice printed where FP8 runs without torch.compile (measured: the step at 0.56x bf16's)."""
    f8, compiled = cfg.quantize.linear.float8, cfg.compile.enable and "model" in cfg.compile.components
    if f8.emulate or compiled:
        return None
    return ("float8: without torch.compile torchao scales each tensor in kernels of its own and the step runs "
            "slower than bf16; set [compile] enable = true")


def head_note(swapped: list[str], head: nn.Module | None) -> str | None:
    """The advice printed where the output head was converted with both backward GEMMs in FP8 (torchao's head;
    ``swapped``: ``convert_float8``'s names): measured, such runs ended ~2% above bf16's loss after 500 steps, a
    worse trained model, where an ``Fp8Head`` with its input gradient in bf16 ended within (docs/performance.md)."""
    if HEAD not in swapped or (isinstance(head, Fp8Head) and len(head.fp8_backward) < 2):
        return None
    return (f'float8: the output head is in FP8 with both backward GEMMs: a faster step, but measured runs ended ~2% '
            f'above bf16\'s loss after 500 steps; keep it in bf16 with "{HEAD}" in [quantize.linear.float8] '
            f'filter_fqns (the default)')


def torchao_config(cfg, fsdp: bool = False):
    """torchao's Float8LinearConfig for ``[quantize.linear.float8]`` (recipe_name, emulate; the FP8
    all-gather where ``fsdp``)."""
    from torchao.float8 import Float8LinearConfig

    f8 = cfg.quantize.linear.float8
    config = Float8LinearConfig.from_recipe_name(f8.recipe_name or "tensorwise")
    return dataclasses.replace(config, emulate=f8.emulate, enable_fsdp_float8_all_gather=fp8_all_gather(cfg, fsdp))


def kept(fqn: str, module: nn.Module, filter_fqns) -> bool:
    """True for a module float8 leaves as it is: not an nn.Linear, a router gate, named in ``filter_fqns``
    (substring, as torchtitan matches), or a dimension not a multiple of 16 (FP8 GEMMs need it)."""
    if type(module) is not nn.Linear:
        return True
    if any(k in fqn for k in (*ALWAYS_KEPT, *filter_fqns)):
        return True
    return module.in_features % 16 != 0 or module.out_features % 16 != 0


def keep_rule(f8) -> Callable[[str, nn.Module], bool]:
    """``keep(fqn, module)`` for ``[quantize.linear.float8]``: ``kept`` under its ``filter_fqns`` (the output head
    where that is empty), and with ``AUTO_FILTER`` among them the layers torchao's thresholds for the recipe
    find too small for FP8 to pay (``torchao.float8._auto_filter_for_recipe``, as torchtitan applies it)."""
    names = tuple(f8.filter_fqns) or DEFAULT_KEPT
    if AUTO_FILTER not in names:
        return lambda fqn, module: kept(fqn, module, names)
    try:
        from torchao.float8 import _auto_filter_for_recipe
    except ImportError:
        raise UserError(f'[quantize.linear.float8] filter_fqns = ["{AUTO_FILTER}"] needs a torchao with its size '
                        f'thresholds (torchao.float8._auto_filter_for_recipe): pip install -U "moe-echo[float8]", '
                        f"or name the layers to keep") from None
    names = tuple(n for n in names if n != AUTO_FILTER)
    converts = _auto_filter_for_recipe(f8.recipe_name or "tensorwise", [])
    return lambda fqn, module: kept(fqn, module, names) or not converts(module, fqn)


def kept_names(f8) -> list[str]:
    """What ``keep_rule`` keeps besides the router gates, in words for the run summary."""
    return [f"layers too small to pay ({AUTO_FILTER})" if n == AUTO_FILTER else n
            for n in (f8.filter_fqns or DEFAULT_KEPT)]


FFN_NAMES = ("shared_experts", "feed_forward")  # the dense SwiGLU feed-forwards (torchtitan's names)


def dense_ffns(model: nn.Module) -> list[str]:
    """The names of the model's dense SwiGLU feed-forwards: ``FFN_NAMES`` modules with w1, w2, w3 linear layers."""
    return [fqn for fqn, m in model.named_modules() if fqn.split(".")[-1] in FFN_NAMES
            and all(type(getattr(m, w, None)) is nn.Linear for w in ("w1", "w2", "w3"))]


def rows_linears(model: nn.Module) -> list[str]:
    """The names of the model's ``Fp8RowsLinear`` layers (``[moe_echo] dense_linear_kernels = "experts"``)."""
    from .fp8_linear import Fp8RowsLinear

    return [fqn for fqn, m in model.named_modules() if isinstance(m, Fp8RowsLinear)]


def _experts_ffn_forward(self, x: torch.Tensor) -> torch.Tensor:
    """A dense feed-forward's forward through the FP8 experts' kernels (``[moe_echo] dense_ffn_kernels``)."""
    from components.moe_echo.fp8_experts import fp8_dense_swiglu

    hint = getattr(self, "_fp8_hint", None)
    if hint is None or hint.device != x.device:
        hint = self._fp8_hint = torch.zeros(2, 1, dtype=torch.float32, device=x.device)
    return fp8_dense_swiglu(x, self.w1.weight, self.w2.weight, self.w3.weight, hint)


def convert_float8(model: nn.Module, cfg, fsdp: bool = False) -> list[str]:
    """Swap the model's dense linear layers for torchao's Float8Linear in place (see ``keep_rule``); returns the
    names of the swapped layers. ``fsdp``: FSDP will shard them (their weights may then be all-gathered in FP8).
    With ``[moe_echo] dense_ffn_kernels = "experts"`` the dense SwiGLU feed-forwards are left to the FP8 experts'
    kernels instead (their forward replaced, left uncompiled); with ``dense_linear_kernels = "experts"`` the other
    converted layers but the output head become ``Fp8RowsLinear``. Neither's names are among those returned."""
    from torchao.float8 import convert_to_float8_training

    f8 = cfg.quantize.linear.float8
    keep = keep_rule(f8)
    ffns = dense_ffns(model)
    in_ffn = lambda fqn: any(fqn.startswith(f + ".") for f in ffns)  # noqa: E731
    if cfg.moe_echo.dense_ffn_kernels == "experts":
        for fqn in ffns:
            ffn = model.get_submodule(fqn)
            ffn.forward = types.MethodType(_experts_ffn_forward, ffn)
            ffn.eager_only = True  # components/parallel/compile.py leaves it uncompiled
        rule = keep
        keep = lambda fqn, m: rule(fqn, m) or in_ffn(fqn)  # noqa: E731
    if cfg.moe_echo.dense_linear_kernels == "experts":  # the class swapped: kept() then leaves them to us
        from .fp8_linear import Fp8RowsLinear

        for fqn, m in list(model.named_modules()):
            if not keep(fqn, m) and fqn != HEAD and m.bias is None and not in_ffn(fqn):
                Fp8RowsLinear.from_linear(m)
    swapped = [fqn for fqn, m in model.named_modules() if not keep(fqn, m)]
    head = getattr(model, HEAD, None)
    if HEAD in swapped and (f8.recipe_name or "tensorwise") == "tensorwise" and not f8.emulate and head.bias is None:
        setattr(model, HEAD, Fp8Head.from_linear(head))  # the loss hands it its gradient in FP8: fp8_head.py
    convert_to_float8_training(model, config=torchao_config(cfg, fsdp),
                               module_filter_fn=lambda m, fqn: not keep(fqn, m))
    return swapped


def precompute_scales_(model: nn.Module) -> int:
    """After the optimizer step: the FP8 all-gather scales of every FSDP-sharded Float8Linear weight from one
    all-reduce of their amaxes (torchao's ``precompute_float8_dynamic_scale_for_fsdp``), written into the scale
    tensors that already exist, so a CUDA graph that captured the optimizer step and the forward reading those
    tensors stays right on replay. Returns how many weights it scaled. No host read."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import precompute_float8_dynamic_scale_for_fsdp

    shards = [m.weight._local_tensor for m in model.modules()
              if isinstance(m, Float8Linear) and hasattr(m.weight, "_local_tensor")]
    before = [getattr(w, "_precomputed_scale", None) for w in shards]
    precompute_float8_dynamic_scale_for_fsdp(model)
    for w, old in zip(shards, before):
        if old is not None and w._precomputed_scale is not old:
            old.copy_(w._precomputed_scale)
            w._precomputed_scale = old
    return sum(getattr(w, "_precomputed_scale", None) is not None for w in shards)
