"""Routed experts that read token rows through their GEMMs and take the combine into their epilogues
(``[moe_echo] gathered_experts = true``).

    gathered_swiglu_combine(x_TD, w13_E2HD, w2_EDH, w_TK, layout) -> y_TD          one rank (``local``)
        y[t] = Σ_k w[t, k] · SwiGLU_{e(t, k)}(x[t])      (fp32 sum of bf16 rows, in x's dtype)
    nvlink_gathered_swiglu_combine(x_TD, w13, w2, counts_e, disp, h) -> y_TD      EP over ``nvlink``
        the same sum across ranks: each token crosses once per rank into its ``tok`` buffer (``disp.route``
        wrote the routing meta rows), the owner's experts read ``tok`` rows by index, the owner sums its
        rows per source token and the source pulls the sums; no expert-major copy of the received tokens

the value of ``combine(grouped_swiglu13(x_TD[token_of_row], ...))`` without the expert-major copy of x, and
without keeping the experts' outputs for backward. ``layout`` (``RowLayout``) is the local dispatcher's:
each expert-major row's token, each (token, choice)'s row, the experts' row offsets.

On CUDA, QuACK's grouped GEMMs (Hopper):
    forward   preact, h = x_TD[tok_N] @ [w1; w3]ᵀ       the GEMM loads token rows by index (``A_idx``),
                                                        SwiGLU in its epilogue
              y_ND = h @ w2ᵀ,  y_TD = Σ_k w · y_ND[row]  (``gather_sum``)
    backward  acc = dy_TD[tok_N] @ w2 (gathered); its epilogue applies the row's combine weight s:
              dpreact = dSwiGLU(preact, s · acc), s·h (for dw2), and reduces ds = <h, acc> per row,
              the combine weight's gradient
              dx_ND = dpreact @ [w1; w3],  dx_TD = Σ_k dx_ND[row]   (``gather_sum``)
              d[w1; w3]ᵀ = x_TD[tok_N]ᵀ @ dpreact,  dw2 = dy_TD[tok_N]ᵀ @ (s·h)  (gathered along the reduction)
Off CUDA the same decomposition runs in torch, one expert at a time (host reads: CPU tests and
references only), so the CPU tests check the algebra the kernels implement.
"""

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from components.errors import UserError
from kernels.moe_rows import gather_sum

from .dispatcher import LocalDispatcher
from .nvlink_dispatch import (NVLinkDispatcher, NVLinkHandle, grad_tokens, nvlink_capacity, pull_grad_w, send_tokens,
                              sum_back)


def check_gathered_supported(cfg, ep_size: int, device: torch.device) -> None:
    """One-line error where ``[moe_echo] gathered_experts = true`` cannot run (``cfg``: MoEEchoConfig)."""
    fix = "set gathered_experts = false"
    nvlink = cfg.dispatcher == "nvlink" or (cfg.dispatcher == "auto" and device.type == "cuda")
    if ep_size > 1 and not nvlink:
        raise UserError(f"[moe_echo] gathered_experts = true at expert_parallel_degree = {ep_size} needs the nvlink "
                        f"dispatcher (this run: {cfg.dispatcher!r}): set dispatcher = \"nvlink\", or {fix}")
    if cfg.expert_precision != "bf16":
        raise UserError(f"[moe_echo] gathered_experts = true needs expert_precision = \"bf16\": {fix}")
    if device.type == "cuda" and cfg.experts_gemm != "quack":
        raise UserError(f"[moe_echo] gathered_experts = true runs on QuACK's GEMMs on CUDA: set experts_gemm = "
                        f"\"quack\", or {fix}")


@dataclass
class RowLayout:
    """Expert-major rows of a local dispatch: N = T·K, rows of expert e at cu_E1[e]:cu_E1[e + 1]."""

    token_of_row_N: torch.Tensor  # int32
    row_of_slot_TK: torch.Tensor  # int64
    cu_E1: torch.Tensor  # int32 [E + 1], cu_E1[0] = 0

    @staticmethod
    def of(token_of_row_N: torch.Tensor, row_of_slot_TK: torch.Tensor, counts_E: torch.Tensor) -> "RowLayout":
        """From ``LocalDispatcher.rows``: the index dtypes QuACK reads, the offsets on the device."""
        cu_E1 = torch.zeros(counts_E.shape[0] + 1, dtype=torch.int32, device=counts_E.device)
        torch.cumsum(counts_E, 0, dtype=torch.int32, out=cu_E1[1:])
        return RowLayout(token_of_row_N.to(torch.int32), row_of_slot_TK, cu_E1)


