"""Load a train config: TOML file + ``--section.key value`` CLI overrides → JobConfig dataclass.

Schema = torchtitan 0.2.2's JobConfig merged with components/train/job_config.py. Every key and
value is checked against the dataclass types; unknown keys, wrong types and out-of-range values
raise ``UserError`` with one line naming the key and what is expected.
"""

import dataclasses
import difflib
import math
import os
import sys
import types
import typing
from typing import Any, Literal

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

import torch
from torchtitan.config.job_config import JobConfig as TitanJobConfig
from torchtitan.config.manager import ConfigManager

from . import float8
from . import job_config as ours
from components.errors import UserError

from .supported_keys import check_supported, is_refused, refusal_reason


def config_class() -> type:
    return ConfigManager._merge_configs(TitanJobConfig, ours.JobConfig)


# --- type checking and coercion ---------------------------------------------------------------

def _describe(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " or ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is list:
        return f"a list of {_describe(args[0])}"
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp))


def _check(tp, value) -> bool:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return value in args
    if origin in (typing.Union, types.UnionType):
        return any(_check(a, value) for a in args)
    if origin is list:
        return isinstance(value, list) and all(_check(args[0], v) for v in value)
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is Any:
        return True
    return isinstance(value, tp)


def _from_cli(tp, text: str):
    """Parse a CLI string into a value of type ``tp`` (None when it does not parse)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if text.lower() in ("none", "null") and type(None) in args:
            return None
        for a in args:
            if a is not type(None) and (v := _from_cli(a, text)) is not None:
                return v
        return None
    if origin is Literal:
        for a in args:
            if str(a) == text:
                return a
        return None
    if origin is list:
        items = [s for s in text.split(",") if s]
        vals = [_from_cli(args[0], s) for s in items]
        return None if any(v is None for v in vals) else vals
    if tp is bool:
        return {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(text.lower())
    for cast in (int, float):
        if tp is cast:
            try:
                return cast(text)
            except ValueError:
                return None
    if tp is str:
        return text
    return None


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _did_you_mean(key: str, known) -> str:
    """'did you mean 'x'? ' for the closest of ``known`` (case and spaces ignored), else ''."""
    known = [str(k) for k in known]
    folded = {k.lower().replace(" ", ""): k for k in known}
    close = difflib.get_close_matches(str(key).lower().replace(" ", ""), list(folded), n=1, cutoff=0.6)
    return f"did you mean {folded[close[0]]!r}? " if close else ""


def _choices(tp) -> list:
    """The values a Literal type (or a union holding one) allows; [] for other types."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return list(args)
    if origin in (typing.Union, types.UnionType):
        return [c for a in args for c in _choices(a)]
    return []


def _validate_table(cls, table: dict, where: str) -> None:
    known = _fields(cls)
    for key, value in table.items():
        name = f"{where}.{key}" if where else key
        if key not in known:
            section = f"[{where}] " if where else "section "
            raise UserError(f"unknown key {section}{key!r}; {_did_you_mean(key, known)}"
                            f"valid keys: {', '.join(sorted(known))}")
        tp = known[key].type
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise UserError(f"[{name}] must be a table (section), got {value!r}")
            _validate_table(tp, value, name)
        elif not _check(tp, value):
            guess = _did_you_mean(value, _choices(tp)) if isinstance(value, str) else ""
            raise UserError(f"{_toml_key(name)} = {value!r} has the wrong type; {guess}expected {_describe(tp)}")


def _toml_key(dotted: str) -> str:
    section, _, key = dotted.rpartition(".")
    return f"[{section}] {key}" if section else key


