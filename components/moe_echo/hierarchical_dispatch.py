"""``hierarchical`` dispatcher: expert parallelism across hosts, each token crossing the network once per
destination host.

The EP group is H hosts × L ranks (EP rank r = h·L + l lives on host h at local index l); X = R·e ids
(e = local experts, echo slots included), expert x on rank x // e, so on host x // (L·e). Two legs, both
with fixed capacities and static shapes (no host read; CUDA-graph capturable):

    network leg (``net_group``: the H ranks with this local index, one per host; NCCL/gloo all_to_all)
        source (h_s, l): one row per unique (token, destination host) pair, into the block of that host
        (C1 rows per block, rows in token order), with the token's choices on that host as host-local ids
        (-1 for choices elsewhere) and their routing weights   ─►  entry rank (h, l) of each host
    host leg (``host_group``: the L ranks of this host; a ``padded`` dispatcher over host-local ids)
        entry rank: the H·C1 received rows fan out to the ranks holding their experts (-1 choices go
        nowhere)  ─►  x_ND, counts_e on the owners, expert-major, as every backend delivers them
    combine: owners' expert rows ─► back to the entry rank, weighted and summed per received row in fp32
        (one partial sum per (token, host), in x's dtype) ─network─► source: Σ over hosts in fp32.

Capacities (``capacity_factor`` = cf, T tokens per rank, K choices):
    C1 = min(round_up(T, 8), round_up(ceil(cf · T · (1 − (1 − 1/H)^K)), 8)) rows per (source, destination
         host): the tokens that need a host when choices spread evenly over hosts (K=6: 98% of them at 2
         hosts, 55% at 8), times cf; a token needs a host at most once, so at C1 >= T it cannot overflow;
    host leg: round_up(ceil(cf · T · K / L), 8) rows per (entry rank, owner) pair, as ``padded`` sizes
         its blocks for T·K assignments over L ranks (an entry rank receives ≈ T·K / … assignments: the
         rows of H sources for its one host).
What does not fit is not sent and is counted in ``handle.dropped`` (the loop gates and replays the step);
``handle.needed_factor`` is the capacity factor that would have fit both legs.

Bytes between hosts per rank and direction: (H - 1) · C1 rows of D (padding included), plus 2K fp32
words per row on the way out (ids and weights); ``handle.network_rows`` counts the real rows sent to other
hosts (the unique (token, remote host) pairs).
"""

from dataclasses import dataclass

import torch

from .comm import all_to_all, wire_scales
from .dispatcher import DispatchHandle, ExpertParallel, FixedCapacity, capacity_rows
from .ep_dispatch import EPHandle, PaddedDispatcher
from .row_ops import gather_rows, weighted_combine


def host_share(top_k: int, hosts: int) -> float:
    """The share of a rank's tokens that need one given host when each of their K choices picks a host
    uniformly: 1 − (1 − 1/H)^K (K=6: 0.98 at 2 hosts, 0.55 at 8)."""
    return 1.0 - (1.0 - 1.0 / hosts) ** top_k


