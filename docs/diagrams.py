"""Draw the documentation's diagrams into docs/img/ (PNG, matplotlib boxes and arrows).

    .venv/bin/python docs/diagrams.py          # needs matplotlib (pip install -e ".[plots]")

Each figure is a sketch of how moe-echo works, not a measurement: bar heights are illustrative.
"""

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "img")
BLUE, GREEN, ORANGE, RED, GREY, PURPLE = "#cfe2f3", "#d9ead3", "#fce5cd", "#f4cccc", "#eeeeee", "#e1d5e7"
DARK = "#333333"


def canvas(w, h):
    fig, ax = plt.subplots(figsize=(w, h))
    ax.set_xlim(0, w * 10)
    ax.set_ylim(0, h * 10)
    ax.axis("off")
    return fig, ax


def box(ax, x, y, w, h, text, color=BLUE, size=9, style="round,pad=0.3", ls="-", weight="normal"):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle=style, fc=color, ec=DARK, lw=1, ls=ls))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, weight=weight, wrap=True)


def arrow(ax, a, b, text="", color=DARK, size=8, style="-|>", ls="-", rad=0.0, offset=(0, 1.2), lw=1.2):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=11, color=color, lw=lw, ls=ls,
                                 connectionstyle=f"arc3,rad={rad}", shrinkA=2, shrinkB=2))
    if text:
        ax.text((a[0] + b[0]) / 2 + offset[0], (a[1] + b[1]) / 2 + offset[1], text, ha="center", va="bottom",
                fontsize=size, color=color)


def save(fig, name):
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, name)
    fig.savefig(path, dpi=100, bbox_inches="tight", pil_kwargs={"optimize": True})
    plt.close(fig)
    print(f"{path}: {os.path.getsize(path) // 1024} KB")


def load_bars(ax, x0, y0, loads, clones=None, title="", title_y=None, width=6.0, gap=2.5, scale=6.0):
    """Stacked rank-load bars: loads[r] = [home expert loads]; clones[r] = [(clone load, colour)]; a dashed
    line at the mean rank load."""
    colors = ["#6fa8dc", "#93c47d", "#f6b26b"]
    clones = clones or [[] for _ in loads]
    totals = [sum(h) + sum(v for v, _ in c) for h, c in zip(loads, clones)]
    for r, homes in enumerate(loads):
        x, y = x0 + r * (width + gap), y0
        for i, v in enumerate(homes):
            ax.add_patch(Rectangle((x, y), width, v * scale, fc=colors[i % len(colors)], ec="white", lw=0.8))
            y += v * scale
        for v, c in clones[r]:
            ax.add_patch(Rectangle((x, y), width, v * scale, fc=c, ec=DARK, lw=0.6, hatch="///"))
            y += v * scale
        ax.text(x + width / 2, y0 - 1, f"rank {r}", ha="center", va="top", fontsize=8)
    x1 = x0 + len(loads) * (width + gap) - gap
    mean = sum(totals) / len(totals)
    ax.plot([x0 - 1, x1 + 1], [y0 + mean * scale] * 2, ls="--", color="#cc0000", lw=1)
    ax.text(x1 + 1.5, y0 + mean * scale, "mean", fontsize=7.5, color="#cc0000", va="center")
    ax.text((x0 + x1) / 2, title_y if title_y is not None else y0 + max(totals) * scale + 2, title, ha="center",
            fontsize=9, weight="bold")


def pipeline(ax, x0, y, steps, width=100.0, h=9.0, gap=2.4, size=7.5):
    """A row of boxes joined by arrows across ``width``."""
    w = (width - gap * (len(steps) - 1)) / len(steps)
    for i, (t, c) in enumerate(steps):
        x = x0 + i * (w + gap)
        box(ax, x + 0.3, y, w - 0.6, h, t, c, size=size)
        if i:
            arrow(ax, (x - gap + 0.1, y + h / 2), (x + 0.2, y + h / 2))


# Illustrative loads: rank 0 holds three hot experts; ECHO moves their excess into clone slots elsewhere.
HOT = [[0.9, 0.8, 0.7], [0.3, 0.2, 0.15], [0.25, 0.2, 0.15], [0.2, 0.15, 0.15]]
BALANCED = [[0.31, 0.36, 0.36], [0.3, 0.2, 0.15], [0.25, 0.2, 0.15], [0.2, 0.15, 0.15]]
CLONES = [[], [(0.39, "#6fa8dc")], [(0.44, "#93c47d")], [(0.34, "#f6b26b"), (0.2, "#6fa8dc")]]


