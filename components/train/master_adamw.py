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

Both optimizers also write FP8 experts' weight copies (``GroupedExperts.enable_fp8_copies``: a weight with
``w.fp8_copy = (copies, role)``) in the same pass, from the fp32 master, then let the copies settle their
scales (``Fp8WeightCopies.finish_``, on the device).
"""

from contextlib import contextmanager

import torch

from components.tensors import local_of
from kernels.adamw import adamw_master_


class MasterAdamW(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 dtype: torch.dtype = torch.bfloat16):
        params = list(params)
        for p in params:
            if hasattr(p, "to_local") or p.dtype != torch.float32:
                raise ValueError("MasterAdamW takes plain fp32 parameters (it converts them to the compute dtype)")
        # AdamW's own param-group keys (amsgrad, maximize, ...), so optimizer checkpoints load across the paths
        defaults = dict(torch.optim.AdamW([torch.zeros(1)], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                          fused=True).defaults)
        super().__init__(params, defaults)
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
            fp8 = _Fp8Writes()
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
    with a compute copy (``GroupedExperts.enable_compute_copies``: experts outside FSDP): the fp32 local
    shard is the master, the moments live in AdamW's own state format (checkpoints load across the two
    paths), the gradient ``p.compute_grad`` (bf16) is divided by ``p.compute_grad_divide`` and clipped
    (``grad_scale``) inside the kernel, and the bf16 copy the next forward reads is written in the same
    pass: no per-step cast of those weights or their gradients. Honours ``found_inf`` like the fused step."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:  # host metadata only: torch's step below would apply such a .grad too
            for p in group["params"]:
                if p.grad is not None and getattr(p, "compute_grad", None) is not None:
                    raise RuntimeError(f"a weight of shape {tuple(p.shape)} with a compute copy also has a .grad: "
                                       "its forward must take the weight itself, not its local shard "
                                       "(components/moe_echo/experts.py, _OptimizerCopy)")
        loss = super().step(closure)
        skip = getattr(self, "found_inf", None)
        scale = getattr(self, "grad_scale", None)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            fp8 = _Fp8Writes()
            for p in group["params"]:
                g = getattr(p, "compute_grad", None)
                if g is None:
                    continue
                state = self.state[p]
                if not state:  # AdamW's format: step (fp32, on the device), moments shaped like the parameter
                    state["step"] = torch.zeros((), dtype=torch.float32, device=g.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"].add_(1.0)
                if skip is not None:
                    state["step"].sub_(skip)
                mul = torch.full((), 1.0 / p.compute_grad_divide, dtype=torch.float32, device=g.device)
                if scale is not None:
                    mul = mul / scale.float()
                lr = group["lr"]
                if isinstance(lr, torch.Tensor) and lr.device != g.device:  # a host tensor (DCP's state init)
                    lr = float(lr)
                # g and the copy may be halves of [w1; w3] (QuACK's layout): the kernel reads them in place
                adamw_master_(p.compute_copy, g, local_of(p), local_of(state["exp_avg"]),
                              local_of(state["exp_avg_sq"]), lr, state["step"], beta1, beta2, group["eps"],
                              group["weight_decay"], skip, mul, fp8.target(p))
            fp8.finish(group["params"], local_of, skip)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                if getattr(p, "compute_grad", None) is not None:
                    p.compute_grad = None


class _Fp8Writes:
    """The FP8 copies one param group's step writes: ``target(p)`` for each weight it updates, then ``finish``."""

    def __init__(self):
        self.updated: dict = {}  # Fp8WeightCopies -> roles written

    def target(self, p: torch.Tensor):
        copies, role = getattr(p, "fp8_copy", (None, None))
        if copies is None:
            return None
        self.updated.setdefault(copies, set()).add(role)
        return copies.copy(role)

    def finish(self, params, master_of, skip) -> None:
        for copies, roles in self.updated.items():
            masters = {q.fp8_copy[1]: master_of(q) for q in params if getattr(q, "fp8_copy", (None,))[0] is copies}
            copies.finish_(masters, roles, skip)


def refresh_compute_copies(model: torch.nn.Module, optimizer=None) -> None:
    """Rewrite every compute copy and FP8 weight copy from its weights (after weights were loaded into them);
    the FP8 copies from the fp32 masters where ``optimizer`` keeps them (MasterAdamW), as its step writes them."""
    with torch.no_grad():
        for p in model.parameters():
            if getattr(p, "compute_copy", None) is not None:
                p.compute_copy.copy_(local_of(p))
        master = optimizer.masters.__getitem__ if has_masters(optimizer) else local_of
        for module in model.modules():
            copies = getattr(module, "fp8_copies", None)
            if copies is not None:
                copies.write_(*(master(w) for w in (module.w1, module.w2, module.w3)))


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
