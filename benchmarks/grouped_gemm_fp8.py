"""The experts' grouped GEMMs on Hopper, bf16 and FP8, by library and scaling: which FP8 grouped GEMM is fastest at
the experts' shapes, and how far each is from a plain GEMM of the same rows.

    python benchmarks/grouped_gemm_fp8.py --shapes 64x768x2048x98304 32x1408x2048x98304

A shape is EXPERTSxHIDDENxDIMxROWS (rows = tokens x top-k, routed ``uniform`` and ``skewed`` as the other benchmarks
route). Each runs the experts' four row-grouped GEMMs: the forward's gate/up (N = 2·hidden, K = dim) and down
(N = dim, K = hidden), and the input gradient's through down (N = hidden, K = dim) and through gate/up (N = dim,
K = 2·hidden). Variants:

    bf16_torch      torch._grouped_mm, rows packed (what expert_precision = "bf16" runs)
    fp8_torch       torch._scaled_grouped_mm, one scale per row and per output channel (what "fp8" runs)
    fp8_triton_<T>  kernels/fp8_gemm.py's persistent grouped kernel, the same scaling, tile T (rows x columns)
    fp8_deepgemm    DeepGEMM's m-grouped FP8 GEMM: one scale per 1x128 block of a row, per 128x128 block of a
                    weight (DeepSeek-V3's scaling); each expert's rows start at a multiple of 128
    bf16_deepgemm   DeepGEMM's m-grouped bf16 GEMM, the same row layout
    fp8_plain       torch._scaled_mm, rowwise scales: every row against one weight (a plain GEMM's rate)
    bf16_plain      torch.mm, the same

With ``--wgrad`` it measures the two weight-gradient GEMMs as well (``wgrad_gate_up``: [da | db]ᵀ x, [2·hidden,
dim] per expert; ``wgrad_down``: dyᵀ h, [dim, hidden] per expert), whose contraction runs over each expert's rows:

    bf16_torch      torch._grouped_mm, 2-D x 2-D with the row offsets (what both precisions run today)
    fp8_torch       torch._scaled_grouped_mm, 2-D x 2-D: both operands e4m3, one scale per expert and column,
                    cast and transposed by torchao's per-group column kernel (its time is ``quant_ms``)
    fp8_triton_<T>  kernels/fp8_wgrad.py: both operands e4m3 and transposed, each expert's rows on whole 128-row
                    blocks at one scale per expert, copied from the e4m3 rows with row scales that the experts' other
                    GEMMs read (``requant_expert_t``, its time is ``quant_ms``); tile T
    fp8_plain / bf16_plain  one GEMM over all rows (K = rows): the rate without the expert boundaries

Each expert's row count is rounded down to a multiple of 16 there (torch's 2-D x 2-D FP8 grouped GEMM needs it).
``with_quant_ms`` adds the casts an FP8 weight gradient needs beyond what the step casts already.

Every time is a CUDA graph's replay (as the step runs). ``tflops`` counts the routed rows only (2·rows·N·K), so the padding DeepGEMM's layout needs is charged to it
(``pad_rows``). Each output is checked against the fp32 product of the bf16 operands (``rel_err``; the run stops
if an FP8 variant is off by more than 8%, bf16 by more than 1%). ``quant_ms`` is what the activation's FP8 cast costs
the producer with this repository's kernels (``kernels/fp8.py``: ``quant_rows`` for row scales, ``quant_blocks`` for
1x128 blocks), ``sf_layout_ms`` what turning the block scales column-major (the layout DeepGEMM reads; it is
not in the timed call) costs. DeepGEMM is used where it imports and a probe GEMM in a child process passes
(``benchmarks/gpu/build_deepgemm.sh`` builds it); otherwise its rows are left out and the log says why.
"""

import argparse
import subprocess
import sys

import torch

from benchmarks.common import environment, graphed, markdown_table, routing_ids, shape_arg, time_ms, write_results
from kernels.fp8 import FP8, quant_blocks, quant_rows
from kernels.fp8_gemm import CONFIGS, grouped_mm_fp8
from kernels.fp8_wgrad import CONFIGS as WGRAD_TILES
from kernels.fp8_wgrad import grouped_wgrad_fp8, requant_expert_t

