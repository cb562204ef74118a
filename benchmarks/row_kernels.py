"""The row kernels of the MoE data movement against a plain copy of the same bytes, swept over
their launch shape (rows per CTA iteration ``block_t``, persistent CTAs ``programs``).

    python benchmarks/row_kernels.py [--out DIR]                       # local kernels, one GPU
    torchrun --nproc_per_node 2 benchmarks/row_kernels.py [--out DIR]  # + the peer kernels

Shapes are an EP rank's at R ranks (R = the launch's world size, or --ranks for the local kernels
on one GPU): T tokens per rank, top-K of E experts, the rank owns E/R of them, bf16 rows of D.

    combine_share     gather_sum over the R·T token rows, each summing its ≈K/R weighted rows here
    expand            peer_scatter to this rank (one destination): each token row to its ≈K/R rows
    combine_backward  the owner's grad_y rows (w·g) and grad_w, into given buffers
    local_combine     gather_sum of T tokens × K rows (the one-GPU ``local`` dispatcher's combine)
    pull (R ranks)    peer_gather_sum of R rows per token, one from each rank (combine's last step)
    send (R ranks)    peer_scatter of each token to every rank (dispatch's first step)

``GBs`` counts each kernel's own HBM (local) or NVLink (peer: remote rows only) bytes; ``of_copy``
divides the time of a ``copy_`` of the same bytes (local: on this GPU; peer: written into the
peer's symmetric buffer through its mapping, one copy kernel) by the kernel's. The slowest rank's time is reported.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

from benchmarks.common import environment, markdown_table, time_ms, write_results
from kernels.moe_rows import combine_backward, gather_sum
from kernels.peer_rows import peer_gather_sum, peer_scatter


def owner_rows(T: int, K: int, E: int, R: int, gen, dev):
    """This rank's (rank 0's) view of R sources' routing: idx [R·T, K] = the expert-major row of
    each choice that lands here (-1 elsewhere), and the rows received."""
    ids = torch.rand(R * T, E, generator=gen, device=dev).topk(K, dim=-1).indices
    here = ids < E // R
    n = int(here.sum())
    order = torch.argsort(torch.where(here, ids, E).flatten(), stable=True)  # expert-major, sources in order
    row = torch.empty(R * T * K, dtype=torch.long, device=dev)
    row[order] = torch.arange(R * T * K, device=dev)
    idx = torch.where(here.flatten(), row, -1).view(R * T, K).to(torch.int32)
    return idx, n


def slowest(ms: float, world: int) -> float:
    if world == 1:
        return ms
    t = torch.tensor([ms], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def copy_ms(nbytes: int, dev, peer_buf=None) -> float:
    """A ``copy_`` that moves ``nbytes`` in all: reads + writes on one GPU, or, with ``peer_buf`` (a
    peer's symmetric buffer mapped here), ``nbytes`` written into the peer."""
    n = max(1, nbytes // (4 if peer_buf is None else 2))
    src = torch.empty(n, dtype=torch.bfloat16, device=dev)
    dst = torch.empty(n, dtype=torch.bfloat16, device=dev) if peer_buf is None else peer_buf.view(-1)[:n]
    return time_ms(lambda: dst.copy_(src))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--shapes", default="2048x6x64,7168x8x256", help="DxKxE, comma-separated")
    ap.add_argument("--ranks", type=int, default=2, help="R of the local kernels' shapes on one GPU")
    ap.add_argument("--block-t", default="1,2,4,8")
    ap.add_argument("--programs", default="0,264,1056", help="persistent CTAs of local kernels (0: one per block)")
    ap.add_argument("--peer-programs", default="32,64,132")
    a = ap.parse_args()
    world = 1
    if "RANK" in os.environ:
        dist.init_process_group("nccl")
        world = dist.get_world_size()
    rank = dist.get_rank() if world > 1 else 0
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    R = world if world > 1 else a.ranks
    T = a.tokens
    rows = []
    bts = [int(b) for b in a.block_t.split(",")]
    progs = [int(p) or None for p in a.programs.split(",")]

    def add(kernel, D, K, E, nbytes, base_ms, sweep):
        for bt, pr, fn in sweep:
            ms = slowest(time_ms(fn), world)
            rows.append({"kernel": kernel, "D": D, "K": K, "E": E, "ranks": R, "block_t": bt,
                         "programs": pr or "per block", "ms": ms, "MB": nbytes / 1e6,
                         "GBs": nbytes / ms / 1e6, "of_copy": base_ms / ms})
            if rank == 0:
                print(rows[-1], flush=True)

    for shape in a.shapes.split(","):
        D, K, E = map(int, shape.split("x"))
        gen = torch.Generator(device=dev).manual_seed(D + K)
        idx, n = owner_rows(T, K, E, R, gen, dev)
        w = torch.rand(R * T, K, generator=gen, device=dev)
        y = torch.randn(n, D, generator=gen, device=dev).bfloat16()
        tok = torch.empty(R * T, D, device=dev, dtype=torch.bfloat16)
        # combine_share: reads the n rows here, writes R·T token rows
        nb = (n + R * T) * D * 2
        add("combine_share", D, K, E, nb, copy_ms(nb, dev),
            [(bt, pr, (lambda bt=bt, pr=pr: gather_sum(y, idx, w, out=tok, programs=pr, block_t=bt)))
             for bt in bts for pr in progs])
        x = torch.empty(n, D, device=dev, dtype=torch.bfloat16)
        nb = (n + R * T) * D * 2
        ptr = torch.tensor([x.data_ptr()], dtype=torch.int64, device=dev)
        add("expand", D, K, E, nb, copy_ms(nb, dev),
            [(bt, pr, (lambda bt=bt, pr=pr: peer_scatter(tok, None, idx, ptr, [x], programs=pr or 1 << 30,
                                                         block_t=bt)))
             for bt in bts for pr in progs])
        gy = torch.empty_like(y)
        nb = (2 * n + R * T) * D * 2
        add("combine_backward", D, K, E, nb, copy_ms(nb, dev),
            [(None, None, lambda: combine_backward(tok, y, w, idx, grad_y_out=gy))])
        lidx = torch.randperm(T * K, device=dev, generator=gen).view(T, K)
        ly = torch.randn(T * K, D, generator=gen, device=dev).bfloat16()
        lw = torch.rand(T, K, generator=gen, device=dev)
        nb = (T * K + T) * D * 2
        add("local_combine", D, K, E, nb, copy_ms(nb, dev),
            [(bt, pr, (lambda bt=bt, pr=pr: gather_sum(ly, lidx, lw, programs=pr, block_t=bt)))
             for bt in bts for pr in progs])
        del x, y, gy, ly
        if world > 1:
            from components.moe_echo.symmetric import workspace_for

            ws = workspace_for(dist.group.WORLD)
            buf = ws.buffer(f"rows/{D}", (R * T, D), torch.bfloat16, dev)
            buf.local.normal_()
            x_TD = torch.randn(T, D, device=dev, dtype=torch.bfloat16, generator=gen)
            r_TR = torch.arange(R, device=dev).expand(T, R).contiguous()
            row_TR = (rank * T + torch.arange(T, device=dev)).unsqueeze(1).expand(T, R).contiguous()
            remote = (R - 1) * T * D * 2  # each rank pulls (sends) this many bytes over NVLink
            base = slowest(copy_ms(remote, dev, buf.peers[(rank + 1) % world][rank * T:]), world)
            pp = [int(p) for p in a.peer_programs.split(",")]
            ws.barrier(buf)
            add("pull", D, R, E, remote, base,
                [(bt, pr, (lambda bt=bt, pr=pr: peer_gather_sum(r_TR, row_TR, buf.ptrs_R, buf.peers,
                                                                   programs=pr, block_t=bt)))
                 for bt in bts for pr in pp])
            add("send", D, R, E, remote, base,
                [(bt, pr, (lambda bt=bt, pr=pr: peer_scatter(x_TD, r_TR, row_TR, buf.ptrs_R, buf.peers,
                                                                programs=pr, block_t=bt)))
                 for bt in bts for pr in pp])
            ws.barrier(buf)
    if rank == 0:
        env = environment()
        env["ranks"] = R
        env["tokens_per_rank"] = T
        table = markdown_table(rows, ["kernel", "D", "K", "E", "ranks", "block_t", "programs", "ms", "MB", "GBs",
                                      "of_copy"])
        stem = write_results(f"row_kernels_ep{R}", env, rows, table, a.out, gpus=world)
        print(f"\nrow kernels, {env['gpu']}, torch {env['torch']} ({stem}.json)\n{table}")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
