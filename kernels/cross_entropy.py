"""Cross-entropy over rows of logits, fused: no fp32 copy of the logits, one pass forward, one backward.

    cross_entropy(logits_NV, labels_N, ignore_index=-100) -> loss   (0-d, fp32; fp64 for fp64 logits)

    valid_N = labels_N != ignore_index,        n_valid = Σ valid_N        (device tensor, never read on the host)
    lse_N   = log Σ_v exp(x_NV)                (online max / sum-exp over blocks of V, fp32)
    loss_N  = lse_N − x[n, label_n]  (0 where not valid),    loss = Σ loss_N / n_valid
    grad_NV = (exp(x_NV − lse_N) − onehot(label_N)) · grad_loss / n_valid   (0 on rows not valid)

F.cross_entropy's semantics (reduction "mean"): every row ignored gives nan (0 / 0) and a zero
gradient. Logits [N, V] bf16 / fp16 / fp32 with unit stride along V (any row stride); labels [N]
int32 / int64. Saved for backward: the logits themselves, lse_N (fp32; -inf on ignored rows),
labels, n_valid. One program per row, blocks of up to 4096 columns, fp32 math. Bytes per logit
(bf16): forward reads 2; backward reads 2 and writes 2 (the gradient, in the logits' dtype).
Ignored rows are not read (their gradient row is written as zeros). No host read, no
value-dependent shape: capturable in a CUDA graph.

    cross_entropy_bwd_fp8(..., rows, cols, plain) -> Fp8Grad(g_NV, q_NV, q_VN, s)     grad_NV ≈ q · s, one scale

The backward for an FP8 output head (``cross_entropy(..., fp8_grad=...)``): |softmax − one-hot| <= 1, so
|grad| <= |grad_loss| / n_valid, a bound known before any value is computed. With the power-of-two scale of
that bound the backward's one pass writes the gradient in each form the head reads: in FP8 row by row
(``rows``: the input gradient's GEMM), in the logits' dtype (``plain``: for a GEMM the head keeps in bf16), and
a byte transpose of the FP8 rows (``cols``: the weight gradient's GEMM). No amax pass, no cast.

A label outside [0, V) other than ignore_index: on CPU tensors this raises IndexError as
F.cross_entropy does (the check is free there). On CUDA nothing is read on the host (the step is
captured in a CUDA graph): such a row's loss and gradient are nan, so the step's loss is nan and the
non-finite step gate skips it; with TRITON_DEBUG=1 the kernel device-asserts instead, like torch.
Triton on CUDA (and under TRITON_INTERPRET=1); the same formulas in torch elsewhere (the reference).
"""

from typing import NamedTuple

import torch

from .fp8 import FP8_GRAD, Q_MAX, pow2_scale, transpose_copy_
from .moe_rows import _acc_dtype, _use_triton, triton