def _apply_override(cls, table: dict, dotted: str, text: str | None) -> None:
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        known = _fields(cls)
        if part not in known:
            where = ".".join(parts[:i])
            guess = _did_you_mean(part, known)
            raise UserError(
                f"unknown option --{dotted}" + (f"; {guess}valid keys of [{where}]: {', '.join(sorted(known))}"
                                                if where else f"; {guess}".rstrip("; "))
            )
        tp = known[part].type
        if i < len(parts) - 1:
            if not dataclasses.is_dataclass(tp):
                raise UserError(f"unknown option --{dotted}: {'.'.join(parts[:i + 1])} is not a section")
            cls = tp
            table = table.setdefault(part, {})
            continue
        if dataclasses.is_dataclass(tp):
            raise UserError(f"--{dotted} is a section; set one of its keys, e.g. --{dotted}.<key> VALUE")
        if text is None:  # a bare flag: true, for a key that takes a boolean (alone or beside "auto")
            if not _check(tp, True):
                raise UserError(f"--{dotted} needs a value ({_describe(tp)})")
            value = True
        else:
            value = _from_cli(tp, text)
            if value is None and not (text.lower() in ("none", "null") and _check(tp, None)):
                raise UserError(f"--{dotted} {text!r} is not valid; {_did_you_mean(text, _choices(tp))}"
                                f"expected {_describe(tp)}")
        table[part] = value


def _build(cls, table: dict):
    kwargs = {}
    for name, f in _fields(cls).items():
        if name in table:
            kwargs[name] = _build(f.type, table[name]) if dataclasses.is_dataclass(f.type) else table[name]
    return cls(**kwargs)


def _known_values(dotted: str) -> list:
    """The values option ``--dotted`` allows, where they are a short list ([] otherwise)."""
    from components.moe_echo.models import FLAVORS

    if dotted == "model.name":
        return list(FLAVORS)
    if dotted == "model.flavor":
        return [f for flavors in FLAVORS.values() for f in flavors]
    cls, tp = config_class(), None
    for part in dotted.split("."):
        known = _fields(cls) if dataclasses.is_dataclass(cls) else {}
        if part not in known:
            return []
        cls = tp = known[part].type
    return _choices(tp)


def _split_cli(argv: list[str]) -> list[tuple[str, str | None]]:
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            if out and out[-1][1] is not None and i > 0 and not argv[i - 1].startswith("--"):
                key, value = out[-1]  # a value split by a space: "--model.flavor v2lite_1 b"
                guess = _did_you_mean(value + arg, _known_values(key))
                raise UserError(f"unexpected argument {arg!r} after --{key} {value}; an option takes one value "
                                f"(quote one with spaces)" + (f"; {guess.replace('mean ', f'mean --{key} ')}"
                                                              .rstrip() if guess else ""))
            raise UserError(f"unexpected argument {arg!r}; options look like --section.key VALUE")
        key = arg[2:].replace("-", "_")
        if "=" in key:
            key, value = key.split("=", 1)
            value = arg.split("=", 1)[1]
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
            i += 2
        else:
            value = None
            i += 1
        out.append((key, value))
    return out


# --- range checks -------------------------------------------------------------------------------

def _require(ok: bool, key: str, value, expected: str) -> None:
    if not ok:
        raise UserError(f"{key} = {value!r} is out of range; expected {expected}")


_INT64 = 2**63


def _check_numbers(cfg, where: str = "") -> None:
    """Every int fits int64 and every float is finite (TOML and Python ints are unbounded)."""
    for f in dataclasses.fields(cfg):
        value, name = getattr(cfg, f.name), f"{where}.{f.name}" if where else f.name
        if dataclasses.is_dataclass(value):
            _check_numbers(value, name)
        elif isinstance(value, int) and not isinstance(value, bool) and not -_INT64 <= value < _INT64:
            raise UserError(f"{_toml_key(name)} = {value} is out of range; expected a 64-bit integer")
        elif isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"{_toml_key(name)} = {value!r} is out of range; expected a finite number")


def _check_dump_folder(path: str) -> None:
    if not path.strip():
        raise UserError("[job] dump_folder is empty; give a folder for logs and checkpoints, e.g. ./outputs/run1")
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"[job] dump_folder = {path!r} is an existing file, not a folder; pick another path")


