"""Worker of the two-host tests of the ``hierarchical`` dispatcher, run by torchrun agents (one per emulated
host, tests/emulated_hosts.py): every rank builds the same MoE layer twice, expert-parallel over all ranks,
once with the exact ``alltoall`` dispatcher and once with ``hierarchical``, and checks on its own tokens:

- outputs and every gradient (input, router, shared and routed experts) equal, ECHO off and on, for random
  and adversarial routing (all tokens to one host, one hot expert per host, experts with no tokens);
- the rows sent between hosts = the unique (token, other host) pairs of this rank's routing, exactly;
- with a capacity too small, the overflow is counted (never silent) and the exact dispatcher's replay of
  the same step gives the exact result;
- the same with the layer's tokens in 3 pipelined chunks (``overlap_chunks``), ``hierarchical`` and ``padded``.

    python -m torch.distributed.run --nnodes 2 --node_rank h ... tests/hierarchical_worker.py [--gpu] [--sync-check]

Prints ``hierarchical ok <checks>`` on each rank at the end; any mismatch raises.
"""

import argparse
import copy
import dataclasses
import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

E, K, D, HID, TOKENS = 16, 4, 32, 16, 24  # bf16 rows of D and HID: 16-byte multiples (grouped GEMM)


def build_layer(dtype, device, bias_E):
    from torchtitan.models.moe import MoEArgs

    from components.moe_echo.config import MoEEchoConfig
    from components.moe_echo.layer import MoELayer

    torch.manual_seed(0)
    args = MoEArgs(num_experts=E, num_shared_experts=1, top_k=K, score_func="softmax", score_before_experts=False)
    layer = MoELayer(args, D, HID, MoEEchoConfig())  # the router adds expert_bias (never updated here)
    layer.init_weights(0.3)
    with torch.no_grad():
        layer.router.gate.weight.normal_(0, 1.0)
    layer = layer.to(device=device, dtype=dtype)
    layer.expert_bias.data = bias_E.to(device=device, dtype=torch.float32)
    return layer


def routing_bias(case: str, hosts: int) -> torch.Tensor:
    """Router bias per expert for a routing case (E experts over the hosts, E / hosts per host)."""
    bias, per_host = torch.zeros(E), E // hosts
    if case == "all_to_one_host":  # every choice of every token on the last host
        bias[:] = -50.0
        bias[E - per_host:] = 50.0
    elif case == "one_hot_per_host":  # the first expert of every host takes a choice of every token
        bias[::per_host] = 50.0
    elif case == "empty_experts":
        bias[[0, 1, per_host + 1, E - 1]] = -50.0
    return bias


def grads(layer):
    from components.tensors import local_of

    return {n: local_of(p.grad).clone() for n, p in layer.named_parameters() if p.grad is not None}


