"""A cast with a scale in one pass: out = (x · scale) in ``dtype``, the product in fp32.

    cast_scale(x, dtype, scale) -> out      (same shape; contiguous)

``x`` may be a view whose dims after the first are contiguous but whose first dim has any stride (e.g. one
half of a [E, 2H, D] gradient along dim 1): it is read in place, not copied first.

The backward of a compute-dtype weight cast uses it: the bf16 gradient comes back to the fp32
weight already divided by the data-parallel size (one read of 2 B and one write of 4 B per element,
where a cast and then a division read and write 14 B). Triton on CUDA (or CPU tensors under
TRITON_INTERPRET=1); torch elsewhere, with the same fp32 product.
"""

import torch

from .moe_rows import _use_triton, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _cast_scale_kernel(x_ptr, out_ptr, n, scale, inner, outer_stride, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        src = (offs // inner) * outer_stride + offs % inner  # x: [n / inner, inner] rows outer_stride apart
        x = tl.load(x_ptr + src, mask=mask).to(tl.float32)
        tl.store(out_ptr + offs, (x * scale).to(out_ptr.dtype.element_ty), mask=mask)


_BLOCK = 4096


def cast_scale(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    if dtype == torch.float64 or x.dtype == torch.float64 or not _use_triton(x):
        return (x.to(torch.float64 if torch.float64 in (x.dtype, dtype) else torch.float32) * scale).to(dtype)
    if not _inner_contiguous(x):
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    n = x.numel()
    if n:
        inner = n // x.shape[0] if x.dim() > 1 else n
        outer_stride = x.stride(0) if x.dim() > 1 else n
        _cast_scale_kernel[(triton.cdiv(n, _BLOCK),)](x, out, n, float(scale), inner, outer_stride, BLOCK=_BLOCK,
                                                      num_warps=8)
    return out


def _inner_contiguous(x: torch.Tensor) -> bool:
    """True if every dim after the first is laid out contiguously (the first may have any stride)."""
    if x.dim() <= 1 or x.shape[0] == 0:
        return x.is_contiguous()
    return x[0].is_contiguous() and x.stride(0) >= x[0].numel()
