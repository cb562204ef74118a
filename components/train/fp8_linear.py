"""Dense linear layers in FP8 on the FP8 experts' kernels: one power-of-two scale per token row, one per weight.

    y = fp8_linear(x, w_NK, hint)  # x [..., K] bf16, w [N, K] (fp32 or bf16) -> y [..., N] bf16
    Fp8RowsLinear                  # an nn.Linear (no bias) whose forward is fp8_linear

What ``[moe_echo] dense_linear_kernels = "experts"`` runs for the linear layers float8 converts outside the dense
feed-forwards and the output head (the attention projections): the routed experts' recipe with one expert that
every row reaches, whose GEMMs are cuBLAS's (``torch._scaled_mm``):

    forward          y = x @ wᵀ     x's rows in e4m3 at a scale each; w in e4m3 at one scale (guessed from the
                                     last step's: one pass over w where it holds)
    input gradient   dx = dy @ w     dy's rows in e4m3 at a scale each; wᵀ in e4m3 at w's scale
    weight gradient  dw = dyᵀ x      dy's and x's e4m3 rows copied transposed at one scale each
                                     (kernels/fp8_wgrad.py), accumulated in fp32, written in w's dtype

Four custom ops: x's rows in e4m3 (``moe_echo::fp8_rows``), w's cast and the forward GEMM (``moe_echo::fp8_linear``,
which updates the scale it guessed), x's rows transposed (``moe_echo::fp8_rows_t``) and the two backward GEMMs
(``moe_echo::fp8_linear_backward``). torch.compile keeps each whole inside a compiled attention (still one graph) and
runs the Triton and cuBLAS kernels it holds; where two layers read one input (an attention's wq and wkv_a) the graph's
common-subexpression pass runs x's two ops once for both. No host read.
Off CUDA the GEMMs are emulated (``scaled_grouped_mm``): the same quantisation, for CPU tests.
"""

import torch
from torch import nn

from components.moe_echo.fp8_experts import per_column, scaled_grouped_mm
from kernels.fp8 import FP8, cast_experts_scaled, cast_experts_t, quant_rows
from kernels.fp8_wgrad import capacity, grouped_wgrad_fp8, requant_expert_t


def _all_rows(x_MK: torch.Tensor) -> torch.Tensor:
    """offs [1] int32: every row belongs to the one expert."""
    return torch.full((1,), x_MK.shape[0], dtype=torch.int32, device=x_MK.device)


