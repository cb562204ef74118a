"""Device → pinned host copies that never wait for later work, and host → device batch uploads.

    out = HostCopy((loss, grad_norm))   # starts the copies, records an event
    loss, grad_norm = out.get()        # waits for these copies only (read one step late)
    x = to_device_async(x_cpu, device) # staged through a reused pinned buffer

Pinned buffers are reused round-robin (``PinnedRing``), so a steady-state step allocates no pinned
memory.
"""

import torch
from torch.utils._pytree import tree_map


class PinnedRing:
    """Pinned host buffers reused round-robin per (shape, dtype), so that a steady-state step
    allocates no pinned memory (nothing of ours can land on host memory a captured graph staged
    from). ``take`` hands out the least recently used buffer of a key, first waiting for the copy
    that last used it (``done``: an event recorded after that copy; normally long complete)."""

    def __init__(self, depth: int = 32):
        self.depth = depth
        self.pinned = torch.cuda.is_available()  # plain host memory on CPU-only machines (tests)
        self.slots: dict[tuple, list] = {}  # key -> [next index, [(buffer, event or None)] * depth]

    def take(self, shape, dtype) -> tuple[torch.Tensor, int, tuple]:
        key = (tuple(shape), dtype)
        if key not in self.slots:  # all at once: later steps allocate nothing
            self.slots[key] = [0, [[torch.empty(shape, dtype=dtype, pin_memory=self.pinned), None]
                                   for _ in range(self.depth)]]
        entry = self.slots[key]
        i = entry[0] % self.depth
        entry[0] += 1
        buf, event = entry[1][i]
        if event is not None and not event.query():
            event.synchronize()  # only when the host got `depth` copies ahead of the device
        return buf, i, key

    def done(self, key: tuple, i: int, event) -> None:
        self.slots[key][1][i][1] = event


_ring = PinnedRing()


def to_device_async(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor → device without a host wait (staged through a reused pinned buffer)."""
    if device.type != "cuda":
        return x.to(device)
    buf, i, key = _ring.take(x.shape, x.dtype)
    buf.copy_(x)
    out = buf.to(device, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    _ring.done(key, i, event)
    return out


class HostCopy:
    """A pytree of device tensors copied to pinned host memory without waiting; ``get()`` waits for
    that copy only (an event recorded right after it), never for work queued later. The pinned
    buffers come from a ring (``PinnedRing``): a copy's values stay valid for ``depth`` (32) later
    copies of the same shape and dtype — a few steps' worth; callers read them one step late."""

    def __init__(self, tree):
        taken = []

        def copy(t):
            if not isinstance(t, torch.Tensor):
                return t
            if not t.is_cuda:
                return t.detach().clone()
            host, i, key = _ring.take(t.shape, t.dtype)
            taken.append((key, i))
            return host.copy_(t.detach(), non_blocking=True)

        self.tree = tree_map(copy, tree)
        self.event = None
        if taken:
            self.event = torch.cuda.Event(enable_timing=True)  # also times the step (GPU timeline)
            self.event.record()
            for key, i in taken:
                _ring.done(key, i, self.event)

    def get(self):
        if self.event is not None:
            self.event.synchronize()
        return self.tree

    def seconds_since(self, earlier: "HostCopy") -> float | None:
        """GPU-timeline seconds from ``earlier``'s copy to this one (both done: call after ``get``);
        None without CUDA events."""
        if self.event is None or earlier is None or earlier.event is None:
            return None
        return earlier.event.elapsed_time(self.event) / 1000
