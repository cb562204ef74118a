"""After each optimizer step: one aux-loss-free bias step per MoE layer from this step's global
expert counts, the layers' per-step counters reset, and the statistics the logs read.

    counts_LE, echo, net_L = balance_experts(layers, skip)   # inside the (captured) training step

``counts_LE`` [L, E]: tokens routed to each expert summed over data-parallel ranks; ``echo``: per
layer None or (echo_stats, per-rank load before/after, slot → cloned expert); ``net_L`` [L]: token
rows the layer's dispatches sent between hosts, summed over ranks (None unless a dispatcher spans
hosts) — device tensors, copied to the host one step late by the logger. ``skip`` (device flag)
keeps the biases of a gated step.
"""

import torch

from components.parallel.data_parallel import allreduce_sum


def balance_experts(layers, skip: torch.Tensor | None):
    if not layers:
        return None, [], None
    counts_LE = allreduce_sum(torch.stack([moe.tokens_per_expert for _, moe in layers]))
    spans = any(getattr(moe.dispatcher, "hosts", 1) > 1 for _, moe in layers)
    net_L = allreduce_sum(torch.stack([moe.network_rows for _, moe in layers])) if spans else None
    for (_, moe), counts_E in zip(layers, counts_LE):
        moe.update_expert_bias(counts_E, skip)
        moe.reset_step_stats()
    echo = [(moe.echo_stats.clone(), moe.echo.last_load.clone(), moe.echo.last_plan.slot_expert_G.clone())
            if moe.echo is not None else None for _, moe in layers]
    return counts_LE, echo, net_L
