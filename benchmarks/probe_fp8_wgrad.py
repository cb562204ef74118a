"""Probe: FP8 weight-gradient GEMMs for the routed experts, against the bf16 ones, on one GPU.

    python benchmarks/probe_fp8_wgrad.py

1. ``torch._scaled_grouped_mm`` with both operands 2-D (groups along the reduction, the weight gradient's form):
   the layout of its per-(group, row) scales and what an empty group gives, against an fp32 reference (group
   starts must be multiples of 16 elements: torch 2.11 fails a device assert otherwise).
2. For the two ``moe_layer.py`` expert shapes (T = 16384 tokens, dim 2048, routed rows T·k, balanced random
   counts), the GEMM budget of the experts' fwd+bwd in bf16 and FP8: forward and input gradient as both paths
   run them (``torch._grouped_mm`` / ``torch._scaled_grouped_mm``, 2d×3d); the weight gradients as the bf16 path
   runs them (three ``torch._grouped_mm``: da·x, db·x, dy·h) and as two FP8 GEMMs (2d×2d, fast accumulation on
   and off), plus what the FP8 operands cost: ``requant_t_grouped`` of x, h, dy and [da | db] from their
   row-quantised copies, and ``group_scales``; and the FP8 weight gradient's error against fp64.
   ``requant_t_grouped`` is checked bit-exact against its torch reference first.
Prints its measurements.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks.common import time_ms
from kernels import fp8
from kernels.fp8 import FP8
from kernels.moe_rows import triton  # None without Triton (CPU): the torch references still import

SHAPES = ((64, 1408, 6), (128, 768, 8))  # (E, H, top-k), dim 2048, 16384 tokens


def padded_offsets(counts_E: torch.Tensor, align: int = 16) -> torch.Tensor:
    """int32 [E]: cumsum of the counts each rounded up to ``align`` (device ops, no host read)."""
    return torch.cumsum((counts_E + align - 1) // align * align, 0, dtype=torch.int32)


def group_scales(s_R: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """s_E fp32 [E]: max of the power-of-two row scales s_R over each group's rows [offs[e-1], offs[e]);
    1 for an empty group. Rows at or past offs[-1] are not read (their scales may be anything)."""
    E, R = offs_E.numel(), s_R.numel()
    rows = torch.arange(R, device=s_R.device, dtype=offs_E.dtype)
    g_R = torch.searchsorted(offs_E, rows, right=True)  # rows past the last group -> E, dropped
    s_R = torch.where(g_R < E, s_R, 0.0)  # padding rows' scales are garbage, possibly NaN
    s = torch.zeros(E + 1, dtype=torch.float32, device=s_R.device).scatter_reduce_(0, g_R, s_R.float(), "amax")[:E]
    return torch.where(s > 0, s, 1.0)


def _group_starts(offs_E: torch.Tensor) -> torch.Tensor:
    return torch.cat([offs_E.new_zeros(1), offs_E[:-1]])


def requant_t_grouped_torch(q_RC, s_R, s_E, offs_E, offs_pad_E, K_pad):
    E = offs_E.numel()
    p = torch.arange(K_pad, device=q_RC.device, dtype=offs_pad_E.dtype)
    g = torch.searchsorted(offs_pad_E, p, right=True)
    gc = g.clamp(max=E - 1)
    m = p - _group_starts(offs_pad_E)[gc] + _group_starts(offs_E)[gc]
    valid = (g < E) & (m < offs_E[gc])
    m = torch.where(valid, m, 0).long()
    v = q_RC[m].float() * (s_R[m] / s_E[gc])[:, None]
    return torch.where(valid[:, None], v, 0.0).to(FP8).t().contiguous()


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _requant_t_kernel(q_ptr, s_row_ptr, s_grp_ptr, offs_ptr, offs_pad_ptr, out_ptr, C, K_pad, E,
                          LOG_E: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
        """out[c, p] for one [BLOCK_C, BLOCK_P] tile: p's group by binary search over offs_pad, its source row
        m = p - start_pad[g] + start[g] (zero where p is a group's alignment padding or past the groups)."""
        p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        lo = tl.zeros([BLOCK_P], dtype=tl.int32)
        hi = tl.zeros([BLOCK_P], dtype=tl.int32) + E
        for _ in tl.static_range(LOG_E):  # first g with offs_pad[g] > p (E: past every group)
            mid = (lo + hi) // 2
            go_right = (tl.load(offs_pad_ptr + mid, mask=mid < E, other=2**31 - 1) <= p) & (lo < hi)
            lo = tl.where(go_right, mid + 1, lo)
            hi = tl.where(go_right | (lo >= hi), hi, mid)
        g = lo
        gc = tl.minimum(g, E - 1)
        start_pad = tl.where(gc > 0, tl.load(offs_pad_ptr + gc - 1, mask=gc > 0, other=0), 0)
        start = tl.where(gc > 0, tl.load(offs_ptr + gc - 1, mask=gc > 0, other=0), 0)
        m = p - start_pad + start
        valid = (g < E) & (m < tl.load(offs_ptr + gc)) & (p < K_pad)
        m = tl.where(valid, m, 0).to(tl.int64)
        f = tl.load(s_row_ptr + m, mask=valid, other=0.0) / tl.load(s_grp_ptr + gc)
        v = tl.load(q_ptr + m[:, None] * C + c[None, :], mask=valid[:, None] & (c[None, :] < C), other=0.0)
        v = (v.to(tl.float32) * f[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + c[:, None].to(tl.int64) * K_pad + p[None, :], tl.trans(v),
                 mask=(c[:, None] < C) & (p[None, :] < K_pad))


def requant_t_grouped(q_RC: torch.Tensor, s_R: torch.Tensor, s_E: torch.Tensor, offs_E: torch.Tensor,
                      offs_pad_E: torch.Tensor, K_pad: int) -> torch.Tensor:
    """out [C, K_pad] fp8, a weight gradient's operand: the row-quantised q_RC (x ≈ q · s_R) rescaled to one scale
    per group (× s_R / s_E, a power of two ≤ 1; s_E = group_scales(s_R, offs_E)) and written transposed, group e's
    rows at columns [offs_pad[e-1], offs_pad[e-1] + counts[e]) and zeros up to offs_pad[e] (FP8 GEMMs with the
    groups along the reduction need 16-aligned group starts; offs_pad_E = padded_offsets(counts_E), K_pad ≥
    offs_pad[-1]). Columns past offs_pad[-1] are unspecified."""
    if not q_RC.is_cuda:
        return requant_t_grouped_torch(q_RC, s_R, s_E, offs_E, offs_pad_E, K_pad)
    R, C = q_RC.shape
    E = offs_E.numel()
    out = torch.empty(C, K_pad, dtype=FP8, device=q_RC.device)
    if C and K_pad and E:
        B = 128
        _requant_t_kernel[(triton.cdiv(K_pad, B), triton.cdiv(C, B))](
            q_RC, s_R, s_E, offs_E, offs_pad_E, out, C, K_pad, E, LOG_E=E.bit_length(), BLOCK_P=B, BLOCK_C=B,
            num_warps=8)
    return out


def _ref_2d2d(a_PK, b_QK, s_a, s_b, offs):
    ends, out = offs.tolist(), []
    for e, (k0, k1) in enumerate(zip([0] + ends[:-1], ends)):
        out.append((a_PK[:, k0:k1].float() * s_a[e][:, None]) @ (b_QK[:, k0:k1].float() * s_b[e][:, None]).t())
    return torch.stack(out)


def semantics() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    P, Q = 64, 48
    for counts in ([32, 16, 48, 0, 16],):  # unaligned group starts fail a device assert (torch 2.11)
        E, K = len(counts), 160
        offs = torch.cumsum(torch.tensor(counts, device="cuda"), 0, dtype=torch.int32)
        a = (torch.randn(P, K, device="cuda", generator=g) * 30).to(fp8.FP8)
        b = (torch.randn(Q, K, device="cuda", generator=g) * 30).to(fp8.FP8)
        s_a = torch.exp2(torch.randint(-3, 3, (E, P), device="cuda", generator=g).float())
        s_b = torch.exp2(torch.randint(-3, 3, (E, Q), device="cuda", generator=g).float())
        ref = _ref_2d2d(a, b, s_a, s_b, offs)
        try:
            out = torch._scaled_grouped_mm(a, b.t(), s_a.reshape(-1), s_b.reshape(-1), offs=offs,
                                           out_dtype=torch.bfloat16, use_fast_accum=True).float()
        except Exception as ex:  # noqa: BLE001 — the probe reports what torch says
            print(f"counts {counts}: {type(ex).__name__}: {str(ex).splitlines()[0]}")
            continue
        err = ((out - ref).norm() / ref.norm()).item()
        alt = _ref_2d2d(a, b, s_a.reshape(P, E).t(), s_b.reshape(Q, E).t(), offs)
        err_alt = ((out - alt).norm() / alt.norm()).item()
        print(f"counts {counts}: out {tuple(out.shape)}; rel err vs group-major scales {err:.2e}, "
              f"vs row-major scales {err_alt:.2e}; empty group max |out| {out[3].abs().max().item():.3g}")


def requant_exact() -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    for counts, C in (([5, 0, 17, 9, 33, 1], 24), ([64, 0, 128, 16], 256), ([3, 200, 0, 77], 1408)):
        counts = torch.tensor(counts, device="cuda")
        R = int(counts.sum()) + 7
        x = torch.randn(R, C, device="cuda", generator=g) * torch.logspace(-3, 2, R, device="cuda")[:, None]
        q, s = fp8.quant_rows(x.to(torch.bfloat16))
        offs, offs_pad = torch.cumsum(counts, 0, dtype=torch.int32), padded_offsets(counts)
        s_E = group_scales(s, offs)
        K_pad = (R + 15 * len(counts) + 15) // 16 * 16
        out = requant_t_grouped(q, s, s_E, offs, offs_pad, K_pad)
        ref = requant_t_grouped_torch(q, s, s_E, offs, offs_pad, K_pad)
        n = int(offs_pad[-1])
        same = torch.equal(out[:, :n].view(torch.uint8), ref[:, :n].view(torch.uint8))
        print(f"requant_t_grouped C={C} counts {counts.tolist()}: bytes equal to the torch reference: {same}")


def timings(E: int, H: int, k: int, D: int = 2048, T: int = 16384) -> None:
    M = T * k
    counts = torch.bincount(torch.randint(0, E, (M,), device="cuda"), minlength=E)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    offs_pad = padded_offsets(counts)
    K_pad = (M + 15 * E + 15) // 16 * 16
    bf = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)
    x, h, dy, dab = bf(M, D), bf(M, H), bf(M, D), bf(M, 2 * H)
    da, db = dab[:, :H].contiguous(), dab[:, H:].contiguous()
    w13, w2 = bf(E, 2 * H, D) * 0.02, bf(E, D, H) * 0.02
    gmm = lambda a, b: torch._grouped_mm(a, b, offs=offs)

    # the layer's GEMMs as the bf16 path runs them: forward, input gradient, weight gradient
    bf16 = {"forward": lambda: (gmm(x, w13.transpose(-2, -1)), gmm(h, w2.transpose(-2, -1))),
            "input gradient": lambda: (gmm(dy, w2), gmm(dab, w13)),
            "weight gradient": lambda: (gmm(da.t(), x), gmm(db.t(), x), gmm(dy.t(), h))}

    # FP8: row-quantised activations, per-expert weight scales, the transposed weight copies
    rows = {n: fp8.quant_rows(t) for n, t in (("x", x), ("h", h), ("dy", dy), ("dab", dab))}
    ones = {n: torch.ones(E, n, device="cuda") for n in (D, H, 2 * H)}  # per-(expert, column) weight scales
    w13_q, w2_q = w13.to(fp8.FP8), w2.to(fp8.FP8)
    w13t_q, w2t_q = w13_q.transpose(1, 2).contiguous(), w2_q.transpose(1, 2).contiguous()
    sgmm = lambda a, b, n, fast=True: torch._scaled_grouped_mm(a[0], b, a[1], ones[n], offs=offs,
                                                               out_dtype=torch.bfloat16, use_fast_accum=fast)
    scales = {n: group_scales(s, offs) for n, (q, s) in rows.items()}
    ts = {n: requant_t_grouped(q, s, scales[n], offs, offs_pad, K_pad) for n, (q, s) in rows.items()}
    ex = lambda s_E, n: s_E[:, None].expand(E, n).reshape(-1)
    sab, sx, sdy, sh = ex(scales["dab"], 2 * H), ex(scales["x"], D), ex(scales["dy"], D), ex(scales["h"], H)

    def wgrad8(fast):
        return (torch._scaled_grouped_mm(ts["dab"], ts["x"].t(), sab, sx, offs=offs_pad, out_dtype=torch.bfloat16,
                                         use_fast_accum=fast),
                torch._scaled_grouped_mm(ts["dy"], ts["h"].t(), sdy, sh, offs=offs_pad, out_dtype=torch.bfloat16,
                                         use_fast_accum=fast))

    def operands():
        for n, (q, s) in rows.items():
            requant_t_grouped(q, s, group_scales(s, offs), offs, offs_pad, K_pad)

    fp8_ = {"forward": lambda: (sgmm(rows["x"], w13_q.transpose(-2, -1), 2 * H),
                                sgmm(rows["h"], w2_q.transpose(-2, -1), D)),
            "input gradient": lambda: (sgmm(rows["dy"], w2t_q.transpose(-2, -1), H),
                                       sgmm(rows["dab"], w13t_q.transpose(-2, -1), D)),
            "weight gradient": lambda: wgrad8(True),
            "weight gradient, exact accumulation": lambda: wgrad8(False)}
    tflop = 2 * M * D * 3 * H / 1e12  # each of the three GEMM groups
    print(f"E={E} H={H} k={k} (M={M}), ms (TFLOP/s):")
    t = {}
    for name in ("forward", "input gradient", "weight gradient", "weight gradient, exact accumulation"):
        tb = time_ms(bf16[name]) if name in bf16 else float("nan")
        tf = time_ms(fp8_[name])
        t[name] = (tb, tf)
        print(f"  {name}: bf16 {tb:.3f} ({tflop / tb * 1e3:.0f}), fp8 {tf:.3f} ({tflop / tf * 1e3:.0f}), "
              f"fp8 vs bf16 {tb / tf:.2f}x")
    g_b = sum(t[n][0] for n in ("forward", "input gradient", "weight gradient"))
    g_f = t["forward"][1] + t["input gradient"][1] + t["weight gradient"][0]
    g_f8 = t["forward"][1] + t["input gradient"][1] + t["weight gradient"][1]
    print(f"  GEMMs of a fwd+bwd: bf16 {g_b:.3f} ms; fp8 with bf16 weight gradient {g_f:.3f} ({g_b / g_f:.2f}x); "
          f"all fp8 {g_f8:.3f} ({g_b / g_f8:.2f}x)")
    t_ops = time_ms(operands)
    moved = sum(2 * q.numel() for q, _ in rows.values()) / 1e9
    print(f"  FP8 weight-gradient operands (4 transposed requants + group scales): {t_ops:.3f} ms "
          f"({moved / t_ops:.2f} TB/s of 1 B read + 1 B written per element)")
    # accuracy of the [w1; w3] weight gradient against fp64, for three experts
    q8, _ = wgrad8(True)
    q8x, _ = wgrad8(False)
    b16 = gmm(dab.t(), x).float()
    ends = offs.tolist()
    errs = {"fp8 fast": 0.0, "fp8 exact": 0.0, "bf16": 0.0}
    for e in (0, E // 2, E - 1):
        k0, k1 = (ends[e - 1] if e else 0), ends[e]
        r = dab[k0:k1].double().t() @ x[k0:k1].double()
        for name, o in (("fp8 fast", q8), ("fp8 exact", q8x), ("bf16", b16)):
            errs[name] = max(errs[name], ((o[e].double() - r).norm() / r.norm()).item())
    print("  dW13 rel err vs fp64 (worst of 3 experts): " + ", ".join(f"{n} {v:.2e}" for n, v in errs.items()))


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__)
    semantics()
    requant_exact()
    for E, H, k in SHAPES:
        timings(E, H, k)
