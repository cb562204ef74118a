"""How ECHO moves what it needs between the EP ranks: the experts' counts (to plan) and the clone
weights (multicast forward, gradients summed back to the home experts in backward).

    t = build_transport(dispatcher, group, ep_size, rank, slots, local_experts)
    counts_RE = t.all_gather(counts_E)                     # every rank's counts, [R, E]
    w_eSX = extend_with_clones(w_eX, slot_expert_G, t, index)  # [e + S, ...]: home experts ++ clones

A transport moves the clones (``clones``: forward) and adds their gradients into the home experts' rows of the
extended weights' gradient, in place (``add_clone_grads_``: backward), so backward moves and adds only cloned rows.

Two transports, both static-shape with no host read:
- ``CollectiveTransport`` (NCCL/gloo; with the ``padded`` / ``alltoall`` dispatchers): counts by
  ``all_gather``; weights by one ``all_to_all`` in which every (home, destination) pair exchanges a
  block of S expert weights (zeros where the destination's slot s clones none of the home's
  experts): R·S expert blocks leave each rank per weight, of which only the clones' are non-zero.
- ``HostTransport`` (with the ``hierarchical`` dispatcher, EP over H hosts × L ranks): like the
  ``hierarchical`` dispatch, a clone's weights cross the network once, between ranks of the same local
  index; inside a host they move over the host's group. Per weight, each rank sends (H − 1)·S expert
  blocks to other hosts (``CollectiveTransport``: (H − 1)·L·S), the same back for the gradients.
- ``PeerMemoryTransport`` (with the ``nvlink`` dispatcher, over its symmetric-memory workspace):
  counts written into every peer's buffer; each home rank writes exactly its cloned experts into the
  clone ranks' slot buffers, and in backward pulls the clones' gradients from them.
"""

import torch
import torch.distributed as dist

from kernels.echo_routes import clone_routes, pull_routes
from kernels.fp8 import transpose_copy_
from kernels.peer_rows import peer_gather_sum, peer_scatter

from .comm import all_to_all
from .hierarchical_dispatch import HierarchicalDispatcher
from .nvlink_dispatch import NVLinkDispatcher, all_gather_rows


