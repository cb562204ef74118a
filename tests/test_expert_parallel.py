"""Expert parallelism on CPU over gloo (2 and 4 processes): layer equivalence in fp64 for both
backends, padded overflow detection, and the recipe under torchrun (EP=2 vs EP=1 losses, DCP
checkpoints resharded between EP layouts, bad parallelism configs)."""

import itertools
import json
import os
import socket
import subprocess
import sys
import threading

import pytest
import torch.multiprocessing as mp

from background import Jobs, Runs, selected
from components.parallel.mesh import parallel_dims
from components.errors import UserError
from conftest import ROOT
from run_env import run_env

pytestmark = pytest.mark.slow  # end-to-end runs in subprocesses


def spawn(world, fn_name, tmp_path, **kwargs):
    """Run ep_worker.<fn_name> (or each of a list of names in turn, in one process group) on ``world``
    gloo processes. A worker that dies without a Python error (seen rarely on 2-core CI machines: a
    gloo thread aborting at start-up) is retried once; any assertion or exception inside a worker
    fails the test at once."""
    for attempt in range(2):
        try:
            return _spawn_once(world, fn_name, os.path.join(tmp_path, f"try{attempt}"), **kwargs)
        except _WorkerDied:
            if attempt == 1:
                raise


class _WorkerDied(AssertionError):
    pass


def _spawn_once(world, fn_name, tmp_path, **kwargs):
    import ep_worker

    os.makedirs(tmp_path)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(ep_worker.run, args=(world, port, fn_name, kwargs, str(tmp_path)), nprocs=world, join=True)
    except Exception as spawn_err:
        errs = [open(os.path.join(tmp_path, f)).read() for f in sorted(os.listdir(tmp_path)) if f.startswith("err")]
        if not errs:
            raise _WorkerDied(f"worker died without a Python error: {spawn_err}") from None
        raise AssertionError("\n".join(errs)) from None
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith("ok")) == [f"ok{r}" for r in range(world)]


# (test, world sizes, ep_worker check): the checks of one world size run in one launch, in this
# order (process start-up and imports are most of their time)
EP_CHECKS = [
    ("test_layer_at_ep_equals_ep1_for_both_backends_and_adversarial_routing", (2, 4), "layer_equivalence_all"),
    ("test_padded_overflow_is_detected_and_counted", (2,), "padded_overflow"),
    ("test_echo_on_equals_ep1_for_both_backends_and_adversarial_routing", (2, 4), "echo_equivalence_all"),
    ("test_experts_leave_fsdp_where_each_has_one_owner", (2, 4), "experts_fsdp_layout"),
    ("test_optimizer_written_expert_copies_train_as_the_per_step_cast", (2,), "compute_copies_train"),
    ("test_optimizer_written_expert_copies_with_echo_train_as_the_per_step_cast", (2,), "compute_copies_echo_train"),
    ("test_fp8_head_as_an_fsdp_unit_takes_the_fp8_gradient_and_reduces_it", (2,), "fp8_head_fsdp"),
    ("test_echo_clones_from_fp8_copies_equal_the_per_call_cast", (2,), "fp8_echo_copies"),
]


@pytest.fixture(scope="module")
def ep_check(request, tmp_path_factory):
    """``ep_check(world, name)`` fails if ep_worker.<name> failed at that world size."""
    launched = {}

    def check(world, name):
        if world not in launched:
            names = [n for test, worlds, n in EP_CHECKS if world in worlds and n == name or
                     world in worlds and {str(world), ""} & selected(request, test)]
            tmp = tmp_path_factory.mktemp(f"ep{world}")
            try:
                spawn(world, names, tmp)
                launched[world] = (names, None, tmp)
            except AssertionError as err:
                launched[world] = (names, str(err), tmp)
        names, error, tmp = launched[world]
        if error is None:
            return
        attempt = max(d for d in os.listdir(tmp) if d.startswith("try"))
        done = os.listdir(os.path.join(tmp, attempt))
        if all(f"done_{name}{r}" in done for r in range(world)):
            return  # passed before a later check of the same launch failed
        raise AssertionError(f"{name} at world {world} (checks of this launch: {', '.join(names)}):\n{error}")

    return check


@pytest.mark.parametrize("world", [2, 4])
def test_experts_leave_fsdp_where_each_has_one_owner(ep_check, world):
    """EP=2 at world 2: experts out of FSDP, gradients divided by the world in a hook; at world 4: FSDP."""
    ep_check(world, "experts_fsdp_layout")


