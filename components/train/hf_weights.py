"""Initial weights for fine-tuning (a DCP ``step-N`` checkpoint of this repo, or HF safetensors),
and the HF safetensors export at the end of a run.

``load_initial_weights(model, path, in_hf, model_name)`` copies weights into ``model`` in place
(parameters keep their identity, so an optimizer built before still holds them) and returns a
short description for the log. Only the model is loaded — never the optimizer, lr scheduler or
step — so the run starts at step 1 from these weights.

- DCP (``in_hf=False``): ``path`` is a ``step-N`` folder written by recipes/pretrain.py; the model
  state (parameters and the routers' ``expert_bias``) is read from ``app.model.*``. Every model key
  must be in the checkpoint with the same shape.
- HF (``in_hf=True``): ``path`` is a directory with ``*.safetensors`` (one file, or shards listed
  in ``model.safetensors.index.json``), converted with torchtitan's state-dict adapter of the
  model family. Every model key must be present with the same shape, except the routers'
  ``expert_bias`` (``model.layers.N.mlp.gate.e_score_correction_bias``, optional), which then
  keeps its initial value (zeros). Tensors are cast to the model's dtypes.

``export_hf(model, folder, model_name, export_dtype)`` is the inverse of the HF load: every rank
calls it, rank 0 writes ``model.safetensors`` (or shards + ``model.safetensors.index.json``) into
``folder`` atomically, and ``load_initial_weights(fresh, folder, True, model_name)`` then gives
``fresh`` exactly the exported state (float32 export: bit-identical; bfloat16/float16: the model's
tensors rounded to that dtype). Qwen3 has no HF router bias; a non-zero ``expert_bias`` of a Qwen3
model is exported under DeepSeek's name ``e_score_correction_bias`` (HF Qwen3 loaders ignore it).

Any failure is a one-line ``UserError`` naming the path and the option to fix.
"""

import glob
import json
import os
import re
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from .checkpoint import MARKER, _fsync_dir, _quiet_dcp_logs, _rank, _root_cause, complete_checkpoints
from components.errors import UserError

_PATH_OPT = "--checkpoint.initial_load_path"
_HF_OPT = "--checkpoint.initial_load_in_hf"
_EXPORT_OPT = "[checkpoint] last_save_in_hf"
_DTYPE_OPT = "[checkpoint] export_dtype"
_OPTIONAL = re.compile(r"(^|\.)moe\.expert_bias$")  # router bias: not in every HF checkpoint
# The router bias in HF (DeepSeek's name); used for Qwen3 too, whose adapter has no such key.
_HF_BIAS = "model.layers.{}.mlp.gate.e_score_correction_bias"
_HF_BIAS_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias$")
_EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_SHARD_BYTES = 4 << 30  # larger exports are split into model-0000i-of-0000n.safetensors + index


def load_initial_weights(model: nn.Module, path: str, in_hf: bool, model_name: str) -> str:
    if not os.path.exists(path):
        kind = "a directory with *.safetensors" if in_hf else "a step-N checkpoint folder"
        raise UserError(f"{_PATH_OPT} {path!r} does not exist; expected {kind}")
    if in_hf:
        return _load_hf(model, path, model_name)
    return _load_dcp(model, path)


# --- DCP ----------------------------------------------------------------------------------------

def _load_dcp(model: nn.Module, path: str) -> str:
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, ".metadata")):
        steps = complete_checkpoints(path)
        hint = (f"set {_HF_OPT} true" if _safetensors_files_or_none(path) else
                f"pick a step-N folder in it, e.g. {steps[-1][1]!r}" if steps else
                "point it at a step-N folder written by recipes/pretrain.py, or pass a safetensors "
                f"directory with {_HF_OPT} true")
        raise UserError(f"{_PATH_OPT} {path!r} is not a DCP checkpoint (no .metadata); {hint}")
    if os.path.basename(path.rstrip("/")).startswith("step-") and not os.path.isfile(os.path.join(path, MARKER)):
        raise UserError(f"{_PATH_OPT} {path!r} is an incomplete checkpoint (no {MARKER} marker); pick another step")
    model_sd = get_model_state_dict(model)
    # Only the model: DCP reads the requested keys and skips the optimizer, scheduler and train state.
    # A model key missing from the checkpoint, or of another shape, fails (no allow_partial_load).
    state = {"app": {"model": model_sd}}
    try:
        with warnings.catch_warnings(), _quiet_dcp_logs():
            warnings.simplefilter("ignore", UserWarning)  # no process group in single-process runs
            dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        raise UserError(
            f"{_PATH_OPT} {path!r} could not be loaded into this model ({_root_cause(err)}); it is corrupt, "
            f"from another model or flavour, or in HF format ({_HF_OPT} true)"
        ) from None
    set_model_state_dict(model, state["app"]["model"])
    return f"model weights from DCP checkpoint {path} ({len(model_sd)} tensors)"