# The README's picture: the step as one CUDA graph, and what ECHO does to rank loads.
def overview():
    fig, ax = canvas(10, 5)
    ax.add_patch(FancyBboxPatch((0.5, 31), 99, 13, boxstyle="round,pad=0.4", fc="white", ec="#8e7cc3", lw=1.6,
                                ls="--"))
    ax.text(50, 45.5, "one training step = one CUDA graph: forward, backward, gated optimizer step",
            ha="center", fontsize=9.5, color="#674ea7", weight="bold")
    pipeline(ax, 1.5, 33, [("router:\ntop-k experts", BLUE), ("ECHO planner:\nclone hot experts", GREEN),
                           ("dispatch:\nfixed capacity,\nno host read", ORANGE), ("grouped\nexperts", BLUE),
                           ("combine", ORANGE), ("backward", GREY), ("optimizer step,\ngated on the GPU", RED)],
             width=97, h=9, size=7.5)
    load_bars(ax, 8, 4, HOT, title="rank load, ECHO off: rank 0 is the straggler", title_y=25, scale=8)
    load_bars(ax, 60, 4, BALANCED, CLONES, title="ECHO on: clones (hatched) take the excess", title_y=25, scale=8)
    save(fig, "overview.png")


# The MoE layer as data: shapes and where each step runs.
def layer():
    fig, ax = canvas(11.5, 5.4)
    rows = [
        ("x_TD", "router", "ids_TK, w_TK, counts_E", "T tokens, K choices, E experts", BLUE),
        ("counts_E", "all_gather  [EP > 1]", "counts_RE on every rank", "R = EP ranks; stays on the device", GREY),
        ("counts_RE", "ECHO planner  [echo]", "plan: slot -> home expert,\n      per-source quotas",
         "the same plan on every rank", GREEN),
        ("ids_TK", "rewrite  [echo]", "ids over home experts\n+ echo slots", "each token keeps K targets and weights",
         GREEN),
        ("x_TD, ids_TK", "dispatch", "x_ND (expert-major),\ncounts_e", "fixed capacity; overflow sets a flag", ORANGE),
        ("x_ND", "grouped experts (SwiGLU)", "y_ND", "group offsets read on the device", BLUE),
        ("y_ND, w_TK", "combine", "y_TD = sum_k w_TK * y", "fp32 sum, back on the source rank", ORANGE),
    ]
    y = 47
    for inp, op, out, note, c in rows:
        ax.text(13, y + 2.5, inp, ha="right", va="center", fontsize=8.5, family="monospace")
        arrow(ax, (14, y + 2.5), (19, y + 2.5))
        box(ax, 20, y, 24, 5, op, c, size=8.5)
        arrow(ax, (44.6, y + 2.5), (49, y + 2.5))
        ax.text(50, y + 2.5, out, ha="left", va="center", fontsize=8.5, family="monospace")
        ax.text(80, y + 2.5, note, ha="left", va="center", fontsize=8, color="#555555", style="italic")
        y -= 7
    ax.text(57, 1, "the shared experts run beside this on a side CUDA stream; their output is added at the end",
            ha="center", fontsize=8, color="#555555")
    save(fig, "layer.png")


# ECHO: what the planner does, and a clone's life within one step.
def echo():
    fig, ax = canvas(10, 5.2)
    load_bars(ax, 6, 23, HOT, title="gathered counts: rank 0 is hot", title_y=46, scale=8)
    load_bars(ax, 60, 23, BALANCED, CLONES, title="plan: S echo slots per rank", title_y=46, scale=8)
    arrow(ax, (42, 33), (56, 33), "planner", size=8)
    ax.text(50, 14.5, "every step, in every MoE layer (clones own no parameters and no optimizer state)",
            ha="center", fontsize=8.5, weight="bold")
    pipeline(ax, 0.5, 2, [("gather\ncounts_RE", GREY), ("plan, the same\non every rank", GREEN),
                          ("rewrite\nrouting", GREEN), ("copy home\nweights to slots", ORANGE),
                          ("experts run\nhomes + clones", BLUE), ("backward: clone\ngrads -> home", ORANGE),
                          ("step ends:\nclones dropped", GREY)], width=99, h=9, size=7.5)
    save(fig, "echo.png")


