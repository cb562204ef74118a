"""Training across hosts on an emulated two-host cluster (tests/emulated_hosts.py: one torchrun agent per
"host", gloo on CPU): two hosts train as one host of the same size does, a checkpoint resumes at another
host count (reading on from the data the saved run had read), a lost host ends the run on the other with
exit code 4 and the run resumes on the host left, and the Slurm script's torchrun line parses.

Every layout reads a global batch of 32 sequences per step (8 per rank on 4 ranks, 16 on 2), so runs at
different host counts see the same tokens and their losses can be compared step by step."""

import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from background import Jobs, Runs
from components.train.checkpoint import complete_checkpoints
from conftest import ROOT
from emulated_hosts import check_ok, start_hosts, wait_hosts
from test_recipe import CONFIG, RECIPE, losses

pytestmark = pytest.mark.slow  # end-to-end runs in subprocesses

STEPS, SAVE_AT, GLOBAL_BATCH, TRAIN_TIMEOUT = 6, 3, 32, 15
ARGS = ["--job.config_file", CONFIG, "--training.max_corpus_mb", "1", "--training.seq_len", "64",
        "--moe_echo.dispatcher", "padded", "--training.steps", str(STEPS), "--checkpoint.interval", str(SAVE_AT),
        "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false"]
# each worker says where torchrun placed it, then runs the recipe
WORKER = ["--no-python", "sh", "-c",
          'echo "worker rank $RANK host $GROUP_RANK of $GROUP_WORLD_SIZE, $LOCAL_WORLD_SIZE ranks per host" >&2; '
          'exec "$0" "$@"', sys.executable, RECIPE]
SBATCH = os.path.join(ROOT, "recipes", "multinode.sbatch")


