"""Tensor helpers every layer of the tree uses (components/moe_echo, parallel and train import this file)."""

import torch


def local_of(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's local shard; any other tensor (or None) as it is."""
    return t.to_local() if hasattr(t, "to_local") else t
