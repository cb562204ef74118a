"""The training loss: mean next-token cross-entropy over the B·S positions whose label is not
``ignore_index`` (0-d, fp32).

    loss_fn = build_loss(cfg.compile, device)
    loss = loss_fn(logits_BSV, labels_BS)

On CUDA it is ``lm_loss``: the fused cross-entropy kernels (kernels/cross_entropy.py) on the logits
in their dtype — one read forward, one read + one write backward (the write in FP8 for an FP8 output
head's logits), no fp32 copy — which leaves nothing for ``[compile]``'s "loss" component to fuse.
Elsewhere "loss" in ``[compile] components``
compiles ``F.cross_entropy`` on fp32 logits as one static-shape graph (components/parallel/compile.py);
without it the CPU path is the kernels' torch reference. No host read either way (CUDA-graph capturable).
"""

import torch
import torch.nn.functional as F

from components.parallel.compile import compile_fn
from kernels.cross_entropy import cross_entropy

from .fp8_head import handoff_of


def lm_loss(logits_BSV: torch.Tensor, labels_BS: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Fused cross-entropy of ``logits_BSV`` [B, S, V] (any float dtype) against ``labels_BS`` [B, S]. Logits
    from an FP8 output head get their gradient in FP8 (components/train/fp8_head.py)."""
    return cross_entropy(logits_BSV.flatten(0, 1), labels_BS.flatten(), ignore_index, fp8_grad=handoff_of(logits_BSV))


def cross_entropy_loss(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """torch's cross-entropy on fp32 logits (what ``[compile]`` "loss" compiles off CUDA)."""
    return F.cross_entropy(logits_BSV.flatten(0, 1).float(), labels_BS.flatten())


def compiles_loss(compile_cfg, device: torch.device) -> bool:
    return compile_cfg.enable and "loss" in compile_cfg.components and device.type != "cuda"


def build_loss(compile_cfg, device: torch.device):
    """``lm_loss``, or off CUDA with "loss" in ``[compile] components`` the compiled torch cross-entropy."""
    if compiles_loss(compile_cfg, device):
        return compile_fn(cross_entropy_loss, compile_cfg.backend)
    return lm_loss
