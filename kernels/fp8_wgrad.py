"""The experts' weight gradients in FP8 (Hopper): operands transposed in e4m3 with one scale per 128 rows of a
column, and the GEMM that contracts each expert's rows.

    quant_blocks_t(x_RC) -> (q_CR e4m3 [C, R_pad], s_BC fp32 [B, C])       B = ceil(R / 128), R_pad = 128 · B
        x transposed, s[b, c] the power-of-two scale of rows [128 b, 128 b + 128) of column c (|x| / s <= 448);
        rows past R are zeros. One pass: each program reads a [128, C-block] tile, takes its column amax and
        writes the tile transposed.
    grouped_wgrad_fp8(at_PR, sa_BP, bt_QR, sb_BQ, offs_E) -> dw_EPQ (bf16)
        dw[e] = Σ over expert e's rows r (offs_E[e-1] <= r < offs_E[e]) of a[r]ᵀ b[r], with a = (at · sa)ᵀ and
        b = (bt · sb)ᵀ dequantised per 128-row block: the weight gradient [da | db]ᵀ x or dyᵀ h of every expert.

Why this layout: Hopper's FP8 MMA reads both operands along the reduction dimension, here the token rows, which
every producer writes row by row (a Triton GEMM handed row-major e4m3 operands runs at 0.08-0.15x its K-major
rate: benchmarks/fp8_operand_layout.py). Scales per 128-row block of a column are what a kernel producing 128
rows at a time can compute on its own, so a producer can write these operands in the pass that makes the rows.
The GEMM walks each expert's rows in the 128-row blocks the scales live in (blocks an expert shares with its
neighbours are read with the other expert's rows masked to zero) and adds each block's product times its two
scales to an fp32 accumulator. An expert without rows gets zeros. No host read (capturable).

Triton on CUDA for both; the GEMM also under TRITON_INTERPRET=1 (its input is FP8 already); torch elsewhere (the
reference).
"""

import torch

from .fp8 import FP8, _on_kernels, pow2_scale
from .moe_rows import _use_triton, triton

BLOCK = 128  # rows per scale block, the GEMM's reduction step
CONFIGS = {  # the GEMM's (BLOCK_P, BLOCK_Q, num_stages, num_warps)
    "128x128": (128, 128, 4, 8),
    "128x256": (128, 256, 3, 8),
    "tiny": (16, 16, 1, 4),  # for the CPU interpreter
}
DEFAULT = "128x128"

