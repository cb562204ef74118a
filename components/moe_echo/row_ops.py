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

With ``fp8`` (an ``Fp8Rows``, for FP8 experts) the row movers also write the rows they move as FP8 rows (e4m3,
one power-of-two scale per row: ``kernels.fp8.quant_rows``, bit for bit): ``gather_rows`` the dispatched x_ND,
``weighted_combine``'s backward grad_y_ND (where the rows are a permutation). The experts then read those
instead of quantising x_ND and grad_y_ND again (one pass over each less).
"""

import torch

from kernels.fp8 import FP8, gather_quant_rows, quant_rows
from kernels.moe_rows import _use_triton, combine_backward, gather_sum


class Fp8Rows:
    """FP8 copies of the dispatched rows (``x``) and of their output's gradient (``grad``), each (q_ND, s_N),
    handed from the kernels that move the rows to FP8 experts. Each is taken once; a gradient is given only for
    the very tensor it was made from (same memory, not modified since), else None and the experts quantise.
    What is taken is marked in use by the taker's stream (a pipelined layer moves rows on another stream than
    its experts run on), so its memory is not reused before the taker's kernels are done with it.

    ``plain`` False: the FP8 rows are the only values. The bf16 rows handed beside them (the dispatched x_ND,
    the gradient of y_ND) are stand-ins of their shape (``components.tensors.shape_only``), for experts that read
    nothing else (FP8 weight gradients); taking them is then a must (``take_grad`` raises where it cannot)."""

    def __init__(self, plain: bool = True):
        self.x: tuple[torch.Tensor, torch.Tensor] | None = None
        self._grad = None
        self.plain = plain

    def take_x(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        x, self.x = self.x, None
        return _used_here(x)

    def put_grad(self, g_ND: torch.Tensor, q_ND: torch.Tensor, s_N: torch.Tensor) -> None:
        self._grad = (g_ND, g_ND._version, q_ND, s_N)

    def take_grad(self, g_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        held, self._grad = self._grad, None
        if held is None:
            return None
        g, version, q_ND, s_N = held
        same = (g.data_ptr() == g_ND.data_ptr() and g.shape == g_ND.shape and g.stride() == g_ND.stride()
                and g.dtype == g_ND.dtype and g._version == version)
        if not same and not self.plain:
            raise RuntimeError("the experts' output gradient is not the combine's: with FP8 rows alone (no bf16 rows "
                               "written) nothing may use the experts' output but the combine")
        return _used_here((q_ND, s_N)) if same else None


def _used_here(rows):
    if rows is not None and rows[0].is_cuda:
        stream = torch.cuda.current_stream(rows[0].device)
        for t in rows:
            t.record_stream(stream)
    return rows


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, token_of_row_N, row_of_slot_TK, fp8):
        ctx.save_for_backward(row_of_slot_TK)
        if fp8 is None:
            return x_TD.index_select(0, token_of_row_N)
        x_ND, q_ND, s_N = gather_quant_rows(x_TD, token_of_row_N)
        fp8.x = (q_ND, s_N)
        return x_ND

    @staticmethod
    def backward(ctx, grad_ND):
        (row_of_slot_TK,) = ctx.saved_tensors
        return gather_sum(grad_ND, row_of_slot_TK), None, None, None


class _WeightedCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_ND, w_TK, row_of_slot_TK, is_permutation, fp8):
        ctx.save_for_backward(y_ND, w_TK, row_of_slot_TK)
        ctx.is_permutation = is_permutation
        ctx.fp8 = fp8 if is_permutation else None  # FP8 rows of every row need every row to have a slot
        return gather_sum(y_ND, row_of_slot_TK, w_TK)

    @staticmethod
    def backward(ctx, grad_TD):
        y_ND, w_TK, row_of_slot_TK = ctx.saved_tensors
        fused = ctx.fp8 is not None and grad_TD.is_cuda and _use_triton(grad_TD, y_ND)
        fp8_out = (torch.empty(y_ND.shape, dtype=FP8, device=y_ND.device),
                   torch.empty(y_ND.shape[0], dtype=torch.float32, device=y_ND.device)) if fused else None
        grad_y_ND, grad_w_TK = combine_backward(grad_TD, y_ND, w_TK, row_of_slot_TK,
                                                allow_missing=not ctx.is_permutation, fp8_out=fp8_out)
        if ctx.fp8 is not None:
            ctx.fp8.put_grad(grad_y_ND, *(fp8_out if fused else quant_rows(grad_y_ND)))
        return grad_y_ND, grad_w_TK, None, None, None


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


def gather_rows(x_TD, token_of_row_N, row_of_slot_TK, fp8: Fp8Rows | None = None):
    return _GatherRows.apply(x_TD, token_of_row_N, row_of_slot_TK, fp8)


def weighted_combine(y_ND, w_TK, row_of_slot_TK, is_permutation: bool = False, fp8: Fp8Rows | None = None):
    """``is_permutation``: row_of_slot_TK covers every row of y_ND exactly once (local dispatch)."""
    return _WeightedCombine.apply(y_ND, w_TK, row_of_slot_TK, is_permutation, fp8)
