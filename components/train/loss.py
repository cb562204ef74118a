"""The recipes' training loss: next-token cross-entropy over the flattened batch."""

import torch

from kernels.cross_entropy import cross_entropy


def lm_loss(logits_BSV: torch.Tensor, labels_BS: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy over the B·S tokens whose label is not ``ignore_index``: 0-d fp32.
    ``logits_BSV`` stay in their dtype (bf16: the fused kernel reads them once, no fp32 copy);
    no host read, so the step stays capturable in a CUDA graph."""
    return cross_entropy(logits_BSV.flatten(0, 1), labels_BS.flatten(), ignore_index)
