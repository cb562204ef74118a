"""Router: bias update rule, aux loss against a hand computation, group-limited routing; the fused router kernels
against the torch path in fp64."""

import pytest
import torch
import torch.nn.functional as F

from components.moe_echo.router import (
    TopKRouter,
    expert_histogram,
    sequence_aux_loss,
    updated_expert_bias,
)
from test_kernels import needs_cpu_interpreter, run_in_interpreter


def test_bias_update_rule_by_hand():
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0])
    counts = torch.tensor([10, 2, 4, 0])  # mean 4
    new = updated_expert_bias(bias, counts, rate=0.1)
    # sign(mean - count) = [-1, +1, 0, +1] * 0.1 = [-.1, .1, 0, .1]; mean .025 -> recentred
    torch.testing.assert_close(new, torch.tensor([-0.125, 0.075, -0.025, 0.075]))
    assert abs(new.sum().item()) < 1e-7


def test_bias_update_balances_a_skewed_router():
    torch.manual_seed(0)
    router = TopKRouter(dim=8, num_experts=4, top_k=1, score_func="sigmoid")
    with torch.no_grad():
        router.gate.weight.normal_(0, 0.1)
        router.gate.weight[0] += 1.0  # expert 0 hot for x with positive coordinates
    x = torch.randn(512, 8).abs()
    bias = torch.zeros(4)
    first = router(x, bias).counts_E
    late = torch.zeros(4)
    for step in range(400):
        counts = router(x, bias).counts_E
        if step >= 300:
            late += counts / 100
        bias = updated_expert_bias(bias, counts, rate=0.01)
    assert first.max() == 512
    assert late.max() < 1.5 * 128  # the hot expert's load came down near the mean (128)


def test_aux_loss_by_hand():
    # B=1, S=2, E=3, K=1. scores rows are already normalised.
    scores = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]]])
    ids = torch.tensor([[[0], [1]]])
    # f = E/(K*S) * hits = 1.5 * [1, 1, 0]; P = mean over t = [0.3, 0.45, 0.25]
    want = 0.1 * (1.5 * 0.3 + 1.5 * 0.45)
    got = sequence_aux_loss(scores, ids, coeff=0.1)
    assert abs(got.item() - want) < 1e-7


def test_aux_loss_averages_over_sequences_and_normalises_scores():
    scores = torch.tensor([[[1.0, 1.0]], [[3.0, 1.0]]])  # sigmoid-like, unnormalised
    ids = torch.tensor([[[0]], [[1]]])
    # seq 0: f=[2,0], P=[.5,.5] -> 1.0 ; seq 1: f=[0,2], P=[.75,.25] -> 0.5 ; mean .75
    assert abs(sequence_aux_loss(scores, ids, 1.0).item() - 0.75) < 1e-7


def test_group_limited_routing_picks_only_from_best_groups():
    router = TopKRouter(dim=4, num_experts=8, top_k=2, score_func="sigmoid", num_expert_groups=4,
                        num_limited_groups=1)
    with torch.no_grad():
        router.gate.weight.zero_()
    bias = torch.zeros(8)
    # group 2 = experts 4,5 has the best top-2 sum; expert 0 alone is the single best expert
    bias[0] = 0.5
    bias[4], bias[5] = 0.3, 0.3
    out = router(torch.randn(5, 4), bias)
    assert sorted(set(out.topk_ids_TK.flatten().tolist())) == [4, 5]
    # without group limiting expert 0 would be chosen
    plain = TopKRouter(dim=4, num_experts=8, top_k=2, score_func="sigmoid")
    with torch.no_grad():
        plain.gate.weight.zero_()
    assert 0 in plain(torch.randn(5, 4), bias).topk_ids_TK.flatten().tolist()


def test_weights_ignore_bias_and_are_normalised():
    torch.manual_seed(1)
    r = TopKRouter(dim=6, num_experts=5, top_k=2, score_func="sigmoid", route_norm=True, route_scale=2.0)
    x = torch.randn(7, 6)
    bias = torch.tensor([5.0, 5.0, 0.0, 0.0, 0.0])
    out = r(x, bias)
    assert torch.equal(out.topk_ids_TK.sort(-1).values, torch.tensor([[0, 1]] * 7))
    s = torch.sigmoid(r.gate(x))[:, :2]
    torch.testing.assert_close(out.topk_w_TK.sort(-1).values, (2 * s / s.sum(-1, keepdim=True)).sort(-1).values)


def test_histogram_counts_every_assignment():
    ids = torch.tensor([[0, 3], [3, 3], [1, 0]])
    assert expert_histogram(ids, 5).tolist() == [2, 1, 0, 3, 0]


# --- the fused router kernels (kernels/router.py) against the torch path in fp64 ------------------------------