if triton is not None:
    import triton.language as tl

    from .moe_rows import _pow2_scale_to

    @triton.jit
    def _cross_entropy_fwd_kernel(x_ptr, labels_ptr, loss_ptr, lse_ptr, stride_row, V, ignore_index,
                                  BLOCK_V: tl.constexpr):
        row = tl.program_id(0)
        x_row = x_ptr + row.to(tl.int64) * stride_row
        label = tl.load(labels_ptr + row).to(tl.int64)
        valid = label != ignore_index
        in_range = (label >= 0) & (label < V)
        tl.device_assert(in_range | (label == ignore_index), "cross_entropy: label out of range")
        n_read = tl.where(valid, V, 0)  # ignored rows are not read
        m = float("-inf")  # running max of the row
        s = 0.0  # running Σ exp(x - m)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            x = tl.load(x_row + offs, mask=offs < n_read, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row of -inf so far: keep s = 0, no nan
            s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), 0)
            m = m_new
        lse = m + tl.log(s)
        x_label = tl.load(x_row + tl.where(in_range & valid, label, 0)).to(tl.float32)
        loss = tl.where(in_range, lse - x_label, float("nan"))
        tl.store(lse_ptr + row, lse)
        tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))

    @triton.jit
    def _cross_entropy_bwd_kernel(x_ptr, labels_ptr, lse_ptr, grad_loss_ptr, n_valid_ptr, g_ptr, q_ptr, s_ptr,
                                  stride_row, g_stride_row, V, ignore_index, Q_MAX: tl.constexpr, PLAIN: tl.constexpr,
                                  QUANT: tl.constexpr, BLOCK_V: tl.constexpr):
        """One row of the gradient: in g's dtype (PLAIN), and (QUANT) over s, the power-of-two scale of the bound
        |grad_loss| / n_valid, clamped to ±Q_MAX in q's FP8 dtype (q [N, V] contiguous; row 0 stores s)."""
        row = tl.program_id(0)
        x_row = x_ptr + row.to(tl.int64) * stride_row
        g_row = g_ptr + row.to(tl.int64) * g_stride_row
        q_row = q_ptr + row.to(tl.int64) * V
        label = tl.load(labels_ptr + row).to(tl.int64)
        valid = label != ignore_index
        in_range = (label >= 0) & (label < V)
        lse = tl.load(lse_ptr + row)
        scale = tl.load(grad_loss_ptr).to(tl.float32) / tl.load(n_valid_ptr).to(tl.float32)
        s = 1.0
        if QUANT:
            s = _pow2_scale_to(tl.abs(scale), Q_MAX)  # |grad| <= |scale|: softmax minus one-hot is within [-1, 1]
            if row == 0:
                tl.store(s_ptr, s)
        scale = tl.where(in_range, scale, float("nan"))
        n_read = tl.where(valid, V, 0)  # ignored rows are not read
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            mask = offs < V
            x = tl.load(x_row + offs, mask=offs < n_read, other=0.0).to(tl.float32)
            t = tl.exp(x - lse) - tl.where(offs == label, 1.0, 0.0)
            if PLAIN:
                tl.store(g_row + offs, tl.where(valid, t * scale, 0.0).to(g_ptr.dtype.element_ty), mask=mask)
            if QUANT:  # exp's rounding can pass the bound by an ulp; nan stays nan
                q = tl.where(valid, t * (scale / s), 0.0)
                q = tl.where(q > Q_MAX, Q_MAX, tl.where(q < -Q_MAX, -Q_MAX, q))
                tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=mask)

_MAX_BLOCK_V = 4096


def _launch_args(V: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps): 8 warps × 16 elements per thread for large V."""
    block = min(_MAX_BLOCK_V, max(16, triton.next_power_of_2(V)))
    return block, 8 if block >= 2048 else 4


def cross_entropy_fwd(logits_NV, labels_N, ignore_index: int):
    """(loss_N, lse_N), fp32: the forward kernel (one program per row)."""
    N, V = logits_NV.shape
    loss_N = torch.empty(N, dtype=torch.float32, device=logits_NV.device)
    lse_N = torch.empty(N, dtype=torch.float32, device=logits_NV.device)
    if N:
        block, warps = _launch_args(V)
        _cross_entropy_fwd_kernel[(N,)](logits_NV, labels_N, loss_N, lse_N, logits_NV.stride(0), V, ignore_index,
                                        BLOCK_V=block, num_warps=warps)
    return loss_N, lse_N


def cross_entropy_bwd(logits_NV, labels_N, lse_N, grad_loss, n_valid, ignore_index: int):
    """grad_NV in the logits' dtype: the backward kernel; ``grad_loss``, ``n_valid``: 0-d device tensors."""
    N, V = logits_NV.shape
    grad_NV = torch.empty_like(logits_NV, memory_format=torch.contiguous_format)
    if N:
        block, warps = _launch_args(V)
        _cross_entropy_bwd_kernel[(N,)](logits_NV, labels_N, lse_N, grad_loss, n_valid, grad_NV, grad_NV, grad_NV,
                                        logits_NV.stride(0), grad_NV.stride(0), V, ignore_index, Q_MAX=0.0, PLAIN=True,
                                        QUANT=False, BLOCK_V=block, num_warps=warps)
    return grad_NV


# --- torch reference (CPU, fp64, and the check for the kernels): the kernels' formulas --------------

def cross_entropy_fwd_torch(logits_NV, labels_N, ignore_index: int):
    N, V = logits_NV.shape
    x_NV = logits_NV.to(_acc_dtype(logits_NV.dtype))
    valid_N = labels_N != ignore_index
    in_range_N = (labels_N >= 0) & (labels_N < V)
    lse_N = torch.where(valid_N, torch.logsumexp(x_NV, dim=1), float("-inf"))
    x_label_N = x_NV.gather(1, torch.where(in_range_N & valid_N, labels_N, 0).long().unsqueeze(1)).squeeze(1)
    loss_N = torch.where(in_range_N, lse_N - x_label_N, float("nan"))
    return torch.where(valid_N, loss_N, 0.0), lse_N