def check_model(m):
    """[model] name, flavor and shape keys (one-line errors naming the key); returns the model args
    they resolve to."""
    from components.moe_echo.models import FLAVORS, SHAPE_KEYS, model_args_for, shape_of, shape_overrides

    if m.name not in FLAVORS:
        raise UserError(f"[model] name = {m.name!r} is not known; {_did_you_mean(m.name, FLAVORS)}"
                        f"expected one of {', '.join(FLAVORS)}")
    if m.flavor not in FLAVORS[m.name]:
        other = [n for n, flavors in FLAVORS.items() if m.flavor in flavors]
        if other:
            raise UserError(f"[model] flavor = {m.flavor!r} is a {other[0]} flavour, not a {m.name} one; "
                            f"set [model] name = {other[0]!r}")
        raise UserError(f"[model] flavor = {m.flavor!r} is not a {m.name} flavour; "
                        f"{_did_you_mean(m.flavor, FLAVORS[m.name])}expected one of {', '.join(FLAVORS[m.name])}")
    over = shape_overrides(m)
    for key in over:
        if m.name not in SHAPE_KEYS[key]:
            raise UserError(f"[model] {key} applies to {' and '.join(SHAPE_KEYS[key])} models only, not {m.name}; "
                            "remove it")
    args = model_args_for(m.name, m.flavor, over)
    v = shape_of(m.name, args)

    def blame(*keys) -> str:  # the first of ``keys`` the config sets (else the first): the one to change
        return next((k for k in keys if k in over), keys[0])

    def need(ok: bool, keys: tuple, expected: str) -> None:
        if not ok:
            key = blame(*keys)
            origin = "" if key in over else f" (flavour {m.flavor!r})"
            raise UserError(f"[model] {key} = {v[key]}{origin} is out of range; expected {expected}")

    for key, value in over.items():
        low = 0 if key in ("n_dense_layers", "num_shared_experts") else 1
        need(value >= low, (key,), f">= {low}")
        if key in ("dim", "inter_dim", "moe_inter_dim"):
            need(value % 16 == 0, (key,), "a multiple of 16 (the GPU GEMMs need aligned rows)")
    if "head_dim" in over:
        need(v["head_dim"] % 2 == 0, ("head_dim",), "an even number (rotary embedding)")
    moe = getattr(args, "moe_enabled", True)  # qwen3's dense flavours have no MoE layers
    moe_keys = [k for k in ("moe_inter_dim", "num_experts", "num_shared_experts", "top_k") if k in over]
    if not moe and moe_keys:
        raise UserError(f"[model] {moe_keys[0]} sizes MoE layers; {m.name} flavour {m.flavor!r} has none "
                        "(a dense model); pick a MoE flavour or remove the key")
    if moe and m.name == "qwen3" and "inter_dim" in over:
        raise UserError(f"[model] inter_dim sizes dense FFN layers; qwen3 flavour {m.flavor!r} has none (every "
                        "layer is MoE); size the experts with moe_inter_dim or remove the key")
    need(v["top_k"] <= v["num_experts"], ("top_k", "num_experts"),
         f"top_k <= num_experts ({v['top_k']} > {v['num_experts']})")
    groups = getattr(getattr(args, "moe_args", None), "num_expert_groups", None)
    need(not groups or v["num_experts"] % groups == 0, ("num_experts",),
         f"a multiple of the flavour's {groups} expert groups")
    if "n_dense_layers" in v:
        need(v["n_dense_layers"] < v["n_layers"], ("n_dense_layers", "n_layers"),
             f"n_dense_layers < n_layers ({v['n_dense_layers']} >= {v['n_layers']}), so one MoE layer remains")
    if "n_kv_heads" in v:
        need(v["n_heads"] % v["n_kv_heads"] == 0, ("n_kv_heads", "n_heads"),
             f"n_kv_heads dividing n_heads ({v['n_heads']} % {v['n_kv_heads']} != 0)")
    return args


