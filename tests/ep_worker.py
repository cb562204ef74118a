"""Worker bodies for multi-process expert-parallel tests (gloo, CPU), launched with mp.spawn."""

import os
import sys
import traceback

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


def run(rank, world, port, fn_names, kwargs, result_dir):
    """Run each of ``fn_names`` (one name or several, in order) in one process group; ``done_<fn><rank>``
    marks each one that passed on this rank, ``ok<rank>`` the whole run, ``err<rank>`` a failure."""
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        for fn_name in [fn_names] if isinstance(fn_names, str) else fn_names:
            globals()[fn_name](rank, world, **kwargs)
            open(os.path.join(result_dir, f"done_{fn_name}{rank}"), "w").close()
        dist.barrier()
        open(os.path.join(result_dir, f"ok{rank}"), "w").close()
    except BaseException:
        with open(os.path.join(result_dir, f"err{rank}"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _layer(E, K, shared, seed):
    from torchtitan.models.moe import MoEArgs

    from components.moe_echo.config import MoEEchoConfig
    from components.moe_echo.layer import MoELayer

    torch.manual_seed(seed)
    args = MoEArgs(num_experts=E, num_shared_experts=shared, top_k=K, score_func="softmax",
                   score_before_experts=False)
    layer = MoELayer(args, 12, 10, MoEEchoConfig()).double()
    layer.init_weights(0.3)
    with torch.no_grad():
        layer.router.gate.weight.normal_(0, 1.0)
    return layer


def layer_equivalence_all(rank, world):
    """Every backend × routing case in one process group (process start-up dominates test time)."""
    for backend in ("alltoall", "padded"):
        for routing in ("random", "all_to_one", "empty_experts"):
            try:
                layer_equivalence(rank, world, backend, routing)
            except AssertionError as err:
                raise AssertionError(f"backend={backend} routing={routing}: {err}") from None


def echo_equivalence_all(rank, world):
    """ECHO on: same outputs and gradients as EP=1, for both backends and adversarial routing,
    in fp64 (to 1e-12) and fp32 (to 1e-5)."""
    for dtype in (torch.float64, torch.float32):
      for backend in ("alltoall", "padded"):
        for routing in ("random", "all_to_one", "one_hot_per_rank", "empty_experts", "more_hot_than_slots"):
            try:
                layer_equivalence(rank, world, backend, routing, echo=True, dtype=dtype)
            except AssertionError as err:
                raise AssertionError(f"echo {dtype} backend={backend} routing={routing}: {err}") from None


def layer_equivalence(rank, world, backend, routing, E=8, K=2, tokens_per_rank=10, echo=False, dtype=torch.float64):
    """EP=world layer vs the same layer at EP=1 on all ranks' tokens: outputs and every gradient."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from components.moe_echo.config import MoEEchoConfig
    from components.parallel.parallelize import apply_expert_parallel

    ref = _layer(E, K, shared=1, seed=0).to(dtype)
    ref.expert_bias.data = ref.expert_bias.float()
    bias = torch.zeros(E)
    if routing == "all_to_one":
        bias[:] = -50.0
        bias[E - 1] = 50.0  # expert on the last rank takes every token's first choice
    elif routing == "empty_experts":
        bias[[0, 1, E // 2]] = -50.0  # three experts never chosen
    elif routing == "one_hot_per_rank":
        bias[:: E // world] = 50.0  # the first expert of every rank is hot
    elif routing == "more_hot_than_slots":
        bias[: E // 2] = 50.0  # half the experts (all on the first ranks) hot; 1 slot per rank
    ref.expert_bias.copy_(bias)
    ep_layer = copy.deepcopy(ref)

    g = torch.Generator().manual_seed(1)
    x_all = torch.randn(world, tokens_per_rank, 12, generator=g, dtype=torch.float64).to(dtype)
    gy_all = torch.randn(world, tokens_per_rank, 12, generator=g, dtype=torch.float64).to(dtype)

    x_ref = x_all.clone().requires_grad_()
    (ref(x_ref) * gy_all).sum().backward()
    y_ref = ref(x_all.clone()).detach()

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    slots = 1 if routing == "more_hot_than_slots" else 2
    cfg = MoEEchoConfig(dispatcher=backend, capacity_factor=float(world), echo=echo,  # C = T*K: never overflows
                        echo_slots_per_rank=slots)
    apply_expert_parallel(ep_layer, mesh, cfg)
    x = x_all[rank:rank + 1].clone().requires_grad_()
    y = ep_layer(x)
    (y * gy_all[rank:rank + 1]).sum().backward()
    assert int(ep_layer.overflow_count) == 0
    if echo:
        plan = ep_layer.echo.last_plan
        before, after, clones, moved = ep_layer.echo_stats.tolist()
        assert after <= before + 1e-9
        if routing in ("all_to_one", "more_hot_than_slots") or before > 1.2:
            assert clones >= 1 and moved > 0, (before, after, clones, moved)
        from components.moe_echo.planner import fold_back, rewrite

        ids = ep_layer.router(x.detach().view(-1, 12), ep_layer.expert_bias).topk_ids_TK
        assert torch.equal(fold_back(rewrite(ids, plan, rank, E), plan, E), ids)

    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.detach(), y_ref[rank:rank + 1], **tol)
    torch.testing.assert_close(x.grad, x_ref.grad[rank:rank + 1], **tol)
    e = E // world
    for name in ("w1", "w2", "w3"):
        got = getattr(ep_layer.experts, name).grad.to_local()
        want = getattr(ref.experts, name).grad[rank * e:(rank + 1) * e]
        torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{name}: {m}")
    for name, p in ep_layer.named_parameters():  # replicated params: rank grads sum to the reference
        if name.startswith("experts."):
            continue
        grad = p.grad.clone()
        dist.all_reduce(grad)
        torch.testing.assert_close(grad, dict(ref.named_parameters())[name].grad, **tol,
                                   msg=lambda m: f"{name}: {m}")
    counts = ep_layer.tokens_per_expert.clone()
    dist.all_reduce(counts)
    assert torch.equal(counts, ref.tokens_per_expert / 2)  # ref ran twice


def padded_overflow(rank, world, E=8, K=2, tokens_per_rank=16):
    """A small capacity with every token sent to one rank's experts: drops are counted, never silent."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from components.moe_echo.config import MoEEchoConfig
    from components.parallel.parallelize import apply_expert_parallel

    layer = _layer(E, K, shared=0, seed=0)
    layer.expert_bias[:] = -50.0
    layer.expert_bias[:2] = 50.0  # both choices on rank 0's experts
    ref = copy.deepcopy(layer)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    apply_expert_parallel(layer, mesh, MoEEchoConfig(dispatcher="padded", capacity_factor=1.0))
    x = torch.randn(1, tokens_per_rank, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    y = layer(x)
    from components.moe_echo.ep_dispatch import padded_capacity

    T, C = tokens_per_rank, padded_capacity(tokens_per_rank, K, world, 1.0)
    assert C < T * K
    dropped = int(layer.overflow_count)
    assert dropped == T * K - C, (dropped, T * K, C)
    # the rows that were sent are exact; the dropped ones are the (reported) difference
    y_ref = ref(x)
    assert not torch.allclose(y, y_ref)
    total = torch.tensor(dropped)
    dist.all_reduce(total)
    assert int(total) == world * (T * K - C)
    # every slot went to rank 0's block: the capacity_factor that fits it is world (C = T*K)
    needed = float(layer.capacity_need)
    assert needed == world and padded_capacity(T, K, world, needed) >= T * K


def experts_fsdp_layout(rank, world):
    """EP=2 through ``parallelize``: at world 2 each expert has one owner, so the experts stay out of
    FSDP (DTensors on the ep mesh, gradients divided by the world size in the layer's hook); at world 4
    (expert-FSDP group of 2) FSDP shards them."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from components.moe_echo.models import build_model, moe_layers
    from components.parallel.mesh import build_mesh, parallel_dims
    from components.parallel.parallelize import parallelize
    from components.train.config import load_config

    cfg = load_config(["--job.config_file", os.path.join(ROOT, "train_configs", "debug_cpu.toml"),
                       "--parallelism.expert_parallel_degree", "2", "--training.seq_len", "32"])
    model = build_model(cfg.model.name, cfg.model.flavor, cfg.moe_echo, seq_len=32, seed=0)
    dims = parallel_dims(cfg.parallelism, world, model.model_args.moe_args.num_experts)
    model = parallelize(model, build_mesh(dims, "cpu"), dims, cfg, torch.device("cpu"))
    layers = moe_layers(model)
    assert layers
    for _, moe in layers:
        w1 = moe.experts.w1
        assert isinstance(w1, DTensor)
        if world == 2:
            assert not isinstance(moe.experts, FSDPModule), type(moe.experts)
            assert w1.device_mesh.mesh_dim_names == ("ep",) and moe.experts._grad_divide == 2.0
            w1_local = w1.to_local()
            g = torch.ones_like(w1_local)
            w1.grad = None
            (moe.experts.local_weights()[0] * g).sum().backward()
            torch.testing.assert_close(w1.grad.to_local(), g / 2)  # the hook's division, before accumulation
            w1.grad = None
        else:
            assert isinstance(moe.experts, FSDPModule), type(moe.experts)
