"""Routed experts that read token rows through their GEMMs and take the combine into their epilogues
(``[moe_echo] gathered_experts = true``; one rank, the ``local`` dispatcher).

    gathered_swiglu_combine(x_TD, w13_E2HD, w2_EDH, w_TK, layout) -> y_TD
        y[t] = Σ_k w[t, k] · SwiGLU_{e(t, k)}(x[t])      (fp32 sum of bf16 rows, in x's dtype)

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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from components.errors import UserError
from kernels.moe_rows import gather_sum


def check_gathered_supported(cfg, ep_size: int, device: torch.device) -> None:
    """One-line error where ``[moe_echo] gathered_experts = true`` cannot run (``cfg``: MoEEchoConfig)."""
    fix = "set gathered_experts = false"
    if ep_size > 1:
        raise UserError(f"[moe_echo] gathered_experts = true runs on one EP rank (the local dispatcher); this run has "
                        f"expert_parallel_degree = {ep_size}: {fix}")
    if cfg.expert_precision != "bf16" or cfg.echo:
        raise UserError(f"[moe_echo] gathered_experts = true needs expert_precision = \"bf16\" and echo = false: {fix}")
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
    dtype = torch.promote_types(w_TK.dtype, torch.float32)
    s_N = torch.empty(layout.token_of_row_N.shape[0], dtype=dtype, device=w_TK.device)
    return s_N.scatter_(0, layout.row_of_slot_TK.reshape(-1), w_TK.reshape(-1).to(dtype))


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
