"""The experts' weight gradients in FP8 (Hopper): the operands transposed in e4m3, each expert's rows starting on a
128-row block, and the GEMM that contracts each expert's rows.

    expert_scales(q_RC, s_R, offs_E) -> s_E
        one power-of-two scale per expert for rows already in e4m3 with a power-of-two scale each (x ≈ q · s, as
        ``quant_rows`` writes them; offs_E: the experts' cumulative row counts): the largest of its nonzero rows'
        scales, 0 for an expert without a nonzero row. A zero row's scale (1) is not counted: a gradient row that
        is zero (an ignored token) would otherwise push a whole expert's small values under e4m3's range.
    requant_expert_t(q_RC, s_R, offs_E) -> (qt_CA e4m3, s_E, aoffs_E int32)
        the rows expert by expert, transposed, each expert's rows starting at a multiple of 128 (A =
        capacity(R, E): R + E · 127 rounded up to 128, a fixed size) and padded with zeros to the next, at the
        expert's scale: q · s_r / s_e, a power-of-two shift, exact unless it lands under e4m3's normal range.
        aoffs_E: the aligned cumulative row ends.
    grouped_wgrad_fp8(at_PA, sa_E, bt_QA, sb_E, aoffs_E) -> dw_EPQ
        dw[e] = Σ over expert e's rows of a[r]ᵀ b[r] · sa[e] · sb[e]: the weight gradient [da | db]ᵀ x or dyᵀ h
        of every expert; the MMA accumulates over the expert's rows, the epilogue scales.

Why this layout: Hopper's FP8 MMA reads both operands along the reduction dimension, here the token rows, which
every producer writes row by row (a Triton GEMM handed row-major e4m3 operands runs at 0.08-0.15x its K-major
rate: benchmarks/fp8_operand_layout.py). The experts already hold every operand in e4m3 rows with their scales
(their forward and input-gradient GEMMs read them), so the transposed copy is made from those 1-byte rows, not
from bf16. One scale per expert keeps the MMA running through the expert's rows (a scale per 128-row block, the
products scaled into fp32 block by block, ran at 0.65-0.8x bf16's grouped GEMM). With each expert's rows on whole
blocks the GEMM's loads need no mask along the rows (masked, they ran ~8x slower). An expert without rows gets
zeros. The GEMM runs one program an SM, each walking (expert, P block, Q block) tiles a grid stride apart with its
operands through TMA: 1.2x one program a tile reading through pointers. No host read (capturable).

Triton on CUDA; the GEMM also under TRITON_INTERPRET=1 (its input is FP8 already); torch elsewhere (the reference).
"""

import torch

from .fp8 import FP8, _on_kernels
from .moe_rows import _use_triton, triton

BLOCK = 128  # the aligned layout's row block, the GEMM's reduction step
CONFIGS = {  # the GEMM's (BLOCK_P, BLOCK_Q, num_stages, num_warps, persistent, flatten). persistent: one program
    # an SM walking the tiles (expert, P block, Q block) a grid stride apart, its operands through TMA; flatten:
    # its tile and row loops one software pipeline, so a tile's first loads overlap the previous tile's epilogue
    "128x256": (128, 256, 3, 8, False, False),
    "128x128": (128, 128, 4, 8, False, False),
    "128x256p": (128, 256, 3, 8, True, False),
    "128x256pf": (128, 256, 3, 8, True, True),
    "128x128pf": (128, 128, 4, 8, True, True),
    "tiny": (16, 16, 1, 4, False, False),  # for the CPU interpreter
    "tinyp": (16, 16, 2, 4, True, False),
}
DEFAULT = "128x256p"  # 1.21x the 128x256 tile's non-persistent form over the experts' shapes on H200, fastest or
# within 3% of it at each (grouped_gemm_fp8.py --wgrad-only)
REQUANT_TILES = {  # the requantiser's (BLOCK_C, ROW_BLOCKS, COL_TILES, num_warps): a program's row blocks and columns
    "c128": (128, 1, 1, 4),
    "c128_w8": (128, 1, 1, 8),
    "c64": (64, 1, 1, 4),
    "c256_w8": (256, 1, 1, 8),
    "c128_r4": (128, 4, 1, 4),
    "c128_r4_w8": (128, 4, 1, 8),
    "c128_t4": (128, 1, 4, 4),
    "c256_r2_w8": (256, 2, 1, 8),
}
REQUANT_DEFAULT = "c128"
SCALE_TILES = {  # the scale kernel's (BLOCK_R, BLOCK_C, programs an expert at least, num_warps): more where an even
    # share of the rows spans more blocks (a program a block: one expert of 16384 rows, a dense layer's, takes 64, not
    # 8 programs each walking 8 blocks one after the other), at most 1024 in all
    "r256_c64_s8": (256, 64, 8, 8),
    "r256_c128_s8": (256, 128, 8, 8),
    "r128_c128_s16": (128, 128, 16, 8),
    "r128_c64_s16": (128, 64, 16, 4),
    "r64_c128_s16": (64, 128, 16, 4),
}
SCALE_DEFAULT = "r256_c64_s8"  # fastest or within 1% at 64 experts, 7% off the fastest at 32 (fp8_requant)

