"""The CUDA-graph step wrapper's contract that holds without a GPU: it says why it cannot capture
and runs the step eagerly; tensor learning rates are filled in place by the scheduler; metrics
copies are detached snapshots; the overflow flag is one tensor updated in place (a captured graph
keeps pointing at it); backends declare whether they are sync-free and fixed-capacity."""

import pytest
import torch

from components.moe_echo.config import MoEEchoConfig
from components.moe_echo.backends import resolve_backend
from components.moe_echo.dispatcher import LocalDispatcher
from components.moe_echo.ep_dispatch import AllToAllDispatcher, PaddedDispatcher
from components.moe_echo.nvlink_dispatch import NVLinkDispatcher
from components.parallel.cuda_graph import StepGraph, make_capturable
from components.parallel.host_copy import HostCopy, PinnedRing
from components.errors import UserError
from components.train.optim import build_lr_scheduler, lr_factor
from components.train.overflow import StepGate


def test_step_graph_says_why_and_runs_eagerly():
    logs, calls = [], []
    step = StepGraph(lambda a, b: calls.append((a, b)) or a + b, torch.device("cpu"), warmup=1, enabled=True,
                     log=logs.append)
    assert not step.active and logs == ["cuda graph: off — no CUDA device; running eagerly"]
    out = step(torch.ones(2), torch.ones(2))
    assert torch.equal(out, torch.full((2,), 2.0)) and len(calls) == 1 and step.captures == 0

    logs.clear()
    StepGraph(lambda a, b: a, torch.device("cpu"), enabled=True, why_not="alltoall sizes buffers on the host",
              log=logs.append)
    assert logs == ["cuda graph: off — alltoall sizes buffers on the host; running eagerly"]
    logs.clear()
    off = StepGraph(lambda a, b: a, torch.device("cpu"), enabled=False, log=logs.append)
    assert logs == [] and "cuda_graph = false" in off.reason


class _Sched:  # [lr_scheduler]: 4 warm-up steps, linear decay to 0.1 of the base lr
    warmup_steps, total_steps, decay_ratio, decay_type, min_lr_factor = 4, None, None, "linear", 0.1


def _lr_at(step: int) -> float:
    return 1e-3 * lr_factor(step, 4, 10, None, "linear", 0.1)


def _optimizer(capturable: bool, seed: int = 0, steps: int = 0):
    """(model, AdamW, its schedule over 10 steps), made capturable as the graphed recipe does, after ``steps``
    optimizer steps."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    sched = build_lr_scheduler(opt, _Sched(), 10)
    if capturable:
        make_capturable(opt, torch.device("cpu"))
    for _ in range(steps):
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        sched.step()
    return model, opt, sched


def _states(model, opt, sched) -> dict:
    from components.train.train_state import LRSchedule, ModelAndOptimizer

    return {"app": ModelAndOptimizer(model, opt), "lr_scheduler": LRSchedule(sched)}


def test_capturable_optimizer_lr_is_a_tensor_the_scheduler_fills_in_place():
    model, opt, sched = _optimizer(capturable=True)
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor)
    for step in range(1, 8):
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        sched.step()
        assert opt.param_groups[0]["lr"] is lr  # same tensor: a captured optimizer step reads it
        assert float(lr) == pytest.approx(_lr_at(step), rel=1e-6)


def test_checkpoints_of_graphed_and_eager_runs_load_into_each_other(tmp_path):
    """A capturable optimizer's lr (and so the scheduler's last lr) is a tensor; the checkpoint holds numbers,
    so it resumes a run that has not made its optimizer capturable yet (the recipe loads first), and a
    capturable one keeps its lr tensor, filled with the loaded value."""
    from components.train import checkpoint

    for saved_graphed, loaded_graphed in ((True, False), (False, True), (True, True)):
        model, opt, sched = _optimizer(saved_graphed, steps=2)
        path = checkpoint.save(str(tmp_path / f"{saved_graphed}{loaded_graphed}"), 2, _states(model, opt, sched))
        model2, opt2, sched2 = _optimizer(loaded_graphed, seed=1)
        lr_before = opt2.param_groups[0]["lr"]
        checkpoint.load(path, _states(model2, opt2, sched2))
        lr = opt2.param_groups[0]["lr"]
        assert float(lr) == pytest.approx(_lr_at(2), rel=1e-6)
        assert (lr is lr_before) == loaded_graphed and sched2.last_epoch == 2
        assert torch.equal(model2.weight, model.weight)
        assert torch.equal(opt2.state[model2.weight]["exp_avg"], opt.state[model.weight]["exp_avg"])
        sched2.step()
        assert float(opt2.param_groups[0]["lr"]) == pytest.approx(_lr_at(3))


def test_checkpoints_of_graphed_runs_from_earlier_versions_still_load(tmp_path):
    """Earlier versions saved a graphed run's learning rates as tensors (the optimizer's and the scheduler's
    last); the loader matches its template to what the checkpoint stored instead of calling it corrupt."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from components.train import checkpoint

    class Raw:  # what earlier versions wrote: the optimizer's and scheduler's state as they are
        def __init__(self, fn):
            self.fn = fn

        def state_dict(self):
            return self.fn()

        def load_state_dict(self, sd):
            raise AssertionError("only saved")

    model, opt, sched = _optimizer(capturable=True, steps=2)
    old = {"app": Raw(lambda: dict(zip(("model", "optim"), get_state_dict(model, opt)))),
           "lr_scheduler": Raw(sched.state_dict)}
    assert isinstance(old["app"].state_dict()["optim"]["param_groups"][0]["lr"], torch.Tensor)
    assert isinstance(old["lr_scheduler"].state_dict()["_last_lr"][0], torch.Tensor)
    path = checkpoint.save(str(tmp_path / "ck"), 2, old)
    for graphed in (False, True):
        model2, opt2, sched2 = _optimizer(graphed, seed=1)
        states = _states(model2, opt2, sched2)
        checkpoint.load(path, states)
        lr = opt2.param_groups[0]["lr"]
        assert isinstance(lr, torch.Tensor) == graphed and float(lr) == pytest.approx(_lr_at(2), rel=1e-6)
        assert torch.equal(model2.weight, model.weight) and sched2.last_epoch == 2
        assert [float(x) for x in sched2.get_last_lr()] == pytest.approx([_lr_at(2)])
        # the next save is in today's format again (numbers)
        assert not isinstance(states["app"].state_dict()["optim"]["param_groups"][0]["lr"], torch.Tensor)
        assert not isinstance(states["lr_scheduler"].state_dict()["_last_lr"][0], torch.Tensor)


