"""The recipes' ``main``: run the training function, turn known failures and Ctrl-C into one line and
an exit code, and shut the process group down.

    error: <message>      exit 2    bad input (UserError: config, data, tokenizer, checkpoint)
    error: <message>      exit 3    too many consecutive non-finite steps (NonFiniteError)
    error: <message>      exit 4    a collective timed out or lost its connection: a peer rank (or its
                                    host) is hung or dead
    stopped at step N...  exit 130  SIGINT (Ctrl-C); exit 143 for SIGTERM (e.g. Slurm's scancel)

Bad input and non-finite stops are the same on every rank, so only rank 0 prints them (the other
ranks exit a moment later, so torchrun's stop of the job cannot cut rank 0 off before its line); a
timeout or a lost peer is seen by the ranks still running, so each of them prints its own line.

SIGINT and SIGTERM (torchrun forwards either to every worker) stop the run where it is: the logs are
closed (metrics.jsonl holds every logged step, TensorBoard's events are flushed) and rank 0 prints
``stopped at step N; the last checkpoint is step-M; run the same command to resume`` (N: the last
step logged or confirmed). A checkpoint being written when the signal comes is finished first
(``stop.deferred()``), so it is complete or, if the process is killed, a ``.partial`` folder that is
never loaded. A rank still blocked ``STOP_GRACE_S`` later (a collective whose peer is gone) prints
the same line and exits; a second signal exits at once.
"""

import os
import re
import signal
import sys
import threading
import time
from contextlib import contextmanager

import torch.distributed as dist

from components.errors import NonFiniteError, PeerTimeoutError, UserError

from .config import help_text
from .starting import STARTING_LINE

_QUIET_RANK_DELAY_S = 3.0
_LOST_PEER = ("connection closed by peer", "connection reset by peer", "remote process exited")
STOP_GRACE_S = 10.0  # within torchrun's 30 s between its forwarded signal and SIGKILL


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread by SIGINT or SIGTERM (``signum``)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopRequest:
    """What a SIGINT or SIGTERM found: the signal, and where the run was (the training loop sets
    ``step``, the last step it logged or confirmed, and ``folder``, its checkpoint folder or None
    when checkpoints are off; ``step`` None: the run was still starting)."""

    def __init__(self, grace_s: float = STOP_GRACE_S):
        self.grace_s = grace_s
        self.signum: int | None = None
        self.step: int | None = None
        self.folder: str | None = None
        self.deferring = False  # a checkpoint is being written: record the signal, stop after it
        self.ending = False  # the run is reporting how it ended: record the signal only
        self.rank = 0
        self._said = threading.Lock()

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGINT)

    def track(self, step: int, folder: str | None) -> None:
        self.step, self.folder = step, folder

    @contextmanager
    def deferred(self):
        """A signal inside waits for the block to finish, then stops the run (a checkpoint being written
        is completed, not abandoned)."""
        before, self.deferring = self.deferring, True
        try:
            yield
        finally:
            self.deferring = before
        if self.signum is not None and not before:
            raise Interrupted(self.signum)

    def line(self) -> str:
        if self.step is None:
            return STARTING_LINE
        from .checkpoint import complete_checkpoints

        done = complete_checkpoints(self.folder) if self.folder else []
        if done:
            return f"stopped at step {self.step}; the last checkpoint is step-{done[-1][0]}; run the same command to resume"
        return (f"stopped at step {self.step}; no checkpoint was saved"
                + ("" if self.folder else " ([checkpoint] enable = false)") + "; the same command starts over")

    def say(self) -> None:
        """The line, once per process, on rank 0."""
        if self.rank == 0 and self._said.acquire(blocking=False):
            sys.stdout.flush()
            say_line(self.line())

    def install(self, rank: int) -> None:
        self.rank = rank
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        if self.signum is not None:  # a second signal: stop now
            self._exit_now()
        self.signum = signum
        threading.Thread(target=self._grace, name="moe-echo-stop", daemon=True).start()
        if not (self.deferring or self.ending):
            raise Interrupted(signum)

    def _grace(self) -> None:
        """A rank still running ``grace_s`` after the signal (blocked in a collective whose peer has
        gone) exits; not while a checkpoint is being written."""
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline or self.deferring:
            time.sleep(0.2)
        self._exit_now()

    def _exit_now(self) -> None:
        try:
            self.say()
        finally:
            os._exit(self.exit_code)


