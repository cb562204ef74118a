"""Gradient-norm clipping for parameters spread over several meshes (dense FSDP, expert EP×FSDP).

The global L2 norm is Σ over parameters of each rank's local ‖shard‖², summed over all ranks with
one all-reduce; a tensor replicated over k ranks (plain tensors, Replicate placements, copies of a
sub-mesh) is divided by k so it counts once. No host read: clipping multiplies by a device scalar.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from components.moe_echo.weight_copies import WeightCopies
from components.tensors import local_of


def _copies(t: torch.Tensor, world: int) -> int:
    if not isinstance(t, DTensor):
        return world
    mesh = t.device_mesh
    reps = 1
    for dim, placement in enumerate(t.placements):
        if isinstance(placement, Replicate):
            reps *= mesh.size(dim)
    return (world // mesh.size()) * reps


def _whole(tensors: list) -> list:
    """``tensors`` for one norm pass, where slices along dim 1 that together tile rows of a contiguous base (the
    [w1; w3] gradient's halves; with ECHO, the home rows [:e] of the [e + S, ...] extended gradient) are replaced
    by those rows, themselves contiguous: the same sum of squares, and the pass keeps ``_foreach_norm``'s fused
    path (slices are not dense: it would cast a copy of each and reduce it alone)."""
    out, views = [], {}
    for t in tensors:
        b = t._base
        if t.is_contiguous() or b is None or not b.is_contiguous() or b.dim() < 2 or t.dim() != b.dim():
            out.append(t)
        else:
            views.setdefault(id(b), (b, []))[1].append(t)
    for b, vs in views.values():
        rows = _tiled_rows(b, vs)
        out.extend(vs if rows is None else [rows])
    return out


def _tiled_rows(b: torch.Tensor, vs: list) -> torch.Tensor | None:
    """``b[r:r + n]`` (``b`` itself for all rows) where the views ``vs`` are slices ``b[r:r + n, i:j]`` of the
    same rows whose column ranges cover ``range(b.shape[1])`` once; None otherwise."""
    rows, spans = set(), []
    for v in vs:
        off = v.storage_offset() - b.storage_offset()
        if v.stride() != b.stride() or v.shape[2:] != b.shape[2:] or off < 0:
            return None
        r, col = divmod(off, b.stride(0))
        if col % b.stride(1):
            return None
        rows.add((r, v.shape[0]))
        spans.append((col // b.stride(1), col // b.stride(1) + v.shape[1]))
    if len(rows) != 1:
        return None
    (r, n), end = rows.pop(), 0
    if r + n > b.shape[0]:
        return None
    for lo, hi in sorted(spans):
        if lo != end:
            return None
        end = hi
    if end != b.shape[1]:
        return None
    return b if (r, n) == (0, b.shape[0]) else b.narrow(0, r, n)


def clip_grad_norm_(params, max_norm: float, scale_into=None, copies: WeightCopies | None = None) -> torch.Tensor:
    """Clip to ``max_norm`` (0 or inf: no clipping); returns the total norm (device; fp32, fp64 for fp64 grads).

    The norm takes one fused pass per group of tensors (``_foreach_norm``, fp32 accumulation). With
    ``scale_into`` (an optimizer that divides gradients by its ``grad_scale`` inside its step: torch's
    fused AdamW, MasterAdamW) the clipping factor goes there instead of a pass over the gradients. A parameter
    without ``.grad`` whose ``WeightCopy`` in ``copies`` holds a ``grad`` (components/moe_echo/weight_copies.py;
    AdamWWithCopies applies it) counts with that gradient divided by its ``grad_divide``."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    groups: dict[tuple, list] = {}  # (copies, device, accumulation dtype, factor) -> local gradients
    for p in params:
        g, factor = p.grad, 1.0
        if g is None:  # a weight whose optimizer writes its compute copy: its gradient, not yet divided
            c = copies.get(p) if copies is not None else None
            if c is None or c.grad is None:
                continue
            g, factor = c.grad, 1.0 / c.grad_divide
        local = local_of(g)
        acc = torch.promote_types(local.dtype, torch.float32)
        groups.setdefault((_copies(p, world), local.device, acc, factor), []).append(local)
    device = next(iter(groups))[1] if groups else "cpu"
    acc = torch.float64 if any(k[2] == torch.float64 for k in groups) else torch.float32
    total = torch.zeros((), dtype=acc, device=device)
    for (copies, _, dtype, factor), locals_ in groups.items():
        norms = torch._foreach_norm(_whole(locals_), 2, dtype=dtype)
        total = total + torch.stack(norms).to(acc).pow(2).sum() * factor ** 2 / copies
    if world > 1:
        dist.all_reduce(total)
    norm = total.sqrt()
    if max_norm and max_norm != float("inf"):
        if scale_into is not None:
            scale_into.grad_scale = ((norm + 1e-6) / max_norm).clamp(min=1.0)  # gradients / this = clipped
        else:
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for locals_ in groups.values():
                torch._foreach_mul_(locals_, coef)
    return norm
