"""Row gather-reduce kernels for MoE permutation and combine (Triton on CUDA, torch elsewhere).

    gather_sum(src_ND, idx_TK, w_TK=None, out=None) -> out_TD
        out[t] = Σ_k w[t, k] · src[idx[t, k]]   (w = 1 when None; idx = -1 contributes nothing — a slot
        that was not sent), accumulated in fp32 (fp64 for
        fp64 inputs), written in src's dtype. Used by combine (forward) and by the backward of the
        dispatch gather (each token's K row-gradients summed without atomics).
    combine_backward(g_TD, y_ND, w_TK, idx_TK, grad_y_out=None, fp8_out=None) -> (grad_y_ND, grad_w_TK)
        grad_y[idx[t, k]] = w[t, k] · g[t]   (rows that no (t, k) maps to are zero; left as they are
                                               when written into ``grad_y_out``)
        grad_w[t, k]      = <g[t], y[idx[t, k]]>  (fp32; 0 where idx = -1)
        ``fp8_out`` (q_ND e4m3, s_N fp32; Triton only): grad_y's rows as FP8 too, one power-of-two scale per
        row, bit for bit ``kernels.fp8.quant_rows(grad_y)`` (what FP8 experts' input-gradient GEMM reads)

One pass over the rows each: no [T, K, D] intermediate, no fp32 copy of y, no atomics.
Indices are read from device memory; nothing is read on the host.
"""

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs may lack triton
    triton = None


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


# --- torch reference implementations (CPU, fp64, and the check for the kernels) ------------------

def _with_zero_row(src_ND, idx_TK):
    """src with a zero row appended, and idx with -1 redirected to it."""
    N = src_ND.shape[0]
    src = torch.cat([src_ND, src_ND.new_zeros(1, src_ND.shape[1])])
    return src, torch.where(idx_TK < 0, N, idx_TK).long()


def gather_sum_torch(src_ND, idx_TK, w_TK=None):
    T, K = idx_TK.shape
    acc = _acc_dtype(src_ND.dtype)
    src_ND, idx_TK = _with_zero_row(src_ND, idx_TK)
    rows_TKD = src_ND.index_select(0, idx_TK.reshape(-1)).view(T, K, -1).to(acc)
    if w_TK is not None:
        rows_TKD = rows_TKD * w_TK.to(acc).unsqueeze(-1)
    return rows_TKD.sum(1).to(src_ND.dtype)


def combine_backward_torch(g_TD, y_ND, w_TK, idx_TK):
    T, K = idx_TK.shape
    acc = _acc_dtype(y_ND.dtype)
    y_pad, idx_pad = _with_zero_row(y_ND, idx_TK)
    flat = idx_pad.reshape(-1)
    y_TKD = y_pad.index_select(0, flat).view(T, K, -1).to(acc)
    grad_w_TK = (y_TKD * g_TD.to(acc).unsqueeze(1)).sum(-1).to(w_TK.dtype)
    src = (w_TK.to(acc).unsqueeze(-1) * g_TD.to(acc).unsqueeze(1)).reshape(T * K, -1).to(y_ND.dtype)
    grad_y_ND = torch.zeros_like(y_pad).index_copy_(0, flat, src)[:-1]
    return grad_y_ND, grad_w_TK