def _start(dump, hosts, ranks, *extra, host_envs=None):
    world = hosts * ranks
    args = [*WORKER, *ARGS, "--job.dump_folder", str(dump), "--parallelism.expert_parallel_degree", str(world),
            "--training.local_batch_size", str(GLOBAL_BATCH // world), *extra]
    return start_hosts(args, hosts=hosts, ranks_per_host=ranks, host_envs=host_envs)


def _train(dump, hosts, ranks, *extra):
    results = wait_hosts(_start(dump, hosts, ranks, *extra), timeout=600)
    check_ok(results)
    return results


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants, parents first."""
    kids = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(k) for k in f.read().split()]
    except OSError:  # it has exited
        pass
    return [pid] + [p for k in kids for p in _tree(k)]


def _then_resumed(dump, first, hosts, ranks):
    """(first run's agents, its losses, the resumed run's agents, its losses): the first run's last
    checkpoint removed, so the resumed one starts from step SAVE_AT."""
    before = first(dump)
    trained = losses(dump)
    shutil.rmtree(os.path.join(dump, "checkpoint", f"step-{STEPS}"), ignore_errors=True)
    return before, trained, _train(dump, hosts, ranks), losses(dump)


def _lose_host(dump, sig=signal.SIGKILL):
    """2 hosts × 2 ranks; host 1's last rank stops before step SAVE_AT + 1 (holding the run there), then all
    of host 1, agent and workers, gets ``sig``: SIGKILL, its processes die (peers see closed sockets); SIGSTOP,
    it falls silent as a host that lost power (peers wait for the timeout). (host 0's agent, host 1's
    agent, seconds from the signal until host 0's agent ended)."""
    procs = _start(dump, 2, 2, "--comm.train_timeout_seconds", str(TRAIN_TIMEOUT),
                   host_envs=[{}, {"MOE_ECHO_FAULT_STOP_AT_STEP": str(SAVE_AT + 1)}])
    done = os.path.join(dump, "checkpoint", f"step-{SAVE_AT}", "COMPLETE")
    deadline = time.monotonic() + 300
    while not os.path.exists(done) and time.monotonic() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.2)
    time.sleep(1.0)  # host 0's ranks wait in step SAVE_AT + 1's first collective
    host1 = _tree(procs[1].pid)
    _signal(host1, sig)  # the agent first, so it cannot react to its workers' deaths
    t0 = time.monotonic()
    try:
        procs[0].wait(timeout=TRAIN_TIMEOUT + 60)
    finally:
        elapsed = time.monotonic() - t0
        _signal(host1, signal.SIGKILL)
        results = wait_hosts(procs, timeout=60)
    return results[0], results[1], elapsed


def _signal(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _lose_host_and_resume(dump):
    return _lose_host(dump), _train(dump, 1, 2), losses(dump)


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory):
    """Independent launch chains, two at a time: ``launches[name]`` is (its result, its folder)."""
    jobs = Jobs(request, tmp_path_factory)
    add = jobs.add

    lost = "test_a_lost_host_ends_the_run_with_exit_4_and_it_resumes_on_the_host_left"
    add(f"test_two_hosts_train_as_one_host_of_the_same_size {lost}", "two_hosts", lambda d: _train(d, 2, 2))
    add(lost, "lost_host", _lose_host_and_resume)
    add("test_a_silent_host_ends_the_run_within_the_timeout", "silent_host",
        lambda d: _lose_host(d, signal.SIGSTOP))
    add("test_two_hosts_train_as_one_host_of_the_same_size test_hierarchical_trains_as_padded_and_replays_exactly "
        "test_experts_shard_within_a_host_and_replicate_across_hosts", "one_host", lambda d: _train(d, 1, 4))
    hier = "test_hierarchical_trains_as_padded_and_replays_exactly"
    add(hier, "hier", lambda d: _train(d, 2, 2, "--moe_echo.dispatcher", "hierarchical",
                                       "--moe_echo.capacity_factor", "4.0", "--checkpoint.enable", "false"))
    add(hier, "hier_overflow", lambda d: _train(d, 2, 2, "--moe_echo.dispatcher", "hierarchical", "--moe_echo.echo",
                                                "true", "--moe_echo.capacity_factor", "1.0", "--checkpoint.enable",
                                                "false"))
    add("test_checkpoint_from_one_host_resumes_on_two", "one_then_two",
        lambda d: _then_resumed(d, lambda d: _train(d, 1, 2), 2, 2))
    add("test_fastest_across_hosts_times_hierarchical", "fastest", lambda d: wait_hosts(_start(
        d, 2, 2, "--moe_echo.dispatcher", "fastest", "--training.steps", "2", "--checkpoint.enable", "false",
        host_envs=[{"MOE_ECHO_CACHE": str(d / "cache.json")}] * 2), timeout=600))
    hsdp = "test_experts_shard_within_a_host_and_replicate_across_hosts"
    add(hsdp, "hsdp_two_hosts", lambda d: _train(d, 2, 2, "--parallelism.expert_parallel_degree", "2",
                                                 "--checkpoint.enable", "false"))
    runs = Runs(jobs)
    yield runs
    runs.close()


def _workers(results) -> list[tuple[int, int, int, int]]:
    """(rank, host, hosts, ranks per host) of every worker, from what each printed at its start."""
    found = []
    for r in results:
        found += [tuple(map(int, m)) for m in re.findall(
            r"worker rank (\d+) host (\d+) of (\d+), (\d+) ranks per host", r.stderr)]
    return sorted(found)


def _same(a: float, b: float, rel: float) -> bool:
    return math.isfinite(a) and abs(a - b) <= rel * abs(b)


def _check_resumed(resumed_agents, resumed, trained, ranks_line):
    """The resumed run loaded step SAVE_AT, logged each step once and trained as the uninterrupted run did."""
    out = resumed_agents[0].stdout
    assert re.search(rf"resumed from \S+step-{SAVE_AT} \(step {SAVE_AT}\)", out), out[-2000:]
    assert ranks_line in out, out[-2000:]
    assert list(resumed) == list(range(1, STEPS + 1))  # no step repeated or missing
    for step in range(1, SAVE_AT + 1):
        assert resumed[step] == trained[step], step  # the first run's log kept as it was
    # The same global batch at both layouts: the same tokens and weights, so the same losses up to the
    # order of fp32 sums over 2 vs 4 ranks (~1e-7 relative, seen <= 1e-7); a resharding error (an expert's
    # weights or Adam moments on the wrong rank) moves the loss by 1e-2 or more.
    for step in range(SAVE_AT + 1, STEPS + 1):
        assert _same(resumed[step], trained[step], 1e-5), (step, resumed[step], trained[step])


def test_two_hosts_train_as_one_host_of_the_same_size(launches):
    agents, dump = launches["two_hosts"]
    trained = losses(dump)
    assert _workers(agents) == [(0, 0, 2, 2), (1, 0, 2, 2), (2, 1, 2, 2), (3, 1, 2, 2)]
    assert "4 (dp_replicate 1 x dp_shard 4, ep 4)" in agents[0].stdout and "PaddedDispatcher" in agents[0].stdout
    assert list(trained) == list(range(1, STEPS + 1))
    assert all(math.isfinite(v) for v in trained.values())
    assert trained[STEPS] < trained[1] - 1.0, trained  # byte-level loss starts near ln(512) = 6.2
    one_host, _ = launches["one_host"]
    assert _workers(one_host) == [(r, 0, 1, 4) for r in range(4)]
    reference = losses(launches["one_host"][1])
    # Same world, ranks, data shards and expert placement, and gloo runs the same collectives over the
    # same 4 ranks whichever agent started them: the same arithmetic in the same order, equal to the last
    # bit (1e-6 relative: ~8 fp32 ulps, room for a reduction order that follows the transport, no more).
    for step in range(1, STEPS + 1):
        assert _same(trained[step], reference[step], 1e-6), (step, trained[step], reference[step])


def test_checkpoint_from_one_host_resumes_on_two(launches):
    (_, trained, resumed_agents, resumed), _ = launches["one_then_two"]
    assert _workers(resumed_agents) == [(0, 0, 2, 2), (1, 0, 2, 2), (2, 1, 2, 2), (3, 1, 2, 2)]
    _check_resumed(resumed_agents, resumed, trained, "4 (dp_replicate 1 x dp_shard 4, ep 4)")


def _ended_with_exit_4(host0, elapsed, why, also=None):
    """host 0's agent ended in time; its workers printed one error line each (``why``, or for all but one of
    them ``also``) and no traceback, and torchrun reported exit code 4 for both."""
    assert host0.returncode != 0 and elapsed < TRAIN_TIMEOUT + 15, (elapsed, host0.stderr[-3000:])
    workers_part = host0.stderr.split("failed (exitcode")[0]  # before the agent's own report and traceback
    errors = re.findall(r"error: \[rank (\d+)\] (.*)", host0.stderr)
    assert sorted(r for r, _ in errors) == ["0", "1"], host0.stderr[-3000:]
    assert any(why in line for _, line in errors), errors
    assert all(why in line or (also is not None and also in line) for _, line in errors), errors
    assert "Traceback" not in workers_part, workers_part[-3000:]
    codes = re.findall(r"exitcode\s*: (-?\d+) \(pid", host0.stderr)
    assert sorted(codes) == ["4", "4"], (codes, host0.stderr[-3000:])


def test_a_lost_host_ends_the_run_with_exit_4_and_it_resumes_on_the_host_left(launches):
    """Also the checkpoint of two hosts resumed on one: from step SAVE_AT the run trains on at half the ranks
    as the uninterrupted two-host run did."""
    ((host0, host1, elapsed), resumed_agents, resumed), dump = launches["lost_host"]
    assert host1.returncode == -signal.SIGKILL
    _ended_with_exit_4(host0, elapsed, "lost its connection to a peer")
    # the run resumes from the last checkpoint, step SAVE_AT, on one host of 2 ranks
    assert _workers(resumed_agents) == [(0, 0, 1, 2), (1, 0, 1, 2)]
    _check_resumed(resumed_agents, resumed, losses(launches["two_hosts"][1]), "2 (dp_replicate 1 x dp_shard 2, ep 2)")


def test_a_silent_host_ends_the_run_within_the_timeout(launches):
    (host0, _, elapsed), dump = launches["silent_host"]
    # the first host-0 rank to time out exits; its neighbour may then see that connection close first
    _ended_with_exit_4(host0, elapsed, "a collective timed out", also="lost its connection to a peer")
    assert elapsed > TRAIN_TIMEOUT - 5, elapsed  # the silence itself is not detected: the timeout ends it
    assert [s for s, _ in complete_checkpoints(os.path.join(dump, "checkpoint"))] == [SAVE_AT]


def test_data_position_carries_across_rank_counts():
    """A loader resumed at another world size reads on from the windows the saved run had read: none twice
    in the epoch, fewer than one global batch skipped."""
    from components.train.data import TokenBatchLoader

    tokens = torch.arange(16 * 203)  # 202 windows of 16
    for saved_world, new_world, steps in ((4, 2, 5), (2, 4, 5), (4, 3, 2)):
        saved = [TokenBatchLoader(tokens, 2, 16, rank=r, world_size=saved_world) for r in range(saved_world)]
        read = [int(w) for _ in range(steps) for ld in saved for w in ld.next_batch()[0][:, 0] // 16]
        new = [TokenBatchLoader(tokens, 2, 16, rank=r, world_size=new_world) for r in range(new_world)]
        for ld in new:
            ld.load_state_dict(saved[0].state_dict(), global_batch=2 * saved_world)
        order = new[0]._permutation(0).tolist()
        nxt = [int(w) for ld in new for w in ld.next_batch()[0][:, 0] // 16]
        assert not set(nxt) & set(read)
        first = min(order.index(w) for w in nxt)
        assert len(read) <= first < len(read) + 2 * new_world and order[:len(read)] == read


def test_checkpoint_carries_the_global_batch_and_older_ones_still_load(tmp_path):
    """The train state records the global batch its data position counts; a checkpoint written before that
    entry existed loads as it did (the position taken as is)."""
    from components.train import checkpoint
    from components.train.data import TokenBatchLoader
    from components.train.train_state import TrainState

    tokens = torch.arange(16 * 203)
    saved = TrainState(TokenBatchLoader(tokens, 2, 16, rank=0, world_size=4))
    for _ in range(5):
        saved.loader.next_batch()
    checkpoint.save(str(tmp_path), 5, {"train": saved})
    saved.stored_global_batch = False  # as written before the entry
    checkpoint.save(str(tmp_path), 6, {"train": saved})
    for step, position in ((5, 10), (6, 5)):
        resumed = TrainState(TokenBatchLoader(tokens, 2, 16, rank=0, world_size=2))
        checkpoint.load(str(tmp_path / f"step-{step}"), {"train": resumed})
        assert resumed.loader.state_dict() == {"epoch": 0, "position": position}, step
        assert "data_global_batch" in resumed.state_dict()  # the next save writes it


def _sbatch_line(tmp_path, nodes: int) -> list[str]:
    """The command the script hands to srun, with stub srun and scontrol on PATH."""
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    (stubs / "srun").write_text('#!/bin/bash\nprintf "%q " "$@" > "$SRUN_ARGS"\n')
    (stubs / "scontrol").write_text('#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && printf "gpu-a17\\ngpu-a18\\n"\n')
    for stub in ("srun", "scontrol"):
        os.chmod(stubs / stub, 0o755)
    env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}", "SLURM_NNODES": str(nodes),
           "SLURM_JOB_NODELIST": "gpu-a[17-18]", "SLURM_JOB_ID": "4711", "SLURM_SUBMIT_DIR": ROOT,
           "SRUN_ARGS": str(tmp_path / "srun_args"), "DUMP": str(tmp_path / "dump")}
    p = subprocess.run(["bash", SBATCH], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return shlex.split((tmp_path / "srun_args").read_text())


def test_slurm_script_launches_one_agent_per_node(tmp_path):
    from torch.distributed.run import get_args_parser

    from components.parallel.mesh import parallel_dims
    from components.train.config import check_global_batch, load_config

    assert subprocess.run(["bash", "-n", SBATCH]).returncode == 0
    for nodes in (2, 4):
        line = _sbatch_line(tmp_path, nodes)
        assert line[:3] == ["--ntasks-per-node", "1", "--kill-on-bad-exit=1"], line
        assert line[3] == os.path.join(ROOT, ".venv", "bin", "moe-echo-run")  # torchrun, same arguments
        args = get_args_parser().parse_args(line[4:])  # torchrun's own parser
        assert (args.nnodes, args.nproc_per_node, args.rdzv_backend) == (str(nodes), "8", "c10d")
        assert args.rdzv_endpoint == "gpu-a17:29500" and args.training_script == "recipes/pretrain.py"
        assert os.path.isfile(os.path.join(ROOT, args.training_script))
        cfg = load_config([a.replace("train_configs/", os.path.join(ROOT, "train_configs/"), 1)
                           for a in args.training_script_args])  # the recipe's parser: config and overrides
        assert cfg.parallelism.expert_parallel_degree == 8 * nodes and cfg.job.dump_folder == str(tmp_path / "dump")
        check_global_batch(cfg, 8 * nodes)
        dims = parallel_dims(cfg.parallelism, 8 * nodes, 64)  # v2lite_1b: 64 experts
        assert dims.ep == 8 * nodes


def _metrics(dump) -> list[dict]:
    import json

    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_hierarchical_trains_as_padded_and_replays_exactly(launches):
    """2 hosts x 2 ranks with the hierarchical dispatcher: the losses of one host's padded run (the per-host
    partial sums change only the order of fp32 sums), rows between hosts logged every step; and with ECHO
    on at a capacity that overflows, every overflowed step replayed on the exact path to the same losses,
    the clones' bytes between hosts logged."""
    agents, dump = launches["hier"]
    line = next(l for l in agents[0].stdout.splitlines() if l.startswith("dispatcher "))
    assert "HierarchicalDispatcher, 2 token chunks per layer (overlap_chunks = auto)" in line, line  # pipelined
    # echo = "auto" stays off across hosts; set on, the run summary says so
    line = next(l for l in launches["hier_overflow"][0][0].stdout.splitlines() if l.startswith("dispatcher "))
    assert "HierarchicalDispatcher, ECHO on (" in line, line
    hier, reference = losses(dump), losses(launches["one_host"][1])
    for step in range(1, STEPS + 1):
        assert _same(hier[step], reference[step], 1e-5), (step, hier[step], reference[step])
    rows = [m for m in _metrics(dump) if "moe/network_rows" in m]
    assert len(rows) == STEPS and all(m["moe/network_rows"] > 0 and m["moe/network_gb_per_rank"] > 0 for m in rows)
    over_agents, over_dump = launches["hier_overflow"]
    replayed = [m["step"] for m in _metrics(over_dump) if m.get("moe/replayed")]
    assert replayed, over_agents[0].stdout[-2000:]  # a capacity of 1.0 overflows (C1 = 0.75 T at K=2)
    assert all(m["moe/echo_clone_network_gb_per_rank"] > 0 for m in _metrics(over_dump) if "moe/network_rows" in m)
    over = losses(over_dump)
    for step in range(1, STEPS + 1):
        assert _same(over[step], hier[step], 1e-5), (step, over[step], hier[step], replayed)


def test_experts_shard_within_a_host_and_replicate_across_hosts(launches):
    """EP = 2 inside each of 2 hosts x 2 ranks: each expert's two holders are on different hosts, so the experts
    are replicated across hosts (HSDP: a gradient all-reduce between the hosts) instead of FSDP-sharded over
    them, and the run trains as EP = 4 over one host's 4 ranks does (the same model and data)."""
    agents, dump = launches["hsdp_two_hosts"]
    assert "experts sharded over 1 rank(s) of a host and replicated across hosts" in agents[0].stdout, \
        agents[0].stdout[-2000:]
    two, one = losses(dump), losses(launches["one_host"][1])
    assert list(two) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):  # expert gradients all-reduced vs owned: fp32 sums in another order
        assert _same(two[step], one[step], 1e-5), (step, two[step], one[step])


def test_fastest_across_hosts_times_hierarchical(launches):
    """dispatcher = "fastest" on 2 hosts x 2 ranks times hierarchical beside the flat backends (never nvlink:
    its peer memory does not reach across hosts) and trains with the one it reports."""
    agents, _ = launches["fastest"]
    check_ok(agents)
    line = next(l for l in agents[0].stdout.splitlines() if l.startswith("dispatcher: fastest = "))
    assert all(f"{name} " in line for name in ("hierarchical", "padded", "alltoall")) and "nvlink" not in line, line
    chosen = line.split("= ")[1].split()[0]
    names = {"hierarchical": "HierarchicalDispatcher", "padded": "PaddedDispatcher", "alltoall": "AllToAllDispatcher"}
    assert names[chosen] in agents[0].stdout, agents[0].stdout[-2000:]
