"""Token-choice top-k router with group-limited routing and balancing signals.

Shapes: T tokens, D model dim, E experts, K choices per token, G expert groups.

    x_TD ─gate (fp32)─► logits_TE ─softmax|sigmoid─► scores_TE
    scores_TE + expert_bias_E ─(group limit)─► top-k ─► topk_ids_TK
    topk_w_TK = scores_TE[topk_ids_TK]  (bias never enters the weights), optional renorm, × scale
    counts_E  = histogram of topk_ids_TK (scatter_add on device: no host read)

On CUDA the gate GEMM of bf16 activations and bf16 weights is one bf16 GEMM writing fp32 logits (``gate_logits``),
and (fp32 logits, no expert groups) everything after it up to the weights runs as one Triton kernel forward and
one backward (kernels/router.py); the torch code here is the reference and the path elsewhere.

Balancing:
- aux-loss-free (DeepSeek-V3): the caller keeps ``expert_bias_E``; ``updated_expert_bias``
  moves it by ``rate * sign(mean - count)`` and re-centres it to zero mean.
- sequence-level auxiliary loss: ``sequence_aux_loss``; it has a gradient into the gate only
  through ``scores`` (the assignment frequencies are constants).
"""

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from kernels import router as router_kernels


@dataclass
class RouterOutput:
    topk_ids_TK: torch.Tensor  # int64, expert id per (token, choice)
    topk_w_TK: torch.Tensor  # combine weights, fp32 (fp64 for fp64 inputs)
    counts_E: torch.Tensor  # int64, assignments per expert (sums to T*K)
    scores_TE: torch.Tensor  # fp32 (or fp64) scores before bias and group masking (for the aux loss)


class TopKRouter(nn.Module):
    """Parameters: ``gate`` (Linear D→E, torchtitan's name, so its checkpoints and HF adapters fit)."""

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        score_func: Literal["softmax", "sigmoid"] = "softmax",
        route_norm: bool = False,
        route_scale: float = 1.0,
        num_expert_groups: int | None = None,
        num_limited_groups: int | None = None,
        gate_bias: bool = False,
    ):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
        if num_expert_groups is not None:
            if num_experts % num_expert_groups != 0 or num_experts // num_expert_groups < 2:
                raise ValueError(
                    f"num_expert_groups={num_expert_groups} must divide num_experts={num_experts} "
                    "into groups of at least 2 experts"
                )
            if num_limited_groups is None or not 1 <= num_limited_groups <= num_expert_groups:
                raise ValueError(
                    f"num_limited_groups must be in [1, num_expert_groups={num_expert_groups}], "
                    f"got {num_limited_groups}"
                )
            if num_limited_groups * (num_experts // num_expert_groups) < top_k:
                raise ValueError("num_limited_groups * experts_per_group must be >= top_k")
        self.gate = nn.Linear(dim, num_experts, bias=gate_bias)
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_func = score_func
        self.route_norm = route_norm
        self.route_scale = route_scale
        self.num_expert_groups = num_expert_groups
        self.num_limited_groups = num_limited_groups

    def _limit_groups(self, choice_TE: torch.Tensor) -> torch.Tensor:
        """Keep the ``num_limited_groups`` groups with the largest top-2 score sum; mask the rest to -inf."""
        T, E = choice_TE.shape
        G = self.num_expert_groups
        choice_TGe = choice_TE.view(T, G, E // G)
        group_score_TG = choice_TGe.topk(2, dim=-1).values.sum(dim=-1)
        keep_TL = group_score_TG.topk(self.num_limited_groups, dim=-1).indices
        drop_TG = torch.ones_like(group_score_TG, dtype=torch.bool).scatter_(1, keep_TL, False)
        return choice_TGe.masked_fill(drop_TG.unsqueeze(-1), float("-inf")).view(T, E)

    def forward(self, x_TD: torch.Tensor, expert_bias_E: torch.Tensor | None = None) -> RouterOutput:
        with torch.autocast(x_TD.device.type, enabled=False):  # routing decided in fp32 (fp64 in tests)
            logits_TE = gate_logits(x_TD, self.gate.weight, self.gate.bias)
        if self.num_expert_groups is None and router_kernels.fusable(logits_TE, self.top_k):
            scores_TE, topk_ids_TK, topk_w_TK = router_kernels.route_topk(
                logits_TE, expert_bias_E, self.top_k, self.score_func, self.route_norm, self.route_scale)
            return RouterOutput(topk_ids_TK, topk_w_TK, expert_histogram(topk_ids_TK, self.num_experts), scores_TE)
        if self.score_func == "softmax":
            scores_TE = F.softmax(logits_TE, dim=-1)
        else:
            scores_TE = torch.sigmoid(logits_TE)

        choice_TE = scores_TE.detach()
        if expert_bias_E is not None:
            choice_TE = choice_TE + expert_bias_E
        if self.num_expert_groups is not None:
            choice_TE = self._limit_groups(choice_TE)
        topk_ids_TK = choice_TE.topk(self.top_k, dim=-1, sorted=False).indices

        topk_w_TK = scores_TE.gather(1, topk_ids_TK)
        if self.route_norm:
            topk_w_TK = topk_w_TK / (topk_w_TK.sum(dim=-1, keepdim=True) + 1e-20)
        topk_w_TK = topk_w_TK * self.route_scale

        counts_E = expert_histogram(topk_ids_TK, self.num_experts)
        return RouterOutput(topk_ids_TK, topk_w_TK, counts_E, scores_TE)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=init_std, a=-2 * init_std, b=2 * init_std)
        if self.gate.bias is not None:
            nn.init.zeros_(self.gate.bias)


def _bf16_gate_applies(x_TD: torch.Tensor, weight_ED: torch.Tensor) -> bool:
    return x_TD.is_cuda and x_TD.dim() == 2 and x_TD.dtype == weight_ED.dtype == torch.bfloat16


def gate_logits(x_TD: torch.Tensor, weight_ED: torch.Tensor, bias_E: torch.Tensor | None = None) -> torch.Tensor:
    """logits_TE = x_TD @ weight_EDᵀ (+ bias_E) in fp32 (fp64 for fp64 inputs). bf16 x and weight on CUDA (bf16
    parameters): one bf16 GEMM writing fp32 (``_BF16Gate``), the value of the fp32 GEMM of the upcast operands
    (bf16 products are exact in fp32 and sum in fp32) without their fp32 copies or the fp32 GEMM's rate."""
    if _bf16_gate_applies(x_TD, weight_ED):
        logits_TE = _BF16Gate.apply(x_TD, weight_ED)
        return logits_TE if bias_E is None else logits_TE + bias_E.float()
    acc = torch.promote_types(x_TD.dtype, torch.float32)
    return F.linear(x_TD.to(acc), weight_ED.to(acc), None if bias_E is None else bias_E.to(acc))


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b written in fp32 for bf16 operands: cuBLAS's bf16 GEMM with an fp32 output on CUDA (``torch.mm``'s
    ``out_dtype``), the fp32 GEMM of the upcast operands elsewhere (the same products and fp32 sums)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


