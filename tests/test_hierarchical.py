"""The ``hierarchical`` dispatcher on an emulated two-host cluster: two torchrun agents on this machine
(tests/emulated_hosts.py), 2 hosts × 2 ranks, gloo on CPU. tests/hierarchical_worker.py checks, against the
exact ``alltoall`` dispatcher in fp64, outputs and every gradient with ECHO off and on over random and
adversarial routing, the rows sent between hosts (= the unique (token, other host) pairs), and a forced
overflow counted and replayed exactly. With CUDA (4 GPUs: 2 per emulated host, each agent its own
``NCCL_HOSTID``) the same checks run in fp32 over NCCL, plus a forward + backward under sync_debug."""

import pytest
import torch

from emulated_hosts import check_ok, run_hosts

pytestmark = pytest.mark.slow


def _run(ranks_per_host, *args, gpus=False):
    results = run_hosts(["tests/hierarchical_worker.py", *args], hosts=2, ranks_per_host=ranks_per_host,
                        timeout=600, gpus=gpus)
    check_ok(results)
    lines = [l for r in results for l in r.stdout.splitlines() if l.startswith("hierarchical ok")]
    assert len(lines) == 2 * ranks_per_host, lines
    return lines


def test_hierarchical_equals_alltoall_on_two_hosts_cpu():
    lines = _run(2)
    assert all(l.split()[2] == "9" and l.endswith("hosts 2") for l in lines), lines


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one emulated host each)")
def test_hierarchical_equals_alltoall_on_two_hosts_gpu():
    per_host = 2 if torch.cuda.device_count() >= 4 else 1
    lines = _run(per_host, "--gpu", "--sync-check", gpus=True)
    assert all(l.split()[2] == "10" for l in lines), lines
