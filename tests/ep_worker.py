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
    marks each one that passed on this rank, ``ok<rank>`` the whole run, ``err<rank>`` a failure.

    One intra-op thread per rank: the ranks already fill the cores, and more threads than cores (2 per
    rank by default on a 2-core machine) spin in OpenMP's barriers and double the CPU time of each check."""
    torch.set_num_threads(1)
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


def fp8_echo_copies(rank, world, E=8, K=2, tokens_per_rank=24):
    """ECHO with FP8 experts at EP=world (the collectives' transport; the FP8 GEMMs emulated): the clones read from
    the FP8 weight copies (their bytes sent into the copies' slot rows) give the output and every gradient of
    casting the extended weights per call, bit for bit: all tokens to one expert, the first rank's experts hot; the
    layer whole and in 2 pipelined chunks (the clones sent once and their gradients pulled once for both chunks:
    the copies' path taken in each case, not the per-call cast)."""
    import copy
    import itertools

    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.models.moe import MoEArgs

    from components.moe_echo import echo, echo_transport
    from components.moe_echo.config import MoEEchoConfig
    from components.moe_echo.layer import MoELayer
    from components.parallel.parallelize import apply_expert_parallel

    calls = {"clone_fp8": 0, "slot_gradients": 0}  # the copies' path: the clones' FP8 bytes, the slots' gradients
    clone_fp8, slot_grads = echo.clone_fp8_weights_, echo_transport._SlotGradients.apply

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call
    echo.clone_fp8_weights_ = counted("clone_fp8", clone_fp8)
    echo_transport._SlotGradients.apply = counted("slot_gradients", slot_grads)

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    for routing, chunks in itertools.product(("all_to_one", "hot_first_rank"), (1, 2)):
        cfg = MoEEchoConfig(dispatcher="padded", capacity_factor=float(world), echo=True, echo_slots_per_rank=2,
                            expert_precision="fp8", overlap_chunks=chunks)
        torch.manual_seed(0)
        args = MoEArgs(num_experts=E, num_shared_experts=1, top_k=K, score_func="softmax",
                       score_before_experts=False)
        base = MoELayer(args, 32, 16, cfg)
        base.init_weights(0.3)
        bias = torch.zeros(E)
        if routing == "all_to_one":
            bias[:] = -50.0
            bias[E - 1] = 50.0
        else:
            bias[: E // world] = 50.0  # the first rank's experts take every token's choices
        base.expert_bias.copy_(bias)
        g = torch.Generator().manual_seed(1 + rank)
        x_all = torch.randn(1, tokens_per_rank, 32, generator=g)
        gy = torch.randn(1, tokens_per_rank, 32, generator=g)
        got = {}
        for copies in (False, True):
            layer = copy.deepcopy(base)
            apply_expert_parallel(layer, mesh, cfg)
            if copies:
                layer.enable_fp8_copies()
                assert layer.experts.fp8_copies.slots == 2
            x = x_all.clone().requires_grad_()
            calls.update(clone_fp8=0, slot_gradients=0)
            y = layer(x)
            (y.float() * gy).sum().backward()
            # with copies: one fetch of the clones and one slot-gradient node per weight, however many chunks
            assert calls == ({"clone_fp8": 1, "slot_gradients": 3} if copies else {"clone_fp8": 0, "slot_gradients": 0}), \
                (routing, chunks, copies, calls)
            assert float(layer.echo_stats[2]) >= 1, (routing, chunks, layer.echo_stats)  # some slot holds a clone
            assert layer.chunks == chunks, (layer.chunks, chunks)
            grads = {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
                     for n, p in layer.named_parameters() if p.grad is not None}
            got[copies] = (y.detach(), x.grad, grads)
        (y0, dx0, g0), (y1, dx1, g1) = got[False], got[True]
        assert torch.equal(y0, y1) and torch.equal(dx0, dx1), (routing, chunks)
        assert g0.keys() == g1.keys() and {"experts.w1", "experts.w2", "experts.w3"} <= g0.keys(), g0.keys()
        for n in g0:
            assert torch.equal(g0[n], g1[n]), (routing, chunks, n)


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
    # the embeddings, and the final norm with the head, are FSDP units of their own (the head's reduce-scatter
    # overlaps the blocks' backward)
    units = {n: m for n, m in model.named_modules() if isinstance(m, FSDPModule)}
    assert {"tok_embeddings", "norm", "output", ""} <= set(units), sorted(units)
    assert units["norm"]._get_fsdp_state() is units["output"]._get_fsdp_state()
    model(torch.randint(0, model.model_args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)))
    # after forward: the ends stay gathered for backward (no second all-gather), the blocks are sharded again
    assert not isinstance(model.tok_embeddings.weight, DTensor) and not isinstance(model.output.weight, DTensor)
    assert isinstance(next(iter(model.layers.values())).attention_norm.weight, DTensor)
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


