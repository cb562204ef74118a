"""Per-step logging of the training loop: metrics.jsonl, TensorBoard, progress bar, run summary.

    logs = StepLogger(...)                 # rank 0 writes; every rank keeps the summary
    logs.log(confirmed_step)               # after the step's gate flags were read (one step late)

A step's device outputs ``(loss, grad_norm, counts_LE, echo)`` and its learning rate arrive as a
HostCopy. Throughput windows are timed on the GPU timeline (events after each step's outputs),
so the last window is not cut short by the host finishing its final launch early; without CUDA,
host time between the steps' outputs (``made_at``: a CPU step has run when its launch returns, so a
step confirmed right after the next one ran is not timed as ~0 s). A replayed step logged right
after another one (``timed = False``) adds its time to the next timed step's window (otherwise its
tokens/s would divide by ~0 s).

``prepare_logs`` keeps one run per log: a fresh run moves an earlier ``metrics.jsonl`` and
TensorBoard folder aside (``<name>.prev-<k>``, never deleted); a resumed run drops the rows after
its checkpoint's step from ``metrics.jsonl`` and opens TensorBoard with ``purge_step``, so no step
is logged twice.
"""

import json
import math
import os
import time

import torch

from .metrics import MetricsLogger, Progress, RunSummary, load_imbalance, rank_imbalance

METRICS_FILE = "metrics.jsonl"


def _aside(path: str) -> None:
    k = 1
    while os.path.exists(f"{path}.prev-{k}"):
        k += 1
    os.rename(path, f"{path}.prev-{k}")


def prepare_logs(dump: str, tb_folder: str | None, resumed_step: int) -> int | None:
    """Rank 0, before the first step. ``resumed_step`` = 0 for a fresh run. Returns the
    TensorBoard ``purge_step`` (None for a fresh run)."""
    os.makedirs(dump, exist_ok=True)
    path = os.path.join(dump, METRICS_FILE)
    tb = os.path.join(dump, tb_folder) if tb_folder else None
    if resumed_step == 0:
        for old in (path, tb):
            if old and os.path.exists(old):
                _aside(old)
        return None
    if os.path.exists(path):
        with open(path) as f:
            rows = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= resumed_step]
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(rows)
        os.replace(tmp, path)
    return resumed_step + 1


def peak_flops(device: torch.device) -> float:
    """The GPU's dense bf16 peak (torchtitan's table); 0 on CPU (no MFU)."""
    if device.type != "cuda":
        return 0.0
    from torchtitan.tools.utils import get_peak_flops

    return float(get_peak_flops(torch.cuda.get_device_name(device)))



def network_gb(layers, tokens_per_rank: int, itemsize: int) -> tuple[float, float]:
    """GB one rank sends to other hosts per training step over the layers whose dispatcher spans hosts
    (fixed blocks, padding included; token rows and weights of ``itemsize`` bytes): (token rows: dispatch +
    combine, forward and backward; ECHO's clone weights forward and their gradients backward)."""
    rows = clones = 0
    for _, moe in layers:
        d = moe.dispatcher
        if getattr(d, "hosts", 1) > 1:
            rows += 2 * d.network_bytes(tokens_per_rank, moe.router.top_k, moe.experts.w1.shape[-1], itemsize)
            transport = getattr(moe.echo, "transport", None)
            if hasattr(transport, "bytes_to_other_hosts"):
                expert = sum(math.prod(w.shape[1:]) for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3)) * itemsize
                clones += transport.bytes_to_other_hosts(expert, d.ranks_per_host)
    return rows / 1e9, clones / 1e9

