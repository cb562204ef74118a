"""AdamW over bf16 parameters with fp32 master weights: the model computes in bf16 with no per-step casts.

With ``mixed_precision_param = "bfloat16"`` and no FSDP (FSDP2's ``MixedPrecisionPolicy`` casts in its
all-gather instead), the model's parameters are converted to bf16 once, at construction here; the
forward and backward run on them directly (no autocast: no weight casts per step, bf16 gradients, and
RMSNorm's fused kernel since input and weight agree). This optimizer keeps, per parameter, the fp32
master ``w`` and AdamW's fp32 moments, and after each update writes ``bf16(w)`` into the parameter
(kernels/adamw.py: one pass per tensor).

Interchangeable with torch.optim.AdamW(fused=True) where the recipe relies on it:
- state per parameter is AdamW's (``step``, ``exp_avg``, ``exp_avg_sq``; fp32, step a device scalar);
- ``found_inf`` (device flag: the gated step changes nothing, step counts included) and ``grad_scale``
  (device scalar the gradients are divided by: clipping without a pass over the gradients);
- ``lr`` a float or a device tensor the scheduler fills in place (CUDA-graph capturable);
- checkpoints: ``ModelAndOptimizer`` saves the masters as the model's weights (fp32, as the autocast
  path saves), so checkpoints load across the two paths and layouts; ``masters_in_model`` swaps them in
  for code that reads the model's full-precision weights (the HF export).

Both optimizers also write FP8 experts' weight copies (``GroupedExperts.enable_fp8_copies``: a weight whose
``WeightCopy`` in the ``copies`` they are handed has ``fp8 = (copies, role)``) in the same pass, from the fp32
master, then let the copies settle their scales (``Fp8WeightCopies.finish_``, on the device). The contract of
those copies: components/moe_echo/weight_copies.py.
"""

from contextlib import contextmanager

import torch

from components.moe_echo.weight_copies import WeightCopies, weight_copies
from components.tensors import local_of
from kernels.adamw import adamw_master_


