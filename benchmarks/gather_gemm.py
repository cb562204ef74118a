"""The routed experts reading token rows through their GEMMs (``[moe_echo] gathered_experts = true``: the gather in
the GEMM's prologue) against expert-major copies (the default). QuACK's grouped GEMMs take row indices (``A_idx``)
and, in the SwiGLU backward, a per-row scale with its reduction (``colvec_scale`` / ``colvec_reduce``). One GPU,
forward and backward of the experts, two designs:

    expanded (default) x_ND = x_TD[tok_N]                          one copy of T·K rows, then the GEMMs read it
                       preact, h = x_ND @ [w1; w3]ᵀ (SwiGLU epilogue);  y_ND = h @ w2ᵀ
                       backward: dy_ND, ds_N = combine_backward(dout_TD, y_ND, s)   (one row pass, y kept)
                                 dpreact, h = dy_ND @ w2 (dSwiGLU epilogue);  dx_ND = dpreact @ [w1; w3]
                                 d[w1; w3] = dpreactᵀ @ x_ND;  dw2 = dy_NDᵀ @ h
    gathered           preact, h = x_TD[tok_N] @ [w1; w3]ᵀ        the GEMM loads token rows by index: no copy
                       y_ND = h @ w2ᵀ  (y need not be kept for backward)
                       backward: dpreact, s·h, ds_N = dout_TD[tok_N] @ w2 with s applied and <h, dout·w2> reduced
                                 in the epilogue;  dx_ND as above
                                 d[w1; w3]ᵀ = x_TD[tok_N]ᵀ @ dpreact   (gathered along the reduction)
                                 dw2 = dout_TD[tok_N]ᵀ @ (s·h)

Both designs then combine y_ND into tokens and sum dx_ND into tokens with the same kernels, left out of both.
Rows: median ms of each design's forward and backward, the gathered design's speedup, and its largest
normwise difference from the expanded design's outputs (y, dx, d[w1; w3], dw2, ds). Variants of the weight-
gradient GEMM that QuACK refuses are reported, not fatal.

    python benchmarks/gather_gemm.py --shapes 64x1408x2048x16384x6 128x768x2048x16384x8 [--out DIR]
                                                           -> gather_gemm_1x<GPU>.{json,md}

Each shape is experts x hidden x dim x tokens x top-k. Needs an SM90 GPU and quack-kernels.
"""

import argparse
import traceback

import torch

from benchmarks.common import environment, markdown_table, shape_arg, time_ms, write_results
from kernels.moe_rows import combine_backward


