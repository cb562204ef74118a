"""Atomic, resumable DCP checkpoints under ``<dump_folder>/<checkpoint.folder>/step-<N>``.

A save writes into ``step-<N>.partial``, then (after every rank finished) rank 0 writes the
``COMPLETE`` marker and renames the folder to ``step-<N>``: a run killed at any moment leaves at
worst a ``.partial`` folder, which is never loaded and is removed by the next save.

The marker is JSON ``{"step": N, "files": {name: {"bytes": n, "sha256": hex}}}`` covering every file
DCP wrote, so a file damaged after the save (disk, copy, filesystem) is caught by :func:`verify` before
it is loaded; :func:`find_resumable` then falls back to the newest checkpoint that verifies.

What is saved: any ``Stateful`` objects the caller passes (the recipe passes the model — with its
router biases —, optimizer, lr scheduler and a train state with step, data position and RNG). The
marker also records the model's shape (``model.model_shape``: name, flavour and dimensions, see
components/moe_echo/models.py): loading into a model of another shape is refused with one line that
names the differing ``[model]`` key, before any tensor is read.
"""

import hashlib
import json
import logging
import os
import re
import shutil
import signal
import warnings

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from components.errors import UserError

MARKER = "COMPLETE"
_HASH = "sha256"  # fastest of hashlib's on CPUs with SHA extensions
_CHUNK = 1 << 20
_STEP_DIR = re.compile(r"^step-(\d+)$")
# Test hook: SIGKILL this process right after the data of step N is written, before the commit.
_FAULT_ENV = "MOE_ECHO_FAULT_KILL_AT_CHECKPOINT"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _from_rank0(obj):
    """``obj`` of rank 0, on every rank."""
    if _world() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _digest(path: str) -> str:
    h = hashlib.new(_HASH)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(path: str) -> list[str]:
    """Every file under checkpoint folder ``path`` but the marker, relative to it, sorted."""
    names = []
    for root, _, files in os.walk(path):
        names += [os.path.relpath(os.path.join(root, n), path) for n in files]
    return sorted(n for n in names if n != MARKER)


