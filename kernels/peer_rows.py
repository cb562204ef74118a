"""Row copies to and from peer GPUs' memory (the NVLink dispatcher's kernels).

Every rank of an expert-parallel group holds a buffer of the same shape in symmetric memory; the
kernels address a peer's buffer through a table of base pointers ``ptrs_R`` (int64 addresses, one
per rank, readable on the device) and a (rank, row) pair per (token, choice) slot:

    peer_scatter(x_TD, rank_TK, row_TK, ptrs_R, scale_TK=None, src_T=None, x_scales=None, scale_block=0)
        peer[rank[t, k]][row[t, k]] = x[src[t]] (· scale[t, k])  row = -1: slot not sent
                                                                   rank_TK None: every slot to peer 0
                                                                   src_T None: src[t] = t
                                                                   x_scales: x is fp8, one scale per
                                                                   scale_block columns
        fp8_out (local scatter): each row also as an FP8 row, (q, s) = kernels.fp8.quant_rows of the row as
        written, bit for bit (what FP8 experts read)
    peer_gather_sum(rank_TK, row_TK, ptrs_R, peers, w_TK=None, out_dtype=None, add_into=None, out_rows_T=None)
        out[t] = Σ_k w[t, k] · peer[rank[t, k]][row[t, k]]   (fp32 accumulate; -1 adds nothing)
                                                              add_into: out[t] += that, in place
                                                              out_rows_T: into row out_rows_T[t] instead
    peer_route_meta(ids_TK, rank_in_id_TK, base_X, e, capacity, w_TK, meta_row, meta_w, src)
            -> (rank_TK, row_TK, row_TR)
        rank = ids // e;  row = base[ids] + rank_in_id, -1 where >= capacity (kernels.route_layout);
        on every rank r, at row src·T + t:  meta_row = row[t, k] where rank[t, k] = r else -1,
        meta_w = w[t];  row_TR[t, r] = src·T + t where any choice of t went to r (row >= 0) else -1

The kernels run a persistent grid of ``programs`` CTAs (the SMs the transfer may occupy); each CTA
walks blocks of ``block_t`` tokens (default ``peer_block_t(D)``; 1 for a local scatter) and moves
whole rows (BLOCK_D >= D), issuing the K row transfers of its tokens back to back. Nothing is read
on the host. ``peer_gather_sum`` is ``kernels.moe_rows``' gather-sum kernel reading through the table.

Without CUDA (CPU tests, fp64 references) the torch versions below do the same on the list of
peer tensors; TRITON_INTERPRET=1 runs the kernels themselves on CPU tensors.
"""

import os

import torch

from kernels.fp8 import FP8, dequant_blocks, quant_rows_torch
from kernels.moe_rows import gather_sum_torch, launch_gather_sum, row_launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs may lack triton
    triton = None


# --- torch references (CPU; the check for the kernels) -------------------------------------------

def peer_scatter_torch(x_TD, rank_TK, row_TK, peers, scale_TK=None):
    T, K = row_TK.shape
    if rank_TK is None:
        rank_TK = torch.zeros_like(row_TK)
    vals_TKD = x_TD.unsqueeze(1).expand(T, K, -1)
    if scale_TK is not None:
        acc = torch.promote_types(x_TD.dtype, torch.float32)
        vals_TKD = (vals_TKD.to(acc) * scale_TK.to(acc).unsqueeze(-1)).to(x_TD.dtype)
    vals_ND, rank_N, row_N = vals_TKD.reshape(T * K, -1), rank_TK.reshape(-1), row_TK.reshape(-1)
    for r, buf in enumerate(peers):
        sel = (rank_N == r) & (row_N >= 0)
        buf.index_copy_(0, row_N[sel].long(), vals_ND[sel].to(buf.dtype))


def _stacked(rank_TK, row_TK, peers):
    """All peers' rows as one matrix and each slot's row in it (-1 stays -1)."""
    n = peers[0].shape[0]
    return torch.cat(list(peers)), torch.where(row_TK >= 0, rank_TK.long() * n + row_TK, -1)


def peer_gather_sum_torch(rank_TK, row_TK, peers, w_TK=None):
    src, idx = _stacked(rank_TK, row_TK, peers)
    return gather_sum_torch(src, idx, w_TK)