stop = StopRequest()


def _is_timeout(err: BaseException) -> bool:
    """A collective's timeout (gloo raises it as a RuntimeError, NCCL with blocking wait as a
    DistBackendError); other errors that merely mention a timeout are not mislabelled."""
    text = str(err).lower()
    if isinstance(err, dist.DistBackendError):
        return "timeout" in text or "timed out" in text
    return isinstance(err, RuntimeError) and "timed out" in text and ("gloo" in text or "collective" in text
                                                                       or "wait" in text)


def _peer_lost(err: BaseException) -> bool:
    """A collective's connection to a peer closed under it: the peer's process or host died (gloo reports the
    closed socket; NCCL a remote error)."""
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(s in text for s in _LOST_PEER)


def _interrupted() -> bool:
    """A signal came (a call, so a handler still pending in the interpreter runs first: a peer that stopped on
    the same signal may have broken this rank's collective before this rank's handler ran)."""
    return stop.signum is not None


def say_line(text: str) -> None:
    """``text`` and a newline to stderr in one write: the ranks of a host share their agent's stderr, and lines
    that several ranks print at once (a lost peer) must not run into each other (writes of a pipe's atomic size
    are never interleaved)."""
    sys.stderr.flush()
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a stderr without a file descriptor (captured in-process)
        print(text, file=sys.stderr, flush=True)
        return
    os.write(fd, (text + "\n").encode())


def run_recipe(train_fn, argv: list[str] | None = None, help_note: str = "") -> None:
    """``train_fn(argv)`` with the exits above. ``help_note``: the recipe's own notes, printed before the
    keys by ``--help``."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print((help_note.strip() + "\n\n" if help_note.strip() else "") + help_text(argv))
        return
    rank = int(os.environ.get("RANK", "0"))
    stop.install(rank)
    try:
        try:
            train_fn(argv)
        finally:
            stop.ending = True  # a signal from here on is recorded, not raised into the reporting below
    except BaseException as err:
        if _interrupted():
            stop.say()
            _shutdown()
            sys.exit(stop.exit_code)
        if isinstance(err, (UserError, NonFiniteError)):
            if rank == 0:
                say_line(f"error: {err}")
            else:
                time.sleep(_QUIET_RANK_DELAY_S)  # torchrun stops every rank once one exits: rank 0 exits first
            _shutdown()
            sys.exit(err.exit_code)
        if isinstance(err, PeerTimeoutError):
            say_line(f"error: [rank {rank}] {err}")
            sys.stdout.flush()
            os._exit(err.exit_code)  # the process group cannot be shut down cleanly without the peer
        timeout, lost = _is_timeout(err), _peer_lost(err)
        if not (timeout or lost):
            raise
        text = str(err).strip()
        first = text.splitlines()[0] if text else type(err).__name__
        first = re.sub(r"^\[[^\]]*\.cc:\d+\]\s*", "", first).split(". ")[0][:160]  # gloo's without its source line
        if timeout:
            say_line(f"error: [rank {rank}] a collective timed out ({first}): a peer rank is hung or dead; "
                     "[comm] train_timeout_seconds sets the limit")
        else:
            say_line(f"error: [rank {rank}] a collective lost its connection to a peer ({first}): a peer rank or its "
                     "host died; resume from the last checkpoint")
        sys.stdout.flush()
        os._exit(PeerTimeoutError.exit_code)
    _shutdown()


def _shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