def _rows_of_slots(w_TK: torch.Tensor, layout: RowLayout) -> torch.Tensor:
    """s_N: each row's combine weight (fp32, or w's dtype where wider)."""
    return _to_rows(w_TK, layout.row_of_slot_TK, layout.token_of_row_N.shape[0],
                    torch.promote_types(w_TK.dtype, torch.float32))


def _to_rows(v_UK: torch.Tensor, row_UK: torch.Tensor, N: int, dtype) -> torch.Tensor:
    """[N]: v[u, k] at row row[u, k]; entries with row -1 (a choice not here) go nowhere, rows nobody maps to
    are 0 (mask-free: -1 is sent to a spare row N)."""
    out = torch.zeros(N + 1, dtype=dtype, device=v_UK.device)
    idx = torch.where(row_UK >= 0, row_UK, N).reshape(-1).long()
    return out.scatter_(0, idx, v_UK.reshape(-1).to(dtype))[:N]


def _from_rows(v_N: torch.Tensor, row_UK: torch.Tensor) -> torch.Tensor:
    """[U, K]: v[row[u, k]], 0 where row is -1."""
    v = torch.cat([v_N, v_N.new_zeros(1)])
    return v.index_select(0, torch.where(row_UK >= 0, row_UK, v_N.shape[0]).reshape(-1).long()).view(row_UK.shape)


class _GatheredSwiGLUCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, w13_E2HD, w2_EDH, w_TK, tok_N, row_of_slot_TK, cu_E1):
        ops = _quack_ops if x_TD.is_cuda else _torch_ops
        preact_N2H, y_ND = ops.forward(x_TD, w13_E2HD, w2_EDH, tok_N, cu_E1)
        ctx.save_for_backward(x_TD, w13_E2HD, w2_EDH, w_TK, tok_N, row_of_slot_TK, cu_E1, preact_N2H)
        return gather_sum(y_ND, row_of_slot_TK, w_TK)

    @staticmethod
    def backward(ctx, dy_TD):
        x_TD, w13_E2HD, w2_EDH, w_TK, tok_N, row_of_slot_TK, cu_E1, preact_N2H = ctx.saved_tensors
        ops = _quack_ops if x_TD.is_cuda else _torch_ops
        s_N = _rows_of_slots(w_TK, RowLayout(tok_N, row_of_slot_TK, cu_E1))
        dy_TD = dy_TD.to(x_TD.dtype).contiguous()
        dx_ND, dw13, dw2, ds_N = ops.backward(dy_TD, x_TD, w13_E2HD, w2_EDH, tok_N, cu_E1, preact_N2H, s_N)
        dx_TD = gather_sum(dx_ND, row_of_slot_TK)
        dw_TK = ds_N.index_select(0, row_of_slot_TK.reshape(-1)).view_as(w_TK).to(w_TK.dtype)
        return dx_TD, dw13, dw2, dw_TK, None, None, None


def gathered_swiglu_combine(x_TD: torch.Tensor, w13_E2HD: torch.Tensor, w2_EDH: torch.Tensor, w_TK: torch.Tensor,
                            layout: RowLayout) -> torch.Tensor:
    """See the module docstring. x_TD [T, D]; w13 [E, 2H, D] ([w1; w3]); w2 [E, D, H]; w_TK [T, K] combine weights
    (differentiable); on CUDA x and the weights in bf16."""
    return _GatheredSwiGLUCombine.apply(x_TD.contiguous(), w13_E2HD, w2_EDH, w_TK, layout.token_of_row_N,
                                        layout.row_of_slot_TK, layout.cu_E1)


