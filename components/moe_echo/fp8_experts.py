"""Grouped SwiGLU experts with FP8 (e4m3) GEMMs: forward, input gradient and weight gradient.

    fp8_grouped_swiglu(x_ND, w1_EHD, w2_EDH, w3_EHD, counts_E) -> y_ND   (bf16; same contract as
    experts.grouped_swiglu: rows expert-major, rows past sum(counts) unspecified in y, zero in dx)

Scaling (dequantisation multipliers, powers of two, computed on the device):
- activations and output gradients: one scale per row for the 2d×3d GEMMs (forward, input
  gradient), one per (expert, column) over the expert's rows for the weight-gradient GEMMs;
- weights: one scale per (expert, output row), taken along the GEMM's reduction dimension, in
  each of the two layouts the forward and the input gradient need.
The nine GEMMs are ``torch._scaled_grouped_mm`` (Hopper rowwise FP8, fp32 accumulation, bf16 out).
Weights stay in their own dtype (fp32 masters or bf16 parameters); only their FP8 copies are
made per call.

Layout: FP8 weight-gradient GEMMs need every expert's row count to be a multiple of 16, so inside
this function each expert's rows sit at a 16-aligned start (``AlignedRows``; pad rows are zero).
The quantisation kernels gather into that layout and the results are gathered back, so the
dispatcher's layout is untouched. Sizes are static (round_up(N, 16) + 16·E rows): no host read, capturable.

Off CUDA the GEMMs are emulated (dequantise, fp32 matmul per expert): the same quantisation and
layout, so CPU tests check everything but the tensor-core kernel.
"""

from dataclasses import dataclass

import torch

from components.errors import UserError
from kernels.fp8 import ALIGN, quant_cols, quant_rows
from kernels.moe_rows import gather_sum
from kernels.swiglu import swiglu_bwd, swiglu_fwd


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


