"""AdamW on fp32 master weights that also writes the low-precision copy the model computes with.

For one tensor of n elements, in one pass (fp32 math):

    if skip: nothing changes (the gated step: overflow replay or non-finite guard)
    g  = grad · grad_mul                               (grad in the model's dtype; grad_mul: clipping)
    w  = w · (1 − lr·wd)                               (decoupled weight decay, torch.optim.AdamW)
    m  = β1·m + (1 − β1)·g,   v = β2·v + (1 − β2)·g²
    w  = w − lr/(1 − β1^t) · m / (√v / √(1 − β2^t) + ε)
    param = w (rounded to the parameter's dtype)

``lr``, ``step`` (t, already advanced), ``skip`` and ``grad_mul`` are device scalars (read by the
kernel: nothing on the host, capturable in a CUDA graph); ``lr`` may also be a Python float.
Bytes per element: read grad (2) + w, m, v (12), write w, m, v (12) + param (2). Without ``param`` (None: a
weight whose model copy nobody reads, the FP8 experts' with their FP8 copies) the last 2 are not written.

With ``fp8`` (a ``kernels.fp8.Fp8Copy``: FP8 experts' weights, [E, O, I]) the same pass also writes
fp8(w / scale[e]) into the weights' FP8 copy (1 byte more per element) and folds |w| into amax[e]; the
scales are the copy's current ones, and ``kernels.fp8.recast_moved_`` recasts afterwards the experts whose
new scale differs (rarely: scales are powers of two).

Triton on CUDA; the same formulas in torch elsewhere (the reference the kernel is tested against).
"""

import torch

