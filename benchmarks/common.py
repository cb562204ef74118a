"""Shared helpers for benchmarks: CUDA-event timing, environment record, result files, tables."""

import datetime
import json
import os
import platform
import statistics
import time

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


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


def write_results(name: str, env: dict, rows: list[dict], table: str, out_dir: str | None = None) -> str:
    out_dir = out_dir or RESULTS
    os.makedirs(out_dir, exist_ok=True)
    gpu = env["gpu"].replace(" ", "_")
    stem = os.path.join(out_dir, f"{name}_{gpu}")
    with open(stem + ".json", "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(f"{name} on {env['gpu']} (torch {env['torch']}, {env['date']})\n\n{table}\n")
    return stem
