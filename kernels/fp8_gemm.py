"""A row-grouped FP8 GEMM for the experts (Hopper): one persistent Triton kernel over every expert's tiles.

    grouped_mm_fp8(a_MK, s_M, b_ENK, s_EN, offs_E) -> c_MN (bf16)
    c[r] = (a[r] · s[r]) @ (b[e] · s_b[e])ᵀ   for the rows r of expert e: offs_E[e-1] <= r < offs_E[e]

a: e4m3 rows grouped by expert (expert-major, any row count per expert, rows at or past offs_E[-1] are skipped
and their c left unspecified); s_M: one fp32 dequantisation scale per row; b: e4m3 weights [E, N, K] (K
contiguous: the layout of the experts' forward copy and of its transpose); s_EN: one fp32 scale per output
channel of each expert (a per-expert scale broadcast over N works too). fp32 accumulation, bf16 out.

Each program walks tiles (expert, row block, column block) in that order, a grid stride apart, finding its tile's
expert from the per-expert tile counts it derives from offs_E in registers: no host read, capturable. A and B
arrive through TMA (a row block reaching into the next expert's rows is read but not stored). The default tiling
flattens the tile loop and the K loop into one software pipeline, so a tile's first loads are in flight during the
previous tile's epilogue: 1.05-1.11x the unflattened loop over the experts' four GEMMs, most where K is short.
"""

import torch

from .moe_rows import triton

CONFIGS = {  # (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps, flatten: one loop over tiles and K blocks, so
    # the next tile's loads are issued during this one's epilogue)
    "128x256": (128, 256, 128, 3, 8, False),
    "128x256s4": (128, 256, 128, 4, 8, False),
    "256x128s4": (256, 128, 128, 4, 8, False),
    "128x128": (128, 128, 128, 4, 8, False),
    "128x256f": (128, 256, 128, 3, 8, True),
    "128x256s4f": (128, 256, 128, 4, 8, True),
    "128x128f": (128, 128, 128, 4, 8, True),
    "tiny": (16, 16, 32, 1, 4, False),  # for the CPU interpreter
    "tinyf": (16, 16, 32, 2, 4, True),
}
DEFAULT = "128x256f"  # the fastest at the experts' shapes on H200 (benchmarks/grouped_gemm_fp8.py)


if triton is not None:
    import triton.language as tl

    from .expert_tiles import expert_ranges, find_expert, pick

    @triton.jit
    def _grouped_fp8_kernel(a_desc, b_desc, c_ptr, sa_ptr, sb_ptr, offs_ptr, E, N, K,
                            E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, NUM_PROGRAMS: tl.constexpr, NUM_STAGES: tl.constexpr,
                            FLATTEN: tl.constexpr):
        ar, starts, ends = expert_ranges(offs_ptr, E, E_POW2)  # lanes past E: empty experts after the last
        counts = ends - starts
        n_blocks = tl.cdiv(N, BLOCK_N)
        tiles = tl.cdiv(counts, BLOCK_M) * n_blocks
        cum = tl.cumsum(tiles, 0)
        total = tl.sum(tiles, 0)
        rows_m = tl.arange(0, BLOCK_M)
        cols_n = tl.arange(0, BLOCK_N)
        for tile in tl.range(tl.program_id(0), total, NUM_PROGRAMS, flatten=FLATTEN):
            e, first = find_expert(tile, cum, tiles, ar)
            row0 = pick(starts, ar, e)
            row_end = pick(ends, ar, e)
            local = tile - first
            pm = local // n_blocks
            pn = local % n_blocks
            r0 = row0 + pm * BLOCK_M
            c0 = pn * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
                a = a_desc.load([r0, k])
                b = b_desc.load([e * N + c0, k])
                acc = tl.dot(a, b.T, acc)
            rows = r0 + rows_m
            cols = c0 + cols_n
            keep_r = rows < row_end
            keep_c = cols < N
            s_a = tl.load(sa_ptr + rows, mask=keep_r, other=0.0)
            s_b = tl.load(sb_ptr + e * N + cols, mask=keep_c, other=0.0)
            out = (acc * s_a[:, None] * s_b[None, :]).to(tl.bfloat16)
            tl.store(c_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], out,
                     mask=keep_r[:, None] & keep_c[None, :])


def grouped_mm_fp8(a_MK: torch.Tensor, s_M: torch.Tensor, b_ENK: torch.Tensor, s_EN: torch.Tensor,
                   offs_E: torch.Tensor, out: torch.Tensor | None = None, config: str = DEFAULT) -> torch.Tensor:
    """c_MN = per expert (a·s_M) @ (b[e]·s_EN[e])ᵀ in bf16 (module docstring); ``out`` [M, N] bf16 written in
    place of a new tensor. K must be a multiple of 16 and a, b contiguous along K."""
    from triton.tools.tensor_descriptor import TensorDescriptor  # Triton's host-side TMA descriptor

    M, K = a_MK.shape
    E, N, K2 = b_ENK.shape
    assert K == K2 and K % 16 == 0 and s_EN.shape == (E, N) and offs_E.numel() == E, (a_MK.shape, b_ENK.shape)
    BM, BN, BK, stages, warps, flatten = CONFIGS[config]
    c = out if out is not None else torch.empty(M, N, dtype=torch.bfloat16, device=a_MK.device)
    if M == 0 or N == 0:
        return c
    a_desc = TensorDescriptor.from_tensor(a_MK, [BM, BK])
    b_desc = TensorDescriptor.from_tensor(b_ENK.reshape(E * N, K), [BN, BK])
    programs = torch.cuda.get_device_properties(a_MK.device).multi_processor_count if a_MK.is_cuda else 3
    _grouped_fp8_kernel[(programs,)](a_desc, b_desc, c, s_M, s_EN.contiguous(), offs_E, E, N, K,
                                     E_POW2=triton.next_power_of_2(E), BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK,
                                     NUM_PROGRAMS=programs, NUM_STAGES=stages, FLATTEN=flatten, num_warps=warps)
    return c
