"""Where a training step's GPU time goes, from a torch.profiler Chrome trace.

    python benchmarks/step_breakdown.py [LABEL=]TRACE.json ... [--name NAME] [--out DIR]
                                        -> step_breakdown_<NAME>_<N>x<GPU>.{json,md}

N and GPU come from the traces (the profiled run's world size, its device name); ``--gpus`` / ``--gpu`` set them.

The recipe writes the traces with ``[profiling] enable_profiling``. A CUDA-graphed step shows as one
graph launch: its kernels have no launching op and are classified by name, and the steps are counted
as the graph launches in the trace. Each GPU kernel is attributed to the CPU ops that launched it
(the launch's correlation id, then the ops enclosing the launch on its thread) and put in the first
category whose rule matches, innermost op first:

    optimizer       inside ``Optimizer.step`` (fused AdamW) or ``zero_grad``
    routed experts  grouped GEMMs (``aten::_grouped_mm``, or QuACK's ``quack::`` GEMMs) and the expert SwiGLU
    dense GEMMs     ``mm`` / ``addmm`` / ``bmm`` / ``linear`` / ``matmul``
    attention       scaled-dot-product / flash / efficient attention kernels
    dispatch        token permutation, gather / scatter of rows, histogram, sort (the MoE data movement;
                    with EP also the peer-memory copy kernels and their barriers)
    collectives     NCCL kernels (FSDP's all-gathers and reduce-scatters, the alltoall/padded
                    dispatchers' all_to_all), by kernel name, whatever op launched them
    echo            anything inside ECHO's ops (its ``echo_route`` span: counts, planner, routing rewrite;
                    ``_ExtendWithClones``: clone weights in, their gradients back), whatever the inner op,
                    and the planner's Triton kernels by name
    router          scores, top-k, bias, normalisation of the gate
    norms           RMSNorm (fused or composite)
    loss            cross-entropy / log-softmax / NLL (also kernels/cross_entropy.py's fused kernels)
    fp8 scaling     what FP8 costs besides its GEMMs: amax reductions and casts to e4m3 (torchao's Float8Linear,
                    inductor's fused kernels, kernels/fp8.py's row quantisation); FP8 GEMMs stay GEMMs
    casts/copies    ``_to_copy``, ``copy_``, ``cat``, ``stack``, contiguous copies
    other           the rest (elementwise, reductions, ...)

Per category: milliseconds per step (kernel time summed, streams included) and the share of the
summed kernel time; ``busy_ms`` is the union of kernel intervals per step (what overlap hides).

Communication: the kernels that move data between GPUs, by name (NCCL's, the peer-memory kernels
``_peer_*`` and barriers, peer-to-peer memcpys); ``comm_ms`` is the union of their intervals per step and
``comm_exposed_ms`` the part of it when no other kernel runs (on any stream): communication that nothing
hides; ``comm_by_kernel`` splits it by kernel name. ``nvlink``'s kernels that touch only this rank's memory have
names of their own (``_scatter_rows_kernel``: the expansion into expert rows; ``_gather_sum_kernel``: the owner's
sums) and are dispatch work, not communication; its peer reads and writes are ``_peer_*`` kernels. (Traces from
before that split ran the combine's pull in ``_gather_sum_kernel`` with the local sums: for them the exposed
share is a lower bound and ``comm_exposed_upper_ms`` counts those kernels as communication too, an upper bound;
the expansion ran in ``_peer_scatter_kernel`` and counts as communication.) ``comm_exposed_by_phase`` splits both
by where in the step it falls (``phase_of``): ``forward`` (up to the loss), ``backward`` (from the loss to the
optimizer) and ``optimizer`` (the optimizer, then the next step's collectives before its first compute, such as
FSDP's first all-gather); ``ms_by_phase`` splits each category's kernel time the same way.
"""

import argparse
import json
import os
import re
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CATEGORIES = ("optimizer", "routed experts", "dense GEMMs", "fp8 scaling", "attention", "dispatch", "collectives", "echo",
              "router", "norms", "loss", "casts/copies", "other")
