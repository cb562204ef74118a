"""Forward only: QuACK's gathered grouped GEMM with SwiGLU in its epilogue, then the down GEMM, against the
same work on torch (index_select gather, ``torch._grouped_mm`` for [w1; w3], SwiGLU, ``torch._grouped_mm``).

    python benchmarks/probe_quack_forward.py        (a Hopper GPU and quack-kernels: pip install -e ".[quack]")

Prints per shape the torch time, a plain [M, D] x [D, 2H] GEMM's time, and QuACK's relative error and time with
[w1; w3] interleaved by rows and concatenated.
"""
import torch
import torch.nn.functional as F
from quack.gemm_interface import gemm, gemm_gated_out


def ms(fn, it=20):
    for _ in range(3):
        fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); s.record()
    for _ in range(it):
        fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / it


torch.manual_seed(0)
for T, D, E, K, H in [(16384, 2048, 64, 6, 1408), (16384, 2048, 128, 8, 768)]:
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    ids = torch.rand(T, E, device="cuda").topk(K, -1).indices.reshape(-1)
    order = torch.argsort(ids, stable=True)
    idx = (order // K).to(torch.int32)  # token of each expert-major row
    counts = torch.bincount(ids, minlength=E)
    cu = torch.zeros(E + 1, dtype=torch.int32, device="cuda"); cu[1:] = torch.cumsum(counts, 0)
    offs = cu[1:]
    w13 = torch.randn(E, 2 * H, D, device="cuda", dtype=torch.bfloat16) * 0.02  # [w1; w3] rows
    w2 = torch.randn(E, D, H, device="cuda", dtype=torch.bfloat16) * 0.02
    M = T * K

    def ours():
        xg = x.index_select(0, idx)
        ab = torch._grouped_mm(xg, w13.transpose(-2, -1), offs=offs)
        h = F.silu(ab[:, :H]) * ab[:, H:]
        return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)

    pre = torch.empty(M, 2 * H, device="cuda", dtype=torch.bfloat16)
    post = torch.empty(M, H, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(M, D, device="cuda", dtype=torch.bfloat16)
    results = {}
    for layout, B13, cl in [("interleaved", w13.view(E, 2, H, D).transpose(1, 2).reshape(E, 2 * H, D), None),
                            ("concat", w13, "B")]:
        try:
            def quack():
                gemm_gated_out(x, B13.transpose(-2, -1), pre, post, cu_seqlens_m=cu, A_idx=idx, concat_layout=cl)
                gemm(post, w2.transpose(-2, -1), out=y, cu_seqlens_m=cu)
            quack()
            err = float((y.float() - ours().float()).norm() / ours().float().norm())
            results[layout] = (err, ms(quack))
        except Exception as exc:  # noqa: BLE001 - a probe reports every failure
            results[layout] = (f"{type(exc).__name__}: {str(exc)[:300]}", None)
    flops = 2 * M * D * 3 * H
    t_ours = ms(ours)
    t_mm = ms(lambda: torch.mm(x.repeat(K, 1)[:M], w13[0].t()))
    print(f"T={T} D={D} E={E} K={K} H={H}: ours fwd {t_ours:.3f} ms ({flops / t_ours / 1e9:.0f} TFLOP/s); "
          f"plain mm [M,D]x[D,2H] {t_mm:.3f} ms; quack {results}")
