"""Pretrain a torchtitan MoE model (deepseek_v3 or qwen3) with moe-echo's MoE layer.

    python recipes/pretrain.py --job.config_file train_configs/debug_cpu.toml [--training.steps 20]
    torchrun --nproc_per_node 2 recipes/pretrain.py --job.config_file ...

Reads top to bottom: config → process group → tokenizer + data → model → optimizer → resume →
train loop (forward, backward, clip, gated optimizer step, router-bias update; confirmed one step
late, overflowed steps replayed exactly, non-finite ones skipped) → checkpoints → summary.
Exit codes: 2 bad input, 3 too many non-finite steps, 4 a peer rank hung (components/train/entry.py).
"""

import gc
import os
import sys
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

import torch
import torch.nn.functional as F

from components.errors import NonFiniteError, UserError
from components.moe_echo.dispatcher import is_fixed_capacity
from components.moe_echo.models import build_model, model_args_for, moe_layers
from components.moe_echo.nvlink_dispatch import peer_memory_bytes
from components.parallel.cuda_graph import StepGraph, make_capturable
from components.parallel.data_parallel import allreduce_sum, init_distributed, set_timeout
from components.parallel.grad_norm import clip_grad_norm_
from components.parallel.host_copy import HostCopy, to_device_async
from components.parallel.mesh import build_mesh, parallel_dims
from components.parallel.parallelize import parallelize
from components.train import checkpoint, faults
from components.train.config import check_global_batch, load_config
from components.train.data import TokenBatchLoader, build_token_stream
from components.train.entry import run_recipe
from components.train.hf_weights import export_hf, load_initial_weights
from components.train.nonfinite import first_nonfinite
from components.train.optim import build_lr_scheduler, build_optimizer
from components.train.overflow import StepGate, StepPipeline
from components.train.profiling import StepProfiler
from components.train.step_log import StepLogger, prepare_logs
from components.train.tokenizer import build_tokenizer
from components.train.train_state import ModelAndOptimizer, TrainState, params_finite
from components.train.watchdog import StepWatchdog


