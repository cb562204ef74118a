"""The router after its gate GEMM, fused: scores, expert bias, top-k and normalisation in one kernel each way.

    route_topk(logits_TE, bias_E, K, score_func, route_norm, route_scale) -> (scores_TE, ids_TK, w_TK)

    scores_TE = softmax(logits_TE) over E   |   sigmoid(logits_TE)              (fp32; kept for backward and
                                                                                  the sequence auxiliary loss)
    ids_TK    = top-k of scores_TE + bias_E  (the bias only chooses: DeepSeek-V3's aux-loss-free balancing;
                K distinct experts; among equal keys the lowest expert id first)
    w_TK      = scores_TE[ids_TK], / (Σ_k + 1e-20) if route_norm, × route_scale (fp32)

Backward (gradients of w_TK and, where the auxiliary loss uses them, of scores_TE):

    g_raw_TK  = scale · (g_w / Z − Σ_j g_w_j · w_raw_j / Z²)  with Z = Σ_k w_raw_k + 1e-20   (route_norm)
                scale · g_w                                                            (otherwise)
    g_s_TE    = g_scores_TE + Σ_k onehot(ids_TK[:, k]) · g_raw_TK[:, k]
    g_logits  = s · (g_s − Σ_e s_e · g_s_e)   (softmax)   |   g_s · s · (1 − s)   (sigmoid)

The same outputs as TopKRouter's torch path without expert groups (components/moe_echo/router.py; the tests
compare the two). One program per block of tokens holds its rows' E scores in registers: the logits are read
once and the scores written once forward, the scores read and the logit gradient written once backward. A row
whose scores hold NaN (a diverged step) still gets K distinct ids in [0, E): no out-of-range index reaches the
dispatcher, and the non-finite gate skips the step. No host read, static shapes: capturable in a CUDA graph.
Triton on CUDA (and under TRITON_INTERPRET=1), fp32 logits, E ≤ MAX_EXPERTS; the router keeps its torch path
elsewhere.
"""

import torch

from .moe_rows import _use_triton, triton

MAX_EXPERTS = 1024  # a block of rows keeps BLOCK_E scores per row in registers
MAX_TOP_K = 32  # the top-k loop is unrolled K times

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _scores(x, SIGMOID: tl.constexpr):
        """softmax over the last axis (columns at -inf count as zero) or the elementwise sigmoid."""
        if SIGMOID:
            return 1.0 / (1.0 + tl.exp(-x))
        m = tl.max(x, 1)
        p = tl.exp(x - m[:, None])
        return p / tl.sum(p, 1)[:, None]

    @triton.jit
    def _route_fwd_kernel(logits_ptr, bias_ptr, scores_ptr, ids_ptr, w_ptr, T, E, logits_stride, route_scale,
                          K: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, ROUTE_NORM: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, BLOCK_E)
        kcols = tl.arange(0, BLOCK_K)
        row_ok = rows < T
        col_ok = cols < E
        ok = row_ok[:, None] & col_ok[None, :]
        x = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * logits_stride + cols[None, :], mask=ok,
                    other=float("-inf")).to(tl.float32)
        s = tl.where(col_ok[None, :], _scores(x, SIGMOID), 0.0)
        tl.store(scores_ptr + rows.to(tl.int64)[:, None] * E + cols[None, :], s, mask=ok)
        key = s
        if HAS_BIAS:
            key = key + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        free = ok  # columns not chosen yet
        ids = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
        w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
        for k in tl.static_range(K):
            key = tl.where(free, key, float("-inf"))
            best = tl.max(key, 1)
            pick = tl.min(tl.where(free & (key == best[:, None]), cols[None, :], BLOCK_E), 1)
            first_free = tl.min(tl.where(free, cols[None, :], BLOCK_E), 1)
            pick = tl.where(pick < BLOCK_E, pick, first_free)  # a NaN key: still a distinct id in range
            pick = tl.minimum(pick, E - 1)  # rows past T (never stored)
            chosen = cols[None, :] == pick[:, None]
            free = free & ~chosen
            ids = tl.where(kcols[None, :] == k, pick[:, None], ids)
            w = tl.where(kcols[None, :] == k, tl.sum(tl.where(chosen, s, 0.0), 1)[:, None], w)
        if ROUTE_NORM:
            w = w / (tl.sum(w, 1)[:, None] + 1e-20)
        w = w * route_scale
        out = row_ok[:, None] & (kcols[None, :] < K)
        offs = rows.to(tl.int64)[:, None] * K + kcols[None, :]
        tl.store(ids_ptr + offs, ids.to(tl.int64), mask=out)
        tl.store(w_ptr + offs, w, mask=out)

    @triton.jit
    def _route_bwd_kernel(scores_ptr, ids_ptr, g_w_ptr, g_s_ptr, g_x_ptr, T, E, route_scale, K: tl.constexpr,
                          SIGMOID: tl.constexpr, HAS_G_S: tl.constexpr, ROUTE_NORM: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, BLOCK_E)
        kcols = tl.arange(0, BLOCK_K)
        row_ok = rows < T
        ok = row_ok[:, None] & (cols < E)[None, :]
        k_ok = row_ok[:, None] & (kcols < K)[None, :]
        row_E = rows.to(tl.int64)[:, None] * E + cols[None, :]
        row_K = rows.to(tl.int64)[:, None] * K + kcols[None, :]
        s = tl.load(scores_ptr + row_E, mask=ok, other=0.0)
        ids = tl.load(ids_ptr + row_K, mask=k_ok, other=-1).to(tl.int32)
        g_w = tl.load(g_w_ptr + row_K, mask=k_ok, other=0.0)
        g_raw = g_w * route_scale
        if ROUTE_NORM:
            w_raw = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
            for k in tl.static_range(K):
                id_k = tl.sum(tl.where(kcols[None, :] == k, ids, 0), 1)
                s_k = tl.sum(tl.where(cols[None, :] == id_k[:, None], s, 0.0), 1)
                w_raw = tl.where(kcols[None, :] == k, s_k[:, None], w_raw)
            z = tl.sum(w_raw, 1) + 1e-20
            g_raw = route_scale * (g_w / z[:, None] - (tl.sum(g_w * w_raw, 1) / (z * z))[:, None])
        g_s = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
        if HAS_G_S:
            g_s = tl.load(g_s_ptr + row_E, mask=ok, other=0.0)
        for k in tl.static_range(K):
            id_k = tl.sum(tl.where(kcols[None, :] == k, ids, 0), 1)
            g_k = tl.sum(tl.where(kcols[None, :] == k, g_raw, 0.0), 1)
            g_s += tl.where(cols[None, :] == id_k[:, None], g_k[:, None], 0.0)
        if SIGMOID:
            g_x = g_s * s * (1.0 - s)
        else:
            g_x = s * (g_s - tl.sum(s * g_s, 1)[:, None])
        tl.store(g_x_ptr + row_E, g_x, mask=ok)


