"""AdamW and the warm-up + (stable) + decay learning-rate schedule (torchtitan's [lr_scheduler] keys)."""

import functools
import math

import torch

from components.errors import UserError
from components.moe_echo.weight_copies import weight_copies

from .master_adamw import AdamWWithCopies, MasterAdamW


def build_optimizer(model: torch.nn.Module, opt_cfg, gated: bool = False,
                    master_dtype: torch.dtype | None = None) -> torch.optim.Optimizer:
    """[optimizer] name, lr, beta1, beta2, eps, weight_decay and implementation, all honoured.
    ``gated``: the step must honour ``optimizer.found_inf`` (the overflow and non-finite gates),
    which only the fused implementation does. ``master_dtype`` (AdamW only): convert the parameters
    to it and keep fp32 masters in the optimizer (MasterAdamW, its own fused step). The experts' weight copies
    (``weight_copies(model)``: components/moe_echo/weight_copies.py) go to the optimizer that writes them:
    MasterAdamW, or AdamWWithCopies where some weight has a compute copy (experts outside FSDP; fused AdamW
    only)."""
    if gated and opt_cfg.implementation != "fused":
        raise UserError(f"[optimizer] implementation = {opt_cfg.implementation!r}: the step is gated on the device "
                        "(overflow replay or non-finite guard), which only 'fused' supports; use 'fused'")
    params = [p for p in model.parameters() if p.requires_grad]
    copies = weight_copies(model)
    if master_dtype is not None:
        return MasterAdamW(params, lr=opt_cfg.lr, betas=(opt_cfg.beta1, opt_cfg.beta2), eps=opt_cfg.eps,
                           weight_decay=opt_cfg.weight_decay, dtype=master_dtype, copies=copies)
    kwargs = dict(lr=opt_cfg.lr, betas=(opt_cfg.beta1, opt_cfg.beta2), eps=opt_cfg.eps,
                  weight_decay=opt_cfg.weight_decay)
    if opt_cfg.implementation == "fused":
        kwargs["fused"] = True
    else:
        kwargs["foreach"] = opt_cfg.implementation == "foreach"
    cls = torch.optim.AdamW if opt_cfg.name == "AdamW" else torch.optim.Adam
    if copies.has_compute():
        if opt_cfg.name != "AdamW" or opt_cfg.implementation != "fused":
            raise ValueError("compute copies need [optimizer] name = 'AdamW', implementation = 'fused'")
        return AdamWWithCopies(params, copies=copies, **kwargs)
    return cls(params, **kwargs)


def lr_factor(step: int, warmup: int, total: int, decay_ratio: float | None, decay_type: str, min_factor: float) -> float:
    """Multiplier of the base lr after ``step`` optimizer steps (0-based, LambdaLR convention)."""
    warmup = min(warmup, total)
    decay_steps = total - warmup if decay_ratio is None else round(total * decay_ratio)
    decay_steps = min(decay_steps, total - warmup)
    stable_end = total - decay_steps
    if step < warmup:
        return (step + 1) / warmup
    if step < stable_end or decay_steps == 0:
        return 1.0
    progress = min(1.0, (step + 1 - stable_end) / decay_steps)
    shape = {"linear": 1 - progress, "sqrt": 1 - math.sqrt(progress),
             "cosine": 0.5 * (1 + math.cos(math.pi * progress))}[decay_type]
    return min_factor + (1 - min_factor) * shape


def build_lr_scheduler(optimizer, sched_cfg, training_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    total = sched_cfg.total_steps or training_steps
    fn = functools.partial(lr_factor, warmup=sched_cfg.warmup_steps, total=total, decay_ratio=sched_cfg.decay_ratio,
                           decay_type=sched_cfg.decay_type, min_factor=sched_cfg.min_lr_factor)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
