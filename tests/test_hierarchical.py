"""The ``hierarchical`` dispatcher on an emulated two-host cluster: two torchrun agents on this machine
(tests/emulated_hosts.py), 2 hosts × 2 ranks, gloo on CPU. tests/hierarchical_worker.py checks, against the
exact ``alltoall`` dispatcher in fp64, outputs and every gradient with ECHO off and on over random and
adversarial routing, the rows sent between hosts (= the unique (token, other host) pairs), and a forced
overflow counted and replayed exactly. With CUDA (4 GPUs: 2 per emulated host, each agent its own
``NCCL_HOSTID``) the same checks run in fp32 over NCCL, plus a forward + backward under sync_debug."""

import re

import pytest
import torch

from emulated_hosts import check_ok, run_hosts

pytestmark = pytest.mark.slow


def _run(ranks_per_host, *args, gpus=False):
    results = run_hosts(["tests/hierarchical_worker.py", *args], hosts=2, ranks_per_host=ranks_per_host,
                        timeout=600, gpus=gpus)
    check_ok(results)
    # one line per rank; the two ranks of an agent share its stdout, so their lines may run together
    lines = [m for r in results for m in re.findall(r"hierarchical ok \d+ rank \d+ hosts \d+", r.stdout)]
    assert len(lines) == 2 * ranks_per_host, [r.stdout for r in results]
    return lines


def test_hierarchical_equals_alltoall_on_two_hosts_cpu():
    lines = _run(2)
    assert all(l.split()[2] == "23" and l.endswith("hosts 2") for l in lines), lines


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one emulated host each)")
def test_hierarchical_equals_alltoall_on_two_hosts_gpu():
    per_host = 2 if torch.cuda.device_count() >= 4 else 1
    lines = _run(per_host, "--gpu", "--sync-check", gpus=True)
    assert all(l.split()[2] == "25" for l in lines), lines


def _recipe(dump, per_host, *extra):
    """debug_gpu on two emulated hosts for 20 steps under sync_debug; (losses, metrics rows, rank 0's output)."""
    import json
    import os

    from conftest import ROOT

    args = [os.path.join(ROOT, "recipes", "pretrain.py"), "--job.config_file",
            os.path.join(ROOT, "train_configs", "debug_gpu.toml"), "--job.dump_folder", str(dump),
            "--training.steps", "20", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
            "--checkpoint.enable", "false", "--training.sync_debug", "true", *extra]
    results = run_hosts(args, hosts=2, ranks_per_host=per_host, timeout=600, gpus=True)
    check_ok(results)
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r["loss"] for r in rows], rows, results[0].stdout


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one emulated host each)")
def test_hierarchical_recipe_on_two_hosts_gpu_graph_equals_eager(tmp_path):
    """The training step with the hierarchical dispatcher and ECHO on two emulated hosts: sync-free (sync_debug
    raises on a host read), captured as one CUDA graph with the eager run's losses, rows between hosts logged;
    and with EP inside each host, the experts replicated across hosts (HSDP) train."""
    per_host = 2 if torch.cuda.device_count() >= 4 else 1
    world = 2 * per_host
    ep = ["--parallelism.expert_parallel_degree", str(world), "--moe_echo.dispatcher", "hierarchical",
          "--moe_echo.echo", "true", "--moe_echo.capacity_factor", "2.0"]
    eager, rows, _ = _recipe(tmp_path / "eager", per_host, *ep)
    graphed, _, out = _recipe(tmp_path / "graphed", per_host, *ep, "--training.cuda_graph", "true")
    assert "cuda graph: captured" in out and "HierarchicalDispatcher" in out, out[-3000:]
    assert len(eager) == len(graphed) == 20
    for s, (a, b) in enumerate(zip(eager, graphed), 1):
        assert abs(a - b) <= 2e-3 * abs(a), f"step {s}: eager loss {a} vs graphed {b}"
    assert all(r["moe/network_rows"] > 0 and r["moe/echo_clone_network_gb_per_rank"] > 0 for r in rows)
    hsdp, _, out = _recipe(tmp_path / "hsdp", per_host, "--parallelism.expert_parallel_degree", str(per_host))
    assert "replicated across hosts" in out, out[-3000:]
    assert hsdp[-1] < hsdp[0], hsdp