def _checksums(path: str) -> dict | None:
    """``{name: {"bytes": n, "sha256": hex}}`` of every file in ``path`` on rank 0 (None elsewhere).

    Rank 0 lists the files (one view of the shared filesystem); every rank hashes a share of them, so
    the save takes 1/world of the hashing time; rank 0 gathers the shares."""
    names = _from_rank0(_files(path) if _rank() == 0 else None)
    mine = {}
    for name in names[_rank()::_world()]:
        full = os.path.join(path, name)
        mine[name] = {"bytes": os.path.getsize(full), _HASH: _digest(full)}
    if _world() == 1:
        return mine
    shares = [None] * _world() if _rank() == 0 else None
    dist.gather_object(mine, shares, dst=0)
    return {k: v for share in shares for k, v in share.items()} if _rank() == 0 else None


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
    """Write ``states`` as ``<folder>/step-<step>`` (atomically, checksummed); keep the newest
    ``keep_latest_k`` complete checkpoints (0: all), always including this one."""
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
    files = _checksums(partial)
    if _rank() == 0:
        shape = _model_shape(states)
        with open(os.path.join(partial, MARKER), "w") as f:
            json.dump({"step": step, "files": files, **({"model": shape} if shape else {})}, f, indent=0)
            f.flush()
            os.fsync(f.fileno())
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.rename(partial, final)
        _fsync_dir(folder)
        if keep_latest_k > 0:  # this one (verified by construction) is kept even when older than others
            others = [p for _, p in complete_checkpoints(folder) if p != final]
            for old in others[: max(0, len(others) - (keep_latest_k - 1))]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def verify(path: str) -> str | None:
    """None when every file listed in the ``COMPLETE`` marker of checkpoint ``path`` exists with its
    recorded size and checksum, else a one-line reason naming the first bad file.

    A marker of the older format (just ``"<step>\\n"``, no checksums) counts as complete but
    unverified: None, nothing is checked."""
    try:
        with open(os.path.join(path, MARKER)) as f:
            text = f.read()
    except OSError as err:
        return f"unreadable {MARKER} marker ({err.strerror})"
    if text.strip().isdigit():
        return None
    try:
        files = json.loads(text)["files"]
        expected = {str(n): (int(r["bytes"]), str(r[_HASH])) for n, r in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"unreadable {MARKER} marker (not the JSON this recipe writes)"
    for name, (size, digest) in sorted(expected.items()):
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            return f"{name} is missing"
        try:
            actual = os.path.getsize(full)
            if actual != size:
                return f"{name} has {actual} bytes, {size} were written"
            if _digest(full) != digest:
                return f"{name} does not match its {_HASH} checksum"
        except OSError as err:
            return f"{name} is unreadable ({err.strerror})"
    return None


def find_resumable(folder: str, load_step: int = -1, warn=print) -> tuple[int, str] | None:
    """(step, path) of the newest complete checkpoint in ``folder`` that passes :func:`verify`
    (with ``load_step`` > 0: that step only); None when ``folder`` holds no complete checkpoint.

    Each corrupt one skipped is reported through ``warn`` (one line, on rank 0). Complete checkpoints
    of which none verifies, or a corrupt or missing ``load_step``, are a UserError. Rank 0 hashes and
    broadcasts its answer, so every rank resumes from the same checkpoint (or raises the same error)."""
    answer = None
    if _rank() == 0:
        try:
            answer = ("found", _newest_verified(folder, load_step, warn))
        except UserError as err:
            answer = ("error", str(err))
    kind, value = _from_rank0(answer)
    if kind == "error":
        raise UserError(value)
    return value


def _newest_verified(folder: str, load_step: int, warn) -> tuple[int, str] | None:
    found = complete_checkpoints(folder)
    if load_step > 0:
        found = [(s, p) for s, p in found if s == load_step]
        if not found:
            raise UserError(f"[checkpoint] load_step = {load_step}: no complete checkpoint "
                            f"step-{load_step} in {folder!r}")
        reason = verify(found[0][1])
        if reason is not None:
            raise UserError(f"[checkpoint] load_step = {load_step}: checkpoint {found[0][1]!r} could not be "
                            f"loaded: it failed verification ({reason}); pick another load_step or -1 (newest)")
        return found[0]
    first = None
    for step, path in reversed(found):
        reason = verify(path)
        if reason is None:
            return step, path
        first = first or (path, reason)
        warn(f"warning: checkpoint {path} is corrupt ({reason}); falling back to the previous one")
    if first is not None:
        raise UserError(f"checkpoints in {folder!r} could not be loaded: all {len(found)} failed verification "
                        f"(newest, {first[0]}: {first[1]}); delete the folder or set --checkpoint.enable false")
    return None


def verify_initial(path: str, key: str = "[checkpoint] initial_load_path") -> None:
    """Check the weights a fine-tune starts from as a resume checks its own checkpoint: a ``step-N`` folder
    with this recipe's ``COMPLETE`` marker must pass :func:`verify` (rank 0 hashes, every rank gets the
    answer), else a one-line UserError naming the damaged file. A folder without a marker (another
    trainer's DCP checkpoint) or with the older marker has no checksums to check."""
    reason = verify(path) if _rank() == 0 and os.path.isfile(os.path.join(path, MARKER)) else None
    reason = _from_rank0(reason)
    if reason is not None:
        raise UserError(f"{key} = {path!r} failed verification: {reason}; the checkpoint is damaged: copy it "
                        "again, or point initial_load_path at another step-N folder")


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


def _match_stored(path: str, states: dict) -> None:
    """Tell each state that can adapt (``match_stored(keys)``) which of its entries ``path`` stored as tensors,
    so its template matches what is there (a learning rate that earlier versions saved as a device tensor)."""
    adapting = {name: st for name, st in states.items() if hasattr(st, "match_stored")}
    if not adapting:
        return
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for name, st in adapting.items():
        st.match_stored({k[len(name) + 1:] for k, m in stored.items()
                         if k.startswith(name + ".") and isinstance(m, TensorStorageMetadata)})


def _model_shape(states: dict) -> dict | None:
    """``model_shape`` of the model a state in ``states`` holds (``.model``), if any."""
    for st in states.values():
        shape = getattr(getattr(st, "model", None), "model_shape", None)
        if shape:
            return dict(shape)
    return None


def saved_model_shape(path: str) -> dict | None:
    """The model shape checkpoint ``path`` was saved with; None when its marker records none."""
    try:
        with open(os.path.join(path, MARKER)) as f:
            shape = json.load(f).get("model")
    except (OSError, ValueError, AttributeError):
        return None
    return shape if isinstance(shape, dict) else None


def check_model_shape(path: str, model, what: str, fix: str = "") -> None:
    """One-line UserError when checkpoint ``path`` holds another model than ``model`` (by
    ``model_shape``): ``what`` names the checkpoint in the message, ``fix`` is appended to it."""
    saved, ours = saved_model_shape(path), getattr(model, "model_shape", None)
    if not saved or not ours:
        return
    keys = ["name", "flavor", *[k for k in saved if k not in ("name", "flavor")]]
    differ = [k for k in keys if k in saved and saved[k] != ours.get(k)]
    if differ:
        held = ", ".join(f"{k} = {saved[k]!r} (the config asks for {ours.get(k)!r})" for k in differ)
        raise UserError(f"{what} holds a model with [model] {held}; set "
                        f"{' '.join(f'--model.{k} {saved[k]}' for k in differ)}{fix}")


def load(path: str, states: dict) -> None:
    """Load ``states`` in place from checkpoint ``path``; any failure is a one-line UserError (a model
    of another shape than the one saved: naming the differing ``[model]`` key)."""
    if not os.path.isdir(path):
        raise UserError(f"checkpoint not found: {path!r} (expected a step-N folder written by this recipe)")
    if not os.path.isfile(os.path.join(path, MARKER)) and _STEP_DIR.match(os.path.basename(path.rstrip("/"))):
        raise UserError(f"checkpoint {path!r} is incomplete (no {MARKER} marker); move it aside or pick another")
    model = next((st.model for st in states.values() if hasattr(st, "model")), None)
    check_model_shape(path, model, f"checkpoint {path!r}",
                      " to resume it, or give a new --job.dump_folder to start afresh")
    try:
        with warnings.catch_warnings(), _quiet_dcp_logs():
            warnings.simplefilter("ignore", UserWarning)
            _match_stored(path, states)
            dcp.load(states, checkpoint_id=path)
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        first = _root_cause(err)
        raise UserError(
            f"checkpoint {path!r} could not be loaded ({first}); "
            "it is corrupt or from another model — move it aside or set --checkpoint.enable false"
        ) from None