# --- HF safetensors -------------------------------------------------------------------------------

def _safetensors_files_or_none(path: str) -> list[str] | None:
    if os.path.isfile(path):
        return [path] if path.endswith(".safetensors") else None
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise UserError(f"{_PATH_OPT} {path!r}: model.safetensors.index.json is not valid ({err})") from None
        return [os.path.join(path, s) for s in shards]
    return sorted(glob.glob(os.path.join(path, "*.safetensors"))) or None


def _adapter(model: nn.Module, path: str | None, model_name: str, option: str = _HF_OPT):
    """torchtitan's state-dict adapter of ``model_name``; ``path`` only where it has an index."""
    from torchtitan.models.deepseek_v3.model.state_dict_adapter import DeepSeekV3StateDictAdapter
    from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

    adapters = {"deepseek_v3": DeepSeekV3StateDictAdapter, "qwen3": Qwen3StateDictAdapter}
    if model_name not in adapters:
        raise UserError(f"{option}: no HF weight conversion for [model] name = {model_name!r}; "
                        f"expected one of {', '.join(adapters)}")
    # The adapter reads model.safetensors.index.json when present (and warns when not; it only
    # matters for saving), so give it the directory only where the index exists.
    has_index = path is not None and os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    return adapters[model_name](model.model_args, path if has_index else None)


def _load_hf(model: nn.Module, path: str, model_name: str) -> str:
    from safetensors.torch import load_file

    files = _safetensors_files_or_none(path)
    if not files:
        raise UserError(f"{_PATH_OPT} {path!r} has no *.safetensors files; point it at a HF model directory, "
                        f"or set {_HF_OPT} false for a DCP step-N checkpoint")
    hf_sd = {}
    for file in files:
        if not os.path.isfile(file):
            raise UserError(f"{_PATH_OPT} {path!r}: shard {os.path.basename(file)!r} listed in "
                            "model.safetensors.index.json is missing; re-download the model")
        try:
            hf_sd.update(load_file(file, device="cpu"))
        except Exception as err:  # SafetensorError, OSError, ...
            raise UserError(f"{_PATH_OPT} {path!r}: {os.path.basename(file)!r} is not a readable safetensors "
                            f"file ({_root_cause(err)}); re-download or re-convert it") from None

    def wrong(detail: str) -> UserError:
        return UserError(f"{_PATH_OPT} {path!r} does not hold {model_name} weights of this flavour ({detail}); "
                         f"check [model] name/flavor, or set {_HF_OPT} false for a DCP checkpoint")

    hf_sd = {k: v for k, v in hf_sd.items() if not k.endswith("rotary_emb.inv_freq")}  # recomputed, not loaded
    num_experts = model.model_args.moe_args.num_experts
    for key in hf_sd:  # the adapter would silently regroup extra experts into the first ones
        m = re.search(r"\.experts\.(\d+)\.", key)
        if m and int(m.group(1)) >= num_experts:
            raise wrong(f"{key!r}: expert id >= num_experts {num_experts}")
    adapter = _adapter(model, path, model_name)
    biases = {}  # router biases the adapter does not map (Qwen3): layers.N.moe.expert_bias
    if _HF_BIAS not in adapter.from_hf_map:
        for key in [k for k in hf_sd if _HF_BIAS_RE.match(k)]:
            biases[f"layers.{_HF_BIAS_RE.match(key).group(1)}.moe.expert_bias"] = hf_sd.pop(key)
    try:
        converted = adapter.from_hf(hf_sd)
    except KeyError as err:  # an HF key the adapter does not know: another model family
        raise wrong(f"unknown tensor {err.args[0]!r}") from None
    except Exception as err:
        raise wrong(_root_cause(err)) from None
    converted.update(biases)

    target = model.state_dict()
    missing = sorted(k for k in target if k not in converted and not _OPTIONAL.search(k))
    unexpected = sorted(k for k in converted if k not in target)
    if missing or unexpected:
        detail = (f"{len(missing)} missing, e.g. {missing[0]!r}" if missing else
                  f"{len(unexpected)} unexpected, e.g. {unexpected[0]!r}")
        raise wrong(detail)
    for key, value in converted.items():
        if tuple(value.shape) != tuple(target[key].shape):
            raise wrong(f"{key!r} has shape {tuple(value.shape)}, the model {tuple(target[key].shape)}")
        converted[key] = value.to(dtype=target[key].dtype)
    model.load_state_dict(converted, strict=False)
    n_files = f"{len(files)} file{'s' if len(files) > 1 else ''}"
    return f"model weights from HF safetensors {path} ({n_files}, {len(converted)} tensors)"


# --- HF export ------------------------------------------------------------------------------------