@torch.library.custom_op("moe_echo::fp8_rows", mutates_args=())
def fp8_rows(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q e4m3 [M, K], x_s fp32 [M]): x's rows at a power-of-two scale each (``quant_rows``). x_MK bf16,
    contiguous. Its own op, so that layers reading one input (an attention's wq and wkv_a) quantise it once in a
    compiled graph: the graph's common-subexpression pass merges the identical calls."""
    return quant_rows(x_MK)


@fp8_rows.register_fake
def _(x_MK):
    return x_MK.new_empty(x_MK.shape, dtype=FP8), x_MK.new_empty(x_MK.shape[0], dtype=torch.float32)


@torch.library.custom_op("moe_echo::fp8_rows_t", mutates_args=())
def fp8_rows_t(x_q: torch.Tensor, x_s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(xt_KA e4m3, s_x fp32 [1]): the rows (``fp8_rows``) transposed at one scale (``requant_expert_t`` with one
    expert; A: M rounded up to 128, zeros past M), the weight gradient's operand. Its own op for the same reason as
    ``fp8_rows``: layers sharing an input copy it once."""
    xt_KA, s_x, _ = requant_expert_t(x_q, x_s, _all_rows(x_q))
    return xt_KA, s_x


@fp8_rows_t.register_fake
def _(x_q, x_s):
    return x_q.new_empty(x_q.shape[1], capacity(x_q.shape[0], 1)), x_s.new_empty(1)


@torch.library.custom_op("moe_echo::fp8_linear", mutates_args=("hint",))
def fp8_linear_forward(x_q: torch.Tensor, x_s: torch.Tensor, w_NK: torch.Tensor,
                       hint: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y_MN bf16, s_w fp32 [1]): y = x @ wᵀ in FP8 from x's rows (``fp8_rows``), w cast at one scale, s_w.
    ``hint`` (fp32 [1]): w's scale in the previous call, updated to s_w; right, the cast is one pass over w."""
    N, K = w_NK.shape
    w_q = torch.empty(1, N, K, dtype=FP8, device=x_q.device)
    s_w = cast_experts_scaled((w_NK[None],), w_q, hint)
    y_MN = scaled_grouped_mm(x_q, w_q.transpose(-2, -1), x_s, per_column(s_w, N), _all_rows(x_q))
    return y_MN, s_w


@fp8_linear_forward.register_fake
def _(x_q, x_s, w_NK, hint):
    return x_q.new_empty(x_q.shape[0], w_NK.shape[0], dtype=torch.bfloat16), x_q.new_empty(1, dtype=torch.float32)


@torch.library.custom_op("moe_echo::fp8_linear_backward", mutates_args=())
def fp8_linear_backward(dy_MN: torch.Tensor, xt_KA: torch.Tensor, s_x: torch.Tensor, w_NK: torch.Tensor,
                        s_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx_MK bf16, dw_NK in w's dtype) from dy_MN (bf16, contiguous), x's transposed rows (``fp8_rows_t``) and
    w's scale."""
    N, K = w_NK.shape
    offs = _all_rows(dy_MN)
    dy_q, dy_s = quant_rows(dy_MN)
    wt_q = torch.empty(1, K, N, dtype=FP8, device=dy_MN.device)
    cast_experts_t(w_NK[None], s_w, wt_q, 0)
    dx_MK = scaled_grouped_mm(dy_q, wt_q.transpose(-2, -1), dy_s, per_column(s_w, K), offs)
    dy_t, s_dy, aoffs = requant_expert_t(dy_q, dy_s, offs)
    dw_NK = grouped_wgrad_fp8(dy_t, s_dy, xt_KA, s_x, aoffs, w_NK.dtype).squeeze(0)
    return dx_MK, dw_NK


@fp8_linear_backward.register_fake
def _(dy_MN, xt_KA, s_x, w_NK, s_w):
    return dy_MN.new_empty(dy_MN.shape[0], w_NK.shape[1], dtype=torch.bfloat16), torch.empty_like(w_NK)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_NK, hint):
        x_q, x_s = fp8_rows(x_MK)
        y_MN, s_w = fp8_linear_forward(x_q, x_s, w_NK, hint)
        ctx.save_for_backward(x_q, x_s, w_NK, s_w)
        return y_MN

    @staticmethod
    def backward(ctx, dy_MN):
        x_q, x_s, w_NK, s_w = ctx.saved_tensors
        xt_KA, s_x = fp8_rows_t(x_q, x_s)
        dx_MK, dw_NK = fp8_linear_backward(dy_MN.to(torch.bfloat16).contiguous(), xt_KA, s_x, w_NK, s_w)
        return dx_MK, dw_NK, None


def fp8_linear(x: torch.Tensor, w_NK: torch.Tensor, hint: torch.Tensor | None = None) -> torch.Tensor:
    """x @ wᵀ in FP8 (module docstring): x [..., K] (cast to bf16), w [N, K] with N and K multiples of 16.
    ``hint`` (fp32 [1], device): w's scale in the previous call, updated in place; kept across steps it saves a
    pass over w (None: no guess). Returns [..., N] bf16; the gradients flow to x (in bf16) and to w (in its
    dtype)."""
    x_MK = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    if hint is None:
        hint = torch.zeros(1, dtype=torch.float32, device=x.device)
    return _Fp8Linear.apply(x_MK, w_NK, hint).view(*x.shape[:-1], w_NK.shape[0])


class Fp8RowsLinear(nn.Linear):
    """An nn.Linear without bias whose forward is ``fp8_linear`` (same weight, same name: checkpoints load with
    it on or off). ``from_linear`` swaps a layer in place. Its buffer ``fp8_hint`` (not in checkpoints) keeps the
    weight's last scale; whatever it holds, a wrong guess costs a pass, never accuracy."""

    fp8_hint: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.fp8_hint)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8RowsLinear":
        if linear.bias is not None:
            raise ValueError("Fp8RowsLinear has no bias; keep a layer with a bias on torchao's Float8Linear")
        linear.__class__ = cls
        linear.register_buffer("fp8_hint", torch.zeros(1, dtype=torch.float32, device=linear.weight.device),
                               persistent=False)
        return linear
