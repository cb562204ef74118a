"""Fused SwiGLU activation: h = silu(a) · b, with its backward, in one elementwise pass each.

``swiglu`` takes a and b as two tensors; ``swiglu13`` takes one [N, 2H] tensor ab = [a | b] (the output of
one GEMM against the gate and up weights concatenated, [w1; w3]) and returns its gradient as one [N, 2H]
tensor, so that GEMM's backward gives x's gradient in one GEMM instead of two gradients to sum.

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

    @triton.jit
    def _tile13(ab_ptr, N, H, ab_stride, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
        """(rows, cols, mask, a, b) of this program's [BLOCK_R, BLOCK_H] tile of ab = [a | b], fp32."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (rows < N)[:, None] & (cols < H)[None, :]
        at = ab_ptr + rows[:, None] * ab_stride + cols[None, :]
        a = tl.load(at, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(at + H, mask=mask, other=0.0).to(tl.float32)
        return rows, cols, mask, a, b

    @triton.jit
    def _swiglu13_fwd_kernel(ab_ptr, h_ptr, N, H, ab_stride, rows_ptr, BLOCK_R: tl.constexpr,
                             BLOCK_H: tl.constexpr, BOUNDED: tl.constexpr):
        """h[r, c] = silu(ab[r, c]) · ab[r, H + c] (grid: row blocks, column blocks)."""
        N = _elements(N, rows_ptr, 1, BOUNDED)
        if tl.program_id(0) * BLOCK_R >= N:
            return
        rows, cols, mask, a, b = _tile13(ab_ptr, N, H, ab_stride, BLOCK_R, BLOCK_H)
        tl.store(h_ptr + rows[:, None] * H + cols[None, :], silu_mul(a, b).to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu13_bwd_kernel(g_ptr, ab_ptr, dab_ptr, N, H, ab_stride, rows_ptr, BLOCK_R: tl.constexpr,
                             BLOCK_H: tl.constexpr, BOUNDED: tl.constexpr):
        """dab[r, c], dab[r, H + c] = SwiGLU's gradients for g[r, c] (dab: [N, 2H] contiguous)."""
        N = _elements(N, rows_ptr, 1, BOUNDED)
        if tl.program_id(0) * BLOCK_R >= N:
            return
        rows, cols, mask, a, b = _tile13(ab_ptr, N, H, ab_stride, BLOCK_R, BLOCK_H)
        g = tl.load(g_ptr + rows[:, None] * H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        da, db = silu_mul_grads(g, a, b)
        out = dab_ptr + rows[:, None] * (2 * H) + cols[None, :]
        tl.store(out, da.to(dab_ptr.dtype.element_ty), mask=mask)
        tl.store(out + H, db.to(dab_ptr.dtype.element_ty), mask=mask)

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


def _tiles13(N: int, H: int) -> tuple[tuple[int, int], int, int]:
    """(grid, BLOCK_R, BLOCK_H) of the [N, 2H] kernels: 2048-element tiles, at most 256 columns wide."""
    block_h = min(256, triton.next_power_of_2(H))
    block_r = _BLOCK // block_h
    return (triton.cdiv(N, block_r), triton.cdiv(H, block_h)), block_r, block_h


def swiglu13_fwd(ab: torch.Tensor, rows_1: torch.Tensor | None = None) -> torch.Tensor:
    """h [N, H] = silu(ab[:, :H]) · ab[:, H:] without autograd; ab [N, 2H], rows contiguous."""
    H = ab.shape[-1] // 2
    if not _use_triton(ab):
        return (F.silu(ab[..., :H].float()) * ab[..., H:].float()).to(ab.dtype)
    ab = ab if ab.stride(-1) == 1 else ab.contiguous()
    h = ab.new_empty(ab.shape[0], H)
    if ab.shape[0] and H:
        grid, block_r, block_h = _tiles13(ab.shape[0], H)
        _swiglu13_fwd_kernel[grid](ab, h, ab.shape[0], H, ab.stride(0), rows_1 if rows_1 is not None else ab,
                                   BLOCK_R=block_r, BLOCK_H=block_h, BOUNDED=rows_1 is not None, num_warps=8)
    return h


def swiglu13_bwd(g: torch.Tensor, ab: torch.Tensor, rows_1: torch.Tensor | None = None) -> torch.Tensor:
    """dab [N, 2H] of h = silu(ab[:, :H]) · ab[:, H:] for the output gradient g [N, H], without autograd."""
    H = ab.shape[-1] // 2
    if not _use_triton(g, ab):
        da, db = swiglu_bwd(g, ab[..., :H], ab[..., H:])
        return torch.cat([da, db], dim=-1)
    g = g.contiguous()
    ab = ab if ab.stride(-1) == 1 else ab.contiguous()
    dab = torch.empty(ab.shape[0], 2 * H, dtype=ab.dtype, device=ab.device)
    if ab.shape[0] and H:
        grid, block_r, block_h = _tiles13(ab.shape[0], H)
        _swiglu13_bwd_kernel[grid](g, ab, dab, ab.shape[0], H, ab.stride(0), rows_1 if rows_1 is not None else ab,
                                   BLOCK_R=block_r, BLOCK_H=block_h, BOUNDED=rows_1 is not None, num_warps=8)
    return dab


class _SwiGLU13(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ab, rows_1):
        ctx.save_for_backward(ab, rows_1)
        return swiglu13_fwd(ab, rows_1)

    @staticmethod
    def backward(ctx, g):
        ab, rows_1 = ctx.saved_tensors
        return swiglu13_bwd(g, ab, rows_1), None


def swiglu13(ab: torch.Tensor, rows_1: torch.Tensor | None = None) -> torch.Tensor:
    """silu(ab[:, :H]) * ab[:, H:] for ab [N, 2H] (gate | up), its gradient one [N, 2H] tensor; fused Triton
    kernels on CUDA, torch ops otherwise. ``rows_1``: only the rows below rows_1[0] (see the module docstring)."""
    if ab.dim() == 2 and _use_triton(ab):
        return _SwiGLU13.apply(ab, rows_1)
    H = ab.shape[-1] // 2
    return F.silu(ab[..., :H]) * ab[..., H:]
