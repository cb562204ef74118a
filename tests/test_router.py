"""Router: bias update rule, aux loss against a hand computation, group-limited routing."""

import torch

from components.moe_echo.router import (
    TopKRouter,
    expert_histogram,
    sequence_aux_loss,
    updated_expert_bias,
)


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
