"""Process-group setup and plain data parallelism (gradient all-reduce) for the recipes.

The FSDP2 + expert-parallel path replaces ``allreduce_gradients`` with ``fully_shard`` in the
expert-parallel issue; until then every rank holds a full replica.
"""

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


def allreduce_gradients(model: torch.nn.Module) -> None:
    """Average gradients over all ranks (missing gradients count as zero)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    grads = []
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def allreduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t
