"""Expert-parallel dispatcher backends: ``alltoall`` (baseline) and ``padded`` (sync-free).

Each of the R ranks of the EP group owns e = E / R experts. Both backends:

    sender:   slots sorted by expert (rank-major) ─► send buffer ─► all_to_all ─► receive buffer
    receiver: received blocks (one per source, local-expert-major) ─permute─► x_ND expert-major
    combine:  y_ND ─inverse permute─► all_to_all back ─► Σ_k w · y at the source (fp32)

``alltoall``: send/receive sizes are the exact counts, read on the host (``.tolist()``) to size
the buffers and the all_to_all splits — like torchtitan's standard path. Never drops.

``padded``: every (source, destination) pair has a fixed block of C rows,
C = round_up(ceil(capacity_factor · T · K / R), 8); counts are exchanged on device; all shapes are
static, so no host read happens and the step can be captured in a CUDA graph. A slot whose
destination block is full is not sent: the handle's ``dropped`` counts such slots (device scalar)
and the layer accumulates it in ``overflow_count``, which the training loop checks — a drop is
never silent.
"""

from dataclasses import dataclass

import torch

from .comm import all_to_all, exchange_counts
from .dispatcher import DispatchHandle, ExpertParallel, FixedCapacity, capacity_rows
from .ep_layout import expert_major_order, send_layout
from .row_ops import gather_rows, permute_rows, weighted_combine


@dataclass
class EPHandle(DispatchHandle):
    row_of_slot_TK: torch.Tensor  # row of each slot in the send buffer (-1: not sent)
    w_TK: torch.Tensor
    nd_of_recv_N: torch.Tensor
    recv_of_nd_N: torch.Tensor
    send_splits: list[int] | None  # None: equal blocks (padded)
    recv_splits: list[int] | None
    out_dtype: torch.dtype


class _AllToAllBase(ExpertParallel):
    """Receive and combine over NCCL/gloo ``all_to_all`` (shared by alltoall and padded)."""

    reentrant = True  # every buffer is a fresh tensor

    def _receive(self, x_send, recv_counts_Re, block_start_R, block_of_row_N, send_splits, recv_splits):
        x_recv = all_to_all(x_send, recv_splits, send_splits, self.group, self.wire)
        nd_of_recv, recv_of_nd, counts_e = expert_major_order(recv_counts_Re, block_start_R, block_of_row_N)
        x_ND = permute_rows(x_recv, recv_of_nd, nd_of_recv)
        return x_ND, counts_e, nd_of_recv, recv_of_nd

    def combine(self, y_ND, handle: EPHandle):
        y_recv = permute_rows(y_ND, handle.nd_of_recv_N, handle.recv_of_nd_N)
        y_back = all_to_all(y_recv, handle.send_splits, handle.recv_splits, self.group, grad_wire=self.wire)
        return weighted_combine(y_back, handle.w_TK, handle.row_of_slot_TK).to(handle.out_dtype)


class AllToAllDispatcher(_AllToAllBase):
    """Exact variable-size all_to_all; split sizes read on the host (the baseline)."""

    def dispatch(self, x_TD, ids_TK, w_TK):
        lay = send_layout(ids_TK, self.num_experts, self.ep_size)
        recv_counts_Re = exchange_counts(lay.counts_Re, self.group)
        send_splits = lay.counts_Re.sum(1).tolist()  # host sync: sizes the buffers
        recv_totals = recv_counts_Re.sum(1)
        recv_splits = recv_totals.tolist()
        x_send = gather_rows(x_TD, lay.token_of_sorted_N, lay.sorted_of_slot_TK)
        block_start_R = torch.cumsum(recv_totals, 0) - recv_totals
        block_of_row_N = torch.repeat_interleave(
            torch.arange(self.ep_size, device=x_TD.device), recv_totals, output_size=sum(recv_splits))
        x_ND, counts_e, nd, rn = self._receive(x_send, recv_counts_Re, block_start_R, block_of_row_N,
                                               send_splits, recv_splits)
        handle = EPHandle(lay.sorted_of_slot_TK, w_TK, nd, rn, send_splits, recv_splits, x_TD.dtype,
                          dropped=torch.zeros((), dtype=torch.int64, device=x_TD.device))
        return x_ND, counts_e, handle


def padded_capacity(num_tokens: int, top_k: int, ep_size: int, capacity_factor: float) -> int:
    """Rows per (source, destination) block: round_up(ceil(cf · T · K / R), 8)."""
    return capacity_rows(capacity_factor, num_tokens * top_k, 8, ep_size)


class PaddedDispatcher(FixedCapacity, _AllToAllBase):
    """Fixed C rows per (source, destination) pair; static shapes; no host read."""

    def __init__(self, num_experts: int, group, ep_size: int, capacity_factor: float):
        _AllToAllBase.__init__(self, num_experts, group, ep_size)
        FixedCapacity.__init__(self, capacity_factor)

    def dispatch(self, x_TD, ids_TK, w_TK):
        return self.dispatch_rows(x_TD, ids_TK, w_TK, ids_TK.numel())

    def dispatch_rows(self, x_TD, ids_TK, w_TK, assignments: int, masked: bool = False):
        """``dispatch`` with the blocks sized for ``assignments`` (T·K of a plain dispatch) and, with
        ``masked``, ids of -1 for slots that go nowhere (not sent, not counted as dropped)."""
        T, K = ids_TK.shape
        R, dev = self.ep_size, x_TD.device
        C = capacity_rows(self.capacity_factor, assignments, 8, R)
        lay = send_layout(ids_TK, self.num_experts, R, masked)
        sent_N = (lay.pos_in_dest_N < C) & (lay.dest_of_sorted_N < R)
        send_row_N = torch.where(sent_N, lay.dest_of_sorted_N * C + lay.pos_in_dest_N, -1)
        row_of_slot_TK = send_row_N.index_select(0, lay.sorted_of_slot_TK.reshape(-1)).view(T, K)
        # token of each send row (unused rows point at token 0; the receiver ignores them)
        token_of_row = torch.zeros(R * C + 1, dtype=torch.int64, device=dev)
        token_of_row.scatter_(0, torch.where(sent_N, send_row_N, R * C), lay.token_of_sorted_N)
        x_send = gather_rows(x_TD, token_of_row[:R * C], row_of_slot_TK)

        # rows actually sent per (destination, expert): the block keeps the first C in expert order
        cum_Re = torch.cumsum(lay.counts_Re, dim=1).clamp(max=C)
        sent_Re = cum_Re - torch.nn.functional.pad(cum_Re[:, :-1], (1, 0))
        recv_counts_Re = exchange_counts(sent_Re, self.group)
        dropped = lay.counts_Re.sum() - sent_Re.sum()
        needed = lay.counts_Re.sum(1).max().float() * R / assignments  # fullest block, as a capacity_factor

        block_start_R = torch.arange(R, device=dev) * C
        block_of_row_N = torch.arange(R * C, device=dev) // C
        x_ND, counts_e, nd, rn = self._receive(x_send, recv_counts_Re, block_start_R, block_of_row_N, None, None)
        return x_ND, counts_e, EPHandle(row_of_slot_TK, w_TK, nd, rn, None, None, x_TD.dtype, dropped=dropped,
                                        needed_factor=needed)