def routing(T: int, E: int, K: int, skew: float, gen: torch.Generator):
    """Top-k of noisy scores (``skew`` > 0 makes low expert ids hot): expert-major rows, each row's token
    ``tok_N``, its combine weight ``s_N``, the weights ``s_TK``, the (token, choice) -> row map and
    ``cu_E1`` (int32 [E + 1]), on the generator's device."""
    dev = gen.device
    scores = torch.rand(T, E, generator=gen, device=dev) - skew * torch.arange(E, device=dev) / E
    s_TK, ids_TK = torch.topk(scores.softmax(-1), K, dim=-1)
    order_N = torch.argsort(ids_TK.flatten(), stable=True)
    row_of_slot_TK = torch.empty_like(order_N).scatter_(0, order_N, torch.arange(T * K, device=dev)).view(T, K)
    cu_E1 = torch.zeros(E + 1, dtype=torch.int32, device=dev)
    torch.cumsum(torch.bincount(ids_TK.flatten(), minlength=E), 0, out=cu_E1[1:])
    tok_N = (order_N // K).to(torch.int32)
    return tok_N, s_TK.flatten()[order_N].float(), s_TK.float(), row_of_slot_TK, cu_E1


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def measure(E: int, H: int, D: int, T: int, K: int, skew: float) -> dict:
    from quack import gemm_interface as q

    gen = torch.Generator(device="cuda").manual_seed(0)
    tok_N, s_N, s_TK, row_of_slot_TK, cu_E1 = routing(T, E, K, skew, gen)
    N, bf = T * K, torch.bfloat16
    x_TD = torch.randn(T, D, device="cuda", dtype=bf, generator=gen)
    dout_TD = torch.randn(T, D, device="cuda", dtype=bf, generator=gen)
    w13 = (torch.randn(E, 2 * H, D, device="cuda", generator=gen) * D ** -0.5).to(bf)  # [w1; w3]
    w2 = (torch.randn(E, D, H, device="cuda", generator=gen) * H ** -0.5).to(bf)
    preact, h = x_TD.new_empty(N, 2 * H), x_TD.new_empty(N, H)
    dpreact, hs = torch.empty_like(preact), torch.empty_like(h)

    def fwd_expanded():
        x_ND = x_TD.index_select(0, tok_N)
        q.gemm_gated_out(x_ND, w13.transpose(-2, -1), preact, h, cu_seqlens_m=cu_E1, concat_layout="B")
        return x_ND, q.gemm(h, w2.transpose(-2, -1), cu_seqlens_m=cu_E1)

    def bwd_expanded(x_ND, y_ND):
        dy_ND, ds_TK = combine_backward(dout_TD, y_ND, s_TK, row_of_slot_TK)
        q.gemm_dgated_out(dy_ND, w2, preact, dpreact, hs, cu_seqlens_m=cu_E1)
        dx = q.gemm(dpreact, w13, cu_seqlens_m=cu_E1, concat_layout=("B",), dynamic_scheduler=True)
        dw13 = q.gemm(dpreact.T, x_ND, cu_seqlens_k=cu_E1, concat_layout=("out",), dynamic_scheduler=True)
        dw2 = q.gemm(dy_ND.T, hs, cu_seqlens_k=cu_E1, dynamic_scheduler=True)
        ds_N = torch.empty_like(s_N).scatter_(0, row_of_slot_TK.flatten(), ds_TK.flatten())
        return dx, dw13, dw2, ds_N

    def fwd_gathered():
        q.gemm_gated_out(x_TD, w13.transpose(-2, -1), preact, h, cu_seqlens_m=cu_E1, A_idx=tok_N,
                         concat_layout="B")
        return q.gemm(h, w2.transpose(-2, -1), cu_seqlens_m=cu_E1)

    dw13_t = torch.empty_like(w13)

    def wgrad13_gathered():  # [E, D, 2H] written into [E, 2H, D] storage, gate / up rows de-interleaved
        q.gemm(x_TD.T, dpreact, out=dw13_t.transpose(-2, -1), cu_seqlens_k=cu_E1, A_idx=tok_N,
               concat_layout=("out",), dynamic_scheduler=True)
        return dw13_t

    def bwd_gathered(wgrad13):
        ds_N = q.gemm_dgated_out(dout_TD, w2, preact, dpreact, hs, colvec_scale=s_N, colvec_reduce=True,
                                 cu_seqlens_m=cu_E1, A_idx=tok_N)
        dx = q.gemm(dpreact, w13, cu_seqlens_m=cu_E1, concat_layout=("B",), dynamic_scheduler=True)
        dw13 = wgrad13()
        dw2 = q.gemm(dout_TD.T, hs, cu_seqlens_k=cu_E1, A_idx=tok_N, dynamic_scheduler=True)
        return dx, dw13, dw2, ds_N

    x_ND, y_ref = fwd_expanded()
    ref = [t.clone() for t in bwd_expanded(x_ND, y_ref)]
    preact_ref = preact.clone()
    y = fwd_gathered()
    row = dict(experts=E, hidden=H, dim=D, tokens=T, top_k=K, skew=skew,
               fwd_bitwise=bool(torch.equal(y, y_ref) and torch.equal(preact, preact_ref)), err_y=rel(y, y_ref))
    wgrad13, note = wgrad13_gathered, "gathered"
    try:
        got = bwd_gathered(wgrad13)
        torch.cuda.synchronize()
    except Exception as exc:  # QuACK may refuse the transposed, de-interleaved output: fall back to the expanded x
        note = f"expanded x for d[w1; w3] ({type(exc).__name__}: {str(exc).splitlines()[0][:80]})"
        traceback.print_exc()

        def wgrad13():
            x_ND = x_TD.index_select(0, tok_N)
            return q.gemm(dpreact.T, x_ND, cu_seqlens_k=cu_E1, concat_layout=("out",), dynamic_scheduler=True)

        got = bwd_gathered(wgrad13)
    for name, a, b in zip(("dx", "dw13", "dw2", "ds"), got, ref):
        row[f"err_{name}"] = rel(a, b)
    row["wgrad13"] = note
    row["expanded_fwd_ms"] = time_ms(fwd_expanded)
    row["gathered_fwd_ms"] = time_ms(fwd_gathered)
    row["expanded_bwd_ms"] = time_ms(lambda: bwd_expanded(x_ND, y_ref))
    row["gathered_bwd_ms"] = time_ms(lambda: bwd_gathered(wgrad13))
    row["speedup"] = ((row["expanded_fwd_ms"] + row["expanded_bwd_ms"])
                      / (row["gathered_fwd_ms"] + row["gathered_bwd_ms"]))
    return row


_shape = shape_arg("EXPERTSxHIDDENxDIMxTOKENSxTOPK", "64x1408x2048x16384x6")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", type=_shape, default=[_shape("64x1408x2048x16384x6")])
    p.add_argument("--skews", default="0,4", help="routing skews (0: balanced)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit("gather_gemm.py needs an SM90 (Hopper) GPU and quack-kernels")
    rows = [measure(*shape, float(skew)) for shape in a.shapes for skew in a.skews.split(",")]
    cols = ["experts", "hidden", "dim", "tokens", "top_k", "skew", "expanded_fwd_ms", "gathered_fwd_ms",
            "expanded_bwd_ms", "gathered_bwd_ms", "speedup", "fwd_bitwise", "err_dx", "err_dw13", "err_dw2",
            "err_ds", "wgrad13"]
    table = markdown_table(rows, cols)
    print(table)
    write_results("gather_gemm", environment(), rows, table, a.out)


if __name__ == "__main__":
    main()
