"""Gradient-norm clipping for parameters spread over several meshes (dense FSDP, expert EP×FSDP).

The global L2 norm is Σ over parameters of each rank's local ‖shard‖², summed over all ranks with
one all-reduce; a tensor replicated over k ranks (plain tensors, Replicate placements, copies of a
sub-mesh) is divided by k so it counts once. No host read: clipping multiplies by a device scalar.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


def _copies(t: torch.Tensor, world: int) -> int:
    if not isinstance(t, DTensor):
        return world
    mesh = t.device_mesh
    reps = 1
    for dim, placement in enumerate(t.placements):
        if isinstance(placement, Replicate):
            reps *= mesh.size(dim)
    return (world // mesh.size()) * reps


def clip_grad_norm_(params, max_norm: float) -> torch.Tensor:
    """Clip in place to ``max_norm`` (0 or inf: no clipping); returns the total norm (device, fp32)."""
    grads = [p.grad for p in params if p.grad is not None]
    world = dist.get_world_size() if dist.is_initialized() else 1
    locals_ = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    total = torch.zeros((), dtype=torch.float32, device=locals_[0].device if locals_ else "cpu")
    for g, local in zip(grads, locals_):
        total = total + local.float().pow(2).sum() / _copies(g, world)
    if world > 1:
        dist.all_reduce(total)
    norm = total.sqrt()
    if max_norm and max_norm != float("inf"):
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for local in locals_:
            local.mul_(coef.to(local.dtype))
    return norm
