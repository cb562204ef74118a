"""Fused SwiGLU activation: h = silu(a) · b, with its backward, in one elementwise pass each.

    forward:  h = a·σ(a)·b
    backward: da = g·b·σ(a)·(1 + a·(1 − σ(a))),  db = g·a·σ(a)
Math in fp32, storage in the inputs' dtype. Triton on CUDA; torch elsewhere (same formulas).

``rows_1``: an optional one-element int tensor on the device. With it, a and b are [N, H] row-major and
only rows below rows_1[0] are computed: the rest (padding of fixed-capacity buffers) is neither read nor
written, so their outputs and gradients are unspecified. No host read: the bound is loaded in the kernel.
"""

import torch
import torch.nn.functional as F

from .moe_rows import _use_triton, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def silu_mul(a, b):
        """h = silu(a) · b on fp32 blocks (shared by every kernel that applies SwiGLU)."""
        return a * tl.sigmoid(a) * b

    @triton.jit
    def silu_mul_grads(g, a, b):
        """(da, db) of h = silu(a) · b for the output gradient g, on fp32 blocks."""
        s = tl.sigmoid(a)
        return g * b * s * (1 + a * (1 - s)), g * a * s

    @triton.jit
    def _elements(n, rows_ptr, row_len, BOUNDED: tl.constexpr):
        """Elements to compute: n, or the first rows_ptr[0] rows of row_len elements."""
        if BOUNDED:
            n = tl.minimum(n, tl.load(rows_ptr).to(tl.int64) * row_len)
        return n

    @triton.jit
    def _swiglu_fwd_kernel(a_ptr, b_ptr, h_ptr, n, rows_ptr, row_len, BLOCK: tl.constexpr, BOUNDED: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < _elements(n, rows_ptr, row_len, BOUNDED)
        a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(h_ptr + offs, silu_mul(a, b).to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(g_ptr, a_ptr, b_ptr, da_ptr, db_ptr, n, rows_ptr, row_len, BLOCK: tl.constexpr,
                           BOUNDED: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < _elements(n, rows_ptr, row_len, BOUNDED)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        da, db = silu_mul_grads(g, a, b)
        tl.store(da_ptr + offs, da.to(da_ptr.dtype.element_ty), mask=mask)
        tl.store(db_ptr + offs, db.to(db_ptr.dtype.element_ty), mask=mask)

_BLOCK = 2048


def _bound(a: torch.Tensor, rows_1: torch.Tensor | None):
    """The kernels' (rows_ptr, row_len, BOUNDED) for ``rows_1`` (None: every element)."""
    if rows_1 is None:
        return a, 0, False
    return rows_1, a.shape[-1], True


def swiglu_fwd(a: torch.Tensor, b: torch.Tensor, rows_1: torch.Tensor | None = None) -> torch.Tensor:
    """h = silu(a) · b without autograd (Triton on CUDA, torch elsewhere); a, b of one shape and dtype."""
    if not _use_triton(a, b):
        return (F.silu(a.float()) * b.float()).to(a.dtype)
    a, b = a.contiguous(), b.contiguous()
    h = torch.empty_like(a)
    n = a.numel()
    if n:
        rows_ptr, row_len, bounded = _bound(a, rows_1)
        _swiglu_fwd_kernel[(triton.cdiv(n, _BLOCK),)](a, b, h, n, rows_ptr, row_len, BLOCK=_BLOCK, BOUNDED=bounded,
                                                      num_warps=8)
    return h


def swiglu_bwd(g: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               rows_1: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(da, db) of h = silu(a) · b for the output gradient g, without autograd."""
    if not _use_triton(g, a, b):
        g32, a32, b32 = g.float(), a.float(), b.float()
        s = torch.sigmoid(a32)
        return (g32 * b32 * s * (1 + a32 * (1 - s))).to(a.dtype), (g32 * a32 * s).to(b.dtype)
    g, a, b = g.contiguous(), a.contiguous(), b.contiguous()
    da, db = torch.empty_like(a), torch.empty_like(b)
    n = a.numel()
    if n:
        rows_ptr, row_len, bounded = _bound(a, rows_1)
        _swiglu_bwd_kernel[(triton.cdiv(n, _BLOCK),)](g, a, b, da, db, n, rows_ptr, row_len, BLOCK=_BLOCK,
                                                      BOUNDED=bounded, num_warps=8)
    return da, db


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, rows_1):
        ctx.save_for_backward(a, b, rows_1)
        return swiglu_fwd(a, b, rows_1)

    @staticmethod
    def backward(ctx, g):
        a, b, rows_1 = ctx.saved_tensors
        return *swiglu_bwd(g, a, b, rows_1), None


def swiglu(a: torch.Tensor, b: torch.Tensor, rows_1: torch.Tensor | None = None) -> torch.Tensor:
    """silu(a) * b; fused Triton kernels for CUDA bf16/fp16/fp32 tensors, torch ops otherwise.
    ``rows_1``: compute only the rows below rows_1[0] (see the module docstring)."""
    if a.dtype == b.dtype and _use_triton(a, b):
        return _SwiGLU.apply(a, b, rows_1)
    return F.silu(a) * b
