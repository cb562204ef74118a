"""Grouped SwiGLU experts with FP8 (e4m3) GEMMs for the forward and the input gradient.

    fp8_grouped_swiglu(x_ND, w1_EHD, w2_EDH, w3_EHD, counts_E) -> y_ND   (bf16; same contract as
    experts.grouped_swiglu: rows expert-major, rows at or past sum(counts) unspecified in y and dx)

GEMMs (``kernels.fp8_gemm.grouped_mm_fp8``, one persistent Triton kernel over every expert's tiles: Hopper FP8,
fp32 accumulation, bf16 out; 1.05–1.59x ``torch._scaled_grouped_mm`` per GEMM at the experts' shapes on H200):
    forward         [a | b] = x @ [w1; w3]ᵀ  (one GEMM, N = 2H),   y = h @ w2ᵀ
    input gradient  dh = dy @ w2,   dx = [da | db] @ [w1; w3]      (one GEMM, reduction over 2H)
The three weight-gradient GEMMs: with ``wgrad_fp8`` (``[moe_echo] expert_wgrad_precision``, FP8 by default with
FP8 experts) in FP8 through kernels/fp8_wgrad.py, from the e4m3 rows the other GEMMs read (x, h, dy, [da | db]),
each copied transposed onto whole 128-row blocks per expert at one scale per expert, the gradients written in the
weights' dtype; the forward then keeps x and h in e4m3 for the backward, not in bf16 (1.035× the FP8 step at EP=2,
docs/performance.md, FP8). Without it in bf16 (``torch._grouped_mm`` on the bf16 x, h, dy, da, db).

Scaling (dequantisation multipliers, powers of two, computed on the device): activations and
output gradients one scale per row; weights one scale per expert (w1 and w3 share it), so the
plain copy (forward) and the transposed copy (input gradient) share it. The forward copy is cast
with the previous call's scale while the amax is taken, and cast again only where the scale moved
(``kernels.fp8.cast_experts_scaled``): exact current scaling without a separate amax pass. The FP8
weight copies are made per call; weights stay in their own dtype (fp32 masters or bf16 parameters) —
unless ``copies`` (``Fp8WeightCopies``) are given: persistent FP8 copies in both layouts that the
optimizer step writes from the fp32 masters (kernels/adamw.py), so no weight is cast in the layer.
With ``channels`` (``[moe_echo] expert_fp8_scaling = "channel"``, what ``recipe_name = "rowwise"`` picks) each weight
gets one scale per output channel of its GEMM instead of one per expert: a row of w for the forward copy, a column
for the transposed one (so the two copies are quantised separately), cast from the weights in every pass.
Expert groups need no alignment (the 2d×3d FP8 GEMMs accept any row counts); rows past sum(counts)
are skipped by every pass. The FP8 rows of x and of dy come from the dispatcher where it made them as it moved
the rows (``rows``: the local dispatcher's gather, ``nvlink``'s expand into expert rows, and either one's combine
backward), else from ``quant_rows`` here.

Off CUDA the GEMMs are emulated (dequantise, fp32 matmul per expert): the same quantisation, so CPU
tests check everything but the tensor-core kernels.
"""

from dataclasses import dataclass

import torch

from components.errors import UserError
from kernels.fp8_gemm import grouped_mm_fp8
from kernels.fp8_wgrad import grouped_wgrad_fp8, requant_expert_t
from kernels.moe_rows import triton
from kernels.fp8 import (FP8, Fp8Copy, cast_experts_scaled, cast_experts_t, pow2_scale, quant_rows, recast_moved_,
                         swiglu_quant, swiglu_quant_bwd, transpose_copy_)

from .row_ops import Fp8Rows

ALIGN = 16  # FP8 GEMM operands: dim and hidden_dim must be multiples of 16 (16-byte rows)