class StepLogger:
    def __init__(self, *, dump: str, cfg, layers, gate, world: int, device: torch.device, start_step: int,
                 flops_per_token: float, is_main: bool, purge_step: int | None, peer_bytes=lambda: 0):
        t = cfg.training
        self.cfg, self.layers, self.gate, self.world, self.device = cfg, layers, gate, world, device
        self.is_main, self.total_steps, self.peer_bytes = is_main, t.steps, peer_bytes
        self.tokens_per_step = t.local_batch_size * t.seq_len * world
        self.network_gb, self.clone_network_gb = network_gb(layers, t.local_batch_size * t.seq_len, 2 if device.type == "cuda" else 4)
        self.flops_per_token, self.peak = flops_per_token, peak_flops(device)
        self.path = os.path.join(dump, METRICS_FILE)
        tb_dir = os.path.join(dump, cfg.metrics.save_tb_folder)
        self.tb = MetricsLogger(tb_dir if is_main and cfg.metrics.enable_tensorboard else None, purge_step=purge_step,
                                log=self.write)
        self.summary = RunSummary()
        self.progress = Progress(t.steps, start_step, enabled=is_main)
        self.window_t0, self.window_steps, self.window_copy = time.perf_counter(), 0, None
        self.nonfinite_steps = 0

    def write(self, text: str) -> None:
        self.progress.write(text) if self.is_main else None

    def log(self, c) -> dict:
        """Log one confirmed step (``overflow.Confirmed``); returns the values it logged."""
        (loss, grad_norm, counts_LE, echo, *net), lr = c.out.get()
        step, s = c.step, self.summary
        self.window_steps += 1
        s.count_step(step, self.tokens_per_step)
        self.nonfinite_steps += c.nonfinite
        if not (step % self.cfg.metrics.log_freq == 0 or step == self.total_steps or step == 1 or c.nonfinite):
            self.progress.update({})
            return {}
        loss_val = float(loss)
        values = {"loss": loss_val, "lr": lr, "grad_norm": float(grad_norm)}
        if c.timed:
            elapsed = c.out.seconds_since(self.window_copy)
            if elapsed is None:
                elapsed = (getattr(c.out, "made_at", None) or time.perf_counter()) - getattr(
                    self.window_copy, "made_at", self.window_t0)
            values["tokens_per_s"] = self.tokens_per_step * self.window_steps / max(elapsed, 1e-9)
            self.window_t0, self.window_steps, self.window_copy = time.perf_counter(), 0, c.out
            if self.peak:
                values["mfu_pct"] = 100 * self.flops_per_token * values["tokens_per_s"] / (self.peak * self.world)
        if self.device.type == "cuda":
            values["memory/peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            s.peak_mem_gib = max(s.peak_mem_gib, values["memory/peak_gib"])
            peer_gib = self.peer_bytes() / 2**30  # symmetric buffers: not in torch's count above
            if peer_gib:
                values["memory/peer_gib"] = peer_gib
                s.peer_mem_gib = max(s.peer_mem_gib, peer_gib)
        if self.gate is not None:
            values["nonfinite_skipped_steps"] = float(self.nonfinite_steps)
            if self.gate.layers:
                values["moe/overflow_assignments"] = float(self.gate.dropped_seen)  # read one step late
                values["moe/replayed_steps"] = float(s.replayed_steps)
                values["moe/replayed"] = float(c.replayed)
        values.update(self._moe_values(step, counts_LE, echo))
        if net and net[0] is not None:  # dispatchers across hosts: rows and (fixed-block) bytes between hosts
            values["moe/network_rows"] = float(net[0].sum())
            values["moe/network_gb_per_rank"] = self.network_gb
            if self.clone_network_gb:
                values["moe/echo_clone_network_gb_per_rank"] = self.clone_network_gb
        if not c.nonfinite:
            s.losses.append((step, loss_val))
        if self.is_main:
            self.tb.scalars(values, step)
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, **values}) + "\n")
            heat = self.cfg.moe_echo.load_heatmap_freq
            if heat and (step % heat == 0 or step == self.total_steps):
                self.tb.heatmaps(step)
        shown = {"loss": f"{loss_val:.3f}", **({"tok/s": f"{values['tokens_per_s']:,.0f}"} if c.timed else {})}
        self.progress.update(shown)
        return values

    def _moe_values(self, step, counts_LE, echo) -> dict:
        """``echo``: per layer None, or (echo_stats, echo_load_columns, slot_expert_G) (see echo.py)."""
        values, s = {}, self.summary
        for (name, moe), counts_E, ech in zip(self.layers, counts_LE if self.layers else [], echo):
            load, slots = (ech[1], ech[2]) if ech else (None, None)
            values[f"moe/layer{name}/load_max_over_mean"] = self.tb.record_load(f"layer{name}", step, counts_E,
                                                                               load, slots)
            s.imbalance.append(load_imbalance(counts_E))
            if ech is not None:
                before, after, clones, moved = ech[0].tolist()
                values.update({f"moe/layer{name}/echo_load_before": before, f"moe/layer{name}/echo_load_after": after,
                               f"moe/layer{name}/echo_clones": clones, f"moe/layer{name}/echo_rerouted": moved,
                               f"moe/layer{name}/rank_load_max_over_mean": after})
                s.rank_imbalance.append((before, after))
            elif getattr(moe, "ep_size", 1) > 1:
                r = rank_imbalance(counts_E, moe.ep_size)
                values[f"moe/layer{name}/rank_load_max_over_mean"] = r
                s.rank_imbalance_plain.append(r)
        return values

    def close(self) -> None:
        self.progress.close()
        self.tb.close()