# --- Triton kernels -----------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _pow2_scale_to(amax, q_max):
        """2^ceil(log2(amax / q_max)), 1 where amax is 0: a power-of-two scale s with |x| / s <= q_max."""
        v = tl.maximum(amax, 1e-30) / q_max
        s = tl.exp2(tl.ceil(tl.log2(v)))
        s = tl.where(v > s, s * 2.0, s)  # guard against log2 rounding down
        return tl.where(amax > 0, s, 1.0)

    @triton.jit
    def _pow2_scale(amax):
        """The e4m3 scale of a row or tile (kernels/fp8.py): 2^ceil(log2(amax / 448)), 1 where amax is 0."""
        return _pow2_scale_to(amax, 448.0)

    @triton.jit
    def _gather_sum_rows(out_ptr, src_ptr, idx_ptr, rank_ptr, ptrs_ptr, w_ptr, dst_ptr, T, D, K: tl.constexpr,
                         HAS_W: tl.constexpr, PEERS: tl.constexpr, ACCUMULATE: tl.constexpr, DST: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        """out[t] = Σ_k w[t, k] · src[idx[t, k]] over BLOCK_T whole rows per iteration of a persistent
        grid; PEERS: slot (t, k) reads the buffer at address ptrs[rank[t, k]] (src_ptr only gives
        the dtype); ACCUMULATE: out[t] += the sum, and rows with no slot (every idx -1) are not touched;
        DST: row dst[t] of out instead of row t (distinct rows)."""
        ty = src_ptr.dtype.element_ty
        cols = tl.arange(0, BLOCK_D)[None, :]
        in_row = cols < D
        for b in range(tl.program_id(0).to(tl.int64), tl.cdiv(T, BLOCK_T), tl.num_programs(0).to(tl.int64)):
            t_T = b * BLOCK_T + tl.arange(0, BLOCK_T)
            ok_T = t_T < T
            if ACCUMULATE:
                hit_T = t_T < 0
                for k in tl.static_range(K):
                    hit_T = hit_T | (tl.load(idx_ptr + t_T * K + k, mask=ok_T, other=-1) >= 0)
                ok_T = ok_T & hit_T
            o_T = t_T
            if DST:  # masked by the range alone: Triton 3.6 fails to compile this load masked by ok_T (hit rows)
                o_T = tl.load(dst_ptr + t_T, mask=t_T < T, other=0).to(tl.int64)
            if ACCUMULATE:
                acc = tl.load(out_ptr + o_T[:, None] * D + cols, mask=ok_T[:, None] & in_row, other=0.0).to(tl.float32)
            else:
                acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
            for k in tl.static_range(K):
                row_T = tl.load(idx_ptr + t_T * K + k, mask=ok_T, other=-1).to(tl.int64)  # -1: slot not sent
                if PEERS:
                    base_T = tl.load(ptrs_ptr + tl.load(rank_ptr + t_T * K + k, mask=ok_T, other=0)).to(
                        tl.pointer_type(ty))
                    at = base_T[:, None] + row_T[:, None] * D + cols
                else:
                    at = src_ptr + row_T[:, None] * D + cols
                v = tl.load(at, mask=(row_T >= 0)[:, None] & in_row, other=0.0).to(tl.float32)
                if HAS_W:
                    v = v * tl.load(w_ptr + t_T * K + k, mask=ok_T, other=0.0).to(tl.float32)[:, None]
                acc += v
            tl.store(out_ptr + o_T[:, None] * D + cols, acc.to(out_ptr.dtype.element_ty), mask=ok_T[:, None] & in_row)

    # two kernels over one body, so a profile tells the local sums from the reads of peer memory (NVLink)
    @triton.jit
    def _gather_sum_kernel(out_ptr, src_ptr, idx_ptr, w_ptr, dst_ptr, T, D, K: tl.constexpr, HAS_W: tl.constexpr,
                           ACCUMULATE: tl.constexpr, DST: tl.constexpr, BLOCK_T: tl.constexpr,
                           BLOCK_D: tl.constexpr):
        _gather_sum_rows(out_ptr, src_ptr, idx_ptr, idx_ptr, idx_ptr, w_ptr, dst_ptr, T, D, K, HAS_W, False,
                         ACCUMULATE, DST, BLOCK_T, BLOCK_D)

    @triton.jit
    def _peer_gather_sum_kernel(out_ptr, src_ptr, idx_ptr, rank_ptr, ptrs_ptr, w_ptr, dst_ptr, T, D,
                                K: tl.constexpr, HAS_W: tl.constexpr, ACCUMULATE: tl.constexpr, DST: tl.constexpr,
                                BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        _gather_sum_rows(out_ptr, src_ptr, idx_ptr, rank_ptr, ptrs_ptr, w_ptr, dst_ptr, T, D, K, HAS_W, True,
                         ACCUMULATE, DST, BLOCK_T, BLOCK_D)

    @triton.jit
    def _combine_g(g_ptr, gs_ptr, t, offs, mask, g_stride, gs_stride, SCALE_BLOCK: tl.constexpr):
        g = tl.load(g_ptr + t * g_stride + offs, mask=mask, other=0.0).to(tl.float32)
        if SCALE_BLOCK > 0:
            g *= tl.load(gs_ptr + t * gs_stride + offs // SCALE_BLOCK, mask=mask, other=1.0)
        return g

    @triton.jit
    def _combine_bwd_kernel(g_ptr, y_ptr, w_ptr, idx_ptr, gy_ptr, gw_ptr, gs_ptr, q_ptr, qs_ptr, D, g_stride,
                            gs_stride, K: tl.constexpr, SCALE_BLOCK: tl.constexpr, QUANT: tl.constexpr,
                            PLAIN: tl.constexpr, BLOCK_D: tl.constexpr):
        """SCALE_BLOCK > 0: g's rows are fp8, one scale per SCALE_BLOCK columns (gs [T, ceil(D / SCALE_BLOCK)]).
        QUANT: grad_y's rows also as FP8 (q, qs). A row's amax is that of g times |w|, rounded as grad_y is
        (rounding is monotonic), so the scale is known before the row is written: one pass. PLAIN False (with
        QUANT): grad_y's rows as FP8 only."""
        t = tl.program_id(0).to(tl.int64)
        g_max = 0.0
        if QUANT:
            g_abs = tl.zeros([BLOCK_D], dtype=tl.float32)
            for d0 in range(0, D, BLOCK_D):
                offs = d0 + tl.arange(0, BLOCK_D)
                g_abs = tl.maximum(g_abs, tl.abs(_combine_g(g_ptr, gs_ptr, t, offs, offs < D, g_stride, gs_stride,
                                                            SCALE_BLOCK)))
            g_max = tl.max(g_abs, axis=0)
        for k in tl.static_range(K):
            row = tl.load(idx_ptr + t * K + k).to(tl.int64)
            present = (tl.zeros([BLOCK_D], dtype=tl.int64) + row) >= 0  # row -1: slot not sent
            w = tl.load(w_ptr + t * K + k).to(tl.float32)
            s = 1.0
            if QUANT:
                s = _pow2_scale((tl.abs(w) * g_max).to(gy_ptr.dtype.element_ty).to(tl.float32))
            r = 1.0 / s  # exact (s a power of two): · r equals / s, a multiply an element
            dot = tl.zeros([BLOCK_D], dtype=tl.float32)
            for d0 in range(0, D, BLOCK_D):
                offs = d0 + tl.arange(0, BLOCK_D)
                mask = (offs < D) & present
                g = _combine_g(g_ptr, gs_ptr, t, offs, mask, g_stride, gs_stride, SCALE_BLOCK)
                y = tl.load(y_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
                dot += g * y
                gy = (w * g).to(gy_ptr.dtype.element_ty)
                if PLAIN:
                    tl.store(gy_ptr + row * D + offs, gy, mask=mask)
                if QUANT:
                    q = tl.clamp(gy.to(tl.float32) * r, -448.0, 448.0)
                    tl.store(q_ptr + row * D + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
            if QUANT:
                tl.store(qs_ptr + row, s, mask=row >= 0)
            tl.store(gw_ptr + t * K + k, tl.sum(dot, axis=0).to(gw_ptr.dtype.element_ty))


def _use_triton(*ts) -> bool:
    if triton is None or ts[0].dtype == torch.float64:
        return False
    # TRITON_INTERPRET=1 runs the kernels on CPU tensors (tests check them that way without a GPU)
    return all(t.is_cuda for t in ts) or os.environ.get("TRITON_INTERPRET") == "1"


TOKENS_PER_BLOCK = 1  # rows a CTA moves per loop iteration (power of 2); benchmarks/row_kernels.py sweeps it


def row_launch(T: int, D: int, programs: int | None, block_t: int | None, num_warps: int | None = None):
    """Grid and meta-parameters of the row kernels: ``programs`` persistent CTAs (None: one per
    block of rows), ``block_t`` whole rows (BLOCK_D >= D) per iteration."""
    block_t = block_t or TOKENS_PER_BLOCK
    block_d = triton.next_power_of_2(D)
    blocks = -(-T // block_t)
    grid = (max(1, blocks if programs is None else min(blocks, programs)),)
    warps = num_warps or max(4, min(16, block_t * block_d // 512))
    return grid, dict(BLOCK_T=block_t, BLOCK_D=block_d, num_warps=warps)


def launch_gather_sum(out_TD, src, idx_TK, w_TK=None, rank_TK=None, ptrs_R=None, programs=None, block_t=None,
                      num_warps=None, accumulate: bool = False, out_rows_T=None):
    """The kernel behind ``gather_sum`` and ``kernels.peer_rows.peer_gather_sum``: ``src`` is the
    rows (local) or, with ``rank_TK`` and ``ptrs_R``, a tensor of the peer buffers' dtype; ``accumulate``:
    add into ``out_TD`` (contiguous), leaving rows with no slot as they are; ``out_rows_T`` (distinct
    rows, with ``accumulate``): route t adds into row out_rows_T[t] of ``out_TD`` instead of row t."""
    T, K = idx_TK.shape
    if T == 0:
        return out_TD
    assert out_rows_T is None or accumulate, "out_rows_T: only for sums added into existing rows"
    grid, meta = row_launch(T, out_TD.shape[1], programs, block_t, num_warps)
    idx_TK = idx_TK.contiguous()
    w = w_TK.contiguous() if w_TK is not None else idx_TK  # dummy pointer without weights
    dst = out_rows_T.contiguous() if out_rows_T is not None else idx_TK  # dummy pointer without rows
    flags = dict(K=K, HAS_W=w_TK is not None, ACCUMULATE=accumulate, DST=out_rows_T is not None, **meta)
    if rank_TK is not None:
        _peer_gather_sum_kernel[grid](out_TD, src, idx_TK, rank_TK.contiguous(), ptrs_R, w, dst, T, out_TD.shape[1],
                                      **flags)
    else:
        _gather_sum_kernel[grid](out_TD, src, idx_TK, w, dst, T, out_TD.shape[1], **flags)
    return out_TD


def gather_sum(src_ND, idx_TK, w_TK=None, out=None, programs: int | None = None, block_t: int | None = None):
    """``out`` (optional, contiguous [T, D]): written in place (e.g. a peer-visible buffer)."""
    if not _use_triton(src_ND):
        res = gather_sum_torch(src_ND, idx_TK, w_TK)
        return res if out is None else out.copy_(res)
    T = idx_TK.shape[0]
    src_ND = src_ND.contiguous()
    out_TD = torch.empty(T, src_ND.shape[1], dtype=src_ND.dtype, device=src_ND.device) if out is None else out
    return launch_gather_sum(out_TD, src_ND, idx_TK, w_TK, programs=programs, block_t=block_t)


def combine_backward(g_TD, y_ND, w_TK, idx_TK, allow_missing: bool = True, grad_y_out=None, g_scales=None,
                     scale_block: int = 0, fp8_out=None, plain: bool = True):
    """``allow_missing=False`` promises idx is a permutation of all N = T·K rows (skips zero-fill);
    ``grad_y_out`` ([N, D], contiguous) receives the rows some (t, k) maps to and keeps the others;
    ``g_scales`` (fp32 [T, ceil(D / scale_block)], unit column stride): g is fp8 (unit column stride, any row
    stride) standing for g[t, c] · g_scales[t, c // scale_block]; ``fp8_out`` (q [N, D] e4m3 and s [N] fp32,
    contiguous; on the Triton path only): receives the rows some (t, k) maps to as FP8 rows (module docstring);
    ``plain`` False (with ``fp8_out`` and ``grad_y_out``): only there, ``grad_y_out`` left as it is."""
    if not plain and (fp8_out is None or grad_y_out is None):
        raise ValueError("combine_backward: plain=False writes the FP8 rows alone: it needs fp8_out and grad_y_out")
    if g_scales is not None and not _use_triton(y_ND):
        s_TD = g_scales.to(y_ND.dtype).repeat_interleave(scale_block, 1)[:, :g_TD.shape[1]]
        g_TD = g_TD.to(y_ND.dtype).mul_(s_TD)  # exact: the scales are powers of two
        g_scales = None
    if not _use_triton(g_TD, y_ND):
        if fp8_out is not None:
            raise ValueError("combine_backward: fp8_out needs the Triton kernel (CUDA tensors)")
        grad_y_ND, grad_w_TK = combine_backward_torch(g_TD, y_ND, w_TK, idx_TK)
        if grad_y_out is None:
            return grad_y_ND, grad_w_TK
        # mask-free (no host sync on CUDA): mark the rows some slot maps to, keep the others
        N = grad_y_out.shape[0]
        flat = idx_TK.reshape(-1).long()
        hit_N = torch.zeros(N + 1, dtype=grad_y_out.dtype, device=grad_y_out.device)
        hit_N.index_fill_(0, torch.where(flat >= 0, flat, N), 1)
        grad_y_out.copy_(torch.where(hit_N[:N, None] > 0, grad_y_ND, grad_y_out))
        return grad_y_out, grad_w_TK
    T, K = idx_TK.shape
    N, D = y_ND.shape
    y_ND, w_TK, idx_TK = (t.contiguous() for t in (y_ND, w_TK, idx_TK))
    if g_scales is None:
        g_TD = g_TD.contiguous()
    assert D < 2 or g_TD.stride(1) == 1
    assert g_scales is None or (scale_block > 0 and (g_scales.shape[1] < 2 or g_scales.stride(1) == 1))
    # every row is written when the rows are exactly the T*K slots (local dispatch: idx is a
    # permutation); otherwise zero-fill the rows no slot maps to
    if grad_y_out is not None:
        grad_y_ND = grad_y_out
    elif N == T * K and not allow_missing:
        grad_y_ND = torch.empty_like(y_ND)
    else:
        grad_y_ND = torch.zeros_like(y_ND)
    grad_w_TK = torch.empty(T, K, dtype=w_TK.dtype, device=w_TK.device)
    if T == 0:
        return grad_y_ND, grad_w_TK
    BLOCK_D = min(1024, triton.next_power_of_2(D))
    gs = g_scales if g_scales is not None else w_TK  # dummy pointer without scales
    if fp8_out is not None:
        assert fp8_out[0].shape == y_ND.shape and fp8_out[0].is_contiguous() and fp8_out[1].is_contiguous()
    q, qs = fp8_out if fp8_out is not None else (w_TK, w_TK)  # dummy pointers without FP8 rows
    _combine_bwd_kernel[(T,)](g_TD, y_ND, w_TK, idx_TK, grad_y_ND, grad_w_TK, gs, q, qs, D, g_TD.stride(0),
                              gs.stride(0), K=K, SCALE_BLOCK=scale_block if g_scales is not None else 0,
                              QUANT=fp8_out is not None, PLAIN=plain, BLOCK_D=BLOCK_D, num_warps=4)
    return grad_y_ND, grad_w_TK
