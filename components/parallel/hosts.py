"""Which ranks share a host, from the launcher, and the process groups of hierarchical expert parallelism.

A host is one machine (one NVLink domain). torchrun gives each worker its node's rank (``GROUP_RANK``);
without torchrun the host name stands in. An EP group of R ranks spans H hosts when its ranks, in EP order,
are H runs of L = R / H ranks, one run per host (torchrun numbers ranks node by node, so an EP group of
consecutive ranks does). Then:

    net group   the H ranks with the same local index l (one per host): the network leg's all_to_all
    host group  the L ranks of one host: the NVLink leg

    hosts = ep_hosts(ep_group)      # EPHosts(hosts=H, ranks_per_host=L, host_rank=h, net_group, host_group)

Collective on every rank of the world (an all_gather and the groups' creation); cached per EP group, so
every MoE layer after the first reuses the groups.
"""

import os
import socket
from dataclasses import dataclass

import torch.distributed as dist

from components.errors import UserError


@dataclass(frozen=True)
class EPHosts:
    hosts: int  # H: hosts the EP group spans
    ranks_per_host: int  # L
    host_rank: int  # this rank's host, 0..H-1, in EP order
    net_group: object | None  # None on one host
    host_group: object | None
    regular: bool = True  # False: the EP ranks are not H equal, host-contiguous runs (hierarchical refused)

    @property
    def spans_hosts(self) -> bool:
        return self.hosts > 1


def host_id() -> str:
    """This process's host: torchrun's node rank where it runs under torchrun, else the host name."""
    node = os.environ.get("GROUP_RANK")
    return f"node{node}" if node is not None else socket.gethostname()


def host_runs(hosts_of_ranks: list[str]) -> tuple[int, int] | None:
    """(H, L) when the list is H equal runs of one host each (no host in two runs), else None."""
    runs: list[list[str]] = []
    for h in hosts_of_ranks:
        if runs and runs[-1][0] == h:
            runs[-1].append(h)
        else:
            runs.append([h])
    if len({r[0] for r in runs}) != len(runs) or len({len(r) for r in runs}) != 1:
        return None
    return len(runs), len(runs[0])


_CACHE: dict[tuple, EPHosts] = {}


def ep_hosts(ep_group) -> EPHosts:
    """The host layout of ``ep_group`` (see the module docstring); one process: a single host."""
    if not dist.is_initialized():
        return EPHosts(1, 1, 0, None, None)
    mine = tuple(dist.get_process_group_ranks(ep_group))
    if mine in _CACHE:
        return _CACHE[mine]
    world = dist.get_world_size()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (host_id(), mine))
    host_of = [h for h, _ in gathered]
    groups = sorted({g for _, g in gathered})  # every EP group, the same order on every rank
    layouts = {g: host_runs([host_of[r] for r in g]) for g in groups}
    if any(v is None for v in layouts.values()) or len({v for v in layouts.values()}) != 1:
        hosts = len({host_of[r] for r in mine})
        out = EPHosts(hosts, len(mine) // hosts if len(mine) % hosts == 0 else 0, 0, None, None, regular=False)
        _CACHE[mine] = out
        return out
    H, L = layouts[mine]
    me = dist.get_rank()
    net_group = host_group = None
    if H > 1:  # every rank creates every group, in the same order
        for g in groups:
            for l in range(L):
                pg = dist.new_group([g[h * L + l] for h in range(H)])
                if me in g and mine.index(me) % L == l:
                    net_group = pg
            for h in range(H):
                pg = dist.new_group(list(g[h * L:(h + 1) * L]))
                if me in g[h * L:(h + 1) * L]:
                    host_group = pg
    out = EPHosts(H, L, mine.index(me) // L, net_group, host_group)
    _CACHE[mine] = out
    return out


def require_spanning(hosts: EPHosts, ep: int) -> None:
    """One-line errors where ``hierarchical`` cannot run on this layout."""
    if not hosts.spans_hosts:
        raise UserError(f"[moe_echo] dispatcher = 'hierarchical' needs the {ep} EP ranks to span several hosts "
                        "(torchrun --nnodes > 1 and expert_parallel_degree > --nproc_per_node); use dispatcher = 'auto'")
    if not hosts.regular:
        raise UserError(f"[moe_echo] dispatcher = 'hierarchical' needs the {ep} EP ranks to be the same number of "
                        f"consecutive ranks on each host (torchrun with the same --nproc_per_node on every node); "
                        f"use dispatcher = 'padded'")