def _grad_torch(logits_NV, labels_N, lse_N, scale, ignore_index: int):
    """(softmax − one-hot) · scale in the accumulation dtype: 0 on ignored rows, nan on out-of-range labels."""
    N, V = logits_NV.shape
    acc = _acc_dtype(logits_NV.dtype)
    valid_N = labels_N != ignore_index
    in_range_N = (labels_N >= 0) & (labels_N < V)
    scale_N = torch.where(in_range_N, scale.to(acc), float("nan"))
    onehot_NV = torch.arange(V, device=labels_N.device) == labels_N.unsqueeze(1)
    grad_NV = ((logits_NV.to(acc) - lse_N.to(acc).unsqueeze(1)).exp() - onehot_NV.to(acc)) * scale_N.unsqueeze(1)
    return torch.where(valid_N.unsqueeze(1), grad_NV, 0.0)


def cross_entropy_bwd_torch(logits_NV, labels_N, lse_N, grad_loss, n_valid, ignore_index: int):
    acc = _acc_dtype(logits_NV.dtype)
    scale = grad_loss.to(acc) / n_valid.to(acc)
    return _grad_torch(logits_NV, labels_N, lse_N, scale, ignore_index).to(logits_NV.dtype)


class Fp8Grad(NamedTuple):
    """The logits' gradient as an FP8 head reads it, grad_NV ≈ q_NV · s: each form None where not asked for."""
    g_NV: torch.Tensor | None  # in the logits' dtype
    q_NV: torch.Tensor | None  # FP8, [N, V]
    q_VN: torch.Tensor | None  # FP8, [V, N]: q_NV transposed, byte for byte
    s: torch.Tensor  # fp32 0-d


def cross_entropy_bwd_fp8_torch(logits_NV, labels_N, lse_N, grad_loss, n_valid, ignore_index: int,
                                dtype: torch.dtype = FP8_GRAD, rows: bool = True, cols: bool = True,
                                plain: bool = False) -> Fp8Grad:
    """The FP8 backward's reference: the fp32 gradient over the power-of-two scale of its bound |grad_loss| / n_valid."""
    scale = grad_loss.float() / n_valid.float()
    s = pow2_scale(scale.abs(), Q_MAX[dtype])
    g_NV = _grad_torch(logits_NV, labels_N, lse_N, scale / s, ignore_index).float()
    q_NV = g_NV.clamp(-Q_MAX[dtype], Q_MAX[dtype]).to(dtype)  # clamp keeps nan
    plain_NV = cross_entropy_bwd_torch(logits_NV, labels_N, lse_N, grad_loss, n_valid, ignore_index) if plain else None
    return Fp8Grad(plain_NV, q_NV if rows else None, q_NV.t().contiguous() if cols else None, s)