def validate(cfg) -> None:
    _check_numbers(cfg)
    check_supported(cfg, ours.JobConfig)
    float8.requested(cfg)  # an unknown [model] converters entry: one line, before any work
    float8.check_keys(cfg)
    _check_dump_folder(cfg.job.dump_folder)
    t, o, s, m, e, p = cfg.training, cfg.optimizer, cfg.lr_scheduler, cfg.model, cfg.moe_echo, cfg.parallelism
    model_args = check_model(m)
    _require(t.steps >= 1, "[training] steps", t.steps, ">= 1")
    _require(t.local_batch_size >= 1, "[training] local_batch_size", t.local_batch_size, ">= 1")
    _require(t.seq_len >= 2, "[training] seq_len", t.seq_len, ">= 2")
    _require(t.max_norm >= 0, "[training] max_norm", t.max_norm, ">= 0 (0 disables clipping)")
    _require(t.max_corpus_mb >= 1, "[training] max_corpus_mb", t.max_corpus_mb, ">= 1")
    _require(o.lr > 0, "[optimizer] lr", o.lr, "> 0")
    _require(o.weight_decay >= 0, "[optimizer] weight_decay", o.weight_decay, ">= 0")
    _require(o.eps > 0, "[optimizer] eps", o.eps, "> 0")
    _require(o.name in ("AdamW", "Adam"), "[optimizer] name", o.name, "'AdamW' or 'Adam'")
    _require(0 <= o.beta1 < 1, "[optimizer] beta1", o.beta1, "in [0, 1)")
    _require(0 <= o.beta2 < 1, "[optimizer] beta2", o.beta2, "in [0, 1)")
    _require(o.implementation in ("fused", "foreach", "for-loop"), "[optimizer] implementation", o.implementation,
             "'fused', 'foreach' or 'for-loop'")
    if o.implementation != "fused" and t.max_nonfinite_steps > 0:
        raise UserError(f"[optimizer] implementation = {o.implementation!r}: the non-finite guard gates the optimizer "
                        "step on the device, which only the fused implementation supports; use 'fused' or set "
                        "[training] max_nonfinite_steps = 0 (guard off)")
    _require(t.max_nonfinite_steps >= 0, "[training] max_nonfinite_steps", t.max_nonfinite_steps, ">= 0 (0: off)")
    _require(0 <= t.seed < 2**62, "[training] seed", t.seed, "in [0, 2**62)")
    _require(cfg.debug.seed is None or 0 <= cfg.debug.seed < 2**62, "[debug] seed", cfg.debug.seed,
             "in [0, 2**62) or unset")
    _require(t.gc_freq >= 1, "[training] gc_freq", t.gc_freq, ">= 1")
    _require(t.mixed_precision_reduce in ("float32", "bfloat16"), "[training] mixed_precision_reduce",
             t.mixed_precision_reduce, "'float32' or 'bfloat16'")
    _require(cfg.comm.init_timeout_seconds >= 1, "[comm] init_timeout_seconds", cfg.comm.init_timeout_seconds, ">= 1")
    _require(cfg.comm.train_timeout_seconds >= 1, "[comm] train_timeout_seconds", cfg.comm.train_timeout_seconds,
             ">= 1")
    _require(cfg.checkpoint.export_dtype in ("float32", "bfloat16", "float16"), "[checkpoint] export_dtype",
             cfg.checkpoint.export_dtype, "'float32', 'bfloat16' or 'float16'")
    _require(0 <= s.warmup_steps, "[lr_scheduler] warmup_steps", s.warmup_steps, ">= 0")
    _require(0 <= s.min_lr_factor <= 1, "[lr_scheduler] min_lr_factor", s.min_lr_factor, "in [0, 1]")
    _require(s.decay_ratio is None or 0 <= s.decay_ratio <= 1, "[lr_scheduler] decay_ratio", s.decay_ratio,
             "in [0, 1] or unset")
    _require(cfg.metrics.log_freq >= 1, "[metrics] log_freq", cfg.metrics.log_freq, ">= 1")
    _require(cfg.checkpoint.interval >= 1, "[checkpoint] interval", cfg.checkpoint.interval, ">= 1")
    _require(cfg.checkpoint.keep_latest_k >= 0, "[checkpoint] keep_latest_k", cfg.checkpoint.keep_latest_k,
             ">= 0 (0 keeps all)")
    _require(e.capacity_factor >= 1.0, "[moe_echo] capacity_factor", e.capacity_factor, ">= 1.0")
    _require(e.aux_loss_coeff >= 0, "[moe_echo] aux_loss_coeff", e.aux_loss_coeff, ">= 0")
    _require(e.bias_update_rate >= 0, "[moe_echo] bias_update_rate", e.bias_update_rate, ">= 0")
    _require(e.load_heatmap_freq >= 0, "[moe_echo] load_heatmap_freq", e.load_heatmap_freq, ">= 0")
    n_experts = getattr(getattr(model_args, "moe_args", None), "num_experts", 0)
    _require(0 <= e.debug_hot_experts <= n_experts, "[moe_echo] debug_hot_experts", e.debug_hot_experts,
             f"in [0, {n_experts}] (the model's experts)")
    _require(e.grow_capacity_after >= 0, "[moe_echo] grow_capacity_after", e.grow_capacity_after, ">= 0 (0: never)")
    if e.expert_wgrad_precision == "fp8" and e.expert_precision != "fp8":
        raise UserError(f"[moe_echo] expert_wgrad_precision = 'fp8' needs expert_precision = 'fp8' (got "
                        f"{e.expert_precision!r}); set both, or leave expert_wgrad_precision at 'auto'")
    ep = p.expert_parallel_degree
    if e.dispatcher == "local" and ep != 1:
        raise UserError(f"[moe_echo] dispatcher = 'local' needs [parallelism] expert_parallel_degree = 1 (got {ep}); "
                        "use 'alltoall', 'padded' or 'auto'")
    if e.echo is True and ep == 1:
        raise UserError("[moe_echo] echo = true needs [parallelism] expert_parallel_degree > 1 (clones live on other "
                        "EP ranks); set echo = false or raise expert_parallel_degree")
    _require(1 <= e.echo_slots_per_rank <= 64, "[moe_echo] echo_slots_per_rank", e.echo_slots_per_rank, "in [1, 64]")
    _require(1 <= e.nvlink_sms <= 1024, "[moe_echo] nvlink_sms", e.nvlink_sms, "in [1, 1024]")
    _require(t.cuda_graph_warmup >= 1, "[training] cuda_graph_warmup", t.cuda_graph_warmup, ">= 1")
    _require(t.hang_report_s >= 0, "[training] hang_report_s", t.hang_report_s, ">= 0 (0: off)")
    if e.dispatcher in ("nvlink", "deepep") and not torch.cuda.is_available():
        raise UserError(f"[moe_echo] dispatcher = {e.dispatcher!r} needs CUDA GPUs (peer memory over NVLink); "
                        "use 'padded' or 'auto' on this machine")
    if e.dispatcher == "deepep":
        from components.moe_echo.deepep_dispatch import require_deep_ep

        require_deep_ep()
    if e.nvlink_copy != "kernel" and e.dispatcher not in ("auto", "fastest", "nvlink"):
        raise UserError(f"[moe_echo] nvlink_copy = {e.nvlink_copy!r} applies to the nvlink dispatcher only (dispatcher = "
                        f"{e.dispatcher!r}); set nvlink_copy = 'kernel' or dispatcher = 'nvlink'")
    if e.dispatcher in ("alltoall", "padded", "nvlink", "hierarchical", "deepep") and ep == 1:
        raise UserError(f"[moe_echo] dispatcher = {e.dispatcher!r} needs [parallelism] expert_parallel_degree > 1; "
                        "use 'local' or 'auto'")
    c = cfg.compile
    for part in c.components:
        if part not in ("model", "loss"):
            raise UserError(f"[compile] components = {c.components!r}: {part!r} is not compiled by this recipe; "
                            "expected 'model' (the blocks' attention, norms, dense FFN, shared experts; the final "
                            "norm and output head) and/or 'loss' (the cross-entropy)")
    if c.enable:
        from components.parallel.compile import compile_options

        compile_options(c.backend)  # a one-line error for an unknown backend, before any work


