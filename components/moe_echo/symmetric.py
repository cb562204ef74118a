"""Buffers every rank of a group can read and write: PyTorch symmetric memory (CUDA, NVLink).

    ws = workspace_for(group)        # one SymmetricWorkspace per group, shared by its layers
    buf = ws.buffer("layer3/recv_x", (N, D), torch.bfloat16, device)   # collective on first use
    buf.local      this rank's tensor                      [N, D]
    buf.peers      every rank's tensor, mapped here         list of R tensors [N, D]
    buf.ptrs_R     their base addresses (int64, on device) for Triton kernels
    ws.barrier(buf)  device-side barrier of the group (a kernel: no host wait, graph-capturable)

A buffer is allocated and exchanged (``rendezvous``) the first time its name is asked for with a
shape, on every rank in the same order (the layers of a model run in the same order everywhere).
Asking again with another shape (e.g. capacity grew) allocates anew. Buffers start zeroed.
``peer_memory_bytes()`` sums every workspace's buffers (the run reports it beside torch's memory).

``backends share one interface``: tests drive the NVLink dispatcher on CPU with a thread-backed
workspace of the same interface (tests/threaded_ranks.py).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from components.debug import DEBUG_CHECKS, setup_work


@dataclass
class SymmBuffer:
    local: torch.Tensor
    peers: list[torch.Tensor]
    ptrs_R: torch.Tensor
    handle: object = None


class SymmetricWorkspace:
    def __init__(self, group):
        import torch.distributed._symmetric_memory as symm_mem

        self.symm_mem = symm_mem
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._buffers: dict[str, tuple[tuple, SymmBuffer]] = {}
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed on older torch, harmless on newer
            enable(group.group_name)

    def buffer(self, name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> SymmBuffer:
        key = (tuple(shape), dtype)
        hit = self._buffers.get(name)
        if hit is not None and hit[0] == key:
            return hit[1]
        with setup_work():
            if DEBUG_CHECKS:
                self._check_same_buffer(name, key)
            local = self.symm_mem.empty(*shape, dtype=dtype, device=device)
            local.zero_()
            handle = self.symm_mem.rendezvous(local, self.group.group_name)
            peers = [local if r == self.rank else handle.get_buffer(r, tuple(shape), dtype)
                     for r in range(self.world)]
            ptrs_R = torch.tensor([p.data_ptr() for p in peers], dtype=torch.int64, device=device)
            buf = SymmBuffer(local, peers, ptrs_R, handle)
            self._buffers[name] = (key, buf)
            torch.cuda.synchronize(device)  # zeroed everywhere before any peer writes into it
            dist.barrier(group=self.group)
        return buf

    def nbytes(self) -> int:
        """This rank's bytes in these buffers: symmetric memory has its own allocator, so
        ``torch.cuda.max_memory_allocated`` does not count them."""
        return sum(buf.local.numel() * buf.local.element_size() for _, buf in self._buffers.values())

    def _check_same_buffer(self, name: str, key: tuple) -> None:
        """MOE_ECHO_CHECK=1: rendezvous pairs buffers by call order, not by name — check that every
        rank is creating the same buffer now (else peers would write into unrelated memory). Off by
        default: an object all-gather per buffer lengthens the first step."""
        mine = f"{name} {key[0]} {key[1]}"
        everyone = [None] * self.world
        dist.all_gather_object(everyone, mine, group=self.group)
        self.created = getattr(self, "created", 0) + 1
        if any(other != mine for other in everyone):
            raise RuntimeError(f"symmetric buffer #{self.created}: ranks create different buffers at the same "
                               f"point ({everyone}); every rank must allocate them in the same order")

    def barrier(self, buf: SymmBuffer) -> None:
        buf.handle.barrier(channel=0)


_workspaces: dict[str, "SymmetricWorkspace"] = {}


def workspace_for(group) -> "SymmetricWorkspace":
    """The one workspace of ``group`` (by its name), created on first use; shared by its layers."""
    name = group.group_name
    if name not in _workspaces:
        _workspaces[name] = SymmetricWorkspace(group)
    return _workspaces[name]


def peer_memory_bytes() -> int:
    """This rank's symmetric-memory bytes over every workspace (receive, output, clone and gradient
    buffers) — memory on top of what torch's caching allocator reports."""
    return sum(ws.nbytes() for ws in _workspaces.values())
