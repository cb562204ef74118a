"""The experts' weight-gradient operands transposed in e4m3 (``kernels/fp8_wgrad.requant_expert_t``) against the
bandwidth ceiling: how close each requantiser tile comes to a plain copy of the same bytes.

    python benchmarks/fp8_requant.py --shapes 64x2048x98304 32x1408x98304

A shape is EXPERTSxCOLUMNSxROWS: ROWS e4m3 rows of COLUMNS (one operand: x and dy have the model's dim, h the
experts' hidden width, [da | db] twice that), routed uniformly over EXPERTS. Rows:

    requant_<tile>  the experts' scales plus the transposed copy at each tile of ``REQUANT_TILES`` (what a weight
                    gradient in FP8 adds per operand)
    scales          ``expert_scales`` alone: the kernel that also writes the aligned offsets (part of each requant
                    row); scales_<tile>: the same at each tile of ``SCALE_TILES``
    copy            ``torch.Tensor.copy_`` of the same bytes, not transposed: the ceiling
    transpose       ``kernels/fp8.transpose_copy_``: the same bytes transposed, no scale and no expert blocks
    torch_t         ``x.t().contiguous()`` on the bytes

``gbps`` counts the bytes read and written once (the rows, and the copy's used columns); ``vs_copy`` is the copy's
time over the row's (1: at the ceiling). Every time is a CUDA graph's replay; every requantiser tile's output is
checked equal to the default tile's first.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import environment, graphed, markdown_table, shape_arg, time_ms, write_results  # noqa: E402
from kernels.fp8 import quant_rows, transpose_copy_  # noqa: E402
from kernels.fp8_wgrad import (REQUANT_DEFAULT, REQUANT_TILES, SCALE_DEFAULT, SCALE_TILES, expert_scales,  # noqa: E402
                               requant_expert_t)


_shape = shape_arg("EXPERTSxCOLUMNSxROWS", "64x2048x98304")


def measure(E: int, C: int, R: int) -> list[dict]:
    """One row per variant at R rows of C columns over E experts (uniform counts, remainder on the first)."""
    counts_E = torch.full((E,), R // E, dtype=torch.int64)
    counts_E[0] += R - int(counts_E.sum())
    offs_E = torch.cumsum(counts_E, 0).to(torch.int32).cuda()
    q_RC, s_R = quant_rows(torch.randn(R, C, device="cuda", dtype=torch.bfloat16))
    q_RC.view(torch.uint8)[::11] = 0  # zero rows (ignored tokens' gradients) as the step has them
    s_R[::11] = 1.0
    nbytes = 2 * R * C  # read once, written once
    out = []

    def row(variant, fn):
        ms = time_ms(graphed(fn), warmup=5, iters=30)
        out.append(dict(experts=E, columns=C, rows=R, variant=variant, ms=ms, gbps=nbytes / ms / 1e6))

    want = requant_expert_t(q_RC, s_R, offs_E, REQUANT_DEFAULT)
    used = int(want[2][-1])
    for tile in REQUANT_TILES:
        got = requant_expert_t(q_RC, s_R, offs_E, tile)
        if not (torch.equal(got[1], want[1])
                and torch.equal(got[0][:, :used].view(torch.uint8), want[0][:, :used].view(torch.uint8))):
            raise SystemExit(f"fp8_requant: tile {tile} differs from {REQUANT_DEFAULT} at {E}x{C}x{R}")
        row(f"requant_{tile}", lambda t=tile: requant_expert_t(q_RC, s_R, offs_E, t))
    row("scales", lambda: expert_scales(q_RC, s_R, offs_E))
    for tile in SCALE_TILES:
        if not torch.equal(expert_scales(q_RC, s_R, offs_E, tile), want[1]):
            raise SystemExit(f"fp8_requant: scale tile {tile} differs from {SCALE_DEFAULT} at {E}x{C}x{R}")
        row(f"scales_{tile}", lambda t=tile: expert_scales(q_RC, s_R, offs_E, t))
    src = q_RC.view(torch.uint8)
    dst = torch.empty_like(src)
    row("copy", lambda: dst.copy_(src))
    dst_t = torch.empty(C, R, dtype=torch.uint8, device="cuda")
    transpose_copy_(src[None], dst_t[None])
    if not torch.equal(dst_t, src.t()):
        raise SystemExit("fp8_requant: transpose_copy_ is not the transpose")
    row("transpose", lambda: transpose_copy_(src[None], dst_t[None]))
    row("torch_t", lambda: src.t().contiguous())
    ceiling = next(r["ms"] for r in out if r["variant"] == "copy")
    for r in out:
        r["vs_copy"] = ceiling / r["ms"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", type=_shape,
                   default=[_shape(s) for s in ("64x2048x98304", "64x1536x98304", "64x768x98304", "32x2816x98304",
                                                "32x1408x98304")],
                   help="EXPERTSxCOLUMNSxROWS, one or more (defaults: v2lite_1b's and v2lite_6b_2gpu's operands)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        raise SystemExit("fp8_requant: needs a Hopper (compute capability 9.0+) GPU")
    rows = [r for shape in args.shapes for r in measure(*shape)]
    table = markdown_table(rows, ["experts", "columns", "rows", "variant", "ms", "gbps", "vs_copy"])
    print(table)
    write_results("fp8_requant", environment(), rows, table, args.out)


if __name__ == "__main__":
    main()
