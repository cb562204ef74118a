"""Hang reports: when no training step has finished for ``timeout_s``, each rank prints where its
Python threads are (a rank stuck in a collective, a peer-memory barrier or a host wait shows up).

    dog = StepWatchdog(timeout_s=900, rank=rank)   # 0 = off
    dog.beat(step)                                 # after each confirmed step
    dog.close()

One report per stall (the next ``beat`` re-arms it); the run itself is not stopped.
"""

import faulthandler
import sys
import threading
import time


class StepWatchdog:
    def __init__(self, timeout_s: float, rank: int, out=None):
        self.timeout_s, self.rank = timeout_s, rank
        self.out = out if out is not None else sys.stderr
        self.last, self.step, self.reported = time.monotonic(), 0, False
        self.reports = 0
        self._stop = threading.Event()
        self._thread = None
        if timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="moe-echo-watchdog", daemon=True)
            self._thread.start()

    def limit(self, timeout_s: float) -> None:
        """Report after ``timeout_s`` from now on (at most the limit given at construction; e.g. a
        share of the collective timeout, so the report comes before the run is ended)."""
        if self._thread is not None:
            self.timeout_s = min(self.timeout_s, timeout_s)

    def beat(self, step: int) -> None:
        self.last, self.step, self.reported = time.monotonic(), step, False

    def _watch(self) -> None:
        while not self._stop.wait(min(self.timeout_s / 4, 2.0)):
            idle = time.monotonic() - self.last
            if idle >= self.timeout_s and not self.reported:
                self.reported = True
                self.reports += 1
                self.out.write(f"[rank {self.rank}] no training step has finished for {idle:.0f} s (last finished: "
                               f"step {self.step}); this rank's Python stacks follow. [training] hang_report_s sets "
                               "the limit (0: off)\n")  # one write: other ranks report into the same stderr
                self.out.flush()
                faulthandler.dump_traceback(file=self.out, all_threads=True)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