COLLECTIVE = re.compile(r"^nccl", re.I)  # decided by the kernel alone: FSDP launches them under copy ops
ECHO = re.compile(r"echo_route|ExtendWithClones|PeerMulticast")  # any enclosing op: ECHO's cost, whatever ran inside
ECHO_KERNEL = re.compile(r"^_(fill|select|quota|greedy_slots)_kernel$")  # kernels/echo_plan.py
# (category, pattern on an op name); tried innermost op first, then outwards
RULES = [
    ("optimizer", re.compile(r"Optimizer\.(step|zero_grad)|_fused_adamw|_foreach_")),
    ("routed experts", re.compile(r"_grouped_mm|GroupedMm|grouped_swiglu|experts|quack", re.I)),
    ("attention", re.compile(r"attention|flash|sdpa|_efficient_attention|_cudnn_attention", re.I)),
    ("dense GEMMs", re.compile(r"aten::(mm|addmm|bmm|linear|matmul|baddbmm|_scaled_mm)$|MmBackward|AddmmBackward")),
    ("fp8 scaling", re.compile(r"float8|fp8|amax|quant", re.I)),
    ("norms", re.compile(r"rms_norm|RmsNorm|layer_norm", re.I)),
    ("loss", re.compile(r"cross_?entropy|log_softmax|nll_loss|LogSoftmax|NllLoss", re.I)),
    ("router", re.compile(r"topk|router|sigmoid|softmax|TopkBackward|gate", re.I)),
    ("dispatch", re.compile(r"dispatch|combine|permute_rows|gather_rows|scatter_rows|moe_rows|histc|bincount|"
                            r"argsort|aten::sort|index_select|index_add|scatter_add|repeat_interleave", re.I)),
    ("casts/copies", re.compile(r"aten::(_to_copy|copy_|cat|stack|contiguous|clone|to)$|ToCopyBackward|CatBackward")),
]
KERNEL_RULES = [  # kernel names that say it all (no launching op found, e.g. Triton kernels launched from Python)
    ("optimizer", re.compile(r"adam", re.I)),
    ("loss", re.compile(r"cross_entropy|nll_loss", re.I)),
    # CUTLASS 3 grouped GEMMs (torch._grouped_mm's kernels) are "pointer-array" kernels over a
    # GroupProblemShape; launched from a backward without a recorded op they were counted as dense
    ("routed experts", re.compile(r"grouped|swiglu|PtrArray|GroupProblemShape|quack|_wgrad_fp8", re.I)),
    ("attention", re.compile(r"flash|fmha|attention", re.I)),
    ("dense GEMMs", re.compile(r"gemm|sm90_xmma|cutlass|nvjet", re.I)),
    ("fp8 scaling", re.compile(r"float8|fp8|e4m3|amax|quant", re.I)),  # torchao's (inductor's) and ours
    ("dispatch", re.compile(r"rows|permute|scatter|gather|histogram|radix|sort|_peer_|barrier", re.I)),
    ("norms", re.compile(r"rms|norm", re.I)),
    ("casts/copies", re.compile(r"copy|cat", re.I)),
]


COMM_KERNEL = re.compile(r"^nccl|_peer_\w*kernel|barrier|PtoP", re.I)  # kernels that move data between GPUs
BARRIER = re.compile(r"barrier", re.I)  # symmetric-memory / peer barriers: time a rank spends waiting for its peers
PEER_READ = re.compile(r"^_gather_sum_kernel")  # before the local / peer split: the combine's pull and local sums
SPLIT_PEER_READ = "_peer_gather_sum_kernel"  # the pull in a kernel of its own: _gather_sum_kernel is local only


PHASES = ("forward", "backward", "optimizer")
# the next step's forward has begun at the first of these after an optimizer kernel (collectives before it, such
# as FSDP's first all-gather, stay with the optimizer phase: the step boundary)
FORWARD_WORK = {"attention", "dense GEMMs", "routed experts", "router", "norms", "dispatch", "echo", "fp8 scaling"}


