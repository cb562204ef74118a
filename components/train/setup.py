"""What a training recipe builds before its first step, from the config (recipes/pretrain.py and
recipes/finetune.py compose these):

    run = start(argv)                                   # config, processes, device meshes, seed
    tokenizer, loader = build_data(run)                 # tokenizer, this rank's token batches
    model, n_params, flops_per_token = build_parallel_model(run, tokenizer)   # EP-sharded, FSDP-wrapped
    tr = build_training(run, model, loader)             # precision, optimizer, lr schedule, step gate, states
    if not resume(run, tr, model): return               # own checkpoint, else initial weights

Every bad value ends as a ``UserError`` (one line, exit code 2) before any step runs.
"""

import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

from components.errors import UserError
from components.moe_echo.dispatcher import is_fixed_capacity
from components.moe_echo.fp8_experts import check_fp8_supported
from components.moe_echo.gathered_experts import check_gathered_supported
from components.moe_echo.quack_experts import check_quack_supported
from components.moe_echo.models import build_model, model_args_for, moe_layers, shape_overrides
from components.moe_echo.weight_copies import WeightCopies, weight_copies
from components.parallel.cuda_graph import make_capturable
from components.parallel.data_parallel import init_distributed
from components.parallel.grad_norm import clip_grad_norm_
from components.parallel.mesh import Meshes, ParallelDims, build_mesh, parallel_dims
from components.parallel.parallelize import parallelize

from . import checkpoint, float8
from .fp8_head import GEMMS, Fp8Head
from .config import check_global_batch, load_config
from .data import TokenBatchLoader, build_token_stream
from .hf_weights import load_initial_weights
from .master_adamw import masters_in_model, refresh_compute_copies
from .optim import build_lr_scheduler, build_optimizer
from .overflow import StepGate, stop_on_overflow
from .tokenizer import build_tokenizer
from .train_state import LRSchedule, ModelAndOptimizer, TrainState


@dataclass
class Run:
    """The parsed config and this process's place in the job."""

    cfg: object
    rank: int
    world: int
    device: torch.device
    dims: ParallelDims
    mesh: Meshes | None
    seed: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def say(self, text: str) -> None:
        """Print on rank 0 only."""
        if self.is_main:
            print(text, flush=True)


