"""Process-group setup for the recipes (NCCL on GPU, gloo on CPU) and a small all-reduce helper."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


def init_distributed(timeout_s: float | None = None) -> tuple[int, int, torch.device]:
    """(rank, world_size, device). Initialises NCCL (GPU) or gloo (CPU) when run under torchrun,
    with collectives timing out after ``timeout_s`` (torch's default when None)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        kw = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", **kw)
    return rank, world, device


def allreduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


def set_timeout(timeout_s: float) -> None:
    """Set the collective timeout of every process group (the default one and the mesh's
    sub-groups), e.g. from a generous start-up limit to the training limit after the first step."""
    if not dist.is_initialized():
        return
    dist.barrier()
    for group in [None, *list(c10d._world.pg_map)]:
        if group is not None and group is c10d.GroupMember.WORLD:
            continue
        c10d._set_pg_timeout(timedelta(seconds=timeout_s), group)