def phase_of(cats: list[str]) -> list[str]:
    """Each kernel's phase, for kernels in start-time order given by category: forward until a loss kernel,
    backward from it until an optimizer kernel, optimizer until the next forward work (``FORWARD_WORK``)."""
    out, phase = [], "forward"
    for cat in cats:
        if cat == "optimizer":
            phase = "optimizer"
        elif cat == "loss":
            phase = "backward"
        elif phase == "optimizer" and cat in FORWARD_WORK:
            phase = "forward"
        out.append(phase)
    return out


def _exposed_by_phase(spans: list[tuple], phases: list[str], cover: list[tuple[float, float]]) -> dict:
    """Per phase: the union of ``spans`` (start, end) of that phase, less what ``cover`` overlaps (microseconds)."""
    out = {}
    for ph in PHASES:
        mine = _union([s for s, p in zip(spans, phases) if p == ph])
        out[ph] = _length(mine) - _overlap(mine, cover)
    return out


def classify(stack: list[str], kernel: str) -> str:
    if COLLECTIVE.search(kernel):
        return "collectives"
    if ECHO_KERNEL.search(kernel) or any(ECHO.search(name) for name in stack):
        return "echo"
    for name in reversed(stack):  # innermost first
        for cat, rule in RULES:
            if rule.search(name):
                return cat
    for cat, rule in KERNEL_RULES:
        if rule.search(kernel):
            return cat
    return "other"


def _stacks_at(ops_by_tid: dict, launches: dict) -> dict:
    """correlation id -> names of the ops enclosing its launch, outermost first (one sweep per thread)."""
    queries = defaultdict(list)
    for corr, (tid, ts) in launches.items():
        queries[tid].append((ts, corr))
    out = {}
    for tid, qs in queries.items():
        ops = sorted(ops_by_tid.get(tid, []), key=lambda o: (o[0], -o[1]))
        stack, i = [], 0
        for ts, corr in sorted(qs):
            while i < len(ops) and ops[i][0] <= ts:
                while stack and stack[-1][1] < ops[i][0]:
                    stack.pop()
                stack.append(ops[i])
                i += 1
            while stack and stack[-1][1] < ts:
                stack.pop()
            out[corr] = [name for start, end, name in stack if end >= ts]
        del stack
    return out