def check_fp8_supported(device: torch.device) -> None:
    """One-line error unless FP8 experts can run on ``device`` (a Hopper or newer CUDA GPU)."""
    if device.type != "cuda":
        raise UserError(
            f"[moe_echo] expert_precision = \"fp8\" needs a CUDA GPU of compute capability 9.0 or newer "
            f"(Hopper); this run is on {device.type}: set expert_precision = \"bf16\""
        )
    cap = torch.cuda.get_device_capability(device)
    if cap < (9, 0) or triton is None:
        raise UserError(
            f"[moe_echo] expert_precision = \"fp8\" needs compute capability 9.0 or newer (Hopper) and Triton; "
            f"{torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}"
            f"{'' if triton is not None else ', without Triton'}: set expert_precision = \"bf16\""
        )


def scaled_grouped_mm(a_q, b_q, s_a, s_b, offs):
    """The row-grouped FP8 GEMM (``kernels.fp8_gemm``, bf16 out; one expert: ``torch._scaled_mm``) on CUDA; off
    CUDA the same product emulated in fp32. a [M, K] (rows grouped by offs), b [E, K, N] (a transposed view of
    K-contiguous [E, N, K]), s_a [M], s_b [E, N] -> [M, N] (rows past offs[-1]: zero on CPU, unspecified on CUDA)."""
    if a_q.is_cuda and offs.numel() == 1:  # one expert (a dense feed-forward): cuBLAS's rowwise-scaled GEMM
        return torch._scaled_mm(a_q, b_q[0], scale_a=s_a[:, None], scale_b=s_b[0][None, :], out_dtype=torch.bfloat16,
                                use_fast_accum=True)
    if a_q.is_cuda:
        return grouped_mm_fp8(a_q, s_a, b_q.transpose(-2, -1), s_b, offs)
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


def bf16_wgrads(x_ND, h_MH, dy_ND, da_MH, db_MH, offs_E):
    """(dw1 [E, H, D], dw2 [E, D, H], dw3 [E, H, D]): the three weight gradients in bf16 (``grouped_wgrad``)."""
    return grouped_wgrad(da_MH, x_ND, offs_E), grouped_wgrad(dy_ND, h_MH, offs_E), grouped_wgrad(db_MH, x_ND, offs_E)


def fp8_wgrads(x_fp8, h_fp8, dy_fp8, dab_fp8, offs_E, out_dtype):
    """``bf16_wgrads`` in FP8 (kernels/fp8_wgrad.py) from the e4m3 rows (q, s) of x, h, dy and [da | db]: each
    copied transposed at one scale per expert, then one grouped GEMM per weight, written in ``out_dtype``; the
    copies of one pair of operands are freed before the next pair's are made."""
    (x_t, sx, aoffs), (dab_t, sab, _) = (requant_expert_t(q, s, offs_E) for q, s in (x_fp8, dab_fp8))
    H = dab_t.shape[0] // 2
    dw1 = grouped_wgrad_fp8(dab_t[:H], sab, x_t, sx, aoffs, out_dtype)
    dw3 = grouped_wgrad_fp8(dab_t[H:], sab, x_t, sx, aoffs, out_dtype)
    del x_t, dab_t
    (dy_t, sdy, _), (h_t, sh, _) = (requant_expert_t(q, s, offs_E) for q, s in (dy_fp8, h_fp8))
    return dw1, grouped_wgrad_fp8(dy_t, sdy, h_t, sh, aoffs, out_dtype), dw3


def per_column(s_E: torch.Tensor, n: int) -> torch.Tensor:
    """A per-expert scale as the [E, N] per-output-column scale the GEMM reads."""
    return s_E[:, None].expand(-1, n).contiguous()


