"""The training loop around a recipe's step: ``fit(run, tr, model, loader, device_step, loss_fn, ...)``.

``device_step(inputs_BS, labels_BS) -> (loss, grad_norm, counts_LE, echo)`` is the recipe's step
(forward, backward, clip, gate, optimizer, expert balancing; device tensors only). Around it, per
training step: the batch is copied to the device without waiting, the step runs (graphed after
``cuda_graph_warmup`` steps where it can be captured), its outputs reach the host one step late
(``StepPipeline``: overflowed steps replayed exactly, non-finite ones skipped and counted), then
logs, the watchdog, the profiler, garbage collection every ``gc_freq`` steps, checkpoints (never of
non-finite weights) and, at the end, the HF export and the run summary. ``loss_fn(inputs, labels)``
re-runs the forward eagerly to name the first non-finite module when the run stops for it (exit 3).
SIGINT / SIGTERM stop the loop where it is (entry.py): a checkpoint being written is finished first,
the logs are closed, and the step reached and the last checkpoint are what rank 0's one line reports.
A one-process CPU run whose default thread pool shares the cores with other busy processes is told,
once, to set OMP_NUM_THREADS=1 (``OtherLoad``).
"""

import gc
import os
import time

import torch

from components.errors import NonFiniteError
from components.moe_echo.models import shape_overrides
from components.moe_echo.symmetric import peer_memory_bytes
from components.parallel.compile import is_compiled
from components.parallel.cuda_graph import StepGraph
from components.parallel.data_parallel import set_timeout
from components.parallel.host_copy import HostCopy, to_device_async

from . import checkpoint, faults
from .entry import stop
from .hf_weights import export_hf
from .loss import compiles_loss
from .master_adamw import masters_in_model
from .nonfinite import first_nonfinite
from .overflow import StepPipeline
from .profiling import StepProfiler
from .setup import Run, Training
from .step_log import StepLogger, prepare_logs
from .train_state import params_finite
from .watchdog import StepWatchdog


