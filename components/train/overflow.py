"""The step gate and the step pipeline: nothing dropped, nothing non-finite applied, no host sync.

A step must not be applied when (a) a fixed-capacity dispatcher (``padded``, ``nvlink``) overflowed
— some (token, expert) assignments were not sent — or (b) its loss or gradient norm is not finite.

1. gate (device, no host read; ``StepGate.gate`` after backward and clipping): ``sticky |= any rank
   overflowed`` and ``nonfinite = loss or grad norm not finite on any rank`` (one all-reduce);
   ``skip = sticky or nonfinite``. The fused AdamW step reads ``optimizer.found_inf = skip`` and
   leaves parameters, moments and step counts untouched when it is set (as GradScaler does); the
   router bias update is skipped the same way. Overflow is sticky: every later step is gated too
   until the host acts, because it ran from parameters that missed the gated update. A non-finite
   step is skipped alone: the next step runs from the same, still finite, parameters.
2. confirm (host, one step late; ``StepPipeline``): the flags of step s are copied to pinned host
   memory and read after step s+1 has been launched. Overflow: the learning-rate schedule is
   rewound over the gated steps and their batches are re-run on the exact path (``alltoall``,
   variable sizes, nothing dropped), the flag is cleared, and training continues. Non-finite: the
   step is reported as skipped; the caller stops after too many in a row.
3. every ``grow_after``-th replay grows the capacity factor to what the overflowed steps needed
   (each dispatch reports the factor that would have fit it; the gate keeps the maximum over layers
   and ranks on the device) plus 10% headroom, and at least by 25% — one growth instead of a ladder
   of 25% steps, each costing replays and buffer re-allocations (sync-free shapes stay static
   between growths).

The flags are device tensors updated in place, so a captured graph keeps pointing at them.
"""

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from components.errors import UserError
from components.moe_echo.dispatcher import is_fixed_capacity
from components.moe_echo.ep_dispatch import AllToAllDispatcher
from components.parallel.data_parallel import allreduce_sum
from components.parallel.host_copy import HostCopy


class StepGate:
    """Device-side gate of the optimizer step (see the module docstring). ``layers``: (name,
    MoELayer) pairs whose overflow is checked (empty: only the non-finite check)."""

    def __init__(self, layers, optimizer, device: torch.device, grow_after: int = 0, check_finite: bool = True):
        self.layers = [moe for _, moe in layers]
        self.optimizer = optimizer
        self.check_finite = check_finite
        self.sticky = torch.zeros((), dtype=torch.float32, device=device)  # overflow, until replayed
        self.nonfinite = torch.zeros((), dtype=torch.float32, device=device)  # this step only
        self.skip = torch.zeros((), dtype=torch.float32, device=device)  # what the optimizer reads
        self.host_flags: dict[int, HostCopy] = {}
        self.replays = 0
        self.grow_after = grow_after
        self.dropped_total = torch.zeros((), dtype=torch.int64, device=device)
        self.dropped_seen = 0  # dropped_total as of the last step read on the host (for logging)
        self.need_max = torch.zeros((), device=device)  # largest capacity_factor needed since the last replay
        self.need_seen = 0.0
        self.nonfinite_total = torch.zeros((), dtype=torch.int64, device=device)
        self.nonfinite_seen = 0  # skipped non-finite steps as of the last step read on the host
        optimizer.found_inf = self.skip

    def gate(self, loss: torch.Tensor | None = None, grad_norm: torch.Tensor | None = None) -> torch.Tensor:
        """After backward and clipping: fold this step's overflow and finiteness into the flags and
        arm the optimizer (``found_inf``); returns the skip flag (device, 0-d)."""
        zero = torch.zeros((), dtype=torch.int64, device=self.skip.device)
        dropped = torch.stack([moe.overflow_count for moe in self.layers]).sum() if self.layers else zero
        bad = zero
        if self.check_finite and loss is not None:
            bad = (~torch.isfinite(loss.detach().float()) | ~torch.isfinite(grad_norm.detach().float())).long()
        flags = torch.stack([dropped.long(), bad])
        if dist.is_initialized():
            dist.all_reduce(flags)  # one collective for both flags
        dropped, bad = flags[0], flags[1] > 0
        self.dropped_total.add_(dropped)
        if self.grow_after and self.layers:
            need = torch.stack([moe.capacity_need for moe in self.layers]).max()
            if dist.is_initialized():
                dist.all_reduce(need, op=dist.ReduceOp.MAX)
            self.need_max.copy_(torch.maximum(self.need_max, need))
        self.sticky.copy_(torch.maximum(self.sticky, (dropped > 0).float()))
        self.nonfinite.copy_(bad.float())
        self.nonfinite_total.add_(bad.long())
        self.skip.copy_(torch.maximum(self.sticky, self.nonfinite))
        self.optimizer.found_inf = self.skip
        return self.skip

    def record(self, step: int) -> None:
        """Copy this step's flags and running counts to host memory without waiting."""
        self.host_flags[step] = HostCopy((self.sticky, self.nonfinite, self.dropped_total, self.need_max,
                                          self.nonfinite_total))

    def read(self, step: int) -> tuple[bool, bool]:
        """(overflowed, non-finite) of ``step``: waits only for that step's copy (recorded before the
        next step was launched), never for the work queued after it."""
        sticky, nonfinite, dropped, need, nonfinite_total = self.host_flags.pop(step).get()
        self.dropped_seen = int(dropped)
        self.need_seen = float(need)
        self.nonfinite_seen = int(nonfinite_total)
        return bool(sticky > 0), bool(nonfinite > 0)

    def clear(self) -> None:
        self.sticky.zero_()
        self.host_flags.clear()

    def replayed(self, n: int) -> float | None:
        """Count a replay; every ``grow_after``-th one grows the capacity (returns the new factor)."""
        self.replays += 1
        grown = None
        if self.grow_after and self.replays % self.grow_after == 0:
            for moe in self.layers:
                if is_fixed_capacity(moe.dispatcher):
                    grown = moe.dispatcher.grow_capacity(1.1 * self.need_seen)
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


