"""``deepep`` dispatcher: DeepEP's intranode (NVLink) normal-mode kernels, when ``deep_ep`` is installed.

    dispatch: deep_ep.Buffer.dispatch sends each token once to every rank hosting one of its
              experts ─► recv_x_MD (M unique tokens here), recv ids (local expert or -1), weights;
              the M tokens are then expanded to (token, local expert) rows, expert-major (local sort)
    combine:  rows ─Σ_k w · y (fp32) per received token─► Buffer.combine sums the ranks' parts ─► y_TD

Backward of dispatch is DeepEP's combine of the row gradients (and of the weight gradients), and
backward of combine is DeepEP's dispatch of the output gradient with the cached handle, as DeepEP
documents for training. DeepEP's normal mode reads the received counts on the host (it sizes
``recv_x``), so this backend never drops but is not sync-free — like ``alltoall``, it cannot be captured
in a CUDA graph.

DeepEP's combine reduces bf16 rows only (in fp32, bf16 out): the per-token sums and the input gradient
cross back rounded to bf16 whatever x's dtype (dispatch, its cached form in backward and the weights'
sums move x's dtype and fp32 exactly). SMs: ``num_sms``, set through ``deep_ep.Buffer.set_num_sms`` before
each dispatch (None: Buffer.num_sms as it is, DeepEP's default 20); each handle keeps the configs it ran with.

``deep_ep`` is not in the GPU image: benchmarks/gpu/build_deepep.sh builds its intranode kernels
(no NVSHMEM) offline from a source tree. Selecting it without ``deep_ep`` stops with one line.
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
    """(Buffer, dispatch config, combine config) for this group, row size and DeepEP's SM budget now: the
    buffer holds the larger of the two configs' NVLink size hints (they grow with the SMs)."""
    deep_ep = require_deep_ep()
    key = (group.group_name, hidden_bytes, deep_ep.Buffer.num_sms)
    if key not in _buffers:
        R = group.size()
        cfgs = deep_ep.Buffer.get_dispatch_config(R), deep_ep.Buffer.get_combine_config(R)
        size = max(cfg.get_nvl_buffer_size_hint(hidden_bytes, R) for cfg in cfgs)
        _buffers[key] = (deep_ep.Buffer(group, size, 0, explicitly_destroy=True), *cfgs)
    return _buffers[key]


def release_buffers() -> None:
    """Free DeepEP's buffers. Collective: every rank calls it, in the same order, before the process group goes
    (where nobody does, the process's exit frees them and DeepEP prints a warning)."""
    for buf, *_ in _buffers.values():
        buf.destroy()
    _buffers.clear()


@dataclass
class DeepEPHandle(DispatchHandle):
    handle: object
    local: object  # LocalHandle of the received tokens' expansion
    w_MK: torch.Tensor
    row_MK: torch.Tensor  # row of each received (token, choice) among the expert rows; -1: not local
    out_dtype: torch.dtype  # DeepEP never drops: dropped stays None
    buf: object  # the deep_ep.Buffer and the configs this dispatch ran with (combine reuses them)
    cfg_d: object
    cfg_c: object


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, w_TK, ids_TK, buf, cfg_d, cfg_c, E):
        n_rank, _, n_expert, in_rank, _ = buf.get_dispatch_layout(ids_TK, E)
        recv_x, recv_ids, recv_w, _, handle, _ = buf.dispatch(
            x_TD, topk_idx=ids_TK, topk_weights=w_TK, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=n_expert, config=cfg_d)
        ctx.buf, ctx.cfg_c, ctx.handle = buf, cfg_c, handle
        ctx.mark_non_differentiable(recv_ids)
        return recv_x, recv_w, recv_ids, handle

    @staticmethod
    def backward(ctx, grad_x, grad_w, _ids, _handle):
        gx, gw, _ = ctx.buf.combine(grad_x.to(torch.bfloat16).contiguous(), ctx.handle,
                                    topk_weights=grad_w.float().contiguous(), config=ctx.cfg_c)
        return gx.to(grad_x.dtype), gw, None, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_MD, buf, cfg_d, cfg_c, handle, out_dtype):
        ctx.buf, ctx.cfg_d, ctx.handle, ctx.y_dtype = buf, cfg_d, handle, y_MD.dtype
        y_TD, _, _ = buf.combine(y_MD.to(torch.bfloat16).contiguous(), handle, config=cfg_c)
        return y_TD.to(out_dtype)

    @staticmethod
    def backward(ctx, grad_TD):
        grad_MD, *_ = ctx.buf.dispatch(grad_TD.contiguous(), handle=ctx.handle, config=ctx.cfg_d)
        return grad_MD.to(ctx.y_dtype), None, None, None, None, None


class DeepEPDispatcher(ExpertParallel):
    def __init__(self, num_experts: int, group, ep_size: int, num_sms: int | None = None):
        require_deep_ep()
        super().__init__(num_experts, group, ep_size)
        self.num_sms = num_sms  # even; None: DeepEP's Buffer.num_sms as it is
        self.local = LocalDispatcher(self.num_local + 1)  # + one sink id for "not on this rank"

    def dispatch(self, x_TD, ids_TK, w_TK):
        deep_ep = require_deep_ep()
        if self.num_sms is not None:
            deep_ep.Buffer.set_num_sms(self.num_sms)
        buf, cfg_d, cfg_c = _buffer(self.group, x_TD.shape[1] * x_TD.element_size())
        ids_TK = ids_TK.to(getattr(deep_ep, "topk_idx_t", torch.int64)).contiguous()
        recv_x, recv_w, recv_ids, handle = _Dispatch.apply(x_TD.contiguous(), w_TK.float().contiguous(), ids_TK,
                                                           buf, cfg_d, cfg_c, self.num_experts)
        ids = torch.where(recv_ids >= 0, recv_ids, self.num_local)  # the sink collects non-local slots
        x_ND, counts, local = self.local.dispatch(recv_x, ids, recv_w)
        row_MK = torch.where(recv_ids >= 0, local.row_of_slot_TK, -1)
        return x_ND, counts[: self.num_local], DeepEPHandle(handle, local, recv_w, row_MK, x_TD.dtype, buf, cfg_d,
                                                             cfg_c)

    def combine(self, y_ND, h: DeepEPHandle):
        y_MD = weighted_combine(y_ND, h.w_MK, h.row_MK)  # summed in fp32; sink rows (past the experts) unread
        return _Combine.apply(y_MD, h.buf, h.cfg_d, h.cfg_c, h.handle, h.out_dtype)