# The overflow gate and the replay timeline (the host reads each step's flag one step late).
def overflow():
    fig, ax = canvas(10.5, 4.4)
    ax.text(0, 33, "GPU", fontsize=9, weight="bold", va="center")
    ax.text(0, 16, "host", fontsize=9, weight="bold", va="center")
    gpu = [(6, 13, "step s overflows:\nflag set,\nno update", RED), (19.5, 12, "step s+1:\ngated too\n(flag sticky)", RED),
           (48, 12, "step s again,\nexact path\n(alltoall)", GREEN), (60.5, 12, "step s+1\nagain,\nexact path", GREEN),
           (73, 15, "s+2, s+3: eager\nwarm-up, then\ncapture", PURPLE), (88.5, 16, "later steps:\nthe graph", BLUE)]
    for x, w, t, c in gpu:
        box(ax, x, 28, w - 1, 10, t, c, size=7.5)
    host = [(6, 13, "launch s", GREY), (19.5, 12, "launch s+1", GREY), (32, 15, "read the flags\nof s from pinned\nmemory, one\nstep late", ORANGE),
            (48, 24.5, "rewind the lr schedule;\nreplay s and s+1", ORANGE),
            (73, 31.5, "every grow_capacity_after-th replay:\ncapacity = what it needed + 10%", ORANGE)]
    for x, w, t, c in host:
        box(ax, x, 11, w - 1, 10, t, c, size=7.5)
    arrow(ax, (12, 27.5), (38, 21.5), rad=-0.2)
    arrow(ax, (59, 21.5), (59, 27.5))
    arrow(ax, (82, 21.5), (80, 27.5))
    ax.plot([0, 104], [6, 6], color=DARK, lw=0.8)
    ax.text(104, 3.5, "time", ha="right", fontsize=8)
    ax.text(52, 0, "nothing is dropped: a gated step is run again, never skipped (a non-finite step uses the same gate "
            "and is skipped)", ha="center", fontsize=8, color="#555555")
    save(fig, "overflow.png")


# The CUDA-graph capture policy.
def graphs():
    fig, ax = canvas(10, 4.4)
    box(ax, 1, 24, 21, 9, "eager warm-up:\ncuda_graph_warmup steps", GREY, size=8)
    box(ax, 27, 24, 20, 9, "capture one step:\nfwd + bwd + optimizer", PURPLE, size=8)
    box(ax, 52, 24, 18, 9, "replay the graph\nevery step", BLUE, size=8)
    box(ax, 75, 24, 24, 9, "overflow: eager replay\non the exact path", RED, size=8)
    arrow(ax, (22.6, 28.5), (26.5, 28.5))
    arrow(ax, (47.6, 28.5), (51.5, 28.5))
    arrow(ax, (70.6, 28.5), (74.5, 28.5))
    arrow(ax, (87, 23.4), (11.5, 23.4), rad=-0.22)
    ax.text(50, 13.5, 'cuda_graph_after_replay = "recapture" (the default)', ha="center", fontsize=8)
    box(ax, 75, 38, 24, 4.5, '"eager": eager from here on', GREY, size=7.5)
    arrow(ax, (87, 33.6), (87, 37.5))
    box(ax, 1, 1, 98, 7.5, "not captured (the run says why once and runs eagerly): a dispatcher that sizes buffers on "
        "the host\n(alltoall, deepep), on_overflow = \"stop\", fp32 experts, no CUDA device", ORANGE, size=8)
    save(fig, "graphs.png")


# Across hosts: the hierarchical dispatcher.
def hosts():
    fig, ax = canvas(10, 4.8)
    for h, x0 in ((0, 2), (1, 58)):
        ax.add_patch(FancyBboxPatch((x0, 6), 38, 37, boxstyle="round,pad=0.4", fc="white", ec=DARK, lw=1))
        ax.text(x0 + 19, 44.5, f"host {h}", ha="center", fontsize=9, weight="bold")
        for l in range(4):
            c = GREY
            if (h, l) == (0, 1):
                c = ORANGE
            elif (h, l) == (1, 1):
                c = BLUE
            elif h == 1:
                c = GREEN
            box(ax, x0 + 12, 35 - l * 9, 14, 6, f"GPU {l}", c, size=8)
    ax.text(21, 1.5, "a token on host 0, GPU 1;\nits experts on host 1, GPUs 0, 2 and 3", ha="center", fontsize=8)
    arrow(ax, (28.6, 29), (69.4, 29), "network: once per\n(token, host), to the\nsame local index",
          color="#cc0000", size=7.5, lw=2, offset=(0, 1))
    for l in (0, 2, 3):
        arrow(ax, (84.6, 29), (84.6, 38 - l * 9), color="#3d85c6", rad=-0.6 if l else 0.6)
    ax.text(77, 1.5, "GPU 1 fans it out inside its host; combine sums there,\nand one row per (token, host) crosses back",
            ha="center", fontsize=8)
    save(fig, "hosts.png")


if __name__ == "__main__":
    overview()
    layer()
    echo()
    overflow()
    graphs()
    hosts()