@dataclass
class Training:
    """What the training step uses besides the model: its MoE layers, the optimizer (fp32 masters
    when ``master``), lr schedule, device step gate (overflow replay, non-finite guard), the
    precision context and the checkpointed states."""

    layers: list
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    gate: StepGate | None
    state: TrainState
    states: dict
    autocast: Callable
    master: bool
    scale_into: torch.optim.Optimizer | None  # where clipping goes (the optimizer divides by its grad_scale)
    fixed: bool  # a fixed-capacity dispatcher (nvlink, padded) runs the step
    replay: bool  # its overflowed steps are replayed exactly (else: the run stops)
    ckpt_dir: str
    max_norm: float  # [training] max_norm
    capacity_factor: float  # [moe_echo] capacity_factor as configured (named by on_overflow = "stop")
    copies: WeightCopies  # the experts' weight copies the optimizer writes (clipping counts their gradients)

    def clip_and_gate(self, model: torch.nn.Module, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """After backward, before the optimizer step: clip the gradients to ``max_norm`` (inside the optimizer's
        step where it divides by a ``grad_scale``) and decide on the device whether the step is applied. Returns
        (gradient norm, skip flag or None); the flag (an overflowed or non-finite step) makes the optimizer step a
        no-op and is read by the host one step late. With on_overflow = "stop" this reads the overflow count
        (a host read: the step cannot be captured) and raises if anything overflowed."""
        grad_norm = clip_grad_norm_(list(model.parameters()), self.max_norm, self.scale_into, copies=self.copies)
        skip = self.gate.gate(loss, grad_norm) if self.gate is not None else None
        if self.fixed and not self.replay:
            stop_on_overflow(self.layers, self.state.step, self.capacity_factor)
        return grad_norm, skip


def check_device(cfg, device: torch.device) -> None:
    """One-line error where the config asks for what ``device`` cannot run (FP8, QuACK). The float8 converter is
    checked first: it also turns the experts to FP8, so its error (remove it, or emulate) is the one to act on."""
    if float8.requested(cfg):
        float8.check_float8(cfg, device)
    if cfg.moe_echo.expert_precision == "fp8":
        check_fp8_supported(device)
    if cfg.moe_echo.experts_gemm == "quack" and cfg.moe_echo.expert_precision == "bf16":
        check_quack_supported(device)


def start(argv: list[str]) -> Run:
    """Parse the config, start the process group, build the device meshes."""
    cfg = load_config(argv)
    m = cfg.model
    moe_args = getattr(model_args_for(m.name, m.flavor, shape_overrides(m)), "moe_args", None)
    rank, world, device = init_distributed(cfg.comm.init_timeout_seconds)
    check_device(cfg, device)
    dims = parallel_dims(cfg.parallelism, world, moe_args.num_experts if moe_args else None)
    if cfg.moe_echo.gathered_experts:
        check_gathered_supported(cfg.moe_echo, dims.ep, device)
    check_global_batch(cfg, world)
    mesh = build_mesh(dims, device.type)
    if cfg.debug.deterministic:  # cuBLAS needs a fixed workspace for deterministic GEMMs
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=cfg.debug.deterministic_warn_only)
    run = Run(cfg, rank, world, device, dims, mesh, cfg.training.seed if cfg.debug.seed is None else cfg.debug.seed)
    if cfg.job.print_config:
        run.say(str(cfg))
    return run


def build_data(run: Run):
    """(tokenizer, loader): this rank's batches of ``local_batch_size`` × ``seq_len`` tokens."""
    t, m = run.cfg.training, run.cfg.model
    tokenizer = build_tokenizer(m.hf_assets_path)
    tokens = build_token_stream(t.dataset, t.dataset_path, tokenizer, text_field=t.text_field,
                                max_bytes=t.max_corpus_mb * 1_000_000)
    loader = TokenBatchLoader(tokens, t.local_batch_size, t.seq_len, rank=run.rank, world_size=run.world,
                              seed=run.seed)
    return tokenizer, loader


