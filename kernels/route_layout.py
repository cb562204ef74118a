"""Where each routed (token, choice) slot goes, in four small kernels instead of ~40 torch ops.

N = T·K slots of one rank, X ids (R ranks × e local ids), ids in [0, X):

    slot_ranks(ids_N, X) -> (rank_in_id_N int32, counts_X int64)
        rank_in_id[n] = #{m < n : ids[m] = ids[n]}   (slots of one id keep their order)
        counts[x]     = #{n : ids[n] = x}
    layout_tail(counts_RX, rank, e, capacity, TK) -> (base_X, counts_e, dropped, needed)
        from every rank's counts (row s = source s): slot n of this rank lands at row
        base[ids[n]] + rank_in_id[n] of its owner's expert-major buffer (owner = id // e), where
        base[x] = rows of the owner's lower ids from all sources + rows of id x from lower sources;
        counts_e = rows this rank receives per local id, capped at ``capacity``;
        dropped = this rank's slots at rows >= capacity; needed = fullest owner's rows / TK (fp32)

Exact integer results: the torch versions (CPU) and the Triton kernels (CUDA, or CPU tensors under
TRITON_INTERPRET=1) agree bit for bit. Nothing is read on the host; every shape is static.
"""

import torch

from .moe_rows import _use_triton, triton

if triton is not None:
    import triton.language as tl

SLOTS_PER_BLOCK = 128


def slot_ranks_torch(ids_N: torch.Tensor, X: int):
    order_N = torch.argsort(ids_N, stable=True)
    ids_N = ids_N.long()
    counts_X = torch.zeros(X, dtype=torch.int64, device=ids_N.device).scatter_add_(0, ids_N, torch.ones_like(ids_N))
    first_X = torch.cumsum(counts_X, 0) - counts_X
    pos_N = torch.empty_like(order_N).scatter_(0, order_N, torch.arange(ids_N.numel(), device=ids_N.device))
    return (pos_N - first_X[ids_N]).to(torch.int32), counts_X


def layout_tail_torch(counts_RX: torch.Tensor, rank: int, e: int, capacity: int, TK: int):
    R, X = counts_RX.shape
    total_Re = counts_RX.sum(0).view(R, e)
    start_X = (torch.cumsum(total_Re, 1) - total_Re).reshape(X)
    base_X = start_X + counts_RX[:rank].sum(0)
    mine_X = counts_RX[rank]
    dropped = torch.minimum((base_X + mine_X - capacity).clamp(min=0), mine_X).sum()
    cum_e = torch.cumsum(total_Re[rank], 0).clamp(max=capacity)
    counts_e = cum_e - torch.nn.functional.pad(cum_e[:-1], (1, 0))
    needed = total_Re.sum(1).max().float() / TK
    return base_X, counts_e, dropped, needed


