"""MoELayer (local dispatcher) against the dense per-token fp64 reference: outputs and all grads."""

import pytest
import torch
from torchtitan.models.moe import MoEArgs

from components.moe_echo.config import MoEEchoConfig
from components.moe_echo.layer import MoELayer
from reference import reference_moe

D, H = 12, 10


def make_layer(E=8, K=2, shared=1, score="softmax", norm=False, scale=1.0, groups=None, limited=None,
               aux=0.0, seed=0, gathered=False):
    torch.manual_seed(seed)
    args = MoEArgs(num_experts=E, num_shared_experts=shared, top_k=K, score_func=score, route_norm=norm,
                   route_scale=scale, num_expert_groups=groups, num_limited_groups=limited,
                   score_before_experts=False)
    layer = MoELayer(args, D, H, MoEEchoConfig(aux_loss_coeff=aux, gathered_experts=gathered)).double()
    layer.init_weights(0.3)
    with torch.no_grad():  # larger weights than training init, so every term matters
        layer.router.gate.weight.normal_(0, 1.0)
    return layer


def grads(layer, x):
    return [x.grad] + [p.grad for _, p in sorted(layer.named_parameters())]


def check_against_reference(layer, x_BSD, bias_E=None):
    if bias_E is not None:
        layer.expert_bias.copy_(bias_E)
    x1 = x_BSD.clone().requires_grad_()
    y = layer(x1)
    g_out = torch.randn_like(y)
    (y * g_out).sum().backward()
    got = grads(layer, x1)
    layer.zero_grad()

    x2 = x_BSD.clone().requires_grad_()
    y_ref, ids = reference_moe(x2.view(-1, D), layer, bias_E if bias_E is not None else layer.expert_bias)
    (y_ref.view_as(y) * g_out).sum().backward()
    want = grads(layer, x2)
    layer.zero_grad()

    torch.testing.assert_close(y, y_ref.view_as(y), rtol=1e-12, atol=1e-12)
    for (name, _), a, b in zip([("x", None)] + sorted(layer.named_parameters()), got, want):
        if b is None:
            assert a is None or a.abs().max() == 0, name
            continue
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12, msg=lambda m: f"grad of {name}: {m}")
    return ids


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(score="sigmoid", norm=True, scale=2.5),
        dict(E=16, K=4, groups=4, limited=2, score="sigmoid", norm=True),
        dict(E=8, K=3, shared=0),
        dict(E=6, K=1, shared=2, score="softmax"),
    ],
    ids=["softmax", "sigmoid_norm_scale", "group_limited", "no_shared", "top1_two_shared"],
)
@pytest.mark.parametrize("gathered", [False, True], ids=["dispatched", "gathered"])
def test_random_routing(kw, gathered):
    layer = make_layer(**kw, gathered=gathered)
    x = torch.randn(3, 7, D, dtype=torch.float64)
    check_against_reference(layer, x)


@pytest.mark.parametrize("gathered", [False, True], ids=["dispatched", "gathered"])
def test_all_tokens_to_one_expert(gathered):
    layer = make_layer(E=8, K=1, gathered=gathered)
    x = torch.randn(2, 9, D, dtype=torch.float64)
    bias = torch.full((8,), -50.0, dtype=torch.float64)
    bias[5] = 50.0
    ids = check_against_reference(layer, x, bias.float())
    assert all(t == [5] for t in ids)
    g = layer.experts.w1.grad
    assert g is None or g.abs().sum() == 0  # grads were zeroed after the check


@pytest.mark.parametrize("gathered", [False, True], ids=["dispatched", "gathered"])
def test_all_tokens_to_one_expert_topk2_and_empty_experts(gathered):
    layer = make_layer(E=8, K=2, gathered=gathered)
    x = torch.randn(2, 9, D, dtype=torch.float64)
    bias = torch.zeros(8, dtype=torch.float64)
    bias[[0, 1, 2, 7]] = -50.0  # four experts receive nothing
    bias[3] = 50.0  # every token picks expert 3
    ids = check_against_reference(layer, x, bias.float())
    assert all(3 in t and not set(t) & {0, 1, 2, 7} for t in ids)
    # empty experts get exactly zero gradient
    y = layer(x.clone().requires_grad_())
    y.sum().backward()
    for e in (0, 1, 2, 7):
        assert layer.experts.w1.grad[e].abs().max() == 0
        assert layer.experts.w2.grad[e].abs().max() == 0
    assert layer.experts.w1.grad[3].abs().max() > 0


def test_counts_accumulate_and_match_routing():
    layer = make_layer(E=8, K=2)
    x = torch.randn(2, 5, D, dtype=torch.float64)
    _, ids = reference_moe(x.view(-1, D), layer, layer.expert_bias)
    layer(x)
    layer(x)
    want = torch.zeros(8)
    for t in ids:
        for e in t:
            want[e] += 2
    assert torch.equal(layer.tokens_per_expert, want)


