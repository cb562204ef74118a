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

from . import job_config as ours
from components.errors import UserError

from .supported_keys import HONOURED, check_supported


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
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


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
            raise UserError(f"{_toml_key(name)} = {value!r} has the wrong type; expected {_describe(tp)}")


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
        if text is None:
            if tp is not bool:
                raise UserError(f"--{dotted} needs a value ({_describe(tp)})")
            value = True
        else:
            value = _from_cli(tp, text)
            if value is None and not (text.lower() in ("none", "null") and _check(tp, None)):
                raise UserError(f"--{dotted} {text!r} is not valid; expected {_describe(tp)}")
        table[part] = value


def _build(cls, table: dict):
    kwargs = {}
    for name, f in _fields(cls).items():
        if name in table:
            kwargs[name] = _build(f.type, table[name]) if dataclasses.is_dataclass(f.type) else table[name]
    return cls(**kwargs)


def _split_cli(argv: list[str]) -> list[tuple[str, str | None]]:
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
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


def validate(cfg) -> None:
    from components.moe_echo.models import FLAVORS, model_args_for

    _check_numbers(cfg)
    check_supported(cfg, ours.JobConfig)
    _check_dump_folder(cfg.job.dump_folder)
    t, o, s, m, e, p = cfg.training, cfg.optimizer, cfg.lr_scheduler, cfg.model, cfg.moe_echo, cfg.parallelism
    if m.name not in FLAVORS:
        raise UserError(f"[model] name = {m.name!r} is not known; expected one of {', '.join(FLAVORS)}")
    if m.flavor not in FLAVORS[m.name]:
        raise UserError(
            f"[model] flavor = {m.flavor!r} is not a {m.name} flavour; expected one of {', '.join(FLAVORS[m.name])}"
        )
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
    n_experts = getattr(getattr(model_args_for(m.name, m.flavor), "moe_args", None), "num_experts", 0)
    _require(0 <= e.debug_hot_experts <= n_experts, "[moe_echo] debug_hot_experts", e.debug_hot_experts,
             f"in [0, {n_experts}] (the flavour's experts)")
    _require(e.grow_capacity_after >= 0, "[moe_echo] grow_capacity_after", e.grow_capacity_after, ">= 0 (0: never)")
    ep = p.expert_parallel_degree
    if e.dispatcher == "local" and ep != 1:
        raise UserError(f"[moe_echo] dispatcher = 'local' needs [parallelism] expert_parallel_degree = 1 (got {ep}); "
                        "use 'alltoall', 'padded' or 'auto'")
    if e.echo and ep == 1:
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
                            "expected 'model' (the blocks' attention, norms, dense FFN, shared experts) and/or "
                            "'loss' (the cross-entropy)")
    if c.enable:
        from components.parallel.compile import compile_options

        compile_options(c.backend)  # a one-line error for an unknown backend, before any work
    for key in ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree",
                "expert_tensor_parallel_degree"):
        _require(getattr(p, key) == 1, f"[parallelism] {key}", getattr(p, key), "1 (not supported yet)")


def check_global_batch(cfg, world: int) -> None:
    """[training] global_batch_size: -1, or local_batch_size x data-parallel ranks (every rank
    reads its own data; gradient accumulation is not supported)."""
    t = cfg.training
    if t.global_batch_size not in (-1, t.local_batch_size * world):
        raise UserError(f"not supported by this recipe: [training] global_batch_size = {t.global_batch_size} "
                        f"(gradient accumulation); with {world} data-parallel ranks and local_batch_size "
                        f"{t.local_batch_size} it must be -1 or {t.local_batch_size * world}")


TITAN_SECTIONS = {f.name for f in dataclasses.fields(TitanJobConfig)}


def _ours(section: str, key: str) -> bool:
    own = {f.name: f.type for f in dataclasses.fields(ours.JobConfig)}
    return section in own and key in {f.name for f in dataclasses.fields(own[section])}


def _field_docs(cls) -> dict[str, str]:
    """First line of each field's attribute docstring (the string right after it in the source)."""
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
                text = " ".join(nxt.value.value.strip().split("\n\n")[0].split())
                docs[node.target.id] = text if len(text) <= 160 else text[:157].rsplit(" ", 1)[0] + " ..."
    return docs


def help_text(argv: list[str] | None = None) -> str:
    """Every section and key with its one-line description and its value: the default, or what
    ``--job.config_file`` (if given in ``argv``) and the other options set."""
    cfg = None
    try:
        cfg = load_config([a for a in (argv or []) if a not in ("-h", "--help")])
    except UserError as err:
        cfg, note = None, f"(config not applied: {err})"
    lines = ["usage: recipe --job.config_file FILE.toml [--section.key VALUE ...]", "",
             "keys: value (type) — description" + ("; values from the given config" if cfg is not None and argv
                                                   else "; defaults")]
    if cfg is None:
        lines.insert(1, note)

    parts = {}  # section -> the dataclasses merged into it (torchtitan's and ours): their docstrings
    for whole in (TitanJobConfig, ours.JobConfig):
        for f in dataclasses.fields(whole):
            parts.setdefault(f.name, []).append(f.type)

    def walk(dc_type, value, prefix, depth):
        docs = _field_docs(dc_type)
        for part in parts.get(prefix.rstrip("."), []) if depth == 1 else []:
            docs.update(_field_docs(part))
        for f in dataclasses.fields(dc_type):
            v = getattr(value, f.name) if value is not None else (
                f.default if f.default is not dataclasses.MISSING else f.default_factory())
            if dataclasses.is_dataclass(f.type):
                lines.append(f"{'  ' * depth}[{prefix}{f.name}]")
                walk(f.type, v, f"{prefix}{f.name}.", depth + 1)
                continue
            doc = f" — {docs[f.name]}" if f.name in docs else ""
            section = prefix.rstrip(".")
            if section in TITAN_SECTIONS and f.name not in HONOURED.get(section, set()) and not _ours(section, f.name):
                doc = " — [not supported by this recipe: keep the default]" + doc
            lines.append(f"{'  ' * depth}{f.name} = {v!r} ({_describe(f.type)}){doc}")

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
    validate(cfg)
    return cfg
