"""Differentiable collectives for expert-parallel dispatch (NCCL or gloo).

    all_to_all(x, out_splits, in_splits, group, wire="bf16", grad_wire="bf16")
        rows of x to the ranks of group (the gradient goes back the reverse way). A ``"fp8"`` wire (forward:
        ``wire``, backward: ``grad_wire``): each row crosses as D e4m3 bytes and one fp32 scale per 128
        columns, powers of two (so a row already on the grid crosses again unchanged), and arrives dequantised
        in the sent dtype: D + D/32 bytes a row instead of 2·D. Autograd sees the rows as if they had crossed
        exactly (straight through the quantisation).
"""

import torch
import torch.distributed as dist

from kernels.fp8 import FP8, dequant_blocks, quant_blocks


WIRE_BLOCK = 128  # columns per scale of an fp8 wire row (1×128 tiles)


def wire_scales(D: int) -> int:
    """Scales of an fp8 wire row of width D: one per WIRE_BLOCK columns."""
    return -(-D // WIRE_BLOCK)


def fp8_rows(x_ND: torch.Tensor, align: int = 1) -> torch.Tensor:
    """[N, P] uint8, P = round_up(D + 4·B, align), B = wire_scales(D): each row in e4m3, every WIRE_BLOCK columns
    divided by their power-of-two scale (their absolute max / 448, rounded up to a power of two; 1 where all are
    zero), then the B scales as fp32 bytes, then zeros. On CUDA one Triton kernel (kernels/fp8.py
    ``quant_blocks``) writes both parts in place where D and P are multiples of 4."""
    N, D = x_ND.shape
    B = wire_scales(D)
    P = -(-(D + 4 * B) // align) * align
    packed = torch.empty(N, P, dtype=torch.uint8, device=x_ND.device)
    if P > D + 4 * B:
        packed[:, D + 4 * B:].zero_()
    if D % 4 == 0 and P % 4 == 0:
        quant_blocks(x_ND, WIRE_BLOCK, out=(packed[:, :D].view(FP8), packed.view(torch.float32)[:, D // 4:D // 4 + B]))
    else:
        q_ND, s_NB = quant_blocks(x_ND, WIRE_BLOCK)
        packed[:, :D] = q_ND.view(torch.uint8)
        packed[:, D:D + 4 * B] = s_NB.view(torch.uint8)
    return packed


def fp8_parts(packed: torch.Tensor, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, D] e4m3, s [N, B] fp32): views of fp8_rows' values and scales (the scales copied out where they are
    not 4-byte aligned)."""
    B = wire_scales(D)
    tail = packed[:, D:D + 4 * B]
    if tail.storage_offset() % 4 or (tail.shape[0] > 1 and tail.stride(0) % 4):  # not viewable as fp32
        tail = torch.empty_like(tail, memory_format=torch.contiguous_format).copy_(tail)
    return packed[:, :D].view(FP8), tail.view(torch.float32)


def rows_of_fp8(packed: torch.Tensor, dtype: torch.dtype, D: int | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, D] in ``dtype`` (``out``, contiguous, where given): fp8_rows' rows dequantised (exact in bf16 and wider:
    the scales are powers of two). ``D``: the row width (default: the widest whose D + 4·B bytes fit the row)."""
    if D is None:
        D = packed.shape[1] - 4 * wire_scales(packed.shape[1])
        while D + 1 + 4 * wire_scales(D + 1) <= packed.shape[1]:
            D += 1
    out = torch.empty(packed.shape[0], D, dtype=dtype, device=packed.device) if out is None else out
    return dequant_blocks(*fp8_parts(packed, D), WIRE_BLOCK, out)


def _exchange(x: torch.Tensor, out_splits, in_splits, group, wire: str) -> torch.Tensor:
    """One all_to_all_single of the rows of ``x`` (``wire = "fp8"``: packed by fp8_rows, then dequantised)."""
    send = fp8_rows(x) if wire == "fp8" else x.contiguous()
    rows = sum(out_splits) if out_splits is not None else x.shape[0]
    out = send.new_empty((rows, *send.shape[1:]))
    dist.all_to_all_single(out, send, out_splits, in_splits, group=group)
    return rows_of_fp8(out, x.dtype, D=x.shape[1]) if wire == "fp8" else out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, wire, grad_wire):
        ctx.splits, ctx.group, ctx.grad_wire = (out_splits, in_splits), group, grad_wire
        return _exchange(x, out_splits, in_splits, group, wire)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group, ctx.grad_wire), None, None, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None, group,
               wire: str = "bf16", grad_wire: str = "bf16") -> torch.Tensor:
    """Rows of ``x`` split by ``in_splits`` go to the ranks of ``group``; ``None`` splits = equal blocks;
    an ``"fp8"`` ``wire`` / ``grad_wire``: the rows / their gradients cross in e4m3 with a scale per 128 columns."""
    return _AllToAll.apply(x, out_splits, in_splits, group, wire, grad_wire)


def exchange_counts(counts_Re: torch.Tensor, group) -> torch.Tensor:
    """counts_Re[r, j] (rows this rank sends to rank r's expert j) → recv[s, j] (rows rank s sends us)."""
    recv = torch.empty_like(counts_Re)
    dist.all_to_all_single(recv, counts_Re.contiguous(), group=group)
    return recv