def test_aux_loss_adds_its_gradient_to_the_gate_only_through_backward():
    layer = make_layer(aux=0.5)
    x = torch.randn(2, 6, D, dtype=torch.float64)
    y = layer(x)
    torch.autograd.backward(y, torch.zeros_like(y))  # zero upstream gradient: only the aux loss remains
    g_aux = layer.router.gate.weight.grad.clone()
    assert g_aux.abs().max() > 0
    assert layer.experts.w1.grad.abs().max() == 0

    # same gradient as differentiating the aux loss itself
    from components.moe_echo.router import sequence_aux_loss
    layer.zero_grad()
    r = layer.router(x.view(-1, D), layer.expert_bias)
    aux = sequence_aux_loss(r.scores_TE.view(2, 6, -1), r.topk_ids_TK.view(2, 6, -1), 0.5)
    aux.backward()
    torch.testing.assert_close(layer.router.gate.weight.grad, g_aux, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(layer.last_aux_loss, aux.detach())


def test_score_before_experts_is_rejected():
    args = MoEArgs(num_experts=4, top_k=1, score_before_experts=True)
    with pytest.raises(ValueError, match="score_before_experts"):
        MoELayer(args, D, H)


def test_overlap_chunks_is_refused_where_it_cannot_run():
    from components.errors import UserError
    from components.moe_echo.pipelined import check_overlap

    args = MoEArgs(num_experts=4, top_k=1, score_before_experts=False)
    with pytest.raises(UserError, match=r"overlap_chunks = 0: must be >= 1"):
        MoELayer(args, D, H, MoEEchoConfig(overlap_chunks=0))

    class PerLayerBuffers:  # like nvlink: one receive buffer per layer
        communicates, reentrant = True, False

    class Fresh:
        communicates, reentrant = True, True

    with pytest.raises(UserError, match=r"overlap_chunks = 2 needs a dispatcher that can have chunks in flight.*PerLayer"):
        check_overlap(MoEEchoConfig(overlap_chunks=2), PerLayerBuffers())
    with pytest.raises(UserError, match="echo_recompute"):
        check_overlap(MoEEchoConfig(overlap_chunks=2, echo=True, echo_recompute=True), Fresh())
    check_overlap(MoEEchoConfig(overlap_chunks=2), Fresh())
    check_overlap(MoEEchoConfig(overlap_chunks=1), PerLayerBuffers())


def test_overlap_chunks_auto_splits_where_the_network_is():
    from components.moe_echo.pipelined import chunks_for

    class Dispatcher:
        communicates, reentrant, overlap_from_ep, overlap_needs_echo, ep_size = True, True, 0, False, 2

    class AcrossHosts(Dispatcher):
        overlap_from_ep = 2

    class NVLinkLike(Dispatcher):  # splits from EP=4 on, with ECHO
        overlap_from_ep, overlap_needs_echo = 4, True

        def __init__(self, ep_size):
            self.ep_size = ep_size

    class Local(Dispatcher):
        communicates = False

    auto = MoEEchoConfig()
    assert auto.overlap_chunks == "auto"
    for echo in (False, True):
        assert chunks_for(auto, AcrossHosts(), 4096, echo) == 2 and chunks_for(auto, Dispatcher(), 4096, echo) == 1
    assert [chunks_for(auto, NVLinkLike(ep), 4096, True) for ep in (2, 4, 8)] == [1, 2, 2]
    assert chunks_for(auto, NVLinkLike(4), 4096, False) == 1  # ECHO off (whatever the config's echo says)
    assert chunks_for(MoEEchoConfig(echo=True), NVLinkLike(4), 4096, False) == 1
    assert chunks_for(MoEEchoConfig(echo=True, echo_recompute=True), AcrossHosts(), 4096, True) == 1
    assert chunks_for(MoEEchoConfig(echo=True, gathered_experts=True), NVLinkLike(4), 4096, True) == 1
    assert chunks_for(MoEEchoConfig(overlap_chunks=1), NVLinkLike(4), 4096, True) == 1
    assert chunks_for(MoEEchoConfig(overlap_chunks=4), Dispatcher(), 4096, False) == 4
    assert chunks_for(MoEEchoConfig(overlap_chunks=4), Dispatcher(), 3, False) == 3
    assert chunks_for(MoEEchoConfig(overlap_chunks=4), Local(), 4096, True) == 1


def test_echo_auto_is_on_for_nvlink_from_ep4_only():
    from components.moe_echo.backends import CLASSES, resolve_echo

    auto = MoEEchoConfig()
    assert auto.echo == "auto"
    on = {(b, ep) for b in CLASSES for ep in (1, 2, 4, 8, 64) if resolve_echo(auto, b, ep)}
    assert on == {("nvlink", 4), ("nvlink", 8), ("nvlink", 64)}
    assert not resolve_echo(auto, "fastest", 8)  # autotune picks its backend with ECHO off
    for b in ("nvlink", "padded", "hierarchical"):  # a set value is kept
        assert resolve_echo(MoEEchoConfig(echo=True), b, 2) is True
        assert resolve_echo(MoEEchoConfig(echo=False), b, 8) is False