def cast_channels(ws: tuple[torch.Tensor, ...], out_EPI: torch.Tensor) -> torch.Tensor:
    """out = fp8 of ws stacked along dim 1 ([E, P, I]), one power-of-two scale per row — the output channel of
    x @ wᵀ — returned as s [E, P] (dequantisation multipliers): ``quant_rows`` over each weight's rows, one pass.
    On the device, no host read."""
    scales, r = [], 0
    for w in ws:
        E, O, I = w.shape
        q_RI, s_R = quant_rows(w.detach().reshape(E * O, I))
        out_EPI[:, r:r + O] = q_RI.view(E, O, I)
        scales.append(s_R.view(E, O))
        r += O
    return torch.cat(scales, 1) if len(scales) > 1 else scales[0]


def cast_channels_t(ws: tuple[torch.Tensor, ...], out_EIP: torch.Tensor) -> torch.Tensor:
    """out = fp8 of (ws stacked along dim 1)ᵀ, [E, I, P] contiguous, one power-of-two scale per column of the
    stack — the output channel of g @ w — returned as s [E, I]: the weights transposed, then ``quant_rows``."""
    E, I, P = out_EIP.shape
    wt_EIP = torch.empty(E, I, P, dtype=ws[0].dtype, device=ws[0].device)
    c = 0
    for w in ws:
        wt_EIP[:, :, c:c + w.shape[1]] = w.detach().transpose(1, 2)
        c += w.shape[1]
    q_RP, s_R = quant_rows(wt_EIP.view(E * I, P))
    out_EIP.copy_(q_RP.view(E, I, P))
    return s_R.view(E, I)


@dataclass
class Fp8Weights:
    """The FP8 weights the experts' GEMMs read, E experts (``Fp8WeightCopies``' fields of the same names)."""

    plain13_E2HD: torch.Tensor
    plain2_EDH: torch.Tensor
    t13_ED2H: torch.Tensor
    t2_EHD: torch.Tensor
    scale_2E: torch.Tensor