class CollectiveTransport:
    """Counts and clone weights over the EP group's collectives (NCCL on GPUs, gloo on CPU)."""

    def __init__(self, group, ep_size: int, rank: int, slots: int, local_experts: int):
        self.group, self.R, self.rank, self.S, self.e = group, ep_size, rank, slots, local_experts

    def all_gather(self, counts_E: torch.Tensor, what: str = "counts") -> torch.Tensor:
        """[R, E]: every rank's ``counts_E`` (any 1-D tensor; ``what`` names it, one buffer per name where the
        transport keeps buffers)."""
        parts = [torch.empty_like(counts_E) for _ in range(self.R)]
        dist.all_gather(parts, counts_E.contiguous(), group=self.group)
        return torch.stack(parts)

    def clones(self, w_eX: torch.Tensor, slot_expert_G: torch.Tensor, index: int = 0) -> torch.Tensor:
        """[S, ...] weights of this rank's echo slots (zeros for unused slots)."""
        x_G, e, S = slot_expert_G, self.e, self.S
        flat = w_eX.reshape(e, -1)
        mine_G = (x_G >= 0) & (x_G // e == self.rank)  # slots (anywhere) that clone my experts
        send = flat.index_select(0, (x_G % e).clamp(min=0)) * mine_G.unsqueeze(1).to(flat.dtype)
        recv = all_to_all(send, None, None, self.group)  # row h·S + s: home h's weights for my slot s
        rows, used = self._my_rows(x_G)
        return (recv.index_select(0, rows) * used.to(flat.dtype)).view(S, *w_eX.shape[1:])

    def clone_grads(self, grad_SX: torch.Tensor, slot_expert_G: torch.Tensor, index: int = 0):
        """(local expert of each slot [G], gradient of each slot that clones one of my experts [G, ...], zeros
        for the others): the transpose of ``clones``."""
        x_G, e, S = slot_expert_G, self.e, self.S
        flat = grad_SX.reshape(S, -1)
        rows, used = self._my_rows(x_G)
        grad_recv = flat.new_zeros(self.R * S, flat.shape[1]).index_copy_(0, rows, flat * used.to(flat.dtype))
        grad_send = all_to_all(grad_recv, None, None, self.group)  # row g: the gradient of slot g, from its rank
        mine_G = (x_G >= 0) & (x_G // e == self.rank)
        grad_G = grad_send * mine_G.unsqueeze(1).to(flat.dtype)
        return (x_G % e).clamp(min=0), grad_G.view(-1, *grad_SX.shape[1:])

    def add_clone_grads_(self, grad_eX: torch.Tensor, grad_SX: torch.Tensor, slot_expert_G: torch.Tensor,
                         index: int = 0) -> None:
        """Backward of ``clones``: add each slot's weight gradient (``grad_SX``: this rank's slots) into its home
        expert's rows of ``grad_eX`` on the home rank, in place."""
        local_G, grad_GX = self.clone_grads(grad_SX, slot_expert_G, index)
        grad_eX.index_add_(0, local_G, grad_GX.to(grad_eX.dtype))

    def bytes_to_other_hosts(self, expert_bytes: int, ranks_per_host: int) -> int:
        """Bytes this rank sends to ranks on other hosts per layer and step: one block of S experts to each of
        the R − L ranks elsewhere, forward (weights) and backward (gradients), used or not (static shapes)."""
        return 2 * (self.R - ranks_per_host) * self.S * expert_bytes

    def _my_rows(self, x_G: torch.Tensor):
        """Row h·S + s of the exchanged block for each of my slots s (h: its expert's home), and whether used."""
        my_x = x_G[self.rank * self.S:(self.rank + 1) * self.S]
        rows = (my_x.clamp(min=0) // self.e) * self.S + torch.arange(self.S, device=x_G.device)
        return rows, (my_x >= 0).unsqueeze(1)


class HostTransport(CollectiveTransport):
    """Clone weights host by host (EP rank r = h·L + l: host h, local index l). Forward, two all_to_alls:
        host leg (``host_group``): home rank → local peer j: H·S blocks, the slots of ranks (k, j) for every
            host k, each its weights if it clones one of my experts (else zeros); peer j keeps, per slot, the
            block of the rank of its host that owns the slot's expert;
        network leg (``net_group``, the H ranks of local index j): block k to host k's rank j, whose slot s
            takes the block from its expert's home host.
    Backward reverses both legs. Counts are gathered over the whole EP group, as in ``CollectiveTransport``."""

    def __init__(self, group, ep_size: int, rank: int, slots: int, local_experts: int, ranks_per_host: int,
                 net_group, host_group):
        super().__init__(group, ep_size, rank, slots, local_experts)
        self.L, self.H = ranks_per_host, ep_size // ranks_per_host
        self.net_group, self.host_group = net_group, host_group
        self.ranks_per_host = ranks_per_host

    def _relay(self, x_G: torch.Tensor):
        """For the slots of ranks (k, l), k = 0..H-1 (l: my local index) [H·S]: their slots g, the row of the
        host leg's receive buffer that holds each (block of the home rank's local index), whether the expert
        is homed on my host."""
        H, L, S, e, dev = self.H, self.L, self.S, self.e, x_G.device
        h, l = divmod(self.rank, L)
        g_N = ((torch.arange(H, device=dev) * L + l) * S).unsqueeze(1) + torch.arange(S, device=dev)
        g_N = g_N.flatten()
        x_N = x_G.index_select(0, g_N)
        home_N = x_N.clamp(min=0) // e
        here_N = (x_N >= 0) & (home_N // L == h)
        return (home_N % L) * (H * S) + torch.arange(H * S, device=dev), here_N.unsqueeze(1)

    def _peer_slots(self, x_G: torch.Tensor):
        """Slots g of ranks (k, j) in host-leg block order [L·H·S] (block j: ranks of local index j)."""
        H, L, S, dev = self.H, self.L, self.S, x_G.device
        k_H1 = torch.arange(H, device=dev).view(1, H, 1)
        j_L1 = torch.arange(L, device=dev).view(L, 1, 1)
        return ((k_H1 * L + j_L1) * S + torch.arange(S, device=dev)).flatten()

    def _home_rows(self, x_G: torch.Tensor):
        """My slots' rows in the network leg's blocks (block = the expert's home host) [S], and whether used."""
        my_x = x_G[self.rank * self.S:(self.rank + 1) * self.S]
        rows = (my_x.clamp(min=0) // (self.e * self.L)) * self.S + torch.arange(self.S, device=x_G.device)
        return rows, (my_x >= 0).unsqueeze(1)

    def clones(self, w_eX: torch.Tensor, slot_expert_G: torch.Tensor, index: int = 0) -> torch.Tensor:
        x_G, e = slot_expert_G, self.e
        flat = w_eX.reshape(e, -1)
        x_P = x_G.index_select(0, self._peer_slots(x_G))
        mine_P = ((x_P >= 0) & (x_P // e == self.rank)).unsqueeze(1)
        send = flat.index_select(0, (x_P % e).clamp(min=0)) * mine_P.to(flat.dtype)
        recv = all_to_all(send, None, None, self.host_group)  # block j': local rank j''s experts for my slots' peers
        rows, here = self._relay(x_G)
        relay = recv.index_select(0, rows) * here.to(flat.dtype)  # [H·S]: block k for the slots of rank (k, l)
        got = all_to_all(relay, None, None, self.net_group)  # block k': from host k', for my slots homed there
        rows, used = self._home_rows(x_G)
        return (got.index_select(0, rows) * used.to(flat.dtype)).view(self.S, *w_eX.shape[1:])

    def clone_grads(self, grad_SX: torch.Tensor, slot_expert_G: torch.Tensor, index: int = 0):
        x_G, e, S = slot_expert_G, self.e, self.S
        flat = grad_SX.reshape(S, -1)
        rows, used = self._home_rows(x_G)
        to_home = flat.new_zeros(self.H * S, flat.shape[1]).index_copy_(0, rows, flat * used.to(flat.dtype))
        got = all_to_all(to_home, None, None, self.net_group)  # block k: rank (k, l)'s slot gradients homed here
        rows, here = self._relay(x_G)
        relay = flat.new_zeros(self.L * self.H * S, flat.shape[1]).index_copy_(0, rows, got * here.to(flat.dtype))
        back = all_to_all(relay, None, None, self.host_group)  # block j': the slots of ranks (k, j'), mine or zeros
        grad_G = flat.new_zeros(x_G.shape[0], flat.shape[1]).index_copy_(0, self._peer_slots(x_G), back)
        mine_G = ((x_G >= 0) & (x_G // e == self.rank)).unsqueeze(1)
        return (x_G % e).clamp(min=0), (grad_G * mine_G.to(flat.dtype)).view(-1, *grad_SX.shape[1:])

    def bytes_to_other_hosts(self, expert_bytes: int, ranks_per_host: int) -> int:
        """One block of S experts to each other host's rank of my local index, forward and backward."""
        return 2 * (self.H - 1) * self.S * expert_bytes


class PeerMemoryTransport:
    """Counts and clone weights over the ``nvlink`` dispatcher's peer memory (its workspace and CTAs). Forward:
    every home rank writes each of its experts that a slot clones straight into that slot's row of the clone
    rank's buffer [S, ...] (only the cloned experts move). Backward: each clone rank exposes its slots' weight
    gradients; each home rank pulls the gradients of the slots cloning its experts."""

    def __init__(self, ws, name: str, rank: int, slots: int, local_experts: int, programs: int = 64):
        self.ws, self.name, self.rank, self.S, self.e, self.programs = ws, name, rank, slots, local_experts, programs

    def all_gather(self, counts_E: torch.Tensor, what: str = "counts") -> torch.Tensor:
        return all_gather_rows(self.ws, f"{self.name}/echo_{what}", counts_E)

    def clones(self, w_eX: torch.Tensor, slot_expert_G: torch.Tensor, index: int = 0) -> torch.Tensor:
        e, S = self.e, self.S
        rows, width = (w_eX[0].numel() // w_eX.shape[-1]), w_eX.shape[-1]  # each expert = rows x width
        src_N, dest_N1, row_N1 = clone_routes(slot_expert_G, self.rank, S, e, rows)
        buf = self.ws.buffer(f"{self.name}/w{index}/clone", (S * rows, width), w_eX.dtype, w_eX.device)
        peer_scatter(w_eX.reshape(e * rows, width), dest_N1, row_N1, buf.ptrs_R, buf.peers, programs=self.programs,
                     src_T=src_N)  # each clone row reads its home expert's row: no gathered copy of the G experts
        self.ws.barrier(buf)
        used_S = slot_expert_G[self.rank * S:(self.rank + 1) * S] >= 0
        out = buf.local.view(S, rows, width) * used_S.view(-1, 1, 1).to(w_eX.dtype)  # unused slots: zeros
        return out.view(S, *w_eX.shape[1:])

    def add_clone_grads_(self, grad_eX: torch.Tensor, grad_SX: torch.Tensor, slot_expert_G: torch.Tensor,
                         index: int = 0) -> None:
        """Each clone rank exposes its slots' gradients; each home rank pulls, for every row of each of its experts
        that some slot clones, the matching row of every slot cloning it (at most one per other rank: the planner
        never clones an expert twice on one rank), sums them in fp32 and adds the sum into ``grad_eX`` in place.
        Only C = min(e, G) experts' rows are read (the cloned ones first; static shapes, no host read): the rows of
        experts no slot clones are not touched."""
        S, e = self.S, self.e
        rows, width = (grad_SX[0].numel() // grad_SX.shape[-1]), grad_SX.shape[-1]
        gbuf = self.ws.buffer(f"{self.name}/w{index}/clone_grad", (S * rows, width), grad_SX.dtype, grad_SX.device)
        gbuf.local.copy_(grad_SX.reshape(-1, width))
        self.ws.barrier(gbuf)
        rank_TR, row_TR, home_T = pull_routes(slot_expert_G, self.rank, S, e, rows)
        # summed in fp32 with the home row and written back in its dtype, by the pull kernel itself: the home rows
        # are distinct (one rounding each, no race); rows with no source are not touched
        peer_gather_sum(rank_TR, row_TR, gbuf.ptrs_R, gbuf.peers, add_into=grad_eX.view(e * rows, width),
                        out_rows_T=home_T, programs=self.programs)


def build_transport(dispatcher, group, ep_size: int, rank: int, slots: int, local_experts: int):
    """Peer memory when the layer dispatches over NVLink, host by host when it dispatches across hosts
    (``hierarchical``), the group's collectives otherwise."""
    if isinstance(dispatcher, HierarchicalDispatcher):
        return HostTransport(group, ep_size, rank, slots, local_experts, dispatcher.ranks_per_host,
                             dispatcher.net_group, dispatcher.host_leg.group)
    if isinstance(dispatcher, NVLinkDispatcher):
        return PeerMemoryTransport(dispatcher.ws, dispatcher.name, rank, slots, local_experts, dispatcher.programs)
    return CollectiveTransport(group, ep_size, rank, slots, local_experts)


class _ExtendWithClones(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w_eX, slot_expert_G, transport, index: int, out):
        ctx.save_for_backward(slot_expert_G)
        e = ctx.e = w_eX.shape[0]
        ctx.transport, ctx.index = transport, index
        clones = transport.clones(w_eX, slot_expert_G, index)
        if out is None:
            return torch.cat([w_eX, clones.to(w_eX.dtype)])
        out[e:].copy_(clones)  # rows [:e] are w_eX itself
        return out.view(out.shape)

    @staticmethod
    def backward(ctx, grad_eSX):
        return _home_gradient(ctx, grad_eSX), None, None, None, None


def _home_gradient(ctx, grad_eSX: torch.Tensor) -> torch.Tensor:
    """The home experts' gradient [e, ...]: rows [:e] of the extended weights' gradient with each slot's rows added
    into its home expert's (on the home rank, through ``ctx.transport``)."""
    (slot_expert_G,) = ctx.saved_tensors
    if 0 in grad_eSX.stride() or not grad_eSX.is_contiguous():  # an expanded gradient (e.g. of a sum) shares
        grad_eSX = grad_eSX.contiguous()                          # memory between rows
    grad_eX = grad_eSX[:ctx.e]  # the extended weights' gradient is this Function's own buffer: added in place
    ctx.transport.add_clone_grads_(grad_eX, grad_eSX[ctx.e:], slot_expert_G, ctx.index)
    return grad_eX


class _SlotGradients(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w_eX, slot_expert_G, transport, index: int):
        ctx.save_for_backward(slot_expert_G)
        ctx.e, ctx.transport, ctx.index = w_eX.shape[0], transport, index
        return w_eX.new_empty(w_eX.shape[0] + transport.S, *w_eX.shape[1:])

    @staticmethod
    def backward(ctx, grad_eSX):
        return _home_gradient(ctx, grad_eSX), None, None, None


def slot_gradients(w_eX: torch.Tensor, slot_expert_G: torch.Tensor, transport, index: int = 0) -> torch.Tensor:
    """[e + S, ...], its values unset: a stand-in for ``extend_with_clones``' weights where the GEMMs read FP8 copies
    instead (``clone_fp8_weights_``) and never the weights. Its gradient is theirs: each slot's rows are added into
    its home expert's, which reach ``w_eX``. No weight moves in the forward."""
    return _SlotGradients.apply(w_eX, slot_expert_G, transport, index)


FP8_INDEX = 16  # the FP8 copies' transport buffers: indices past the weights' (0, 1, 2 and W13)


@torch.no_grad()
def clone_fp8_weights_(w, e: int, slot_expert_G: torch.Tensor, transport):
    """ECHO's slots of FP8 weights (``fp8_experts.Fp8Weights`` of e home experts then S slots) written from their
    home experts' rows, and returned: the plain copies' bytes through the transport, the scales by an all-gather of
    every rank's, the transposed copies transposed here. Unused slots: zero bytes, scale 1. The home rows are read,
    never written."""
    S = transport.S
    for k, plain in enumerate((w.plain13_E2HD, w.plain2_EDH)):
        plain[e:].view(torch.uint8).copy_(transport.clones(plain[:e].view(torch.uint8), slot_expert_G, FP8_INDEX + k))
    home_R2e = transport.all_gather(w.scale_2E[:, :e].reshape(-1), "fp8_scales").view(-1, 2, e)
    x_S = slot_expert_G.view(-1, S)[transport.rank]  # the experts my slots clone (-1: none)
    x = x_S.clamp(min=0)
    s_2S = home_R2e[x // e, :, x % e].t()  # [2, S]
    w.scale_2E[:, e:].copy_(torch.where(x_S >= 0, s_2S, torch.ones_like(s_2S)))
    transpose_copy_(w.plain13_E2HD[e:], w.t13_ED2H[e:])
    transpose_copy_(w.plain2_EDH[e:], w.t2_EHD[e:])
    return w


def extend_with_clones(w_eX: torch.Tensor, slot_expert_G: torch.Tensor, transport, index: int = 0,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """[e + S, ...]: this rank's home experts, then the clone weights of its echo slots (zeros for unused slots).
    Differentiable: each clone's gradient is added into its home expert's rows, which are the extended weights'
    gradient rows [:e] themselves (no dense [e, ...] buffer, no extra add). ``index`` names the weight (one
    buffer pair per weight and layer). ``out`` ([e + S, ...], optional): a buffer whose rows [:e] are w_eX
    itself (the experts' compute copies); the clones are written into its rows [e:] and it is returned, so
    the home experts are not copied."""
    if out is not None and (out.shape[0] != w_eX.shape[0] + transport.S or out.data_ptr() != w_eX.data_ptr()
                            or out.stride() != w_eX.stride()):
        raise ValueError(f"extend_with_clones: out {tuple(out.shape)} must hold w_eX {tuple(w_eX.shape)} as its "
                         f"first rows and {transport.S} slot rows after them")
    return _ExtendWithClones.apply(w_eX, slot_expert_G, transport, index, out)
