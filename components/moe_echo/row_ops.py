"""Differentiable row permutations shared by dispatcher backends.

    gather_rows(x_TD, token_of_row_N, row_of_slot_TK) -> x_ND = x_TD[token_of_row_N]
        backward: grad_x[t] = Σ_k grad_x_ND[row_of_slot[t, k]]  (a gather-sum, no atomics)
    weighted_combine(y_ND, w_TK, row_of_slot_TK) -> y_TD = Σ_k w[t, k] · y_ND[row_of_slot[t, k]]
        fp32 accumulation; backward gives grad_y_ND and grad_w_TK in one pass.

Invariant: ``row_of_slot_TK`` maps the T·K (token, choice) slots to distinct rows, or to -1 for a
slot that has no row (not sent: its contribution is zero), and ``token_of_row_N[row_of_slot[t, k]]
== t``. Rows no slot maps to (padding) get zero gradient.

    permute_rows(x_ND, src_of_row_N, row_of_src_N) -> x_ND[src_of_row_N] for a permutation
        (backward gathers with the inverse permutation: no atomics)
"""

import torch

from kernels.moe_rows import combine_backward, gather_sum


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, token_of_row_N, row_of_slot_TK):
        ctx.save_for_backward(row_of_slot_TK)
        return x_TD.index_select(0, token_of_row_N)

    @staticmethod
    def backward(ctx, grad_ND):
        (row_of_slot_TK,) = ctx.saved_tensors
        return gather_sum(grad_ND, row_of_slot_TK), None, None


class _WeightedCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_ND, w_TK, row_of_slot_TK, is_permutation):
        ctx.save_for_backward(y_ND, w_TK, row_of_slot_TK)
        ctx.is_permutation = is_permutation
        return gather_sum(y_ND, row_of_slot_TK, w_TK)

    @staticmethod
    def backward(ctx, grad_TD):
        y_ND, w_TK, row_of_slot_TK = ctx.saved_tensors
        grad_y_ND, grad_w_TK = combine_backward(grad_TD, y_ND, w_TK, row_of_slot_TK,
                                                allow_missing=not ctx.is_permutation)
        return grad_y_ND, grad_w_TK, None, None


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, src_of_row_N, row_of_src_N):
        ctx.save_for_backward(row_of_src_N)
        return x_ND.index_select(0, src_of_row_N)

    @staticmethod
    def backward(ctx, grad_ND):
        (row_of_src_N,) = ctx.saved_tensors
        return grad_ND.index_select(0, row_of_src_N), None, None


def permute_rows(x_ND, src_of_row_N, row_of_src_N):
    return _PermuteRows.apply(x_ND, src_of_row_N, row_of_src_N)


def gather_rows(x_TD, token_of_row_N, row_of_slot_TK):
    return _GatherRows.apply(x_TD, token_of_row_N, row_of_slot_TK)


def weighted_combine(y_ND, w_TK, row_of_slot_TK, is_permutation: bool = False):
    """``is_permutation``: row_of_slot_TK covers every row of y_ND exactly once (local dispatch)."""
    return _WeightedCombine.apply(y_ND, w_TK, row_of_slot_TK, is_permutation)