if triton is not None:

    @triton.jit
    def _block_counts_kernel(ids_ptr, hist_ptr, N, X, BLOCK: tl.constexpr, XB: tl.constexpr):
        """hist[b, x] = slots of id x in block b (BLOCK slots)."""
        b = tl.program_id(0)
        n = b * BLOCK + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + n, mask=n < N, other=-1)
        for x0 in range(0, X, XB):
            xs = x0 + tl.arange(0, XB)
            c = tl.sum((ids[:, None] == xs[None, :]).to(tl.int32), axis=0)
            tl.store(hist_ptr + b * X + xs, c, mask=xs < X)

    @triton.jit
    def _block_prefix_kernel(hist_ptr, counts_ptr, NB, X, BB: tl.constexpr, XB: tl.constexpr):
        """In place, ids p·XB.. of program p: hist[b, x] becomes the slots of id x in blocks before b (an
        exclusive scan over blocks, BB blocks a step with a running carry); counts[x] = the total."""
        xs = tl.program_id(0) * XB + tl.arange(0, XB)
        okx = xs < X
        carry = tl.zeros([XB], dtype=tl.int32)
        for b0 in range(0, NB, BB):
            bs = b0 + tl.arange(0, BB)
            at = hist_ptr + bs[:, None] * X + xs[None, :]
            ok = (bs[:, None] < NB) & okx[None, :]
            h = tl.load(at, mask=ok, other=0)
            tl.store(at, tl.cumsum(h, axis=0) - h + carry[None, :], mask=ok)
            carry += tl.sum(h, axis=0)
        tl.store(counts_ptr + xs, carry.to(tl.int64), mask=okx)

    @triton.jit
    def _slot_rank_kernel(ids_ptr, prefix_ptr, rank_ptr, N, X, BLOCK: tl.constexpr):
        """Ranks of block b's slots: the id's slots in earlier blocks (prefix[b, id]) + earlier slots of the
        block with the id."""
        b = tl.program_id(0)
        i = tl.arange(0, BLOCK)
        n = b * BLOCK + i
        ok = n < N
        ids = tl.load(ids_ptr + n, mask=ok, other=-1)
        earlier = (ids[:, None] == ids[None, :]) & (i[None, :] < i[:, None])
        r = tl.sum(earlier.to(tl.int32), axis=1) + tl.load(prefix_ptr + b * X + ids, mask=ok, other=0)
        tl.store(rank_ptr + n, r, mask=ok)

    @triton.jit
    def _layout_tail_kernel(counts_ptr, scratch_ptr, base_ptr, counts_e_ptr, dropped_ptr, needed_ptr, rank, X, E_LOCAL,
                            cap, TK, R: tl.constexpr, RP: tl.constexpr, XP: tl.constexpr, EP: tl.constexpr):
        """One CTA. scratch [3, X]: the exclusive prefix of total over ids, start, total."""
        rs = tl.arange(0, RP)[:, None]
        xs = tl.arange(0, XP)
        okx = xs < X
        c = tl.load(counts_ptr + rs * X + xs[None, :], mask=(rs < R) & okx[None, :], other=0)
        total = tl.sum(c, axis=0)
        mine = tl.sum(tl.where(rs == rank, c, 0), axis=0)
        before = tl.sum(tl.where(rs < rank, c, 0), axis=0)
        excl = tl.cumsum(total, axis=0) - total
        tl.store(scratch_ptr + xs, excl, mask=okx)
        tl.debug_barrier()
        start = excl - tl.load(scratch_ptr + (xs // E_LOCAL) * E_LOCAL, mask=okx, other=0)  # within the owner
        base = start + before
        tl.store(base_ptr + xs, base, mask=okx)
        tl.store(scratch_ptr + X + xs, start, mask=okx)
        tl.store(scratch_ptr + 2 * X + xs, total, mask=okx)
        tl.store(dropped_ptr, tl.sum(tl.minimum(tl.maximum(base + mine - cap, 0), mine), axis=0))
        tl.store(needed_ptr, tl.max(tl.where(okx, start + total, 0), axis=0).to(tl.float32) / TK)
        tl.debug_barrier()
        js = rank * E_LOCAL + tl.arange(0, EP)
        okj = tl.arange(0, EP) < E_LOCAL
        s = tl.load(scratch_ptr + X + js, mask=okj, other=0)
        t = tl.load(scratch_ptr + 2 * X + js, mask=okj, other=0)
        tl.store(counts_e_ptr + tl.arange(0, EP), tl.minimum(s + t, cap) - tl.minimum(s, cap), mask=okj)


def slot_ranks(ids_N: torch.Tensor, X: int):
    """(rank_in_id_N int32, counts_X int64) of ``ids_N`` (int, values in [0, X)); three launches, work linear in
    the slots: per-block counts, their exclusive scan over blocks, then each block's ranks."""
    if not _use_triton(ids_N):
        return slot_ranks_torch(ids_N, X)
    N = ids_N.numel()
    nb = max(1, -(-N // SLOTS_PER_BLOCK))
    xb = 64
    hist = torch.empty(nb, X, dtype=torch.int32, device=ids_N.device)
    rank_N = torch.empty(N, dtype=torch.int32, device=ids_N.device)
    counts_X = torch.empty(X, dtype=torch.int64, device=ids_N.device)
    ids_N = ids_N.contiguous()
    _block_counts_kernel[(nb,)](ids_N, hist, N, X, BLOCK=SLOTS_PER_BLOCK, XB=xb, num_warps=4)
    _block_prefix_kernel[(-(-X // xb),)](hist, counts_X, nb, X, BB=32, XB=xb, num_warps=4)
    _slot_rank_kernel[(nb,)](ids_N, hist, rank_N, N, X, BLOCK=SLOTS_PER_BLOCK, num_warps=4)
    return rank_N, counts_X


def layout_tail(counts_RX: torch.Tensor, rank: int, e: int, capacity: int, TK: int):
    """(base_X, counts_e, dropped, needed) from every rank's counts ``counts_RX`` (int64); one launch."""
    if not _use_triton(counts_RX):
        return layout_tail_torch(counts_RX, rank, e, capacity, TK)
    R, X = counts_RX.shape
    dev = counts_RX.device
    scratch = torch.empty(3, X, dtype=torch.int64, device=dev)
    base_X = torch.empty(X, dtype=torch.int64, device=dev)
    counts_e = torch.empty(e, dtype=torch.int64, device=dev)
    dropped = torch.empty((), dtype=torch.int64, device=dev)
    needed = torch.empty((), dtype=torch.float32, device=dev)
    _layout_tail_kernel[(1,)](counts_RX.contiguous(), scratch, base_X, counts_e, dropped, needed, rank, X, e, capacity,
                              TK, R=R, RP=triton.next_power_of_2(R), XP=triton.next_power_of_2(X),
                              EP=triton.next_power_of_2(e), num_warps=4)
    return base_X, counts_e, dropped, needed
