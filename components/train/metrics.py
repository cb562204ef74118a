"""TensorBoard logging, expert-load statistics and heatmaps, console progress and run summary.

TensorBoard tags:
    loss, lr, grad_norm, tokens_per_s, mfu_pct (GPU), memory/peak_gib, memory/peer_gib (nvlink)
    moe/<layer>/load_max_over_mean, moe/<layer>/load_heatmap (image, ``heatmap_rgb``: rows = the last
    64 logged steps, newest at the bottom; columns = experts; colour = load / mean load, 1.0 is
    balanced, clipped at 3; with ECHO: home experts after rerouting | separator | echo slots' clone
    load, cloned experts marked per step)
    at EP > 1, per layer: rank_load_max_over_mean (the load of the ranks' experts, with ECHO after its
    clones took their share)
    with ECHO, per layer: echo_load_before / echo_load_after (max/mean rank load), echo_clones,
    echo_rerouted (fraction of assignments moved to clones)
"""

import functools
import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch


def load_imbalance(counts_E: torch.Tensor) -> float:
    """max / mean of per-expert load (1.0 = perfectly balanced)."""
    counts_E = counts_E.float()
    return float(counts_E.max() / counts_E.mean().clamp_min(1e-9))


def rank_imbalance(counts_E: torch.Tensor, ep: int) -> float:
    """max / mean of the EP ranks' loads, rank r owning experts [r·E/ep, (r+1)·E/ep) (1.0 = balanced):
    the slowest rank's extra share of the routed experts' time, which the other ranks wait out."""
    return load_imbalance(counts_E.reshape(ep, -1).sum(1))


VMAX = 3.0  # heatmap colour scale: load / mean load from 0 to VMAX; larger values get VMAX's colour
HEATMAP_HEIGHT = 480  # px, whatever the number of rows (rows stretch to fill it)
_STOPS = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], dtype=np.float32)
_UNUSED = (217, 217, 217)  # light grey: an ECHO slot that cloned nothing at that step
_MARK = (255, 0, 0)  # red: an expert cloned into an ECHO slot at that step (not a viridis colour)


def heatmap_size(columns: int) -> tuple[int, int]:
    """(height, width) in pixels of a heatmap with ``columns`` columns (E, or E + G with ECHO):
    480 high, 300 + 9 px per column wide, within 700..1800."""
    return HEATMAP_HEIGHT, int(np.clip(300 + 9 * columns, 700, 1800))


_MPL_FAILED: list[str] = []  # why matplotlib failed to draw (then this process draws numpy images)


@functools.cache
def _matplotlib_installed() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def have_matplotlib() -> bool:
    """matplotlib is importable and has not failed to draw in this process."""
    return _matplotlib_installed() and not _MPL_FAILED


def heatmap_rgb(ratio_RC: np.ndarray, steps_R=None, *, num_experts: int | None = None,
                slot_expert_RG: np.ndarray | None = None, title: str = "expert load", vmax: float = VMAX,
                renderer: str = "auto") -> np.ndarray:
    """The expert-load heatmap as a uint8 HWC RGB image.

    Layout: one row per logged step, oldest at the top, newest at the bottom (y axis: the step
    numbers ``steps_R``); one column per expert (x axis: expert index). With ECHO, ``num_experts`` =
    E < C: columns 0..E-1 are the home experts' loads after ECHO moved work to their clones, then
    (after a white separator) the G = EP·S echo slots' clone loads; ``slot_expert_RG[r, g]`` is the
    expert that slot g cloned at row r's step (-1: unused, drawn light grey), and each cloned
    expert's cell in that row carries a red × (legend: "cloned into an ECHO slot").
    Scale: colour = load / mean load of the home experts (1.0 = balanced), viridis from 0 to
    ``vmax``; larger values are clipped to ``vmax``'s colour (yellow; the colour bar's arrow).
    Size: ``heatmap_size(C)``, fixed for a run: 480 px high whatever the number of rows, 700..1800 px
    wide. Rendering: matplotlib (Agg) when importable, with axes, colour bar, title and legend; else
    (``renderer="numpy"``, or after matplotlib failed to draw once) the same layout without text:
    cells, separator, marks (red squares) and a colour bar strip on the right (0 at the bottom,
    ``vmax`` at the top, a black tick at 1.0).
    """
    ratio_RC = np.asarray(ratio_RC, dtype=np.float64)
    R, C = ratio_RC.shape
    E = C if num_experts is None else num_experts
    steps_R = list(range(R)) if steps_R is None else list(steps_R)
    if slot_expert_RG is not None:
        slot_expert_RG = np.asarray(slot_expert_RG, dtype=np.int64).reshape(R, C - E)
        ratio_RC = ratio_RC.copy()
        ratio_RC[:, E:][slot_expert_RG < 0] = np.nan  # unused slot
    size = heatmap_size(C)
    if renderer == "matplotlib" or (renderer == "auto" and have_matplotlib()):
        try:
            return _heatmap_matplotlib(ratio_RC, steps_R, E, slot_expert_RG, title, vmax, size)
        except Exception as e:  # e.g. a matplotlib this was not tried with: an unlabelled image, not a failed run
            if renderer == "matplotlib":
                raise
            _MPL_FAILED.append(f"{type(e).__name__}: {e}")
    return _heatmap_numpy(ratio_RC, E, slot_expert_RG, vmax, size)


