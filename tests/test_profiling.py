"""[profiling]: traces land at torchtitan's steps under the training step's number (resumed runs
too), hold the step's ops and open as Chrome-trace JSON; bad values are one-line config errors;
memory snapshots (GPU) at every profile_freq steps and at close; off means no files."""

import contextlib
import dataclasses
import json
import os
import pickle

import pytest
import torch
from torchtitan.tools import profiling as tt_profiling

from components.errors import UserError
from components.train.profiling import StepProfiler


@dataclasses.dataclass
class Prof:
    enable_profiling: bool = True
    save_traces_folder: str = "profile_traces"
    profile_freq: int = 4
    profiler_active: int = 1
    profiler_warmup: int = 1
    enable_memory_snapshot: bool = False
    save_memory_snapshot_folder: str = "memory_snapshot"


def _work(device="cpu"):
    a = torch.randn(64, 64, device=device)
    return a @ a


def _run(cfg, dump, start, stop, rank=0, device="cpu"):
    """Steps start+1 .. stop, as the recipe runs them."""
    prof = StepProfiler(cfg, str(dump), rank, start, device)
    for _ in range(start, stop):
        _work(device)
        prof.step()
    prof.close()
    return prof


def _iterations(folder):
    return sorted(int(d.split("_")[1]) for d in os.listdir(folder)) if os.path.isdir(folder) else []


def _torchtitan_iterations(cfg, dump, start, stop, monkeypatch):
    """Where torchtitan's trainer loop would put the traces for the same run."""
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    profile = torch.profiler.profile  # torchtitan passes a None activity without a GPU; newer torch refuses it
    monkeypatch.setattr(torch.profiler, "profile",
                        lambda activities, **kw: profile(activities=[a for a in activities if a], **kw))
    with tt_profiling.maybe_enable_profiling(cfg, global_step=start, base_folder=str(dump)) as p:
        for _ in range(start, stop):
            _work()
            p.step()
    return _iterations(os.path.join(dump, cfg.save_traces_folder))


def _events(path):
    with open(path) as f:
        return json.load(f)["traceEvents"]


def test_traces_at_torchtitans_steps_hold_the_steps_ops(tmp_path):
    cfg = Prof()
    prof = _run(cfg, tmp_path, 0, 9, rank=3)
    folder = tmp_path / "profile_traces"
    assert _iterations(folder) == [4, 8]
    assert prof.written == [str(folder / f"iteration_{s}" / "rank3_trace.json") for s in (4, 8)]
    for s in (4, 8):
        names = {e.get("name", "") for e in _events(folder / f"iteration_{s}" / "rank3_trace.json")}
        assert any("mm" in n or "matmul" in n for n in names), sorted(names)[:20]
        assert f"ProfilerStep#{s}" in names  # the profiler's step span is the training step
        assert f"ProfilerStep#{s - 1}" not in names  # the warm-up step is not in the trace


@pytest.mark.parametrize("start", [0, 5, 10])
@pytest.mark.parametrize("freq,warmup,active", [(4, 1, 1), (5, 2, 2), (3, 0, 1), (2, 1, 1)])
def test_a_trace_every_profile_freq_steps_as_torchtitan(tmp_path, monkeypatch, start, freq, warmup, active):
    cfg = Prof(profile_freq=freq, profiler_warmup=warmup, profiler_active=active)
    stop = (start // freq + 4) * freq  # ends after a traced step: no open window at close
    ours = _iterations(_run(cfg, tmp_path / "ours", start, stop).trace_folder)
    assert ours == [s for s in range(start + 1, stop + 1) if s % freq == 0]
    if start % freq == 0:  # resumed mid-cycle, torchtitan's first window follows step 0's place in the cycle
        assert ours == _torchtitan_iterations(cfg, tmp_path / "tt", start, stop, monkeypatch)


def test_resumed_run_names_folders_by_the_true_step(tmp_path):
    prof = _run(Prof(), tmp_path, 5, 13)  # steps 6..13
    folder = tmp_path / "profile_traces"
    assert _iterations(folder) == [8, 12]
    assert "ProfilerStep#12" in {e.get("name") for e in _events(prof.written[-1])}


def test_close_writes_an_open_window_only_if_it_holds_a_finished_step(tmp_path):
    # freq 4, warmup 1, active 2: steps 3 and 4 are traced; the run ends after step 3
    prof = _run(Prof(profiler_active=2), tmp_path / "a", 0, 3)
    assert _iterations(prof.trace_folder) == [3]
    assert "ProfilerStep#3" in {e.get("name") for e in _events(prof.written[0])}
    # freq 4, warmup 1, active 1: step 4 would be traced; the run ends after step 3
    prof = _run(Prof(), tmp_path / "b", 0, 3)
    assert prof.written == [] and _iterations(prof.trace_folder) == []


@pytest.mark.parametrize("freq,warmup,active,key", [(3, 3, 1, "profile_freq"), (4, 1, 0, "profiler_active"),
                                                    (4, -1, 1, "profiler_warmup")])
def test_bad_schedule_is_a_one_line_config_error(tmp_path, freq, warmup, active, key):
    cfg = Prof(profile_freq=freq, profiler_warmup=warmup, profiler_active=active)
    with pytest.raises(UserError, match=rf"\[profiling\] .*{key}") as e:
        StepProfiler(cfg, str(tmp_path), 0, 0, "cpu")
    assert "\n" not in str(e.value)
    assert not os.listdir(tmp_path)


def test_memory_snapshot_on_cpu_is_a_config_error(tmp_path):
    cfg = Prof(enable_profiling=False, enable_memory_snapshot=True)
    with pytest.raises(UserError, match=r"\[profiling\] enable_memory_snapshot needs a CUDA device; "):
        StepProfiler(cfg, str(tmp_path), 0, 0, torch.device("cpu"))


def test_disabled_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.profiler, "profile", None)  # never built
    with StepProfiler(Prof(enable_profiling=False), str(tmp_path), 0, 0, "cpu") as prof:
        for _ in range(9):
            _work()
            prof.step()
    assert not prof.enabled and prof.written == [] and prof.trace_folder is None
    assert not os.listdir(tmp_path)


@pytest.mark.gpu
def test_memory_snapshots_every_freq_steps_and_at_close(tmp_path):
    cfg = Prof(enable_profiling=True, enable_memory_snapshot=True, profile_freq=4)
    prof = _run(cfg, tmp_path, 2, 11, rank=1, device="cuda")  # steps 3..11
    snaps = tmp_path / "memory_snapshot"
    assert _iterations(snaps) == [4, 8, 11]
    assert _iterations(tmp_path / "profile_traces") == [4, 8]
    for s in (4, 8, 11):
        with open(snaps / f"iteration_{s}" / "rank1_memory_snapshot.pickle", "rb") as f:
            assert "segments" in pickle.load(f)
    events = _events(tmp_path / "profile_traces" / "iteration_8" / "rank1_trace.json")
    assert any(e.get("cat") == "kernel" for e in events)  # CUDA activity is traced on a CUDA device
    # an out-of-memory error: the snapshot goes to iteration_<last finished>_exit
    with contextlib.suppress(torch.OutOfMemoryError):
        with StepProfiler(Prof(enable_profiling=False, enable_memory_snapshot=True), str(tmp_path / "oom"),
                          0, 0, "cuda") as prof:
            prof.step()
            raise torch.OutOfMemoryError("fake")
    assert os.listdir(tmp_path / "oom" / "memory_snapshot") == ["iteration_1_exit"]
    assert prof.written[-1].endswith("iteration_1_exit/rank0_memory_snapshot.pickle")