def compute_copies_echo_train(rank, world, tmp=None):
    """``compute_copies_train`` with ECHO on (one clone slot a rank) and full activation checkpointing: clone
    weights come from the copies, clone gradients flow back into the home experts' compute gradients, and the
    recomputed forward in backward neither drops nor doubles them (no DCP round trip)."""
    compute_copies_train(rank, world, tmp, echo=True)


def compute_copies_train(rank, world, tmp=None, echo=False):
    """EP=2, experts outside FSDP computing in bf16: the optimizer writing their bf16 copies
    (AdamWWithCopies) trains as the per-step cast path with torch's fused AdamW — same losses and gradient
    norms, weights within AdamW's rounding — and a DCP round trip restores weights, moments and copies."""
    import tempfile

    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F

    from components.moe_echo.models import build_model, moe_layers
    from components.moe_echo.weight_copies import weight_copies
    from components.parallel.grad_norm import clip_grad_norm_
    from components.parallel.mesh import build_mesh, parallel_dims
    from components.parallel.parallelize import parallelize
    from components.train.config import load_config
    from components.train.master_adamw import AdamWWithCopies
    from components.train.train_state import ModelAndOptimizer

    cfg = load_config(["--job.config_file", os.path.join(ROOT, "train_configs", "debug_cpu.toml"),
                       "--parallelism.expert_parallel_degree", "2", "--training.seq_len", "32",
                       "--moe_echo.echo", str(echo).lower()]
                      + (["--activation_checkpoint.mode", "full"] if echo else []))
    dims = parallel_dims(cfg.parallelism, world, 8)
    mesh = build_mesh(dims, "cpu")

    def make(copies, seed=0):
        model = build_model(cfg.model.name, cfg.model.flavor, cfg.moe_echo, seq_len=32, seed=seed)
        model = parallelize(model, mesh, dims, cfg, torch.device("cpu"))
        for _, moe in moe_layers(model):
            moe.experts.compute_dtype = torch.bfloat16  # as on GPUs with bf16 mixed precision
            if copies:
                moe.enable_compute_copies()
        if copies:
            return model, AdamWWithCopies(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True,
                                          copies=weight_copies(model))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)

    runs = {c: make(c) for c in (False, True)}
    vocab = runs[False][0].model_args.vocab_size
    g = torch.Generator().manual_seed(rank)
    logged = {False: [], True: []}
    for _ in range(3):
        tokens = torch.randint(0, vocab, (2, 33), generator=g)
        for c, (model, opt) in runs.items():
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
            if c:  # the experts' gradients arrive as bf16 compute gradients only, never as .grad
                for _, moe in moe_layers(model):
                    for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3):
                        assert w.grad is None and moe.experts.copies[w].grad.dtype == torch.bfloat16, rank
            # clipped: grad_scale in the step
            norm = clip_grad_norm_(list(model.parameters()), 0.05, opt, copies=weight_copies(model))
            opt.step()
            opt.zero_grad(set_to_none=True)
            logged[c].append((float(loss), float(norm)))
    assert logged[True][0] == logged[False][0]  # same weights, same bf16 compute: the first step bit for bit
    for (l1, n1), (l2, n2) in zip(logged[False], logged[True]):
        assert abs(l1 - l2) <= 1e-4 * abs(l1) and abs(n1 - n2) <= 1e-3 * n1, (logged, rank)
    ref, ours = runs[False][0], runs[True][0]
    for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
        a, b = (t.detach().to_local() if hasattr(t, "to_local") else t.detach() for t in (a, b))
        # AdamW's normalised step turns one-ulp gradient differences near zero into visible ones: a bound of
        # a tenth of one lr step everywhere, and 1e-5 on all but one in a thousand elements
        diff = (a - b).abs()
        assert float(diff.max()) < 1e-4 and float((diff > 1e-5 + 1e-4 * a.abs()).float().mean()) < 1e-3, name
    experts = [moe.experts for _, moe in moe_layers(ours)]
    for w in (experts[0].w1, experts[0].w3):
        assert torch.equal(experts[0].copies[w].compute, w.detach().to_local().bfloat16())
    if echo:  # some clone slot was used, so clone gradients did reach home experts
        assert sum(float(moe.echo_stats[2]) for _, moe in moe_layers(ours)) > 0, rank
        return
    # DCP round trip into a fresh model with copies (other weights): weights, moments and copies restored
    folder = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(folder)
    model, opt = runs[True]
    dcp.save({"app": ModelAndOptimizer(model, opt)}, checkpoint_id=folder[0])
    again, opt2 = make(True, seed=7)
    dcp.load({"app": ModelAndOptimizer(again, opt2)}, checkpoint_id=folder[0])
    for (_, moe), (_, moe2) in zip(moe_layers(model), moe_layers(again)):
        for w, w2 in zip((moe.experts.w1, moe.experts.w2), (moe2.experts.w1, moe2.experts.w2)):
            assert torch.equal(w.detach().to_local(), w2.detach().to_local())
            assert torch.equal(moe2.experts.copies[w2].compute, w2.detach().to_local().bfloat16())
            assert torch.equal(opt.state[w]["exp_avg"].to_local(), opt2.state[w2]["exp_avg"].to_local())


