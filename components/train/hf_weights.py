"""Initial weights for fine-tuning: a DCP ``step-N`` checkpoint of this repo, or HF safetensors.

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
  ``expert_bias`` (DeepSeek's ``e_score_correction_bias`` is optional; Qwen3 has none), which
  then keeps its initial value (zeros). Tensors are cast to the model's dtypes.

Any failure is a one-line ``UserError`` naming the path and the option to fix.
"""

import glob
import json
import os
import re
import warnings

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from .checkpoint import MARKER, _quiet_dcp_logs, _root_cause, complete_checkpoints
from .errors import UserError

_PATH_OPT = "--checkpoint.initial_load_path"
_HF_OPT = "--checkpoint.initial_load_in_hf"
_OPTIONAL = re.compile(r"(^|\.)moe\.expert_bias$")  # router bias: not in every HF checkpoint


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


def _adapter(model: nn.Module, path: str, model_name: str):
    from torchtitan.models.deepseek_v3.model.state_dict_adapter import DeepSeekV3StateDictAdapter
    from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

    adapters = {"deepseek_v3": DeepSeekV3StateDictAdapter, "qwen3": Qwen3StateDictAdapter}
    if model_name not in adapters:
        raise UserError(f"{_HF_OPT}: no HF weight conversion for [model] name = {model_name!r}; "
                        f"expected one of {', '.join(adapters)}")
    # The adapter reads model.safetensors.index.json when present (and warns when not; it only
    # matters for saving), so give it the directory only where the index exists.
    has_index = os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
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
    try:
        converted = adapter.from_hf(hf_sd)
    except KeyError as err:  # an HF key the adapter does not know: another model family
        raise wrong(f"unknown tensor {err.args[0]!r}") from None
    except Exception as err:
        raise wrong(_root_cause(err)) from None

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
