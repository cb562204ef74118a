"""The training loss: mean next-token cross-entropy over all B·S positions, in fp32.

    cross_entropy = build_loss(cfg.compile)
    loss = cross_entropy(logits_BSV, labels_BS)   # scalar fp32

Compiled (one static-shape graph, components/parallel/compile.py) when ``[compile] enable`` and
"loss" is in ``[compile] components`` (torchtitan's default components: "model" and "loss"), so
the backend may fuse the fp32 upcast with the log-softmax.
"""

import torch
import torch.nn.functional as F

from components.parallel.compile import compile_fn


def cross_entropy_loss(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BSV.flatten(0, 1).float(), labels_BS.flatten())


def build_loss(compile_cfg):
    """``cross_entropy_loss``, compiled when the config asks for it."""
    if compile_cfg.enable and "loss" in compile_cfg.components:
        return compile_fn(cross_entropy_loss, compile_cfg.backend)
    return cross_entropy_loss
