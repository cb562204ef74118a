"""TensorBoard logging, expert-load statistics and heatmaps, console progress and run summary.

TensorBoard tags:
    loss, lr, grad_norm, tokens_per_s, mfu_pct (GPU), memory/peak_gib, memory/peer_gib (nvlink)
    moe/<layer>/load_max_over_mean, moe/<layer>/load_heatmap (image: rows = recent logged steps,
    columns = experts, colour = load / mean load; 1.0 is balanced; with ECHO: home experts after
    rerouting | white separator | echo slots' clone load)
    with ECHO, per layer: echo_load_before / echo_load_after (max/mean rank load), echo_clones,
    echo_rerouted (fraction of assignments moved to clones)
"""

import os
import time
from collections import deque

import numpy as np
import torch


def load_imbalance(counts_E: torch.Tensor) -> float:
    """max / mean of per-expert load (1.0 = perfectly balanced)."""
    counts_E = counts_E.float()
    return float(counts_E.max() / counts_E.mean().clamp_min(1e-9))


_STOPS = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], dtype=np.float32)


def heatmap_rgb(ratio_RC: np.ndarray, vmax: float = 3.0, cell: int = 8) -> np.ndarray:
    """uint8 HWC image of ``ratio_RC`` (load / mean) on a viridis-like scale from 0 to ``vmax``."""
    blank = np.isnan(ratio_RC)  # NaN cells (separators) are drawn white
    x = np.clip(np.nan_to_num(ratio_RC) / vmax, 0.0, 1.0) * (len(_STOPS) - 1)
    lo = np.floor(x).astype(int).clip(0, len(_STOPS) - 2)
    frac = (x - lo)[..., None]
    rgb = _STOPS[lo] * (1 - frac) + _STOPS[lo + 1] * frac
    rgb[blank] = 255
    return np.repeat(np.repeat(rgb, cell, axis=0), cell, axis=1).astype(np.uint8)


class MetricsLogger:
    """Rank-0 TensorBoard writer plus per-layer load history for the heatmaps."""

    def __init__(self, log_dir: str | None, history: int = 64, purge_step: int | None = None):
        """``purge_step``: a resumed run's first step; TensorBoard hides events logged at or after
        it by the interrupted run."""
        self.writer = None
        if log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(log_dir, exist_ok=True)
            self.writer = SummaryWriter(log_dir=log_dir, purge_step=purge_step)
        self.history: dict[str, deque] = {}
        self.history_len = history

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self.writer is not None:
            for k, v in values.items():
                self.writer.add_scalar(k, v, step)

    def record_load(self, layer: str, counts_E: torch.Tensor, echo_load: torch.Tensor | None = None) -> float:
        """Add one heatmap row: expert loads / mean; with ECHO, the home experts' loads after
        rerouting, a white separator, then the echo slots' (clone) loads, all over the same mean."""
        counts = counts_E.float().cpu().numpy()
        mean = max(counts.mean(), 1e-9)
        ratio = counts / mean
        row = ratio if echo_load is None else np.concatenate(
            [echo_load[: len(counts)].cpu().numpy() / mean, [np.nan], echo_load[len(counts):].cpu().numpy() / mean])
        self.history.setdefault(layer, deque(maxlen=self.history_len)).append(row)
        return float(ratio.max())

    def heatmaps(self, step: int) -> None:
        if self.writer is None:
            return
        for layer, rows in self.history.items():
            img = heatmap_rgb(np.stack(list(rows)))
            self.writer.add_image(f"moe/{layer}/load_heatmap", img, step, dataformats="HWC")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()


class Progress:
    """A console progress bar (tqdm) on rank 0; silent elsewhere."""

    def __init__(self, total: int, initial: int, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, mininterval=0.5)

    def update(self, postfix: dict) -> None:
        if self.bar is not None:
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class RunSummary:
    """Accumulates what the end-of-run summary prints."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.losses: list[tuple[int, float]] = []
        self.tokens = 0
        self.imbalance: list[float] = []
        self.rank_imbalance: list[tuple[float, float]] = []  # (without ECHO, with ECHO)
        self.replayed_steps = 0
        self.capacity_factor: float | None = None  # grown by overflow replays
        self.peak_mem_gib = 0.0
        self.peer_mem_gib = 0.0  # symmetric-memory buffers (nvlink), outside torch's allocator count

    def text(self, extra: dict[str, str]) -> str:
        wall = time.perf_counter() - self.t0
        lines = ["", "=== run summary ==="]
        if self.losses:
            n = max(1, len(self.losses) // 10)
            first = sum(l for _, l in self.losses[:n]) / n
            last = sum(l for _, l in self.losses[-n:]) / n
            lines.append(f"steps          {self.losses[0][0]}..{self.losses[-1][0]}")
            lines.append(f"loss           {first:.4f} -> {last:.4f} (means of the first and last {n} logged steps)")
        lines.append(f"wall time      {wall:.1f} s")
        lines.append(f"tokens         {self.tokens:,}  ({self.tokens / max(wall, 1e-9):,.0f} tok/s)")
        if self.imbalance:
            lines.append(f"expert load    max/mean {sum(self.imbalance) / len(self.imbalance):.3f} (mean over layers and logged steps)")
        if self.rank_imbalance:
            n = len(self.rank_imbalance)
            b, a = sum(x for x, _ in self.rank_imbalance) / n, sum(y for _, y in self.rank_imbalance) / n
            lines.append(f"rank load      max/mean {b:.3f} without ECHO -> {a:.3f} with ECHO (mean over layers and logged steps)")
        if self.replayed_steps:
            grown = f"; capacity_factor grown to {self.capacity_factor:.2f}" if self.capacity_factor else ""
            lines.append(f"overflow       {self.replayed_steps} steps gated and replayed on the exact path (nothing dropped)"
                         + grown)
        if self.peak_mem_gib:
            peer = (f" + {self.peer_mem_gib:.2f} GiB of peer (symmetric) buffers, which torch does not count"
                    if self.peer_mem_gib else "")
            lines.append(f"peak memory    {self.peak_mem_gib:.2f} GiB{peer}")
        lines += [f"{k:<14} {v}" for k, v in extra.items()]
        return "\n".join(lines)