if triton is not None:
    import triton.language as tl

    from .moe_rows import _pow2_scale

    @triton.jit
    def _quant_blocks_t_kernel(x_ptr, q_ptr, s_ptr, R, C, R_pad, stride_x, BLOCK_R: tl.constexpr,
                               BLOCK_C: tl.constexpr):
        rb = tl.program_id(0)
        r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        col_ok = c < C
        x = tl.load(x_ptr + r[:, None].to(tl.int64) * stride_x + c[None, :], mask=(r < R)[:, None] & col_ok[None, :],
                    other=0.0).to(tl.float32)
        s = _pow2_scale(tl.max(tl.abs(x), 0))
        tl.store(s_ptr + rb * C + c, s, mask=col_ok)
        q = (x / s[None, :]).to(tl.float8e4nv).to(tl.uint8, bitcast=True)  # q: the e4m3 copy's bytes
        tl.store(q_ptr + c[:, None].to(tl.int64) * R_pad + r[None, :], tl.trans(q),
                 mask=col_ok[:, None] & (r < R_pad)[None, :])

    @triton.jit
    def _wgrad_fp8_kernel(at_ptr, sa_ptr, bt_ptr, sb_ptr, out_ptr, offs_ptr, P, Q, stride_a, stride_b, tiles_q,
                          tiles_pq, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr,
                          NUM_STAGES: tl.constexpr):
        pid = tl.program_id(0)
        e = pid // tiles_pq
        t = pid % tiles_pq
        p = (t // tiles_q) * BLOCK_P + tl.arange(0, BLOCK_P)
        q = (t % tiles_q) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        p_ok, q_ok = p < P, q < Q
        r0 = tl.load(offs_ptr + e - 1, mask=e > 0, other=0).to(tl.int32)
        r1 = tl.load(offs_ptr + e).to(tl.int32)
        kr = tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
        for kb in tl.range(r0 // BLOCK_R, tl.cdiv(r1, BLOCK_R), num_stages=NUM_STAGES):
            k = kb * BLOCK_R + kr
            mine = (k >= r0) & (k < r1)  # the expert's rows of this block
            a = tl.load(at_ptr + p[:, None].to(tl.int64) * stride_a + k[None, :], mask=p_ok[:, None] & mine[None, :],
                        other=0.0)
            b = tl.load(bt_ptr + q[:, None].to(tl.int64) * stride_b + k[None, :], mask=q_ok[:, None] & mine[None, :],
                        other=0.0)
            s_a = tl.load(sa_ptr + kb * P + p, mask=p_ok, other=0.0)
            s_b = tl.load(sb_ptr + kb * Q + q, mask=q_ok, other=0.0)
            acc += tl.dot(a, tl.trans(b)) * s_a[:, None] * s_b[None, :]
        out = out_ptr + e.to(tl.int64) * P * Q + p[:, None].to(tl.int64) * Q + q[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=p_ok[:, None] & q_ok[None, :])


def quant_blocks_t_torch(x_RC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    R, C = x_RC.shape
    B = -(-R // BLOCK)
    x = x_RC.new_zeros(B * BLOCK, C, dtype=torch.float32)
    x[:R] = x_RC.float()
    s_BC = pow2_scale(x.view(B, BLOCK, C).abs().amax(1))
    q = (x.view(B, BLOCK, C) / s_BC[:, None, :]).to(FP8).view(B * BLOCK, C)
    return q.t().contiguous(), s_BC


def quant_blocks_t(x_RC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_CR, s_BC): x transposed in e4m3, one power-of-two scale per 128 rows of a column (module docstring)."""
    if not _on_kernels(x_RC):
        return quant_blocks_t_torch(x_RC)
    R, C = x_RC.shape
    B = -(-R // BLOCK)
    q_CR = torch.empty(C, B * BLOCK, dtype=FP8, device=x_RC.device)
    s_BC = torch.empty(B, C, dtype=torch.float32, device=x_RC.device)
    if B and C:
        x_RC = x_RC if x_RC.stride(1) == 1 else x_RC.contiguous()
        BLOCK_C = 64
        _quant_blocks_t_kernel[(B, triton.cdiv(C, BLOCK_C))](x_RC, q_CR.view(torch.uint8), s_BC, R, C, B * BLOCK,
                                                             x_RC.stride(0),
                                                             BLOCK_R=BLOCK, BLOCK_C=BLOCK_C, num_warps=4)
    return q_CR, s_BC


def dequant_blocks_t(q_XR: torch.Tensor, s_BX: torch.Tensor) -> torch.Tensor:
    """fp32 [X, R]: q · the scale of its 128-row block (exact)."""
    return q_XR.float() * s_BX.repeat_interleave(BLOCK, 0)[:q_XR.shape[1]].t()


def grouped_wgrad_fp8_torch(at_PR, sa_BP, bt_QR, sb_BQ, offs_E, out_dtype=torch.bfloat16) -> torch.Tensor:
    a_PR, b_QR = dequant_blocks_t(at_PR, sa_BP), dequant_blocks_t(bt_QR, sb_BQ)
    ends = [0] + offs_E.tolist()
    return torch.stack([a_PR[:, r0:r1] @ b_QR[:, r0:r1].t() for r0, r1 in zip(ends[:-1], ends[1:])]).to(out_dtype)


def grouped_wgrad_fp8(at_PR: torch.Tensor, sa_BP: torch.Tensor, bt_QR: torch.Tensor, sb_BQ: torch.Tensor,
                      offs_E: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16, config: str = DEFAULT) -> torch.Tensor:
    """dw_EPQ = per expert Σ over its rows of a[r]ᵀ b[r] (module docstring). at, bt: e4m3 [P, R'] and [Q, R'] with
    unit stride along the rows (R' >= offs_E[-1], as ``quant_blocks_t`` writes them); sa, sb: their scales
    [ceil(R' / 128), P] and [.., Q]; offs_E: int32 cumulative row counts; ``config``: a tile of ``CONFIGS``."""
    P, Q, E = at_PR.shape[0], bt_QR.shape[0], offs_E.numel()
    if not _use_triton(at_PR, offs_E) or at_PR.stride(1) != 1 or bt_QR.stride(1) != 1:
        return grouped_wgrad_fp8_torch(at_PR, sa_BP, bt_QR, sb_BQ, offs_E, out_dtype)
    out = torch.empty(E, P, Q, dtype=out_dtype, device=at_PR.device)
    BP, BQ, stages, warps = CONFIGS[config]
    tiles_q = triton.cdiv(Q, BQ)
    tiles_pq = triton.cdiv(P, BP) * tiles_q
    if E and P and Q:
        _wgrad_fp8_kernel[(E * tiles_pq,)](at_PR, sa_BP, bt_QR, sb_BQ, out, offs_E, P, Q, at_PR.stride(0),
                                           bt_QR.stride(0), tiles_q, tiles_pq, BLOCK_P=BP, BLOCK_Q=BQ, BLOCK_R=BLOCK,
                                           NUM_STAGES=stages, num_warps=warps)
    return out
