"""What an FP8 GEMM costs when its operands are not stored along the reduction dimension, on one Hopper GPU.

Hopper's FP8 tensor-core instructions read both operands K-major (contiguous along the reduction dimension); a
weight gradient contracts over token rows, which every producer in the step writes row by row, so its operands
arrive M- and N-major and a transposed copy is made today (torchao's casts, the experts' bf16 weight gradients).
This times one Triton GEMM kernel, C[M, N] = A[M, K] @ B[K, N], with each operand K-major or MN-major, in e4m3 and
in bf16 (whose instructions read either layout), beside torch's GEMMs of the same shapes (``torch._scaled_mm`` for
FP8 takes only K-major operands). Rows: median ms (``triton.testing.do_bench``), TFLOP/s, and the rate as a fraction
of the same dtype's K-major Triton row.

    python benchmarks/fp8_operand_layout.py [--shapes 2048x2048x32768,8192x8192x8192]
"""

import argparse

import torch

from benchmarks.common import environment, markdown_table, write_results

try:
    import triton
    import triton.language as tl
except ImportError:  # the script runs on a GPU machine; the module imports anywhere
    triton = None

if triton is not None:
    CONFIGS = [triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_stages=s, num_warps=w)
               for bm, bn, bk, s, w in ((128, 256, 128, 3, 8), (128, 128, 128, 4, 8), (128, 256, 64, 4, 8),
                                        (128, 128, 64, 4, 4), (64, 256, 128, 3, 4))]

    @triton.autotune(configs=CONFIGS, key=["M", "N", "K", "sam", "sak", "sbk", "sbn"])
    @triton.jit
    def _mm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, sam, sak, sbk, sbn, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        a = a_ptr + rm[:, None].to(tl.int64) * sam + rk[None, :].to(tl.int64) * sak
        b = b_ptr + rk[:, None].to(tl.int64) * sbk + rn[None, :].to(tl.int64) * sbn
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for _ in range(0, K, BK):  # M, N, K multiples of the blocks: no masks
            acc = tl.dot(tl.load(a), tl.load(b), acc)
            a += BK * sak
            b += BK * sbk
        tl.store(c_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc.to(c_ptr.dtype.element_ty))


def triton_mm(a_MK: torch.Tensor, b_KN: torch.Tensor) -> torch.Tensor:
    """a @ b in bf16 out, for any strides of a and b (views of K-major or MN-major storage)."""
    M, K = a_MK.shape
    N = b_KN.shape[1]
    c = torch.empty(M, N, dtype=torch.bfloat16, device=a_MK.device)
    grid = lambda meta: (M // meta["BM"], N // meta["BN"])
    _mm_kernel[grid](a_MK, b_KN, c, M, N, K, a_MK.stride(0), a_MK.stride(1), b_KN.stride(0), b_KN.stride(1))
    return c


def operands(M: int, N: int, K: int, dtype: torch.dtype, a_kmajor: bool, b_kmajor: bool):
    """A [M, K] and B [K, N] as views of storage contiguous along K (K-major) or along M / N."""
    a = torch.randn(M, K, device="cuda") if a_kmajor else torch.randn(K, M, device="cuda").t()
    b = torch.randn(N, K, device="cuda").t() if b_kmajor else torch.randn(K, N, device="cuda")
    return (a * 0.5).to(dtype), (b * 0.5).to(dtype)


def bench(fn) -> float:
    return triton.testing.do_bench(fn, return_mode="median")


def check(dtype: torch.dtype, a_kmajor: bool, b_kmajor: bool, M: int = 256, N: int = 512, K: int = 1024) -> None:
    """The kernel computes the product in this layout: within 1e-2 of fp32's on the same (rounded) operands."""
    a, b = operands(M, N, K, dtype, a_kmajor, b_kmajor)
    want = a.float() @ b.float()
    err = float((triton_mm(a, b).float() - want).norm() / want.norm())
    assert err < 1e-2, (dtype, a_kmajor, b_kmajor, err)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="2048x2048x32768,8192x8192x8192", help="MxNxK, comma-separated")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = p.parse_args()
    fp8 = torch.float8_e4m3fn
    rows = []
    for shape in args.shapes.split(","):
        M, N, K = map(int, shape.split("x"))
        flops = 2 * M * N * K
        base = {}
        for dtype, name in ((fp8, "e4m3"), (torch.bfloat16, "bf16")):
            for a_k, b_k in ((True, True), (True, False), (False, True), (False, False)):
                check(dtype, a_k, b_k)
                a, b = operands(M, N, K, dtype, a_k, b_k)
                ms = bench(lambda: triton_mm(a, b))
                layout = f"A {'K' if a_k else 'M'}-major, B {'K' if b_k else 'N'}-major"
                if a_k and b_k:
                    base[name] = ms
                rows.append({"shape": shape, "dtype": name, "layout": layout, "kernel": "triton", "ms": round(ms, 3),
                             "tflops": int(flops / ms / 1e9), "vs_k_major": round(base[name] / ms, 3)})
        a, b = operands(M, N, K, fp8, True, True)
        one = torch.ones((), device="cuda")
        ms = bench(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
        rows.append({"shape": shape, "dtype": "e4m3", "layout": "A K-major, B K-major", "kernel": "torch._scaled_mm",
                     "ms": round(ms, 3), "tflops": int(flops / ms / 1e9), "vs_k_major": round(base["e4m3"] / ms, 3)})
        a, b = operands(M, N, K, torch.bfloat16, False, False)
        ms = bench(lambda: a @ b)
        rows.append({"shape": shape, "dtype": "bf16", "layout": "A M-major, B N-major", "kernel": "torch.mm",
                     "ms": round(ms, 3), "tflops": int(flops / ms / 1e9), "vs_k_major": round(base["bf16"] / ms, 3)})
    table = markdown_table(rows, ["shape", "dtype", "layout", "kernel", "ms", "tflops", "vs_k_major"])
    print(table)
    print(write_results("fp8_operand_layout", environment(), rows, table, args.out))


if __name__ == "__main__":
    main()
