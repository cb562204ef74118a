"""How ECHO moves what it needs between the EP ranks: the experts' counts (to plan) and the clone
weights (multicast forward, gradients summed back to the home experts in backward).

    t = build_transport(dispatcher, group, ep_size, rank, slots, local_experts)
    counts_RE = t.all_gather(counts_E)          # every rank's counts, [R, E]
    clones_S = t.multicast(w_eX, slot_expert_G, index)   # [S, ...] weights of this rank's echo slots

Two transports, both static-shape with no host read:
- ``CollectiveTransport`` (NCCL/gloo; with the ``padded`` / ``alltoall`` dispatchers): counts by
  ``all_gather``; weights by one ``all_to_all`` in which every (home, destination) pair exchanges a
  block of S expert weights (zeros where the destination's slot s clones none of the home's
  experts): R·S expert blocks leave each rank per weight, of which only the clones' are non-zero.
- ``PeerMemoryTransport`` (with the ``nvlink`` dispatcher, over its symmetric-memory workspace):
  counts written into every peer's buffer; each home rank writes exactly its cloned experts into the
  clone ranks' slot buffers, and in backward pulls the clones' gradients from them.
"""

import torch
import torch.distributed as dist

from kernels.peer_rows import peer_gather_sum, peer_scatter

from .comm import all_to_all
from .nvlink_dispatch import NVLinkDispatcher, all_gather_rows


class CollectiveTransport:
    """Counts and clone weights over the EP group's collectives (NCCL on GPUs, gloo on CPU)."""

    def __init__(self, group, ep_size: int, rank: int, slots: int, local_experts: int):
        self.group, self.R, self.rank, self.S, self.e = group, ep_size, rank, slots, local_experts

    def all_gather(self, counts_E: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(counts_E) for _ in range(self.R)]
        dist.all_gather(parts, counts_E.contiguous(), group=self.group)
        return torch.stack(parts)

    def multicast(self, w_eX: torch.Tensor, slot_expert_G: torch.Tensor, index: int = 0) -> torch.Tensor:
        x_G, e, S = slot_expert_G, self.e, self.S
        flat = w_eX.reshape(e, -1)
        mine_G = (x_G >= 0) & (x_G // e == self.rank)  # slots (anywhere) that clone my experts
        send = flat.index_select(0, (x_G % e).clamp(min=0)) * mine_G.unsqueeze(1).to(flat.dtype)
        recv = all_to_all(send, None, None, self.group)  # row h·S + s: home h's weights for my slot s
        my_x = x_G[self.rank * S:(self.rank + 1) * S]
        used = (my_x >= 0).unsqueeze(1).to(flat.dtype)
        rows = (my_x.clamp(min=0) // e) * S + torch.arange(S, device=x_G.device)
        return (recv.index_select(0, rows) * used).view(S, *w_eX.shape[1:])


class PeerMemoryTransport:
    """Counts and clone weights over the ``nvlink`` dispatcher's peer memory (its workspace and CTAs)."""

    def __init__(self, dispatcher: NVLinkDispatcher, rank: int, slots: int):
        self.d, self.rank, self.S = dispatcher, rank, slots

    def all_gather(self, counts_E: torch.Tensor) -> torch.Tensor:
        return all_gather_rows(self.d.ws, f"{self.d.name}/echo_counts", counts_E)

    def multicast(self, w_eX: torch.Tensor, slot_expert_G: torch.Tensor, index: int = 0) -> torch.Tensor:
        d = self.d
        return nvlink_multicast(w_eX, slot_expert_G, d.ws, f"{d.name}/w{index}", self.rank, self.S, d.programs)


def build_transport(dispatcher, group, ep_size: int, rank: int, slots: int, local_experts: int):
    """Peer memory when the layer dispatches over NVLink, the group's collectives otherwise."""
    if isinstance(dispatcher, NVLinkDispatcher):
        return PeerMemoryTransport(dispatcher, rank, slots)
    return CollectiveTransport(group, ep_size, rank, slots, local_experts)


class _PeerMulticast(torch.autograd.Function):
    """Clone weights over peer memory. Forward: every home rank writes each of its experts that a
    slot clones straight into that slot's row of the clone rank's buffer [S, ...] (only the cloned
    experts move). Backward: each clone rank exposes its slots' weight gradients; each home rank
    pulls the gradients of the slots cloning its experts and adds them to its experts' gradients."""

    @staticmethod
    def forward(ctx, w_eX, slot_expert_G, ws, name: str, rank: int, slots: int, programs: int):
        e, G = w_eX.shape[0], slot_expert_G.shape[0]
        rows, width = (w_eX[0].numel() // w_eX.shape[-1]), w_eX.shape[-1]  # each expert = rows x width
        dev = w_eX.device
        mine_G = (slot_expert_G >= 0) & (slot_expert_G // e == rank)  # slots (anywhere) cloning my experts
        local_G = (slot_expert_G % e).clamp(min=0)
        g_N = torch.arange(G * rows, device=dev) // rows
        dest_N1 = (g_N // slots).view(-1, 1)
        row_N1 = torch.where(mine_G.index_select(0, g_N), (g_N % slots) * rows + torch.arange(G * rows, device=dev) % rows,
                             -1).view(-1, 1)
        buf = ws.buffer(f"{name}/clone", (slots * rows, width), w_eX.dtype, dev)
        src_ND = w_eX.reshape(e, rows, width).index_select(0, local_G).reshape(G * rows, width)
        peer_scatter(src_ND, dest_N1, row_N1, buf.ptrs_R, buf.peers, programs=programs)
        ws.barrier(buf)
        used_S = slot_expert_G[rank * slots:(rank + 1) * slots] >= 0
        out = buf.local.view(slots, rows, width) * used_S.view(-1, 1, 1).to(w_eX.dtype)  # unused slots: zeros
        ctx.save_for_backward(local_G, dest_N1, row_N1)
        ctx.ws, ctx.name, ctx.shape, ctx.programs = ws, name, (e, rows, width), programs
        return out.view(slots, *w_eX.shape[1:])

    @staticmethod
    def backward(ctx, grad_SX):
        local_G, dest_N1, row_N1 = ctx.saved_tensors
        e, rows, width = ctx.shape
        gbuf = ctx.ws.buffer(f"{ctx.name}/clone_grad", (grad_SX.shape[0] * rows, width), grad_SX.dtype, grad_SX.device)
        gbuf.local.copy_(grad_SX.reshape(-1, width))
        ctx.ws.barrier(gbuf)
        pulled_ND = peer_gather_sum(dest_N1, row_N1, gbuf.ptrs_R, gbuf.peers, programs=ctx.programs)  # 0: not mine
        grad_eX = torch.zeros(e, rows, width, dtype=grad_SX.dtype, device=grad_SX.device)
        grad_eX.index_add_(0, local_G, pulled_ND.view(-1, rows, width))
        return grad_eX.view(e, *grad_SX.shape[1:]), None, None, None, None, None, None


def nvlink_multicast(w_eX: torch.Tensor, slot_expert_G: torch.Tensor, ws, name: str, rank: int, slots: int,
                     programs: int = 64) -> torch.Tensor:
    """[S, ...] clone weights of this rank's echo slots from their home experts (differentiable:
    the clones' gradients are summed into the home experts'). ``name`` must be unique per weight."""
    return _PeerMulticast.apply(w_eX, slot_expert_G, ws, name, rank, slots, programs)
