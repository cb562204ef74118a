"""``nvlink`` dispatcher: tokens written straight into the owning peers' receive buffers.

R ranks, X = R·e ids (e = local experts, echo slots included), T tokens, K choices per rank.
Every rank holds, in symmetric memory (``symmetric.py``), per MoE layer:

    counts [R, X] int64    row s = rank s's routed rows per id (each rank writes its row everywhere)
    x      [N_cap, D]      receive buffer, local-expert-major: expert j's rows from source 0, then
                           source 1, ...; N_cap = round_up(capacity_factor · T · K, 128)
    y      [N_cap, D]      expert outputs, read back by the sources at combine
and, shared by all layers, the backward's ``grad_y`` and ``grad_x`` of the same shape.

    dispatch:  counts ─write to all peers─► barrier ─► layout (device) ─► scatter rows to peers ─► barrier
               (row of slot (t, k) with id x on rank r = start of x on r + rows of x from lower
               sources + rank of (t, k) among this rank's rows for x; rows >= N_cap are not sent)
    combine:   y_ND ─copy─► y buffer ─► barrier ─► y_TD[t] = Σ_k w · peer_y[rank][row] (fp32)
    backward:  combine: w·g written to peers' grad_y, grad_w = <g, peer_y row> ─► barrier
               dispatch: grad_x_ND ─copy─► grad_x buffer ─► barrier ─► Σ_k peer rows

No host read anywhere (counts, offsets and overflow stay on the device); every shape comes from
the capacity, so the step can be captured in a CUDA graph. Assignments that do not fit are not
sent and are counted in ``handle.dropped`` — the training loop gates the step and replays it (never
a silent drop). Buffer reuse is race-free because each layer's x/y buffers are only rewritten one
full step later, and each shared backward buffer is rewritten only after a barrier that every
reader of its previous contents has passed.
"""

import itertools
from dataclasses import dataclass

import torch

from kernels.peer_rows import peer_combine_backward, peer_gather_sum, peer_scatter

from .dispatcher import DispatchHandle, ExpertParallel, FixedCapacity, capacity_rows
from .ep_layout import SendLayout, send_layout
from .symmetric import SymmBuffer, workspace_for

_instance_ids = itertools.count()


def nvlink_capacity(num_tokens: int, top_k: int, capacity_factor: float) -> int:
    """Receive rows per rank: round_up(ceil(capacity_factor · T · K), 128)."""
    return capacity_rows(capacity_factor, num_tokens * top_k, 128)


def all_gather_rows(ws, name: str, row_X: torch.Tensor) -> torch.Tensor:
    """[R, X]: every rank's ``row_X`` (this rank writes its row into every peer's buffer; one
    device barrier). The buffer is per name, rewritten one full step later."""
    R, X, dev = ws.world, row_X.shape[0], row_X.device
    buf = ws.buffer(name, (R, X), row_X.dtype, dev)
    to_all = torch.arange(R, device=dev).view(1, R)
    peer_scatter(row_X.view(1, X), to_all, torch.full_like(to_all, ws.rank), buf.ptrs_R, buf.peers, programs=R)
    ws.barrier(buf)
    return buf.local.clone()