def check_global_batch(cfg, world: int) -> None:
    """[training] global_batch_size: -1, or local_batch_size x data-parallel ranks (every rank
    reads its own data; gradient accumulation is not supported)."""
    t = cfg.training
    if t.global_batch_size not in (-1, t.local_batch_size * world):
        raise UserError(f"not supported by this recipe: [training] global_batch_size = {t.global_batch_size} "
                        f"(gradient accumulation); with {world} data-parallel ranks and local_batch_size "
                        f"{t.local_batch_size} it must be -1 or {t.local_batch_size * world}")


# torchtitan keys its source leaves without a description
_MORE_DOCS = {
    "optimizer": {"beta1": "Exponential moving average coefficient of the gradient (Adam's first moment)."},
    "compile": {"backend": 'torch.compile backend, e.g. "inductor" (default), "aot_eager" or "eager".'},
    "model": {"converters": 'Model converters; this recipe applies "float8" (or "quantize.linear.float8"): the dense '
                            "linear layers become torchao's Float8Linear before parallelisation (pip install "
                            '"moe-echo[float8]"; Hopper, with [compile] enable = true to pay), and the routed experts '
                            'go FP8 too unless [moe_echo] expert_precision is set. Others are refused.'},
    "quantize.linear.float8": {
        "recipe_name": 'torchao\'s scaling of the dense FP8 layers: "tensorwise" (the default when unset), "rowwise" '
                       'or "rowwise_with_gw_hp". The FP8 routed experts follow it unless [moe_echo] expert_fp8_scaling '
                       'is set: one weight scale per expert with "tensorwise", per output channel with the rowwise '
                       "recipes (token rows scaled per row either way).",
        "filter_fqns": 'Names (substrings) of the linear layers to keep in bf16. Empty: the output head is kept; a list '
                       'without "output" converts the head too. Router gates are always kept, and so is any layer '
                       'with a dimension not a multiple of 16. "auto_filter_small_kn" in the list (torchtitan\'s '
                       "flag) also keeps the layers torchao's size thresholds for the recipe rule out (tensorwise, "
                       "rowwise).",
        "enable_fsdp_float8_all_gather": "With FSDP and tensorwise scaling: each weight shard is cast to FP8 before "
                                         "FSDP's all-gather (half the bytes). No effect without FSDP.",
        "precompute_float8_dynamic_scale_for_fsdp": "With the FP8 all-gather: every weight's scale from one "
                                                    "all-reduce after the optimizer step instead of one per weight "
                                                    "in the forward."},
}
_WIDTH = 100  # --help wraps descriptions at this column


