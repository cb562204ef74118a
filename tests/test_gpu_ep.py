"""Expert parallelism on 2 GPUs (NCCL): sync-free padded dispatch, alltoall syncs, bf16 parity; the deepep
dispatcher against alltoall where deep_ep is installed."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpu_expert_parallel_checks():
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        os.path.join(ROOT, "tests", "gpu_ep_check.py")], capture_output=True, text=True, timeout=600)
    print(p.stdout[-3000:])
    assert p.returncode == 0 and "GPU-EP-OK" in p.stdout, p.stderr[-5000:]


@pytest.mark.skipif(importlib.util.find_spec("deep_ep") is None, reason="needs deep_ep (benchmarks/gpu/build_deepep.sh)")
@pytest.mark.parametrize("ep", [2, 4])
def test_deepep_matches_alltoall(ep):
    if torch.cuda.device_count() < ep:
        pytest.skip(f"needs {ep} GPUs")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ep),
                        os.path.join(ROOT, "tests", "gpu_deepep_check.py")], capture_output=True, text=True, timeout=600)
    print(p.stdout[-3000:])
    assert p.returncode == 0 and "GPU-DEEPEP-OK" in p.stdout, p.stderr[-5000:]
