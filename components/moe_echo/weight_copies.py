"""The experts' weight copies: what the optimizer step writes besides a weight, and the gradient it takes instead
of the weight's ``.grad``.

One ``WeightCopy`` per expert weight (``GroupedExperts.w1``, ``w2``, ``w3``), owned by the experts
(``GroupedExperts.copies``, a ``WeightCopies``: Parameter -> WeightCopy) and handed to the optimizer
(components/train/optim.py, ``build_optimizer``: ``weight_copies(model)``). Who writes what, per step:

    forward    reads ``compute`` (compute dtype, this rank's local shard) instead of casting the fp32 weight
    backward   sums the weight's gradient into ``grad`` (compute dtype, not yet divided); ``.grad`` stays None
    clipping   counts ``grad / grad_divide`` (components/parallel/grad_norm.py)
    optimizer  divides ``grad`` by ``grad_divide``, clips it, applies it to the fp32 weight, writes the next
               ``compute`` (where ``compute_read``) and the FP8 copies (``fp8``) from the fp32 weight (or its master)
               in the same pass; ``zero_grad`` clears ``grad``

Invariants: a weight whose copy has a ``grad`` has no ``.grad`` (the optimizer refuses the step otherwise);
where ``compute_read`` is False (FP8 experts whose GEMMs read the FP8 copies) ``compute`` is a stand-in of the
local shard's shape and dtype without memory of its own (one element expanded): nothing reads or writes its values;
``compute`` and ``grad`` are shaped like the weight's local shard and may be views (the halves of one [w1; w3]
buffer) that the optimizer reads and writes in place; the objects are created once (``enable_*_copies``) and
only their fields change, so a map gathered before the first step stays valid.
"""

from dataclasses import dataclass

import torch
from torch import nn

from .fp8_experts import Fp8WeightCopies


@dataclass(eq=False)
class WeightCopy:
    """What the optimizer writes for one weight and the gradient it takes for it (the module docstring's contract).

    compute      the compute-dtype copy the forward reads (``GroupedExperts.enable_compute_copies``), or None
    grad         backward's gradient in the compute dtype, undivided; None until a backward reaches it
    grad_divide  what ``grad`` is divided by in the step (``GroupedExperts.set_gradient_divide_factor``)
    fp8          (Fp8WeightCopies, role: 1, 2, 3 for w1, w2, w3) the step also writes, or None
                 (``GroupedExperts.enable_fp8_copies``)
    compute_read False where the forward reads only ``compute``'s shape and dtype (the GEMMs read ``fp8``):
                 ``compute`` is then a stand-in (``components.tensors.shape_only``) the step does not write"""

    compute: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    grad_divide: float = 1.0
    fp8: tuple[Fp8WeightCopies, int] | None = None
    compute_read: bool = True

    def add_grad(self, grad: torch.Tensor) -> None:
        """Backward: sum ``grad`` into ``self.grad`` (the first one is kept as it is, a view included)."""
        self.grad = grad if self.grad is None else self.grad + grad


class WeightCopies(dict):
    """Parameter -> WeightCopy: the weights whose optimizer step writes copies (one module's, or a model's)."""

    def has_compute(self) -> bool:
        """Whether some weight has a compute copy (its optimizer must be AdamWWithCopies)."""
        return any(c.compute is not None for c in self.values())


def weight_copies(model: nn.Module) -> WeightCopies:
    """Every module's ``copies`` merged into one map (the same WeightCopy objects): what ``build_optimizer``
    hands the optimizer. Empty where no module has any."""
    out = WeightCopies()
    for module in model.modules():
        copies = getattr(module, "copies", None)
        if isinstance(copies, WeightCopies):
            out.update(copies)
    return out