def build_parallel_model(run: Run, tokenizer):
    """(model, n_params, flops_per_token): built whole on every rank (same seed), then EP-sharded
    and FSDP-wrapped (components/parallel/parallelize.py)."""
    cfg, m, t = run.cfg, run.cfg.model, run.cfg.training
    model = build_model(m.name, m.flavor, cfg.moe_echo, seq_len=t.seq_len, device=run.device, seed=run.seed,
                        overrides=shape_overrides(m))
    vocab = model.model_args.vocab_size
    if tokenizer.get_vocab_size() > vocab:
        raise UserError(f"tokenizer at [model] hf_assets_path = {m.hf_assets_path!r} has "
                        f"{tokenizer.get_vocab_size()} ids but the model has vocab_size {vocab}; "
                        f"set --model.vocab_size {tokenizer.get_vocab_size()} (or more) or use a smaller tokenizer")
    n_params, flops_per_token = model.model_args.get_nparams_and_flops(model, t.seq_len)
    if float8.requested(cfg):
        swapped = float8.convert_float8(model, cfg, fsdp=run.dims.fsdp)
        f8 = cfg.quantize.linear.float8
        gather = ("; all-gathered in FP8" if float8.fp8_all_gather(cfg, run.dims.fsdp) else
                  "; enable_fsdp_float8_all_gather has no effect without FSDP" if f8.enable_fsdp_float8_all_gather
                  else "")
        run.say(f"float8: {len(swapped)} linear layers in FP8 ({f8.recipe_name or 'tensorwise'}"
                f"{', emulated' if f8.emulate else ''}{gather}); kept: router gates, "
                f"{', '.join(float8.kept_names(f8))}")
        if cfg.moe_echo.dense_ffn_kernels == "experts":
            run.say(f"float8: {len(float8.dense_ffns(model))} dense feed-forwards (shared experts, dense layers) "
                    f"through the FP8 experts' kernels, one scale per token row")
        if cfg.moe_echo.dense_linear_kernels == "experts":
            run.say(f"float8: {len(float8.rows_linears(model))} linear layers (attention projections) through the FP8 experts' kernels "
                    f"(Fp8RowsLinear), one scale per token row")
        if isinstance(head := getattr(model, float8.HEAD, None), Fp8Head):
            kind = str(head.grad_dtype).removeprefix("torch.float8_").removesuffix("fn")  # e5m2 / e4m3
            if head.takes_fp8_grad:
                run.say(f"float8: the loss writes the logits' gradient in FP8 ({kind}) for the output head's "
                        f"{' and '.join(head.fp8_backward)} GEMM{'s' * (len(head.fp8_backward) > 1)}, in its one pass")
            if bf16 := [g for g in GEMMS if g not in head.fp8_gemms]:
                run.say(f"float8: the output head's {', '.join(bf16)} GEMM{'s' * (len(bf16) > 1)} in bf16")
        if note := float8.head_note(swapped, getattr(model, float8.HEAD, None)):
            run.say(note)
        if note := float8.uncompiled_note(cfg):
            run.say(note)
    model = parallelize(model, run.mesh, run.dims, cfg, run.device)
    if m.print_after_conversion:
        run.say(str(model))
    return model, n_params, flops_per_token


def build_training(run: Run, model: torch.nn.Module, loader: TokenBatchLoader) -> Training:
    """Precision (bf16 parameters + fp32 masters on one GPU without FSDP, else autocast or FSDP's
    policy), optimizer, lr schedule, the step gate and the states a checkpoint holds."""
    cfg, t, device = run.cfg, run.cfg.training, run.device
    layers = moe_layers(model)
    use_bf16 = device.type == "cuda" and t.mixed_precision_param == "bfloat16" and not run.dims.fsdp  # FSDP casts
    master = (use_bf16 and t.master_weights and cfg.optimizer.name == "AdamW"
              and not any(hasattr(p, "to_local") for p in model.parameters()))
    autocast = ((lambda: torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=not t.cuda_graph))
                if use_bf16 and not master else nullcontext)
    fixed = any(is_fixed_capacity(moe.dispatcher) for _, moe in layers)
    replay = fixed and cfg.moe_echo.on_overflow == "replay"
    gated = replay or t.max_nonfinite_steps > 0
    copies = use_copies(run, model)
    if copies:  # experts outside FSDP: the optimizer writes their bf16 copies
        for _, moe in layers:
            moe.enable_compute_copies()
    if master or copies:  # FP8 experts without ECHO: the optimizer writes their FP8 copies too
        for _, moe in layers:
            moe.enable_fp8_copies()
    if cfg.moe_echo.expert_precision == "fp8":
        n = sum(moe.experts.fp8_copies is not None for _, moe in layers)
        wgrad = layers[0][1].experts.wgrad_precision if layers else cfg.moe_echo.expert_wgrad_precision
        run.say(f"fp8 experts: weight scales per {cfg.moe_echo.expert_fp8_scaling}; weight copies written by the "
                f"optimizer step in {n} of {len(layers)} MoE layers"
                + ("" if n == len(layers) else "; the others cast their weights in each pass (per-channel "
                   "scales, gathered experts, or no optimizer that writes copies)")
                + f"; weight gradients in {wgrad}")
    optimizer = build_optimizer(model, cfg.optimizer, gated=gated, master_dtype=torch.bfloat16 if master else None)
    if float8.requested(cfg) and float8.fp8_all_gather(cfg, run.dims.fsdp) and \
            cfg.quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp:
        optimizer.register_step_post_hook(lambda *_: float8.precompute_scales_(model))  # inside the captured step
    scale_into = optimizer if device.type == "cuda" and (master or cfg.optimizer.implementation == "fused") else None
    scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, t.steps)
    state = TrainState(loader)
    states = {"app": ModelAndOptimizer(model, optimizer), "lr_scheduler": LRSchedule(scheduler), "train": state}
    gate = (StepGate(layers if replay else [], optimizer, device, cfg.moe_echo.grow_capacity_after,
                     check_finite=t.max_nonfinite_steps > 0) if gated else None)
    ckpt_dir = os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder)
    return Training(layers, optimizer, scheduler, gate, state, states, autocast, master, scale_into, fixed, replay,
                    ckpt_dir, t.max_norm, cfg.moe_echo.capacity_factor, copies=weight_copies(model))