from .fp8 import Fp8Copy, write_copy_reference_
from .moe_rows import _use_triton, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _adamw_kernel(grad_ptr, w_ptr, m_ptr, v_ptr, param_ptr, inner, lr_ptr, lr_value, step_ptr, skip_ptr,
                      mul_ptr, beta1, beta2, eps, weight_decay, g_outer, p_outer, q_ptr, s_ptr, amax_ptr, q_outer, q_off,
                      LR_PTR: tl.constexpr, HAS_SKIP: tl.constexpr, HAS_MUL: tl.constexpr, FP8: tl.constexpr,
                      HAS_PARAM: tl.constexpr, BLOCK: tl.constexpr):
        """Grid (column blocks, rows): row r holds ``inner`` elements, at r*inner in w/m/v and r*outer in
        grad/param (no per-element division). FP8: row r is expert r, its FP8 copy at r*q_outer + q_off."""
        if HAS_SKIP:
            if tl.load(skip_ptr) > 0:
                return
        row = tl.program_id(1).to(tl.int64)
        cols = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inner
        offs = row * inner + cols
        lr = tl.load(lr_ptr).to(tl.float32) if LR_PTR else lr_value
        t = tl.load(step_ptr).to(tl.float32)
        g_offs = row * g_outer + cols
        p_offs = row * p_outer + cols
        g = tl.load(grad_ptr + g_offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_MUL:
            g = g * tl.load(mul_ptr).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        w = w * (1.0 - lr * weight_decay)
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        bc1 = 1.0 - tl.exp(t * tl.log(beta1))
        bc2_sqrt = tl.sqrt(1.0 - tl.exp(t * tl.log(beta2)))
        w = w - (lr / bc1) * m / (tl.sqrt(v) / bc2_sqrt + eps)
        tl.store(w_ptr + offs, w, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        if HAS_PARAM:
            tl.store(param_ptr + p_offs, w.to(param_ptr.dtype.element_ty), mask=mask)
        if FP8:
            s = tl.load(s_ptr + row)
            tl.store(q_ptr + row * q_outer + q_off + cols, tl.clamp(w / s, -448.0, 448.0).to(q_ptr.dtype.element_ty),
                     mask=mask)
            tl.atomic_max(amax_ptr + row, tl.max(tl.abs(w), axis=0))

_BLOCK = 2048


def adamw_master_(param: torch.Tensor | None, grad: torch.Tensor, w: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                  lr: float | torch.Tensor, step: torch.Tensor, beta1: float, beta2: float, eps: float,
                  weight_decay: float, skip: torch.Tensor | None = None, grad_mul: torch.Tensor | None = None,
                  fp8: Fp8Copy | None = None) -> None:
    """One AdamW step of fp32 master ``w`` (moments ``m``, ``v``), written back to ``param`` in its dtype.
    All of one shape; ``w``, ``m``, ``v`` contiguous; ``param`` and ``grad`` contiguous or each ``t[i]`` contiguous
    (a slice along dim 1 of a larger tensor: the experts' [w1; w3] halves); ``step`` is the step count after
    this step (device). ``fp8``: w is [E, O, I] and its FP8 copies are written too (module docstring). ``param``
    None: nothing written in the model's dtype (only the masters, moments and FP8 copies)."""
    if not _use_triton(grad):
        adamw_master_reference_(param, grad, w, m, v, lr, step, beta1, beta2, eps, weight_decay, skip, grad_mul)
        if fp8 is not None:
            write_copy_reference_(w, fp8)  # a gated step rewrites the same bytes; finish_ keeps the scales
        return
    lr_is_ptr = isinstance(lr, torch.Tensor)
    if param is not None and (_rows(param) is None or (fp8 is not None and param.dim() != 3)):
        raise ValueError(f"adamw_master_: param of shape {tuple(param.shape)}, strides {param.stride()} "
                         "is neither contiguous nor contiguous per index of dim 0")
    if fp8 is not None and w.dim() != 3:
        raise ValueError(f"adamw_master_: FP8 copies of a weight of shape {tuple(w.shape)}: they are for [E, O, I]")
    grad = grad if _rows(grad) is not None else grad.contiguous()
    contiguous = (param is None or param.is_contiguous()) and grad.is_contiguous()
    rows = 1 if contiguous and fp8 is None else w.shape[0]
    inner = w.numel() // max(rows, 1)
    if rows == 0 or inner == 0:
        return
    outer = lambda t: inner if rows == 1 else t.stride(0)
    q = fp8 if fp8 is not None else (step, 0, step, step)
    _adamw_kernel[(triton.cdiv(inner, _BLOCK), rows)](
        grad, w, m, v, param if param is not None else w, inner, lr if lr_is_ptr else step, 0.0 if lr_is_ptr else float(lr), step,
        skip if skip is not None else step, grad_mul if grad_mul is not None else step,
        beta1, beta2, eps, weight_decay, outer(grad), outer(param) if param is not None else 0, q[0], q[2], q[3],
        q[0].stride(0) if fp8 is not None else 0, q[1] * w.shape[-1] if fp8 is not None else 0, LR_PTR=lr_is_ptr,
        HAS_SKIP=skip is not None, HAS_MUL=grad_mul is not None, FP8=fp8 is not None, HAS_PARAM=param is not None,
        BLOCK=_BLOCK)


def _rows(t: torch.Tensor) -> int | None:
    """Rows of ``t`` for the kernel: 1 if contiguous, else ``t.shape[0]`` when each ``t[i]`` is contiguous
    (a grid dimension: at most 65535); None if neither."""
    if t.is_contiguous():
        return 1
    if t.dim() >= 2 and 0 < t.shape[0] <= 65535 and t[0].is_contiguous():
        return t.shape[0]
    return None


def adamw_master_reference_(param, grad, w, m, v, lr, step, beta1, beta2, eps, weight_decay, skip=None,
                            grad_mul=None) -> None:
    """The kernel's formulas in torch (any device; also the CPU path)."""
    g = grad.to(w.dtype)
    if grad_mul is not None:
        g = g * grad_mul.to(w.dtype)
    lr = torch.as_tensor(lr, dtype=w.dtype, device=w.device)
    t = step.to(w.dtype)
    new_w = w * (1 - lr * weight_decay)
    new_m = beta1 * m + (1 - beta1) * g
    new_v = beta2 * v + (1 - beta2) * g * g
    bc1, bc2_sqrt = 1 - beta1 ** t, (1 - beta2 ** t).sqrt()
    new_w = new_w - (lr / bc1) * new_m / (new_v.sqrt() / bc2_sqrt + eps)
    if skip is not None:
        keep = skip > 0
        new_w, new_m, new_v = (torch.where(keep, old, new) for old, new in ((w, new_w), (m, new_m), (v, new_v)))
    w.copy_(new_w)
    m.copy_(new_m)
    v.copy_(new_v)
    if param is not None:
        param.copy_(w)
