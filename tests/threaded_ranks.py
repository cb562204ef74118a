"""R "ranks" as threads of one process sharing CPU buffers: the symmetric-memory workspace
interface (``components/moe_echo/symmetric.py``) without GPUs, for testing the NVLink dispatcher's
logic (layout, capacity, overflow, autograd) on CPU against references."""

import threading

import torch

from components.moe_echo.symmetric import SymmBuffer


class _Shared:
    def __init__(self, world: int):
        self.world = world
        self.lock = threading.Lock()
        self.barrier = threading.Barrier(world, timeout=120)
        self.buffers: dict[str, tuple[tuple, list[torch.Tensor]]] = {}


class ThreadWorkspace:
    def __init__(self, shared: _Shared, rank: int):
        self.shared, self.rank, self.world = shared, rank, shared.world

    def buffer(self, name, shape, dtype, device) -> SymmBuffer:
        key = (tuple(shape), dtype)
        with self.shared.lock:
            hit = self.shared.buffers.get(name)
            if hit is None or hit[0] != key:
                hit = (key, [torch.zeros(*shape, dtype=dtype, device=device) for _ in range(self.world)])
                self.shared.buffers[name] = hit
        peers = hit[1]
        ptrs = torch.tensor([p.data_ptr() for p in peers], dtype=torch.int64)
        return SymmBuffer(peers[self.rank], peers, ptrs)

    def barrier(self, buf) -> None:
        self.shared.barrier.wait()


def run_ranks(world: int, fn):
    """fn(rank, workspace) on ``world`` threads; returns their results (re-raises the first error)."""
    shared = _Shared(world)
    results, errors = [None] * world, []

    def body(r):
        try:
            results[r] = fn(r, ThreadWorkspace(shared, r))
        except BaseException as err:  # noqa: BLE001 - re-raised below
            errors.append(err)
            shared.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