def test_host_copy_is_a_detached_snapshot():
    t = torch.arange(4.0, requires_grad=True) * 1
    h = HostCopy((t, [t.sum(), None], 3.0))
    with torch.no_grad():
        t.add_(100)
    (a, (b, none), c) = h.get()
    assert torch.equal(a, torch.arange(4.0)) and float(b) == 6.0 and none is None and c == 3.0
    assert not a.requires_grad


def test_host_copy_times_steps_on_the_gpu_timeline_when_it_has_events():
    a, b = HostCopy(torch.ones(2)), HostCopy(torch.ones(2))
    assert b.seconds_since(a) is None and b.seconds_since(None) is None  # CPU: the caller uses host time

    class Event:  # stands in for torch.cuda.Event: elapsed_time in milliseconds, on the GPU timeline
        def __init__(self, t_ms):
            self.t_ms = t_ms

        def elapsed_time(self, later):
            return later.t_ms - self.t_ms

    a.event, b.event = Event(1000.0), Event(3500.0)
    assert b.seconds_since(a) == pytest.approx(2.5)


def test_moe_echo_check_names_broken_routing():
    from types import SimpleNamespace

    from components.moe_echo.layer import _check_dispatch

    moe = SimpleNamespace(dispatcher=LocalDispatcher(4), num_experts=4)
    _check_dispatch(moe, torch.tensor([[0, 3]]), torch.tensor([1, 0, 0, 1]), rows=8)  # fine
    with pytest.raises(RuntimeError, match="ids out of range"):
        _check_dispatch(moe, torch.tensor([[0, 4]]), torch.tensor([1, 0, 0, 1]), rows=8)
    with pytest.raises(RuntimeError, match="bad counts_e"):
        _check_dispatch(moe, torch.tensor([[0, 3]]), torch.tensor([1, -1, 0, 1]), rows=8)
    with pytest.raises(RuntimeError, match="bad counts_e"):
        _check_dispatch(moe, torch.tensor([[0, 3]]), torch.tensor([5, 0, 0, 5]), rows=8)


def test_pinned_ring_reuses_its_buffers_and_waits_for_their_last_copy():
    class Event:
        def __init__(self, done):
            self.done, self.waited = done, False

        def query(self):
            return self.done

        def synchronize(self):
            self.waited = True

    ring = PinnedRing(depth=3)
    got = [ring.take((2, 5), torch.int64) for _ in range(7)]
    ptrs = [b.data_ptr() for b, _, _ in got]
    assert len(set(ptrs)) == 3 and ptrs[:3] == ptrs[3:6] and ptrs[6] == ptrs[0]  # allocated once, round-robin
    assert ring.take((2,), torch.int64)[0].shape == (2,)  # keyed by shape and dtype
    busy, idle = Event(done=False), Event(done=True)
    _, i, key = ring.take((2, 5), torch.int64)  # slot 1
    ring.done(key, i, busy)
    _, j, _ = ring.take((2, 5), torch.int64)  # slot 2
    ring.done(key, j, idle)
    ring.take((2, 5), torch.int64)  # slot 0: no event
    ring.take((2, 5), torch.int64)  # slot 1 again: its last copy has not finished
    assert busy.waited
    ring.take((2, 5), torch.int64)
    assert not idle.waited


