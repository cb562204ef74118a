"""Where did it go non-finite? An eager re-run of one step with hooks (compiled regions too), off the hot path.

    where = first_nonfinite(model, loss_fn, inputs_BS, labels_BS)
    # "output of layers.1.moe.experts (forward)", "gradient of layers.3.attention.wo (backward)",
    # "the loss", or None when every output and gradient was finite on this rank

Forward hooks check every module's output as it finishes (a child finishes before its parent,
so the deepest module is named); tensor hooks on those outputs check the gradient flowing into
them in backward order; then the parameters' gradients, last layer first. The gradients this produces are cleared; parameters are not changed.
Every rank must call it together (the model's collectives run as in training).
"""

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from components.moe_echo.weight_copies import WeightCopies, weight_copies
from components.tensors import local_of

_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def _clean(name: str) -> str:
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name or "model"


def _finite(tree) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tree_leaves(tree)
               if isinstance(t, torch.Tensor) and t.is_floating_point())


def first_nonfinite(model: nn.Module, loss_fn, inputs_BS: torch.Tensor, labels_BS: torch.Tensor,
                    copies: WeightCopies | None = None) -> str | None:
    """Re-run forward (``loss_fn(model, inputs, labels) -> scalar loss``) and backward with hooks;
    return where the first non-finite value appeared on this rank. A weight without ``.grad`` is checked by its
    gradient in ``copies`` (``weight_copies(model)`` where not given; see AdamWWithCopies)."""
    copies = weight_copies(model) if copies is None else copies
    found: dict[str, str] = {}
    handles = []

    def on_forward(name):
        def hook(module, args, output):
            if "forward" not in found and not _finite(output):
                found["forward"] = name
            for t in tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(on_grad(name))
        return hook

    def on_grad(name):
        def hook(grad):
            if "backward" not in found and not bool(torch.isfinite(grad).all()):
                found["backward"] = name
        return hook

    for name, module in model.named_modules():
        handles.append(module.register_forward_hook(on_forward(_clean(name))))
    try:
        with torch.compiler.set_stance("force_eager"):  # hooks read tensors on the host: no compiled regions
            loss = loss_fn(model, inputs_BS, labels_BS)
            loss_finite = bool(torch.isfinite(loss).all())
            loss.backward()
        for name, p in reversed(list(model.named_parameters())):  # the last layer's gradients come first
            c = copies.get(p)
            g = p.grad if p.grad is not None or c is None else c.grad
            g = local_of(g)
            if g is not None and not bool(torch.isfinite(g).all()):
                found.setdefault("parameter", _clean(name))
                break
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    if "forward" in found:
        return f"output of {found['forward']} (forward)"
    if not loss_finite:
        return "the loss"
    if "backward" in found:
        return f"gradient of {found['backward']}'s output (backward)"
    if "parameter" in found:
        return f"gradient of parameter {found['parameter']} (backward)"
    return None
