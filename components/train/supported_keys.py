"""Which of torchtitan 0.2.2's JobConfig keys this recipe honours.

Every key of the schema is either honoured (listed in ``HONOURED``) or must keep torchtitan's
default: a config that sets an un-honoured key to anything else stops before any work with one
line, ``error: not supported by this recipe: [section] key = value (...)``. moe-echo's own keys
(``[moe_echo]`` and the keys components/train/job_config.py adds) are all honoured.
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
    "model": {"name", "flavor", "hf_assets_path", "print_after_conversion"},
    "optimizer": {"name", "lr", "beta1", "beta2", "eps", "weight_decay", "implementation"},
    "lr_scheduler": {"warmup_steps", "total_steps", "decay_ratio", "decay_type", "min_lr_factor"},
    # global_batch_size: only the value without gradient accumulation (checked in config.validate)
    "training": {"local_batch_size", "global_batch_size", "seq_len", "max_norm", "steps", "mixed_precision_param",
                 "mixed_precision_reduce", "gc_freq", "gc_debug"},
    # the other degrees are range-checked (1) in config.validate
    "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
                    "expert_parallel_degree", "tensor_parallel_degree", "pipeline_parallel_degree",
                    "context_parallel_degree", "expert_tensor_parallel_degree"},
    "checkpoint": {"enable", "folder", "interval", "initial_load_path", "initial_load_in_hf", "keep_latest_k",
                   "load_step", "last_save_in_hf", "export_dtype", "load_only", "enable_first_step_checkpoint"},
    "activation_checkpoint": {"mode", "selective_ac_option", "preserve_rng_state"},
    "compile": {"enable", "components", "backend"},
    "comm": {"init_timeout_seconds", "train_timeout_seconds"},
    "debug": {"seed", "deterministic", "deterministic_warn_only"},
}

_HINTS = {
    "model.converters": "FP8/quantisation converters are not applied; remove the key",
    "model.tokenizer_path": "use [model] hf_assets_path",
    "optimizer.early_step_in_backward": "the optimizer steps after backward (it is gated on the device)",
    "training.dtype": "use [training] mixed_precision_param",
    "parallelism.expert_parallel_comm_backend": "choose the dispatcher with [moe_echo] dispatcher",
    "validation.enable": "held-out evaluation is not implemented; remove the [validation] section",
    "checkpoint.async_mode": "checkpoints are saved synchronously; remove the key",
    "metrics.enable_wandb": "TensorBoard is the supported logger ([metrics] enable_tensorboard)",
}


def check_supported(cfg, ours) -> None:
    """Raise ``UserError`` for the first key outside ``HONOURED`` (and not in ``ours``, moe-echo's
    own JobConfig) whose value differs from torchtitan's default."""
    own = {f.name: f.type for f in dataclasses.fields(ours)}
    for sec in dataclasses.fields(cfg):
        section = getattr(cfg, sec.name)
        if not dataclasses.is_dataclass(section):
            continue
        own_keys = {f.name for f in dataclasses.fields(own[sec.name])} if sec.name in own else set()
        for f in dataclasses.fields(section):
            if f.name in HONOURED.get(sec.name, set()) or f.name in own_keys:
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            value = getattr(section, f.name)
            if value != default:
                hint = _HINTS.get(f"{sec.name}.{f.name}", f"remove it or set it to torchtitan's default {default!r}")
                raise UserError(f"not supported by this recipe: [{sec.name}] {f.name} = {value!r} ({hint})")
