"""Checksummed checkpoints: damaged files are named by verify(), find_resumable() falls back to the
newest good checkpoint, and old-format markers still load."""

import json
import os

import pytest
import torch

from components.errors import UserError
from components.train import checkpoint

SHAPE = (256, 1024)  # 1 MiB of float32 per tensor: the middle of a .distcp file is tensor data


def states(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w1": torch.randn(SHAPE, generator=g), "w2": torch.randn(SHAPE, generator=g)}}


def empty() -> dict:
    return {"model": {"w1": torch.zeros(SHAPE), "w2": torch.zeros(SHAPE)}}


@pytest.fixture
def folder(tmp_path):
    d = str(tmp_path / "checkpoint")
    checkpoint.save(d, 1, states(1))
    checkpoint.save(d, 2, states(2))
    return d


def largest(path: str) -> str:
    return max(os.listdir(path), key=lambda n: os.path.getsize(os.path.join(path, n)))


def scribble(path: str, name: str, n: int = 64 << 10) -> None:
    """Overwrite ``n`` random bytes in the middle of ``path/name`` (same size: only the checksum can tell)."""
    full = os.path.join(path, name)
    size = os.path.getsize(full)
    n = min(n, size // 2)
    with open(full, "r+b") as f:
        f.seek(size // 2 - n // 2)
        f.write(os.urandom(n))


def test_saves_record_every_file_and_verify(folder):
    paths = [p for _, p in checkpoint.complete_checkpoints(folder)]
    assert [os.path.basename(p) for p in paths] == ["step-1", "step-2"]
    for p in paths:
        marker = json.load(open(os.path.join(p, checkpoint.MARKER)))
        assert set(marker["files"]) == set(os.listdir(p)) - {checkpoint.MARKER}
        assert ".metadata" in marker["files"] and any(n.endswith(".distcp") for n in marker["files"])
        assert checkpoint.verify(p) is None
    assert checkpoint.find_resumable(folder, warn=pytest.fail) == (2, paths[1])


def test_random_bytes_in_the_middle_are_named_and_skipped(folder):
    step1, step2 = (p for _, p in checkpoint.complete_checkpoints(folder))
    name = largest(step2)
    assert name.endswith(".distcp") and os.path.getsize(os.path.join(step2, name)) > 4 * (64 << 10)
    scribble(step2, name)
    reason = checkpoint.verify(step2)
    assert reason is not None and name in reason and "checksum" in reason
    assert checkpoint.verify(step1) is None
    warnings = []
    assert checkpoint.find_resumable(folder, warn=warnings.append) == (1, step1)
    assert len(warnings) == 1 and warnings[0].startswith("warning: checkpoint ")
    assert step2 in warnings[0] and name in warnings[0] and "falling back" in warnings[0]
    loaded = empty()  # the fallback really loads, with step 1's values
    checkpoint.load(step1, loaded)
    assert torch.equal(loaded["model"]["w1"], states(1)["model"]["w1"])


def test_every_checkpoint_corrupt_is_a_user_error(folder):
    for _, p in checkpoint.complete_checkpoints(folder):
        scribble(p, largest(p))
    warnings = []
    with pytest.raises(UserError) as err:
        checkpoint.find_resumable(folder, warn=warnings.append)
    msg = str(err.value)
    assert "\n" not in msg and "all 2 failed verification" in msg and "step-2" in msg and ".distcp" in msg
    assert "delete the folder or set --checkpoint.enable false" in msg
    assert len(warnings) == 2


def test_load_step_picks_one_and_a_corrupt_one_is_a_user_error(folder):
    step1, step2 = (p for _, p in checkpoint.complete_checkpoints(folder))
    assert checkpoint.find_resumable(folder, load_step=1, warn=pytest.fail) == (1, step1)
    scribble(step1, largest(step1))
    with pytest.raises(UserError, match=r"load_step = 1: .*step-1.*failed verification \(__\d+_\d+\.distcp"):
        checkpoint.find_resumable(folder, load_step=1, warn=pytest.fail)
    with pytest.raises(UserError, match="no complete checkpoint step-3"):
        checkpoint.find_resumable(folder, load_step=3)
    assert checkpoint.find_resumable(folder, load_step=2, warn=pytest.fail) == (2, step2)


def test_missing_file_truncation_and_bad_marker_are_named(folder):
    step1, step2 = (p for _, p in checkpoint.complete_checkpoints(folder))
    os.remove(os.path.join(step2, ".metadata"))
    assert checkpoint.verify(step2) == ".metadata is missing"
    name = largest(step1)
    with open(os.path.join(step1, name), "r+b") as f:
        f.truncate(100)
    reason = checkpoint.verify(step1)
    assert name in reason and "100 bytes" in reason
    with open(os.path.join(step1, checkpoint.MARKER), "w") as f:
        f.write('{"step": 1, "fil')
    assert "unreadable COMPLETE marker" in checkpoint.verify(step1)


def test_old_format_marker_loads_unverified(folder):
    step2 = checkpoint.complete_checkpoints(folder)[-1][1]
    with open(os.path.join(step2, checkpoint.MARKER), "w") as f:
        f.write("2\n")
    assert checkpoint.verify(step2) is None
    assert checkpoint.find_resumable(folder, warn=pytest.fail) == (2, step2)
    loaded = empty()
    checkpoint.load(step2, loaded)
    assert torch.equal(loaded["model"]["w2"], states(2)["model"]["w2"])


def test_no_checkpoint_is_none(tmp_path):
    assert checkpoint.find_resumable(str(tmp_path / "absent")) is None
    os.makedirs(tmp_path / "c" / "step-3.partial")
    assert checkpoint.find_resumable(str(tmp_path / "c")) is None


def test_pruning_keeps_the_new_checkpoint_even_behind_a_newer_corrupt_one(folder):
    checkpoint.save(folder, 5, states(5))
    step5 = checkpoint.complete_checkpoints(folder)[-1][1]
    scribble(step5, largest(step5))  # a run resumed from step 2 saves step 3 with keep_latest_k = 1
    checkpoint.save(folder, 3, states(3), keep_latest_k=1)
    assert [s for s, _ in checkpoint.complete_checkpoints(folder)] == [3]
    assert checkpoint.find_resumable(folder, warn=pytest.fail)[0] == 3