def export_hf(model: nn.Module, folder: str, model_name: str, export_dtype: str = "float32",
              max_shard_bytes: int = MAX_SHARD_BYTES) -> str:
    """Write ``model``'s full state as HF safetensors into ``folder`` (replacing it); returns ``folder``.

    Collective: every rank calls it; the state is gathered from its FSDP / expert-parallel shards
    onto rank 0's CPU, and rank 0 alone converts it with torchtitan's adapter and writes
    ``folder + ".partial"``, then renames it, so ``folder`` is never half-written. Floating tensors
    are cast to ``export_dtype``; the others keep their dtype. An export above ``max_shard_bytes``
    is split into shards listed in ``model.safetensors.index.json``.
    Every rank returns, or every rank raises the same one-line UserError.
    """
    if export_dtype not in _EXPORT_DTYPES:
        raise UserError(f"{_DTYPE_OPT} = {export_dtype!r} is not supported; use one of "
                        f"{', '.join(repr(d) for d in _EXPORT_DTYPES)}")
    adapter = _adapter(model, None, model_name, _EXPORT_OPT)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    error = None
    if _rank() == 0:  # the other ranks got an empty state
        try:
            _write_hf(_to_hf(adapter, model, state, model_name), folder, _EXPORT_DTYPES[export_dtype],
                      max_shard_bytes)
        except UserError as err:
            error = str(err)
        except Exception as err:  # OSError (disk full, permissions), SafetensorError, ...
            error = (f"{_EXPORT_OPT}: writing {folder!r} failed ({_root_cause(err)}); check the free space and "
                     "permissions there, or set it to false (the DCP checkpoint holds the same weights)")
    del state
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise UserError(error)
    return folder


def _to_hf(adapter, model: nn.Module, state: dict, model_name: str) -> dict:
    """HF name -> tensor (views of ``state``). Every key of ``state`` is exported, except a tied
    ``output.weight`` and an all-zero router bias that the adapter has no HF name for."""
    tied = bool(getattr(model.model_args, "enable_weight_tying", False))
    hf = {}
    for key, value in state.items():
        try:
            out = adapter.to_hf({key: value})
        except KeyError:  # DeepSeek's adapter raises for a name it does not know
            out = {}
        if not out:
            layer = re.match(r"^layers\.(\d+)\.", key)
            if _OPTIONAL.search(key) and layer:  # Qwen3: no HF router bias; keep a used one anyway
                out = {_HF_BIAS.format(layer.group(1)): value} if bool(value.any()) else {}
            elif not (tied and key == "output.weight"):  # tied: the loader takes it from the embedding
                raise UserError(f"{_EXPORT_OPT}: {key!r} of this {model_name} model has no HF name in "
                                "torchtitan's state-dict adapter; set it to false (the DCP checkpoint holds "
                                "the weights)")
        for hf_key in out:
            if hf_key in hf:
                raise UserError(f"{_EXPORT_OPT}: two tensors of this {model_name} model map to HF {hf_key!r}; "
                                "set it to false (the DCP checkpoint holds the weights)")
        hf.update(out)
    return hf


def _write_hf(hf: dict, folder: str, dtype: torch.dtype, max_shard_bytes: int) -> None:
    """Rank 0: ``hf`` cast to ``dtype`` into ``folder + ".partial"``, then renamed to ``folder``.
    One shard of copies is in memory at a time."""
    from safetensors.torch import save_file

    def out_dtype(t: torch.Tensor) -> torch.dtype:
        return dtype if t.is_floating_point() else t.dtype

    sizes = {k: v.numel() * out_dtype(v).itemsize for k, v in hf.items()}
    shards, current, current_bytes = [], [], 0
    for key in hf:  # adapter order: layer by layer
        if current and current_bytes + sizes[key] > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(key)
        current_bytes += sizes[key]
    shards.append(current)
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]

    folder = os.path.abspath(folder)
    partial = folder + ".partial"
    shutil.rmtree(partial, ignore_errors=True)  # a killed export's leftovers
    os.makedirs(partial)
    for name, keys in zip(names, shards):
        # copies: safetensors refuses views sharing storage (split experts, tied weights)
        tensors = {k: hf[k].to(dtype=out_dtype(hf[k]), copy=True, memory_format=torch.contiguous_format)
                   for k in keys}
        save_file(tensors, os.path.join(partial, name), metadata={"format": "pt"})
        del tensors
        _fsync_file(os.path.join(partial, name))
    if n > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {k: name for name, keys in zip(names, shards) for k in keys}}
        path = os.path.join(partial, "model.safetensors.index.json")
        with open(path, "w") as f:
            json.dump(index, f, indent=2)
        _fsync_file(path)
    _fsync_dir(partial)
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    os.rename(partial, folder)
    _fsync_dir(os.path.dirname(folder))


def _fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())
