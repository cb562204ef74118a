"""Checks of the ``deepep`` dispatcher (DeepEP's intranode kernels) at EP = the GPUs torchrun starts (2 or 4; the
layer has 16 experts), run by tests/test_gpu_ep.py where ``deep_ep`` is installed (NCCL):
1. the bf16 EP layer (autocast) matches the same layer at EP=1, forward and backward run;
2. in fp32, at DeepEP budgets of 24 and 64 SMs, outputs and input/parameter gradients against the exact
   alltoall path: outputs and input gradients to 1e-2 (DeepEP's combine takes and returns bf16 rows),
   parameter gradients to 1e-3 (their rows cross in fp32: dispatch, and its cached form in backward)."""

import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deep_ep
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from components.moe_echo.config import MoEEchoConfig
from components.moe_echo.deepep_dispatch import release_buffers
from components.parallel.parallelize import apply_expert_parallel
from gpu_ep_check import make


def apply_ep(ref, mesh, backend):
    layer = copy.deepcopy(ref)
    apply_expert_parallel(layer, mesh, MoEEchoConfig(dispatcher=backend))
    return layer


def grads_of(layer, x, dev):
    y = layer(x)
    (y * torch.linspace(-1, 1, y.numel(), device=dev).view_as(y)).sum().backward()
    return [y.detach(), x.grad] + [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                                   for p in layer.parameters()]


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("ep",))
    ref = make(dev)
    x_all = torch.randn(world, 1024, 512, device=dev, generator=torch.Generator(device=dev).manual_seed(1))
    # 1. bf16 layer at EP=world against EP=1
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y_ref = ref(x_all)
    layer = copy.deepcopy(ref)
    apply_expert_parallel(layer, mesh, MoEEchoConfig(dispatcher="deepep"))
    x = x_all[rank:rank + 1].clone().requires_grad_()
    for _ in range(2):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        y.float().pow(2).mean().backward()
    rel = float((y.float() - y_ref[rank:rank + 1].float()).norm() / y_ref[rank:rank + 1].float().norm())
    assert rel < 2e-2, (f"deepep bf16 at EP={world} vs EP=1", rel)
    if rank == 0:
        print(f"deepep bf16 at EP={world}: rel err vs EP=1 {rel:.2e} (DeepEP's default {deep_ep.Buffer.num_sms} SMs)", flush=True)
    # 2. fp32 against the exact alltoall path, at two SM budgets
    want = grads_of(apply_ep(ref, mesh, "alltoall"), x_all[rank:rank + 1].clone().requires_grad_(), dev)
    for sms in (24, 64):
        deep_ep.Buffer.set_num_sms(sms)
        got = grads_of(apply_ep(ref, mesh, "deepep"), x_all[rank:rank + 1].clone().requires_grad_(), dev)
        errs = [float((a - b).norm() / a.norm().clamp_min(1e-30)) for a, b in zip(want, got)]
        assert errs[0] < 1e-2 and errs[1] < 1e-2, f"fp32 deepep ({sms} SMs) vs alltoall: output / input grad {errs[:2]}"
        assert max(errs[2:]) < 1e-3, f"fp32 deepep ({sms} SMs) vs alltoall: parameter grads {errs[2:]}"
        if rank == 0:
            print(f"fp32 deepep at {sms} SMs vs alltoall: output {errs[0]:.1e}, input grad {errs[1]:.1e}, "
                  f"{len(errs) - 2} parameter grads max {max(errs[2:]):.1e}", flush=True)
    release_buffers()
    dist.barrier()
    if rank == 0:
        print("GPU-DEEPEP-OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