def train(argv: list[str]) -> None:
    # --- config and processes -------------------------------------------------------------------
    cfg = load_config(argv)
    t, m, ckpt = cfg.training, cfg.model, cfg.checkpoint
    seed = t.seed if cfg.debug.seed is None else cfg.debug.seed
    moe_args = getattr(model_args_for(m.name, m.flavor), "moe_args", None)
    rank, world, device = init_distributed(cfg.comm.init_timeout_seconds)
    dims = parallel_dims(cfg.parallelism, world, moe_args.num_experts if moe_args else None)
    check_global_batch(cfg, world)
    mesh = build_mesh(dims, device.type)
    is_main, dump = rank == 0, cfg.job.dump_folder
    if cfg.debug.deterministic:  # cuBLAS needs a fixed workspace for deterministic GEMMs
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=cfg.debug.deterministic_warn_only)
    if is_main and cfg.job.print_config:
        print(cfg)

    # --- tokenizer and data -----------------------------------------------------------------------
    tokenizer = build_tokenizer(m.hf_assets_path)
    tokens = build_token_stream(t.dataset, t.dataset_path, tokenizer, text_field=t.text_field,
                                max_bytes=t.max_corpus_mb * 1_000_000)
    loader = TokenBatchLoader(tokens, t.local_batch_size, t.seq_len, rank=rank, world_size=world, seed=seed)

    # --- model: built whole on every rank (same seed), then EP-sharded and FSDP-wrapped ------------
    model = build_model(m.name, m.flavor, cfg.moe_echo, seq_len=t.seq_len, device=device, seed=seed)
    vocab = model.model_args.vocab_size
    if tokenizer.get_vocab_size() > vocab:
        raise UserError(f"tokenizer at [model] hf_assets_path = {m.hf_assets_path!r} has "
                        f"{tokenizer.get_vocab_size()} ids but flavour {m.flavor!r} has vocab_size {vocab}; "
                        "pick a flavour with a larger vocabulary or a smaller tokenizer")
    n_params, flops_per_token = model.model_args.get_nparams_and_flops(model, t.seq_len)
    model = parallelize(model, mesh, dims, cfg, device)
    if is_main and m.print_after_conversion:
        print(model)
    layers = moe_layers(model)
    use_bf16 = device.type == "cuda" and t.mixed_precision_param == "bfloat16" and not dims.fsdp  # FSDP casts
    autocast = ((lambda: torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=not t.cuda_graph)) if use_bf16
                else nullcontext)

    fixed = any(is_fixed_capacity(moe.dispatcher) for _, moe in layers)
    replay = fixed and cfg.moe_echo.on_overflow == "replay"
    gated = replay or t.max_nonfinite_steps > 0
    optimizer = build_optimizer(model, cfg.optimizer, gated=gated)
    scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, t.steps)
    state = TrainState(loader)
    states = {"app": ModelAndOptimizer(model, optimizer), "lr_scheduler": scheduler, "train": state}
    gate = (StepGate(layers if replay else [], optimizer, device, cfg.moe_echo.grow_capacity_after,
                     check_finite=t.max_nonfinite_steps > 0) if gated else None)

    # --- resume (or, on a fresh run, start from initial weights) ---------------------------------
    ckpt_dir = os.path.join(dump, ckpt.folder)
    found = checkpoint.find_resumable(ckpt_dir, ckpt.load_step) if ckpt.enable else None
    if found is not None:  # the run's own checkpoint always wins over initial_load_path
        checkpoint.load(found[1], states)
    elif ckpt.initial_load_path:  # model weights only (DCP step-N folder or HF safetensors)
        loaded = load_initial_weights(model, ckpt.initial_load_path, ckpt.initial_load_in_hf, m.name)
        if is_main:
            print(f"initial weights: {loaded}", flush=True)
    if state.step >= t.steps:
        if is_main:
            print(f"nothing to do: {found[1] if found else dump} is at step {state.step}, [training] steps = "
                  f"{t.steps}; raise --training.steps to train further", flush=True)
        return
    if found is not None and is_main:
        print(f"resumed from {found[1]} (step {state.step})", flush=True)
    if t.cuda_graph and device.type == "cuda":
        make_capturable(optimizer, device)  # tensor lr filled by the scheduler, device step counters

    # --- the step: forward, backward, clip, gate, optimizer; device tensors only -------------------
    def device_step(inputs_BS, labels_BS):
        """No host read (a CUDA graph captures this whole function), except on_overflow = 'stop'."""
        with autocast():
            logits_BSV = model(inputs_BS)
        loss = F.cross_entropy(logits_BSV.flatten(0, 1).float(), labels_BS.flatten())
        loss.backward()
        grad_norm = clip_grad_norm_(list(model.parameters()), t.max_norm)
        skip = gate.gate(loss, grad_norm) if gate is not None else None  # device flags, read one step late
        if fixed and not replay:  # on_overflow = "stop": host read every step
            _stop_on_overflow(layers, state.step, cfg.moe_echo.capacity_factor)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # aux-loss-free balancing: one bias step per layer from this step's global counts
        counts_LE = allreduce_sum(torch.stack([moe.tokens_per_expert for _, moe in layers])) if layers else None
        for (_, moe), counts_E in zip(layers, counts_LE if layers else []):
            moe.update_expert_bias(counts_E, skip)
            moe.reset_step_stats()
        echo = [(moe.echo_stats.clone(), moe.echo.last_load.clone(), moe.echo.last_plan.slot_expert_G.clone())
                if moe.echo is not None else None
                for _, moe in layers]
        return allreduce_sum(loss.detach()) / world, grad_norm, counts_LE, echo

    step_graph = StepGraph(device_step, device, t.cuda_graph_warmup, t.cuda_graph,
                           _why_not_graph(layers, fixed, replay, device, t),
                           log=print if is_main else (lambda *_: None))

    def run_step(batch, exact):
        """One step (graphed when possible; ``exact``: eager on the exact path); outputs and lr are
        copied to pinned host memory without waiting."""
        with _sync_check(t.sync_debug and device.type == "cuda" and not exact):
            out = device_step(*batch) if exact else step_graph(*batch)
        scheduler.step()  # fills the optimizer's lr tensor in place when graphed
        return HostCopy((out, scheduler.base_lrs[0] * scheduler.lr_lambdas[0](scheduler.last_epoch)))

    def on_replay(first, n, grown):
        logs.summary.replayed_steps += n
        if grown is not None:
            logs.summary.capacity_factor = grown
            logs.write(f"step {first}: overflow replayed; capacity_factor grown to {grown:.2f} "
                       "(what the step needed + 10%)")
        if step_graph.captures and t.cuda_graph_after_replay == "recapture":
            step_graph.invalidate()  # warm up and capture again (capacity may have grown)
        elif step_graph.captures:
            step_graph.disable("an overflow was replayed on the exact path; set [training] "
                               "cuda_graph_after_replay = 'recapture' to capture the step again")

    def before_replay():  # let graph replays finish before eager steps touch FSDP's stream/event state
        if step_graph.captures:
            torch.cuda.synchronize(device)

    pipeline = StepPipeline(run_step, gate, scheduler, before_replay=before_replay, on_replay=on_replay)

    # --- training loop -------------------------------------------------------------------------------
    purge_step = prepare_logs(dump, cfg.metrics.save_tb_folder if cfg.metrics.enable_tensorboard else None,
                              state.step) if is_main else None
    logs = StepLogger(dump=dump, cfg=cfg, layers=layers, gate=gate, world=world, device=device,
                      start_step=state.step, flops_per_token=flops_per_token, is_main=is_main,
                      purge_step=purge_step, peer_bytes=peer_memory_bytes)
    watchdog = StepWatchdog(t.hang_report_s, rank)
    watchdog.limit(0.75 * cfg.comm.init_timeout_seconds)  # the report comes before a collective times out
    profiler = StepProfiler(cfg.profiling, dump, rank, state.step, device)
    gc.disable()  # collected every [training] gc_freq steps instead (torchtitan's convention)
    if device.type == "cuda":
        logs.write("the first step compiles the Triton kernels and sets up buffers (peer memory, optimizer "
                   "state): minutes on a machine whose Triton cache is cold")
    first_confirmed = True
    try:
        while state.step < t.steps:
            state.step += 1
            step = state.step
            batch = tuple(to_device_async(x, device) for x in loader.next_batch())
            faults.inject(step, model, layers, rank, world)  # test hooks, off unless set in the environment
            save_now = ckpt.enable and not ckpt.load_only and (
                step % ckpt.interval == 0 or step == t.steps or (step == 1 and ckpt.enable_first_step_checkpoint))
            for c in pipeline.submit(step, batch, settle=save_now or step == t.steps):
                logs.log(c)
                watchdog.beat(c.step)
                if c.nonfinite and c.streak >= t.max_nonfinite_steps:
                    logs.close()  # the progress bar ends before the error line
                    _stop_nonfinite(c, model, autocast, gate, t.max_nonfinite_steps, ckpt_dir)
                if first_confirmed:  # start-up done (compiles, buffers): the training timeout applies
                    set_timeout(cfg.comm.train_timeout_seconds)
                    watchdog.limit(0.75 * cfg.comm.train_timeout_seconds)
                    first_confirmed = False
            profiler.step()
            if step % t.gc_freq == 0:
                gc.collect(1)
            if save_now:
                if params_finite(model):
                    logs.write(f"checkpoint: {checkpoint.save(ckpt_dir, step, states, ckpt.keep_latest_k)}")
                else:
                    logs.write(f"step {step}: checkpoint not saved: the weights are not finite")
                watchdog.beat(step)  # a long save is not a hang
        if ckpt.last_save_in_hf:
            hf_dir = os.path.join(ckpt_dir, f"step-{step}-hf")
            logs.write(f"HF export: {export_hf(model, hf_dir, m.name, ckpt.export_dtype)}")
    finally:
        gc.enable()
        profiler.close()
        watchdog.close()
        logs.close()
    if is_main:
        print(logs.summary.text(_summary_extra(cfg, n_params, layers, world, dims, step_graph, device, logs,
                                               profiler)), flush=True)