class _BF16Gate(torch.autograd.Function):
    """Forward: logits_TE (fp32) = x_TD @ w_EDᵀ from bf16 operands. Backward: the logit gradient rounded to bf16
    once, then bf16 GEMMs for dx (T×E @ E×D) and dw (E×T @ T×D), written in bf16 as x's and w's gradients are."""

    @staticmethod
    def forward(ctx, x_TD, w_ED):
        ctx.save_for_backward(x_TD, w_ED)
        return _mm_f32(x_TD, w_ED.t())

    @staticmethod
    def backward(ctx, g_TE):
        x_TD, w_ED = ctx.saved_tensors
        g_TE = g_TE.to(torch.bfloat16)
        g_x = g_TE @ w_ED if ctx.needs_input_grad[0] else None
        g_w = g_TE.t() @ x_TD if ctx.needs_input_grad[1] else None
        return g_x, g_w


def expert_histogram(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 count of each id in ``ids`` (any shape), computed on device without a host read."""
    flat = ids.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )


def sequence_aux_loss(
    scores_BSE: torch.Tensor, topk_ids_BSK: torch.Tensor, coeff: float
) -> torch.Tensor:
    """DeepSeek-V3 sequence-wise balance loss, averaged over the B sequences.

    For each sequence: f_e = E / (K·S) · #{t : e ∈ topk(t)},  P_e = mean_t s'_{t,e} with
    s' = scores normalised over experts;  loss = coeff · Σ_e f_e · P_e.
    """
    B, S, E = scores_BSE.shape
    K = topk_ids_BSK.shape[-1]
    with torch.no_grad():
        hits_BE = torch.zeros(B, E, dtype=scores_BSE.dtype, device=scores_BSE.device)
        ones_BN = torch.ones(B, S * K, dtype=scores_BSE.dtype, device=scores_BSE.device)
        hits_BE.scatter_add_(1, topk_ids_BSK.reshape(B, S * K), ones_BN)
        f_BE = hits_BE * (E / (K * S))
    p_BE = (scores_BSE / scores_BSE.sum(dim=-1, keepdim=True)).mean(dim=1)
    return coeff * (f_BE * p_BE).sum(dim=-1).mean()


@torch.no_grad()
def updated_expert_bias(expert_bias_E: torch.Tensor, counts_E: torch.Tensor, rate: float) -> torch.Tensor:
    """Aux-loss-free balancing step: bias + rate·sign(mean − count), re-centred to zero mean."""
    counts_E = counts_E.float()
    new_E = expert_bias_E + rate * torch.sign(counts_E.mean() - counts_E)
    return new_E - new_E.mean()