def breakdown(trace_path: str) -> dict:
    """Per-step milliseconds by category, plus steps, kernel_ms and busy_ms per step."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    ops_by_tid = defaultdict(list)  # tid -> [(ts, end, name)]
    launches = {}  # correlation id -> (tid, ts)
    kernels, steps, replays = [], [], 0
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, name = e.get("cat", ""), e.get("name", "")
        if cat in ("cpu_op", "user_annotation", "python_function"):
            ops_by_tid[e["tid"]].append((e["ts"], e["ts"] + e.get("dur", 0), name))
            if name.startswith("ProfilerStep#"):
                steps.append(name)
        elif cat == "cuda_runtime" or cat == "cuda_driver":
            if name.startswith("cudaGraphLaunch"):
                replays += 1
            corr = e.get("args", {}).get("correlation")
            if corr is not None:
                launches[corr] = (e["tid"], e["ts"])
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels.append(e)
    stacks = _stacks_at(ops_by_tid, launches)
    if replays:  # graphed: a replay launched before the window also runs inside it; its launch is not in the
        # trace, so its kernels (correlation ids without a launch) belong to no counted step
        kernels = [k for k in kernels if k.get("args", {}).get("correlation") in launches]

    ms, top, wait = defaultdict(float), defaultdict(float), 0.0
    intervals, comm, reads, others, comm_named, kinds = [], [], [], [], [], []
    kernels = sorted(kernels, key=lambda k: k["ts"])
    mixed_reads = PEER_READ if not any(k.get("name") == SPLIT_PEER_READ for k in kernels) else re.compile(r"(?!)")
    for k in kernels:
        corr = k.get("args", {}).get("correlation")
        stack = stacks.get(corr, [])
        cat = classify(stack, k.get("name", ""))
        ms[cat] += k.get("dur", 0) / 1e3
        ops = [n for n in stack if not n.startswith("ProfilerStep")]
        top[(cat, " < ".join(ops[-2:][::-1]), k.get("name", ""))] += k.get("dur", 0) / 1e3
        if BARRIER.search(k.get("name", "")):
            wait += k.get("dur", 0) / 1e3
        span = (k["ts"], k["ts"] + k.get("dur", 0))
        intervals.append(span)
        name = k.get("name", "")
        (comm if COMM_KERNEL.search(name) else reads if mixed_reads.search(name) else others).append(span)
        kinds.append((span, cat, "comm" if COMM_KERNEL.search(name) else "read" if mixed_reads.search(name) else ""))
        if COMM_KERNEL.search(name):
            comm_named.append((span, name))
    busy = _length(_union(intervals))
    comm_U, rest_U = _union(comm), _union(reads + others)
    comm_ms = _length(comm_U)
    comm_exposed = comm_ms - _overlap(comm_U, rest_U)
    # upper bound: the combine's peer reads counted as communication too (their local sums with them)
    wide_U = _union(comm + reads)
    comm_exposed_upper = _length(wide_U) - _overlap(wide_U, _union(others)) if reads else comm_exposed
    phases = phase_of([c for _, c, _ in kinds])
    by_phase = {ph: defaultdict(float) for ph in PHASES}
    for (span, cat, _), ph in zip(kinds, phases):
        by_phase[ph][cat] += (span[1] - span[0]) / 1e3
    low = _exposed_by_phase([s for s, _, kind in kinds if kind == "comm"],
                            [p for p, (_, _, kind) in zip(phases, kinds) if kind == "comm"], rest_U)
    wide = [(s, p) for p, (s, _, kind) in zip(phases, kinds) if kind]
    high = _exposed_by_phase([s for s, _ in wide], [p for _, p in wide], _union(others)) if reads else low
    by_kernel = defaultdict(lambda: [0.0, 0.0])  # name -> [kernel time, the part no non-communication kernel covers]
    for span, name in comm_named:
        by_kernel[name][0] += span[1] - span[0]
        by_kernel[name][1] += span[1] - span[0] - _overlap([span], rest_U)
    # a graphed step is one replay; the profiler's window can hold one replay more than its steps
    # (the last step's replay launched before the window closes), so replays launched in it count the steps
    n = max(1, len(set(steps)), replays)
    total = sum(ms.values())
    ranked = sorted(top.items(), key=lambda kv: -kv[1])
    return {"steps": n, "kernel_ms": total / n, "busy_ms": busy / 1e3 / n, "barrier_ms": wait / n,
            "comm_ms": comm_ms / 1e3 / n, "comm_exposed_ms": comm_exposed / 1e3 / n,
            "comm_exposed_upper_ms": comm_exposed_upper / 1e3 / n,
            "comm_exposed_by_phase": {ph: {"ms": low[ph] / 1e3 / n, "upper_ms": high[ph] / 1e3 / n} for ph in PHASES},
            "comm_by_kernel": [{"kernel": k, "ms": v[0] / 1e3 / n, "exposed_ms": v[1] / 1e3 / n}
                               for k, v in sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:12]],
            "ms": {c: ms.get(c, 0.0) / n for c in CATEGORIES},
            "ms_by_phase": {ph: {c: by_phase[ph].get(c, 0.0) / n for c in CATEGORIES} for ph in PHASES},
            "pct": {c: 100 * ms.get(c, 0.0) / total if total else 0.0 for c in CATEGORIES},
            "top": [{"category": c, "ops": o, "kernel": k, "ms": v / n} for (c, o, k), v in ranked[:30]],
            "by_category": {cat: [{"ops": o, "kernel": k, "ms": v / n} for (c, o, k), v in ranked if c == cat][:12]
                            for cat in CATEGORIES}}


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering ``spans``."""
    out = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _length(disjoint: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in disjoint)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two sorted, disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def table(rows: list[dict]) -> str:
    head = "| category | " + " | ".join(f"{r['label']} ms/step | %" for r in rows) + " |"
    lines = [head, "|---|" + "---|---|" * len(rows)]
    for c in CATEGORIES:
        lines.append(f"| {c} | " + " | ".join(f"{r['ms'][c]:.2f} | {r['pct'][c]:.1f}" for r in rows) + " |")
    lines.append("| **kernel time** | " + " | ".join(f"{r['kernel_ms']:.2f} | 100" for r in rows) + " |")
    lines.append("| GPU busy (union) | " + " | ".join(f"{r['busy_ms']:.2f} | " for r in rows) + " |")
    if any(r.get("comm_ms") for r in rows):  # % of GPU busy time
        lines.append("| communication (union) | " + " | ".join(
            f"{r.get('comm_ms', 0.0):.2f} | {100 * r.get('comm_ms', 0.0) / r['busy_ms']:.1f}" for r in rows) + " |")
        lines.append("| of which exposed (no other kernel running) | " + " | ".join(
            f"{r.get('comm_exposed_ms', 0.0):.2f} | {100 * r.get('comm_exposed_ms', 0.0) / r['busy_ms']:.1f}"
            for r in rows) + " |")
    if any(r.get("comm_exposed_upper_ms", 0.0) > r.get("comm_exposed_ms", 0.0) for r in rows):
        lines.append("| exposed, counting the combine's peer reads (`_gather_sum_kernel`) too | " + " | ".join(
            f"{r.get('comm_exposed_upper_ms', 0.0):.2f} | {100 * r.get('comm_exposed_upper_ms', 0.0) / r['busy_ms']:.1f}"
            for r in rows) + " |")
    if any(r.get("comm_exposed_by_phase") and r.get("comm_ms") for r in rows):
        upper = any(r.get("comm_exposed_upper_ms", 0.0) > r.get("comm_exposed_ms", 0.0) for r in rows)
        for key, what in [("ms", "exposed")] + ([("upper_ms", "exposed with the peer reads")] if upper else []):
            for ph in PHASES:
                lines.append(f"| {what}, {ph} | " + " | ".join(
                    f"{r['comm_exposed_by_phase'][ph][key]:.2f} | {100 * r['comm_exposed_by_phase'][ph][key] / r['busy_ms']:.1f}"
                    if "comm_exposed_by_phase" in r else " | " for r in rows) + " |")
    if any(r.get("barrier_ms") for r in rows):  # inside dispatch: a rank spinning until its peers arrive
        lines.append("| of which barriers (a rank waiting for its peers) | "
                     + " | ".join(f"{r.get('barrier_ms', 0.0):.2f} | {100 * r.get('barrier_ms', 0.0) / r['kernel_ms']:.1f}"
                                  for r in rows) + " |")
    return "\n".join(lines)