class MasterAdamW(torch.optim.Optimizer):
    """``copies``: the weights' FP8 copies this step writes (``weight_copies(model)``; none where empty)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 dtype: torch.dtype = torch.bfloat16, copies: WeightCopies | None = None):
        params = list(params)
        for p in params:
            if hasattr(p, "to_local") or p.dtype != torch.float32:
                raise ValueError("MasterAdamW takes plain fp32 parameters (it converts them to the compute dtype)")
        # AdamW's own param-group keys (amsgrad, maximize, ...), so optimizer checkpoints load across the paths
        defaults = dict(torch.optim.AdamW([torch.zeros(1)], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                          fused=True).defaults)
        super().__init__(params, defaults)
        self.copies = copies if copies is not None else WeightCopies()
        self.masters: dict[torch.Tensor, torch.Tensor] = {}
        for p in params:
            self.masters[p] = p.detach().clone()
            p.data = p.data.to(dtype)

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(self.masters[p])
            state["exp_avg_sq"] = torch.zeros_like(self.masters[p])
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        skip = getattr(self, "found_inf", None)
        scale = getattr(self, "grad_scale", None)
        grad_mul = None if scale is None else torch.reciprocal(scale.float())
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [self._state(p) for p in params]
            steps = [s["step"] for s in states]
            torch._foreach_add_(steps, 1.0)
            if skip is not None:  # a gated step leaves the counts where they are (as torch's fused AdamW)
                torch._foreach_sub_(steps, [skip] * len(steps))
            lr = group["lr"]
            if isinstance(lr, torch.Tensor) and lr.device != params[0].device:  # a host tensor (DCP's state init)
                lr = float(lr)
            beta1, beta2 = group["betas"]
            fp8 = _Fp8Writes(self.copies)
            for p, s in zip(params, states):  # param and grad may be halves of [w1; w3] (QuACK): read in place
                adamw_master_(p.data, p.grad, self.masters[p], s["exp_avg"], s["exp_avg_sq"], lr, s["step"], beta1,
                              beta2, group["eps"], group["weight_decay"], skip, grad_mul, fp8.target(p))
            fp8.finish(group["params"], self.masters.__getitem__, skip)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """torch casts loaded moments to the parameter's dtype (bf16 here): keep them fp32; steps on
        the device (fp32, as capturable AdamW keeps them)."""
        super().load_state_dict(state_dict)
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        ours = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved, ours):
            for key in ("exp_avg", "exp_avg_sq", "step"):  # own copies: torch may share the given tensors
                if key in state_dict["state"].get(i, {}):
                    self.state[p][key] = state_dict["state"][i][key].to(dtype=torch.float32, device=p.device,
                                                                         copy=True)

    def sync_params(self) -> None:
        """Write the masters into the (bf16) parameters, e.g. after the masters were loaded."""
        with torch.no_grad():
            for p, w in self.masters.items():
                p.data.copy_(w)


class AdamWWithCopies(torch.optim.AdamW):
    """torch's AdamW (fused) for the parameters with a ``.grad``, and one pass of kernels/adamw.py for those
    whose ``WeightCopy`` in ``copies`` (``weight_copies(model)``; ``GroupedExperts.enable_compute_copies``:
    experts outside FSDP) holds a gradient: the fp32 local shard is the master, the moments live in AdamW's
    own state format (checkpoints load across the two paths), the gradient ``copy.grad`` (bf16) is divided by
    ``copy.grad_divide`` and clipped (``grad_scale``) inside the kernel, and the bf16 copy the next forward
    reads (``copy.compute``) is written in the same pass: no per-step cast of those weights or their
    gradients; not where the model never reads it (``copy.compute_read`` False: FP8 experts, which read the FP8
    copies written in that pass). Honours ``found_inf`` like the fused step."""

    def __init__(self, params, *args, copies: WeightCopies, **kwargs):
        """``copies`` is required: without it the weights with compute copies (whose gradients never reach
        ``.grad``) would silently not be updated."""
        super().__init__(params, *args, **kwargs)
        self.copies = copies

    def _grad_of(self, p: torch.Tensor) -> torch.Tensor | None:
        """``p``'s gradient in the compute dtype (undivided), or None."""
        c = self.copies.get(p)
        return None if c is None else c.grad

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:  # host metadata only: torch's step below would apply such a .grad too
            for p in group["params"]:
                if p.grad is not None and self._grad_of(p) is not None:
                    raise RuntimeError(f"a weight of shape {tuple(p.shape)} with a compute copy also has a .grad: "
                                       "its forward must take the weight itself, not its local shard "
                                       "(components/moe_echo/experts.py, _OptimizerCopy)")
        loss = super().step(closure)
        skip = getattr(self, "found_inf", None)
        scale = getattr(self, "grad_scale", None)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            fp8 = _Fp8Writes(self.copies)
            for p in group["params"]:
                g = self._grad_of(p)
                if g is None:
                    continue
                c = self.copies[p]
                state = self.state[p]
                if not state:  # AdamW's format: step (fp32, on the device), moments shaped like the parameter
                    state["step"] = torch.zeros((), dtype=torch.float32, device=g.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"].add_(1.0)
                if skip is not None:
                    state["step"].sub_(skip)
                mul = torch.full((), 1.0 / c.grad_divide, dtype=torch.float32, device=g.device)
                if scale is not None:
                    mul = mul / scale.float()
                lr = group["lr"]
                if isinstance(lr, torch.Tensor) and lr.device != g.device:  # a host tensor (DCP's state init)
                    lr = float(lr)
                # g and the copy may be halves of [w1; w3] (QuACK's layout): the kernel reads them in place
                adamw_master_(c.compute if c.compute_read else None, g, local_of(p), local_of(state["exp_avg"]),
                              local_of(state["exp_avg_sq"]), lr, state["step"], beta1, beta2, group["eps"],
                              group["weight_decay"], skip, mul, fp8.target(p))
            fp8.finish(group["params"], local_of, skip)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                if self._grad_of(p) is not None:
                    self.copies[p].grad = None


class _Fp8Writes:
    """The FP8 copies one param group's step writes (``copies``: the optimizer's WeightCopies): ``target(p)`` for
    each weight it updates, then ``finish``."""

    def __init__(self, copies: WeightCopies):
        self.copies = copies
        self.updated: dict = {}  # Fp8WeightCopies -> roles written

    def _fp8_of(self, p: torch.Tensor):
        c = self.copies.get(p)
        return (None, None) if c is None or c.fp8 is None else c.fp8

    def target(self, p: torch.Tensor):
        fp8, role = self._fp8_of(p)
        if fp8 is None:
            return None
        self.updated.setdefault(fp8, set()).add(role)
        return fp8.copy(role)

    def finish(self, params, master_of, skip) -> None:
        for fp8, roles in self.updated.items():
            masters = {}  # role -> master, of every weight in these copies (the roles not written are read)
            for q in params:
                held, role = self._fp8_of(q)
                if held is fp8:
                    masters[role] = master_of(q)
            fp8.finish_(masters, roles, skip)


def refresh_compute_copies(model: torch.nn.Module, optimizer=None) -> None:
    """Rewrite every compute copy and FP8 weight copy of ``model`` (``weight_copies(model)``) from its weights
    (after weights were loaded into them); the FP8 copies from the fp32 masters where ``optimizer`` keeps them
    (MasterAdamW), as its step writes them."""
    copies = weight_copies(model)
    master = optimizer.masters.__getitem__ if has_masters(optimizer) else local_of
    fp8_masters: dict = {}  # Fp8WeightCopies -> {role: its weight's master}
    with torch.no_grad():
        for p, c in copies.items():
            if c.compute is not None and c.compute_read:
                c.compute.copy_(local_of(p))
            if c.fp8 is not None:
                fp8_masters.setdefault(c.fp8[0], {})[c.fp8[1]] = master(p)
        for fp8, masters in fp8_masters.items():
            fp8.write_(masters[1], masters[2], masters[3])


def has_masters(optimizer) -> bool:
    return isinstance(optimizer, MasterAdamW)


def with_masters(optimizer, model_sd: dict) -> dict:
    """``model_sd`` with each parameter's entry replaced by its fp32 master (same key, same shape)."""
    if not has_masters(optimizer):
        return model_sd
    by_ptr = {p.data_ptr(): w for p, w in optimizer.masters.items()}
    return {k: by_ptr.get(v.data_ptr(), v) if isinstance(v, torch.Tensor) else v for k, v in model_sd.items()}


@contextmanager
def masters_in_model(optimizer):
    """Within the block the model's parameters hold the fp32 masters (no copy); restored after."""
    if not has_masters(optimizer):
        yield
        return
    low = {p: p.data for p in optimizer.masters}
    try:
        for p, w in optimizer.masters.items():
            p.data = w
        yield
    finally:
        for p, data in low.items():
            p.data = data
