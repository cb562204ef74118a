"""``deepep`` dispatcher: DeepEP's intranode (NVLink) normal-mode kernels, when ``deep_ep`` is installed.

    dispatch: deep_ep.Buffer.dispatch sends each token once to every rank hosting one of its
              experts ─► recv_x_MD (M unique tokens here), recv ids (local expert or -1), weights;
              the M tokens are then expanded to (token, local expert) rows, expert-major (local sort)
    combine:  rows ─Σ_k w · y (fp32) per received token─► Buffer.combine sums the ranks' parts ─► y_TD

Backward of dispatch is DeepEP's combine of the row gradients (and of the weight gradients), and
backward of combine is DeepEP's dispatch of the output gradient with the cached handle, as DeepEP
documents for training. DeepEP's normal mode reads the received counts on the host (it sizes
``recv_x``), so this backend is exact but not sync-free — like ``alltoall``, it cannot be captured
in a CUDA graph.

Not exercised on this project's machines: their image has no ``deep_ep`` (it needs a CUDA build
that the offline machines cannot fetch). Selecting it without ``deep_ep`` stops with one line.
"""

from dataclasses import dataclass

import torch

from .dispatcher import DispatchHandle, ExpertParallel, LocalDispatcher
from .row_ops import weighted_combine


def require_deep_ep():
    try:
        import deep_ep  # noqa: F401
    except ImportError:
        from components.errors import UserError

        raise UserError("[moe_echo] dispatcher = 'deepep' needs the deep_ep package (github.com/deepseek-ai/DeepEP, "
                        "built for this GPU); install it or use dispatcher = 'nvlink'") from None
    return deep_ep


_buffers: dict = {}


def _buffer(group, hidden_bytes: int):
    deep_ep = require_deep_ep()
    key = (group.group_name, hidden_bytes)
    if key not in _buffers:
        size = max(cfg.get_nvl_buffer_size_hint(hidden_bytes, group.size())
                   for cfg in (deep_ep.Buffer.get_dispatch_config(group.size()),
                               deep_ep.Buffer.get_combine_config(group.size())))
        _buffers[key] = deep_ep.Buffer(group, size, 0)
    return _buffers[key]


@dataclass
class DeepEPHandle(DispatchHandle):
    handle: object
    local: object  # LocalHandle of the received tokens' expansion
    w_MK: torch.Tensor
    row_MK: torch.Tensor  # row of each received (token, choice) among the expert rows; -1: not local
    out_dtype: torch.dtype  # DeepEP never drops: dropped stays None


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, w_TK, ids_TK, buf, E):
        n_rank, _, n_expert, in_rank, _ = buf.get_dispatch_layout(ids_TK, E)
        recv_x, recv_ids, recv_w, _, handle, _ = buf.dispatch(
            x_TD, topk_idx=ids_TK, topk_weights=w_TK, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=n_expert)
        ctx.buf, ctx.handle = buf, handle
        ctx.mark_non_differentiable(recv_ids)
        return recv_x, recv_w, recv_ids, handle

    @staticmethod
    def backward(ctx, grad_x, grad_w, _ids, _handle):
        gx, gw, _ = ctx.buf.combine(grad_x.contiguous(), ctx.handle, topk_weights=grad_w.contiguous())
        return gx, gw, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_MD, buf, handle):
        ctx.buf, ctx.handle = buf, handle
        y_TD, _, _ = buf.combine(y_MD.contiguous(), handle)
        return y_TD

    @staticmethod
    def backward(ctx, grad_TD):
        grad_MD, *_ = ctx.buf.dispatch(grad_TD.contiguous(), handle=ctx.handle)
        return grad_MD, None, None


class DeepEPDispatcher(ExpertParallel):
    def __init__(self, num_experts: int, group, ep_size: int):
        require_deep_ep()
        super().__init__(num_experts, group, ep_size)
        self.local = LocalDispatcher(self.num_local + 1)  # + one sink id for "not on this rank"

    def dispatch(self, x_TD, ids_TK, w_TK):
        buf = _buffer(self.group, x_TD.shape[1] * x_TD.element_size())
        recv_x, recv_w, recv_ids, handle = _Dispatch.apply(x_TD, w_TK.float(), ids_TK.long(), buf, self.num_experts)
        ids = torch.where(recv_ids >= 0, recv_ids, self.num_local)  # the sink collects non-local slots
        x_ND, counts, local = self.local.dispatch(recv_x, ids, recv_w)
        row_MK = torch.where(recv_ids >= 0, local.row_of_slot_TK, -1)
        return x_ND, counts[: self.num_local], DeepEPHandle(handle, local, recv_w, row_MK, x_TD.dtype)

    def combine(self, y_ND, h: DeepEPHandle):
        y_MD = weighted_combine(y_ND, h.w_MK, h.row_MK).to(h.out_dtype)  # sink rows (past the experts) unread
        return _Combine.apply(y_MD, self._buf(y_MD), h.handle)

    def _buf(self, y):
        return _buffer(self.group, y.shape[1] * y.element_size())