def run_case(case, echo, dtype, device, mesh, capacity_factor, tol, dispatcher="hierarchical", chunks=1,
             wire="bf16", on_grid=False):
    from components.moe_echo.config import MoEEchoConfig
    from components.parallel.parallelize import apply_expert_parallel

    rank, world = dist.get_rank(), dist.get_world_size()
    hosts = world // int(os.environ["LOCAL_WORLD_SIZE"])
    ref = build_layer(dtype, device, routing_bias(case, hosts))
    hier = copy.deepcopy(ref)
    hier.cfg = dataclasses.replace(hier.cfg, overlap_chunks=chunks)
    common = dict(echo=echo, echo_slots_per_rank=2, bias_update_rate=0.0)
    apply_expert_parallel(ref, mesh, MoEEchoConfig(dispatcher="alltoall", **common))
    apply_expert_parallel(hier, mesh, MoEEchoConfig(dispatcher=dispatcher, capacity_factor=capacity_factor,
                                                    overlap_chunks=chunks, dispatch_precision=wire, **common))
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(1, TOKENS, D, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    gy = torch.randn(1, TOKENS, D, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    if on_grid:  # token rows e4m3 can hold exactly (times a power of two): the fp8 wire is lossless for them
        from components.moe_echo.comm import fp8_rows, rows_of_fp8

        x = rows_of_fp8(fp8_rows(x.view(TOKENS, D)), dtype).view_as(x)
    out = {}
    for name, layer in (("alltoall", ref), ("hierarchical", hier)):
        xi = x.clone().requires_grad_()
        y = layer(xi)
        (y * gy).sum().backward()
        out[name] = (y.detach(), xi.grad.clone(), grads(layer))
    return ref, hier, x, gy, out


def check_equal(out, tol, what):
    (ya, gxa, gwa), (yh, gxh, gwh) = out["alltoall"], out["hierarchical"]
    torch.testing.assert_close(yh, ya, rtol=tol, atol=tol, msg=lambda m: f"{what}: output: {m}")
    torch.testing.assert_close(gxh, gxa, rtol=tol, atol=tol, msg=lambda m: f"{what}: input grad: {m}")
    assert gwa.keys() == gwh.keys(), (what, gwa.keys(), gwh.keys())
    for n in gwa:
        torch.testing.assert_close(gwh[n], gwa[n], rtol=tol, atol=tol, msg=lambda m, n=n: f"{what}: grad {n}: {m}")


def expected_network_rows(layer, x, hosts) -> int:
    """Unique (token, other host) pairs of this rank's routing (after ECHO's rewrite), computed directly."""
    d = layer.dispatcher
    with torch.no_grad():
        r = layer.router(x.view(-1, D), layer.expert_bias)
        ids = r.topk_ids_TK
        if layer.echo is not None:  # the rewrite the layer ran: per token chunk where it pipelines
            from components.moe_echo.pipelined import chunks_for

            ids, _ = layer.echo.route(ids, r.counts_E, chunks_for(layer.cfg, d, ids.shape[0], True))
    host_TK = ids // (d.num_experts // hosts)
    mine = dist.get_rank() // (dist.get_world_size() // hosts)
    pairs = {(t, h) for t, row in enumerate(host_TK.tolist()) for h in row if h != mine}
    return len(pairs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--sync-check", action="store_true", help="no host sync in the hierarchical step (CUDA)")
    a = ap.parse_args()
    from torch.distributed.device_mesh import init_device_mesh

    if a.gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if a.gpu else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if a.gpu else torch.device("cpu")
    world = dist.get_world_size()
    hosts = world // int(os.environ["LOCAL_WORLD_SIZE"])
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))
    dtype, tol = (torch.float32, 2e-5) if a.gpu else (torch.float64, 1e-12)
    checks = 0
    cases = ("random", "all_to_one_host", "one_hot_per_host", "empty_experts")
    for echo in (False, True):
        for case in cases:
            what = f"echo={echo} routing={case}"
            ref, hier, x, _, out = run_case(case, echo, dtype, device, mesh, capacity_factor=float(K), tol=tol)
            assert int(hier.overflow_count) == 0, what
            check_equal(out, tol, what)
            if echo and case in ("all_to_one_host", "one_hot_per_host"):
                assert float(hier.echo_stats[2]) >= 1, f"{what}: ECHO placed no clone"
                assert type(hier.echo.transport).__name__ == "HostTransport", what
            if echo and case == "all_to_one_host":  # the idle host's ranks clone the busy host's experts
                x_G, S, e = hier.echo.last_plan.slot_expert_G, hier.echo.S, hier.echo.e
                L = world // hosts
                remote = (x_G >= 0) & (x_G // e // L != torch.arange(x_G.numel(), device=x_G.device) // S // L)
                assert int(remote.sum()) >= 1, f"{what}: no clone crossed hosts"
            rows = int(hier.network_rows)  # one forward (the layer was run once)
            want = expected_network_rows(hier, x, hosts)
            assert rows == want, f"{what}: {rows} rows sent between hosts, unique (token, host) pairs {want}"
            checks += 1
    # overflow: both legs too small; counted, and the exact dispatcher's replay of the step is exact
    from components.moe_echo.ep_dispatch import AllToAllDispatcher

    ref, hier, x, gy, out = run_case("all_to_one_host", False, dtype, device, mesh, capacity_factor=0.25, tol=tol)
    dropped = hier.overflow_count.clone().view(1)
    dist.all_reduce(dropped)
    assert int(dropped) > 0, "a capacity of 0.25 did not overflow"
    assert float(hier.capacity_need) > 0.25, float(hier.capacity_need)
    d = hier.dispatcher
    hier.dispatcher = AllToAllDispatcher(d.num_experts, d.group, d.ep_size)  # what the step gate's replay does
    for p in hier.parameters():
        p.grad = None
    xi = x.clone().requires_grad_()
    y = hier(xi)
    (y * gy).sum().backward()
    out["hierarchical"] = (y.detach(), xi.grad.clone(), grads(hier))
    check_equal(out, tol, "overflow replayed")
    checks += 1
    checks += pipelined_checks(dtype, device, mesh, tol, hosts)
    checks += fp8_wire_checks(dtype, device, mesh, tol)
    if a.sync_check:
        for chunks in (1, 2):  # bf16: the grouped-GEMM experts (fp32 loops over experts on the host)
            sync_free_step(device, torch.bfloat16, mesh, chunks)
            checks += 1
    dist.barrier()
    print(f"hierarchical ok {checks} rank {dist.get_rank()} hosts {hosts}", flush=True)
    dist.destroy_process_group()


def pipelined_checks(dtype, device, mesh, tol, hosts) -> int:
    """The layer's tokens in 3 chunks, dispatch of one beside the experts of another (``overlap_chunks``):
    equal to the exact ``alltoall`` layer, the rows sent between hosts still the unique (token, host) pairs,
    and an overflow of the chunks' smaller blocks counted."""
    checks = 0
    for dispatcher in ("hierarchical", "padded"):
        for echo in (False, True):
            for case in ("random", "one_hot_per_host"):
                what = f"{dispatcher} in 3 chunks echo={echo} routing={case}"
                _, layer, x, _, out = run_case(case, echo, dtype, device, mesh, float(K), tol, dispatcher, chunks=3)
                assert int(layer.overflow_count) == 0, what
                check_equal(out, tol, what)
                if dispatcher == "hierarchical":
                    rows, want = int(layer.network_rows), expected_network_rows(layer, x, hosts)
                    assert rows == want, f"{what}: {rows} rows sent between hosts, unique (token, host) pairs {want}"
                checks += 1
    _, layer, *_ = run_case("all_to_one_host", False, dtype, device, mesh, 0.25, tol, "hierarchical", chunks=3)
    dropped = layer.overflow_count.clone().view(1)
    dist.all_reduce(dropped)
    assert int(dropped) > 0 and float(layer.capacity_need) > 0.25, "3 chunks at capacity 0.25: no overflow counted"
    return checks + 1


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def fp8_wire_checks(dtype, device, mesh, tol) -> int:
    """``dispatch_precision = "fp8"``: token rows on the e4m3 grid cross exactly, so the layer's output equals
    the exact ``alltoall`` one, ECHO off and on; the output gradients sent to the experts cross in e4m3 too, so
    the gradients are within its rounding, not equal; rows off the grid give outputs within e4m3's rounding."""
    checks = 0
    for dispatcher in ("hierarchical", "padded"):
        for echo in (False, True):
            what = f"{dispatcher} fp8 wire echo={echo}"
            _, layer, *_, out = run_case("one_hot_per_host", echo, dtype, device, mesh, float(K), tol, dispatcher,
                                         wire="fp8", on_grid=True)
            assert layer.dispatcher.wire == "fp8" and int(layer.overflow_count) == 0, what
            (ya, gxa, gwa), (yf, gxf, gwf) = out["alltoall"], out["hierarchical"]
            torch.testing.assert_close(yf, ya, rtol=tol, atol=tol, msg=lambda m: f"{what}: output: {m}")
            assert 1e-6 < _rel(gxf, gxa) < 0.1, f"{what}: input gradient off by {_rel(gxf, gxa)}"
            for n in ("experts.w1", "experts.w2", "experts.w3"):
                assert _rel(gwf[n], gwa[n]) < 0.1, f"{what}: {n} gradient off by {_rel(gwf[n], gwa[n])}"
            checks += 1
    *_, out = run_case("random", False, dtype, device, mesh, float(K), tol, "hierarchical", wire="fp8")
    rel = _rel(out["hierarchical"][0], out["alltoall"][0])
    assert 1e-6 < rel < 0.1, f"fp8 wire off the grid: relative error {rel}"
    return checks + 1


def sync_free_step(device, dtype, mesh, chunks=1):
    """Forward + backward of the hierarchical layer (ECHO on; ``chunks`` pipelined token chunks) under
    sync_debug_mode('error')."""
    from components.moe_echo.config import MoEEchoConfig
    from components.parallel.parallelize import apply_expert_parallel

    layer = build_layer(dtype, device, routing_bias("random", 2))
    layer.cfg = dataclasses.replace(layer.cfg, overlap_chunks=chunks)
    apply_expert_parallel(layer, mesh, MoEEchoConfig(dispatcher="hierarchical", capacity_factor=float(K), echo=True,
                                                     bias_update_rate=0.0, overlap_chunks=chunks))
    x = torch.randn(1, TOKENS, D, device=device, dtype=dtype, requires_grad=True)
    layer(x).sum().backward()  # warm-up (allocations, lazy inits)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
