"""What moves a [T, D] block of bf16 rows into a peer GPU fastest, and what it costs the SMs: the copy engines
(``[moe_echo] nvlink_copy = "copy_engine"``) against the NVLink dispatcher's copy kernels.

    torchrun --nproc_per_node 2 benchmarks/copy_engine.py [--out DIR]      -> copy_engine_2x<GPU>.{json,md}

Both ranks at once, each into the other's PyTorch symmetric-memory buffer, every op graphed:
``ce_push`` (``copy_`` into the peer's tensor: a cudaMemcpyAsync the driver runs on the copy engines),
``ce_pull`` (``copy_`` from the peer's tensor), the NVLink dispatcher's Triton kernels ``send`` (peer_scatter) at
64 and 24 CTAs and ``pull`` (peer_gather_sum) at 64, and a local ``copy_`` of the same bytes. ``beside_gemm_ms``:
the op with an 8192³ bf16 GEMM on a side stream at the same time (``gemm_ms`` alone): an op that leaves the SMs
to the GEMM costs about max(op, GEMM). The last table is rank 0's profiler names of the three copies
(``Memcpy PtoP``: the copy engines between GPUs).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import beside, environment, graphed, markdown_table, slowest, time_ms, write_results
from components.moe_echo.symmetric import workspace_for
from kernels.peer_rows import peer_gather_sum, peer_scatter


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="16384x2048,16384x7168", help="TxD, comma-separated")
    a = ap.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    ws = workspace_for(dist.group.WORLD)
    other = (rank + 1) % dist.get_world_size()

    mm_a, mm_b = (torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16) for _ in range(2))
    gemm = lambda: torch.mm(mm_a, mm_b)  # noqa: E731
    rows, names = [], ""
    for shape in a.shapes.split(","):
        T, D = map(int, shape.split("x"))
        buf = ws.buffer(f"copy_engine/{D}", (2 * T, D), torch.bfloat16, dev)
        x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
        local = torch.empty_like(x)
        to_peer, from_peer = buf.peers[other][rank * T:(rank + 1) * T], buf.peers[other][other * T:(other + 1) * T]
        rank_T1 = torch.full((T, 1), other, device=dev, dtype=torch.long)
        row_T1 = (rank * T + torch.arange(T, device=dev)).view(T, 1)
        ops = {
            "ce_push": lambda: to_peer.copy_(x),
            "ce_pull": lambda: local.copy_(from_peer),
            "send_kernel_64": lambda: peer_scatter(x, rank_T1, row_T1, buf.ptrs_R, buf.peers, programs=64),
            "send_kernel_24": lambda: peer_scatter(x, rank_T1, row_T1, buf.ptrs_R, buf.peers, programs=24),
            "pull_kernel_64": lambda: peer_gather_sum(rank_T1, row_T1, buf.ptrs_R, buf.peers, programs=64),
            "local_copy": lambda: local.copy_(x),
        }
        dist.barrier()
        t_gemm = slowest(time_ms(graphed(gemm)))
        for name, op in ops.items():
            both = beside(gemm, op)  # the op on the side stream, the GEMM on the current one
            dist.barrier()
            ms = slowest(time_ms(graphed(op)))
            dist.barrier()
            with_gemm = slowest(time_ms(graphed(both)))
            rows.append({"T": T, "D": D, "op": name, "ms": ms, "GBs": T * D * 2 / ms / 1e6, "gemm_ms": t_gemm,
                         "beside_gemm_ms": with_gemm, "added_to_gemm_ms": with_gemm - t_gemm})
            if rank == 0:
                print(rows[-1], flush=True)
        if rank == 0 and not names:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for name in ("ce_push", "ce_pull", "local_copy"):
                    ops[name]()
                torch.cuda.synchronize()
            names = prof.key_averages().table(sort_by="cuda_time_total", row_limit=4, max_name_column_width=40)
        dist.barrier()
    if rank == 0:
        env = environment()
        table = markdown_table(rows, ["T", "D", "op", "ms", "GBs", "gemm_ms", "beside_gemm_ms", "added_to_gemm_ms"])
        table += f"\n\nRank 0's profile of ce_push, ce_pull and local_copy at the first shape:\n\n```\n{names}\n```"
        stem = write_results("copy_engine", env, rows, table, a.out, gpus=dist.get_world_size())
        print(f"\n{stem}.json\n{table}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
