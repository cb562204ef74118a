"""Pick the fastest dispatch primitive for this run's shape on this machine, once, and cache it.

``[moe_echo] dispatcher = "fastest"``: before training, every EP rank times dispatch + combine of
each available backend on random routing of the run's exact shape (T tokens, D, K, E, EP); the
slowest rank's median decides. The choice is cached in ``$MOE_ECHO_CACHE`` (default
``~/.cache/moe_echo/dispatch.json``) keyed by machine, shape and candidates, and reported.
Candidates: ``nvlink`` (CUDA GPUs of one host), ``padded`` and ``alltoall``; ``deepep`` when
``deep_ep`` is installed.
"""

import json
import os
import time

import torch
import torch.distributed as dist

from .config import MoEEchoConfig
from .backends import build_dispatcher, peers_on_one_host

def candidates(device: torch.device, ep: int, spans_hosts: bool = False) -> tuple[str, ...]:
    names = ["padded", "alltoall"]
    if spans_hosts:
        names.insert(0, "hierarchical")
    elif peers_on_one_host(device.type, ep):
        names.insert(0, "nvlink")
        try:
            import deep_ep  # noqa: F401

            names.append("deepep")
        except ImportError:
            pass
    return tuple(names)


def _cache_path() -> str:
    return os.environ.get("MOE_ECHO_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "moe_echo", "dispatch.json"))


def _machine(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu-{os.cpu_count()}"


def _time_ms(fn, device, iters: int) -> float:
    times = []
    for i in range(iters + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:  # first two are warm-up
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def choose_backend(cfg: MoEEchoConfig, num_experts: int, top_k: int, dim: int, tokens: int, group, ep: int,
                   device: torch.device, dtype: torch.dtype, iters: int = 5,
                   hosts=None) -> tuple[str, dict[str, float], bool]:
    """(backend, {backend: ms}, from_cache). Same answer on every rank (rank 0's decision is broadcast).
    ``hosts`` (components.parallel.hosts.EPHosts): where the EP ranks span hosts, ``hierarchical`` is timed
    and ``nvlink`` is not."""
    spans = hosts is not None and hosts.hosts > 1 and hosts.regular
    names = candidates(device, ep, spans)
    key = f"{_machine(device)}|ep{ep}|E{num_experts}|K{top_k}|D{dim}|T{tokens}|{dtype}|cf{cfg.capacity_factor}|" \
          + ",".join(names)
    path = _cache_path()
    cache = {}
    if os.path.isfile(path):
        try:
            cache = json.load(open(path))
        except ValueError:
            cache = {}
    hit = key in cache
    if hit:
        timings = cache[key]
    else:
        g = torch.Generator(device=device).manual_seed(1234 + dist.get_rank(group))
        x = torch.randn(tokens, dim, device=device, dtype=dtype, generator=g)
        ids = torch.rand(tokens, num_experts, device=device, generator=g).topk(top_k, dim=-1).indices
        w = torch.rand(tokens, top_k, device=device, generator=g)
        timings = {}
        for name in names:
            d = build_dispatcher(MoEEchoConfig(dispatcher=name, capacity_factor=max(cfg.capacity_factor, 2.0),
                                               nvlink_sms=cfg.nvlink_sms, nvlink_copy=cfg.nvlink_copy), num_experts, group, ep,
                                 hosts=hosts if spans else None)

            def fn():
                with torch.no_grad():
                    y, _, h = d.dispatch(x, ids, w)
                    d.combine(y, h)

            ms = torch.tensor([_time_ms(fn, device, iters)], device=device)
            dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
            timings[name] = float(ms)
    choice = [min(timings, key=timings.get)]
    dist.broadcast_object_list(choice, src=dist.get_global_rank(group, 0), group=group)
    if not hit and dist.get_rank() == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        cache[key] = timings
        tmp = path + f".{os.getpid()}"
        json.dump(cache, open(tmp, "w"), indent=1)
        os.replace(tmp, path)
    return choice[0], timings, hit