BLOCK = 128  # DeepGEMM's scaling block and, on Hopper, its row alignment per expert
TRITON_CONFIGS = [name for name in CONFIGS if not name.startswith("tiny")]
WGRAD_CONFIGS = [name for name in WGRAD_TILES if not name.startswith("tiny")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", type=_shape, default=[_shape("64x768x2048x98304")],
                   help="EXPERTSxHIDDENxDIMxROWS, one or more (one results file for all)")
    p.add_argument("--top_k", type=int, default=6, help="experts per token: rows / top_k tokens are routed")
    p.add_argument("--routing", nargs="+", default=["uniform", "skewed"], choices=["uniform", "skewed"])
    p.add_argument("--wgrad", action="store_true", help="the weight-gradient GEMMs too")
    p.add_argument("--wgrad-only", action="store_true", help="only the weight-gradient GEMMs")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        raise SystemExit("grouped_gemm_fp8: needs a Hopper (compute capability 9.0+) GPU")
    dg, why = deepgemm()
    rows = [row for shape in args.shapes for routing in args.routing
            for row in measure(*shape, args.top_k, routing, dg, args.wgrad or args.wgrad_only, args.wgrad_only)]
    cols = ["experts", "hidden", "dim", "rows", "routing", "gemm", "N", "K", "variant", "ms", "tflops",
            "vs_fp8_plain", "vs_bf16_torch", "vs_fp8_torch", "pad_rows", "quant_ms", "with_quant_ms", "sf_layout_ms",
            "rel_err"]
    table = markdown_table(rows, cols)
    if dg is None:
        table += f"\n\nNo DeepGEMM rows: {why}."
    print(table)
    name = "grouped_wgrad_fp8" if args.wgrad_only else "grouped_gemm_fp8_wgrad" if args.wgrad else "grouped_gemm_fp8"
    write_results(name, {**environment(), "deepgemm": getattr(dg, "__version__", None)}, rows, table, args.out)


_shape = shape_arg("EXPERTSxHIDDENxDIMxROWS", "64x768x2048x98304")


def deepgemm():
    """(the ``deep_gemm`` module, None) where it imports and its kernels pass a probe (one small grouped bf16 GEMM,
    compiled and run in a child process first: a crash there must not end this run); else (None, why not)."""
    try:
        import deep_gemm
    except ImportError as e:
        why = f"DeepGEMM does not import ({e})"
    else:
        probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=600)
        if probe.returncode == 0:
            return deep_gemm, None
        died = f"signal {-probe.returncode}" if probe.returncode < 0 else (probe.stderr.strip().splitlines() or ["?"])[-1]
        why = f"DeepGEMM {deep_gemm.__version__} imports but its probe GEMM failed ({died})"
    print(f"grouped_gemm_fp8: {why}; its variants are left out")
    return None, why


PROBE = """
import torch, deep_gemm
a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
b = torch.randn(2, 256, 256, device="cuda", dtype=torch.bfloat16)
d = torch.empty(256, 256, device="cuda", dtype=torch.bfloat16)
layout = torch.arange(256, device="cuda", dtype=torch.int32) // 128
deep_gemm.m_grouped_bf16_gemm_nt_contiguous(a, b, d, layout)
ref = torch.cat([a[:128].float() @ b[0].float().t(), a[128:].float() @ b[1].float().t()])
assert (d.float() - ref).norm() / ref.norm() < 0.01
"""