def routed_both_ways(router, x_TD, bias_E, aux_coeff=0.0, seed=0):
    """Run ``router`` on fp32 ``x_TD`` (the fused kernels where they apply) and on its fp64 copy (the torch
    path): for each, (ids_TK and w_TK sorted by id, counts_E, scores_TE, x grad, gate weight grad) under a
    random weighting of w_TK plus ``aux_coeff`` × the sequence auxiliary loss."""
    import copy
    g = torch.Generator().manual_seed(seed)
    T = x_TD.shape[0]
    c_TK = torch.randn(T, router.top_k, generator=g, dtype=torch.float64).to(x_TD.device)
    out = []
    for dtype in (torch.float32, torch.float64):
        r = copy.deepcopy(router).to(dtype)
        x = x_TD.detach().to(dtype).requires_grad_()
        o = r(x, None if bias_E is None else bias_E.to(dtype))
        order = o.topk_ids_TK.argsort(dim=1)
        ids, w = o.topk_ids_TK.gather(1, order), o.topk_w_TK.gather(1, order)
        loss = (w.double() * c_TK).sum()  # the same weight for an (token, expert) pair in both runs
        if aux_coeff:
            loss = loss + sequence_aux_loss(o.scores_TE.view(1, T, -1), o.topk_ids_TK.view(1, T, -1), aux_coeff)
        loss.backward()
        out.append((ids, w.double(), o.counts_E, o.scores_TE.double(), x.grad.double(), r.gate.weight.grad.double()))
    return out


def assert_routed_alike(fused, torch64, rtol=1e-5):
    ids, w, counts, scores, gx, gw = fused
    ids64, w64, counts64, scores64, gx64, gw64 = torch64
    assert torch.equal(ids, ids64) and torch.equal(counts, counts64)
    for got, want in [(w, w64), (scores, scores64), (gx, gx64), (gw, gw64)]:
        assert (got - want).norm() <= rtol * want.norm() + 1e-12, ((got - want).norm(), want.norm())


_ROUTER_SCRIPT = r"""
import sys, torch
sys.path.insert(0, "tests")
from components.moe_echo.router import TopKRouter
from kernels import router as rk
from test_router import assert_routed_alike, routed_both_ways
cases = [  # E, K, score_func, route_norm, route_scale, bias, aux
    (10, 3, "softmax", False, 1.0, False, 0.0),   # E not a power of two
    (64, 6, "softmax", False, 2.5, True, 0.01),   # v2lite's router shape, bias and aux loss
    (8, 2, "sigmoid", True, 1.0, True, 0.0),      # sigmoid + renormalised, with bias
    (128, 8, "softmax", True, 1.0, False, 0.0),   # the Qwen3-shaped router
]
for E, K, func, norm, scale, with_bias, aux in cases:
    torch.manual_seed(E)
    T = 37 if E > 16 else 133  # rows past the last full block
    r = TopKRouter(dim=24, num_experts=E, top_k=K, score_func=func, route_norm=norm, route_scale=scale)
    x = torch.randn(T, 24)
    bias = torch.randn(E) * 0.05 if with_bias else None
    assert rk.fusable(x @ r.gate.weight.T, K)
    fused, ref = routed_both_ways(r, x, bias, aux)
    assert_routed_alike(fused, ref)
# one hot expert: a bias that sends every token to expert 3 first (weights still from the scores)
r = TopKRouter(dim=16, num_experts=16, top_k=2, score_func="softmax", route_norm=True)
x = torch.randn(50, 16)
bias = torch.zeros(16); bias[3] = 10.0
fused, ref = routed_both_ways(r, x, bias)
assert_routed_alike(fused, ref)
assert fused[2][3] == 50 and fused[2].sum() == 100
# half the experts get no token at all
bias = torch.zeros(16); bias[:8] = -10.0
fused, ref = routed_both_ways(r, x, bias)
assert_routed_alike(fused, ref)
assert (fused[2][:8] == 0).all()
# ties (every score equal): K distinct ids, the lowest first; equal weights
logits = torch.zeros(5, 12)
s, ids, w = rk.route_topk(logits, None, 4, "softmax", True, 1.0)
assert torch.equal(ids, torch.arange(4).expand(5, 4)) and torch.allclose(w, torch.full((5, 4), 1 / 4))
assert torch.allclose(s, torch.full((5, 12), 1 / 12))
# a NaN row (a diverged step): K distinct ids in [0, E) on it, the other rows as before
logits = torch.randn(6, 12); logits[2, 5] = float("nan")
s, ids, w = rk.route_topk(logits, None, 4, "softmax", True, 1.0)
assert ((ids >= 0) & (ids < 12)).all() and all(len(set(row.tolist())) == 4 for row in ids)
assert torch.isnan(w[2]).all() and torch.isfinite(w[[0, 1, 3, 4, 5]]).all()
print("ROUTER-OK")
"""


@needs_cpu_interpreter
def test_fused_router_equals_torch_router_in_interpreter():
    """Random routers (softmax / sigmoid, renormalised or not, bias, aux loss, E not a power of two), one hot
    expert, empty experts, ties and a NaN row: ids and counts equal, weights, scores and gradients to 1e-5."""
    run_in_interpreter(_ROUTER_SCRIPT, "ROUTER-OK")


