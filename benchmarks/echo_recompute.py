"""ECHO expert recompute on 2 GPUs: peak memory and time of one MoE layer fwd+bwd at EP=2 with
ECHO on, with and without ``echo_recompute`` (E=64, D=2048, H=1408, K=6, 16384 tokens/rank,
8 hot experts on rank 0, 4 echo slots per rank, padded dispatch, bf16).

    torchrun --nproc_per_node 2 benchmarks/echo_recompute.py [--out DIR]
"""

import argparse
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torchtitan.models.moe import MoEArgs

from benchmarks.common import environment, markdown_table, time_ms, write_results
from components.moe_echo.config import MoEEchoConfig
from components.moe_echo.layer import MoELayer
from components.parallel.parallelize import apply_expert_parallel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    mesh = init_device_mesh("cuda", (2,), mesh_dim_names=("ep",))
    torch.manual_seed(0)
    args = MoEArgs(num_experts=64, num_shared_experts=0, top_k=6, score_func="softmax", score_before_experts=False)
    base = MoELayer(args, 2048, 1408, MoEEchoConfig()).to(dev)
    base.init_weights(0.02, dev)
    base.to(torch.bfloat16)
    base.expert_bias.data = base.expert_bias.float()
    base.expert_bias[:8] = 1.0
    x = torch.randn(1, 16384, 2048, device=dev, dtype=torch.bfloat16, requires_grad=True)
    rows = []
    for recompute in (False, True):
        layer = copy.deepcopy(base)
        cfg = MoEEchoConfig(dispatcher="padded", capacity_factor=1.25, echo=True, echo_slots_per_rank=4,
                            echo_recompute=recompute)
        layer.cfg = cfg
        apply_expert_parallel(layer, mesh, cfg)

        def step():
            x.grad = None
            layer.zero_grad(set_to_none=True)
            layer(x).float().pow(2).mean().backward()

        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        base_mem = torch.cuda.memory_allocated(dev)
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated(dev) - base_mem) / 2**30
        ms = time_ms(step, warmup=2, iters=10)
        t = torch.tensor([peak, ms], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        rows.append({"echo_recompute": recompute, "peak_extra_GiB": float(t[0]), "fwd_bwd_ms": float(t[1]),
                     "overflow": int(layer.overflow_count), "clones": float(layer.echo_stats[2])})
    if rank == 0:
        env = environment()
        table = markdown_table(rows, list(rows[0]))
        stem = write_results("echo_recompute", env, rows, table, a.out, gpus=dist.get_world_size())
        print(f"\nECHO layer fwd+bwd at EP=2 on {env['gpu']} ({stem}.json)\n{table}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