def fit(run: Run, tr: Training, model, loader, device_step, loss_fn, n_params: int, flops_per_token: float) -> None:
    cfg, t, ckpt, device = run.cfg, run.cfg.training, run.cfg.checkpoint, run.device
    state, scheduler, dump = tr.state, tr.scheduler, cfg.job.dump_folder
    stop.track(state.step, tr.ckpt_dir if ckpt.enable else None)  # what a Ctrl-C reports
    step_graph = StepGraph(device_step, device, t.cuda_graph_warmup, t.cuda_graph, why_not_graph(run, tr),
                           log=print if run.is_main else (lambda *_: None))

    compiling = [cfg.compile.enable]  # torch.compile's first call compiles, which reads the device

    def run_step(batch, exact):
        """One step (graphed when possible; ``exact``: eager on the exact path); outputs and lr are
        copied to pinned host memory without waiting."""
        with sync_check(t.sync_debug and device.type == "cuda" and not exact and not compiling[0]):
            out = device_step(*batch) if exact else step_graph(*batch)
        compiling[0] = False
        lr = scheduler.base_lrs[0] * scheduler.lr_lambdas[0](scheduler.last_epoch)  # the lr this step used
        scheduler.step()  # fills the optimizer's lr tensor in place when graphed
        copy = HostCopy((out, lr))
        copy.made_at = time.perf_counter()  # without CUDA the step ran as it was launched: its end, for tokens/s
        return copy

    def on_replay(first, n, grown):
        logs.summary.replayed_steps += n
        if grown is not None:
            logs.summary.capacity_factor = grown
            logs.write(f"step {first}: overflow replayed; capacity_factor grown to {grown:.2f} "
                       "(what the step needed + 10%)")
        step_graph.after_replay(recapture=t.cuda_graph_after_replay == "recapture")

    def before_replay():  # let graph replays finish before eager steps touch FSDP's stream/event state
        if step_graph.captures:
            torch.cuda.synchronize(device)

    pipeline = StepPipeline(run_step, tr.gate, scheduler, before_replay=before_replay, on_replay=on_replay)
    purge_step = prepare_logs(dump, cfg.metrics.save_tb_folder if cfg.metrics.enable_tensorboard else None,
                              state.step) if run.is_main else None
    logs = StepLogger(dump=dump, cfg=cfg, layers=tr.layers, gate=tr.gate, world=run.world, device=device,
                      start_step=state.step, flops_per_token=flops_per_token, is_main=run.is_main,
                      purge_step=purge_step, peer_bytes=peer_memory_bytes)
    watchdog = StepWatchdog(t.hang_report_s, run.rank)
    watchdog.limit(0.75 * cfg.comm.init_timeout_seconds)  # the report comes before a collective times out
    profiler = StepProfiler(cfg.profiling, dump, run.rank, state.step, device)
    gc.disable()  # collected every [training] gc_freq steps instead (torchtitan's convention)
    if device.type == "cuda":
        logs.write("the first step compiles the Triton kernels and sets up buffers (peer memory, optimizer "
                   "state): minutes on a machine whose Triton cache is cold")
    first_confirmed = True
    other = (OtherLoad() if run.world == 1 and device.type == "cpu" and torch.get_num_threads() > 1
             and "OMP_NUM_THREADS" not in os.environ else None)
    try:
        while state.step < t.steps:
            state.step += 1
            step = state.step
            batch = tuple(to_device_async(x, device) for x in loader.next_batch())
            faults.inject(step, model, tr.layers, run.rank, run.world)  # test hooks, off unless set in the env
            save_now = ckpt.enable and not ckpt.load_only and (
                step % ckpt.interval == 0 or step == t.steps or (step == 1 and ckpt.enable_first_step_checkpoint))
            for c in pipeline.submit(step, batch, settle=save_now or step == t.steps):
                logs.log(c)
                stop.step = c.step
                watchdog.beat(c.step)
                if c.nonfinite and c.streak >= t.max_nonfinite_steps:
                    logs.close()  # the progress bar ends before the error line
                    stop_nonfinite(c, model, loss_fn, tr, t.max_nonfinite_steps)
                if first_confirmed:  # start-up done (compiles, buffers): the training timeout applies
                    set_timeout(cfg.comm.train_timeout_seconds)
                    watchdog.limit(0.75 * cfg.comm.train_timeout_seconds)
                    first_confirmed = False
            if other is not None and (busy := other.cores()) is not None:
                other = None
                if busy >= max(1.0, 0.5 * (os.cpu_count() or 1)):
                    logs.write(f"warning: other processes kept {busy:.1f} of this machine's {os.cpu_count()} cores busy "
                               f"while this run's {torch.get_num_threads()} threads trained; set OMP_NUM_THREADS=1 "
                               "(PyTorch's thread pool runs several times slower on busy cores)")
            profiler.step()
            if step % t.gc_freq == 0:
                gc.collect(1)
            if save_now:
                if params_finite(model):
                    with stop.deferred():  # a Ctrl-C waits for the checkpoint to be complete
                        logs.write(f"checkpoint: {checkpoint.save(tr.ckpt_dir, step, tr.states, ckpt.keep_latest_k)}")
                else:
                    logs.write(f"step {step}: checkpoint not saved: the weights are not finite")
                watchdog.beat(step)  # a long save is not a hang
        if ckpt.last_save_in_hf:
            hf_dir = os.path.join(tr.ckpt_dir, f"step-{step}-hf")
            with masters_in_model(tr.optimizer):  # the fp32 weights, not their bf16 copies
                logs.write(f"HF export: {export_hf(model, hf_dir, cfg.model.name, ckpt.export_dtype)}")
    finally:
        gc.enable()
        profiler.close()
        watchdog.close()
        logs.close()
    run.say(logs.summary.text(summary_extra(run, tr, model, n_params, step_graph, logs, profiler)))


def stop_nonfinite(c, model, loss_fn, tr: Training, limit: int) -> None:
    """Re-run the step eagerly with hooks to name where it went non-finite, then stop (exit 3)."""
    (loss, grad_norm, *_), _ = c.out.get()
    with tr.gate.exact_dispatch():
        where = first_nonfinite(model, lambda _model, inputs, labels: loss_fn(inputs, labels), *c.batch)
    weights = ("the optimizer skipped them, so the weights are finite" if params_finite(model)
               else "the weights themselves are not finite")
    done = checkpoint.complete_checkpoints(tr.ckpt_dir)
    raise NonFiniteError(
        f"step {c.step}: {c.streak} consecutive non-finite steps (loss {float(loss):.4g}, grad norm "
        f"{float(grad_norm):.4g}; [training] max_nonfinite_steps = {limit}); first non-finite: "
        f"{where or 'not reproduced on rank 0'}; {weights}"
        + (f"; last checkpoint: {done[-1][1]}" if done else "") + "; lower [optimizer] lr or check the data")