def nvlink_layout(ids_TK: torch.Tensor, lay: SendLayout, counts_RX: torch.Tensor, rank: int, num_local: int,
                  capacity: int):
    """Where each (token, choice) slot lands: (dest rank_TK, row_TK with -1 = not sent, counts_e
    received by this rank per local id, dropped slots of this rank, the capacity_factor the fullest
    rank needed — the same on every rank). ``lay``: this rank's
    ``send_layout`` (its stable sort by id); ``counts_RX``: every rank's counts. Device only."""
    T, K = ids_TK.shape
    R, X = counts_RX.shape
    flat_N = ids_TK.reshape(-1)
    # a slot's rank among this rank's slots for the same id = its place in the destination block
    # minus the rows of the destination's lower local ids
    pos_N = lay.pos_in_dest_N.index_select(0, lay.sorted_of_slot_TK.reshape(-1))
    first_in_dest_X = (torch.cumsum(lay.counts_Re, 1) - lay.counts_Re).reshape(X)
    rank_in_id = pos_N - first_in_dest_X.index_select(0, flat_N)
    total_Re = counts_RX.sum(0).view(R, num_local)
    start_X = (torch.cumsum(total_Re, 1) - total_Re).reshape(X)  # start of each id in its owner's buffer
    before_X = counts_RX[:rank].sum(0)  # rows of each id from lower source ranks
    row_N = start_X.index_select(0, flat_N) + before_X.index_select(0, flat_N) + rank_in_id
    row_N = torch.where(row_N < capacity, row_N, -1)
    cum_e = torch.cumsum(total_Re[rank], 0).clamp(max=capacity)
    counts_e = cum_e - torch.nn.functional.pad(cum_e[:-1], (1, 0))
    dropped = (row_N < 0).sum()
    needed = total_Re.sum(1).max().float() / (T * K)
    return (flat_N // num_local).view(T, K), row_N.view(T, K), counts_e, dropped, needed


@dataclass
class NVLinkHandle(DispatchHandle):
    rank_TK: torch.Tensor
    row_TK: torch.Tensor
    w_TK: torch.Tensor
    out_dtype: torch.dtype
    x_buf: SymmBuffer
    y_buf: SymmBuffer
    x_dtype: torch.dtype


class NVLinkDispatcher(FixedCapacity, ExpertParallel):
    """Sync-free dispatch over peer memory (NVLink); ``programs`` = CTAs (≈ SMs) the copy kernels use."""

    def __init__(self, num_experts: int, group, ep_size: int, capacity_factor: float, programs: int = 32,
                 workspace=None, name: str | None = None, block_t: int | None = None):
        ExpertParallel.__init__(self, num_experts, group, ep_size)
        FixedCapacity.__init__(self, capacity_factor)
        self.programs = programs
        self.block_t = block_t  # tokens per CTA iteration (None: kernels.peer_rows.TOKENS_PER_BLOCK)
        self.ws = workspace if workspace is not None else workspace_for(group)
        self.rank = self.ws.rank
        # buffer names must agree across ranks: layers are built in the same order on every rank
        self.name = name or f"nvlink{next(_instance_ids)}"

    def _shared(self, role: str, rows: int, D: int, dtype, device) -> SymmBuffer:
        return self.ws.buffer(f"shared/{role}/{rows}x{D}/{dtype}", (rows, D), dtype, device)

    def dispatch(self, x_TD, ids_TK, w_TK):
        T, K = ids_TK.shape
        R, X, dev = self.ep_size, self.num_experts, x_TD.device
        out_dtype = x_TD.dtype  # combine returns (and accumulates in fp32 into) the caller's dtype
        if torch.is_autocast_enabled(dev.type) and x_TD.is_floating_point():
            x_TD = x_TD.to(torch.get_autocast_dtype(dev.type))  # move the experts' input dtype
        cap = nvlink_capacity(T, K, self.capacity_factor)
        lay = send_layout(ids_TK, X, R)  # the same sort by id as the NCCL backends
        counts_RX = all_gather_rows(self.ws, f"{self.name}/counts", lay.counts_Re.reshape(X))
        rank_TK, row_TK, counts_e, dropped, needed = nvlink_layout(ids_TK, lay, counts_RX, self.rank, self.num_local,
                                                                   cap)
        D = x_TD.shape[1]
        h = NVLinkHandle(rank_TK, row_TK, w_TK, out_dtype, self.ws.buffer(f"{self.name}/x", (cap, D), x_TD.dtype, dev),
                         None, x_TD.dtype, dropped=dropped, needed_factor=needed)
        x_ND = _NVLinkDispatch.apply(x_TD, self, h)
        return x_ND, counts_e, h

    def combine(self, y_ND, handle: NVLinkHandle):
        handle.y_buf = self.ws.buffer(f"{self.name}/y", tuple(y_ND.shape), y_ND.dtype, y_ND.device)
        return _NVLinkCombine.apply(y_ND, handle.w_TK, self, handle)


class _NVLinkDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, disp: NVLinkDispatcher, h: NVLinkHandle):
        buf = h.x_buf
        peer_scatter(x_TD, h.rank_TK, h.row_TK, buf.ptrs_R, buf.peers, programs=disp.programs, block_t=disp.block_t)
        disp.ws.barrier(buf)
        ctx.disp, ctx.h = disp, h
        return buf.local.view(buf.local.shape)

    @staticmethod
    def backward(ctx, grad_ND):
        disp, h = ctx.disp, ctx.h
        gx = disp._shared("grad_x", *grad_ND.shape, grad_ND.dtype, grad_ND.device)
        gx.local.copy_(grad_ND)
        disp.ws.barrier(gx)
        grad_TD = peer_gather_sum(h.rank_TK, h.row_TK, gx.ptrs_R, gx.peers, out_dtype=h.x_dtype,
                                  programs=disp.programs, block_t=disp.block_t)
        return grad_TD, None, None


class _NVLinkCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_ND, w_TK, disp: NVLinkDispatcher, h: NVLinkHandle):
        yb = h.y_buf
        yb.local.copy_(y_ND)
        disp.ws.barrier(yb)
        ctx.save_for_backward(w_TK)
        ctx.disp, ctx.h = disp, h
        return peer_gather_sum(h.rank_TK, h.row_TK, yb.ptrs_R, yb.peers, w_TK, out_dtype=h.out_dtype,
                               programs=disp.programs, block_t=disp.block_t)

    @staticmethod
    def backward(ctx, grad_TD):
        (w_TK,) = ctx.saved_tensors
        disp, h = ctx.disp, ctx.h
        yb = h.y_buf
        gy = disp._shared("grad_y", *yb.local.shape, yb.local.dtype, yb.local.device)
        grad_w_TK = peer_combine_backward(grad_TD, h.rank_TK, h.row_TK, yb.ptrs_R, yb.peers, gy.ptrs_R, gy.peers,
                                          w_TK, programs=disp.programs, block_t=disp.block_t)
        disp.ws.barrier(gy)
        return gy.local.view(gy.local.shape), grad_w_TK, None, None
