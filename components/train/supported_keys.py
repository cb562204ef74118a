"""Which of torchtitan 0.2.2's JobConfig keys this recipe honours, and why it refuses the others.

Every key of the schema is either honoured (listed in ``HONOURED``) or refused: it must keep
torchtitan's default, and a config that sets it to anything else stops before any work with one
line, ``error: not supported by this recipe: [section] key = value (reason); ...``. ``--help``
marks refused keys with the same reason. moe-echo's own keys (``[moe_echo]`` and the keys
components/train/job_config.py adds) are all honoured.
"""

import dataclasses

from components.errors import UserError

# section -> keys whose every value is honoured (some are range-checked in config.validate)
HONOURED: dict[str, set[str]] = {
    "job": {"config_file", "dump_folder", "description", "print_config"},
    "profiling": {"enable_profiling", "save_traces_folder", "profile_freq", "profiler_active", "profiler_warmup",
                  "enable_memory_snapshot", "save_memory_snapshot_folder"},
    # no colour is ever printed, so either value of disable_color_printing holds
    "metrics": {"log_freq", "enable_tensorboard", "save_tb_folder", "disable_color_printing"},
    "model": {"name", "flavor", "hf_assets_path", "print_after_conversion", "converters"},  # converters: float8.py
    "quantize.linear.float8": {"recipe_name", "filter_fqns", "emulate", "enable_fsdp_float8_all_gather",
                               "precompute_float8_dynamic_scale_for_fsdp"},
    "optimizer": {"name", "lr", "beta1", "beta2", "eps", "weight_decay", "implementation"},
    "lr_scheduler": {"warmup_steps", "total_steps", "decay_ratio", "decay_type", "min_lr_factor"},
    # global_batch_size: only the value without gradient accumulation (checked in config.validate)
    "training": {"local_batch_size", "global_batch_size", "seq_len", "max_norm", "steps", "mixed_precision_param",
                 "mixed_precision_reduce", "gc_freq", "gc_debug"},
    "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
                    "expert_parallel_degree"},
    "checkpoint": {"enable", "folder", "interval", "initial_load_path", "initial_load_in_hf", "keep_latest_k",
                   "load_step", "last_save_in_hf", "export_dtype", "load_only", "enable_first_step_checkpoint"},
    "activation_checkpoint": {"mode", "selective_ac_option", "preserve_rng_state"},
    "compile": {"enable", "components", "backend"},
    "comm": {"init_timeout_seconds", "train_timeout_seconds"},
    "debug": {"seed", "deterministic", "deterministic_warn_only"},
}

_NO_TP = "tensor parallelism is not implemented: experts scale with expert_parallel_degree, the rest with FSDP"
_NO_PP = "pipeline parallelism is not implemented: experts scale with expert_parallel_degree, the rest with FSDP"
_NO_CP = "context parallelism is not implemented: each sequence stays on one rank"
_TITAN_TRAINER = "read by torchtitan's own trainer (components/train/torchtitan_spec.py), not by this recipe"