def why_not_graph(run: Run, tr: Training) -> str | None:
    """Why the step cannot be captured as a CUDA graph (None: it can)."""
    layers, t = tr.layers, run.cfg.training
    if any(not moe.dispatcher.sync_free for _, moe in layers):
        return (f"the {type(layers[0][1].dispatcher).__name__} sizes its buffers on the host; use "
                "dispatcher = 'nvlink' or 'padded'")
    if tr.fixed and not tr.replay:
        return "on_overflow = 'stop' reads the overflow count on the host every step"
    if run.device.type == "cuda" and t.mixed_precision_param != "bfloat16":
        return "fp32 experts run a per-expert loop sized on the host; use mixed_precision_param = 'bfloat16'"
    return None


def summary_extra(run: Run, tr: Training, model, n_params: int, step_graph, logs, profiler) -> dict:
    cfg, dims, layers = run.cfg, run.dims, tr.layers
    m, dump = cfg.model, cfg.job.dump_folder
    c = cfg.compile
    done = [f"{sum(map(is_compiled, model.modules()))} dense submodules (attention, norms, dense FFN, shared "
            "experts, output head; routed MoE eager)"] if "model" in c.components else []
    if "loss" in c.components:
        done += ["the loss" if compiles_loss(c, run.device) else "the loss: fused cross-entropy kernels (nothing to compile)"]
    sizes = "".join(f", {k} {v}" for k, v in shape_overrides(m).items())  # [model] keys over the flavour's
    extra = {"params": f"{n_params:,}", "model": f"{m.name}/{m.flavor}{sizes} ({len(layers)} MoE layers)",
             "ranks": f"{run.world} (dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard}, ep {dims.ep})" + (
                 f"; {dims.world // dims.ranks_per_host} hosts, experts sharded over {dims.expert_shard_in_host} "
                 f"rank(s) of a host and replicated across hosts" if dims.expert_shard_in_host < dims.efsdp else ""),
             "dispatcher": dispatcher_line(layers),
             "cuda graph": (f"on (captured {step_graph.captures}x)" if step_graph.captures
                            else f"off ({step_graph.reason})" if step_graph.reason
                            else "never captured (the run ended within the warm-up steps)"),
             "compile": f"{c.backend}: {' + '.join(done) or 'nothing'}" if c.enable else "off",
             "device": str(run.device), "metrics": logs.path}
    if logs.nonfinite_steps:
        extra["non-finite"] = f"{logs.nonfinite_steps} steps skipped (loss or gradient norm not finite)"
    if logs.tb.writer is not None:
        extra["tensorboard"] = f"tensorboard --logdir {os.path.join(dump, cfg.metrics.save_tb_folder)}"
    if profiler.written:
        extra["profiles"] = os.path.commonpath(profiler.written)
    if cfg.checkpoint.enable:
        extra["checkpoints"] = os.path.join(dump, cfg.checkpoint.folder)
    return extra


def dispatcher_line(layers) -> str:
    """The MoE layers' dispatcher, ECHO where it runs, and the token chunks each layer went in where it pipelined
    them."""
    if not layers:
        return "-"
    layer = layers[0][1]
    echo = "" if layer.echo is None else f", ECHO on ({layer.echo.S} slots per rank)"
    chunks = "" if layer.chunks == 1 else f", {layer.chunks} token chunks per layer (overlap_chunks = {layer.cfg.overlap_chunks})"
    return type(layer.dispatcher).__name__ + echo + chunks


class OtherLoad:
    """How many cores other processes kept busy since this object was made (Linux's /proc/stat minus this
    process's CPU time); ``cores()`` is None before ``min_s`` seconds or without /proc/stat."""

    def __init__(self, min_s: float = 10.0):
        self.t0, self.min_s, self.start = time.monotonic(), min_s, self._others_cpu_s()

    @staticmethod
    def _others_cpu_s() -> float | None:
        try:
            with open("/proc/stat") as f:  # cpu  user nice system idle iowait irq softirq steal (ticks)
                ticks = [int(x) for x in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        own = os.times()
        return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK") - own.user - own.system

    def cores(self) -> float | None:
        wall, now = time.monotonic() - self.t0, self._others_cpu_s()
        return None if self.start is None or now is None or wall < self.min_s else (now - self.start) / wall


class sync_check:
    """[training] sync_debug: any device-to-host sync inside a training step raises."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        if self.on:
            torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        if self.on:
            torch.cuda.set_sync_debug_mode(0)