def measure(E: int, H: int, D: int, R: int, top_k: int, routing: str, dg, wgrad: bool = False,
            wgrad_only: bool = False) -> list[dict]:
    """Every variant of the four grouped GEMMs (six with ``wgrad``, the two alone with ``wgrad_only``) at one shape
    and routing."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = routing_ids(R // top_k, E, top_k, routing, gen, "cuda")
    counts_E = torch.bincount(ids.flatten(), minlength=E).int()
    rows = []
    for gemm, N, K in () if wgrad_only else (("fwd_gate_up", 2 * H, D), ("fwd_down", D, H), ("dgrad_down", H, D),
                                              ("dgrad_gate_up", D, 2 * H)):
        base = dict(experts=E, hidden=H, dim=D, rows=int(counts_E.sum()), routing=routing, gemm=gemm, N=N, K=K)
        rows += [{**base, **r} for r in _gemm_variants(counts_E, N, K, dg)]
    if wgrad:
        counts16_E = counts_E // 16 * 16
        for gemm, P, Q in (("wgrad_gate_up", 2 * H, D), ("wgrad_down", D, H)):
            base = dict(experts=E, hidden=H, dim=D, rows=int(counts16_E.sum()), routing=routing, gemm=gemm, N=P * Q,
                        K="rows")
            rows += [{**base, **r} for r in _wgrad_variants(counts16_E, P, Q)]
    return rows


def _gemm_variants(counts_E: torch.Tensor, N: int, K: int, dg) -> list[dict]:
    E, M = counts_E.numel(), int(counts_E.sum())
    a_MK = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w_ENK = (torch.randn(E, N, K, device="cuda") / K ** 0.5).to(torch.bfloat16)
    offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
    ref_MN = _reference(a_MK, w_ENK, counts_E)
    flops = 2 * M * N * K
    out = []

    def row(variant, fn, limit, take=lambda y: y, **extra):
        y = take(fn())
        err = float((y.float() - ref_MN).norm() / ref_MN.norm())
        if not err < limit:
            raise SystemExit(f"grouped_gemm_fp8: {variant} is off by {err:.3g} (limit {limit}) at N={N} K={K}")
        ms = time_ms(graphed(fn), warmup=5, iters=30)
        out.append(dict(variant=variant, ms=ms, tflops=flops / ms / 1e9, rel_err=err, **extra))

    row("bf16_torch", lambda: torch._grouped_mm(a_MK, w_ENK.transpose(-2, -1), offs=offs_E), 0.01)
    a_q, a_s = quant_rows(a_MK)
    w_q, w_s = _weights_rowwise(w_ENK)
    row("fp8_torch", lambda: torch._scaled_grouped_mm(a_q, w_q.transpose(-2, -1), a_s, w_s, offs=offs_E,
                                                      out_dtype=torch.bfloat16, use_fast_accum=True), 0.08,
        quant_ms=time_ms(lambda: quant_rows(a_MK)))
    for name in TRITON_CONFIGS:
        c_MN = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        row(f"fp8_triton_{name}", lambda: grouped_mm_fp8(a_q, a_s, w_q, w_s, offs_E, out=c_MN, config=name), 0.08)
    if dg is not None:
        a_pad, layout_M, keep = _aligned_rows(a_MK, counts_E)
        aq_pad, as_pad = quant_blocks(a_pad, BLOCK)
        as_pad_t = dg.get_mn_major_tma_aligned_tensor(as_pad)  # the scales' layout the kernel reads (column-major)
        wq_blk, ws_blk = _weights_blockwise(w_ENK)
        d_pad = torch.empty(a_pad.shape[0], N, device="cuda", dtype=torch.bfloat16)

        def fp8_dg():
            dg.m_grouped_fp8_gemm_nt_contiguous((aq_pad, as_pad_t), (wq_blk, ws_blk), d_pad, layout_M,
                                                disable_ue8m0_cast=True)
            return d_pad

        def bf16_dg():
            dg.m_grouped_bf16_gemm_nt_contiguous(a_pad, w_ENK, d_pad, layout_M)
            return d_pad

        pad = a_pad.shape[0] - M
        row("fp8_deepgemm", fp8_dg, 0.08, take=lambda y: y[keep], pad_rows=pad,
            quant_ms=time_ms(lambda: quant_blocks(a_MK, BLOCK)),
            sf_layout_ms=time_ms(lambda: dg.get_mn_major_tma_aligned_tensor(as_pad)))
        row("bf16_deepgemm", bf16_dg, 0.01, take=lambda y: y[keep], pad_rows=pad)
    # plain GEMMs of the same rows against one weight: the reference rates (their output is not the grouped one)
    w0_q, w0_s = w_q[0], w_s[0]
    plain8 = time_ms(graphed(lambda: torch._scaled_mm(a_q, w0_q.t(), scale_a=a_s[:, None], scale_b=w0_s[None, :],
                                                      out_dtype=torch.bfloat16, use_fast_accum=True)), warmup=5, iters=30)
    plain16 = time_ms(graphed(lambda: a_MK @ w_ENK[0].t()), warmup=5, iters=30)
    out += [dict(variant="fp8_plain", ms=plain8, tflops=flops / plain8 / 1e9),
            dict(variant="bf16_plain", ms=plain16, tflops=flops / plain16 / 1e9)]
    by = {r["variant"]: r["ms"] for r in out}
    for r in out:
        r["vs_fp8_plain"] = by["fp8_plain"] / r["ms"]  # > 1: faster than a plain FP8 GEMM of the same rows
        r["vs_bf16_torch"] = by["bf16_torch"] / r["ms"]
        r["vs_fp8_torch"] = by["fp8_torch"] / r["ms"]
    return out


def _wgrad_variants(counts_E: torch.Tensor, P: int, Q: int) -> list[dict]:
    """Σ over each expert's rows of aᵀ b ([E, P, Q]) by each variant; a [M, P], b [M, Q] bf16."""
    M = int(counts_E.sum())
    a_MP = torch.randn(M, P, device="cuda", dtype=torch.bfloat16)
    b_MQ = torch.randn(M, Q, device="cuda", dtype=torch.bfloat16)
    offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
    ends = [0] + offs_E.tolist()
    ref_EPQ = torch.stack([a_MP[i0:i1].float().t() @ b_MQ[i0:i1].float() for i0, i1 in zip(ends[:-1], ends[1:])])
    flops = 2 * M * P * Q
    out = []

    def row(variant, fn, limit, **extra):
        y = fn()
        err = float((y.float() - ref_EPQ).norm() / ref_EPQ.norm())
        if not err < limit:
            raise SystemExit(f"grouped_gemm_fp8: {variant} is off by {err:.3g} (limit {limit}) at P={P} Q={Q}")
        ms = time_ms(graphed(fn), warmup=5, iters=30)
        out.append(dict(variant=variant, ms=ms, tflops=flops / ms / 1e9, rel_err=err, **extra))

    row("bf16_torch", lambda: torch._grouped_mm(a_MP.t(), b_MQ, offs=offs_E), 0.01)
    try:
        from torchao.prototype.moe_training.kernels.jagged_float8_scales import (
            triton_fp8_per_group_colwise_scales_dual as colwise_dual)
    except ImportError as e:
        print(f"grouped_gemm_fp8: no fp8_torch weight-gradient rows (torchao's per-group cast: {e})")
    else:
        def quant():  # e4m3, column-major (rows contiguous: the K-major layout both operands need), [E·P] scales
            return colwise_dual(a_MP, b_MQ, offs_E, FP8, round_scales_to_power_of_2=True)

        aq, as_, bq, bs = quant()
        row("fp8_torch", lambda: torch._scaled_grouped_mm(aq.t(), bq, as_.reciprocal(), bs.reciprocal(), offs_E,
                                                          out_dtype=torch.bfloat16, use_fast_accum=True), 0.08,
            quant_ms=time_ms(graphed(quant), warmup=5, iters=30))
        out[-1]["with_quant_ms"] = out[-1]["ms"] + out[-1]["quant_ms"]
    rows_a, rows_b = quant_rows(a_MP), quant_rows(b_MQ)  # the e4m3 rows the experts' other GEMMs read

    def requant():  # transposed onto whole 128-row blocks per expert, one scale per expert (kernels/fp8_wgrad.py)
        return requant_expert_t(*rows_a, offs_E), requant_expert_t(*rows_b, offs_E)

    (at, sa, aoffs_E), (bt, sb, _) = requant()
    requant_ms = time_ms(graphed(requant), warmup=5, iters=30)
    for config in WGRAD_CONFIGS:
        row(f"fp8_triton_{config}", lambda c=config: grouped_wgrad_fp8(at, sa, bt, sb, aoffs_E, config=c), 0.08,
            quant_ms=requant_ms)
        out[-1]["with_quant_ms"] = out[-1]["ms"] + requant_ms
    aq_all, as_all = quant_rows(a_MP.t().contiguous())  # [P, M]: one GEMM over all rows, rowwise scales
    bq_all, bs_all = quant_rows(b_MQ.t().contiguous())
    plain8 = time_ms(graphed(lambda: torch._scaled_mm(aq_all, bq_all.t(), scale_a=as_all[:, None],
                                                      scale_b=bs_all[None, :], out_dtype=torch.bfloat16,
                                                      use_fast_accum=True)), warmup=5, iters=30)
    plain16 = time_ms(graphed(lambda: a_MP.t() @ b_MQ), warmup=5, iters=30)
    out += [dict(variant="fp8_plain", ms=plain8, tflops=flops / plain8 / 1e9),
            dict(variant="bf16_plain", ms=plain16, tflops=flops / plain16 / 1e9)]
    by = {r["variant"]: r["ms"] for r in out}
    for r in out:
        r["vs_fp8_plain"] = by["fp8_plain"] / r["ms"]
        r["vs_bf16_torch"] = by["bf16_torch"] / r["ms"]
    return out