# Why a key is refused: "section.key", else its section ("section"); anything else: _DEFAULT_REASON.
_REASONS = {
    "job.save_config_file": _TITAN_TRAINER,
    "job.custom_config_module": _TITAN_TRAINER,
    "experimental": _TITAN_TRAINER,
    "metrics.save_for_all_ranks": "rank 0 writes the logs",
    "metrics.enable_wandb": "TensorBoard is the supported logger ([metrics] enable_tensorboard)",
    "model.tokenizer_path": "deprecated by torchtitan; use [model] hf_assets_path",
    "optimizer.early_step_in_backward": "the optimizer steps after backward (it is gated on the device)",
    "training.dtype": "use [training] mixed_precision_param",
    "training.enable_cpu_offload": "FSDP's CPU offload is not implemented",
    "training.dataloader": "the token loader runs in the training process, without worker processes",
    "parallelism.tensor_parallel_degree": _NO_TP,
    "parallelism.disable_loss_parallel": _NO_TP,
    "parallelism.enable_async_tensor_parallel": _NO_TP,
    "parallelism.expert_tensor_parallel_degree": "experts are not split by tensor parallelism: each lives whole on "
                                                 "one EP rank (scale them with expert_parallel_degree)",
    "parallelism.pipeline_parallel_degree": _NO_PP,
    "parallelism.module_fqns_per_model_part": _NO_PP,
    "parallelism.context_parallel_degree": _NO_CP,
    "parallelism.expert_parallel_comm_backend": "choose the token dispatcher with [moe_echo] dispatcher",
    "checkpoint.enable_ft_dataloader_checkpoints": "TorchFT is not integrated",
    "checkpoint.initial_load_model_only": "initial_load_path always loads the model weights only",
    "checkpoint.initial_load_in_hf_quantized": "quantized HF checkpoints are not read",
    "checkpoint.last_save_model_only": "every save holds the model, optimizer and train state (HF export of "
                                       "the weights: last_save_in_hf)",
    "checkpoint.async_mode": "checkpoints are saved synchronously",
    "checkpoint.exclude_from_loading": "a resume loads every state it saved",
    "checkpoint.create_seed_checkpoint": "every rank builds the same initial weights from the seed",
    "activation_checkpoint": "only mode, selective_ac_option and preserve_rng_state are applied",
    "quantize": 'of torchao\'s quantised training only [quantize.linear.float8] is applied (with [model] '
                'converters = ["float8"]; FP8 routed experts: [moe_echo] expert_precision)',
    "comm": "the NCCL flight recorder and fake/local communication modes are not set up by this recipe",
    "memory_estimation": "memory estimation is not implemented",
    "fault_tolerance": "TorchFT is not integrated; a stopped run resumes from its last checkpoint",
    "validation": "held-out evaluation is not implemented",
    "debug.moe_force_load_balance": "to set the expert load use [moe_echo] debug_hot_experts and bias_update_rate",
}
_DEFAULT_REASON = "not used by this recipe"


def refusal_reason(section: str, key: str) -> str:
    """Why ``[section] key`` is refused (``section`` may be dotted, e.g. "training.dataloader")."""
    top = section.split(".")[0]
    for where in (f"{section}.{key}", f"{top}.{section.split('.')[1]}" if "." in section else None, top):
        if where in _REASONS:
            return _REASONS[where]
    if key.startswith("pipeline_parallel_"):
        return _NO_PP
    if key.startswith("context_parallel_"):
        return _NO_CP
    return _DEFAULT_REASON


def is_refused(section: str, key: str, ours) -> bool:
    """True for a key of torchtitan's schema this recipe does not honour (``section`` may be dotted;
    ``ours``: moe-echo's own JobConfig, whose keys are all honoured)."""
    if key in HONOURED.get(section, set()):  # a key of a nested section honoured by its full name
        return False
    top, _, sub = section.partition(".")
    own = {f.name: f.type for f in dataclasses.fields(ours)}
    if top in own and (sub or key) in {f.name for f in dataclasses.fields(own[top])}:
        return False
    return (sub or key) not in HONOURED.get(top, set())


def check_supported(cfg, ours, where: str = "") -> None:
    """Raise ``UserError`` for the first refused key (see ``is_refused``) whose value differs from
    torchtitan's default."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if not where:
            if dataclasses.is_dataclass(value):
                check_supported(value, ours, f.name)
            continue
        if dataclasses.is_dataclass(value) and not is_refused(where, f.name, ours):
            continue  # a nested section of an honoured key
        if dataclasses.is_dataclass(value):
            check_supported(value, ours, f"{where}.{f.name}")
            continue
        if not is_refused(where, f.name, ours):
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if value != default:
            raise UserError(f"not supported by this recipe: [{where}] {f.name} = {value!r} "
                            f"({refusal_reason(where, f.name)}); remove it or set torchtitan's default {default!r}")