class _NVLinkGathered(torch.autograd.Function):
    """``nvlink`` at EP > 1: tokens cross once per rank (as ``NVLinkDispatcher.dispatch``) into ``tok``, which the
    owner's experts read by row index; the owner sums its experts' weighted outputs per source token and the
    sources pull the sums (as ``combine``). Backward: token-row gradients to the owners, the experts'
    backward on them (combine weights in its epilogue), routing-weight gradients back to the sources, and
    per-token sums of the input-row gradients pulled by the sources (as the dispatch's backward)."""

    @staticmethod
    def forward(ctx, x_TD, w_TK, w13_E2HD, w2_EDH, disp, h, counts_e):
        T, K = w_TK.shape
        cap = nvlink_capacity(T, K, disp.capacity_factor)
        send_tokens(disp, h, x_TD)  # after its barrier the meta rows written by the peers are in place too
        row_UK = h.meta_row.local
        U = row_UK.shape[0]
        tok_N = _to_rows(torch.arange(U, device=x_TD.device, dtype=torch.int32)[:, None].expand(U, K), row_UK, cap,
                         torch.int32)
        s_N = _to_rows(h.meta_w.local, row_UK, cap, torch.promote_types(w_TK.dtype, torch.float32))
        cu_E1 = RowLayout.of(tok_N, row_UK, counts_e).cu_E1
        ops = _quack_ops if x_TD.is_cuda else _torch_ops
        preact_N2H, y_ND = ops.forward(h.tok.local, w13_E2HD, w2_EDH, tok_N, cu_E1)
        sums = disp.ws.buffer(f"{disp.name}/sums/{y_ND.dtype}", tuple(h.tok.local.shape), y_ND.dtype, y_ND.device)
        ctx.save_for_backward(w13_E2HD, w2_EDH, tok_N, s_N, cu_E1, preact_N2H)
        ctx.disp, ctx.h = disp, h  # h.tok keeps the received tokens until the next step's dispatch
        return sum_back(disp, h, y_ND, sums, weighted=True, out_dtype=h.out_dtype)

    @staticmethod
    def backward(ctx, grad_TD):
        w13_E2HD, w2_EDH, tok_N, s_N, cu_E1, preact_N2H = ctx.saved_tensors
        disp, h = ctx.disp, ctx.h
        gt = grad_tokens(disp, h, grad_TD.to(h.tok.local.dtype).contiguous())
        ops = _quack_ops if grad_TD.is_cuda else _torch_ops
        dx_ND, dw13, dw2, ds_N = ops.backward(gt.local, h.tok.local, w13_E2HD, w2_EDH, tok_N, cu_E1, preact_N2H, s_N)
        grad_w_TK = pull_grad_w(disp, h, _from_rows(ds_N.to(h.w_TK.dtype), h.meta_row.local))
        # every rank has read its grad_tok (the barrier above): it now takes the per-token input-row sums
        dx_TD = sum_back(disp, h, dx_ND, gt, weighted=False, out_dtype=h.x_dtype)
        return dx_TD, grad_w_TK, dw13, dw2, None, None, None


def gathered_rows(dispatcher, x_TD: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor):
    """How the experts read this step's token rows themselves: (run, handle). run(w13, w2) -> the routed experts'
    y_TD; handle: the dispatch handle whose overflow the layer counts (None on one rank). One rank (``local``
    dispatcher: rows by index into x_TD) or EP over ``nvlink`` (tokens cross once per rank); the other
    dispatchers deliver expert-major rows only (one-line error)."""
    if isinstance(dispatcher, LocalDispatcher):
        layout = RowLayout.of(*dispatcher.rows(ids_TK))
        return functools.partial(gathered_swiglu_combine, x_TD, w_TK=w_TK, layout=layout), None
    if isinstance(dispatcher, NVLinkDispatcher):
        x_c, counts_e, h = dispatcher.route(x_TD, ids_TK, w_TK)
        return functools.partial(nvlink_gathered_swiglu_combine, x_c, counts_e=counts_e, disp=dispatcher, h=h), h
    raise UserError(f"[moe_echo] gathered_experts = true needs the local or nvlink dispatcher, not "
                    f"{type(dispatcher).__name__}: set gathered_experts = false")


def nvlink_gathered_swiglu_combine(x_TD: torch.Tensor, w13_E2HD: torch.Tensor, w2_EDH: torch.Tensor,
                                   counts_e: torch.Tensor, disp: NVLinkDispatcher, h: NVLinkHandle) -> torch.Tensor:
    """``gathered_swiglu_combine`` across the ranks of an ``nvlink`` dispatcher, after ``disp.route`` (which gave
    x_TD in the experts' dtype, counts_e and h): y_TD on each source rank, in its input's dtype. Assignments the
    capacity could not take contribute nothing (counted in h.dropped: the training loop replays the step)."""
    return _NVLinkGathered.apply(x_TD.contiguous(), h.w_TK, w13_E2HD, w2_EDH, disp, h, counts_e)