def test_optimizer_written_expert_copies_train_as_the_per_step_cast(ep_check):
    """EP=2, experts outside FSDP in bf16: AdamWWithCopies = the cast path + torch's fused AdamW; DCP round trip."""
    ep_check(2, "compute_copies_train")


def test_optimizer_written_expert_copies_with_echo_train_as_the_per_step_cast(ep_check):
    """The same with ECHO on and full activation checkpointing: clones read the copies, their gradients reach
    the home experts' compute gradients, and the forward recomputed in backward keeps them."""
    ep_check(2, "compute_copies_echo_train")


def test_echo_clones_from_fp8_copies_equal_the_per_call_cast(ep_check):
    """EP=2, FP8 experts, ECHO on: clones sent as FP8 copy bytes = the extended weights cast per call, bit for bit."""
    ep_check(2, "fp8_echo_copies")


def test_fp8_head_as_an_fsdp_unit_takes_the_fp8_gradient_and_reduces_it(ep_check):
    """components/train/fp8_head.py under fully_shard (gloo; torch._scaled_mm on CPU)."""
    ep_check(2, "fp8_head_fsdp")


@pytest.mark.parametrize("world", [2, 4])
def test_layer_at_ep_equals_ep1_for_both_backends_and_adversarial_routing(ep_check, world):
    """alltoall and padded × random / all tokens to one expert / experts with no tokens, fp64."""
    ep_check(world, "layer_equivalence_all")


def test_padded_overflow_is_detected_and_counted(ep_check):
    ep_check(2, "padded_overflow")


# --- recipe under torchrun ------------------------------------------------------------------------

RECIPE = os.path.join(ROOT, "recipes", "pretrain.py")
CONFIG = os.path.join(ROOT, "train_configs", "debug_cpu.toml")
COMMON = ["--job.config_file", CONFIG, "--training.max_corpus_mb", "1", "--training.seq_len", "64",
          "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--training.steps", "5",
          "--lr_scheduler.warmup_steps", "2", "--moe_echo.capacity_factor", "4.0"]


_NEXT_PORT = itertools.count()


def _port() -> int:
    """A port of its own for each launch (launches run side by side), below Linux's ephemeral range
    (32768 and up), so no connection of another launch's ranks can have taken it since it was chosen;
    one something else listens on is passed over."""
    while True:
        port = 20000 + (os.getpid() * 64 + next(_NEXT_PORT)) % 12000
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return port


