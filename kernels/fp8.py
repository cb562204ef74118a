"""FP8 (e4m3) quantisation for the scaled grouped GEMMs of FP8 experts (Triton on CUDA, torch elsewhere).

Scales are dequantisation multipliers rounded up to a power of two (x ≈ q · s, an exact rescaling;
|x| / s ≤ 448): s = 2^ceil(log2(amax / 448)), s = 1 where amax = 0.

    quant_rows(x_RC, n_valid=None) -> (q_RC fp8, s_R fp32)
        one scale per row over its C columns (the left operand of a 2d×3d grouped GEMM). Rows at or
        past the device scalar n_valid (fixed-capacity padding no GEMM reads) are skipped: unspecified.
    gather_quant_rows(x_TC, src_R) -> (x_RC = x_TC[src_R], q_RC, s_R)
        a row gather (the local dispatch) that quantises the rows it moves, as quant_rows would.
    quant_blocks(x_RC, block, out=None) -> (q_RC fp8, s_RB fp32)          B = ceil(C / block)
        one scale per ``block`` consecutive columns of a row (1×128 tiles, as DeepSeek-V3 moves tokens in FP8);
        ``out``: (q, s) views to write, any row strides (a packed wire row holds both).
    dequant_blocks(q_RC, s_RB, block, out_RC) -> out_RC    out[r, c] = q[r, c] · s[r, c // block] (exact)
    cast_experts_scaled(ws, out_EPI, hint_E) -> s_E
        one scale per expert over every element of its matrices in all of ws (w1 and w3 share one, so
        their FP8 copies stack along the GEMM's reduction dimension), and the stacked plain copy
        out[e] = fp8([w_0; w_1; …][e] / s[e]): one pass over the weights when hint_E (the previous call's
        scales, updated in place) is right, plus a pass over only the experts whose scale moved.
    cast_experts_t(w_EOI, s_E, out_EIP, col0)    out[e, i, col0 + o]  = fp8(w[e, o, i] / s[e])
        the transposed FP8 copy the input gradient's GEMM needs (Hopper FP8 GEMMs read both operands
        along the reduction dimension); ``cast_experts_torch`` is the plain (forward) layout's reference.
    cast_both(x_RC, dtype=FP8) -> (q_RC, q_CR, s)
        one scale for the whole tensor, x in FP8 in its layout and transposed (the output head's operands).
    Fp8Copy, write_copy_reference_, recast_moved_, transpose_copy_
        a weight's place in a persistent FP8 copy that the optimizer step writes (kernels/adamw.py) with
        the scales it already has while it takes the new amax; ``recast_moved_`` then recasts only the
        experts whose scale moved, and ``transpose_copy_`` writes the transposed copy from the plain one.
    swiglu_quant(ab_MJ, n_valid=None) -> (h_MH bf16, q_MH fp8, s_M)          J = 2H, ab = [a | b]
        h = silu(a) · b in fp32, written in bf16 and as FP8 rows (one scale per row).
    swiglu_quant_bwd(dh_MH, ab_MJ, n_valid=None) -> (da_MH, db_MH bf16, q_MJ fp8, s_M)
        da = dh·b·σ(a)·(1 + a(1 − σ(a))), db = dh·silu(a): bf16 each (the weight-gradient GEMMs) and
        [da | db] as FP8 rows with one scale per row (the input-gradient GEMM, reduction over 2H).

Everything is read from device memory: no host sync, fixed output shapes (CUDA-graph capturable).
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .moe_rows import triton

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_GRAD = torch.float8_e5m2  # gradients scaled per tensor (the output head's): more range, less precision
Q_MAX = {FP8: FP8_MAX, FP8_GRAD: 57344.0}


def pow2_scale(amax: torch.Tensor, q_max: float = FP8_MAX) -> torch.Tensor:
    """s = 2^ceil(log2(amax / q_max)) (fp32), 1 where amax is 0."""
    m, e = torch.frexp(amax.float() / q_max)  # v = m · 2^e, m in [0.5, 1)
    s = torch.ldexp(torch.ones_like(m), torch.where(m == 0.5, e - 1, e))
    return torch.where(amax > 0, s, torch.ones_like(s))


def _cast(x: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = FP8) -> torch.Tensor:
    return (x.float() / s).clamp(-Q_MAX[dtype], Q_MAX[dtype]).to(dtype)


# --- torch reference (CPU, and the check for the kernels) ---------------------------------------

def _on_kernels(x: torch.Tensor) -> bool:
    """Triton for every CUDA tensor, whatever its float dtype (the torch path is the CPU reference).
    Not under TRITON_INTERPRET: the interpreter's float8 conversion does not round to nearest even."""
    return triton is not None and x.is_cuda


