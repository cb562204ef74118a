"""FP8 (e4m3) quantisation for the scaled grouped GEMMs of FP8 experts (Triton on CUDA, torch elsewhere).

Scales are dequantisation multipliers rounded up to a power of two (x ≈ q · s exactly representable
rescaling; |x| / s ≤ 448): s = 2^ceil(log2(amax / 448)), s = 1 where amax = 0.

    quant_rows(x_RC, src_M=None) -> (q_MC fp8, s_M fp32)
        one scale per output row over its C columns; row m reads x[src[m]] (a gather: -1 gives a zero
        row), or x[m] without src. Used for the left operand of 2d×3d grouped GEMMs and for weights.
    quant_cols(x_RC, in_start_G, counts_G, out_start_G, n_out, group_stride=0) -> (qT fp8, s_GC fp32)
        one scale per (group g, column c) over the group's rows x[in_start[g] : in_start[g] + counts[g]];
        written transposed: qT[base_g + c · n_out + i] for i < round_up(counts[g], 16) (zeros past
        counts[g]), base_g = g · group_stride + out_start[g]. Two uses:
          - activations for the weight-gradient GEMMs (2d×2d, groups along tokens): qT is [C, n_out]
            with group g at columns out_start[g] (16-aligned), group_stride = 0;
          - weights [G·R, C] transposed per expert into [G, C, R] (out_start = 0, group_stride = C·R).

Everything is read from device memory: no host sync, fixed output shapes (CUDA-graph capturable).
"""

import torch

from .moe_rows import _with_zero_row, triton

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
ALIGN = 16  # rows per group of an FP8 grouped GEMM's token dimension must be a multiple of this


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """s = 2^ceil(log2(amax / 448)) (fp32), 1 where amax is 0."""
    m, e = torch.frexp(amax.float() / FP8_MAX)  # v = m · 2^e, m in [0.5, 1)
    s = torch.ldexp(torch.ones_like(m), torch.where(m == 0.5, e - 1, e))
    return torch.where(amax > 0, s, torch.ones_like(s))


def _cast(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8)


# --- torch reference (CPU, and the check for the kernels) ---------------------------------------

def _on_kernels(x: torch.Tensor) -> bool:
    """Triton for every CUDA tensor, whatever its float dtype (the torch path reads counts on the host).
    Not under TRITON_INTERPRET: the interpreter's float8 conversion does not round to nearest even."""
    return triton is not None and x.is_cuda


def quant_rows_torch(x_RC, src_M=None):
    if src_M is not None:
        x_RC, src_M = _with_zero_row(x_RC, src_M)
        x_RC = x_RC[src_M]
    s_M = pow2_scale(x_RC.abs().amax(1) if x_RC.shape[1] else x_RC.new_zeros(x_RC.shape[0]))
    return _cast(x_RC, s_M[:, None]), s_M


def quant_cols_torch(x_RC, in_start_G, counts_G, out_start_G, n_out, group_stride=0):
    G, C = counts_G.shape[0], x_RC.shape[1]
    size = n_out * C if group_stride == 0 else G * group_stride
    qT = torch.zeros(size, dtype=FP8, device=x_RC.device)
    s_GC = torch.ones(G, C, dtype=torch.float32, device=x_RC.device)
    for g, (i0, n, o0) in enumerate(zip(in_start_G.tolist(), counts_G.tolist(), out_start_G.tolist())):
        if n == 0:
            continue
        blk_nC = x_RC[i0:i0 + n].float()
        s_GC[g] = pow2_scale(blk_nC.abs().amax(0))
        idx_Cn = g * group_stride + o0 + torch.arange(C)[:, None] * n_out + torch.arange(n)[None, :]
        qT[idx_Cn.reshape(-1)] = _cast(blk_nC, s_GC[g]).t().reshape(-1)
    return qT, s_GC


