"""Grouped SwiGLU experts with FP8 (e4m3) GEMMs for the forward and the input gradient.

    fp8_grouped_swiglu(x_ND, w1_EHD, w2_EDH, w3_EHD, counts_E) -> y_ND   (bf16; same contract as
    experts.grouped_swiglu: rows expert-major, rows at or past sum(counts) unspecified in y and dx)

GEMMs (``torch._scaled_grouped_mm``: Hopper FP8, fp32 accumulation, bf16 out):
    forward         [a | b] = x @ [w1; w3]ᵀ  (one GEMM, N = 2H),   y = h @ w2ᵀ
    input gradient  dh = dy @ w2,   dx = [da | db] @ [w1; w3]      (one GEMM, reduction over 2H)
The three weight-gradient GEMMs stay in bf16 (``torch._grouped_mm`` on the bf16 x, h, dy, da, db):
FP8 there needs per-(expert, column) scales of the token operands, i.e. five more transposing
passes over tensors as large as the GEMMs' inputs, for ~1.3× on a third of the FLOPs.

Scaling (dequantisation multipliers, powers of two, computed on the device): activations and
output gradients one scale per row; weights one scale per expert (w1 and w3 share it), so the
plain copy (forward) and the transposed copy (input gradient) share it. The forward copy is cast
with the previous call's scale while the amax is taken, and cast again only where the scale moved
(``kernels.fp8.cast_experts_scaled``): exact current scaling without a separate amax pass. The FP8
weight copies are made per call; weights stay in their own dtype (fp32 masters or bf16 parameters).
Expert groups need no alignment (the 2d×3d FP8 GEMMs accept any row counts); rows past sum(counts)
are skipped by every pass.

Off CUDA the GEMMs are emulated (dequantise, fp32 matmul per expert): the same quantisation, so CPU
tests check everything but the tensor-core kernels.
"""

import torch

from components.errors import UserError
from kernels.fp8 import FP8, cast_experts_scaled, cast_experts_t, quant_rows, swiglu_quant, swiglu_quant_bwd

ALIGN = 16  # FP8 GEMM operands: dim and hidden_dim must be multiples of 16 (16-byte rows)


def check_fp8_supported(device: torch.device) -> None:
    """One-line error unless FP8 experts can run on ``device`` (a Hopper or newer CUDA GPU)."""
    if device.type != "cuda":
        raise UserError(
            f"[moe_echo] expert_precision = \"fp8\" needs a CUDA GPU of compute capability 9.0 or newer "
            f"(Hopper); this run is on {device.type}: set expert_precision = \"bf16\""
        )
    cap = torch.cuda.get_device_capability(device)
    if cap < (9, 0) or not hasattr(torch, "_scaled_grouped_mm"):
        raise UserError(
            f"[moe_echo] expert_precision = \"fp8\" needs compute capability 9.0 or newer (Hopper) and "
            f"torch._scaled_grouped_mm; {torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}: "
            f"set expert_precision = \"bf16\""
        )


def scaled_grouped_mm(a_q, b_q, s_a, s_b, offs):
    """``torch._scaled_grouped_mm`` (2d×3d, bf16 out) on CUDA; off CUDA the same product emulated in fp32.
    a [M, K] (rows grouped by offs), b [E, K, N], s_a [M], s_b [E, N] -> [M, N] (rows past offs[-1]: zero on CPU,
    unspecified on CUDA)."""
    if a_q.is_cuda:
        return torch._scaled_grouped_mm(a_q, b_q, s_a, s_b, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True)
    ends = offs.tolist()  # host read: the emulation is for CPU tests only
    out = torch.zeros(a_q.shape[0], b_q.shape[2])
    for e, (i0, i1) in enumerate(zip([0] + ends[:-1], ends)):
        out[i0:i1] = (a_q[i0:i1].float() * s_a[i0:i1, None]) @ (b_q[e].float() * s_b[e][None, :])
    return out.to(torch.bfloat16)


def grouped_wgrad(a_MP, b_MQ, offs):
    """Σ over each expert's rows of aᵀ b: [E, P, Q] (bf16 ``torch._grouped_mm`` on CUDA; fp32 loop off CUDA).
    An expert without rows gets zeros."""
    if a_MP.is_cuda:
        return torch._grouped_mm(a_MP.t(), b_MQ, offs=offs)
    ends = offs.tolist()
    return torch.stack([a_MP[i0:i1].float().t() @ b_MQ[i0:i1].float()
                        for i0, i1 in zip([0] + ends[:-1], ends)]).to(torch.bfloat16)