def _stop_on_overflow(layers, step: int, capacity_factor: float) -> None:
    dropped = int(allreduce_sum(torch.stack([moe.overflow_count for _, moe in layers]).sum()))
    if dropped:
        raise UserError(
            f"expert-parallel buffer overflow at step {step}: {dropped} (token, expert) assignments did not fit the "
            f"dispatcher's fixed capacity; the step was not applied — raise [moe_echo] capacity_factor (now "
            f"{capacity_factor}), use dispatcher = 'alltoall' or on_overflow = 'replay'")


def _stop_nonfinite(c, model, autocast, gate, limit: int, ckpt_dir: str) -> None:
    """Re-run the step eagerly with hooks to name where it went non-finite, then stop (exit 3)."""
    (loss, grad_norm, _, _), _ = c.out.get()

    def loss_fn(model, inputs_BS, labels_BS):
        with autocast():
            logits_BSV = model(inputs_BS)
        return F.cross_entropy(logits_BSV.flatten(0, 1).float(), labels_BS.flatten())

    with gate.exact_dispatch():
        where = first_nonfinite(model, loss_fn, *c.batch)
    weights = ("the optimizer skipped them, so the weights are finite" if params_finite(model)
               else "the weights themselves are not finite")
    done = checkpoint.complete_checkpoints(ckpt_dir)
    raise NonFiniteError(
        f"step {c.step}: {c.streak} consecutive non-finite steps (loss {float(loss):.4g}, grad norm "
        f"{float(grad_norm):.4g}; [training] max_nonfinite_steps = {limit}); first non-finite: "
        f"{where or 'not reproduced on rank 0'}; {weights}"
        + (f"; last checkpoint: {done[-1][1]}" if done else "") + "; lower [optimizer] lr or check the data")


