"""GPU checks (skipped without CUDA): bf16 numerics, no host syncs, parity with torchtitan's MoE."""

import pytest
import torch
from torchtitan.models.moe import MoE, MoEArgs

from components.moe_echo.config import MoEEchoConfig
from components.moe_echo.layer import MoELayer
from cuda_graphs import warm_up_and_capture
from reference import expert_counts, experts_fp64

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _layer(E=16, K=4, D=256, H=192, shared=1, seed=0, score="softmax", norm=False):
    torch.manual_seed(seed)
    args = MoEArgs(num_experts=E, num_shared_experts=shared, top_k=K, score_func=score, route_norm=norm,
                   score_before_experts=False)
    layer = MoELayer(args, D, H, MoEEchoConfig(aux_loss_coeff=0.01)).to(DEV)
    layer.init_weights(0.02, torch.device(DEV))
    return layer, args


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.mark.parametrize("skew", [False, True])
def test_bf16_layer_matches_fp32_reference(skew):
    layer, _ = _layer()
    if skew:  # all tokens pick expert 3; experts 0..2 get nothing
        layer.expert_bias.zero_()
        layer.expert_bias[3] = 10.0
        layer.expert_bias[:3] = -10.0
    x = torch.randn(4, 512, 256, device=DEV)
    g = torch.randn_like(x)

    x32 = x.clone().requires_grad_()
    y32 = layer(x32)  # fp32: looped reference path
    (y32 * g).sum().backward()
    ref = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)

    x16 = x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):  # grouped-GEMM path
        y16 = layer(x16)
    (y16.float() * g).sum().backward()
    assert _rel(y16, y32) < 2e-2
    assert _rel(x16.grad, x32.grad) < 3e-2
    for n, p in layer.named_parameters():
        if ref[n].abs().max() == 0:
            assert p.grad.abs().max() == 0, n
        else:
            assert _rel(p.grad, ref[n]) < 3e-2, n


def test_local_path_fwd_bwd_has_no_host_sync():
    layer, _ = _layer(E=64, K=6, D=512, H=384, shared=2)
    layer.to(torch.bfloat16)
    x = torch.randn(8, 256, 512, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    layer(x).sum().backward()  # warm-up (lazy init, autotuning) outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            y = layer(x)
            y.float().pow(2).mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(x.grad).all()


def test_sync_check_is_real():
    """The check above would catch a host read: the fp32 looped path reads counts on the host."""
    layer, _ = _layer()
    x = torch.randn(2, 64, 256, device=DEV)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            layer(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_matches_torchtitan_moe_with_same_weights():
    layer, args = _layer(E=16, K=4, shared=2, score="sigmoid", norm=True)
    theirs = MoE(args, 256, 192).to(DEV)
    missing, unexpected = theirs.load_state_dict(layer.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"tokens_per_expert"}
    x = torch.randn(2, 128, 256, device=DEV)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ours_y, their_y = layer(x), theirs(x)
    assert _rel(ours_y, their_y) < 2e-2


def test_shared_experts_side_stream_equals_one_stream_eager_and_graphed():
    """shared_experts_stream = "on" runs the same kernels on two streams: the output bitwise equal to
    "off", every gradient within 1% (norm) of "off"'s or its own run-to-run spread (a kernel on another
    stream may take another cuBLAS algorithm; a race would be off by ~100%), eager and as a captured
    fwd+bwd graph; the side stream really ran kernels."""
    torch.manual_seed(0)
    args = MoEArgs(num_experts=16, num_shared_experts=2, top_k=4, score_func="softmax", route_norm=False,
                   score_before_experts=False)
    layer = MoELayer(args, 512, 256, MoEEchoConfig(shared_experts_stream="off")).to(DEV)
    layer.init_weights(0.02, torch.device(DEV))
    x = torch.randn(4, 1024, 512, device=DEV, requires_grad=True)
    gy = torch.randn_like(x)

    def step():
        x.grad = None
        layer.zero_grad(set_to_none=False)
        with torch.autocast(DEV, dtype=torch.bfloat16):
            y = layer(x)
        y.backward(gy)
        return y.detach()

    def grads():
        return [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]

    ref_y, ref_g = step().clone(), grads()
    step()
    spread = [_rel(a, b) for a, b in zip(grads(), ref_g)]  # "off" against itself

    def same_grads(got):
        return all(_rel(a, b) <= max(2 * d, 1e-2) for a, b, d in zip(got, ref_g, spread))

    layer.cfg.shared_experts_stream = "on"
    assert layer._shared_stream(x) is not None and layer._shared_stream(x) != torch.cuda.current_stream()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        y = step()
        torch.cuda.synchronize()
    streams = {e.device_resource_id for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    assert len(streams) >= 2, streams  # kernels on the side stream too
    print("side stream vs one stream, grads (x, params) rel diff:", [_rel(a, b) for a, b in zip(grads(), ref_g)],
          "one stream vs itself:", spread)
    assert torch.equal(y, ref_y) and same_grads(grads())

    graph, y_g = warm_up_and_capture(step)
    static_g = [x.grad] + [p.grad for p in layer.parameters()]  # the graph's gradient buffers
    for _ in range(3):
        x.data.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        got_y, got_g = y_g.clone(), [g.clone() for g in static_g]
        layer.cfg.shared_experts_stream = "off"
        ref_y, ref_g = step().clone(), grads()
        assert torch.equal(got_y, ref_y) and same_grads(got_g)
        layer.cfg.shared_experts_stream = "on"


@pytest.mark.parametrize("kind", ["random", "all_to_one", "empty_experts", "none", "random-owned"])
def test_grouped_experts_match_fp64_and_never_read_padding_rows(kind):
    """The bf16 grouped-GEMM experts on a fixed-capacity buffer (one gate/up GEMM against [w1; w3]): used rows
    (and weight gradients) match an fp64 per-expert loop; the padding rows past the used ones hold NaN and must
    not leak into either. ``owned``: fp32 weights cast (and concatenated) for compute in one pass, as for
    experts outside FSDP."""
    from components.moe_echo.experts import GroupedExperts

    torch.manual_seed(0)
    E, D, H, capacity = 8, 512, 384, 4096
    kind, owned = kind.removesuffix("-owned"), kind.endswith("-owned")
    used = 0 if kind == "none" else 3000
    experts = GroupedExperts(D, H, E).to(DEV)
    experts.init_weights(0.02)
    if owned:
        experts.compute_dtype = torch.bfloat16
    counts = expert_counts(kind, E, used)
    x = torch.randn(capacity, D, device=DEV, dtype=torch.bfloat16)
    g = torch.randn(capacity, D, device=DEV, dtype=torch.bfloat16)
    x[used:], g[used:] = float("nan"), float("nan")
    x.requires_grad_()
    y = experts(x, counts.to(DEV))
    y.backward(g)
    y64, dx64, *dw64 = experts_fp64(x, experts.w1, experts.w2, experts.w3, counts, g)
    assert _rel(y[:used], y64) < 1e-2
    assert _rel(x.grad[:used], dx64) < 2e-2
    for w, want in zip((experts.w1, experts.w2, experts.w3), dw64):
        assert torch.isfinite(w.grad).all()
        assert _rel(w.grad, want) < 2e-2
