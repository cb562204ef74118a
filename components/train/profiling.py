"""torchtitan's ``[profiling]`` keys: PyTorch profiler traces and CUDA memory snapshots.

    prof = StepProfiler(cfg.profiling, dump_folder, rank, start_step, device)
    prof.step()     # once per training step, after the step's work is launched
    prof.close()    # after the loop (close(exc) from an error path)

Files, ``<step>`` being the training step number (resumed runs included):

- ``enable_profiling``: a Chrome trace JSON (Perfetto or chrome://tracing) of the last
  ``profiler_active`` steps of every ``profile_freq`` steps, after ``profiler_warmup`` warm-up steps:
  ``<dump>/<save_traces_folder>/iteration_<step>/rank<rank>_trace.json``, ``<step>`` the last step
  traced. The profiler's ``ProfilerStep#<n>`` spans are training step ``n``.
- ``enable_memory_snapshot`` (CUDA only): the allocator history, every ``profile_freq`` steps and at
  close, for https://pytorch.org/memory_viz:
  ``<dump>/<save_memory_snapshot_folder>/iteration_<step>/rank<rank>_memory_snapshot.pickle``; a close
  after an out-of-memory error writes ``iteration_<step>_exit`` (``<step>`` the last finished step).

With both keys off every method is a no-op. ``written`` lists the files written so far.
"""

import os
import time
from typing import Callable

import torch
from torch.profiler import ProfilerAction

from components.errors import UserError

MEMORY_SNAPSHOT_MAX_ENTRIES = 100_000  # alloc/free events kept in the history (torchtitan's value)
_RECORDING = (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)


def check(cfg, device) -> None:
    """Raise ``UserError`` for ``[profiling]`` values that cannot work on ``device``."""
    if cfg.enable_profiling:
        freq, warmup, active = cfg.profile_freq, cfg.profiler_warmup, cfg.profiler_active
        if active < 1 or warmup < 0:
            raise UserError(
                f"[profiling] profiler_active = {active}, profiler_warmup = {warmup}: need "
                "profiler_active >= 1 and profiler_warmup >= 0")
        if freq < warmup + active:
            raise UserError(
                f"[profiling] profile_freq = {freq} is less than profiler_warmup + profiler_active = "
                f"{warmup} + {active}; raise profile_freq to at least {warmup + active} or lower the others")
    if cfg.enable_memory_snapshot:
        if torch.device(device).type != "cuda":
            raise UserError(
                f"[profiling] enable_memory_snapshot needs a CUDA device; this run is on "
                f"{torch.device(device)}: set it to false")
        if cfg.profile_freq < 1:
            raise UserError(f"[profiling] profile_freq = {cfg.profile_freq}: need >= 1 for the memory snapshots")


class StepProfiler:
    """Profiler traces and memory snapshots at torchtitan's steps; see the module docstring."""

    def __init__(self, cfg, dump_folder: str, rank: int, start_step: int, device, *,
                 with_stack: bool = False, record_shapes: bool = False,
                 log: Callable[[str], None] | None = None):
        check(cfg, device)
        self.device, self.rank, self.log = torch.device(device), rank, log
        self.step_num = start_step  # the last finished training step
        self.freq = cfg.profile_freq
        self.written: list[str] = []
        self.trace_folder = (os.path.join(dump_folder, cfg.save_traces_folder)
                             if cfg.enable_profiling else None)
        self.snapshot_folder = (os.path.join(dump_folder, cfg.save_memory_snapshot_folder)
                                if cfg.enable_memory_snapshot else None)
        self._closed = False
        self._torch = None
        if self.trace_folder:
            self._start_traces(cfg, start_step, with_stack, record_shapes)
        self._snapshot_step = None  # step of the last snapshot written
        if self.snapshot_folder:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_SNAPSHOT_MAX_ENTRIES, device=self.device)

    @property
    def enabled(self) -> bool:
        return self._torch is not None or self.snapshot_folder is not None

    def _start_traces(self, cfg, start_step, with_stack, record_shapes) -> None:
        warmup, active = cfg.profiler_warmup, cfg.profiler_active
        cycle = torch.profiler.schedule(wait=cfg.profile_freq - warmup - active, warmup=warmup, active=active)
        # torch's profiler counts step() calls; its step_num is kept at the training step that runs next,
        # so the action chosen after step s finished is torchtitan's schedule(s). The profiler asks the
        # schedule once at step_num 0 while it is built: that answer is for start_step.
        shift = [start_step]

        def schedule(n: int) -> ProfilerAction:
            return cycle(n + shift[0])

        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._torch = torch.profiler.profile(activities=activities, schedule=schedule,
                                             on_trace_ready=self._trace_ready, record_shapes=record_shapes,
                                             with_stack=with_stack)
        shift[0] = -1
        self._torch.step_num = start_step + 1
        self._recorded = 0  # finished steps in the open trace window
        self._drop_trace = False
        self._torch.__enter__()

    def _trace_ready(self, p) -> None:
        recorded, self._recorded = self._recorded, 0
        if self._drop_trace and not recorded:
            return  # closed before any step of this window ran
        folder = os.path.join(self.trace_folder, f"iteration_{self.step_num}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}_trace.json")
        begin = time.monotonic()
        p.export_chrome_trace(path)
        self.written.append(path)
        if self.log:
            self.log(f"profiler trace of step {self.step_num} ({time.monotonic() - begin:.1f} s to write): {path}")

    def _snapshot(self, name: str) -> None:
        folder = os.path.join(self.snapshot_folder, name)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}_memory_snapshot.pickle")
        torch.cuda.memory._dump_snapshot(path)
        self.written.append(path)
        self._snapshot_step = self.step_num
        if self.log:
            self.log(f"memory snapshot: {path}")

    def step(self) -> None:
        """Mark the end of one training step (its work launched)."""
        if self._closed or not self.enabled:
            return
        self.step_num += 1
        if self._torch is not None:
            if self._torch.current_action in _RECORDING:
                self._recorded += 1
            self._torch.step()
        if self.snapshot_folder and self.step_num % self.freq == 0:
            self._snapshot(f"iteration_{self.step_num}")

    def close(self, exc: BaseException | None = None) -> None:
        """Stop profiling: write the open trace window if it holds a finished step, a last memory
        snapshot (``_exit`` after an out-of-memory ``exc``), and stop the allocator history."""
        if self._closed:
            return
        self._closed = True
        if self._torch is not None:
            self._drop_trace = True
            self._torch.__exit__(None, None, None)
            self._torch = None
        if self.snapshot_folder:
            try:
                if isinstance(exc, torch.OutOfMemoryError):
                    self._snapshot(f"iteration_{self.step_num}_exit")
                elif exc is None and self._snapshot_step != self.step_num:
                    self._snapshot(f"iteration_{self.step_num}")
            finally:
                torch.cuda.memory._record_memory_history(enabled=None, device=self.device)

    def __enter__(self) -> "StepProfiler":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exc)
