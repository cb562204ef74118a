"""Atomic, resumable DCP checkpoints under ``<dump_folder>/<checkpoint.folder>/step-<N>``.

A save writes into ``step-<N>.partial``, then (after every rank finished) rank 0 writes the
``COMPLETE`` marker and renames the folder to ``step-<N>``: a run killed at any moment leaves at
worst a ``.partial`` folder, which is never loaded and is removed by the next save.

What is saved: any ``Stateful`` objects the caller passes (the recipe passes the model — with its
router biases —, optimizer, lr scheduler and a train state with step, data position and RNG).
"""

import logging
import os
import re
import shutil
import signal
import warnings

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .errors import UserError

MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step-(\d+)$")
# Test hook: SIGKILL this process right after the data of step N is written, before the commit.
_FAULT_ENV = "MOE_ECHO_FAULT_KILL_AT_CHECKPOINT"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def complete_checkpoints(folder: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint in ``folder``, oldest first."""
    if not os.path.isdir(folder):
        return []
    found = []
    for name in os.listdir(folder):
        m = _STEP_DIR.match(name)
        path = os.path.join(folder, name)
        if m and os.path.isfile(os.path.join(path, MARKER)):
            found.append((int(m.group(1)), path))
    return sorted(found)


def save(folder: str, step: int, states: dict, keep_latest_k: int = 0) -> str:
    final = os.path.join(folder, f"step-{step}")
    partial = final + ".partial"
    if _rank() == 0:
        os.makedirs(folder, exist_ok=True)
        for name in os.listdir(folder):  # leftovers of killed saves
            if name.endswith(".partial"):
                shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
    _barrier()
    with warnings.catch_warnings():  # single-process saves warn that no process group exists
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(states, checkpoint_id=partial)
    _barrier()
    if os.environ.get(_FAULT_ENV) == str(step):
        os.kill(os.getpid(), signal.SIGKILL)
    if _rank() == 0:
        with open(os.path.join(partial, MARKER), "w") as f:
            f.write(f"{step}\n")
            f.flush()
            os.fsync(f.fileno())
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.rename(partial, final)
        _fsync_dir(folder)
        if keep_latest_k > 0:
            for _, old in complete_checkpoints(folder)[:-keep_latest_k]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _quiet_dcp_logs:
    """DCP logs full tracebacks of a failed load on the root logger; our one-line error replaces them."""

    def __enter__(self):
        self.previous = logging.root.manager.disable
        logging.disable(logging.CRITICAL)

    def __exit__(self, *exc):
        logging.disable(self.previous)


def _root_cause(err: BaseException) -> str:
    """Last non-empty line of the (possibly multi-rank, multi-line) error text, shortened."""
    lines = [l.strip() for l in str(err).splitlines() if l.strip()]
    return (lines[-1] if lines else "")[:200]


def load(path: str, states: dict) -> None:
    """Load ``states`` in place from checkpoint ``path``; any failure is a one-line UserError."""
    if not os.path.isdir(path):
        raise UserError(f"checkpoint not found: {path!r} (expected a step-N folder written by this recipe)")
    if not os.path.isfile(os.path.join(path, MARKER)) and _STEP_DIR.match(os.path.basename(path.rstrip("/"))):
        raise UserError(f"checkpoint {path!r} is incomplete (no {MARKER} marker); delete it or pick another")
    try:
        with warnings.catch_warnings(), _quiet_dcp_logs():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(states, checkpoint_id=path)
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        first = _root_cause(err)
        raise UserError(
            f"checkpoint {path!r} could not be loaded ({first}); "
            "it is corrupt or from another model — delete it or set --checkpoint.enable false"
        ) from None