def cross_entropy_bwd_fp8(logits_NV, labels_N, lse_N, grad_loss, n_valid, ignore_index: int,
                          dtype: torch.dtype = FP8_GRAD, rows: bool = True, cols: bool = True,
                          plain: bool = False) -> Fp8Grad:
    """The gradient in FP8 ``dtype`` (e5m2 or e4m3) with one scale s = 2^ceil(log2(|grad_loss| / n_valid / max)),
    in the forms asked for: ``rows`` q_NV, ``cols`` q_VN (the same bytes transposed), ``plain`` g_NV in the logits'
    dtype (unscaled, as ``cross_entropy_bwd`` writes it). |softmax − one-hot| <= 1 bounds the gradient, so the scale
    is known before a value is computed: the backward kernel writes q_NV (1 byte a logit) beside or instead of g_NV
    (2) in its one pass over the logits (reading 2), then ``transpose_copy_`` writes q_VN from it (reads 1, writes 1;
    a tiled pass writing q_VN itself measured slower on H200). grad ≈ q · s."""
    if not _use_triton(logits_NV, labels_N):
        return cross_entropy_bwd_fp8_torch(logits_NV, labels_N, lse_N, grad_loss, n_valid, ignore_index, dtype, rows,
                                           cols, plain)
    N, V = logits_NV.shape
    new = lambda *shape, dt=dtype: torch.empty(*shape, dtype=dt, device=logits_NV.device)
    g_NV, q_NV, q_VN = new(N, V, dt=logits_NV.dtype) if plain else None, new(N, V) if rows or cols else None, \
        new(V, N) if cols else None
    s = torch.ones((), dtype=torch.float32, device=logits_NV.device)
    if N and (plain or q_NV is not None):
        block, warps = _launch_args(V)
        q_ptr = q_NV if q_NV is not None else new(1)  # a pointer of the FP8 dtype either way
        _cross_entropy_bwd_kernel[(N,)](logits_NV, labels_N, lse_N, grad_loss, n_valid, q_ptr if g_NV is None else g_NV,
                                        q_ptr, s, logits_NV.stride(0), V, V, ignore_index, Q_MAX=Q_MAX[dtype],
                                        PLAIN=plain, QUANT=q_NV is not None, BLOCK_V=block, num_warps=warps)
        if cols:
            transpose_copy_(q_NV[None], q_VN[None])
    return Fp8Grad(g_NV, q_NV if rows else None, q_VN, s)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV, labels_N, ignore_index, fp8_grad):
        with torch.profiler.record_function("cross_entropy_fwd"):  # the step breakdown's "loss"
            if logits_NV.stride(1) != 1:
                logits_NV = logits_NV.contiguous()
            labels_N = labels_N.contiguous()
            triton_path = _use_triton(logits_NV, labels_N)
            fwd = cross_entropy_fwd if triton_path else cross_entropy_fwd_torch
            loss_N, lse_N = fwd(logits_NV, labels_N, ignore_index)
            n_valid = (labels_N != ignore_index).sum(dtype=loss_N.dtype)  # device scalar: no host read
            ctx.save_for_backward(logits_NV, labels_N, lse_N, n_valid)
            ctx.ignore_index, ctx.triton_path, ctx.fp8_grad = ignore_index, triton_path, fp8_grad
            return loss_N.sum() / n_valid

    @staticmethod
    def backward(ctx, grad_loss):
        with torch.profiler.record_function("cross_entropy_bwd"):
            logits_NV, labels_N, lse_N, n_valid = ctx.saved_tensors
            args = (logits_NV, labels_N, lse_N, grad_loss.contiguous(), n_valid, ctx.ignore_index)
            if ctx.fp8_grad is not None:
                return ctx.fp8_grad.put(cross_entropy_bwd_fp8(*args, ctx.fp8_grad.dtype, *ctx.fp8_grad.forms)), None, \
                    None, None
            bwd = cross_entropy_bwd if ctx.triton_path else cross_entropy_bwd_torch
            return bwd(*args), None, None, None


def cross_entropy(logits_NV: torch.Tensor, labels_N: torch.Tensor, ignore_index: int = -100,
                  fp8_grad=None) -> torch.Tensor:
    """Mean cross-entropy of ``logits_NV`` [N, V] against ``labels_N`` [N] over rows whose label is not
    ``ignore_index`` (F.cross_entropy, reduction "mean"); 0-d fp32 (fp64 for fp64 logits).

    ``fp8_grad``: where the layer that made the logits reads its gradient in FP8 (an FP8 output head), an object
    with the FP8 ``dtype`` it reads and the ``forms`` (rows, cols, plain) it reads it in, whose ``put(Fp8Grad)``
    takes the gradient as ``cross_entropy_bwd_fp8`` writes it and returns what autograd passes on as the logits'
    gradient: the plain one where written, else a stand-in (the gradient in the logits' dtype is then never written)."""
    if logits_NV.dim() != 2 or labels_N.shape != logits_NV.shape[:1]:
        raise ValueError(f"cross_entropy: logits [N, V] and labels [N], got {tuple(logits_NV.shape)} and "
                         f"{tuple(labels_N.shape)}")
    if labels_N.device.type == "cpu":  # free on CPU; on CUDA a bad label gives nan (see the module docstring)
        bad = (labels_N != ignore_index) & ((labels_N < 0) | (labels_N >= logits_NV.shape[1]))
        if bad.any():
            raise IndexError(f"Target {int(labels_N[bad][0])} is out of bounds.")
    return _CrossEntropy.apply(logits_NV, labels_N, ignore_index, fp8_grad)