class Fp8WeightCopies:
    """Persistent FP8 copies of one rank's E experts (w1, w3: [E, H, D], w2: [E, D, H]) in the layouts the GEMMs
    read, written by the optimizer step (``adamw_master_(..., fp8=copies.copy(role))`` writes the plain copies
    in its pass over each weight; ``finish_`` then settles the scales and transposes) instead of cast from the
    weights in every forward and backward:

        plain13_E2HD [E, 2H, D]  [w1; w3] as stored (forward),   plain2_EDH [E, D, H]  w2 (forward)
        t13_ED2H     [E, D, 2H]  [w1; w3]ᵀ (input gradient),      t2_EHD     [E, H, D]  w2ᵀ (input gradient)
        scale_2E     fp32 [2, E] the scales of ([w1; w3], w2) the copies hold (module docstring's scaling)
        amax_2E      fp32 [2, E] the amax of the weights written since the last ``finish_``

    2 bytes per weight element in all, the size of one bf16 copy. Roles: 1, 2, 3 for w1, w2, w3. Per step the
    optimizer moves 3 bytes per element for them (write the plain copy; read it, write the transposed one)
    where casting in the layer moves 6 (read bf16 and write FP8, twice).

    ``slots`` (ECHO's slots per rank): each buffer holds ``slots`` expert rows after the E home experts, which the
    optimizer never writes; ECHO writes its clones there from their home experts' copies
    (``echo_transport.clone_fp8_weights_``) and the GEMMs read ``with_slots`` ([E + slots] views)."""

    def __init__(self, E: int, H: int, D: int, device: torch.device, slots: int = 0):
        new = lambda *shape: torch.zeros(E + slots, *shape, dtype=FP8, device=device)
        scales = torch.ones(2, E + slots, dtype=torch.float32, device=device)
        self.with_slots = Fp8Weights(new(2 * H, D), new(D, H), new(D, 2 * H), new(H, D), scales)
        w = self.with_slots
        self.plain13_E2HD, self.plain2_EDH = w.plain13_E2HD[:E], w.plain2_EDH[:E]
        self.t13_ED2H, self.t2_EHD = w.t13_ED2H[:E], w.t2_EHD[:E]
        self.scale_2E = scales[:, :E]
        self.amax_2E = torch.zeros(2, E, dtype=torch.float32, device=device)
        self.H, self.E, self.slots = H, E, slots

    def copy(self, role: int) -> Fp8Copy:
        """Where weight ``role`` (1, 2, 3: w1, w2, w3) lives in the copies."""
        if role == 2:
            return Fp8Copy(self.plain2_EDH, 0, self.scale_2E[1], self.amax_2E[1])
        return Fp8Copy(self.plain13_E2HD, 0 if role == 1 else self.H, self.scale_2E[0], self.amax_2E[0])

    @torch.no_grad()
    def write_(self, w1_EHD: torch.Tensor, w2_EDH: torch.Tensor, w3_EHD: torch.Tensor) -> None:
        """Every copy from the weights (at the start, after weights were loaded): exact current scales."""
        cast_experts_scaled((w1_EHD, w3_EHD), self.plain13_E2HD, self.scale_2E[0])
        cast_experts_scaled((w2_EDH,), self.plain2_EDH, self.scale_2E[1])
        self._transpose()
        self.amax_2E.zero_()

    def _transpose(self) -> None:
        transpose_copy_(self.plain13_E2HD, self.t13_ED2H)
        transpose_copy_(self.plain2_EDH, self.t2_EHD)

    @torch.no_grad()
    def finish_(self, masters: dict[int, torch.Tensor], updated: set[int], skip: torch.Tensor | None) -> None:
        """After the optimizer wrote the copies of the weights in ``updated`` (with the held scales) from
        ``masters`` (role -> fp32 weight, all three roles): the scales become those of the new amax — kept where
        ``skip`` (device flag of a gated step) is set — the experts whose scale moved are recast, and the
        transposed copies written from the plain ones. All on the device; a partial update (a weight without
        gradient) rewrites every copy."""
        if updated != {1, 2, 3}:
            self.write_(masters[1], masters[2], masters[3])
            return
        s_2E = pow2_scale(self.amax_2E)
        if skip is not None:
            s_2E = torch.where(skip > 0, self.scale_2E, s_2E)
        for role in (1, 2, 3):
            recast_moved_(masters[role], self.copy(role), s_2E[0 if role != 2 else 1])
        self.scale_2E.copy_(s_2E)
        self.amax_2E.zero_()
        self._transpose()