def phase_table(rows: list[dict]) -> str:
    """Kernel time per step by category and phase, one cell "forward / backward / optimizer" per run; rows of
    older results (no ``ms_by_phase``) are left out."""
    rows = [r for r in rows if r.get("ms_by_phase")]
    if not rows:
        return ""
    cats = [c for c in CATEGORIES if any(r["ms_by_phase"][ph][c] for r in rows for ph in PHASES)]
    head = "| category | " + " | ".join(f"{r['label']} ms: " + " / ".join(PHASES) for r in rows) + " |"
    lines = [head, "|---|" + "---|" * len(rows)]
    for c in cats + ["**kernel time**"]:
        cell = (lambda r, ph: sum(r["ms_by_phase"][ph].values())) if c.startswith("**") else (
            lambda r, ph, c=c: r["ms_by_phase"][ph][c])
        lines.append(f"| {c} | " + " | ".join(" / ".join(f"{cell(r, ph):.2f}" for ph in PHASES) for r in rows) + " |")
    return "\n".join(lines)


def trace_machine(trace_path: str) -> tuple[str, int]:
    """(GPU name, world size) a profiler trace records (``deviceProperties``, ``distributedInfo``); ("", 1)
    where it does not say."""
    with open(trace_path) as f:
        data = json.load(f)
    devices = data.get("deviceProperties") or [{}]
    world = (data.get("distributedInfo") or {}).get("world_size", 1)
    return str(devices[0].get("name", "")), int(world or 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="+", help="Chrome trace JSON files (label=path to name a column)")
    ap.add_argument("--out", default=None, help="write step_breakdown_<name>_<N>x<GPU>.md/.json here")
    ap.add_argument("--name", default="v2lite_1b")
    ap.add_argument("--gpu", default=None, help="the GPU the traces ran on (default: the traces' device name)")
    ap.add_argument("--gpus", type=int, default=None,
                    help="GPUs the profiled runs used (default: the largest world size among the traces)")
    ap.add_argument("--detail", action="append", default=[], choices=CATEGORIES, metavar="CATEGORY",
                    help="also list this category's largest kernels by op (repeatable), e.g. --detail echo")
    a = ap.parse_args()
    rows = []
    for spec in a.traces:
        label, _, path = spec.rpartition("=")
        r = breakdown(path)
        r["label"], r["trace"] = label or os.path.basename(os.path.dirname(path)), path
        rows.append(r)
    text = table(rows)
    if phase_table(rows):
        text += "\n\nKernel time by phase of the step (ms per step; phases as for the exposed rows):\n\n" + phase_table(rows)
    for r in rows:
        text += f"\n\nLargest kernels of {r['label']} (ms per step; innermost op < its parent):\n\n"
        text += "| ms | category | ops | kernel |\n|---|---|---|---|\n"
        text += "\n".join(f"| {t['ms']:.2f} | {t['category']} | {t['ops']} | {t['kernel'][:70]} |" for t in r["top"][:20])
    for r in rows:
        if r.get("comm_by_kernel"):
            text += (f"\n\nCommunication kernels of {r['label']}, most exposed first (ms per step; exposed: no other "
                     "kernel but communication runs; kernels on two streams at once each count):\n\n")
            text += "| exposed ms | ms | kernel |\n|---|---|---|\n"
            text += "\n".join(f"| {t['exposed_ms']:.2f} | {t['ms']:.2f} | {t['kernel'][:70]} |" for t in r["comm_by_kernel"])
    for cat in a.detail:
        for r in rows:
            text += f"\n\nLargest {cat} kernels of {r['label']} (ms per step; innermost op < its parent):\n\n"
            text += "| ms | ops | kernel |\n|---|---|---|\n"
            text += "\n".join(f"| {t['ms']:.2f} | {t['ops']} | {t['kernel'][:70]} |" for t in r["by_category"][cat])
    print(text)
    if a.out:
        from benchmarks.common import environment, results_stem

        seen = [trace_machine(r["trace"]) for r in rows]
        gpu = a.gpu or next((g for g, _ in seen if g), "") or environment()["gpu"]
        gpus = a.gpus or max(w for _, w in seen)
        env = {**environment(), "gpu": gpu, "gpus": gpus}
        os.makedirs(a.out, exist_ok=True)
        stem = os.path.join(a.out, results_stem(f"step_breakdown_{a.name}", gpu, gpus))
        with open(stem + ".json", "w") as f:
            json.dump({"env": env, "script": "benchmarks/step_breakdown.py", "rows": rows}, f, indent=1)
        with open(stem + ".md", "w") as f:
            f.write(f"GPU time per training step by category (benchmarks/step_breakdown.py; {gpus}× {gpu}, "
                    f"torch {env['torch']}, {env['date']})\n\n{text}\n")


if __name__ == "__main__":
    main()