def _why_not_graph(layers, fixed: bool, replay: bool, device, t) -> str | None:
    if any(not moe.dispatcher.sync_free for _, moe in layers):
        return (f"the {type(layers[0][1].dispatcher).__name__} sizes its buffers on the host; use "
                "dispatcher = 'nvlink' or 'padded'")
    if fixed and not replay:
        return "on_overflow = 'stop' reads the overflow count on the host every step"
    if device.type == "cuda" and t.mixed_precision_param != "bfloat16":
        return "fp32 experts run a per-expert loop sized on the host; use mixed_precision_param = 'bfloat16'"
    return None


def _summary_extra(cfg, n_params, layers, world, dims, step_graph, device, logs, profiler) -> dict:
    m, dump = cfg.model, cfg.job.dump_folder
    extra = {"params": f"{n_params:,}", "model": f"{m.name}/{m.flavor} ({len(layers)} MoE layers)",
             "ranks": f"{world} (dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard}, ep {dims.ep})",
             "dispatcher": type(layers[0][1].dispatcher).__name__ if layers else "-",
             "cuda graph": (f"replayed (captured {step_graph.captures}x)" if step_graph.captures
                            else f"off ({step_graph.reason})" if step_graph.reason
                            else "never captured (the run ended within the warm-up steps)"),
             "device": str(device), "metrics": logs.path}
    if logs.nonfinite_steps:
        extra["non-finite"] = f"{logs.nonfinite_steps} steps skipped (loss or gradient norm not finite)"
    if logs.tb.writer is not None:
        extra["tensorboard"] = f"tensorboard --logdir {os.path.join(dump, cfg.metrics.save_tb_folder)}"
    if profiler.written:
        extra["profiles"] = os.path.commonpath(profiler.written)
    if cfg.checkpoint.enable:
        extra["checkpoints"] = os.path.join(dump, cfg.checkpoint.folder)
    return extra


class _sync_check:
    """[training] sync_debug: any device-to-host sync inside a training step raises."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        if self.on:
            torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        if self.on:
            torch.cuda.set_sync_debug_mode(0)


if __name__ == "__main__":
    run_recipe(train)
