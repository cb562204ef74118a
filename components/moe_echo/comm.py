"""Differentiable collectives for expert-parallel dispatch (NCCL or gloo)."""

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group, ctx.in_rows = (out_splits, in_splits), group, x.shape[0]
        rows = sum(out_splits) if out_splits is not None else x.shape[0]
        out = x.new_empty((rows, *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty((ctx.in_rows, *grad.shape[1:]))
        dist.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None, group) -> torch.Tensor:
    """Rows of ``x`` split by ``in_splits`` go to the ranks of ``group``; ``None`` splits = equal blocks."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def exchange_counts(counts_Re: torch.Tensor, group) -> torch.Tensor:
    """counts_Re[r, j] (rows this rank sends to rank r's expert j) → recv[s, j] (rows rank s sends us)."""
    recv = torch.empty_like(counts_Re)
    dist.all_to_all_single(recv, counts_Re.contiguous(), group=group)
    return recv