def _field_docs(cls) -> dict[str, list[str]]:
    """Each field's attribute docstring (the string right after it in the source), in full: its
    paragraphs and list items ("- ...") as separate chunks of whitespace-normalised text."""
    import ast
    import inspect
    import textwrap

    docs = {}
    for klass in reversed(cls.__mro__):  # merged configs inherit their parts' fields
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
                docs[node.target.id] = _chunks(nxt.value.value)
    return docs


def _chunks(doc: str) -> list[str]:
    chunks, current = [], []
    for line in doc.strip().splitlines():
        line = line.strip()
        if not line or line.startswith(("- ", "* ")):
            if current:
                chunks.append(" ".join(current))
            current = [line] if line else []
        else:
            current.append(line)
    if current:
        chunks.append(" ".join(current))
    return chunks


def _shape_note(cfg, key: str) -> str:
    """For an unset [model] shape key: the value the flavour gives it."""
    from components.moe_echo.models import FLAVORS, SHAPE_KEYS, model_args_for, shape_of

    m = cfg.model if cfg is not None else ours.Model()
    if key not in SHAPE_KEYS or getattr(m, key) is not None or m.name not in FLAVORS or m.flavor not in FLAVORS[m.name]:
        return ""
    if m.name not in SHAPE_KEYS[key]:
        return f"; not for {m.name}"
    return f"; flavour {m.flavor!r}: {shape_of(m.name, model_args_for(m.name, m.flavor))[key]}"


def _flavour_list() -> str:
    from components.moe_echo.models import FLAVORS

    return "Flavours: " + "; ".join(f"{name}: {', '.join(flavors)}" for name, flavors in FLAVORS.items()) + "."