def recipe(dump, nproc, *args, check=True, env=None):
    env = run_env(args, OMP_NUM_THREADS="1", **(env or {}))
    if nproc == 1:
        cmd = [sys.executable, RECIPE]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", str(_port()), RECIPE]
    p = subprocess.run([*cmd, *COMMON, "--job.dump_folder", str(dump), *args], capture_output=True, text=True,
                       env=env, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return p


def losses(dump):
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


EP2 = ["--training.local_batch_size", "4", "--parallelism.expert_parallel_degree", "2"]
ECHO_SKEW = [*EP2, "--training.steps", "10", "--checkpoint.enable", "false", "--moe_echo.bias_update_rate", "0",
             "--moe_echo.debug_hot_experts", "1"]
OVERFLOW = [*EP2, "--training.steps", "8", "--moe_echo.debug_hot_experts", "1", "--moe_echo.bias_update_rate", "0",
            "--checkpoint.interval", "8"]
FASTEST = [*EP2, "--training.steps", "2", "--moe_echo.dispatcher", "fastest", "--checkpoint.enable", "false"]


def _resumed_from_ep2(dump, ep2, nproc, ep):
    """The EP=2 run's checkpoints copied into ``dump``, resumed from step 2 at ``nproc`` ranks, EP = ``ep``."""
    import shutil

    shutil.copytree(os.path.join(ep2, "checkpoint"), os.path.join(dump, "checkpoint"))
    return recipe(dump, nproc, "--training.local_batch_size", str(8 // nproc), "--parallelism.expert_parallel_degree",
                  str(ep), "--checkpoint.load_step", "2")


def _fastest_twice(dump):
    """Two launches sharing one timing cache: the first measures, the second reads the cache."""
    env = {"MOE_ECHO_CACHE": str(dump / "cache.json")}
    return recipe(dump / "a", 2, *FASTEST, env=env), recipe(dump / "b", 2, *FASTEST, env=env)


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory):
    """This module's recipe launches, started together two at a time in the order the tests read them
    (each spends most of its first ~10 s importing); ``launches[name]`` is (its result, its folder). A
    launch that resumes another's checkpoint waits for it inside its own job (started earlier, so
    already running or done)."""
    jobs = Jobs(request, tmp_path_factory)
    add = jobs.add

    ep1_tests = ("test_training_at_ep2_matches_ep1 test_activation_checkpointing_and_compile_keep_the_losses "
                 "test_fp8_wire_from_the_command_line_trains_near_ep1")
    add(ep1_tests, "ep1", lambda d: recipe(d, 1, "--training.local_batch_size", "8", "--checkpoint.enable", "false"))
    resumes = "test_checkpoint_saved_at_ep2_resumes_at_other_layouts"
    add(f"test_training_at_ep2_matches_ep1 {resumes}", "ep2", lambda d: recipe(
        d, 2, *EP2, "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0"))
    for backend in sorted(selected(request, "test_training_at_ep2_matches_ep1") - {"padded"}):
        extra = (["--parallelism.fsdp_reshard_after_forward", "never"] if backend == "padded_never_reshard"
                 else ["--moe_echo.dispatcher", "alltoall"])
        add("test_training_at_ep2_matches_ep1", backend,
            lambda d, extra=extra: recipe(d, 2, *EP2, "--checkpoint.enable", "false", *extra))
    for case in sorted(selected(request, resumes)):
        nproc, ep = map(int, case.split("-"))
        add(resumes, f"resumed_{case}", lambda d, nproc=nproc, ep=ep: _resumed_from_ep2(d, jobs_done("ep2"), nproc, ep))
    bad = "test_bad_parallelism_in_the_recipe_exits_2"
    add(bad, "bad_ep", lambda d: recipe(d, 1, "--parallelism.expert_parallel_degree", "2", check=False))
    add(bad, "bad_padded", lambda d: recipe(d, 1, "--moe_echo.dispatcher", "padded", check=False))
    ac = "test_activation_checkpointing_and_compile_keep_the_losses"
    add(ac, "ac", lambda d: recipe(d, 2, *EP2, "--activation_checkpoint.mode", "full", "--checkpoint.enable", "false"))
    add(ac, "sac", lambda d: recipe(d, 2, *EP2, "--activation_checkpoint.mode", "selective",
                                    "--activation_checkpoint.selective_ac_option", "2", "--compile.enable", "true",
                                    "--compile.backend", "aot_eager", "--checkpoint.enable", "false"))
    echo = "test_training_with_echo_matches_echo_off"
    add(echo, "echo_off", lambda d: recipe(d, 2, *ECHO_SKEW))  # echo = "auto": off at EP=2 (and on CPU's padded)
    add(echo, "echo_on", lambda d: recipe(d, 2, *ECHO_SKEW, "--moe_echo.echo", "true",
                                          "--moe_echo.echo_slots_per_rank", "2"))
    add(echo, "echo_recompute", lambda d: recipe(d, 2, *ECHO_SKEW, "--moe_echo.echo", "true",
                                                 "--moe_echo.echo_recompute", "true"))
    overflow = "test_overflow_is_gated_and_replayed_never_dropped"
    add(overflow, "overflow_exact", lambda d: recipe(d, 2, *OVERFLOW, "--moe_echo.dispatcher", "alltoall"))
    for grow in sorted(selected(request, overflow)):
        add(overflow, f"overflow_grow{grow}", lambda d, grow=grow: recipe(
            d, 2, *OVERFLOW, "--moe_echo.dispatcher", "padded", "--moe_echo.capacity_factor", "1.0",
            "--moe_echo.grow_capacity_after", grow))
    add("test_overflow_stop_mode_is_a_clear_error", "overflow_stop", lambda d: recipe(
        d, 2, *EP2, "--moe_echo.debug_hot_experts", "1", "--moe_echo.bias_update_rate", "0",
        "--moe_echo.capacity_factor", "1.0", "--moe_echo.on_overflow", "stop", "--checkpoint.enable", "false",
        check=False))
    add("test_fastest_dispatcher_is_measured_once_cached_and_reported", "fastest", _fastest_twice)
    add("test_fp8_wire_from_the_command_line_trains_near_ep1", "fp8_wire", lambda d: recipe(
        d, 2, *EP2, "--checkpoint.enable", "false", "--moe_echo.dispatch_precision", "fp8"))

    started = threading.Event()

    def jobs_done(name):
        started.wait()
        return runs[name][1]

    runs = Runs(jobs)
    started.set()
    yield runs
    runs.close()


@pytest.fixture(scope="module")
def ep1_losses(launches):
    return losses(launches["ep1"][1])


@pytest.fixture(scope="module")
def ep2_run(launches):
    return launches["ep2"][1]


@pytest.mark.parametrize("backend", ["padded", "alltoall", "padded_never_reshard"])
def test_training_at_ep2_matches_ep1(launches, ep1_losses, ep2_run, backend):
    """padded_never_reshard: FSDP keeps the dense weights gathered from forward to backward (no second all-gather)."""
    got = losses(ep2_run if backend == "padded" else launches[backend][1])
    assert sorted(got) == [1, 2, 3, 4, 5]
    for step, want in ep1_losses.items():
        assert got[step] == pytest.approx(want, rel=2e-5), step


@pytest.mark.parametrize("nproc, ep", [(1, 1), (4, 4)])
def test_checkpoint_saved_at_ep2_resumes_at_other_layouts(launches, ep2_run, nproc, ep):
    p, tmp_path = launches[f"resumed_{nproc}-{ep}"]
    assert "resumed from" in p.stdout and "step-2" in p.stdout
    want = losses(ep2_run)
    got = losses(tmp_path)
    for step in (3, 4, 5):
        assert got[step] == pytest.approx(want[step], rel=2e-5), step


class _Par:
    def __init__(self, rep=1, shard=-1, ep=1):
        self.data_parallel_replicate_degree, self.data_parallel_shard_degree, self.expert_parallel_degree = rep, shard, ep


@pytest.mark.parametrize(
    "world, par, experts, expect",
    [
        (4, _Par(rep=3), 8, "does not divide the world size 4"),
        (4, _Par(rep=1, shard=3), 8, "must equal the number of processes (4)"),
        (4, _Par(ep=3), 8, "must divide data_parallel_shard_degree = 4"),
        (4, _Par(ep=4), 6, "does not divide the model's 6 experts"),
        (2, _Par(ep=2), None, "has no MoE layers"),
        (4, _Par(rep=0), 8, "must be >= 1"),
    ],
)
def test_bad_parallelism_is_a_one_line_error(world, par, experts, expect):
    with pytest.raises(UserError, match=expect.replace("(", r"\(").replace(")", r"\)")) as err:
        parallel_dims(par, world, experts)
    assert "\n" not in str(err.value)


def test_bad_parallelism_in_the_recipe_exits_2(launches):
    p, _ = launches["bad_ep"]
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "expert_parallel_degree = 2" in lines[0], p.stderr[-2000:]
    p, _ = launches["bad_padded"]
    assert p.returncode == 2 and "needs [parallelism] expert_parallel_degree > 1" in p.stderr


def test_activation_checkpointing_and_compile_keep_the_losses(launches, ep1_losses):
    """Full AC at EP=2; selective AC + compile (dense submodules inside AC, the final norm and head, and the loss,
    under FSDP2) at EP=2."""
    p, _ = launches["sac"]
    assert "aot_eager: 18 dense submodules" in p.stdout and "+ the loss" in p.stdout, p.stdout[-2000:]
    for run in ("ac", "sac"):
        got = losses(launches[run][1])
        for step, want in ep1_losses.items():
            assert got[step] == pytest.approx(want, rel=2e-5), (run, step)


@pytest.mark.parametrize("world", [2, 4])
def test_echo_on_equals_ep1_for_both_backends_and_adversarial_routing(ep_check, world):
    """ECHO changes where work runs, never the math: fp64 outputs and every gradient agree with
    EP=1 (random, all tokens to one expert, one hot expert per rank, empty experts, more hot
    experts than slots)."""
    ep_check(world, "echo_equivalence_all")


def test_training_with_echo_matches_echo_off(launches):
    """10 steps at EP=2 with strongly skewed routing (a hot expert): ECHO on gives ECHO off's losses,
    and its TensorBoard-bound stats show it balanced the ranks."""
    (p_off, off_dump), (p_on, on_dump) = launches["echo_off"], launches["echo_on"]
    line = {n: next(l for l in p.stdout.splitlines() if l.startswith("dispatcher ")) for n, p in (("off", p_off),
                                                                                                  ("on", p_on))}
    assert "ECHO" not in line["off"] and "echo: auto" not in p_off.stdout, line["off"]
    assert "PaddedDispatcher, ECHO on (2 slots per rank)" in line["on"], line["on"]
    off, on = losses(off_dump), losses(on_dump)
    recomputed = losses(launches["echo_recompute"][1])
    for step in on:
        assert recomputed[step] == on[step], step  # recompute changes memory, not one bit of the math
    assert sorted(on) == list(range(1, 11))
    for step in off:
        assert on[step] == pytest.approx(off[step], rel=2e-5), step
    with open(os.path.join(on_dump, "metrics.jsonl")) as f:
        rows = [json.loads(l) for l in f]
    before = [v for r in rows for k, v in r.items() if k.endswith("echo_load_before")]
    after = [v for r in rows for k, v in r.items() if k.endswith("echo_load_after")]
    assert before and len(before) == len(after)
    assert sum(before) / len(before) > 1.2  # the hot expert really skews the ranks
    assert sum(after) / len(after) < 1.05
    # the rank load is logged with ECHO off too (from the global expert counts): the same skew ECHO saw
    with open(os.path.join(off_dump, "metrics.jsonl")) as f:
        off_rows = [json.loads(l) for l in f]
    plain = [v for r in off_rows for k, v in r.items() if k.endswith("rank_load_max_over_mean")]
    assert len(plain) == len(before) and plain == pytest.approx(before, rel=1e-3)
    ran = [v for r in rows for k, v in r.items() if k.endswith("rank_load_max_over_mean")]
    assert ran == after  # with ECHO: what the ranks ran after the clones took their share


def _final_weights(dump):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    import torch

    ckpts = sorted(os.listdir(os.path.join(dump, "checkpoint")))
    out = os.path.join(dump, "final.pt")
    dcp_to_torch_save(os.path.join(dump, "checkpoint", ckpts[-1]), out)
    return torch.load(out, weights_only=False)["app"]["model"]


@pytest.fixture(scope="module")
def overflow_exact(launches):
    """The exact (alltoall) run the overflowing runs must reproduce: its losses and final weights."""
    dump = launches["overflow_exact"][1]
    return losses(dump), _final_weights(dump)


@pytest.mark.parametrize("grow", [0, 1])
def test_overflow_is_gated_and_replayed_never_dropped(launches, overflow_exact, grow):
    """A tiny padded capacity with a hot expert overflows: every such step is gated on the device
    and replayed on the exact path. Losses and final weights equal an exact (alltoall) run; with
    grow_capacity_after = 1 the capacity grows until the padded path stops overflowing."""
    import torch

    p, padded_dump = launches[f"overflow_grow{grow}"]
    assert "gated and replayed" in p.stdout
    with open(os.path.join(padded_dump, "metrics.jsonl")) as f:
        rows = [json.loads(l) for l in f]
    replayed = [r["step"] for r in rows if r["moe/replayed"]]
    assert replayed and rows[-1]["moe/overflow_assignments"] > 0
    if grow:  # one growth, to what the overflowed step needed (+10%): only the first two steps replay
        assert replayed == [1, 2] and "capacity_factor grown to" in p.stdout
    else:
        assert replayed == list(range(1, 9))
        untimed = [r["step"] for r in rows if "tokens_per_s" not in r]  # replayed back to back: no 0-s windows
        assert untimed and len(untimed) < len(rows) and set(untimed) <= set(replayed)
    exact, w_exact = overflow_exact
    padded = losses(padded_dump)
    for step in exact:
        assert padded[step] == pytest.approx(exact[step], rel=1e-5), step
    w_padded = _final_weights(padded_dump)
    assert set(w_exact) == set(w_padded)
    for k in w_exact:
        torch.testing.assert_close(w_padded[k], w_exact[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")


def test_overflow_stop_mode_is_a_clear_error(launches):
    p, _ = launches["overflow_stop"]
    assert p.returncode != 0 and "buffer overflow at step 1" in p.stderr and "capacity_factor" in p.stderr


def test_fastest_dispatcher_is_measured_once_cached_and_reported(launches):
    (p, p_cached), dump = launches["fastest"]
    cache = str(dump / "cache.json")
    line = next(l for l in p.stdout.splitlines() if l.startswith("dispatcher: fastest = "))
    chosen = line.split("= ")[1].split(" ")[0]
    timings = json.load(open(cache))
    (key, ms), = timings.items()
    assert set(ms) == {"padded", "alltoall"} and chosen == min(ms, key=ms.get) and "ep2" in key
    p = p_cached
    assert f"fastest = {chosen}" in p.stdout and "cached" in p.stdout


def test_fp8_wire_from_the_command_line_trains_near_ep1(launches, ep1_losses):
    """``--moe_echo.dispatch_precision fp8`` at EP=2 (gloo, ``padded``): tokens and output gradients cross in e4m3,
    so the losses leave EP=1's exact ones, but only by the quantisation's size."""
    got = losses(launches["fp8_wire"][1])
    assert sorted(got) == [1, 2, 3, 4, 5]
    rel = [abs(got[s] - want) / want for s, want in ep1_losses.items()]
    assert max(rel) < 1e-2 and max(rel) > 2e-5, rel  # off the exact path (2e-5 holds the bf16 wire), not far off