@dataclass
class Confirmed:
    """A step whose gate flags were read: ``out`` (the step's HostCopy), whether it was replayed on
    the exact path, whether its time closes a throughput window, and whether it was skipped as
    non-finite."""

    step: int
    batch: tuple
    out: HostCopy
    replayed: bool = False
    timed: bool = True
    nonfinite: bool = False
    streak: int = 0  # consecutive non-finite steps up to and including this one


class StepPipeline:
    """Runs steps one ahead of their confirmation and replays overflowed ones.

        pipe = StepPipeline(run_step, gate, scheduler)   # run_step(batch, exact) -> HostCopy
        for c in pipe.submit(step, batch, settle):       # settle: confirm everything now
            log(c)

    Step s's flags are read on the host after step s+1 was launched. An overflowed step and the
    one after it (gated too: the flag is sticky) are re-run on the exact path and confirmed as
    replayed; ``before_replay()`` runs before the exact re-runs (e.g. to let graph replays finish)
    and ``on_replay(first_step, n_steps, grown_capacity_or_None)`` after them.
    ``nonfinite_streak`` counts consecutive confirmed non-finite steps. Without a gate every step
    is confirmed at once.
    """

    def __init__(self, run_step, gate: StepGate | None, scheduler, before_replay=None, on_replay=None):
        self.run_step, self.gate, self.scheduler = run_step, gate, scheduler
        self.before_replay, self.on_replay = before_replay, on_replay
        self.pending: list[tuple[int, tuple, HostCopy]] = []
        self.replayed_steps = 0
        self.nonfinite_streak = 0

    def submit(self, step: int, batch: tuple, settle: bool) -> list[Confirmed]:
        self.pending.append((step, batch, self.run_step(batch, False)))
        if self.gate is not None:
            self.gate.record(step)
        done = []
        while self.pending and (settle or self.gate is None or len(self.pending) > 1):
            s, b, out = self.pending[0]
            overflowed, nonfinite = self.gate.read(s) if self.gate is not None else (False, False)
            if overflowed:
                done += self._replay()
            else:
                self.pending.pop(0)
                done.append(self._count(Confirmed(s, b, out, nonfinite=nonfinite)))
        return done

    def _replay(self) -> list[Confirmed]:
        gate, pending = self.gate, self.pending
        if self.before_replay is not None:
            self.before_replay()
        rewind_lr(self.scheduler, len(pending))
        gate.clear()
        replayed = []
        with gate.exact_dispatch():
            for s, b, _ in pending:
                replayed.append((s, b, self.run_step(b, True)))
                gate.record(s)
        grown = gate.replayed(len(pending))
        if self.on_replay is not None:
            self.on_replay(pending[0][0], len(pending), grown)
        self.replayed_steps += len(pending)
        self.pending = []
        done = []
        for i, (s, b, out) in enumerate(replayed):
            _, nonfinite = gate.read(s)  # the exact path cannot overflow
            done.append(self._count(Confirmed(s, b, out, replayed=True, timed=i == len(replayed) - 1,
                                              nonfinite=nonfinite)))
        return done

    def _count(self, c: Confirmed) -> Confirmed:
        self.nonfinite_streak = self.nonfinite_streak + 1 if c.nonfinite else 0
        c.streak = self.nonfinite_streak
        return c


def stop_on_overflow(layers, step: int, capacity_factor: float) -> None:
    """on_overflow = "stop": one host read of this step's dropped assignments; raise if any."""
    dropped = int(allreduce_sum(torch.stack([moe.overflow_count for _, moe in layers]).sum()))
    if dropped:
        raise UserError(
            f"expert-parallel buffer overflow at step {step}: {dropped} (token, expert) assignments did not fit the "
            f"dispatcher's fixed capacity; the step was not applied — raise [moe_echo] capacity_factor (now "
            f"{capacity_factor}), use dispatcher = 'alltoall' or on_overflow = 'replay'")