def help_text(argv: list[str] | None = None) -> str:
    """Every section and key with its value (the default, or what ``--job.config_file``, if given
    in ``argv``, and the other options set), its type and its full description, wrapped; keys
    this recipe refuses are marked ``[refused]`` with the reason."""
    import textwrap

    cfg = None
    try:
        cfg = load_config([a for a in (argv or []) if a not in ("-h", "--help")])
    except UserError as err:
        cfg, note = None, f"(config not applied: {err})"
    lines = ["usage: recipe --job.config_file FILE.toml [--section.key VALUE ...]", "",
             "Each key: name = value (type), then its description. Values "
             + ("from the given config." if cfg is not None and argv else "are the defaults."),
             "[refused]: a torchtitan key this recipe does not support; it must keep its default, and the "
             "reason follows."]
    if cfg is None:
        lines.insert(1, note)

    parts = {}  # section -> the dataclasses merged into it (torchtitan's and ours): their docstrings
    for whole in (TitanJobConfig, ours.JobConfig):
        for f in dataclasses.fields(whole):
            parts.setdefault(f.name, []).append(f.type)

    def describe(chunks: list[str], indent: str) -> None:
        for chunk in chunks:
            lines.extend(textwrap.wrap(chunk, _WIDTH, initial_indent=indent, subsequent_indent=indent + "  "
                                       if chunk.startswith(("- ", "* ")) else indent, break_on_hyphens=False))

    def walk(dc_type, value, prefix, depth):
        section = prefix.rstrip(".")
        docs = _field_docs(dc_type)
        for part in parts.get(section, []) if depth == 1 else []:
            docs.update(_field_docs(part))
        docs.update({k: [d] for k, d in _MORE_DOCS.get(section, {}).items()})
        for f in dataclasses.fields(dc_type):
            v = getattr(value, f.name) if value is not None else (
                f.default if f.default is not dataclasses.MISSING else f.default_factory())
            pad = "  " * depth
            if dataclasses.is_dataclass(f.type):
                lines.append(f"{pad}[{prefix}{f.name}]")
                walk(f.type, v, f"{prefix}{f.name}.", depth + 1)
                continue
            refused = section and is_refused(section, f.name, ours.JobConfig)
            note = _shape_note(cfg, f.name) if section == "model" else ""
            lines.append(f"{pad}{f.name} = {v!r} ({_describe(f.type)}{note})" + (" [refused]" if refused else ""))
            chunks = list(docs.get(f.name, []))
            if section == "model" and f.name == "flavor":
                chunks.append(_flavour_list())
            if refused:
                chunks.insert(0, f"Refused: {refusal_reason(section, f.name)}.")
            describe(chunks or ["(no description)"], pad + "    ")

    walk(config_class(), cfg, "", 0)
    return "\n".join(lines)


def load_config(argv: list[str] | None = None):
    """Parse argv (default sys.argv[1:]) into a validated merged JobConfig."""
    argv = sys.argv[1:] if argv is None else list(argv)
    cls = config_class()
    overrides = _split_cli(argv)
    table: dict = {}
    paths = [v for k, v in overrides if k == "job.config_file"]
    if len(paths) > 1:
        raise UserError(f"--job.config_file is given {len(paths)} times ({', '.join(map(repr, paths))}); "
                        "pass one file and override single keys with --section.key VALUE")
    path = paths[0] if paths else None
    if path is not None:
        if not os.path.isfile(path):
            raise UserError(f"config file not found: {path!r} (pass --job.config_file PATH to a .toml file)")
        try:
            with open(path, "rb") as f:
                table = tomllib.load(f)
        except tomllib.TOMLDecodeError as err:
            raise UserError(f"config file {path!r} is not valid TOML: {err}") from None
        except UnicodeDecodeError as err:
            raise UserError(f"config file {path!r} is not UTF-8 text (byte {err.start}); save it as UTF-8") from None
        _validate_table(cls, table, "")
    for key, value in overrides:
        _apply_override(cls, table, key, value)
    cfg = _build(cls, table)
    implied = cfg.model.converters and not cfg.quantize.linear.float8.emulate  # FP8 experts have no emulation
    if implied and "expert_precision" not in table.get("moe_echo", {}):
        cfg.moe_echo.expert_precision = "fp8"  # [model] converters = ["float8"]: the routed experts too, unless set
    rowwise = (cfg.quantize.linear.float8.recipe_name or "tensorwise") != "tensorwise"
    if cfg.model.converters and rowwise and "expert_fp8_scaling" not in table.get("moe_echo", {}):
        cfg.moe_echo.expert_fp8_scaling = "channel"  # one key picks the scaling of dense layers and experts alike
    validate(cfg)
    return cfg