def fp8_head_fsdp(rank, world):
    """The FP8 output head as an FSDP2 unit, with all three GEMMs in FP8 (the loss hands it the gradient in FP8)
    and with the default (its input gradient bf16: the loss hands it the bf16 gradient and an FP8 transposed one);
    the head casts no gradient itself either way;
    its input gradient is bit for bit the unsharded head's on the rank's tokens, and its sharded weight gradient
    is the mean of the ranks' unsharded ones."""
    import copy

    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from components.train import fp8_head as fh
    from components.train.loss import lm_loss

    for gemms in (fh.GEMMS, fh.Fp8Head.fp8_gemms):
        torch.manual_seed(0)
        linear = nn.Linear(64, 96, bias=False)
        ref = fh.Fp8Head.from_linear(copy.deepcopy(linear))
        head = fully_shard(fh.Fp8Head.from_linear(linear))
        ref.fp8_gemms = head.fp8_gemms = gemms
        g = torch.Generator().manual_seed(1 + rank)  # each rank its own tokens
        h = torch.randn(2, 8, 64, generator=g)
        labels = torch.randint(0, 96, (2, 8), generator=g)
        cast = fh.cast_both
        casts = []
        fh.cast_both = lambda x, dtype: casts.append(dtype) or cast(x, dtype)
        try:
            h_fsdp = h.clone().requires_grad_()
            lm_loss(head(h_fsdp), labels).backward()
        finally:
            fh.cast_both = cast
        assert casts == [fh.FP8, fh.FP8], (gemms, casts)  # h and W in the forward; the gradient came from the loss
        h_ref = h.clone().requires_grad_()
        lm_loss(ref(h_ref), labels).backward()
        assert torch.equal(h_fsdp.grad, h_ref.grad), gemms
        want = ref.weight.grad.clone()
        dist.all_reduce(want)
        torch.testing.assert_close(head.weight.grad.full_tensor(), want / world, rtol=1e-6, atol=0)
