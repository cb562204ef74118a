"""Dispatch + combine across hosts: ``hierarchical`` (one row per (token, destination host) on the network;
``hierarchical_fp8``: its dispatch rows in e4m3 + a scale, ``dispatch_precision = "fp8"``) vs flat ``padded``
(one fixed block per (source, destination) rank pair) vs flat ``alltoall`` (exact sizes, read on the host), on
H hosts × L GPUs, plus NCCL's all_to_all bandwidth between the hosts.

    python benchmarks/dispatch_hosts.py --hosts 2 --gpus-per-host 2 [--out DIR]     (emulated hosts)
    torchrun --nnodes H ... benchmarks/dispatch_hosts.py --worker [--out DIR]     (a real cluster)

Without ``--worker`` it emulates the hosts on this machine: one torchrun agent per host, each with its GPUs
and its own ``NCCL_HOSTID`` (NCCL then moves bytes between them over its network transport, as between
hosts; the emulated network is much slower than a real one, so its times are for bytes and their effect).

Per shape (T tokens per rank, D hidden, E experts, top-K, bf16, capacity factor cf) and routing (uniform
or skewed: Zipf popularity) each backend reports, from the busiest rank:
    network_MB    bytes this rank sends to other hosts per dispatch + combine, padding included
                  (padded: (R − L) blocks of C rows each way; hierarchical: (H − 1) blocks of C1 rows each
                  way + ids and weights; alltoall: its exact rows)
    network_rows  token rows sent to other hosts per dispatch (real rows: padded and alltoall one per
                  (token, choice) on another host, hierarchical one per (token, other host))
    ms / graph_ms dispatch + combine forward, eager / captured in a CUDA graph (the slowest rank)
and ``net_gbs``: NCCL all_to_all GB/s per peer between the hosts (the ranks of one local index).
Writes ``dispatch_hosts_<label>_<N>x<GPU>.{json,md}``.
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch
import torch.distributed as dist

E, K, CF = 64, 6, 1.25  # v2lite_1b's routed experts and top-k
SHAPES = [(4096, 2048), (16384, 2048)]


def net_gbs(hosts, dev, mb: int = 64) -> float:
    """all_to_all GB/s per peer over the net group (one rank per host), bytes to other hosts / time."""
    from benchmarks.common import slowest, time_ms

    H = hosts.hosts
    x = torch.empty(H * mb * 2**20 // 2, dtype=torch.bfloat16, device=dev).normal_()
    y = torch.empty_like(x)
    ms = slowest(time_ms(lambda: dist.all_to_all_single(y, x, group=hosts.net_group), warmup=2, iters=5))
    return (H - 1) * mb * 2**20 / (ms * 1e-3) / 1e9 / (H - 1)


def worker(a):
    from benchmarks.common import environment, graphed, markdown_table, routing_ids, slowest, time_ms, write_results
    from components.moe_echo.ep_dispatch import AllToAllDispatcher, PaddedDispatcher, padded_capacity
    from components.moe_echo.hierarchical_dispatch import HierarchicalDispatcher
    from components.parallel.hosts import ep_hosts

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    rank, R, dev = dist.get_rank(), dist.get_world_size(), torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD
    hosts = ep_hosts(group)
    H, L = hosts.hosts, hosts.ranks_per_host
    assert H > 1, "the ranks do not span hosts (launch one torchrun agent per host)"
    bw = net_gbs(hosts, dev)
    rows = []
    for T, D in SHAPES:
        for kind in ("uniform", "skewed"):
            gen = torch.Generator(device=dev).manual_seed(1000 + rank)
            ids = routing_ids(T, E, K, kind, gen, dev)
            w = torch.rand(T, K, device=dev)
            x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
            host_TK = ids // (E // H)
            remote_TK = host_TK != hosts.host_rank
            pair_rows = int(remote_TK.sum())
            host_pairs = int((torch.zeros(T, H, dtype=torch.bool, device=dev).scatter_(1, host_TK, True)).sum()
                             - (host_TK == hosts.host_rank).any(1).sum())
            C = padded_capacity(T, K, R, CF)
            backends = {
                "alltoall": (AllToAllDispatcher(E, group, R), 2 * pair_rows * D * 2),
                "padded": (PaddedDispatcher(E, group, R, CF), 2 * (R - L) * C * D * 2),
                "hierarchical": (HierarchicalDispatcher(E, group, R, CF, H, hosts.net_group, hosts.host_group,
                                                        hosts.host_rank), None),
                "hierarchical_fp8": (HierarchicalDispatcher(E, group, R, CF, H, hosts.net_group, hosts.host_group,
                                                            hosts.host_rank), None),  # dispatch_precision = "fp8"
            }
            backends["hierarchical_fp8"][0].wire = "fp8"
            for name, (d, nbytes) in backends.items():
                def round_trip(d=d):
                    x_ND, counts_e, h = d.dispatch(x, ids, w)
                    return d.combine(x_ND, h), h

                y, h = round_trip()
                if name.startswith("hierarchical"):
                    nbytes = d.network_bytes(T, K, D, 2)
                    real = int(h.network_rows)
                    assert real == host_pairs, (real, host_pairs)
                else:
                    real = pair_rows
                dropped = int(h.dropped) if h.dropped is not None else 0
                ms = slowest(time_ms(lambda: round_trip(), warmup=3, iters=10))
                graph_ms = None
                if d.sync_free:
                    replay = graphed(lambda: round_trip())
                    graph_ms = slowest(time_ms(replay, warmup=3, iters=10))
                net = torch.tensor([nbytes, real], device=dev, dtype=torch.float64)
                dist.all_reduce(net, op=dist.ReduceOp.MAX)
                rows.append({"dispatcher": name, "routing": kind, "hosts": H, "gpus_per_host": L,
                             "tokens_per_rank": T, "hidden": D, "top_k": K, "experts": E, "capacity_factor": CF,
                             "network_MB": float(net[0]) / 1e6, "network_rows": int(net[1]), "dropped": dropped,
                             "dispatch_combine_ms": ms, "graph_ms": graph_ms, "network_gbs": bw})
            base = {r["dispatcher"]: r for r in rows[-len(backends):]}
            for r in rows[-len(backends):]:
                r["network_vs_padded"] = r["network_MB"] / base["padded"]["network_MB"]
                r["speedup_vs_padded"] = base["padded"]["dispatch_combine_ms"] / r["dispatch_combine_ms"]
                if r["graph_ms"] and base["padded"]["graph_ms"]:
                    r["graph_speedup_vs_padded"] = base["padded"]["graph_ms"] / r["graph_ms"]
    if rank == 0:
        env = {**environment(), "hosts": H, "gpus_per_host": L, "net_gbs_per_peer": bw,
               "emulated": os.environ.get("NCCL_HOSTID", "").startswith("emulated")}
        cols = ["dispatcher", "routing", "tokens_per_rank", "hidden", "network_MB", "network_vs_padded",
                "network_rows", "dropped", "dispatch_combine_ms", "graph_ms", "speedup_vs_padded",
                "graph_speedup_vs_padded"]
        table = markdown_table(rows, cols) + f"\n\nNCCL all_to_all between the hosts: {bw:.2f} GB/s per peer"
        stem = write_results(f"dispatch_hosts{a.label}", {**env, "gpu_name": env["gpu"]}, rows, table, a.out,
                             gpus=H * L)  # dispatch_hosts_<label>_<N>x<GPU>: all hosts' GPUs
        print(table, flush=True)
        print(json.dumps({"results": stem}), flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help="run as a torchrun worker (a real multi-node launch)")
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--gpus-per-host", type=int, default=2)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    a = ap.parse_args()
    if a.label and not a.label.startswith("_"):
        a.label = "_" + a.label
    if a.worker:
        return worker(a)
    from emulated_hosts import check_ok, run_hosts

    args = [os.path.abspath(__file__), "--worker", "--out", a.out] + (["--label", a.label] if a.label else [])
    results = run_hosts(args, hosts=a.hosts, ranks_per_host=a.gpus_per_host, timeout=900, gpus=True,
                        env={"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"})
    check_ok(results)
    log = results[0].stdout + results[0].stderr
    nets = sorted({l.split("NET/")[1].split()[0] for l in log.splitlines() if "NET/" in l})
    print("NCCL network transport between the hosts:", ", ".join(nets) or "none reported")
    print(results[0].stdout[-6000:])


if __name__ == "__main__":
    main()