@pytest.mark.gpu
@pytest.mark.parametrize("E, K, func, norm, hot", [(64, 6, "softmax", False, False), (128, 8, "softmax", True, True),
                                                    (8, 2, "sigmoid", True, False)])
def test_fused_router_on_gpu(E, K, func, norm, hot):
    torch.manual_seed(0)
    r = TopKRouter(dim=2048, num_experts=E, top_k=K, score_func=func, route_norm=norm).cuda()
    x = torch.randn(16384, 2048, device="cuda")
    bias = torch.randn(E, device="cuda") * 0.05
    if hot:
        bias[0] = 10.0  # every token's first choice
    fused, ref = routed_both_ways(r, x, bias, aux_coeff=0.01)
    assert r.gate.weight.is_cuda and fused[0].is_cuda
    ids, ids64 = fused[0], ref[0]
    # fp32 vs fp64 scores may order a near-tie differently: all but a handful of tokens route alike
    same_T = (ids == ids64).all(dim=1)
    assert same_T.float().mean() > 0.999
    keep = same_T.unsqueeze(1)
    w, w64 = fused[1] * keep, ref[1] * keep
    assert (w - w64).norm() <= 1e-5 * w64.norm()
    assert (fused[3] - ref[3]).norm() <= 1e-5 * ref[3].norm()
    # a token's input gradient depends on its own routing only: checked on every token that routed alike (the
    # gate's weight gradient sums over all tokens, so it is compared where every token did)
    assert ((fused[4] - ref[4]) * keep).norm() <= 1e-4 * (ref[4] * keep).norm()
    if same_T.all():
        assert (fused[5] - ref[5]).norm() <= 1e-4 * ref[5].norm()


def test_bf16_gate_equals_the_fp32_gemm_and_its_gradients_are_bf16_gemms():
    """``_BF16Gate`` (the CUDA gate of bf16 activations and weights; on CPU its fp32 stand-in for the bf16 GEMM
    with an fp32 output): logits equal the fp32 GEMM of the upcast operands; the gradients, bf16, are within
    bf16 rounding of the fp64 ones (the logit gradient is rounded to bf16 once)."""
    from components.moe_echo.router import _BF16Gate

    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 64, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(16, 64, generator=g) * 0.1).bfloat16().requires_grad_()
    dlogits = torch.randn(300, 16, generator=g)
    logits = _BF16Gate.apply(x, w)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, F.linear(x.detach().float(), w.detach().float()), rtol=1e-6, atol=1e-6)
    logits.backward(dlogits)
    assert x.grad.dtype == w.grad.dtype == torch.bfloat16
    want_x = dlogits.double() @ w.detach().double()
    want_w = dlogits.double().t() @ x.detach().double()
    for got, want in [(x.grad, want_x), (w.grad, want_w)]:
        assert (got.double() - want).norm() <= 2 ** -7 * want.norm()


@pytest.mark.gpu
def test_bf16_gate_routes_as_the_fp32_gate_on_gpu():
    """bf16 parameters on CUDA (the one bf16 GEMM writing fp32): the same scores as the fp32 GEMM of the same bf16
    values to fp32 rounding, the same experts for all but a handful of near-ties, gradients within bf16 rounding."""
    import copy

    from components.moe_echo.router import _bf16_gate_applies

    torch.manual_seed(0)
    r = TopKRouter(dim=2048, num_experts=64, top_k=6).cuda().bfloat16()
    r32 = copy.deepcopy(r).float()
    x = torch.randn(16384, 2048, device="cuda").bfloat16()
    bias = torch.randn(64, device="cuda") * 0.05
    assert _bf16_gate_applies(x, r.gate.weight) and not _bf16_gate_applies(x.float(), r32.gate.weight)
    c_TK = torch.randn(16384, 6, device="cuda")
    outs = []
    for router, xi in [(r, x.clone().requires_grad_()), (r32, x.float().requires_grad_())]:
        o = router(xi, bias)
        order = o.topk_ids_TK.argsort(dim=1)
        (o.topk_w_TK.gather(1, order) * c_TK).sum().backward()
        outs.append((o.scores_TE, o.topk_ids_TK.gather(1, order), xi.grad.float(), router.gate.weight.grad.float()))
    (s, ids, gx, gw), (s32, ids32, gx32, gw32) = outs
    assert (s - s32).norm() <= 1e-5 * s32.norm()
    same_T = (ids == ids32).all(dim=1)
    assert same_T.float().mean() > 0.999
    keep = same_T.unsqueeze(1)  # a token's input gradient through the router depends on its own routing only
    assert ((gx - gx32) * keep).norm() <= 1e-2 * (gx32 * keep).norm()
    if same_T.all():
        assert (gw - gw32).norm() <= 1e-2 * gw32.norm()