if triton is not None:
    import triton.language as tl

    from .expert_tiles import expert_ranges, find_expert, pick

    @triton.jit
    def _expert_scale_kernel(qb_ptr, s_ptr, se_ptr, aoffs_ptr, offs_ptr, E, C, stride_q, E_POW2: tl.constexpr,
                             BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ALIGN: tl.constexpr):
        """Expert program_id(0)'s largest nonzero-row scale over every num_programs(1)-th BLOCK_R rows from
        program_id(1) on, folded into se (atomic max); program (e, 0) also writes the expert's aligned row end.
        A row's bytes (qb: e4m3 as uint8) are read only where its scale is 1 (the scale a zero row gets), to tell
        a zero row (every byte ±0) from one whose scale is 1."""
        e = tl.program_id(0)
        split = tl.num_programs(1)
        r0 = tl.load(offs_ptr + e - 1, mask=e > 0, other=0).to(tl.int32)
        r1 = tl.load(offs_ptr + e).to(tl.int32)
        best = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for start in range(r0 + tl.program_id(1) * BLOCK_R, r1, split * BLOCK_R):
            r = start + tl.arange(0, BLOCK_R)
            ok = r < r1
            s = tl.load(s_ptr + r, mask=ok, other=0.0)
            maybe_zero = ok & (s == 1.0)
            if tl.sum(maybe_zero.to(tl.int32), 0) > 0:
                nonzero = tl.zeros((BLOCK_R,), dtype=tl.int32)
                for c0 in range(0, C, BLOCK_C):
                    c = c0 + tl.arange(0, BLOCK_C)
                    q = tl.load(qb_ptr + r[:, None].to(tl.int64) * stride_q + c[None, :],
                                mask=maybe_zero[:, None] & (c < C)[None, :], other=0)
                    mag = q & tl.full((BLOCK_R, BLOCK_C), 0x7F, tl.uint8)  # the magnitude bits: 0 only for ±0
                    nonzero = tl.maximum(nonzero, tl.max(mag, 1))
                s = tl.where(maybe_zero & (nonzero == 0), 0.0, s)
            best = tl.maximum(best, s)
        tl.atomic_max(se_ptr + e, tl.max(best, 0))
        if tl.program_id(1) == 0:
            lanes, starts, ends = expert_ranges(offs_ptr, E, E_POW2)
            blocks = tl.where(lanes <= e, tl.cdiv(ends - starts, ALIGN), 0)
            tl.store(aoffs_ptr + e, tl.sum(blocks, 0) * ALIGN)

    @triton.jit
    def _requant_t_kernel(q_ptr, s_ptr, se_ptr, out_ptr, offs_ptr, E, C, A, stride_q, E_POW2: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ROW_BLOCKS: tl.constexpr,
                          COL_TILES: tl.constexpr, ZERO_TAIL: tl.constexpr):
        """ROW_BLOCKS aligned 128-row blocks × COL_TILES · BLOCK_C columns: each block's rows (of one expert)
        rescaled to the expert's scale and written transposed (zeros past the expert's rows). The experts' ranges
        are read once per program. ZERO_TAIL: blocks past the last expert's are written as zeros (else left
        unwritten)."""
        ar, starts, ends = expert_ranges(offs_ptr, E, E_POW2)
        blocks = tl.cdiv(ends - starts, BLOCK_R)
        cum = tl.cumsum(blocks, 0)
        used = tl.sum(blocks, 0)
        for j in range(ROW_BLOCKS):
            rb = tl.program_id(0) * ROW_BLOCKS + j
            if rb < used:
                e, first = find_expert(rb, cum, blocks, ar)
                src0 = pick(starts, ar, e) + (rb - first) * BLOCK_R
                end = pick(ends, ar, e)
                r = src0 + tl.arange(0, BLOCK_R)
                s_e = tl.load(se_ptr + e)
                s_r = tl.load(s_ptr + r, mask=r < end, other=0.0)
                shift = tl.where(s_r <= s_e, s_r / tl.where(s_e > 0, s_e, 1.0), 0.0)  # s_r > s_e: a zero row's
                rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
                for t in range(COL_TILES):
                    c = (tl.program_id(1) * COL_TILES + t) * BLOCK_C + tl.arange(0, BLOCK_C)
                    col_ok = c < C
                    x = tl.load(q_ptr + r[:, None].to(tl.int64) * stride_q + c[None, :],
                                mask=(r < end)[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
                    q = (x * shift[:, None]).to(tl.float8e4nv).to(tl.uint8, bitcast=True)  # the e4m3 copy's bytes
                    tl.store(out_ptr + c[:, None].to(tl.int64) * A + rows[None, :], tl.trans(q), mask=col_ok[:, None])
            elif ZERO_TAIL:
                rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
                for t in range(COL_TILES):
                    c = (tl.program_id(1) * COL_TILES + t) * BLOCK_C + tl.arange(0, BLOCK_C)
                    tl.store(out_ptr + c[:, None].to(tl.int64) * A + rows[None, :],
                             tl.zeros((BLOCK_C, BLOCK_R), dtype=tl.uint8), mask=(c < C)[:, None] & (rows < A)[None, :])

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
        for kb in tl.range(r0 // BLOCK_R, r1 // BLOCK_R, num_stages=NUM_STAGES):
            k = kb * BLOCK_R + kr  # all the expert's rows (or zero padding): no mask along them
            a = tl.load(at_ptr + p[:, None].to(tl.int64) * stride_a + k[None, :], mask=p_ok[:, None], other=0.0)
            b = tl.load(bt_ptr + k[:, None] + q[None, :].to(tl.int64) * stride_b, mask=q_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc)  # b: [rows, Q], contiguous along the rows
        acc = acc * (tl.load(sa_ptr + e) * tl.load(sb_ptr + e))
        out = out_ptr + e.to(tl.int64) * P * Q + p[:, None].to(tl.int64) * Q + q[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=p_ok[:, None] & q_ok[None, :])

    @triton.jit
    def _wgrad_fp8_tma_kernel(a_desc, sa_ptr, b_desc, sb_ptr, out_ptr, offs_ptr, P, Q, tiles_q, tiles_pq, total,
                              BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr,
                              NUM_PROGRAMS: tl.constexpr, NUM_STAGES: tl.constexpr, FLATTEN: tl.constexpr):
        """The persistent form: tile i = (expert, P block, Q block) in that order, program j takes i = j, j +
        NUM_PROGRAMS, ...; TMA reads past P or Q as zeros (its descriptors' bounds), the store masks them."""
        for tile in tl.range(tl.program_id(0), total, NUM_PROGRAMS, flatten=FLATTEN):
            e = tile // tiles_pq
            t = tile % tiles_pq
            p0 = (t // tiles_q) * BLOCK_P
            q0 = (t % tiles_q) * BLOCK_Q
            r0 = tl.load(offs_ptr + e - 1, mask=e > 0, other=0).to(tl.int32)
            r1 = tl.load(offs_ptr + e).to(tl.int32)
            acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
            for k in tl.range(r0, r1, BLOCK_R, num_stages=NUM_STAGES):
                a = a_desc.load([p0, k])
                b = b_desc.load([q0, k])
                acc = tl.dot(a, b.T, acc)
            acc = acc * (tl.load(sa_ptr + e) * tl.load(sb_ptr + e))
            p = p0 + tl.arange(0, BLOCK_P)
            q = q0 + tl.arange(0, BLOCK_Q)
            out = out_ptr + e.to(tl.int64) * P * Q + p[:, None].to(tl.int64) * Q + q[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(p < P)[:, None] & (q < Q)[None, :])


def capacity(R: int, E: int) -> int:
    """Rows of the aligned layout for R rows over E experts: each expert's rows padded to a multiple of 128. The
    padded total is a multiple of 128 of at most R + E · 127, so at most this (exactly the rows' with one expert)."""
    return (R + E * (BLOCK - 1)) // BLOCK * BLOCK


def aligned_offsets(offs_E: torch.Tensor) -> torch.Tensor:
    """The aligned layout's cumulative row ends (int32, on the device; torch: the kernel path writes them beside
    the scales)."""
    counts = torch.diff(offs_E, prepend=offs_E.new_zeros(1))
    return (torch.cumsum((counts + BLOCK - 1) // BLOCK, 0) * BLOCK).to(torch.int32)


def _ranges(offs_E: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each expert's rows (host read: the torch references')."""
    ends = offs_E.tolist()
    return list(zip([0] + ends[:-1], ends))


def expert_scales_torch(q_RC: torch.Tensor, s_R: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    nonzero = (s_R != 1) | (q_RC.float() != 0).any(1)
    return torch.stack([s_R[r0:r1][nonzero[r0:r1]].max() if nonzero[r0:r1].any() else s_R.new_zeros(())
                        for r0, r1 in _ranges(offs_E)]) if offs_E.numel() else s_R.new_zeros(0)


def _scales_and_offsets(q_RC: torch.Tensor, s_R: torch.Tensor, offs_E: torch.Tensor, tile: str = SCALE_DEFAULT):
    """(s_E fp32, aoffs_E int32) by one kernel: each expert's scale and its aligned row end. tile: a name in
    SCALE_TILES."""
    R, C = q_RC.shape
    E = offs_E.numel()
    s_E = torch.zeros(E, dtype=torch.float32, device=q_RC.device)
    aoffs_E = torch.empty(E, dtype=torch.int32, device=q_RC.device)
    if E:
        block_r, block_c, least, warps = SCALE_TILES[tile]
        split = max(1, min(1024 // E, max(least, triton.cdiv(R, E * block_r))))  # programs an expert
        _expert_scale_kernel[(E, split)](q_RC.view(torch.uint8), s_R, s_E, aoffs_E, offs_E, E, C, q_RC.stride(0),
                                         E_POW2=triton.next_power_of_2(E), BLOCK_R=block_r, BLOCK_C=block_c,
                                         ALIGN=BLOCK, num_warps=warps)
    return s_E, aoffs_E


def expert_scales(q_RC: torch.Tensor, s_R: torch.Tensor, offs_E: torch.Tensor, tile: str = SCALE_DEFAULT):
    """s_E fp32: each expert's scale (module docstring); rows past offs_E[-1] are not read. tile: a name in
    SCALE_TILES."""
    if not _on_kernels(q_RC):
        return expert_scales_torch(q_RC, s_R, offs_E)
    return _scales_and_offsets(q_RC if q_RC.stride(1) == 1 else q_RC.contiguous(), s_R, offs_E, tile)[0]


def requant_expert_t_torch(q_RC: torch.Tensor, s_R: torch.Tensor, offs_E: torch.Tensor):
    R, C = q_RC.shape
    E = offs_E.numel()
    A = capacity(R, E)
    s_E = expert_scales_torch(q_RC, s_R, offs_E)
    aoffs = aligned_offsets(offs_E)
    x = torch.zeros(A, C, dtype=torch.float32)
    for e, ((r0, r1), a0) in enumerate(zip(_ranges(offs_E), [0] + aoffs.tolist()[:-1])):
        s_r = s_R[r0:r1]
        shift = torch.where(s_r <= s_E[e], s_r / s_E[e].clamp(min=1e-38), 0.0)  # a larger s_r: a zero row's
        x[a0:a0 + r1 - r0] = q_RC[r0:r1].float() * shift[:, None]
    return x.to(FP8).t().contiguous(), s_E, aoffs


def requant_expert_t(q_RC: torch.Tensor, s_R: torch.Tensor, offs_E: torch.Tensor, tile: str = REQUANT_DEFAULT):
    """(qt_CA, s_E, aoffs_E): e4m3 rows q_RC [R, C] with their scales s_R, expert by expert, transposed onto whole
    128-row blocks at one scale per expert (module docstring). Blocks past the last expert's are left unwritten
    (no grouped GEMM reads them), except with one expert: zeros there, as its plain GEMM reads every block.
    tile: a name in REQUANT_TILES."""
    if not _on_kernels(q_RC):
        return requant_expert_t_torch(q_RC, s_R, offs_E)
    R, C = q_RC.shape
    E = offs_E.numel()
    A = capacity(R, E)
    q_RC = q_RC if q_RC.stride(1) == 1 else q_RC.contiguous()
    s_E, aoffs_E = _scales_and_offsets(q_RC, s_R, offs_E)
    qt_CA = torch.empty(C, A, dtype=FP8, device=q_RC.device)
    if A and C:
        block_c, row_blocks, col_tiles, warps = REQUANT_TILES[tile]
        grid = (triton.cdiv(A // BLOCK, row_blocks), triton.cdiv(C, block_c * col_tiles))
        _requant_t_kernel[grid](q_RC, s_R, s_E, qt_CA.view(torch.uint8), offs_E, E, C, A, q_RC.stride(0),
                                E_POW2=triton.next_power_of_2(E), BLOCK_R=BLOCK, BLOCK_C=block_c,
                                ROW_BLOCKS=row_blocks, COL_TILES=col_tiles, ZERO_TAIL=E == 1, num_warps=warps)
    return qt_CA, s_E, aoffs_E


def dequant_t(q_XA: torch.Tensor, s_E: torch.Tensor, aoffs_E: torch.Tensor) -> torch.Tensor:
    """fp32 [X, A]: q times its expert's scale (exact); rows past the experts' zero (torch reference)."""
    s_A = torch.zeros(q_XA.shape[1])
    for e, (a0, a1) in enumerate(_ranges(aoffs_E)):
        s_A[a0:a1] = s_E[e]
    return q_XA.float() * s_A[None, :]


def grouped_wgrad_fp8_torch(at_PA, sa_E, bt_QA, sb_E, aoffs_E, out_dtype=torch.bfloat16):
    a_PA, b_QA = dequant_t(at_PA, sa_E, aoffs_E), dequant_t(bt_QA, sb_E, aoffs_E)
    return torch.stack([a_PA[:, r0:r1] @ b_QA[:, r0:r1].t() for r0, r1 in _ranges(aoffs_E)]).to(out_dtype)


def grouped_wgrad_fp8(at_PA: torch.Tensor, sa_E: torch.Tensor, bt_QA: torch.Tensor, sb_E: torch.Tensor,
                      aoffs_E: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                      config: str = DEFAULT) -> torch.Tensor:
    """dw_EPQ = per expert Σ over its rows of a[r]ᵀ b[r] · sa[e] · sb[e] (module docstring). at, bt: e4m3 [P, A]
    and [Q, A] with unit stride along the rows, and their experts' scales, as ``requant_expert_t`` writes them;
    aoffs_E: the aligned cumulative row ends (multiples of 128); ``config``: a tile of ``CONFIGS``."""
    P, Q, E = at_PA.shape[0], bt_QA.shape[0], aoffs_E.numel()
    if not _use_triton(at_PA, aoffs_E):
        return grouped_wgrad_fp8_torch(at_PA, sa_E, bt_QA, sb_E, aoffs_E, out_dtype)
    at_PA, bt_QA = (t if t.stride(1) == 1 else t.contiguous() for t in (at_PA, bt_QA))  # the kernel's row stride 1
    if E == 1 and at_PA.is_cuda:  # one expert: one plain GEMM over all A rows (zeros past its rows, as written)
        return torch._scaled_mm(at_PA, bt_QA.t(), scale_a=sa_E, scale_b=sb_E, out_dtype=out_dtype,
                                use_fast_accum=True)[None]
    out = torch.empty(E, P, Q, dtype=out_dtype, device=at_PA.device)
    BP, BQ, stages, warps, persistent, flatten = CONFIGS[config]
    tiles_q = triton.cdiv(Q, BQ)
    tiles_pq = triton.cdiv(P, BP) * tiles_q
    if E and P and Q and persistent:
        from triton.tools.tensor_descriptor import TensorDescriptor  # Triton's host-side TMA descriptor

        a_desc = TensorDescriptor.from_tensor(at_PA, [BP, BLOCK])
        b_desc = TensorDescriptor.from_tensor(bt_QA, [BQ, BLOCK])
        programs = torch.cuda.get_device_properties(at_PA.device).multi_processor_count if at_PA.is_cuda else 3
        _wgrad_fp8_tma_kernel[(programs,)](a_desc, sa_E, b_desc, sb_E, out, aoffs_E, P, Q, tiles_q, tiles_pq,
                                           E * tiles_pq, BLOCK_P=BP, BLOCK_Q=BQ, BLOCK_R=BLOCK, NUM_PROGRAMS=programs,
                                           NUM_STAGES=stages, FLATTEN=flatten, num_warps=warps)
    elif E and P and Q:
        _wgrad_fp8_kernel[(E * tiles_pq,)](at_PA, sa_E, bt_QA, sb_E, out, aoffs_E, P, Q, at_PA.stride(0),
                                           bt_QA.stride(0), tiles_q, tiles_pq, BLOCK_P=BP, BLOCK_Q=BQ, BLOCK_R=BLOCK,
                                           NUM_STAGES=stages, num_warps=warps)
    return out
