"""The FP8 row quantisers (``kernels/fp8.py``: one power-of-two scale a row) against a copy of the same bytes, at
their default launch and each tile of ``ROW_TILES`` (rows a program, warps, a row in power-of-two parts or one).

    python benchmarks/fp8_rows.py [--shapes swiglu_quant:98304x768x196608 ...] [--label L] [--out DIR]

Kernels, at v2lite_6b_2gpu's shapes by default (16384 tokens a GPU, top-6 of 64 experts, dim 2048, expert hidden
1408, two shared experts: hidden 2816):

    swiglu_quant      h = silu(a) · b of the experts' [a | b] rows, written as e4m3 rows (the down projection's
                      input); routed: ROWS of a buffer twice as long, the rest past the valid count
    swiglu_quant_bwd  [da | db] from dh and [a | b], written as e4m3 rows (the input gradient's GEMM)
    quant_rows        bf16 rows to e4m3 rows (tokens into the dense layers' and the experts' GEMMs)

A shape is KERNELxROWSxWIDTH[xBUFFER]: ROWS valid rows of WIDTH (H for the SwiGLU kernels, C for quant_rows) in a
buffer of BUFFER rows (default ROWS; larger: the rest skipped through the device count, as in the step).
``gbps`` counts the bytes each kernel must read and write once; ``vs_copy`` is a ``copy_`` of as many bytes
(read + write) over the kernel's time (1: at the ceiling). Every time is a CUDA graph's replay; every tile's
output is checked byte-equal to the default's.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import environment, graphed, markdown_table, time_ms, write_results  # noqa: E402
from kernels.fp8 import ROW_TILES, quant_rows, swiglu_quant, swiglu_quant_bwd  # noqa: E402

KERNELS = ("swiglu_quant", "swiglu_quant_bwd", "quant_rows")
DEFAULT_SHAPES = ("swiglu_quant:98304x1408x196608", "swiglu_quant:16384x2816", "swiglu_quant_bwd:98304x1408x196608",
                  "swiglu_quant_bwd:16384x2816", "quant_rows:16384x2048", "quant_rows:16384x3072",
                  "quant_rows:98304x2048x196608")


def _shape(text: str) -> tuple[str, int, int, int]:
    kernel, _, dims = text.partition(":")
    sizes = dims.split("x")
    if kernel not in KERNELS or len(sizes) not in (2, 3) or not all(d.isdigit() for d in sizes):
        raise argparse.ArgumentTypeError(f"shape {text!r}: want KERNEL:ROWSxWIDTH[xBUFFER], KERNEL one of "
                                         f"{', '.join(KERNELS)} (e.g. {DEFAULT_SHAPES[0]})")
    rows, width, *buf = (int(d) for d in sizes)
    return kernel, rows, width, buf[0] if buf else rows


def _case(kernel: str, rows: int, width: int, buffer: int):
    """(fn(tile) -> outputs, bytes moved once) for one shape."""
    n = torch.tensor([rows], dtype=torch.int32, device="cuda") if buffer > rows else None
    if kernel == "quant_rows":
        x = torch.randn(buffer, width, device="cuda", dtype=torch.bfloat16)
        return (lambda t: quant_rows(x, n, tile=t)), rows * (3 * width + 4)
    ab = torch.randn(buffer, 2 * width, device="cuda", dtype=torch.bfloat16)
    if kernel == "swiglu_quant":
        return (lambda t: swiglu_quant(ab, n, bf16=False, tile=t)), rows * (5 * width + 4)
    dh = torch.randn(buffer, width, device="cuda", dtype=torch.bfloat16)
    return (lambda t: swiglu_quant_bwd(dh, ab, n, bf16=False, tile=t)), rows * (8 * width + 4)


def _bytes_of(outputs, rows: int) -> list[torch.Tensor]:
    return [o[:rows].reshape(rows, -1).view(torch.uint8) for o in outputs if o is not None]


def measure(kernel: str, rows: int, width: int, buffer: int) -> list[dict]:
    fn, nbytes = _case(kernel, rows, width, buffer)
    out = []
    want = None
    for tile in (None, *ROW_TILES):
        got = _bytes_of(fn(tile), rows)
        if want is None:
            want = got
        elif not all(torch.equal(a, b) for a, b in zip(got, want)):
            raise SystemExit(f"fp8_rows: tile {tile} differs from the default for {kernel} at {rows}x{width}")
        ms = time_ms(graphed(lambda t=tile: fn(t)), warmup=5, iters=30)
        out.append(dict(kernel=kernel, rows=rows, width=width, buffer=buffer, variant=tile or "default", ms=ms,
                        gbps=nbytes / ms / 1e6))
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ceiling = time_ms(graphed(lambda: dst.copy_(src)), warmup=5, iters=30)
    out.append(dict(kernel=kernel, rows=rows, width=width, buffer=buffer, variant="copy", ms=ceiling,
                    gbps=nbytes / ceiling / 1e6))
    for r in out:
        r["vs_copy"] = ceiling / r["ms"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", type=_shape, default=[_shape(s) for s in DEFAULT_SHAPES],
                   help="KERNEL:ROWSxWIDTH[xBUFFER], one or more (defaults: v2lite_6b_2gpu's)")
    p.add_argument("--label", default="", help="results name: fp8_rows_<label> (e.g. the config of --shapes)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        raise SystemExit("fp8_rows: needs a Hopper (compute capability 9.0+) GPU")
    rows = [r for shape in args.shapes for r in measure(*shape)]
    table = markdown_table(rows, ["kernel", "rows", "width", "buffer", "variant", "ms", "gbps", "vs_copy"])
    print(table)
    write_results("fp8_rows" + (f"_{args.label}" if args.label else ""), environment(), rows, table, args.out)


if __name__ == "__main__":
    main()