def quant_rows_torch(x_RC):
    s_R = pow2_scale(x_RC.abs().amax(1) if x_RC.shape[1] else x_RC.new_zeros(x_RC.shape[0]))
    return _cast(x_RC, s_R[:, None]), s_R


def quant_blocks_torch(x_RC, block: int):
    R, C = x_RC.shape
    B = -(-C // block)
    amax_RB = F.pad(x_RC.abs(), (0, B * block - C)).view(R, B, block).amax(2) if C else x_RC.new_zeros(R, 0)
    s_RB = pow2_scale(amax_RB)
    return _cast(x_RC, s_RB.repeat_interleave(block, 1)[:, :C]), s_RB


def expert_scales_torch(*ws):
    amax_E = torch.stack([w.detach().abs().flatten(1).amax(1).float() for w in ws]).amax(0)
    return pow2_scale(amax_E)


def swiglu_quant_torch(ab_MJ, bf16=True):
    a, b = ab_MJ.float().chunk(2, dim=1)
    h = F.silu(a) * b
    q, s = quant_rows_torch(h)
    return h.to(torch.bfloat16) if bf16 else None, q, s


def swiglu_quant_bwd_torch(dh_MH, ab_MJ, bf16=True):
    a, b = ab_MJ.float().chunk(2, dim=1)
    g, sig = dh_MH.float(), torch.sigmoid(a)
    da, db = g * b * sig * (1 + a * (1 - sig)), g * a * sig
    q, s = quant_rows_torch(torch.cat([da, db], 1))
    if not bf16:
        return None, None, q, s
    return da.to(torch.bfloat16), db.to(torch.bfloat16), q, s


# --- Triton kernels -----------------------------------------------------------------------------

if triton is not None:
    import triton.language as tl

    from .moe_rows import _pow2_scale
    from .swiglu import silu_mul, silu_mul_grads

    @triton.jit
    def _rows(M, n_valid_ptr, HAS_N: tl.constexpr, BLOCK_M: tl.constexpr):
        """(rows m of this program's BLOCK_M, the row count n): n = min(M, n_valid) with HAS_N, else M."""
        n = M.to(tl.int64) if not HAS_N else tl.minimum(tl.load(n_valid_ptr).to(tl.int64), M)
        return tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M), n

    @triton.jit
    def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, n_valid_ptr, src_ptr, out_ptr, R, C, HAS_N: tl.constexpr,
                           GATHER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
        """Rows m of q from rows m of x, or with GATHER from rows src[m] of x, copied to rows m of out as well;
        BLOCK_M rows a program."""
        m, n = _rows(R, n_valid_ptr, HAS_N, BLOCK_M)
        if tl.program_id(0).to(tl.int64) * BLOCK_M < n:
            ok = m < n
            src = m
            if GATHER:
                src = tl.load(src_ptr + m, mask=ok, other=0).to(tl.int64)
            offs = tl.arange(0, BLOCK_C)
            amax = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
            for c0 in range(0, C, BLOCK_C):
                mask = ok[:, None] & (c0 + offs < C)[None, :]
                v = tl.load(x_ptr + src[:, None] * C + c0 + offs[None, :], mask=mask, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(v))
            s = _pow2_scale(tl.max(amax, axis=1))
            r = 1.0 / s  # exact (s a power of two): x · r == x / s, one multiply an element
            for c0 in range(0, C, BLOCK_C):
                mask = ok[:, None] & (c0 + offs < C)[None, :]
                x = tl.load(x_ptr + src[:, None] * C + c0 + offs[None, :], mask=mask, other=0.0)
                if GATHER:
                    tl.store(out_ptr + m[:, None] * C + c0 + offs[None, :], x, mask=mask)
                q = tl.clamp(x.to(tl.float32) * r[:, None], -448.0, 448.0)
                tl.store(q_ptr + m[:, None] * C + c0 + offs[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
            tl.store(s_ptr + m, s, mask=ok)

    @triton.jit
    def _quant_blocks_kernel(x_ptr, q_ptr, s_ptr, C, q_stride, s_stride, B_P: tl.constexpr, BLOCK: tl.constexpr):
        """Row m as [B_P, BLOCK] tiles: one scale per tile."""
        m = tl.program_id(0).to(tl.int64)
        b = tl.arange(0, B_P)
        col = b[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        mask = col < C
        v = tl.load(x_ptr + m * C + col, mask=mask, other=0.0).to(tl.float32)
        s = _pow2_scale(tl.max(tl.abs(v), axis=1))
        tl.store(q_ptr + m * q_stride + col, tl.clamp(v * (1.0 / s)[:, None], -448.0, 448.0).to(q_ptr.dtype.element_ty),
                 mask=mask)
        tl.store(s_ptr + m * s_stride + b, s, mask=b * BLOCK < C)

    @triton.jit
    def _dequant_blocks_kernel(q_ptr, s_ptr, out_ptr, C, q_stride, s_stride, BLOCK: tl.constexpr,
                               BLOCK_C: tl.constexpr):
        m = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_C)
        for c0 in range(0, C, BLOCK_C):
            mask = c0 + offs < C
            s = tl.load(s_ptr + m * s_stride + (c0 + offs) // BLOCK, mask=mask, other=1.0)
            v = tl.load(q_ptr + m * q_stride + c0 + offs, mask=mask, other=0.0).to(tl.float32) * s
            tl.store(out_ptr + m * C + c0 + offs, v.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _cast_amax_kernel(w_ptr, hint_ptr, out_ptr, amax_ptr, n_per_e, out_per_e, out_off, BLOCK: tl.constexpr):
        e = tl.program_id(1).to(tl.int64)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_per_e
        s = tl.load(hint_ptr + e)
        v = tl.load(w_ptr + e * n_per_e + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + e * out_per_e + out_off + offs, tl.clamp(v / s, -448.0, 448.0).to(out_ptr.dtype.element_ty),
                 mask=mask)
        tl.atomic_max(amax_ptr + e, tl.max(tl.abs(v), axis=0))

    @triton.jit
    def _recast_kernel(w_ptr, hint_ptr, s_ptr, out_ptr, n_per_e, out_per_e, out_off, BLOCK: tl.constexpr):
        """Expert program_id(1)'s blocks program_id(0), + num_programs(0), … cast again at s where the predicted
        scale (hint) was wrong for it; else the program exits at once."""
        e = tl.program_id(1).to(tl.int64)
        s = tl.load(s_ptr + e)
        if s != tl.load(hint_ptr + e):
            for b in range(tl.program_id(0), tl.cdiv(n_per_e, BLOCK), tl.num_programs(0)):
                offs = b * BLOCK + tl.arange(0, BLOCK)
                mask = offs < n_per_e
                v = tl.load(w_ptr + e * n_per_e + offs, mask=mask, other=0.0).to(tl.float32)
                tl.store(out_ptr + e * out_per_e + out_off + offs,
                         tl.clamp(v / s, -448.0, 448.0).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _cast_experts_t_kernel(w_ptr, s_ptr, out_ptr, plain_ptr, O, I, P, col0, Q_MAX: tl.constexpr,
                               PLAIN: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr):
        """out[e, i, col0 + o] = fp8(w[e, o, i] / s[e]) for one [BLOCK_O, BLOCK_I] tile; PLAIN: plain[e, o, i] too."""
        e = tl.program_id(2).to(tl.int64)
        o = tl.program_id(0) * BLOCK_O + tl.arange(0, BLOCK_O)
        i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        mask = (o[:, None] < O) & (i[None, :] < I)
        s = tl.load(s_ptr + e)
        src = e * O * I + o[:, None].to(tl.int64) * I + i[None, :]
        v = tl.load(w_ptr + src, mask=mask, other=0.0)
        q = tl.clamp(v.to(tl.float32) / s, -Q_MAX, Q_MAX).to(out_ptr.dtype.element_ty)
        if PLAIN:
            tl.store(plain_ptr + src, q, mask=mask)
        dst = out_ptr + e * I * P + i[:, None].to(tl.int64) * P + col0 + o[None, :]
        tl.store(dst, tl.trans(q), mask=(i[:, None] < I) & (o[None, :] < O))

    @triton.jit
    def _transpose_kernel(src_ptr, dst_ptr, P, I, BLOCK_P: tl.constexpr, BLOCK_I: tl.constexpr):
        """dst[e, i, p] = src[e, p, i] for one [BLOCK_P, BLOCK_I] tile of bytes (FP8 copies viewed as uint8)."""
        e = tl.program_id(2).to(tl.int64)
        p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        x = tl.load(src_ptr + e * P * I + p[:, None].to(tl.int64) * I + i[None, :],
                    mask=(p[:, None] < P) & (i[None, :] < I))
        tl.store(dst_ptr + e * I * P + i[:, None].to(tl.int64) * P + p[None, :], tl.trans(x),
                 mask=(i[:, None] < I) & (p[None, :] < P))

    @triton.jit
    def _part(m, ok, H, C0: tl.constexpr, W: tl.constexpr):
        """(offsets in an [M, H] array, mask) of columns C0 … C0 + W of rows m (those past H masked)."""
        c = C0 + tl.arange(0, W)
        return m[:, None] * H + c[None, :], ok[:, None] & (c < H)[None, :]

    @triton.jit
    def _h_part(ab_ptr, m, ok, H, C0: tl.constexpr, W: tl.constexpr):
        """(h = silu(a) · b, offsets, mask) of columns C0 … C0 + W of rows m of ab = [a | b]; rows amax of |h|."""
        off, mask = _part(m, ok, H, C0, W)
        a = tl.load(ab_ptr + off + m[:, None] * H, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(ab_ptr + off + m[:, None] * H + H, mask=mask, other=0.0).to(tl.float32)
        h = silu_mul(a, b)
        return h, off, mask, tl.max(tl.abs(h), axis=1)

    @triton.jit
    def _h_store(h_ptr, q_ptr, h, off, mask, r, BF16: tl.constexpr):
        if BF16:
            tl.store(h_ptr + off, h.to(h_ptr.dtype.element_ty), mask=mask)
        tl.store(q_ptr + off, tl.clamp(h * r, -448.0, 448.0).to(q_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_quant_kernel(ab_ptr, h_ptr, q_ptr, s_ptr, n_valid_ptr, M, H, HAS_N: tl.constexpr, BF16: tl.constexpr,
                             BLOCK_M: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr):
        """BLOCK_M rows a program, each as up to three column parts of widths W0, W1, W2 (powers of two, W0 + W1 +
        W2 >= H; 0: no part), so a row needs no lanes past H but in its last part."""
        m, n = _rows(M, n_valid_ptr, HAS_N, BLOCK_M)
        if tl.program_id(0).to(tl.int64) * BLOCK_M < n:
            ok = m < n
            h0, o0, k0, amax = _h_part(ab_ptr, m, ok, H, 0, W0)
            if W1 > 0:
                h1, o1, k1, amax1 = _h_part(ab_ptr, m, ok, H, W0, W1)
                amax = tl.maximum(amax, amax1)
            if W2 > 0:
                h2, o2, k2, amax2 = _h_part(ab_ptr, m, ok, H, W0 + W1, W2)
                amax = tl.maximum(amax, amax2)
            s = _pow2_scale(amax)
            r = (1.0 / s)[:, None]  # exact (s a power of two): · r equals / s, a multiply an element
            _h_store(h_ptr, q_ptr, h0, o0, k0, r, BF16)
            if W1 > 0:
                _h_store(h_ptr, q_ptr, h1, o1, k1, r, BF16)
            if W2 > 0:
                _h_store(h_ptr, q_ptr, h2, o2, k2, r, BF16)
            tl.store(s_ptr + m, s, mask=ok)

    @triton.jit
    def _dab_part(dh_ptr, ab_ptr, m, ok, H, C0: tl.constexpr, W: tl.constexpr):
        """(da, db, offsets, mask, rows amax of |da| and |db|) of columns C0 … C0 + W of rows m."""
        off, mask = _part(m, ok, H, C0, W)
        g = tl.load(dh_ptr + off, mask=mask, other=0.0).to(tl.float32)
        a = tl.load(ab_ptr + off + m[:, None] * H, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(ab_ptr + off + m[:, None] * H + H, mask=mask, other=0.0).to(tl.float32)
        da, db = silu_mul_grads(g, a, b)
        return da, db, off, mask, tl.maximum(tl.max(tl.abs(da), axis=1), tl.max(tl.abs(db), axis=1))

    @triton.jit
    def _dab_store(da_ptr, db_ptr, q_ptr, da, db, off, mask, m, H, r, BF16: tl.constexpr):
        if BF16:
            tl.store(da_ptr + off, da.to(da_ptr.dtype.element_ty), mask=mask)
            tl.store(db_ptr + off, db.to(db_ptr.dtype.element_ty), mask=mask)
        q = q_ptr + off + m[:, None] * H  # [da | db] rows of 2H
        tl.store(q, tl.clamp(da * r, -448.0, 448.0).to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(q + H, tl.clamp(db * r, -448.0, 448.0).to(q_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_quant_bwd_kernel(dh_ptr, ab_ptr, da_ptr, db_ptr, q_ptr, s_ptr, n_valid_ptr, M, H,
                                 HAS_N: tl.constexpr, BF16: tl.constexpr, BLOCK_M: tl.constexpr, W0: tl.constexpr,
                                 W1: tl.constexpr, W2: tl.constexpr):
        """BLOCK_M rows a program in column parts, as ``_swiglu_quant_kernel``."""
        m, n = _rows(M, n_valid_ptr, HAS_N, BLOCK_M)
        if tl.program_id(0).to(tl.int64) * BLOCK_M < n:
            ok = m < n
            da0, db0, o0, k0, amax = _dab_part(dh_ptr, ab_ptr, m, ok, H, 0, W0)
            if W1 > 0:
                da1, db1, o1, k1, amax1 = _dab_part(dh_ptr, ab_ptr, m, ok, H, W0, W1)
                amax = tl.maximum(amax, amax1)
            if W2 > 0:
                da2, db2, o2, k2, amax2 = _dab_part(dh_ptr, ab_ptr, m, ok, H, W0 + W1, W2)
                amax = tl.maximum(amax, amax2)
            s = _pow2_scale(amax)
            r = (1.0 / s)[:, None]
            _dab_store(da_ptr, db_ptr, q_ptr, da0, db0, o0, k0, m, H, r, BF16)
            if W1 > 0:
                _dab_store(da_ptr, db_ptr, q_ptr, da1, db1, o1, k1, m, H, r, BF16)
            if W2 > 0:
                _dab_store(da_ptr, db_ptr, q_ptr, da2, db2, o2, k2, m, H, r, BF16)
            tl.store(s_ptr + m, s, mask=ok)


def _row_warps(block: int) -> int:
    return 4 if block <= 2048 else 8


ROW_TILES = {  # the row kernels' launch for the sweep (benchmarks/fp8_rows.py): (rows a program, num_warps — 0: 4
    # up to 2048 lanes a program, else 8 —, split: the SwiGLU kernels' rows in up to three power-of-two parts, not
    # one padded to a power of two; quant_rows ignores it). None: the default rule (``_row_tile``)
    "m1": (1, 0, False),
    "m2_w4": (2, 4, False),
    "m4_w4": (4, 4, False),
    "m4_w8": (4, 8, False),
    "m8_w8": (8, 8, False),
    "m1_split": (1, 0, True),
    "m2_w4_split": (2, 4, True),
    "m4_w4_split": (4, 4, True),
    "m4_w8_split": (4, 8, True),
}


def _row_tile(tile: str | None, block: int, swiglu: bool) -> tuple[int, int, bool]:
    """(BLOCK_M, num_warps, split) of ``tile`` (a name in ROW_TILES) for rows of ``block`` lanes (a power of two).
    The default: quant_rows a row a program (its rows span up to 4096 lanes, looped past); the SwiGLU kernels, in
    parts, as many rows as fill 8192 lanes (4 of 1408, 2 of 2816: the fastest tile or within the sweep's ~5% noise
    of it on H200, 1.2-1.3x one padded row a program at the routed experts' shape; benchmarks/fp8_rows.py)."""
    if tile is not None:
        rows, warps, split = ROW_TILES[tile]
        return rows, warps or _row_warps(rows * block), split
    if not swiglu:
        return 1, _row_warps(block), False
    rows = max(1, min(8, 8192 // block))
    return rows, 4 if rows * block <= 8192 else 8, True


def _row_parts(split: bool, H: int) -> tuple[int, int, int]:
    """(W0, W1, W2): a row of H in power-of-two parts (0: none), W0 + W1 + W2 >= H: one part padded to a power of
    two, or ``split``: the largest power of two that fits, the next, and the rest padded."""
    if not split:
        return triton.next_power_of_2(H), 0, 0
    w0 = 1 << (H.bit_length() - 1)
    w1 = 1 << ((H - w0).bit_length() - 1) if H > w0 else 0
    return w0, w1, triton.next_power_of_2(H - w0 - w1) if H > w0 + w1 else 0


def quant_rows(x_RC: torch.Tensor, n_valid: torch.Tensor | None = None,
               tile: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if not _on_kernels(x_RC):
        return quant_rows_torch(x_RC)
    return _launch_quant_rows(x_RC.contiguous(), x_RC.shape[0], n_valid, tile=tile)


def gather_quant_rows(x_TC: torch.Tensor, src_R: torch.Tensor,
                      tile: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x_RC = x_TC[src_R] (x's dtype) and ``quant_rows(x_RC)``, in one pass over the rows on CUDA:
    (x_RC, q_RC, s_R)."""
    if not _on_kernels(x_TC):
        x_RC = x_TC.index_select(0, src_R)
        return x_RC, *quant_rows_torch(x_RC)
    return _launch_quant_rows(x_TC.contiguous(), src_R.shape[0], None, src_R.contiguous(), tile)


def _launch_quant_rows(x_XC, R: int, n_valid, src_R=None, tile: str | None = None):
    C = x_XC.shape[1]
    q_RC = torch.empty(R, C, dtype=FP8, device=x_XC.device)
    s_R = torch.empty(R, dtype=torch.float32, device=x_XC.device)
    out_RC = torch.empty(R, C, dtype=x_XC.dtype, device=x_XC.device) if src_R is not None else None
    if R:
        BLOCK_C = min(4096, triton.next_power_of_2(C))
        rows, warps, _ = _row_tile(tile, BLOCK_C, swiglu=False)
        _quant_rows_kernel[(triton.cdiv(R, rows),)](
            x_XC, q_RC, s_R, n_valid if n_valid is not None else s_R, src_R if src_R is not None else s_R,
            out_RC if src_R is not None else q_RC, R, C, HAS_N=n_valid is not None, GATHER=src_R is not None,
            BLOCK_M=rows, BLOCK_C=BLOCK_C, num_warps=warps)
    return (q_RC, s_R) if src_R is None else (out_RC, q_RC, s_R)


def quant_blocks(x_RC: torch.Tensor, block: int,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` (q_RC fp8 and s_RB fp32, each with unit column stride): written in place of new tensors, returned."""
    R, C = x_RC.shape
    B = -(-C // block)
    if not _on_kernels(x_RC):
        q_RC, s_RB = quant_blocks_torch(x_RC, block)
        if out is None:
            return q_RC, s_RB
        out[0].copy_(q_RC)
        out[1].copy_(s_RB)
        return out
    x_RC = x_RC.contiguous()
    if out is None:
        out = (torch.empty(R, C, dtype=FP8, device=x_RC.device),
               torch.empty(R, B, dtype=torch.float32, device=x_RC.device))
    q_RC, s_RB = out
    assert q_RC.shape == (R, C) and s_RB.shape == (R, B) and (C < 2 or q_RC.stride(1) == 1) and \
        (B < 2 or s_RB.stride(1) == 1)
    if R and C:
        B_P = triton.next_power_of_2(B)
        _quant_blocks_kernel[(R,)](x_RC, q_RC, s_RB, C, q_RC.stride(0), s_RB.stride(0), B_P=B_P, BLOCK=block,
                                   num_warps=_row_warps(B_P * block))
    return q_RC, s_RB


def dequant_blocks(q_RC: torch.Tensor, s_RB: torch.Tensor, block: int, out_RC: torch.Tensor) -> torch.Tensor:
    """out_RC (contiguous) = q_RC · s_RB in out's dtype, one scale per ``block`` columns; q (fp8) and s (fp32) have
    unit column strides and any row strides (the two parts of packed wire rows)."""
    R, C = q_RC.shape
    if not _on_kernels(q_RC):
        s_RC = s_RB.to(out_RC.dtype).repeat_interleave(block, 1)[:, :C]
        return out_RC.copy_(q_RC.to(out_RC.dtype)).mul_(s_RC)
    assert out_RC.is_contiguous() and out_RC.shape == (R, C) and (C < 2 or q_RC.stride(1) == 1)
    if R and C:
        BLOCK_C = min(4096, triton.next_power_of_2(C))
        _dequant_blocks_kernel[(R,)](q_RC, s_RB, out_RC, C, q_RC.stride(0), s_RB.stride(0), BLOCK=block,
                                     BLOCK_C=BLOCK_C, num_warps=_row_warps(BLOCK_C))
    return out_RC


def cast_experts_scaled(ws: tuple[torch.Tensor, ...], out_EPI: torch.Tensor, hint_E: torch.Tensor) -> torch.Tensor:
    """out[e] = fp8([ws[0]; ws[1]; …][e] / s[e]) stacked along dim 1, s = expert_scales_torch(*ws), returned.
    ``hint_E`` (fp32 [E], device) is the scale guessed for each expert — the previous call's; it is
    overwritten with s. A wrong guess costs one more pass over that expert's weights, never accuracy."""
    if not _on_kernels(ws[0]):
        s_E = expert_scales_torch(*ws)
        row = 0
        for w in ws:
            cast_experts_torch(w, s_E, out_EPI, row)
            row += w.shape[1]
        hint_E.copy_(s_E)
        return s_E
    E = ws[0].shape[0]
    amax_E = torch.zeros(E, dtype=torch.float32, device=out_EPI.device)
    BLOCK = 4096
    ws = [w.detach().contiguous() for w in ws]
    row, starts = 0, []
    for w in ws:
        n = w[0].numel()
        starts.append(row * w.shape[2])
        _cast_amax_kernel[(triton.cdiv(n, BLOCK), E)](w, hint_E, out_EPI, amax_E, n, out_EPI[0].numel(), starts[-1],
                                                      BLOCK=BLOCK, num_warps=8)
        row += w.shape[1]
    s_E = pow2_scale(amax_E)
    for w, start in zip(ws, starts):
        n = w[0].numel()
        _recast_kernel[(_programs(triton.cdiv(n, BLOCK), E), E)](w, hint_E, s_E, out_EPI, n, out_EPI[0].numel(),
                                                                 start, BLOCK=BLOCK, num_warps=8)
    hint_E.copy_(s_E)
    return s_E


def _programs(blocks: int, E: int) -> int:
    """Programs an expert for a kernel whose programs mostly exit at once (a recast where few scales move): about
    2048 in all, each walking its expert's blocks a grid stride apart, so the exits cost little and a real recast
    still fills the GPU."""
    return max(1, min(blocks, 2048 // max(E, 1)))


def cast_experts_torch(w_EOI: torch.Tensor, s_E: torch.Tensor, out_EPI: torch.Tensor, row0: int) -> None:
    """out[e, row0:row0+O, :] = fp8(w[e] / s[e]) (out [E, P, I]): the reference of the forward copy."""
    out_EPI[:, row0:row0 + w_EOI.shape[1]] = _cast(w_EOI.detach(), s_E[:, None, None])


def cast_experts_t(w_EOI: torch.Tensor, s_E: torch.Tensor, out_EIP: torch.Tensor, col0: int,
                   plain_EOI: torch.Tensor | None = None) -> None:
    """out[e, :, col0:col0+O] = fp8(w[e] / s[e])ᵀ (out [E, I, P] contiguous; its dtype, e4m3 or e5m2); with
    ``plain_EOI`` (contiguous, out's dtype) the same values in w's layout as well, from the same pass."""
    E, O, I = w_EOI.shape
    if not _on_kernels(w_EOI):
        q_EOI = _cast(w_EOI.detach(), s_E[:, None, None], out_EIP.dtype)
        out_EIP[:, :, col0:col0 + O] = q_EOI.transpose(1, 2)
        if plain_EOI is not None:
            plain_EOI.copy_(q_EOI)
        return
    if E == 0 or O == 0 or I == 0:
        return
    w = w_EOI.detach().contiguous()
    BO, BI = 64, 64
    _cast_experts_t_kernel[(triton.cdiv(O, BO), triton.cdiv(I, BI), E)](
        w, s_E, out_EIP, out_EIP if plain_EOI is None else plain_EOI, O, I, out_EIP.shape[2], col0,
        Q_MAX=Q_MAX[out_EIP.dtype], PLAIN=plain_EOI is not None, BLOCK_O=BO, BLOCK_I=BI, num_warps=4)


def cast_both(x_RC: torch.Tensor, dtype: torch.dtype = FP8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_RC, q_CR, s): x in FP8 ``dtype`` with one power-of-two scale for the whole tensor (|x| / s <= the
    dtype's max), in x's layout and transposed (the two layouts Hopper's FP8 GEMMs read, each along its
    reduction dimension), from one amax pass and one cast pass. s: fp32 0-d, on the device."""
    R, C = x_RC.shape
    s = pow2_scale(torch.linalg.vector_norm(x_RC.detach(), float("inf")), Q_MAX[dtype])
    q_RC = torch.empty(R, C, dtype=dtype, device=x_RC.device)
    q_CR = torch.empty(C, R, dtype=dtype, device=x_RC.device)
    cast_experts_t(x_RC[None], s[None], q_CR[None], 0, plain_EOI=q_RC[None])
    return q_RC, q_CR, s


class Fp8Copy(NamedTuple):
    """Where a weight w [E, O, I] lives in a persistent FP8 copy: rows [row0, row0 + O) of ``plain_EPI``
    [E, P, I]; ``scale_E`` the scales the copy holds (shared with the weights stacked beside it), ``amax_E``
    the running amax of what was written since the scales were last set (both fp32 [E], device)."""
    plain_EPI: torch.Tensor
    row0: int
    scale_E: torch.Tensor
    amax_E: torch.Tensor


def write_copy_reference_(w_EOI: torch.Tensor, c: Fp8Copy) -> None:
    """fp8(w / c.scale_E) written into the copy, |w|'s amax per expert folded into c.amax_E (torch: the
    optimizer kernel's reference)."""
    c.plain_EPI[:, c.row0:c.row0 + w_EOI.shape[1]] = _cast(w_EOI.detach(), c.scale_E[:, None, None])
    torch.maximum(c.amax_E, w_EOI.detach().abs().flatten(1).amax(1).float(), out=c.amax_E)


def recast_moved_(w_EOI: torch.Tensor, c: Fp8Copy, s_E: torch.Tensor) -> None:
    """w's rows of the copy recast with the scales ``s_E`` for the experts where s_E differs from c.scale_E
    (which is left as it is: the caller sets it after every weight sharing it was recast)."""
    E, O, I = w_EOI.shape
    rows = c.plain_EPI[:, c.row0:c.row0 + O]
    if not _on_kernels(w_EOI):
        rows.copy_(torch.where((s_E != c.scale_E)[:, None, None], _cast(w_EOI.detach(), s_E[:, None, None]), rows))
        return
    w = w_EOI.detach()
    if not w.is_contiguous():
        raise ValueError("recast_moved_: the weight must be contiguous (the optimizer's fp32 master)")
    BLOCK = 4096
    _recast_kernel[(_programs(triton.cdiv(O * I, BLOCK), E), E)](w, c.scale_E, s_E, c.plain_EPI, O * I,
                                                                 c.plain_EPI[0].numel(), c.row0 * I, BLOCK=BLOCK,
                                                                 num_warps=8)


def transpose_copy_(plain_EPI: torch.Tensor, out_EIP: torch.Tensor) -> None:
    """out[e] = plain[e]ᵀ, FP8 bytes unchanged (the transposed copy the input gradient's GEMM reads)."""
    if not _on_kernels(plain_EPI):
        out_EIP.view(torch.uint8).copy_(plain_EPI.view(torch.uint8).transpose(1, 2))
        return
    E, P, I = plain_EPI.shape
    if E == 0 or P == 0 or I == 0:
        return
    B = 128  # 16 KB of bytes per tile
    _transpose_kernel[(triton.cdiv(P, B), triton.cdiv(I, B), E)](plain_EPI.view(torch.uint8), out_EIP.view(torch.uint8),
                                                                 P, I, BLOCK_P=B, BLOCK_I=B, num_warps=8)


def swiglu_quant(ab_MJ: torch.Tensor, n_valid: torch.Tensor | None = None, bf16: bool = True,
                 tile: str | None = None):
    """(h_MH bf16, or None with ``bf16=False``; h's e4m3 rows q_MH and their scales s_M). tile: a name in
    ROW_TILES (None: the default, ``_row_tile``)."""
    if not _on_kernels(ab_MJ):
        return swiglu_quant_torch(ab_MJ, bf16)
    ab_MJ = ab_MJ.contiguous()
    M, H = ab_MJ.shape[0], ab_MJ.shape[1] // 2
    h = torch.empty(M, H, dtype=torch.bfloat16, device=ab_MJ.device) if bf16 else None
    q = torch.empty(M, H, dtype=FP8, device=ab_MJ.device)
    s = torch.empty(M, dtype=torch.float32, device=ab_MJ.device)
    if M:
        rows, warps, split = _row_tile(tile, triton.next_power_of_2(H), swiglu=True)
        w0, w1, w2 = _row_parts(split, H)
        _swiglu_quant_kernel[(triton.cdiv(M, rows),)](ab_MJ, h if bf16 else q, q, s,
                                                      n_valid if n_valid is not None else s, M, H,
                                                      HAS_N=n_valid is not None, BF16=bf16, BLOCK_M=rows, W0=w0,
                                                      W1=w1, W2=w2, num_warps=warps)
    return h, q, s


def swiglu_quant_bwd(dh_MH: torch.Tensor, ab_MJ: torch.Tensor, n_valid: torch.Tensor | None = None,
                     bf16: bool = True, tile: str | None = None):
    """(da_MH, db_MH bf16, or None, None with ``bf16=False``; [da | db]'s e4m3 rows q_M2H and their scales s_M).
    tile: a name in ROW_TILES (None: the default, ``_row_tile``)."""
    if not _on_kernels(ab_MJ):
        return swiglu_quant_bwd_torch(dh_MH, ab_MJ, bf16)
    dh_MH, ab_MJ = dh_MH.contiguous(), ab_MJ.contiguous()
    M, H = dh_MH.shape
    da = torch.empty(M, H, dtype=torch.bfloat16, device=ab_MJ.device) if bf16 else None
    db = torch.empty_like(da) if bf16 else None
    q = torch.empty(M, 2 * H, dtype=FP8, device=ab_MJ.device)
    s = torch.empty(M, dtype=torch.float32, device=ab_MJ.device)
    if M:
        rows, warps, split = _row_tile(tile, triton.next_power_of_2(H), swiglu=True)
        w0, w1, w2 = _row_parts(split, H)
        _swiglu_quant_bwd_kernel[(triton.cdiv(M, rows),)](dh_MH, ab_MJ, da if bf16 else q, db if bf16 else q, q, s,
                                                          n_valid if n_valid is not None else s, M, H,
                                                          HAS_N=n_valid is not None, BF16=bf16, BLOCK_M=rows, W0=w0,
                                                          W1=w1, W2=w2, num_warps=warps)
    return da, db, q, s