def fusable(logits_TE: torch.Tensor, top_k: int) -> bool:
    """Whether ``route_topk`` runs its kernels on these logits (fp32, CUDA or the interpreter, E and K in range)."""
    return (logits_TE.dtype == torch.float32 and _use_triton(logits_TE) and logits_TE.shape[1] <= MAX_EXPERTS
            and top_k <= MAX_TOP_K)


def _blocks(E: int, K: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_E, BLOCK_K): about 4096 scores per program (32 a thread at 4 warps)."""
    block_e = max(16, triton.next_power_of_2(E))
    return max(1, min(64, 4096 // block_e)), block_e, max(2, triton.next_power_of_2(K))


class _RouteTopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TE, bias_E, top_k, score_func, route_norm, route_scale):
        T, E = logits_TE.shape
        scores_TE = torch.empty(T, E, dtype=torch.float32, device=logits_TE.device)
        ids_TK = torch.empty(T, top_k, dtype=torch.int64, device=logits_TE.device)
        w_TK = torch.empty(T, top_k, dtype=torch.float32, device=logits_TE.device)
        if T:
            bt, be, bk = _blocks(E, top_k)
            bias = bias_E.to(torch.float32).contiguous() if bias_E is not None else scores_TE
            _route_fwd_kernel[(triton.cdiv(T, bt),)](
                logits_TE, bias, scores_TE, ids_TK, w_TK, T, E, logits_TE.stride(0), float(route_scale),
                K=top_k, SIGMOID=score_func == "sigmoid", HAS_BIAS=bias_E is not None, ROUTE_NORM=route_norm,
                BLOCK_T=bt, BLOCK_E=be, BLOCK_K=bk, num_warps=4)
        ctx.mark_non_differentiable(ids_TK)
        ctx.save_for_backward(scores_TE, ids_TK)
        ctx.args = (top_k, score_func, route_norm, route_scale)
        return scores_TE, ids_TK, w_TK

    @staticmethod
    def backward(ctx, g_scores_TE, _g_ids, g_w_TK):
        scores_TE, ids_TK = ctx.saved_tensors
        top_k, score_func, route_norm, route_scale = ctx.args
        T, E = scores_TE.shape
        g_x_TE = torch.empty_like(scores_TE)
        g_w = g_w_TK.contiguous() if g_w_TK is not None else torch.zeros_like(ids_TK, dtype=torch.float32)
        if T:
            bt, be, bk = _blocks(E, top_k)
            g_s = g_scores_TE.contiguous() if g_scores_TE is not None else scores_TE
            _route_bwd_kernel[(triton.cdiv(T, bt),)](
                scores_TE, ids_TK, g_w, g_s, g_x_TE, T, E, float(route_scale), K=top_k,
                SIGMOID=score_func == "sigmoid", HAS_G_S=g_scores_TE is not None, ROUTE_NORM=route_norm,
                BLOCK_T=bt, BLOCK_E=be, BLOCK_K=bk, num_warps=4)
        return g_x_TE, None, None, None, None, None


def route_topk(logits_TE: torch.Tensor, bias_E: torch.Tensor | None, top_k: int, score_func: str,
               route_norm: bool, route_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scores_TE fp32, ids_TK int64, w_TK fp32) from fp32 logits [T, E] (unit stride along E); see the module
    docstring. Call only where ``fusable``."""
    if logits_TE.stride(1) != 1:
        logits_TE = logits_TE.contiguous()
    return _RouteTopK.apply(logits_TE, bias_E, top_k, score_func, route_norm, route_scale)
