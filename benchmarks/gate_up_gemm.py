"""The routed experts' forward + backward on one GPU with the gate and up projections as two grouped GEMMs
(``grouped_swiglu``: x @ w1ᵀ and x @ w3ᵀ, whose backward sums two [N, D] gradients of x) and as one against
[w1; w3] (``grouped_swiglu13``), for bf16 weights (concatenated each step: a copy forward, another backward) and
for fp32 weights cast for compute (experts outside FSDP: cast and concatenated in one pass, what
``GroupedExperts`` runs one GEMM for).

    python benchmarks/gate_up_gemm.py --shapes 64x1408x2048x98304 32x1408x2048x196608 64x768x2048x98304

Each shape is experts x hidden x dim x rows (rows = tokens x top-k). Rows: median ms of fwd+bwd (weight gradients
included) and the one-GEMM speedup.
"""

import argparse

import torch

from benchmarks.common import environment, markdown_table, shape_arg, time_ms, write_results
from components.moe_echo.experts import GroupedExperts, grouped_swiglu, grouped_swiglu13


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", type=_shape, default=[_shape("64x1408x2048x98304")],
                   help="EXPERTSxHIDDENxDIMxROWS, one or more (one results file for all)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = [row for shape in args.shapes for row in measure(*shape)]
    cols = ["weights", "experts", "hidden", "dim", "rows", "two_gemms_ms", "one_gemm_ms", "speedup", "one_gemm_tflops"]
    table = markdown_table(rows, cols)
    print(table)
    write_results("gate_up_gemm", environment(), rows, table, args.out)


_shape = shape_arg("EXPERTSxHIDDENxDIMxROWS", "64x1408x2048x98304")


def measure(E: int, H: int, D: int, N: int) -> list[dict]:
    """Two GEMMs vs one for bf16 weights and for fp32 weights cast for compute, at one shape."""
    torch.manual_seed(0)
    counts = torch.full((E,), N // E, device="cuda", dtype=torch.int64)
    x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    rows = []
    for weights in ("bf16", "fp32 cast"):
        ge = GroupedExperts(D, H, E).cuda()
        ge.init_weights(0.02)
        if weights == "bf16":
            ge.to(torch.bfloat16)
        else:
            ge.compute_dtype = torch.bfloat16

        def clear():
            x.grad = None
            for w in ge.parameters():
                w.grad = None

        def two():
            clear()
            grouped_swiglu(x, *ge.local_weights(), counts).backward(gy)

        def one():
            clear()
            grouped_swiglu13(x, *ge.local_weights_13(), counts).backward(gy)

        two_ms, one_ms = time_ms(two), time_ms(one)
        flops = 3 * 2 * N * D * 3 * H  # fwd + bwd (2x), three projections
        rows.append(dict(weights=weights, experts=E, hidden=H, dim=D, rows=N, two_gemms_ms=two_ms, one_gemm_ms=one_ms,
                         speedup=two_ms / one_ms, one_gemm_tflops=flops / one_ms / 1e9))
        del ge
    return rows


if __name__ == "__main__":
    main()