class _Fp8GroupedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, w1_EHD, w2_EDH, w3_EHD, counts_E, hint_2E, copies, channels, rows, wgrad_fp8):
        E, H, D = w1_EHD.shape
        offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
        used = offs_E[-1:]
        ctx.copies, ctx.channels, ctx.rows, ctx.wgrad_fp8 = copies, channels, rows, wgrad_fp8
        # [w1; w3] and w2 as stored: K-major for x @ ·ᵀ
        w13_q = torch.empty(E, 2 * H, D, dtype=FP8, device=x_ND.device) if copies is None else copies.plain13_E2HD
        w2_q = torch.empty(E, D, H, dtype=FP8, device=x_ND.device) if copies is None else copies.plain2_EDH
        if channels:
            s13_E = s2_E = hint_2E  # unused: every scale is per channel, computed here from the weights
            s13_N, s2_N = cast_channels((w1_EHD, w3_EHD), w13_q), cast_channels((w2_EDH,), w2_q)
        else:
            if copies is not None:  # written by the optimizer: no weight is read here
                s13_E, s2_E = copies.scale_2E.unbind(0)
            else:
                s13_E = cast_experts_scaled((w1_EHD, w3_EHD), w13_q, hint_2E[0])
                s2_E = cast_experts_scaled((w2_EDH,), w2_q, hint_2E[1])
            s13_N, s2_N = per_column(s13_E, 2 * H), per_column(s2_E, D)
        x_fp8 = rows.take_x() if rows is not None else None
        x_q, x_s = x_fp8 if x_fp8 is not None else quant_rows(x_ND, used)
        ab_MJ = scaled_grouped_mm(x_q, w13_q.transpose(-2, -1), x_s, s13_N, offs_E)
        h_MH, h_q, h_s = swiglu_quant(ab_MJ, used, bf16=not wgrad_fp8)  # bf16 h: only bf16 weight gradients read it
        y_ND = scaled_grouped_mm(h_q, w2_q.transpose(-2, -1), h_s, s2_N, offs_E)
        ctx.x_dtype = x_ND.dtype
        kept = (x_q, x_s, h_q, h_s) if wgrad_fp8 else (x_ND, h_MH)  # what the weight gradients read
        ctx.save_for_backward(w1_EHD, w2_EDH, w3_EHD, ab_MJ, offs_E, s13_E, s2_E, *kept)
        return y_ND

    @staticmethod
    def backward(ctx, dy_ND):
        w1_EHD, w2_EDH, w3_EHD, ab_MJ, offs_E, s13_E, s2_E, *kept = ctx.saved_tensors
        E, H, D = w1_EHD.shape
        used = offs_E[-1:]
        dy_fp8 = ctx.rows.take_grad(dy_ND) if ctx.rows is not None else None  # the very tensor the combine gave
        dy_ND = dy_ND.to(torch.bfloat16).contiguous() if dy_fp8 is None or not ctx.wgrad_fp8 else dy_ND
        dy_q, dy_s = dy_fp8 if dy_fp8 is not None else quant_rows(dy_ND, used)
        copies = ctx.copies
        if copies is not None:
            w2t_q, w13t_q = copies.t2_EHD, copies.t13_ED2H
        else:
            w2t_q = torch.empty(E, H, D, dtype=FP8, device=dy_ND.device)  # w2ᵀ: K-major for dy @ w2
            w13t_q = torch.empty(E, D, 2 * H, dtype=FP8, device=dy_ND.device)  # [w1; w3]ᵀ: K-major for [da|db] @ ·
        if ctx.channels:
            s2_N, s13_N = cast_channels_t((w2_EDH,), w2t_q), cast_channels_t((w1_EHD, w3_EHD), w13t_q)
        else:
            if copies is None:
                cast_experts_t(w2_EDH, s2_E, w2t_q, 0)
                cast_experts_t(w1_EHD, s13_E, w13t_q, 0)
                cast_experts_t(w3_EHD, s13_E, w13t_q, H)
            s2_N, s13_N = per_column(s2_E, H), per_column(s13_E, D)
        dh_MH = scaled_grouped_mm(dy_q, w2t_q.transpose(-2, -1), dy_s, s2_N, offs_E)
        da_MH, db_MH, dab_q, dab_s = swiglu_quant_bwd(dh_MH, ab_MJ, used, bf16=not ctx.wgrad_fp8)
        dx_ND = scaled_grouped_mm(dab_q, w13t_q.transpose(-2, -1), dab_s, s13_N, offs_E)
        if ctx.wgrad_fp8:
            x_q, x_s, h_q, h_s = kept
            dw1, dw2, dw3 = fp8_wgrads((x_q, x_s), (h_q, h_s), (dy_q, dy_s), (dab_q, dab_s), offs_E, w1_EHD.dtype)
        else:
            dw1, dw2, dw3 = bf16_wgrads(*kept[:2], dy_ND, da_MH, db_MH, offs_E)
        grads = dx_ND.to(ctx.x_dtype), dw1.to(w1_EHD.dtype), dw2.to(w2_EDH.dtype), dw3.to(w3_EHD.dtype)
        return *grads, None, None, None, None, None, None


