"""Independent fp64 references: routing decided token by token in Python, experts applied densely."""

import torch
import torch.nn.functional as F


def reference_routing(scores_TE, bias_E, top_k, n_groups=None, topk_groups=None):
    """Per-token Python selection (sorting, no torch.topk): returns ids as nested lists."""
    T, E = scores_TE.shape
    choice = (scores_TE.detach() + (0 if bias_E is None else bias_E)).tolist()
    ids = []
    for t in range(T):
        allowed = list(range(E))
        if n_groups is not None:
            per = E // n_groups
            gscore = [sum(sorted(choice[t][g * per:(g + 1) * per], reverse=True)[:2]) for g in range(n_groups)]
            keep = sorted(range(n_groups), key=lambda g: -gscore[g])[:topk_groups]
            allowed = [e for e in range(E) if e // per in keep]
        ids.append(sorted(allowed, key=lambda e: -choice[t][e])[:top_k])
    return ids


def reference_moe(x_TD, layer, bias_E=None):
    """y_TD of ``layer`` computed densely per token from its parameters (autograd through them)."""
    r = layer.router
    logits = x_TD @ r.gate.weight.t()
    if r.gate.bias is not None:
        logits = logits + r.gate.bias
    scores = torch.softmax(logits, -1) if r.score_func == "softmax" else torch.sigmoid(logits)
    ids = reference_routing(scores, bias_E, r.top_k, r.num_expert_groups, r.num_limited_groups)
    w1, w2, w3 = layer.experts.w1, layer.experts.w2, layer.experts.w3
    rows = []
    for t, ids_t in enumerate(ids):
        w = torch.stack([scores[t, e] for e in ids_t])
        if r.route_norm:
            w = w / (w.sum() + 1e-20)
        w = w * r.route_scale
        y = torch.zeros_like(x_TD[t])
        for k, e in enumerate(ids_t):
            h = F.silu(w1[e] @ x_TD[t]) * (w3[e] @ x_TD[t])
            y = y + w[k] * (w2[e] @ h)
        rows.append(y)
    y_TD = torch.stack(rows)
    if layer.shared_experts is not None:
        s = layer.shared_experts
        y_TD = y_TD + (F.silu(x_TD @ s.w1.weight.t()) * (x_TD @ s.w3.weight.t())) @ s.w2.weight.t()
    return y_TD, ids
