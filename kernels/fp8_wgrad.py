"""The experts' weight gradients in FP8 (Hopper): operands transposed in e4m3, each expert's rows starting on a
128-row block, and the GEMM that contracts each expert's rows.

    quant_expert_blocks_t(x_RC, offs_E, scales="block") -> (q_CA e4m3, s, aoffs_E int32)
        x's rows, expert by expert (offs_E: cumulative row counts), transposed, each expert's rows starting at a
        multiple of 128 (A = capacity(R, E): R + E · 127, rounded up to 128, a fixed size) and padded with zero
        rows to the next multiple; aoffs_E the aligned cumulative row ends. Power-of-two scales (|x| / s <= 448):
        "block", s [A / 128, C], one per column of each 128-row block, found by the pass that casts the block
        (each program reads 128 of an expert's rows × a block of columns, takes their column amax, writes the tile
        transposed); "expert", s [E, C], one per column of each expert's rows: an amax pass (atomic max), then
        the cast pass.
    grouped_wgrad_fp8(at_PA, sa, bt_QA, sb, aoffs_E, scales="block") -> dw_EPQ (bf16)
        dw[e] = Σ over expert e's rows of a[r]ᵀ b[r], a and b dequantised: the weight gradient [da | db]ᵀ x or
        dyᵀ h of every expert. "block": each block's product times its two scales is added to an fp32
        accumulator (the MMA restarts every 128 rows); "expert": the MMA accumulates over all of the expert's rows
        and the epilogue scales.

Why this layout: Hopper's FP8 MMA reads both operands along the reduction dimension, here the token rows, which
every producer writes row by row (a Triton GEMM handed row-major e4m3 operands runs at 0.08-0.15x its K-major
rate: benchmarks/fp8_operand_layout.py). Block scales are what a kernel producing 128 rows at a time can compute on
its own, so a producer could write these operands in the pass that makes the rows; per-expert scales keep the
GEMM's MMA running but need every row's amax first. With each expert's rows on whole blocks the GEMM's loads need
no mask along the rows (masked, they ran ~8x slower). An expert without rows gets zeros. No host read
(capturable).

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
    def _quant_expert_t_kernel(x_ptr, q_ptr, s_ptr, offs_ptr, E, C, A, stride_x, MODE: tl.constexpr,
                               E_POW2: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """One aligned 128-row block of an expert's rows × BLOCK_C columns. MODE 0: its own scale per column
        (s [A / 128, C]) and the block in e4m3; 1: the column amax folded into the expert's (s [E, C], atomic max);
        2: the block in e4m3 with the expert's column scales s [E, C]."""
        rb = tl.program_id(0)
        ar = tl.arange(0, E_POW2)
        real = ar < E
        ends = tl.load(offs_ptr + ar, mask=real, other=0).to(tl.int32)
        starts = tl.load(offs_ptr + ar - 1, mask=(ar >= 1) & real, other=0).to(tl.int32)
        blocks = tl.where(real, tl.cdiv(ends - starts, BLOCK_R), 0)
        cum = tl.cumsum(blocks, 0)
        if rb < tl.sum(blocks, 0):
            e = tl.sum((cum <= rb).to(tl.int32), 0)
            here = ar == e
            src0 = tl.sum(tl.where(here, starts, 0), 0) + (rb - tl.sum(tl.where(here, cum - blocks, 0), 0)) * BLOCK_R
            end = tl.sum(tl.where(here, ends, 0), 0)
            r = src0 + tl.arange(0, BLOCK_R)
            c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
            col_ok = c < C
            x = tl.load(x_ptr + r[:, None].to(tl.int64) * stride_x + c[None, :],
                        mask=(r < end)[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            if MODE == 1:
                tl.atomic_max(s_ptr + e * C + c, tl.max(tl.abs(x), 0), mask=col_ok)
            else:
                if MODE == 0:
                    s = _pow2_scale(tl.max(tl.abs(x), 0))
                    tl.store(s_ptr + rb * C + c, s, mask=col_ok)
                else:
                    s = tl.load(s_ptr + e * C + c, mask=col_ok, other=1.0)
                q = (x / s[None, :]).to(tl.float8e4nv).to(tl.uint8, bitcast=True)  # q: the e4m3 copy's bytes
                rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
                tl.store(q_ptr + c[:, None].to(tl.int64) * A + rows[None, :], tl.trans(q), mask=col_ok[:, None])

    @triton.jit
    def _wgrad_fp8_kernel(at_ptr, sa_ptr, bt_ptr, sb_ptr, out_ptr, offs_ptr, P, Q, stride_a, stride_b, tiles_q,
                          tiles_pq, PER_BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr,
                          BLOCK_R: tl.constexpr, NUM_STAGES: tl.constexpr):
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
        for kb in tl.range(r0 // BLOCK_R, r1 // BLOCK_R, num_stages=NUM_STAGES):
            k = kb * BLOCK_R + kr  # all the expert's rows (or zero padding): no mask along them
            a = tl.load(at_ptr + p[:, None].to(tl.int64) * stride_a + k[None, :], mask=p_ok[:, None], other=0.0)
            b = tl.load(bt_ptr + k[:, None] + q[None, :].to(tl.int64) * stride_b, mask=q_ok[None, :], other=0.0)
            if PER_BLOCK:  # each block's product times its two scales, summed in fp32
                s_a = tl.load(sa_ptr + kb * P + p, mask=p_ok, other=0.0)
                s_b = tl.load(sb_ptr + kb * Q + q, mask=q_ok, other=0.0)
                acc += tl.dot(a, b) * s_a[:, None] * s_b[None, :]  # b: [rows, Q], contiguous along the rows
            else:  # one scale per expert and column: the MMA accumulates, the epilogue scales
                acc = tl.dot(a, b, acc)
        if not PER_BLOCK:
            acc = acc * tl.load(sa_ptr + e * P + p, mask=p_ok, other=0.0)[:, None] \
                * tl.load(sb_ptr + e * Q + q, mask=q_ok, other=0.0)[None, :]
        out = out_ptr + e.to(tl.int64) * P * Q + p[:, None].to(tl.int64) * Q + q[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=p_ok[:, None] & q_ok[None, :])


def capacity(R: int, E: int) -> int:
    """Rows of the aligned layout for R rows over E experts: each expert's rows padded to a multiple of 128."""
    return -(-(R + E * (BLOCK - 1)) // BLOCK) * BLOCK


def aligned_offsets(offs_E: torch.Tensor) -> torch.Tensor:
    """The aligned layout's cumulative row ends (int32, on the device)."""
    counts = torch.diff(offs_E, prepend=offs_E.new_zeros(1))
    return (torch.cumsum((counts + BLOCK - 1) // BLOCK, 0) * BLOCK).to(torch.int32)


SCALES = ("block", "expert")  # one scale per 128-row block of a column, or per expert and column


def _expert_rows(aoffs_E: torch.Tensor, A: int) -> torch.Tensor:
    """The expert of each aligned row, -1 past the last (host read: the torch reference's)."""
    e_A = torch.full((A,), -1, dtype=torch.long)
    for e, (a0, a1) in enumerate(zip([0] + aoffs_E.tolist()[:-1], aoffs_E.tolist())):
        e_A[a0:a1] = e
    return e_A


def quant_expert_blocks_t_torch(x_RC: torch.Tensor, offs_E: torch.Tensor, scales: str = "block"):
    R, C = x_RC.shape
    E = offs_E.numel()
    A = capacity(R, E)
    x = x_RC.new_zeros(A, C, dtype=torch.float32)
    aoffs = aligned_offsets(offs_E)
    for r0, r1, a0 in zip([0] + offs_E.tolist()[:-1], offs_E.tolist(), [0] + aoffs.tolist()[:-1]):
        x[a0:a0 + r1 - r0] = x_RC[r0:r1].float()
    if scales == "block":
        s = pow2_scale(x.view(A // BLOCK, BLOCK, C).abs().amax(1))
        s_AC = s.repeat_interleave(BLOCK, 0)
    else:
        e_A = _expert_rows(aoffs, A)
        ends = aoffs.tolist()
        s = pow2_scale(torch.stack([x[a0:a1].abs().amax(0) if a1 > a0 else x.new_zeros(C)
                                    for a0, a1 in zip([0] + ends[:-1], ends)]))
        s_AC = torch.where((e_A >= 0)[:, None], s[e_A.clamp(min=0)], 1.0)
    q = (x / s_AC).to(FP8)
    return q.t().contiguous(), s, aoffs


def quant_expert_blocks_t(x_RC: torch.Tensor, offs_E: torch.Tensor, scales: str = "block"):
    """(q_CA, s, aoffs_E): x's rows expert by expert, transposed in e4m3, each expert on whole 128-row blocks,
    with one power-of-two scale per block of a column (``scales="block"``, s [A / 128, C]: one pass) or per
    expert and column (``"expert"``, s [E, C]: an amax pass, then the cast pass). Blocks past the last expert's
    are left unwritten (no GEMM reads them)."""
    if scales not in SCALES:
        raise ValueError(f"quant_expert_blocks_t: scales {scales!r} is not one of {SCALES}")
    if not _on_kernels(x_RC):
        return quant_expert_blocks_t_torch(x_RC, offs_E, scales)
    R, C = x_RC.shape
    E = offs_E.numel()
    A = capacity(R, E)
    q_CA = torch.empty(C, A, dtype=FP8, device=x_RC.device)
    s = torch.empty(A // BLOCK, C, dtype=torch.float32, device=x_RC.device) if scales == "block" else \
        torch.zeros(E, C, dtype=torch.float32, device=x_RC.device)
    if A and C:
        x_RC = x_RC if x_RC.stride(1) == 1 else x_RC.contiguous()
        BLOCK_C = 64

        def launch(mode: int, s_: torch.Tensor) -> None:
            _quant_expert_t_kernel[(A // BLOCK, triton.cdiv(C, BLOCK_C))](
                x_RC, q_CA.view(torch.uint8), s_, offs_E, E, C, A, x_RC.stride(0), MODE=mode,
                E_POW2=triton.next_power_of_2(E), BLOCK_R=BLOCK, BLOCK_C=BLOCK_C, num_warps=4)

        if scales == "block":
            launch(0, s)
        else:
            launch(1, s)  # s holds the experts' column amax, then their scales
            s = pow2_scale(s)
            launch(2, s)
    return q_CA, s, aligned_offsets(offs_E)


def dequant_t(q_XA: torch.Tensor, s: torch.Tensor, aoffs_E: torch.Tensor, scales: str = "block") -> torch.Tensor:
    """fp32 [X, A]: q times its scale (exact); rows past the experts' zero (torch reference)."""
    A = q_XA.shape[1]
    e_A = _expert_rows(aoffs_E, A)
    s_AX = s.repeat_interleave(BLOCK, 0)[:A] if scales == "block" else s[e_A.clamp(min=0)]
    return torch.where((e_A >= 0)[None, :], q_XA.float() * s_AX.t(), 0.0)


def grouped_wgrad_fp8_torch(at_PA, sa, bt_QA, sb, aoffs_E, scales="block", out_dtype=torch.bfloat16):
    a_PA, b_QA = dequant_t(at_PA, sa, aoffs_E, scales), dequant_t(bt_QA, sb, aoffs_E, scales)
    ends = [0] + aoffs_E.tolist()
    return torch.stack([a_PA[:, r0:r1] @ b_QA[:, r0:r1].t() for r0, r1 in zip(ends[:-1], ends[1:])]).to(out_dtype)


def grouped_wgrad_fp8(at_PA: torch.Tensor, sa: torch.Tensor, bt_QA: torch.Tensor, sb: torch.Tensor,
                      aoffs_E: torch.Tensor, scales: str = "block", out_dtype: torch.dtype = torch.bfloat16,
                      config: str = DEFAULT) -> torch.Tensor:
    """dw_EPQ = per expert Σ over its rows of a[r]ᵀ b[r] (module docstring). at, bt: e4m3 [P, A] and [Q, A] with
    unit stride along the rows, and their scales (``scales``: "block", [A / 128, P] and [A / 128, Q]; "expert",
    [E, P] and [E, Q]), as ``quant_expert_blocks_t`` writes them; aoffs_E: the aligned cumulative row ends
    (multiples of 128); ``config``: a tile of ``CONFIGS``."""
    P, Q, E = at_PA.shape[0], bt_QA.shape[0], aoffs_E.numel()
    if not _use_triton(at_PA, aoffs_E) or at_PA.stride(1) != 1 or bt_QA.stride(1) != 1:
        return grouped_wgrad_fp8_torch(at_PA, sa, bt_QA, sb, aoffs_E, scales, out_dtype)
    out = torch.empty(E, P, Q, dtype=out_dtype, device=at_PA.device)
    BP, BQ, stages, warps = CONFIGS[config]
    tiles_q = triton.cdiv(Q, BQ)
    tiles_pq = triton.cdiv(P, BP) * tiles_q
    if E and P and Q:
        _wgrad_fp8_kernel[(E * tiles_pq,)](at_PA, sa, bt_QA, sb, out, aoffs_E, P, Q, at_PA.stride(0), bt_QA.stride(0),
                                           tiles_q, tiles_pq, PER_BLOCK=scales == "block", BLOCK_P=BP, BLOCK_Q=BQ,
                                           BLOCK_R=BLOCK, NUM_STAGES=stages, num_warps=warps)
    return out
