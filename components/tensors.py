"""Tensor helpers every layer of the tree uses (components/moe_echo, parallel and train import this file)."""

import torch


def local_of(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's local shard; any other tensor (or None) as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def shape_only(t: torch.Tensor) -> torch.Tensor:
    """A tensor of ``t``'s shape, dtype and device whose elements all alias one (no memory of ``t``'s size): a
    stand-in where only a tensor's metadata is read (autograd's, for values a kernel handed over in another form)."""
    return torch.empty((), dtype=t.dtype, device=t.device).expand(t.shape)
