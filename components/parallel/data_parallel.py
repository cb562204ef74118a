"""Process-group setup for the recipes (NCCL on GPU, gloo on CPU) and a small all-reduce helper."""

import os

import torch
import torch.distributed as dist


def init_distributed() -> tuple[int, int, torch.device]:
    """(rank, world_size, device). Initialises NCCL (GPU) or gloo (CPU) when run under torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


def allreduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t