# --- Triton kernels -----------------------------------------------------------------------------

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _pow2_scale(amax):
        v = tl.maximum(amax, 1e-30) / 448.0
        s = tl.exp2(tl.ceil(tl.log2(v)))
        s = tl.where(v > s, s * 2.0, s)  # guard against log2 rounding down
        return tl.where(amax > 0, s, 1.0)

    @triton.jit
    def _quant_rows_kernel(x_ptr, src_ptr, q_ptr, s_ptr, C, HAS_SRC: tl.constexpr, BLOCK_C: tl.constexpr):
        m = tl.program_id(0).to(tl.int64)
        if HAS_SRC:
            src = tl.load(src_ptr + m).to(tl.int64)
        else:
            src = m
        offs = tl.arange(0, BLOCK_C)
        present = (tl.zeros([BLOCK_C], dtype=tl.int64) + src) >= 0  # src -1: a zero row
        amax = tl.zeros([BLOCK_C], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            mask = (c0 + offs < C) & present
            amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + src * C + c0 + offs, mask=mask, other=0.0).to(tl.float32)))
        s = _pow2_scale(tl.max(amax, axis=0))
        for c0 in range(0, C, BLOCK_C):
            mask = (c0 + offs < C) & present
            v = tl.load(x_ptr + src * C + c0 + offs, mask=mask, other=0.0).to(tl.float32)
            q = tl.clamp(v / s, -448.0, 448.0)
            tl.store(q_ptr + m * C + c0 + offs, q.to(q_ptr.dtype.element_ty), mask=c0 + offs < C)
        tl.store(s_ptr + m, s)

    @triton.jit
    def _quant_cols_kernel(x_ptr, in_start_ptr, counts_ptr, out_start_ptr, q_ptr, s_ptr, C, n_out, group_stride,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        g = tl.program_id(1)
        cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        i0 = tl.load(in_start_ptr + g).to(tl.int64)
        n = tl.load(counts_ptr + g).to(tl.int32)
        n_pad = (n + 15) // 16 * 16
        base = g.to(tl.int64) * group_stride + tl.load(out_start_ptr + g).to(tl.int64)
        rows = tl.arange(0, BLOCK_R)
        amax = tl.zeros([BLOCK_C], dtype=tl.float32)
        for r0 in range(0, n, BLOCK_R):
            mask = ((r0 + rows) < n)[:, None] & cmask[None, :]
            v = tl.load(x_ptr + (i0 + r0 + rows)[:, None] * C + cols[None, :], mask=mask, other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(v.to(tl.float32)), axis=0))
        s = _pow2_scale(amax)
        for r0 in range(0, n_pad, BLOCK_R):
            mask = ((r0 + rows) < n)[:, None] & cmask[None, :]
            v = tl.load(x_ptr + (i0 + r0 + rows)[:, None] * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            q = tl.clamp(v / s[None, :], -448.0, 448.0)
            out = base + cols[None, :].to(tl.int64) * n_out + (r0 + rows)[:, None]
            tl.store(q_ptr + out, q.to(q_ptr.dtype.element_ty), mask=((r0 + rows) < n_pad)[:, None] & cmask[None, :])
        tl.store(s_ptr + g * C + cols, s, mask=cmask)


def quant_rows(x_RC: torch.Tensor, src_M: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if not _on_kernels(x_RC):
        return quant_rows_torch(x_RC, src_M)
    x_RC = x_RC.contiguous()
    M = x_RC.shape[0] if src_M is None else src_M.shape[0]
    C = x_RC.shape[1]
    q_MC = torch.empty(M, C, dtype=FP8, device=x_RC.device)
    s_M = torch.empty(M, dtype=torch.float32, device=x_RC.device)
    if M:
        BLOCK_C = min(4096, triton.next_power_of_2(C))
        _quant_rows_kernel[(M,)](x_RC, src_M if src_M is not None else s_M, q_MC, s_M, C, HAS_SRC=src_M is not None,
                                 BLOCK_C=BLOCK_C, num_warps=4 if BLOCK_C <= 2048 else 8)
    return q_MC, s_M


def quant_cols(x_RC, in_start_G, counts_G, out_start_G, n_out: int, group_stride: int = 0):
    if not _on_kernels(x_RC):
        return quant_cols_torch(x_RC, in_start_G, counts_G, out_start_G, n_out, group_stride)
    x_RC = x_RC.contiguous()
    G, C = counts_G.shape[0], x_RC.shape[1]
    size = n_out * C if group_stride == 0 else G * group_stride
    # positions no group covers stay unwritten: for the token layout they are past every group's end
    # (offsets stop there), for weights every position is covered
    qT = torch.empty(size, dtype=FP8, device=x_RC.device)
    s_GC = torch.empty(G, C, dtype=torch.float32, device=x_RC.device)
    BLOCK_C, BLOCK_R = 64, 64
    _quant_cols_kernel[(triton.cdiv(C, BLOCK_C), G)](x_RC, in_start_G, counts_G, out_start_G, qT, s_GC, C, n_out,
                                                     group_stride, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=4)
    return qT, s_GC