class _quack_ops:
    """QuACK's GEMMs on the device: no host read, capturable."""

    @staticmethod
    def forward(x_TD, w13, w2, tok_N, cu_E1):
        from .quack_experts import _quack

        q = _quack()
        N, H2 = tok_N.shape[0], w13.shape[1]
        preact_N2H, h_NH = x_TD.new_empty(N, H2), x_TD.new_empty(N, H2 // 2)
        q.gemm_gated_out(x_TD, w13.transpose(-2, -1), preact_N2H, h_NH, cu_seqlens_m=cu_E1, A_idx=tok_N,
                         concat_layout="B")
        return preact_N2H, q.gemm(h_NH, w2.transpose(-2, -1), cu_seqlens_m=cu_E1)

    @staticmethod
    def backward(dy_TD, x_TD, w13, w2, tok_N, cu_E1, preact_N2H, s_N):
        from .quack_experts import _quack

        q = _quack()
        dpreact_N2H = torch.empty_like(preact_N2H)
        hs_NH = x_TD.new_empty(preact_N2H.shape[0], preact_N2H.shape[1] // 2)
        ds_N = q.gemm_dgated_out(dy_TD, w2, preact_N2H, dpreact_N2H, hs_NH, colvec_scale=s_N, colvec_reduce=True,
                                 cu_seqlens_m=cu_E1, A_idx=tok_N)
        dx_ND = q.gemm(dpreact_N2H, w13, cu_seqlens_m=cu_E1, concat_layout=("B",), dynamic_scheduler=True)
        dw13 = torch.empty_like(w13)  # written as [E, D, 2H] (its transpose), gate / up rows de-interleaved
        q.gemm(x_TD.T, dpreact_N2H, out=dw13.transpose(-2, -1), cu_seqlens_k=cu_E1, A_idx=tok_N,
               concat_layout=("out",), dynamic_scheduler=True)
        dw2 = q.gemm(dy_TD.T, hs_NH, cu_seqlens_k=cu_E1, A_idx=tok_N, dynamic_scheduler=True)
        return dx_ND, dw13, dw2, ds_N


class _torch_ops:
    """The same decomposition in torch, one expert at a time (preact kept as [gate | up])."""

    @staticmethod
    def _experts(cu_E1):
        ends = cu_E1.tolist()  # host read: CPU path only
        return list(enumerate(zip(ends[:-1], ends[1:])))

    @staticmethod
    def forward(x_TD, w13, w2, tok_N, cu_E1):
        N, H2 = tok_N.shape[0], w13.shape[1]
        x_ND = x_TD.index_select(0, tok_N.long())
        preact_N2H, y_ND = x_TD.new_zeros(N, H2), x_TD.new_zeros(N, w2.shape[1])
        for e, (i0, i1) in _torch_ops._experts(cu_E1):
            preact_N2H[i0:i1] = x_ND[i0:i1] @ w13[e].t().to(x_TD.dtype)
            a, b = preact_N2H[i0:i1].chunk(2, dim=1)
            y_ND[i0:i1] = (F.silu(a) * b) @ w2[e].t().to(x_TD.dtype)
        return preact_N2H, y_ND

    @staticmethod
    def backward(dy_TD, x_TD, w13, w2, tok_N, cu_E1, preact_N2H, s_N):
        tok = tok_N.long()
        g_ND, x_ND = dy_TD.index_select(0, tok), x_TD.index_select(0, tok)
        dx_ND = torch.zeros_like(x_ND)
        dw13, dw2 = torch.zeros_like(w13), torch.zeros_like(w2)
        ds_N = torch.zeros(tok.shape[0], dtype=s_N.dtype)
        for e, (i0, i1) in _torch_ops._experts(cu_E1):
            a, b = preact_N2H[i0:i1].chunk(2, dim=1)
            sig = torch.sigmoid(a)
            h = a * sig * b
            acc = g_ND[i0:i1] @ w2[e].to(x_TD.dtype)  # dh before the combine weight
            s = s_N[i0:i1, None].to(x_TD.dtype)
            dh = acc * s
            dpre = torch.cat([dh * b * sig * (1 + a * (1 - sig)), dh * a * sig], dim=1)
            ds_N[i0:i1] = (h * acc).sum(1).to(s_N.dtype)
            dx_ND[i0:i1] = dpre @ w13[e].to(x_TD.dtype)
            dw13[e] = (dpre.t() @ x_ND[i0:i1]).to(w13.dtype)
            dw2[e] = (g_ND[i0:i1].t() @ (h * s)).to(w2.dtype)
        return dx_ND, dw13, dw2, ds_N