def test_overflow_flag_is_one_tensor_updated_in_place():
    class Layer:
        def __init__(self):
            self.overflow_count = torch.zeros((), dtype=torch.int64)
            self.dispatcher = None

    class Opt:
        pass

    layers = [("1", Layer()), ("2", Layer())]
    opt = Opt()
    gate = StepGate(layers, opt, torch.device("cpu"))
    flag, skip = gate.sticky, gate.skip
    assert float(gate.gate()) == 0 and opt.found_inf is skip
    layers[1][1].overflow_count.fill_(3)
    assert float(gate.gate()) == 1 and gate.sticky is flag and int(gate.dropped_total) == 3
    layers[1][1].overflow_count.zero_()
    assert float(gate.gate()) == 1  # sticky until the host acts
    gate.clear()
    assert gate.sticky is flag and float(flag) == 0 and float(gate.gate()) == 0
    assert gate.skip is skip and opt.found_inf is skip  # the same tensors: a captured graph keeps them


def test_backends_declare_sync_free_and_fixed_capacity():
    assert LocalDispatcher.sync_free and not LocalDispatcher.fixed_capacity
    assert PaddedDispatcher.sync_free and PaddedDispatcher.fixed_capacity
    assert NVLinkDispatcher.sync_free and NVLinkDispatcher.fixed_capacity
    assert not AllToAllDispatcher.sync_free and not AllToAllDispatcher.fixed_capacity
    cfg = MoEEchoConfig()
    assert resolve_backend(cfg, 1) == "local"
    assert resolve_backend(cfg, 2, on_cuda=False) == "padded"
    assert resolve_backend(cfg, 2, on_cuda=True) == "nvlink"


def test_deepep_selected_without_deep_ep_is_one_clear_error():
    try:
        import deep_ep  # noqa: F401
        pytest.skip("deep_ep is installed here")
    except ImportError:
        pass
    from components.moe_echo.deepep_dispatch import require_deep_ep

    with pytest.raises(UserError, match="needs the deep_ep package"):
        require_deep_ep()


def test_recipe_with_cuda_graph_on_cpu_says_why_it_runs_eagerly(tmp_path):
    import subprocess
    import sys

    from test_recipe import CONFIG, RECIPE, SMALL

    p = subprocess.run([sys.executable, RECIPE, "--job.config_file", CONFIG, "--job.dump_folder", str(tmp_path), *SMALL,
                        "--training.steps", "3", "--training.cuda_graph", "true", "--checkpoint.enable", "false"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "cuda graph: off — no CUDA device; running eagerly" in p.stdout + p.stderr
    assert "cuda graph     off (no CUDA device)" in p.stdout


def test_peer_memory_is_counted_and_reported():
    """Symmetric buffers live outside torch's caching allocator: the run reports them separately."""
    from components.moe_echo import symmetric
    from components.moe_echo.symmetric import SymmBuffer, SymmetricWorkspace
    from components.train.metrics import RunSummary

    ws = object.__new__(SymmetricWorkspace)  # bookkeeping only (no GPU, no rendezvous)
    ws._buffers = {"a/x": (((10, 4), torch.bfloat16), SymmBuffer(torch.zeros(10, 4, dtype=torch.bfloat16), [], None)),
                   "a/counts": (((2, 3), torch.int64), SymmBuffer(torch.zeros(2, 3, dtype=torch.int64), [], None))}
    before = symmetric.peer_memory_bytes()
    symmetric._workspaces["test-group"] = ws
    try:
        assert symmetric.peer_memory_bytes() - before == 10 * 4 * 2 + 2 * 3 * 8
    finally:
        del symmetric._workspaces["test-group"]
    summary = RunSummary()
    summary.peak_mem_gib, summary.peer_mem_gib = 40.0, 12.5
    assert "40.00 GiB + 12.50 GiB of peer (symmetric) buffers" in summary.text({})


def test_a_replay_before_the_first_capture_restarts_the_warm_up():
    """An overflow replayed during the warm-up may grow the capacity; the step that first uses the
    grown buffers allocates them, so it must run eagerly: the warm-up starts again (recapture), or
    the graph is off for good ("eager")."""
    calls = []
    step = StepGraph(lambda a, b: calls.append(1) or a, torch.device("cuda"), warmup=2, enabled=True,
                     log=lambda *_: None)
    assert step.active  # a CUDA device is named; nothing below touches it before a capture
    step(torch.ones(1), torch.ones(1))
    step(torch.ones(1), torch.ones(1))
    assert step.eager_calls == 2  # the next call would capture
    step.after_replay(recapture=True)
    assert step.active and step.eager_calls == 0 and step.graph is None
    step(torch.ones(1), torch.ones(1))
    step(torch.ones(1), torch.ones(1))  # two warm-up steps again, both eager
    assert len(calls) == 4 and step.captures == 0
    step.after_replay(recapture=False)
    assert not step.active and "cuda_graph_after_replay = 'eager'" in step.reason
    step(torch.ones(1), torch.ones(1))
    assert len(calls) == 5