def fp8_grouped_swiglu(x_ND, w1_EHD, w2_EDH, w3_EHD, counts_E, scale_hint_2E=None,
                       copies: Fp8WeightCopies | None = None, channels: bool = False, rows: Fp8Rows | None = None,
                       wgrad_fp8: bool = False):
    """SwiGLU experts with FP8 GEMMs (see the module docstring); x_ND bf16, D and H multiples of 16.
    ``scale_hint_2E``: fp32 [2, E] on the device, the weight scales ([w1; w3], w2) of the previous call,
    updated in place — kept by the caller across steps it saves the weights' amax pass (zeros: no guess).
    ``copies``: the weights' FP8 copies, current (written by the optimizer): the weights themselves only
    receive the gradients. ``channels``: one weight scale per output channel instead of per expert (no copies).
    ``rows``: x_ND and y_ND's gradient already quantised as ``quant_rows`` would (by the dispatcher that moved
    them); whichever is missing is quantised here; where ``rows.plain`` is False they are the only values (x_ND and
    the gradient handed back are stand-ins: needs ``wgrad_fp8``). ``wgrad_fp8``: the weight gradients in FP8 too
    (``fp8_wgrads``)."""
    E, H, D = w1_EHD.shape
    if D % ALIGN or H % ALIGN:
        raise UserError(f"FP8 experts need dim and hidden_dim divisible by {ALIGN}; got dim={D}, hidden_dim={H}")
    if channels and copies is not None:
        raise ValueError("FP8 weight copies hold one scale per expert; per-channel scaling casts in each call")
    if copies is not None and tuple(copies.plain2_EDH.shape) != tuple(w2_EDH.shape):
        raise ValueError(f"FP8 copies of shape {tuple(copies.plain2_EDH.shape)} for w2 of {tuple(w2_EDH.shape)}: "
                         "the copies belong to other weights (with ECHO the GEMMs read their with_slots)")
    if scale_hint_2E is None:
        scale_hint_2E = torch.zeros(2, E, dtype=torch.float32, device=x_ND.device)
    if rows is not None and not rows.plain:  # x_ND a stand-in: its FP8 rows are its only values
        if not wgrad_fp8 or rows.x is None:
            raise ValueError("FP8 rows alone (no bf16 rows written) need FP8 weight gradients and rows not yet taken")
        return _Fp8GroupedSwiGLU.apply(x_ND, w1_EHD, w2_EDH, w3_EHD, counts_E, scale_hint_2E, copies, channels, rows,
                                       wgrad_fp8)
    if rows is not None and (x_ND.dtype != torch.bfloat16 or not x_ND.is_contiguous()):
        rows.take_x()  # quantised from other values than the GEMM's bf16 rows
    return _Fp8GroupedSwiGLU.apply(x_ND.to(torch.bfloat16).contiguous(), w1_EHD, w2_EDH, w3_EHD, counts_E,
                                   scale_hint_2E, copies, channels, rows, wgrad_fp8)


def fp8_dense_swiglu(x, w1_HD, w2_DH, w3_HD, scale_hint_21):
    """A dense SwiGLU feed-forward, w2(silu(w1 x) · w3 x), through the FP8 experts' kernels as expert 0 of one that
    every row of x reaches: one power-of-two scale per token row and one per weight, the SwiGLU writing its FP8
    rows, FP8 weight gradients; the weights cast in each call; with one expert the GEMMs are cuBLAS's
    (``torch._scaled_mm``, rowwise scales; the weight gradients tensorwise). x [..., D] bf16; w1, w3 [H, D],
    w2 [D, H] (a Linear's weights, gradients flow to them); ``scale_hint_21``: fp32 [2, 1] on the device, as
    ``fp8_grouped_swiglu``'s. Returns [..., D] bf16."""
    x_ND = x.reshape(-1, x.shape[-1])
    counts_E = torch.full((1,), x_ND.shape[0], dtype=torch.int64, device=x.device)
    y_ND = fp8_grouped_swiglu(x_ND, w1_HD[None], w2_DH[None], w3_HD[None], counts_E, scale_hint_21, wgrad_fp8=True)
    return y_ND.view(x.shape)