@dataclass
class AlignedRows:
    """Where each expert's rows go when every expert starts at a multiple of 16.

    start_E / start_al_E: first row of expert e in the dispatcher's / the aligned layout;
    offs_al_E: int32 end of each expert's (16-padded) rows in the aligned layout (GEMM offsets);
    src_M: for each of the M = round_up(N, 16) + 16·E aligned rows, its dispatcher row (-1: padding);
    dst_N1: for each dispatcher row, its aligned row (-1: past sum(counts)), shaped [N, 1].
    """

    counts_E: torch.Tensor
    start_E: torch.Tensor
    start_al_E: torch.Tensor
    offs_al_E: torch.Tensor
    src_M: torch.Tensor
    dst_N1: torch.Tensor

    @staticmethod
    def build(counts_E: torch.Tensor, N: int) -> "AlignedRows":
        E = counts_E.shape[0]
        counts_E = counts_E.to(torch.int64)
        end_E = torch.cumsum(counts_E, 0)
        end_al_E = torch.cumsum((counts_E + ALIGN - 1) // ALIGN * ALIGN, 0)
        start_E, start_al_E = end_E - counts_E, end_al_E - (counts_E + ALIGN - 1) // ALIGN * ALIGN
        M = (N + ALIGN - 1) // ALIGN * ALIGN + ALIGN * E  # rows are a GEMM stride: a multiple of 16
        r_M = torch.arange(M, device=counts_E.device)
        e_M = torch.searchsorted(end_al_E, r_M, right=True).clamp(max=E - 1)
        i_M = r_M - start_al_E[e_M]
        src_M = torch.where((r_M < end_al_E[-1]) & (i_M < counts_E[e_M]), start_E[e_M] + i_M, -1)
        n_N = torch.arange(N, device=counts_E.device)
        e_N = torch.searchsorted(end_E, n_N, right=True).clamp(max=E - 1)
        dst_N = torch.where(n_N < end_E[-1], n_N - start_E[e_N] + start_al_E[e_N], -1)
        return AlignedRows(counts_E, start_E, start_al_E, end_al_E.to(torch.int32), src_M, dst_N.view(N, 1))

    @property
    def rows(self) -> int:
        return self.src_M.shape[0]


def scaled_grouped_mm(a_q, b_q, s_a, s_b, offs):
    """``torch._scaled_grouped_mm`` (bf16 out) on CUDA; off CUDA the same product emulated in fp32.
    2d×3d: a [M, K], b [E, K, N] -> [M, N]; 2d×2d: a [P, M], b [M, Q] grouped on M -> [E, P, Q]."""
    if a_q.is_cuda:
        return torch._scaled_grouped_mm(a_q, b_q, s_a, s_b, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True)
    ends = offs.tolist()  # host read: the emulation is for CPU tests only
    starts = [0] + ends[:-1]
    if b_q.dim() == 3:
        out = torch.zeros(a_q.shape[0], b_q.shape[2])
        for e, (i0, i1) in enumerate(zip(starts, ends)):
            a = a_q[i0:i1].float() * s_a[i0:i1, None]
            out[i0:i1] = a @ (b_q[e].float() * s_b[e][None, :])
        return out.to(torch.bfloat16)
    P, Q = a_q.shape[0], b_q.shape[1]
    s_a, s_b = s_a.view(-1, P), s_b.view(-1, Q)
    out = torch.stack([(a_q[:, i0:i1].float() * s_a[e][:, None]) @ (b_q[i0:i1].float() * s_b[e][None, :])
                       for e, (i0, i1) in enumerate(zip(starts, ends))])
    return out.to(torch.bfloat16)


def _weight_rows(w_EON):
    """FP8 copy of w [E, O, I] scaled per (e, o) over I, as the 2d×3d GEMM's [E, I, O] operand."""
    E, O, I = w_EON.shape
    q, s = quant_rows(w_EON.reshape(E * O, I))
    return q.view(E, O, I).transpose(-2, -1), s.view(E, O)


def _weight_cols(w_EON):
    """FP8 copy of w [E, O, I] scaled per (e, i) over O, as the 2d×3d GEMM's [E, O, I] operand."""
    E, O, I = w_EON.shape
    ar = torch.arange(E, device=w_EON.device)
    q, s = quant_cols(w_EON.reshape(E * O, I), ar * O, torch.full_like(ar, O), torch.zeros_like(ar), O, I * O)
    return q.view(E, I, O).transpose(-2, -1), s


def _token_cols(x_RC, lay: AlignedRows, aligned_input: bool):
    """FP8 copy of x [rows, C] scaled per (expert, c) over the expert's rows, as the 2d×2d GEMM's
    transposed operand [C, M] in the aligned layout; scales flattened [E·C]."""
    q, s = quant_cols(x_RC, lay.start_al_E if aligned_input else lay.start_E, lay.counts_E, lay.start_al_E, lay.rows)
    return q.view(x_RC.shape[1], lay.rows), s.reshape(-1)


def _to_dispatch_rows(y_MC, lay: AlignedRows):
    """Rows of the aligned layout back in the dispatcher's order (zero past sum(counts))."""
    return gather_sum(y_MC, lay.dst_N1)


class _Fp8GroupedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, w1_EHD, w2_EDH, w3_EHD, counts_E):
        lay = AlignedRows.build(counts_E, x_ND.shape[0])
        offs = lay.offs_al_E
        x_q, x_s = quant_rows(x_ND, lay.src_M)
        w1_q, w1_s = _weight_rows(w1_EHD)
        w3_q, w3_s = _weight_rows(w3_EHD)
        a_MH = scaled_grouped_mm(x_q, w1_q, x_s, w1_s, offs)
        b_MH = scaled_grouped_mm(x_q, w3_q, x_s, w3_s, offs)
        h_MH = swiglu_fwd(a_MH, b_MH)
        h_q, h_s = quant_rows(h_MH)
        w2_q, w2_s = _weight_rows(w2_EDH)
        y_MD = scaled_grouped_mm(h_q, w2_q, h_s, w2_s, offs)
        ctx.save_for_backward(x_ND, w1_EHD, w2_EDH, w3_EHD, a_MH, b_MH, h_MH)
        ctx.lay = lay
        return _to_dispatch_rows(y_MD, lay)

    @staticmethod
    def backward(ctx, dy_ND):
        x_ND, w1_EHD, w2_EDH, w3_EHD, a_MH, b_MH, h_MH = ctx.saved_tensors
        lay: AlignedRows = ctx.lay
        offs = lay.offs_al_E
        dy_q, dy_s = quant_rows(dy_ND.to(torch.bfloat16), lay.src_M)
        w2_q, w2_s = _weight_cols(w2_EDH)
        dh_MH = scaled_grouped_mm(dy_q, w2_q, dy_s, w2_s, offs)
        da_MH, db_MH = swiglu_bwd(dh_MH, a_MH, b_MH)
        da_q, da_s = quant_rows(da_MH)
        db_q, db_s = quant_rows(db_MH)
        w1_q, w1_s = _weight_cols(w1_EHD)
        w3_q, w3_s = _weight_cols(w3_EHD)
        dx_MD = scaled_grouped_mm(da_q, w1_q, da_s, w1_s, offs)
        dx_MD += scaled_grouped_mm(db_q, w3_q, db_s, w3_s, offs)
        dx_ND = _to_dispatch_rows(dx_MD, lay).to(x_ND.dtype)

        x_T, x_Ts = _token_cols(x_ND, lay, aligned_input=False)
        dy_T, dy_Ts = _token_cols(dy_ND, lay, aligned_input=False)
        h_T, h_Ts = _token_cols(h_MH, lay, aligned_input=True)
        da_T, da_Ts = _token_cols(da_MH, lay, aligned_input=True)
        db_T, db_Ts = _token_cols(db_MH, lay, aligned_input=True)
        dw1 = scaled_grouped_mm(da_T, x_T.t(), da_Ts, x_Ts, offs)
        dw3 = scaled_grouped_mm(db_T, x_T.t(), db_Ts, x_Ts, offs)
        dw2 = scaled_grouped_mm(dy_T, h_T.t(), dy_Ts, h_Ts, offs)
        return dx_ND, dw1.to(w1_EHD.dtype), dw2.to(w2_EDH.dtype), dw3.to(w3_EHD.dtype), None


def fp8_grouped_swiglu(x_ND, w1_EHD, w2_EDH, w3_EHD, counts_E):
    """SwiGLU experts with FP8 GEMMs (see the module docstring); x_ND bf16, D and H multiples of 16."""
    E, H, D = w1_EHD.shape
    if D % ALIGN or H % ALIGN:
        raise UserError(f"FP8 experts need dim and hidden_dim divisible by {ALIGN}; got dim={D}, hidden_dim={H}")
    return _Fp8GroupedSwiGLU.apply(x_ND.to(torch.bfloat16), w1_EHD, w2_EDH, w3_EHD, counts_E)
