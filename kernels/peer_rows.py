"""Row copies to and from peer GPUs' memory (the NVLink dispatcher's kernels).

Every rank of an expert-parallel group holds a buffer of the same shape in symmetric memory; the
kernels address a peer's buffer through a table of base pointers ``ptrs_R`` (int64 addresses, one
per rank, readable on the device) and a (rank, row) pair per (token, choice) slot:

    peer_scatter(x_TD, rank_TK, row_TK, ptrs_R, scale_TK=None)
        peer[rank[t, k]][row[t, k]] = x[t] (· scale[t, k])       row = -1: slot not sent
    peer_gather_sum(rank_TK, row_TK, ptrs_R, peers, w_TK=None, out_dtype=None) -> out_TD
        out[t] = Σ_k w[t, k] · peer[rank[t, k]][row[t, k]]   (fp32 accumulate; -1 adds nothing)
    peer_combine_backward(g_TD, rank_TK, row_TK, y_ptrs_R, y_peers, gy_ptrs_R, gy_peers, w_TK) -> grad_w_TK
        peer_gy[rank][row] = w[t, k] · g[t];  grad_w[t, k] = <g[t], peer_y[rank][row]>  (fp32)

The kernels run a persistent grid of ``programs`` CTAs (the SMs the transfer may occupy); each CTA
walks tokens t = pid, pid + programs, ... and moves whole rows (BLOCK_D >= D), issuing the K row
transfers of a token back to back. Nothing is read on the host.

Without CUDA (CPU tests, fp64 references) the torch versions below do the same on the list of
peer tensors; TRITON_INTERPRET=1 runs the kernels themselves on CPU tensors.
"""

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs may lack triton
    triton = None


# --- torch references (CPU; the check for the kernels) -------------------------------------------

def peer_scatter_torch(x_TD, rank_TK, row_TK, peers, scale_TK=None):
    T, K = row_TK.shape
    vals_TKD = x_TD.unsqueeze(1).expand(T, K, -1)
    if scale_TK is not None:
        acc = torch.promote_types(x_TD.dtype, torch.float32)
        vals_TKD = (vals_TKD.to(acc) * scale_TK.to(acc).unsqueeze(-1)).to(x_TD.dtype)
    vals_ND, rank_N, row_N = vals_TKD.reshape(T * K, -1), rank_TK.reshape(-1), row_TK.reshape(-1)
    for r, buf in enumerate(peers):
        sel = (rank_N == r) & (row_N >= 0)
        buf.index_copy_(0, row_N[sel], vals_ND[sel].to(buf.dtype))


def _stacked(rank_TK, row_TK, peers):
    """All peers' rows as one matrix and each slot's row in it (-1 stays -1)."""
    n = peers[0].shape[0]
    return torch.cat(list(peers)), torch.where(row_TK >= 0, rank_TK.long() * n + row_TK, -1)


def peer_gather_sum_torch(rank_TK, row_TK, peers, w_TK=None):
    from kernels.moe_rows import gather_sum_torch

    src, idx = _stacked(rank_TK, row_TK, peers)
    return gather_sum_torch(src, idx, w_TK)


def peer_combine_backward_torch(g_TD, rank_TK, row_TK, y_peers, gy_peers, w_TK):
    y, idx = _stacked(rank_TK, row_TK, y_peers)
    acc = torch.promote_types(y.dtype, torch.float32)
    rows = y.index_select(0, idx.clamp(min=0).reshape(-1)).view(*idx.shape, -1).to(acc)
    grad_w_TK = (rows * g_TD.to(acc).unsqueeze(1)).sum(-1) * (idx >= 0)
    peer_scatter_torch(g_TD, rank_TK, row_TK, gy_peers, w_TK)
    return grad_w_TK.to(w_TK.dtype)


