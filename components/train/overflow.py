"""Dropless training with fixed-capacity dispatch: gate on the device, replay from the host.

A fixed-capacity dispatcher (``padded``, ``nvlink``) that overflows has not sent some (token,
expert) assignments of that step.
Such a step must never be applied:

1. gate (device, no host read): ``sticky |= any rank overflowed`` (an all-reduce of the layers'
   overflow counters); the fused AdamW step reads ``optimizer.found_inf = sticky`` and leaves
   parameters, moments and step counts untouched when it is set (as GradScaler does); the router
   bias update is skipped the same way. Sticky: every later step is gated too until the host acts,
   because it ran from parameters that missed the gated update.
2. replay (host, one step late): the flag of step s is copied to pinned host memory and read after
   step s+1 has been launched; if it is set, the learning-rate schedule is rewound over the gated
   steps and their batches are re-run on the exact path (``alltoall``, variable sizes, nothing
   dropped), the flag is cleared, and training continues.
3. every ``grow_after``-th replay grows the capacity factor to what the overflowed steps needed
   (each dispatch reports the factor that would have fit it; the gate keeps the maximum over layers
   and ranks on the device) plus 10% headroom, and at least by 25% — one growth instead of a ladder
   of 25% steps, each costing replays and buffer re-allocations (sync-free shapes stay static
   between growths).

The flag is one device tensor updated in place (``sticky``), so a captured graph keeps pointing at it.
"""

from contextlib import contextmanager

import torch
import torch.distributed as dist

from components.moe_echo.dispatcher import is_fixed_capacity
from components.moe_echo.ep_dispatch import AllToAllDispatcher
from components.parallel.cuda_graph import HostCopy


class OverflowGate:
    def __init__(self, layers, optimizer, device: torch.device, grow_after: int = 0):
        self.layers = [moe for _, moe in layers]
        self.optimizer = optimizer
        self.sticky = torch.zeros((), dtype=torch.float32, device=device)
        self.host_flags: dict[int, HostCopy] = {}
        self.replays = 0
        self.grow_after = grow_after
        self.dropped_total = torch.zeros((), dtype=torch.int64, device=device)
        self.dropped_seen = 0  # dropped_total as of the last step read on the host (for logging)
        self.need_max = torch.zeros((), device=device)  # largest capacity_factor needed since the last replay
        self.need_seen = 0.0

    def gate(self) -> torch.Tensor:
        """After backward: fold this step's overflow into the sticky flag and arm the optimizer."""
        dropped = torch.stack([moe.overflow_count for moe in self.layers]).sum()
        if dist.is_initialized():
            dist.all_reduce(dropped)
        self.dropped_total.add_(dropped)
        if self.grow_after:
            need = torch.stack([moe.capacity_need for moe in self.layers]).max()
            if dist.is_initialized():
                dist.all_reduce(need, op=dist.ReduceOp.MAX)
            self.need_max.copy_(torch.maximum(self.need_max, need))
        self.sticky.copy_(torch.maximum(self.sticky, (dropped > 0).float()))
        self.optimizer.found_inf = self.sticky
        return self.sticky

    def record(self, step: int) -> None:
        """Copy this step's flag and the running drop count to host memory without waiting."""
        self.host_flags[step] = HostCopy((self.sticky, self.dropped_total, self.need_max))

    def overflowed(self, step: int) -> bool:
        """Host read of step's flag: waits only for that step's copy (recorded before the next step
        was launched), never for the work queued after it."""
        flag, dropped, need = self.host_flags.pop(step).get()
        self.dropped_seen = int(dropped)
        self.need_seen = float(need)
        return bool(flag > 0)

    def clear(self) -> None:
        self.sticky.zero_()
        self.optimizer.found_inf = self.sticky
        self.host_flags.clear()

    def replayed(self, n: int) -> float | None:
        """Count a replay; every ``grow_after``-th one grows the capacity (returns the new factor)."""
        self.replays += 1
        grown = None
        if self.grow_after and self.replays % self.grow_after == 0:
            for moe in self.layers:
                if is_fixed_capacity(moe.dispatcher):
                    cf = moe.dispatcher.capacity_factor
                    moe.dispatcher.capacity_factor = grown = max(1.25 * cf, 1.1 * self.need_seen)
        self.need_max.zero_()  # the next growth sizes for what overflows from here on
        return grown

    @contextmanager
    def exact_dispatch(self):
        """Swap every fixed-capacity dispatcher for an exact alltoall one (same group and id space)."""
        saved = [moe.dispatcher for moe in self.layers]
        for moe in self.layers:
            d = moe.dispatcher
            if is_fixed_capacity(d):
                moe.dispatcher = AllToAllDispatcher(d.num_experts, d.group, d.ep_size)
        try:
            yield
        finally:
            for moe, d in zip(self.layers, saved):
                moe.dispatcher = d


def rewind_lr(scheduler, steps: int) -> None:
    """Undo ``steps`` LambdaLR steps (they were gated; the replay steps them again)."""
    scheduler.last_epoch -= steps + 1
    scheduler.step()