def host_capacity(num_tokens: int, top_k: int, hosts: int, capacity_factor: float) -> int:
    """C1: network-leg rows per (source rank, destination host) block, round_up(ceil(cf · T · share), 8) and at
    most round_up(T, 8) (a token needs a host at most once)."""
    share_rows = round(num_tokens * host_share(top_k, hosts), 6)
    return min(-(-num_tokens // 8) * 8, capacity_rows(capacity_factor, share_rows, 8))


@dataclass
class HierarchicalHandle(DispatchHandle):
    row_TH: torch.Tensor  # [T, H] row of (token, host) in the network send buffer (-1: not needed / not sent)
    ones_TH: torch.Tensor  # combine weights of the per-host partial sums
    host: EPHandle  # the host leg's handle
    out_dtype: torch.dtype


class HierarchicalDispatcher(FixedCapacity, ExpertParallel):
    """EP over ``hosts`` × ``ranks_per_host`` ranks: network leg over ``net_group`` (this local index on every
    host), host leg over ``host_group`` (this host's ranks)."""

    reentrant = True  # every buffer is a fresh tensor
    overlap_from_ep = 2  # its network leg is worth hiding behind the experts at any size (overlap_chunks = "auto")

    def __init__(self, num_experts: int, group, ep_size: int, capacity_factor: float, hosts: int,
                 net_group, host_group, host_rank: int):
        ExpertParallel.__init__(self, num_experts, group, ep_size)
        FixedCapacity.__init__(self, capacity_factor)
        if hosts < 1 or ep_size % hosts != 0:
            raise ValueError(f"hierarchical dispatch: {ep_size} EP ranks do not split evenly over {hosts} hosts")
        self.hosts, self.ranks_per_host, self.host_rank = hosts, ep_size // hosts, host_rank
        self.net_group = net_group
        self.per_host = self.ranks_per_host * self.num_local  # ids of one host
        # the host leg: a padded dispatcher over this host's ranks and host-local ids (shares our capacity)
        self.host_leg = PaddedDispatcher(self.per_host, host_group, self.ranks_per_host, capacity_factor)

    @property
    def wire(self) -> str:
        return self.host_leg.wire

    @wire.setter
    def wire(self, wire: str) -> None:  # both legs' token rows cross the same way
        self.host_leg.wire = wire

    @property
    def capacity_factor(self) -> float:
        return self._cf

    @capacity_factor.setter
    def capacity_factor(self, cf: float) -> None:
        self._cf = cf
        if hasattr(self, "host_leg"):
            self.host_leg.capacity_factor = cf

    def network_bytes(self, num_tokens: int, top_k: int, hidden: int, itemsize: int) -> int:
        """Bytes this rank sends to other hosts per dispatch + combine (padding included; dispatch rows of
        ``hidden + 4·ceil(hidden / 128)`` bytes with the fp8 wire)."""
        rows = (self.hosts - 1) * host_capacity(num_tokens, top_k, self.hosts, self.capacity_factor)
        out = hidden + 4 * wire_scales(hidden) if self.wire == "fp8" else hidden * itemsize
        return rows * (out + hidden * itemsize + 2 * top_k * 4)

    def dispatch(self, x_TD, ids_TK, w_TK):
        T, K = ids_TK.shape
        H, dev = self.hosts, x_TD.device
        C1 = host_capacity(T, K, H, self.capacity_factor)
        host_TK = ids_TK // self.per_host
        need_TH = torch.zeros(T, H, dtype=torch.int64, device=dev).scatter_(1, host_TK, 1)
        pos_TH = torch.cumsum(need_TH, 0) - 1  # place of the token in its block to host h
        sent_TH = (need_TH > 0) & (pos_TH < C1)
        row_TH = torch.where(sent_TH, torch.arange(H, device=dev) * C1 + pos_TH, -1)
        # what crosses: rows of x, and per row the choices on that host (host-local ids, -1 elsewhere) and weights
        src_of_row = torch.full((H * C1 + 1,), T * H, dtype=torch.int64, device=dev)  # T·H: an empty pair
        src_of_row.scatter_(0, torch.where(sent_TH, row_TH, H * C1).view(-1), torch.arange(T * H, device=dev))
        src_of_row = src_of_row[:H * C1]
        token_of_row = torch.where(src_of_row < T * H, src_of_row // H, 0)
        x_send = gather_rows(x_TD, token_of_row, row_TH)
        on_THK = host_TK.unsqueeze(1) == torch.arange(H, device=dev).view(1, H, 1)
        local_THK = torch.where(on_THK, (ids_TK % self.per_host).unsqueeze(1), -1)
        w_dtype = torch.promote_types(w_TK.dtype, torch.float32)  # ids < 2**24 are exact in it
        meta_THK = torch.cat([w_TK.to(w_dtype).unsqueeze(1) * on_THK, local_THK.to(w_dtype)], dim=2)  # [T, H, 2K]
        empty = torch.cat([meta_THK.new_zeros(1, K), meta_THK.new_full((1, K), -1.0)], dim=1)
        meta_send = torch.cat([meta_THK.reshape(T * H, 2 * K), empty]).index_select(0, src_of_row)
        x_recv = all_to_all(x_send, None, None, self.net_group, self.wire)  # [H·C1, D]: block g from host g's source
        meta_recv = all_to_all(meta_send, None, None, self.net_group)
        w_recv, ids_recv = meta_recv[:, :K], meta_recv[:, K:].detach().long()

        x_ND, counts_e, host_h = self.host_leg.dispatch_rows(x_recv, ids_recv, w_recv, T * K, masked=True)
        need_H = need_TH.sum(0)
        unsent_TH = (need_TH > 0) & ~sent_TH
        dropped_net = (on_THK.sum(2) * unsent_TH).sum()  # the choices of (token, host) pairs not sent
        need_net = need_H.max().float() / (T * host_share(K, H))  # as a capacity_factor of C1
        remote = torch.arange(H, device=dev) != self.host_rank
        handle = HierarchicalHandle(
            row_TH, torch.ones(T, H, dtype=torch.float32, device=dev), host_h, x_TD.dtype,
            dropped=dropped_net + host_h.dropped, needed_factor=torch.maximum(need_net, host_h.needed_factor),
            network_rows=(sent_TH & remote).sum())
        return x_ND, counts_e, handle

    def combine(self, y_ND, handle: HierarchicalHandle):
        part_recv = self.host_leg.combine(y_ND, handle.host)  # [H·C1, D]: per (token, host) weighted sums
        part_back = all_to_all(part_recv, None, None, self.net_group, grad_wire=self.wire)
        return weighted_combine(part_back, handle.ones_TH, handle.row_TH).to(handle.out_dtype)