# --- Triton kernels ------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _peer_scatter_kernel(x_ptr, rank_ptr, row_ptr, ptrs_ptr, buf_like, scale_ptr, T, D, K: tl.constexpr,
                             HAS_SCALE: tl.constexpr, BLOCK_D: tl.constexpr):
        cols = tl.arange(0, BLOCK_D)
        in_row = cols < D
        for t64 in range(tl.program_id(0).to(tl.int64), T, tl.num_programs(0).to(tl.int64)):
            x = tl.load(x_ptr + t64 * D + cols, mask=in_row)
            for k in tl.static_range(K):
                row = tl.load(row_ptr + t64 * K + k).to(tl.int64)
                dst = tl.load(ptrs_ptr + tl.load(rank_ptr + t64 * K + k)).to(tl.pointer_type(buf_like.dtype.element_ty))
                v = x
                if HAS_SCALE:
                    v = x.to(tl.float32) * tl.load(scale_ptr + t64 * K + k).to(tl.float32)
                tl.store(dst + row * D + cols, v.to(buf_like.dtype.element_ty), mask=in_row & ((cols * 0 + row) >= 0))

    @triton.jit
    def _peer_gather_sum_kernel(out_ptr, rank_ptr, row_ptr, ptrs_ptr, buf_like, w_ptr, T, D, K: tl.constexpr,
                                HAS_W: tl.constexpr, BLOCK_D: tl.constexpr):
        cols = tl.arange(0, BLOCK_D)
        in_row = cols < D
        for t64 in range(tl.program_id(0).to(tl.int64), T, tl.num_programs(0).to(tl.int64)):
            acc = tl.zeros([BLOCK_D], dtype=tl.float32)
            for k in tl.static_range(K):
                row = tl.load(row_ptr + t64 * K + k).to(tl.int64)
                src = tl.load(ptrs_ptr + tl.load(rank_ptr + t64 * K + k)).to(tl.pointer_type(buf_like.dtype.element_ty))
                v = tl.load(src + row * D + cols, mask=in_row & ((cols * 0 + row) >= 0), other=0.0).to(tl.float32)
                if HAS_W:
                    v = v * tl.load(w_ptr + t64 * K + k).to(tl.float32)
                acc += v
            tl.store(out_ptr + t64 * D + cols, acc.to(out_ptr.dtype.element_ty), mask=in_row)

    @triton.jit
    def _peer_combine_bwd_kernel(g_ptr, rank_ptr, row_ptr, y_ptrs, gy_ptrs, buf_like, w_ptr, gw_ptr, T, D,
                                 K: tl.constexpr, BLOCK_D: tl.constexpr):
        cols = tl.arange(0, BLOCK_D)
        in_row = cols < D
        for t64 in range(tl.program_id(0).to(tl.int64), T, tl.num_programs(0).to(tl.int64)):
            g = tl.load(g_ptr + t64 * D + cols, mask=in_row, other=0.0).to(tl.float32)
            for k in tl.static_range(K):
                row = tl.load(row_ptr + t64 * K + k).to(tl.int64)
                r = tl.load(rank_ptr + t64 * K + k)
                m = in_row & ((cols * 0 + row) >= 0)
                y_src = tl.load(y_ptrs + r).to(tl.pointer_type(buf_like.dtype.element_ty))
                y = tl.load(y_src + row * D + cols, mask=m, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + t64 * K + k).to(tl.float32)
                gy_dst = tl.load(gy_ptrs + r).to(tl.pointer_type(buf_like.dtype.element_ty))
                tl.store(gy_dst + row * D + cols, (w * g).to(buf_like.dtype.element_ty), mask=m)
                tl.store(gw_ptr + t64 * K + k, tl.sum(g * y, axis=0).to(gw_ptr.dtype.element_ty))


def use_triton(t: torch.Tensor) -> bool:
    if triton is None or t.dtype == torch.float64:
        return False
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _launch_args(T: int, D: int, programs: int):
    block_d = triton.next_power_of_2(D)
    return (max(1, min(T, programs)),), block_d, max(4, min(16, block_d // 512))


def peer_scatter(x_TD, rank_TK, row_TK, ptrs_R, peers, scale_TK=None, programs: int = 32):
    """``peers`` (list of tensors) is used by the torch path, ``ptrs_R`` by the kernel."""
    if not use_triton(x_TD):
        return peer_scatter_torch(x_TD, rank_TK, row_TK, peers, scale_TK)
    T, K = row_TK.shape
    if T == 0:
        return
    D = x_TD.shape[1]
    grid, block_d, warps = _launch_args(T, D, programs)
    scale = scale_TK.contiguous() if scale_TK is not None else row_TK  # dummy pointer without scale
    _peer_scatter_kernel[grid](x_TD.contiguous(), rank_TK.contiguous(), row_TK.contiguous(), ptrs_R, peers[0], scale, T, D,
                               K=K, HAS_SCALE=scale_TK is not None, BLOCK_D=block_d, num_warps=warps)


def peer_gather_sum(rank_TK, row_TK, ptrs_R, peers, w_TK=None, out_dtype=None, programs: int = 32):
    if not use_triton(peers[0]):
        return peer_gather_sum_torch(rank_TK, row_TK, peers, w_TK).to(out_dtype or peers[0].dtype)
    T, K = row_TK.shape
    D = peers[0].shape[1]
    out_TD = torch.empty(T, D, dtype=out_dtype or peers[0].dtype, device=rank_TK.device)
    if T == 0:
        return out_TD
    grid, block_d, warps = _launch_args(T, D, programs)
    w = w_TK.contiguous() if w_TK is not None else row_TK
    _peer_gather_sum_kernel[grid](out_TD, rank_TK.contiguous(), row_TK.contiguous(), ptrs_R, peers[0], w, T, D, K=K,
                                  HAS_W=w_TK is not None, BLOCK_D=block_d, num_warps=warps)
    return out_TD


def peer_combine_backward(g_TD, rank_TK, row_TK, y_ptrs_R, y_peers, gy_ptrs_R, gy_peers, w_TK, programs: int = 32):
    if not use_triton(g_TD):
        return peer_combine_backward_torch(g_TD, rank_TK, row_TK, y_peers, gy_peers, w_TK)
    T, K = row_TK.shape
    grad_w_TK = torch.zeros(T, K, dtype=w_TK.dtype, device=w_TK.device)
    if T == 0:
        return grad_w_TK
    D = g_TD.shape[1]
    grid, block_d, warps = _launch_args(T, D, programs)
    _peer_combine_bwd_kernel[grid](g_TD.contiguous(), rank_TK.contiguous(), row_TK.contiguous(), y_ptrs_R, gy_ptrs_R,
                                   gy_peers[0], w_TK.contiguous(), grad_w_TK, T, D, K=K, BLOCK_D=block_d, num_warps=warps)
    return grad_w_TK