def use_copies(run: Run, model: torch.nn.Module) -> bool:
    """[training] master_weights with FSDP: experts outside FSDP (each with one owner, cast for compute) keep
    persistent bf16 copies written by the optimizer (fused AdamW) instead of casting weights and gradients
    every step."""
    t, o = run.cfg.training, run.cfg.optimizer
    owned = [moe for _, moe in moe_layers(model) if moe.experts.compute_dtype is not None]
    return bool(owned) and t.master_weights and o.name == "AdamW" and o.implementation == "fused"


def verify_initial_weights(run: Run) -> None:
    """Before anything is built: a ``step-N`` folder in ``[checkpoint] initial_load_path`` is checked as a
    resume checks its own checkpoint (a damaged file is one line, exit 2), unless the run's own checkpoint
    will be resumed instead."""
    ckpt = run.cfg.checkpoint
    own = os.path.join(run.cfg.job.dump_folder, ckpt.folder)
    if ckpt.initial_load_path and not ckpt.initial_load_in_hf and not (ckpt.enable and checkpoint.complete_checkpoints(own)):
        checkpoint.verify_initial(ckpt.initial_load_path)


def resume(run: Run, tr: Training, model: torch.nn.Module) -> bool:
    """Load the run's own newest verified checkpoint, or on a fresh run the initial weights
    (``[checkpoint] initial_load_path``: weights only). False: nothing left to do."""
    cfg, t, ckpt = run.cfg, run.cfg.training, run.cfg.checkpoint
    found = checkpoint.find_resumable(tr.ckpt_dir, ckpt.load_step) if ckpt.enable else None
    if found is not None:  # the run's own checkpoint always wins over initial_load_path
        checkpoint.load(found[1], tr.states)
    elif ckpt.initial_load_path:  # model weights only (DCP step-N folder or HF safetensors)
        if not ckpt.initial_load_in_hf:  # the model the checkpoint was saved with, else one line naming the key
            checkpoint.check_model_shape(ckpt.initial_load_path, model,
                                         f"[checkpoint] initial_load_path {ckpt.initial_load_path!r}")
        with masters_in_model(tr.optimizer):  # into the fp32 masters, when the optimizer keeps them
            loaded = load_initial_weights(model, ckpt.initial_load_path, ckpt.initial_load_in_hf, cfg.model.name)
        if tr.master:
            tr.optimizer.sync_params()
        refresh_compute_copies(model, tr.optimizer)
        run.say(f"initial weights: {loaded}")
    if tr.state.step >= t.steps:
        run.say(f"nothing to do: {found[1] if found else cfg.job.dump_folder} is at step {tr.state.step}, "
                f"[training] steps = {t.steps}; raise --training.steps to train further")
        return False
    if found is not None:
        run.say(f"resumed from {found[1]} (step {tr.state.step})")
    if t.cuda_graph and run.device.type == "cuda":
        make_capturable(tr.optimizer, run.device)  # tensor lr filled by the scheduler, device step counters
    return True