def _per_column(s_E: torch.Tensor, n: int) -> torch.Tensor:
    """A per-expert scale as the [E, N] per-output-column scale the GEMM reads."""
    return s_E[:, None].expand(-1, n).contiguous()


class _Fp8GroupedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, w1_EHD, w2_EDH, w3_EHD, counts_E, hint_2E):
        E, H, D = w1_EHD.shape
        offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
        used = offs_E[-1:]
        w13_q = torch.empty(E, 2 * H, D, dtype=FP8, device=x_ND.device)  # [w1; w3] as stored: K-major for x @ ·ᵀ
        s13_E = cast_experts_scaled((w1_EHD, w3_EHD), w13_q, hint_2E[0])
        w2_q = torch.empty(E, D, H, dtype=FP8, device=x_ND.device)
        s2_E = cast_experts_scaled((w2_EDH,), w2_q, hint_2E[1])
        x_q, x_s = quant_rows(x_ND, used)
        ab_MJ = scaled_grouped_mm(x_q, w13_q.transpose(-2, -1), x_s, _per_column(s13_E, 2 * H), offs_E)
        h_MH, h_q, h_s = swiglu_quant(ab_MJ, used)
        y_ND = scaled_grouped_mm(h_q, w2_q.transpose(-2, -1), h_s, _per_column(s2_E, D), offs_E)
        ctx.save_for_backward(x_ND, w1_EHD, w2_EDH, w3_EHD, ab_MJ, h_MH, offs_E, s13_E, s2_E)
        return y_ND

    @staticmethod
    def backward(ctx, dy_ND):
        x_ND, w1_EHD, w2_EDH, w3_EHD, ab_MJ, h_MH, offs_E, s13_E, s2_E = ctx.saved_tensors
        E, H, D = w1_EHD.shape
        used = offs_E[-1:]
        dy_ND = dy_ND.to(torch.bfloat16).contiguous()
        dy_q, dy_s = quant_rows(dy_ND, used)
        w2t_q = torch.empty(E, H, D, dtype=FP8, device=dy_ND.device)  # w2ᵀ: K-major for dy @ w2
        cast_experts_t(w2_EDH, s2_E, w2t_q, 0)
        dh_MH = scaled_grouped_mm(dy_q, w2t_q.transpose(-2, -1), dy_s, _per_column(s2_E, H), offs_E)
        da_MH, db_MH, dab_q, dab_s = swiglu_quant_bwd(dh_MH, ab_MJ, used)
        w13t_q = torch.empty(E, D, 2 * H, dtype=FP8, device=dy_ND.device)  # [w1; w3]ᵀ: K-major for [da|db] @ ·
        cast_experts_t(w1_EHD, s13_E, w13t_q, 0)
        cast_experts_t(w3_EHD, s13_E, w13t_q, H)
        dx_ND = scaled_grouped_mm(dab_q, w13t_q.transpose(-2, -1), dab_s, _per_column(s13_E, D), offs_E)
        dw1 = grouped_wgrad(da_MH, x_ND, offs_E)
        dw3 = grouped_wgrad(db_MH, x_ND, offs_E)
        dw2 = grouped_wgrad(dy_ND, h_MH, offs_E)
        return dx_ND.to(x_ND.dtype), dw1.to(w1_EHD.dtype), dw2.to(w2_EDH.dtype), dw3.to(w3_EHD.dtype), None, None


def fp8_grouped_swiglu(x_ND, w1_EHD, w2_EDH, w3_EHD, counts_E, scale_hint_2E=None):
    """SwiGLU experts with FP8 GEMMs (see the module docstring); x_ND bf16, D and H multiples of 16.
    ``scale_hint_2E``: fp32 [2, E] on the device, the weight scales ([w1; w3], w2) of the previous call,
    updated in place — kept by the caller across steps it saves the weights' amax pass (zeros: no guess)."""
    E, H, D = w1_EHD.shape
    if D % ALIGN or H % ALIGN:
        raise UserError(f"FP8 experts need dim and hidden_dim divisible by {ALIGN}; got dim={D}, hidden_dim={H}")
    if scale_hint_2E is None:
        scale_hint_2E = torch.zeros(2, E, dtype=torch.float32, device=x_ND.device)
    return _Fp8GroupedSwiGLU.apply(x_ND.to(torch.bfloat16).contiguous(), w1_EHD, w2_EDH, w3_EHD, counts_E, scale_hint_2E)
