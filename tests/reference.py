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


def experts_fp64(x_ND, w1_EHD, w2_EDH, w3_EHD, counts_E, g_ND):
    """The SwiGLU experts as an fp64 per-expert loop over the first counts_E.sum() rows of x_ND, and the
    backward of g_ND on those rows: (y, dx, dw1, dw2, dw3)."""
    counts = counts_E.cpu()
    x = x_ND.detach()[: int(counts.sum())].double().requires_grad_()
    ws = [w.detach().double().requires_grad_() for w in (w1_EHD, w2_EDH, w3_EHD)]
    ys, start = [], 0
    for e, n in enumerate(counts.tolist()):
        xe = x[start:start + n]
        ys.append((F.silu(xe @ ws[0][e].T) * (xe @ ws[2][e].T)) @ ws[1][e].T)
        start += n
    y = torch.cat(ys)
    y.backward(g_ND[: y.shape[0]].double())
    return y, x.grad, *(w.grad for w in ws)


def expert_counts(kind: str, E: int, used: int) -> torch.Tensor:
    """Rows per expert summing to ``used``: "random" (multinomial), "all_to_one" (expert E // 2 takes every
    row), "empty_experts" (every other expert gets none) or "none" (no rows at all: an EP rank whose experts
    no token chose)."""
    if kind == "none":
        return torch.zeros(E, dtype=torch.int64)
    if kind == "all_to_one":
        c = torch.zeros(E, dtype=torch.int64)
        c[E // 2] = used
    elif kind == "empty_experts":
        c = torch.zeros(E, dtype=torch.int64)
        c[1::2] = torch.distributions.Multinomial(used, torch.ones(E // 2)).sample().long()
    else:
        c = torch.distributions.Multinomial(used, torch.ones(E)).sample().long()
    return c