def peer_route_meta_torch(ids_TK, rank_in_id_TK, base_X, e: int, capacity: int, w_TK, meta_row, meta_w, src: int):
    T = ids_TK.shape[0]
    rank_TK = ids_TK // e
    row_TK = base_X[ids_TK] + rank_in_id_TK
    row_TK = torch.where(row_TK < capacity, row_TK, -1)
    at_T = src * T + torch.arange(T, device=row_TK.device)
    row_TR = torch.full((T, len(meta_row.peers)), -1, dtype=torch.long, device=row_TK.device)
    for r, (rows, ws) in enumerate(zip(meta_row.peers, meta_w.peers)):
        mine_TK = rank_TK == r
        rows.index_copy_(0, at_T, torch.where(mine_TK, row_TK, -1).to(rows.dtype))
        ws.index_copy_(0, at_T, w_TK.to(ws.dtype))
        row_TR[:, r] = torch.where((mine_TK & (row_TK >= 0)).any(1), at_T, -1)
    return rank_TK, row_TK, row_TR


# --- Triton kernels ------------------------------------------------------------------------------

if triton is not None:

    from kernels.moe_rows import _pow2_scale

    @triton.jit
    def _scatter_rows(x_ptr, src_ptr, rank_ptr, row_ptr, ptrs_ptr, buf_like, scale_ptr, rs_ptr, q_ptr, qs_ptr, T, D,
                      x_stride, rs_stride, K: tl.constexpr, HAS_SRC: tl.constexpr, HAS_SCALE: tl.constexpr,
                      SCALE_BLOCK: tl.constexpr, ONE_DEST: tl.constexpr, QUANT: tl.constexpr, PLAIN: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        """QUANT (no HAS_SCALE: every copy of a token is the same row): each row written is also written to
        q / qs as quant_rows would quantise it (its amax over the values as written, a power-of-two scale).
        PLAIN False (with QUANT): only those FP8 rows are written, not the buffers' rows."""
        ty = buf_like.dtype.element_ty
        cols = tl.arange(0, BLOCK_D)[None, :]
        in_row = cols < D
        for b in range(tl.program_id(0).to(tl.int64), tl.cdiv(T, BLOCK_T), tl.num_programs(0).to(tl.int64)):
            t_T = b * BLOCK_T + tl.arange(0, BLOCK_T)
            ok_T = t_T < T
            read_T = ok_T
            if K == 1:  # a row sent nowhere is not read
                read_T = ok_T & (tl.load(row_ptr + t_T, mask=ok_T, other=-1) >= 0)
            src_T = t_T
            if HAS_SRC:
                src_T = tl.load(src_ptr + t_T, mask=ok_T, other=0).to(tl.int64)
            x = tl.load(x_ptr + src_T[:, None] * x_stride + cols, mask=read_T[:, None] & in_row)
            if SCALE_BLOCK > 0:  # fp8 rows, one scale per SCALE_BLOCK columns
                x = x.to(tl.float32) * tl.load(rs_ptr + src_T[:, None] * rs_stride + cols // SCALE_BLOCK,
                                               mask=read_T[:, None] & in_row, other=1.0)
            if QUANT:
                xw = tl.where(in_row, x.to(ty).to(tl.float32), 0.0)  # the values as written
                qs_T = _pow2_scale(tl.max(tl.abs(xw), axis=1))
                # · 1/s, not / s: exact (a power of two) and one multiply an element
                q = tl.clamp(xw * (1.0 / qs_T)[:, None], -448.0, 448.0).to(q_ptr.dtype.element_ty)
            for k in tl.static_range(K):
                row_T = tl.load(row_ptr + t_T * K + k, mask=ok_T, other=-1).to(tl.int64)
                if ONE_DEST:
                    dst_T = tl.load(ptrs_ptr + tl.zeros_like(t_T)).to(tl.pointer_type(ty))
                else:
                    dst_T = tl.load(ptrs_ptr + tl.load(rank_ptr + t_T * K + k, mask=ok_T, other=0)).to(
                        tl.pointer_type(ty))
                v = x
                if HAS_SCALE:
                    s_T = tl.load(scale_ptr + t_T * K + k, mask=ok_T, other=0.0).to(tl.float32)
                    v = x.to(tl.float32) * s_T[:, None]
                if PLAIN:
                    tl.store(dst_T[:, None] + row_T[:, None] * D + cols, v.to(ty),
                             mask=(row_T >= 0)[:, None] & in_row)
                if QUANT:
                    tl.store(q_ptr + row_T[:, None] * D + cols, q, mask=(row_T >= 0)[:, None] & in_row)
                    tl.store(qs_ptr + row_T, qs_T, mask=row_T >= 0)

    # two kernels over one body, so a profile tells the writes into peers (NVLink) from the scatter into one buffer
    # (the owner's expansion of its received tokens into expert rows, in its own memory)
    @triton.jit
    def _peer_scatter_kernel(x_ptr, src_ptr, rank_ptr, row_ptr, ptrs_ptr, buf_like, scale_ptr, rs_ptr, T, D, x_stride,
                             rs_stride, K: tl.constexpr, HAS_SRC: tl.constexpr, HAS_SCALE: tl.constexpr,
                             SCALE_BLOCK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        _scatter_rows(x_ptr, src_ptr, rank_ptr, row_ptr, ptrs_ptr, buf_like, scale_ptr, rs_ptr, scale_ptr, scale_ptr,
                      T, D, x_stride, rs_stride, K, HAS_SRC, HAS_SCALE, SCALE_BLOCK, False, False, True, BLOCK_T,
                      BLOCK_D)

    @triton.jit
    def _scatter_rows_kernel(x_ptr, src_ptr, row_ptr, ptrs_ptr, buf_like, scale_ptr, rs_ptr, q_ptr, qs_ptr, T, D,
                             x_stride, rs_stride, K: tl.constexpr, HAS_SRC: tl.constexpr, HAS_SCALE: tl.constexpr,
                             SCALE_BLOCK: tl.constexpr, QUANT: tl.constexpr, PLAIN: tl.constexpr,
                             BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        _scatter_rows(x_ptr, src_ptr, row_ptr, row_ptr, ptrs_ptr, buf_like, scale_ptr, rs_ptr, q_ptr, qs_ptr, T, D,
                      x_stride, rs_stride, K, HAS_SRC, HAS_SCALE, SCALE_BLOCK, True, QUANT, PLAIN, BLOCK_T, BLOCK_D)


    @triton.jit
    def _peer_route_meta_kernel(ids_ptr, rid_ptr, base_ptr, rank_ptr, row_ptr, w_ptr, meta_row_ptrs, meta_w_ptrs,
                                row_like, w_like, route_ptr, T, src, E_LOCAL, cap, R: tl.constexpr, K: tl.constexpr,
                                KP: tl.constexpr, BLOCK_T: tl.constexpr):
        row_ty = row_like.dtype.element_ty
        w_ty = w_like.dtype.element_ty
        ks = tl.arange(0, KP)[None, :]
        in_k = ks < K
        for b in range(tl.program_id(0).to(tl.int64), tl.cdiv(T, BLOCK_T), tl.num_programs(0).to(tl.int64)):
            t_T = b * BLOCK_T + tl.arange(0, BLOCK_T)
            ok_T = t_T < T
            ok = ok_T[:, None] & in_k
            ids = tl.load(ids_ptr + t_T[:, None] * K + ks, mask=ok, other=0)
            row = tl.load(base_ptr + ids, mask=ok, other=0) + tl.load(rid_ptr + t_T[:, None] * K + ks, mask=ok, other=0)
            row = tl.where(row < cap, row, -1)
            rank = tl.where(ok, ids // E_LOCAL, -1)
            tl.store(rank_ptr + t_T[:, None] * K + ks, rank, mask=ok)
            tl.store(row_ptr + t_T[:, None] * K + ks, row, mask=ok)
            w = tl.load(w_ptr + t_T[:, None] * K + ks, mask=ok, other=0.0)
            at_T = src * T + t_T
            for r in tl.static_range(R):
                mine = rank == r
                rows_r = tl.load(meta_row_ptrs + r).to(tl.pointer_type(row_ty))
                tl.store(rows_r + at_T[:, None] * K + ks, tl.where(mine, row, -1).to(row_ty), mask=ok)
                ws_r = tl.load(meta_w_ptrs + r).to(tl.pointer_type(w_ty))
                tl.store(ws_r + at_T[:, None] * K + ks, w.to(w_ty), mask=ok)
                sent_T = tl.max((mine & (row >= 0)).to(tl.int32), axis=1) > 0
                tl.store(route_ptr + t_T * R + r, tl.where(sent_T, at_T, -1), mask=ok_T)


def use_triton(t: torch.Tensor) -> bool:
    if triton is None or t.dtype == torch.float64:
        return False
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def peer_block_t(D: int) -> int:
    """Rows a CTA of a peer kernel moves per iteration: ~16 KB of bf16 in flight (4 rows of 2048,
    1 of 7168). A remote row costs a round trip over NVLink: at one row per iteration a 64-CTA pull
    of 16384 rows of 2048 ran 3x slower on H100 (benchmarks/row_kernels.py)."""
    return max(1, 8192 // triton.next_power_of_2(D))


def peer_scatter(x_TD, rank_TK, row_TK, ptrs_R, peers, scale_TK=None, programs: int = 32, block_t: int | None = None,
                 src_T=None, x_scales=None, scale_block: int = 0, fp8_out=None, plain: bool = True):
    """``peers`` (list of tensors) is used by the torch path, ``ptrs_R`` by the kernel; ``rank_TK``
    None writes every slot into ``peers[0]`` / ``ptrs_R[0]`` (a local scatter). ``src_T`` (int, [T]): slot row t
    sends row ``src_T[t]`` of ``x`` (x then has any number of rows), in place of a gathered copy of x.
    ``x_scales`` (fp32 [rows of x, ceil(D / scale_block)], unit column stride): x is fp8 (unit column stride, any
    row stride) standing for x[i, c] · x_scales[i, c // scale_block] (dequantised on the way, into the buffers'
    dtype). ``fp8_out`` (q [rows of the buffer, D] e4m3 and s [rows] fp32, contiguous; a local scatter without
    ``scale_TK``): every row written is also written there as ``kernels.fp8.quant_rows`` quantises it; other rows
    are left as they are. ``plain`` False (with ``fp8_out``, on the kernel path): the rows go to ``fp8_out`` only,
    ``peers[0]`` is left as it is."""
    if fp8_out is not None and (rank_TK is not None or scale_TK is not None):
        raise ValueError("peer_scatter: fp8_out is for a local scatter (rank_TK None) of unscaled rows")
    if not plain and (fp8_out is None or not (use_triton(x_TD) and use_triton(peers[0]))):
        raise ValueError("peer_scatter: plain=False writes the FP8 rows alone: it needs fp8_out and the kernel path")
    if not (use_triton(x_TD) and use_triton(peers[0])):
        if x_scales is not None:
            x_TD = dequant_blocks(x_TD, x_scales, scale_block,
                                  torch.empty(x_TD.shape, dtype=peers[0].dtype, device=x_TD.device))
        peer_scatter_torch(x_TD if src_T is None else x_TD.index_select(0, src_T), rank_TK, row_TK, peers, scale_TK)
        if fp8_out is not None:
            rows = row_TK[row_TK >= 0].long()
            q, s = quant_rows_torch(peers[0].index_select(0, rows))
            fp8_out[0].view(torch.uint8).index_copy_(0, rows, q.view(torch.uint8))
            fp8_out[1].index_copy_(0, rows, s)
        return
    T, K = row_TK.shape
    if T == 0:
        return
    D = x_TD.shape[1]
    grid, meta = row_launch(T, D, programs, block_t or (1 if rank_TK is None else peer_block_t(D)))
    scale = scale_TK.contiguous() if scale_TK is not None else row_TK  # dummy pointer without scale
    src = src_T.contiguous() if src_T is not None else row_TK  # dummy pointer: slot row t reads row t
    rs = x_scales if x_scales is not None else scale  # dummy pointer without fp8 rows
    flags = dict(K=K, HAS_SRC=src_T is not None, HAS_SCALE=scale_TK is not None,
                 SCALE_BLOCK=scale_block if x_scales is not None else 0, **meta)
    if x_scales is None:
        x_TD = x_TD.contiguous()
    assert D < 2 or x_TD.stride(1) == 1
    assert x_scales is None or (scale_block > 0 and (x_scales.shape[1] < 2 or x_scales.stride(1) == 1))
    row_TK = row_TK.contiguous()
    if rank_TK is not None:  # into the peers
        _peer_scatter_kernel[grid](x_TD, src, rank_TK.contiguous(), row_TK, ptrs_R, peers[0], scale, rs, T, D,
                                   x_TD.stride(0), rs.stride(0), **flags)
        return
    if fp8_out is not None:
        assert fp8_out[0].dtype == FP8 and fp8_out[0].shape == peers[0].shape and fp8_out[0].is_contiguous()
        assert fp8_out[1].shape == peers[0].shape[:1] and fp8_out[1].is_contiguous()
    q, qs = fp8_out if fp8_out is not None else (scale, scale)  # dummy pointers without FP8 rows
    _scatter_rows_kernel[grid](x_TD, src, row_TK, ptrs_R, peers[0], scale, rs, q, qs, T, D, x_TD.stride(0),
                               rs.stride(0), QUANT=fp8_out is not None, PLAIN=plain, **flags)


def peer_gather_sum(rank_TK, row_TK, ptrs_R, peers, w_TK=None, out_dtype=None, programs: int = 32,
                    block_t: int | None = None, add_into=None, out_rows_T=None):
    """``add_into`` ([T, D], contiguous): add the sums into it in place (rows with no slot untouched) and return it;
    with ``out_rows_T`` (distinct rows of ``add_into``, any count of them) sum t goes into row out_rows_T[t]."""
    if not use_triton(peers[0]):
        sums_TD = peer_gather_sum_torch(rank_TK, row_TK, peers, w_TK)
        if add_into is not None:
            acc = torch.promote_types(add_into.dtype, torch.float32)
            rows_T = out_rows_T if out_rows_T is not None else torch.arange(len(sums_TD), device=sums_TD.device)
            hit_T1 = (row_TK >= 0).any(1, keepdim=True)
            old_TD = add_into.index_select(0, rows_T)
            return add_into.index_copy_(0, rows_T, torch.where(hit_T1, (old_TD.to(acc) + sums_TD.to(acc)).to(
                add_into.dtype), old_TD))
        return sums_TD.to(out_dtype or peers[0].dtype)
    if add_into is not None:
        return launch_gather_sum(add_into, peers[0], row_TK, w_TK, rank_TK, ptrs_R, programs,
                                 block_t or peer_block_t(add_into.shape[1]), accumulate=True, out_rows_T=out_rows_T)
    out_TD = torch.empty(row_TK.shape[0], peers[0].shape[1], dtype=out_dtype or peers[0].dtype, device=rank_TK.device)
    return launch_gather_sum(out_TD, peers[0], row_TK, w_TK, rank_TK, ptrs_R, programs,
                             block_t or peer_block_t(out_TD.shape[1]))


def peer_route_meta(ids_TK, rank_in_id_TK, base_X, e: int, capacity: int, w_TK, meta_row, meta_w, src: int,
                    programs: int = 32):
    """One launch for where this rank's slots land and what every destination needs of its routing
    (``meta_row`` / ``meta_w``: symmetric [R·T, K] buffers). Returns (rank_TK, row_TK, row_TR), int64,
    local: each slot's destination rank and row there (-1: past capacity, not sent), and the row each
    token takes in rank r's token buffer (-1 where it goes nowhere on r)."""
    if not use_triton(meta_w.local):
        return peer_route_meta_torch(ids_TK, rank_in_id_TK, base_X, e, capacity, w_TK, meta_row, meta_w, src)
    T, K = ids_TK.shape
    R = len(meta_row.peers)
    dev = ids_TK.device
    rank_TK = torch.empty(T, K, dtype=torch.long, device=dev)
    row_TK = torch.empty(T, K, dtype=torch.long, device=dev)
    row_TR = torch.empty(T, R, dtype=torch.long, device=dev)
    if T == 0:
        return rank_TK, row_TK, row_TR
    block_t = 128
    grid = (max(1, min(-(-T // block_t), programs)),)
    _peer_route_meta_kernel[grid](ids_TK.contiguous(), rank_in_id_TK.contiguous(), base_X, rank_TK, row_TK,
                                  w_TK.contiguous(), meta_row.ptrs_R, meta_w.ptrs_R, meta_row.local, meta_w.local,
                                  row_TR, T, src, e, capacity, R=R, K=K, KP=triton.next_power_of_2(K),
                                  BLOCK_T=block_t, num_warps=4)
    return rank_TK, row_TK, row_TR