def _reference(a_MK, w_ENK, counts_E) -> torch.Tensor:
    """fp32 products of the bf16 operands, expert by expert: [M, N]."""
    outs, i = [], 0
    for e, c in enumerate(counts_E.tolist()):
        outs.append(a_MK[i:i + c].float() @ w_ENK[e].float().t())
        i += c
    return torch.cat(outs)


def _weights_rowwise(w_ENK):
    """e4m3 weights [E, N, K] with one fp32 power-of-two scale per output channel [E, N] (``quant_rows`` per row)."""
    E, N, K = w_ENK.shape
    q, s = quant_rows(w_ENK.reshape(E * N, K))
    return q.view(E, N, K), s.view(E, N)


def _weights_blockwise(w_ENK):
    """e4m3 weights with one fp32 power-of-two scale per 128x128 block: ([E, N, K], [E, N/128, K/128])."""
    E, N, K = w_ENK.shape
    blocks = w_ENK.float().view(E, N // BLOCK, BLOCK, K // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=(2, 4), keepdim=True).clamp_min(1e-12)
    s = torch.exp2(torch.ceil(torch.log2(amax / torch.finfo(FP8).max)))
    q = (blocks / s).to(FP8).view(E, N, K)
    return q, s.view(E, N // BLOCK, K // BLOCK).contiguous()


def _aligned_rows(a_MK, counts_E):
    """The rows re-laid with each expert starting at a multiple of 128 (zero rows between): (a_PK, per-row expert
    index [P] int32 with -1 on padding, the index of each routed row in the padded layout [M])."""
    padded_E = (counts_E + BLOCK - 1) // BLOCK * BLOCK
    starts_E = torch.cumsum(padded_E, 0) - padded_E
    P = int(padded_E.sum())
    dev = a_MK.device
    expert_M = torch.repeat_interleave(torch.arange(counts_E.numel(), device=dev), counts_E.long())
    first_M = torch.cumsum(counts_E, 0) - counts_E
    dest_M = starts_E[expert_M] + torch.arange(a_MK.shape[0], device=dev) - first_M[expert_M]
    a_PK = a_MK.new_zeros(P, a_MK.shape[1])
    a_PK[dest_M] = a_MK
    layout_P = torch.full((P,), -1, device=dev, dtype=torch.int32)
    layout_P[dest_M] = expert_M.int()
    return a_PK, layout_P, dest_M


if __name__ == "__main__":
    main()
