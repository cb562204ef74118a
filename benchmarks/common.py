"""Shared helpers for benchmarks: CUDA-event timing, environment record, result files, tables, shape arguments."""

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import sys
import time

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def shape_arg(fields: str, example: str):
    """An argparse type for a shape written as ``fields`` joined by x (e.g. ``"EXPERTSxCOLUMNSxROWS"``): the tuple
    of its ints, or a one-line error naming the form and ``example``."""
    n = len(fields.split("x"))

    def parse(text: str) -> tuple[int, ...]:
        parts = text.lower().split("x")
        try:
            if len(parts) != n:
                raise ValueError
            return tuple(int(v) for v in parts)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: a shape is {fields}, e.g. {example}") from None

    return parse


def routing_ids(T: int, E: int, K: int, kind: str, gen: torch.Generator, dev) -> torch.Tensor:
    """[T, K] expert ids: top-K of uniform scores (``uniform``) or of Zipf(1.2) popularity + Gumbel noise
    (``skewed``)."""
    scores = torch.rand(T, E, generator=gen, device=dev)
    if kind == "skewed":
        pop = torch.arange(1, E + 1, device=dev).float().pow(-1.2)
        scores = pop.log() - torch.log(-torch.log(scores.clamp_min(1e-9)))
    return scores.topk(K, dim=-1).indices


def time_ms(fn, warmup: int = 5, iters: int = 20) -> float:
    """Median milliseconds of ``fn()`` measured with CUDA events (after ``warmup`` calls)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graphed(fn):
    """``fn`` captured once in a CUDA graph (after warm-up on a side stream, as capture wants); returns the replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def fp64_fwd_bwd(module, x, dy, grads) -> list:
    """``[y] + grads(ref, x)`` of ``y = ref(x)``, ``y.backward(dy)`` on an fp64 copy of ``module`` (the reference
    a benchmark checks its variants against); ``grads(module, x)`` lists the gradients to compare, x's included."""
    import copy

    ref = copy.deepcopy(module).double()
    xr = x.double().requires_grad_()
    y = ref(xr)
    y.backward(dy.double())
    return [y.detach()] + grads(ref, xr)


def checked_fwd_bwd(block, x, dy, want: list, grads, what: str, limit: float):
    """``(step, err)``: ``step()`` runs ``block(x).backward(dy)`` (gradients reset first; capturable), ``err`` is the
    largest relative error of its output and ``grads(block, x)`` against ``want`` (``fp64_fwd_bwd``'s list), which
    must be under ``limit``: otherwise one line naming ``what`` and the error ends the benchmark."""
    xg = x.clone().requires_grad_()

    def step():
        for p in block.parameters():
            p.grad = None
        xg.grad = None
        block(xg).backward(dy)

    step()
    got = [block(xg).detach()] + grads(block, xg)
    err = max(float((g.double().reshape(-1) - w.reshape(-1)).norm() / w.norm()) for g, w in zip(got, want))
    if not err < limit:
        raise SystemExit(f"{what} is off by {err:.3g} (limit {limit})")
    return step, err


def slowest(ms: float) -> float:
    """The largest of every rank's ``ms`` (a collective over the default process group): the busiest rank sets
    the time of a collective operation."""
    import torch.distributed as dist

    t = torch.tensor([ms], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def beside(fn, other):
    """One callable: ``fn`` on the current stream with ``other`` on a side stream at the same time (forked before,
    joined after; capturable): what ``fn`` costs while ``other`` wants the SMs too."""
    side = torch.cuda.Stream()

    def both():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            other()
        fn()
        torch.cuda.current_stream().wait_stream(side)
    return both


def host_ms(fn, warmup: int = 5, iters: int = 20) -> float:
    """Median host milliseconds to issue ``fn()`` with the GPU idle at its start (no sync inside ``fn``):
    where it is close to ``time_ms(fn)``, the call is bound by the host, not the GPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def environment() -> dict:
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


NAME = re.compile(r"^(?P<stem>[a-z0-9][A-Za-z0-9_.]*?)_(?P<machine>(?P<gpus>\d+)x(?P<gpu>[A-Z][A-Za-z0-9]*)|cpu)"
                  r"\.(?P<ext>json|md)$")
"""A results file's name: ``<benchmark>[_<label>]_<N>x<GPU>.{json,md}`` (N GPUs of one kind, e.g. 2xH200) or
``<benchmark>[_<label>]_cpu.{json,md}`` for what ran on CPU alone."""


def gpu_short(name: str) -> str:
    """A GPU's name as results files spell it: ``NVIDIA H100 80GB HBM3`` / ``NVIDIA_H100_80GB_HBM3`` -> ``H100``,
    ``NVIDIA H200`` -> ``H200``; ``cpu`` stays ``cpu``."""
    words = [w for w in re.split(r"[\s_]+", name.strip()) if w]
    words = [w for w in words if w.upper() not in ("NVIDIA", "GEFORCE", "TESLA", "AMD", "INSTINCT")]
    if not words or words[0].lower() == "cpu":
        return "cpu"
    m = re.match(r"[A-Za-z0-9]+", words[0])
    return m.group(0) if m else "gpu"


def machine(gpu: str, gpus: int = 1) -> str:
    """The name's machine part: ``<N>x<GPU>`` (``2xH200``) for ``gpus`` GPUs of kind ``gpu``, ``cpu`` for CPU."""
    short = gpu_short(gpu)
    return "cpu" if short == "cpu" else f"{gpus}x{short}"


def results_stem(name: str, gpu: str, gpus: int = 1) -> str:
    """``<name>_<N>x<GPU>`` (or ``<name>_cpu``): a results file's name without its extension."""
    return f"{name}_{machine(gpu, gpus)}"


def script_name() -> str:
    """The running script's path from the repository root (``benchmarks/dispatch.py``), as results files record it."""
    path = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.relpath(path, root) if path.startswith(root + os.sep) else os.path.basename(path)


def write_results(name: str, env: dict, rows: list[dict], table: str, out_dir: str | None = None, gpus: int = 1,
                  script: str | None = None) -> str:
    """Write ``<out_dir>/<name>_<N>x<GPU>.json`` ({env, script, rows}) and ``.md`` (a header line and ``table``);
    ``gpus`` is N, the GPUs the figures ran on (``cpu`` replaces ``<N>x<GPU>`` where env's gpu is cpu). Returns
    the path without its extension."""
    out_dir = out_dir or RESULTS
    os.makedirs(out_dir, exist_ok=True)
    env = env if gpu_short(env["gpu"]) == "cpu" else {**env, "gpus": gpus}
    stem = os.path.join(out_dir, results_stem(name, env["gpu"], gpus))
    with open(stem + ".json", "w") as f:
        json.dump({"env": env, "script": script or script_name(), "rows": rows}, f, indent=1)
    where = env["gpu"] if gpu_short(env["gpu"]) == "cpu" else f"{gpus}× {env['gpu']}"
    with open(stem + ".md", "w") as f:
        f.write(f"{name} on {where} (torch {env['torch']}, {env['date']})\n\n{table}\n")
    return stem