def _marks(slot_expert_RG) -> list[tuple[int, int]]:
    """(row, expert) of each expert cloned into a slot at that row's step."""
    if slot_expert_RG is None:
        return []
    return sorted({(r, int(slot_expert_RG[r, g])) for r, g in zip(*np.nonzero(slot_expert_RG >= 0))})


def _viridis(x: np.ndarray, vmax: float) -> np.ndarray:
    """float RGB of ``x`` on the 5-stop viridis-like scale from 0 to ``vmax`` (clipped); NaN: grey."""
    t = np.clip(np.nan_to_num(x) / vmax, 0.0, 1.0) * (len(_STOPS) - 1)
    lo = np.floor(t).astype(int).clip(0, len(_STOPS) - 2)
    frac = (t - lo)[..., None]
    rgb = _STOPS[lo] * (1 - frac) + _STOPS[lo + 1] * frac
    rgb[np.isnan(x)] = _UNUSED
    return rgb


def _heatmap_numpy(ratio_RC, E, slot_expert_RG, vmax, size) -> np.ndarray:
    (h, w), (R, C) = size, ratio_RC.shape
    G = C - E
    img = np.full((h, w, 3), 255, dtype=np.uint8)
    top, bottom, left, bar_w = 10, h - 10, 10, 20
    bar_x = w - 10 - bar_w
    right = bar_x - 16
    sep = 6 if G else 0
    home_w = round((right - left - sep) * E / C)
    slot_x = left + home_w + sep
    rows = ((np.arange(top, bottom) - top) * R) // (bottom - top)
    cols = np.concatenate([(np.arange(home_w) * E) // home_w,
                           E + (np.arange(right - slot_x) * G) // max(right - slot_x, 1) if G else []]).astype(int)
    xs = np.concatenate([np.arange(left, left + home_w), np.arange(slot_x, right) if G else []]).astype(int)
    colours = _viridis(ratio_RC, vmax).astype(np.uint8)
    img[top:bottom, xs] = colours[rows[:, None], cols[None, :]]
    cell_w, cell_h = home_w / E, (bottom - top) / R
    half = max(1, int(0.2 * min(cell_w, cell_h)))
    for r, x in _marks(slot_expert_RG):
        cx, cy = int(left + (x + 0.5) * cell_w), int(top + (r + 0.5) * cell_h)
        img[cy - half:cy + half + 1, cx - half:cx + half + 1] = _MARK
    values = vmax * (bottom - 1 - np.arange(top, bottom)) / (bottom - top - 1)  # vmax at the top
    img[top:bottom, bar_x:bar_x + bar_w] = _viridis(values, vmax).astype(np.uint8)[:, None]
    one = bottom - 1 - round((bottom - top - 1) / vmax)
    img[one, bar_x - 4:bar_x + bar_w] = 0  # tick at 1.0 (balanced)
    return img


def _heatmap_matplotlib(ratio_RC, steps_R, E, slot_expert_RG, title, vmax, size) -> np.ndarray:
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    (h, w), (R, C) = size, ratio_RC.shape
    G = C - E
    fig = Figure(figsize=(w / 100, h / 100), dpi=100)  # fixed margins (px): a layout engine costs 2x the time
    canvas = FigureCanvasAgg(fig)
    top = 56 if G else 30  # px above the axes: the title, and with ECHO the legend's line under it
    ax = fig.add_axes((70 / w, 50 / h, 1 - 160 / w, 1 - (50 + top) / h))
    cax = fig.add_axes((1 - 80 / w, 50 / h, 14 / w, 1 - (50 + top) / h))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad=np.array(_UNUSED) / 255)
    im = ax.imshow(np.ma.masked_invalid(ratio_RC), cmap=cmap, norm=Normalize(0.0, vmax), aspect="auto",
                   interpolation="nearest")

    def ticks(n, most):
        return [int(t) for t in MaxNLocator(nbins=most, integer=True).tick_values(0, n - 1) if 0 <= t <= n - 1]

    col_px = (w - 160) / C  # ticks about 45 px apart at most
    xt = ticks(E, int(np.clip(E * col_px // 45, 2, 16)))
    xl = [str(t) for t in xt]
    if G:
        ax.axvline(E - 0.5, color="white", linewidth=4)
        st = ticks(G, int(np.clip(G * col_px // 45, 1, 8)))
        xt, xl = xt + [E + g for g in st], xl + [f"s{g}" for g in st]
        ax.set_xlabel("expert index (home load after ECHO)  |  ECHO slots s0, s1, ... (clone load)")
    else:
        ax.set_xlabel("expert index")
    ax.set_xticks(xt, xl, fontsize=8)
    yt = ticks(R, 10)
    ax.set_yticks(yt, [str(steps_R[i]) for i in yt], fontsize=8)
    ax.set_ylabel("training step (newest at the bottom)")
    fig.text(70 / w, 1 - 6 / h, title, ha="left", va="top", fontsize=10)
    marks = _marks(slot_expert_RG)
    if slot_expert_RG is not None:
        cell_pt = 0.72 * min((w - 160) / C, (h - 50 - top) / R)  # a cell's side in points
        if marks:
            ys, xs = zip(*marks)
            ax.scatter(xs, ys, marker="x", color=np.array(_MARK) / 255,
                       s=float(np.clip(0.6 * cell_pt, 3, 9)) ** 2, linewidths=1.2)
        handles = [Line2D([], [], linestyle="none", marker="x", color=np.array(_MARK) / 255,
                          label="cloned into an ECHO slot at that step"),
                   Patch(facecolor=np.array(_UNUSED) / 255, label="unused ECHO slot")]
        ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=2, fontsize=8,
                  frameon=False, borderaxespad=0.1)
    fig.colorbar(im, cax=cax, extend="max", label=f"load / mean load (1 = balanced; > {vmax:g} clipped)")
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


class MetricsLogger:
    """Rank-0 TensorBoard writer plus per-layer load history for the heatmaps."""

    def __init__(self, log_dir: str | None, history: int = 64, purge_step: int | None = None, log=print):
        """``purge_step``: a resumed run's first step; TensorBoard hides events logged at or after
        it by the interrupted run. ``history``: logged steps (rows) a heatmap shows. ``log``: where
        the one-time note that matplotlib is missing goes."""
        self.writer = None
        if log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(log_dir, exist_ok=True)
            self.writer = SummaryWriter(log_dir=log_dir, purge_step=purge_step)
        self.history: dict[str, deque] = {}
        self.history_len = history
        self.log, self.told_no_matplotlib = log, False
        self.painter: ThreadPoolExecutor | None = None  # the one thread that draws (and uses matplotlib)
        self.drawing: list[Future] = []

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self.writer is not None:
            for k, v in values.items():
                self.writer.add_scalar(k, v, step)

    def record_load(self, layer: str, step: int, counts_E: torch.Tensor, echo_load: torch.Tensor | None = None,
                    slot_expert_G: torch.Tensor | None = None) -> float:
        """Add one heatmap row (``step``'s): expert loads / mean; with ECHO (``echo_load``
        [E + G], ``echo.echo_load_columns``), the home experts' loads after rerouting then the echo
        slots' (clone) loads, all over the same mean, and ``slot_expert_G``: the expert each slot
        cloned (-1: unused). Returns max / mean of ``counts_E``."""
        counts = counts_E.float().cpu().numpy()
        mean = max(counts.mean(), 1e-9)
        ratio = counts / mean
        row = ratio if echo_load is None else echo_load.float().cpu().numpy() / mean
        slots = None if slot_expert_G is None else slot_expert_G.cpu().numpy().astype(np.int64)
        self.history.setdefault(layer, deque(maxlen=self.history_len)).append((step, len(counts), row, slots))
        return float(ratio.max())

    def heatmaps(self, step: int) -> None:
        """One ``moe/<layer>/load_heatmap`` image per layer (``heatmap_rgb``) of its recorded rows,
        drawn on a background thread (matplotlib takes ~0.1-0.2 s a figure): the training loop
        goes on meanwhile, unless two calls' images are still being drawn; ``close`` waits for them."""
        if self.writer is None:
            return
        if not have_matplotlib() and not self.told_no_matplotlib:
            self.told_no_matplotlib = True
            why = f"failed ({_MPL_FAILED[0]})" if _MPL_FAILED else "is not installed"
            self.log(f"load heatmaps: matplotlib {why}, so they have no axes, title or legend "
                     "(pip install matplotlib, or moe-echo[plots], for labelled ones)")
        while self.drawing and (self.drawing[0].done() or len(self.drawing) > 1):  # at most one waits
            self.drawing.pop(0).result()  # a drawing error surfaces here, not silently
        if self.painter is None:
            self.painter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="heatmaps")
        snapshot = {layer: list(rows) for layer, rows in self.history.items()}  # rows are never mutated
        self.drawing.append(self.painter.submit(self._draw, step, snapshot))

    def _draw(self, step: int, history: dict[str, list]) -> None:
        for layer, rows in history.items():
            steps = [r[0] for r in rows]
            slots = np.stack([r[3] for r in rows]) if rows[-1][3] is not None else None
            title = (f"{layer}: expert load, last {len(rows)} logged steps ({steps[0]}..{steps[-1]})"
                     + (", ECHO on" if slots is not None else ""))
            img = heatmap_rgb(np.stack([r[2] for r in rows]), steps, num_experts=rows[-1][1], slot_expert_RG=slots,
                              title=title)
            self.writer.add_image(f"moe/{layer}/load_heatmap", img, step, dataformats="HWC")

    def close(self) -> None:
        if self.painter is not None:
            self.painter.shutdown(wait=True)
            for f in self.drawing:
                f.result()
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()


class Progress:
    """A console progress bar (tqdm) on rank 0; silent elsewhere. Its final line is drawn once: the
    last step closes the bar (tqdm draws it on that update, on a later ``write`` and again on close,
    so a captured log held it two or three times); ``write`` then prints plainly."""

    def __init__(self, total: int, initial: int, enabled: bool):
        self.bar, self.enabled = None, enabled
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, mininterval=0.5)

    def update(self, postfix: dict) -> None:
        if self.bar is not None:
            self.bar.set_postfix(postfix, refresh=False)
            if self.bar.n + 1 < self.bar.total:
                self.bar.update(1)
            else:  # the last step: counted without drawing; close() draws the final line
                self.bar.n += 1
                self.close()

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        elif self.enabled:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class RunSummary:
    """Accumulates what the end-of-run summary prints."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.losses: list[tuple[int, float]] = []
        self.first_step: int | None = None  # the steps this run trained (a resumed run starts after its checkpoint)
        self.last_step: int | None = None
        self.tokens = 0
        self.imbalance: list[float] = []
        self.rank_imbalance: list[tuple[float, float]] = []  # (without ECHO, with ECHO)
        self.rank_imbalance_plain: list[float] = []  # EP > 1 without ECHO
        self.replayed_steps = 0
        self.capacity_factor: float | None = None  # grown by overflow replays
        self.peak_mem_gib = 0.0
        self.peer_mem_gib = 0.0  # symmetric-memory buffers (nvlink), outside torch's allocator count

    def count_step(self, step: int, tokens: int) -> None:
        """A step this run trained (confirmed once, replayed or not) and its tokens."""
        self.first_step = step if self.first_step is None else self.first_step
        self.last_step = step
        self.tokens += tokens

    def text(self, extra: dict[str, str]) -> str:
        wall = time.perf_counter() - self.t0
        lines = ["", "=== run summary ==="]
        if self.first_step is not None:
            resumed = f" (resumed after step {self.first_step - 1})" if self.first_step > 1 else ""
            lines.append(f"steps          {self.first_step}..{self.last_step}{resumed}")
        if self.losses:
            n = max(1, len(self.losses) // 10)
            first = sum(l for _, l in self.losses[:n]) / n
            last = sum(l for _, l in self.losses[-n:]) / n
            lines.append(f"loss           {first:.4f} -> {last:.4f} (means of the first and last {n} logged steps)")
        lines.append(f"wall time      {wall:.1f} s")
        lines.append(f"tokens         {self.tokens:,}  ({self.tokens / max(wall, 1e-9):,.0f} tok/s)")
        if self.imbalance:
            lines.append(f"expert load    max/mean {sum(self.imbalance) / len(self.imbalance):.3f} (mean over layers and logged steps)")
        if self.rank_imbalance:
            n = len(self.rank_imbalance)
            b, a = sum(x for x, _ in self.rank_imbalance) / n, sum(y for _, y in self.rank_imbalance) / n
            lines.append(f"rank load      max/mean {b:.3f} without ECHO -> {a:.3f} with ECHO (mean over layers and logged steps)")
        if self.rank_imbalance_plain:
            r = sum(self.rank_imbalance_plain) / len(self.rank_imbalance_plain)
            lines.append(f"rank load      max/mean {r:.3f} (mean over layers and logged steps; the other ranks wait for the "
                         "busiest, [moe_echo] echo = true moves its load to spare slots)")
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
