"""Row layouts for expert-parallel dispatch, computed on device with static shapes.

R = EP ranks, E = global experts, e = E / R local experts per rank; expert x lives on rank x // e.

Sender (``send_layout``): the T·K (token, choice) slots sorted by global expert id (stable), which is
rank-major then local-expert-major: ``token_of_sorted_N``, ``sorted_of_slot_TK``, ``counts_Re``
(this rank's rows per destination rank and local expert) and ``pos_in_dest_N`` (row index inside
its destination's block). With ``masked``, an id of -1 marks a slot that goes nowhere: it sorts last,
its destination is R (no rank) and it is in no count.

Receiver (``expert_major_order``): received rows arrive in blocks, one per source rank, each block
local-expert-major. The grouped GEMM wants all rows of local expert 0 first (sources in order),
then expert 1, ... ``nd_of_recv_N`` maps each received row to that order; rows past a block's
count (padding) go to the end, so N stays static.
"""

from dataclasses import dataclass

import torch


@dataclass
class SendLayout:
    token_of_sorted_N: torch.Tensor  # [T*K] source token of each sorted slot
    sorted_of_slot_TK: torch.Tensor  # [T, K] sorted position of each slot
    counts_Re: torch.Tensor  # [R, e] rows for (destination rank, its local expert)
    dest_of_sorted_N: torch.Tensor  # [T*K] destination rank of each sorted slot
    pos_in_dest_N: torch.Tensor  # [T*K] index of the sorted slot inside its destination's block


def send_layout(ids_TK: torch.Tensor, num_experts: int, ep_size: int, masked: bool = False) -> SendLayout:
    T, K = ids_TK.shape
    e = num_experts // ep_size
    flat_N = ids_TK.reshape(-1)
    if masked:  # -1 → id E: sorts last, destination R
        flat_N = torch.where(flat_N < 0, num_experts, flat_N)
    sorted_slot_N = torch.argsort(flat_N, stable=True)
    arange_N = torch.arange(T * K, device=ids_TK.device)
    sorted_of_slot = torch.empty_like(sorted_slot_N).scatter_(0, sorted_slot_N, arange_N)
    counts_E = torch.zeros(num_experts + int(masked), dtype=torch.int64, device=ids_TK.device)
    counts_E.scatter_add_(0, flat_N, torch.ones_like(flat_N))
    counts_Re = counts_E[:num_experts].view(ep_size, e)
    rows_R = counts_Re.sum(1)
    dest_start_R = torch.cumsum(rows_R, 0) - rows_R
    if masked:  # destination R (nowhere) starts after every rank's block
        dest_start_R = torch.cat([dest_start_R, rows_R.sum().view(1)])
    dest_N = flat_N.index_select(0, sorted_slot_N) // e
    pos_N = arange_N - dest_start_R.index_select(0, dest_N)
    return SendLayout(sorted_slot_N // K, sorted_of_slot.view(T, K), counts_Re, dest_N, pos_N)


def expert_major_order(recv_counts_Re: torch.Tensor, block_start_R: torch.Tensor, block_of_row_N: torch.Tensor):
    """Permutation of the N received rows into local-expert-major order.

    recv_counts_Re[s, j]: rows from source s for local expert j; block_start_R[s]: first row of
    source s's block; block_of_row_N[n]: the source block of received row n.
    Returns (nd_of_recv_N, recv_of_nd_N, counts_e): row n goes to position nd_of_recv_N[n];
    positions >= counts_e.sum() are padding.
    """
    N = block_of_row_N.shape[0]
    R, e = recv_counts_Re.shape
    dev = recv_counts_Re.device
    arange_N = torch.arange(N, device=dev)
    j_N = arange_N - block_start_R.index_select(0, block_of_row_N)  # row inside its block
    cum_Re = torch.cumsum(recv_counts_Re, dim=1)
    cum_Ne = cum_Re.index_select(0, block_of_row_N)
    expert_N = (j_N.unsqueeze(1) >= cum_Ne).sum(1)  # local expert of the row (e: padding)
    valid_N = expert_N < e
    expert_c = expert_N.clamp(max=e - 1)
    within_N = j_N - (cum_Ne - recv_counts_Re.index_select(0, block_of_row_N)).gather(1, expert_c[:, None]).squeeze(1)
    counts_e = recv_counts_Re.sum(0)
    expert_start_e = torch.cumsum(counts_e, 0) - counts_e
    src_before_Re = torch.cumsum(recv_counts_Re, dim=0) - recv_counts_Re  # earlier sources, same expert
    nd_valid = expert_start_e.index_select(0, expert_c) + src_before_Re[block_of_row_N, expert_c] + within_N
    pad_rank = torch.cumsum((~valid_N).long(), 0) - 1
    nd_of_recv = torch.where(valid_N, nd_valid, counts_e.sum() + pad_rank)
    recv_of_nd = torch.empty_like(nd_of_recv).scatter_(0, nd_of_recv, arange_N)
    return nd_of_recv, recv_of_nd, counts_e
