"""Probes behind the FP8 experts' design (one GPU): grouped-GEMM rates for the layouts it could use,
and the MoE layer's CUDA kernels (bf16 and FP8 experts).

    python benchmarks/probe_fp8_layout.py [gemms] [layer]     (default: both)

gemms: at the layer benchmark's two shapes (M routed rows, D, H, E; balanced random group sizes),
bf16 ``torch._grouped_mm`` for w1 alone vs w1|w3 stacked (N = 2H), the down projection, the input
gradients and the weight gradients; FP8 ``torch._scaled_grouped_mm`` for the same GEMMs with groups
as they come and 16-row aligned; torch casts / amax / transpose of the weights for reference.
layer: fwd+bwd time and the top CUDA kernels of our MoE layer (T=16384, 64 experts, hidden 1408, top-6).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import time_ms

dev = "cuda"
F8 = torch.float8_e4m3fn


def counts_for(M, E, seed, skew=False):
    g = torch.Generator().manual_seed(seed)
    p = torch.ones(E) if not skew else (torch.arange(E) + 1.0).pow(-1.0)
    ids = torch.multinomial(p / p.sum(), M, replacement=True, generator=g)
    return torch.bincount(ids, minlength=E)


def rate(name, fn, flops):
    ms = time_ms(fn, warmup=5, iters=20)
    print(f"{name:48s} {ms:8.3f} ms {flops / ms / 1e9:7.0f} TFLOP/s", flush=True)
    return ms


def gemms(M, D, H, E):
    print(f"\n=== M={M} D={D} H={H} E={E}")
    c = counts_for(M, E, 0)
    offs = torch.cumsum(c, 0).to(torch.int32).to(dev)
    c_al = (c + 15) // 16 * 16
    offs_al = torch.cumsum(c_al, 0).to(torch.int32).to(dev)
    M_al = (M + 15) // 16 * 16 + 16 * E
    bf = torch.bfloat16
    x = torch.randn(M, D, device=dev, dtype=bf)
    x_al = torch.randn(M_al, D, device=dev, dtype=bf)
    h = torch.randn(M, H, device=dev, dtype=bf)
    dab = torch.randn(M, 2 * H, device=dev, dtype=bf)
    w1 = torch.randn(E, H, D, device=dev, dtype=bf)
    w13 = torch.randn(E, 2 * H, D, device=dev, dtype=bf)
    w2 = torch.randn(E, D, H, device=dev, dtype=bf)
    f = 2 * M * D * H
    rate("bf16 fwd x@w1 (N=H)", lambda: torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs), f)
    rate("bf16 fwd x@w13 (N=2H)", lambda: torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs), 2 * f)
    rate("bf16 down h@w2 (K=H)", lambda: torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs), f)
    rate("bf16 dgrad dy@w2 (N=H)", lambda: torch._grouped_mm(x, w2, offs=offs), f)
    rate("bf16 dgrad dab@w13 (K=2H)", lambda: torch._grouped_mm(dab, w13, offs=offs), 2 * f)
    rate("bf16 wgrad da^T x", lambda: torch._grouped_mm(h.t(), x, offs=offs), f)
    rate("bf16 wgrad dab^T x", lambda: torch._grouped_mm(dab.t(), x, offs=offs), 2 * f)
    xq, xq_al = x.to(F8), x_al.to(F8)
    hq, dabq = h.to(F8), dab.to(F8)
    sM, sM_al = torch.ones(M, device=dev), torch.ones(M_al, device=dev)
    w13q = w13.to(F8)  # [E, 2H, D]: K-major for x @ w13ᵀ
    w13Tq = w13.transpose(-2, -1).contiguous().to(F8)  # [E, D, 2H]
    w2q = w2.to(F8)  # [E, D, H]
    w2Tq = w2.transpose(-2, -1).contiguous().to(F8)  # [E, H, D]
    s2H, sD, sH = (torch.ones(E, n, device=dev) for n in (2 * H, D, H))
    sgm = lambda a, b, sa, sb, o: torch._scaled_grouped_mm(a, b, sa, sb, offs=o, out_dtype=bf, use_fast_accum=True)  # noqa: E731
    rate("fp8 fwd x@w13 unaligned", lambda: sgm(xq, w13q.transpose(-2, -1), sM, s2H, offs), 2 * f)
    rate("fp8 fwd x@w13 aligned", lambda: sgm(xq_al, w13q.transpose(-2, -1), sM_al, s2H, offs_al), 2 * f)
    rate("fp8 down h@w2 unaligned", lambda: sgm(hq, w2q.transpose(-2, -1), sM, sD, offs), f)
    rate("fp8 dgrad dy@w2 unaligned", lambda: sgm(xq, w2Tq.transpose(-2, -1), sM, sH, offs), f)
    rate("fp8 dgrad dab@w13 (K=2H) unaligned", lambda: sgm(dabq, w13Tq.transpose(-2, -1), sM, sD, offs), 2 * f)
    nb = w13.numel() * 2
    ms = time_ms(lambda: w13.to(F8))
    print(f"{'cast w13 bf16->fp8 (torch)':48s} {ms:8.3f} ms {nb * 1.5 / ms / 1e6:7.0f} GB/s")
    ms = time_ms(lambda: w13.abs().amax(dim=(1, 2)))
    print(f"{'amax per expert w13 (torch)':48s} {ms:8.3f} ms {nb / ms / 1e6:7.0f} GB/s")
    ms = time_ms(lambda: w13.transpose(-2, -1).contiguous())
    print(f"{'transpose w13 (torch)':48s} {ms:8.3f} ms {nb * 2 / ms / 1e6:7.0f} GB/s")


def layer_profile():
    from torchtitan.models.moe import MoEArgs

    from components.moe_echo.config import MoEEchoConfig
    from components.moe_echo.layer import MoELayer

    T, D, H, E, K = 16384, 2048, 1408, 64, 6
    args = MoEArgs(num_experts=E, num_shared_experts=0, top_k=K, score_func="softmax", route_norm=False,
                   score_before_experts=False, use_grouped_mm=True)
    torch.manual_seed(0)
    m = MoELayer(args, D, H, MoEEchoConfig()).to(dev)
    m.init_weights(0.02, torch.device(dev))
    m.to(torch.bfloat16)
    m.expert_bias.data = m.expert_bias.float()
    x = torch.randn(4, 4096, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)

    def fb():
        x.grad = None
        m.zero_grad(set_to_none=True)
        m(x).backward(g)

    for prec in ("bf16", "fp8"):
        m.experts.precision = prec
        ms = time_ms(fb)
        print(f"\n=== layer {prec}: {ms:.2f} ms fwd+bwd")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fb()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=24, max_name_column_width=90))


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__)
    which = sys.argv[1:] or ["gemms", "layer"]
    if "gemms" in which:
        gemms(98304, 2048, 1408, 64)
        gemms(131072, 2048, 768, 128)
    if "layer" in which:
        layer_profile()
