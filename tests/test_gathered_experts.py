"""Experts reading token rows and taking the combine (components/moe_echo/gathered_experts.py) against an
independent fp64 reference: y[t] = Σ_k w[t, k] · SwiGLU_{e(t, k)}(x[t]), token by token, and its autograd
gradients for x, [w1; w3], w2 and the combine weights. Random, all tokens to one expert, empty experts."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from components.moe_echo.dispatcher import LocalDispatcher
from components.moe_echo.gathered_experts import RowLayout, gathered_swiglu_combine
from components.moe_echo.nvlink_dispatch import nvlink_capacity


def reference(x_TD, w13, w2, w_TK, ids_TK):
    H = w2.shape[2]
    out = []
    for t in range(x_TD.shape[0]):
        acc = x_TD.new_zeros(x_TD.shape[1])
        for k in range(ids_TK.shape[1]):
            e = int(ids_TK[t, k])
            h = F.silu(w13[e, :H] @ x_TD[t]) * (w13[e, H:] @ x_TD[t])
            acc = acc + w_TK[t, k] * (w2[e] @ h)
        out.append(acc)
    return torch.stack(out)


def routing(kind, T, E, K, gen):
    if kind == "random":
        return torch.rand(T, E, generator=gen).topk(K, dim=-1).indices
    if kind == "one_expert":  # every token's first choice is expert 0; the other choices fixed
        return torch.arange(K).expand(T, K).clone()
    # "empty": only the odd experts receive tokens
    return (torch.rand(T, E // 2, generator=gen).topk(K, dim=-1).indices * 2 + 1)


@pytest.mark.parametrize("kind", ["random", "one_expert", "empty"])
def test_gathered_experts_match_the_token_by_token_reference(kind):
    T, E, K, D, H = 13, 6, 2, 8, 5
    gen = torch.Generator().manual_seed(7)
    f64 = torch.float64
    x = torch.randn(T, D, generator=gen, dtype=f64, requires_grad=True)
    w13 = (torch.randn(E, 2 * H, D, generator=gen, dtype=f64) * 0.5).requires_grad_()
    w2 = (torch.randn(E, D, H, generator=gen, dtype=f64) * 0.5).requires_grad_()
    w_TK = torch.rand(T, K, generator=gen, dtype=f64).requires_grad_()
    ids_TK = routing(kind, T, E, K, gen)
    dy = torch.randn(T, D, generator=gen, dtype=f64)

    layout = RowLayout.of(*LocalDispatcher(E).rows(ids_TK))
    y = gathered_swiglu_combine(x, w13, w2, w_TK, layout)
    got = torch.autograd.grad(y, (x, w13, w2, w_TK), dy)
    y_ref = reference(x, w13, w2, w_TK, ids_TK)
    want = torch.autograd.grad(y_ref, (x, w13, w2, w_TK), dy)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(("x", "w13", "w2", "w_TK"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"gradient of {name}")
    if kind == "empty":  # experts without tokens get exactly zero gradient
        assert bool((got[1][0::2] == 0).all()) and bool((got[2][0::2] == 0).all())


def test_layout_offsets_and_indices():
    ids_TK = torch.tensor([[2, 0], [2, 1], [0, 2]])
    layout = RowLayout.of(*LocalDispatcher(4).rows(ids_TK))
    assert layout.cu_E1.tolist() == [0, 2, 3, 6, 6] and layout.cu_E1.dtype == torch.int32
    assert layout.token_of_row_N.dtype == torch.int32
    # row of (t, k) holds token t, and rows are expert-major
    assert torch.equal(layout.token_of_row_N.long()[layout.row_of_slot_TK], torch.arange(3)[:, None].expand(3, 2))
    expert_of_row = torch.empty(6, dtype=torch.long).scatter_(0, layout.row_of_slot_TK.flatten(), ids_TK.flatten())
    assert expert_of_row.tolist() == [0, 0, 1, 2, 2, 2]


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
QUACK = importlib.util.find_spec("quack") is not None


@pytest.mark.skipif(not (HOPPER and QUACK), reason="needs a Hopper GPU and quack-kernels")
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["random", "one_expert", "empty"])
def test_quack_gathered_experts_match_fp64_no_host_sync_and_graph_equals_eager(kind):
    """QuACK's kernels (row indices, the dSwiGLU epilogue's scale and reduction, the transposed de-interleaved
    weight gradient) against the token-by-token fp64 reference, bf16 bounds; sync-free and capturable."""
    from cuda_graphs import warm_up_and_capture

    T, E, K, D, H = 1024, 16, 4, 512, 384
    gen = torch.Generator().manual_seed(3)
    bf = torch.bfloat16
    x = torch.randn(T, D, generator=gen).to(bf).cuda().requires_grad_()
    w13 = (torch.randn(E, 2 * H, D, generator=gen) * D ** -0.5).to(bf).cuda().requires_grad_()
    w2 = (torch.randn(E, D, H, generator=gen) * H ** -0.5).to(bf).cuda().requires_grad_()
    w_TK = torch.rand(T, K, generator=gen).cuda().requires_grad_()
    ids_TK = routing(kind, T, E, K, gen).cuda()
    dy = torch.randn(T, D, generator=gen).to(bf).cuda()
    layout = RowLayout.of(*LocalDispatcher(E).rows(ids_TK))

    def step():
        for t in (x, w13, w2, w_TK):
            t.grad = None
        y = gathered_swiglu_combine(x, w13, w2, w_TK, layout)
        y.backward(dy)
        return y.detach()

    y = step()
    got = [y] + [t.grad.clone() for t in (x, w13, w2, w_TK)]
    leaves = [t.detach().cpu().double().requires_grad_() for t in (x, w13, w2, w_TK)]
    y_ref = reference(*leaves, ids_TK.cpu())
    want = [y_ref] + list(torch.autograd.grad(y_ref, leaves, dy.cpu().double()))
    for name, a, b in zip(("y", "x", "w13", "w2", "w_TK"), got, want):
        err = float((a.double().cpu() - b.double().cpu()).norm() / b.double().norm().clamp_min(1e-30))
        assert err < 2e-2, f"{name}: normwise error {err:.3g}"
    if kind == "empty":
        assert bool((got[2][0::2] == 0).all()) and bool((got[3][0::2] == 0).all())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = step().clone()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    eager_dw13 = w13.grad.clone()
    graph, out = warm_up_and_capture(step)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager) and torch.equal(w13.grad, eager_dw13)


def test_unsupported_settings_are_one_line_errors():
    from components.errors import UserError
    from components.moe_echo.config import MoEEchoConfig
    from components.moe_echo.gathered_experts import check_gathered_supported

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    check_gathered_supported(MoEEchoConfig(gathered_experts=True), 1, cpu)  # runs on CPU in torch
    check_gathered_supported(MoEEchoConfig(gathered_experts=True, experts_gemm="quack"), 1, gpu)
    check_gathered_supported(MoEEchoConfig(gathered_experts=True, experts_gemm="quack", echo=True), 2, gpu)
    cases = [(MoEEchoConfig(gathered_experts=True), 2, cpu, "expert_parallel_degree = 2 needs the nvlink"),
             (MoEEchoConfig(gathered_experts=True, dispatcher="padded", experts_gemm="quack"), 2, gpu, "'padded'"),
             (MoEEchoConfig(gathered_experts=True, expert_precision="fp8"), 1, cpu, 'expert_precision = "bf16"'),
             (MoEEchoConfig(gathered_experts=True), 1, gpu, 'set experts_gemm = "quack"')]
    for cfg, ep, dev, msg in cases:
        with pytest.raises(UserError, match=msg) as err:
            check_gathered_supported(cfg, ep, dev)
        assert "gathered_experts = false" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("R, kind, capacity_factor, wire", [
    (2, "random", 4.0, "bf16"), (4, "one_hot_per_rank", 4.0, "bf16"), (2, "all_to_one", 4.0, "bf16"),
    (2, "skewed", 0.6, "bf16"), (2, "random", 4.0, "fp8"), (2, "skewed", 0.6, "fp8")])
def test_nvlink_gathered_experts_match_the_reference_across_ranks(R, kind, capacity_factor, wire):
    """EP over the ``nvlink`` dispatcher (ranks as threads, fp64): tokens cross once per rank into ``tok``, the
    owner's experts read them by index and sum their weighted outputs per source token; outputs and the
    gradients of x, the routing weights and each rank's experts equal the token-by-token reference in which
    the choices the capacity could not take (counted in ``dropped``) contribute nothing. ``fp8`` wire: the
    reference takes the tokens and the output gradients through the wire's quantisation first."""
    from test_nvlink import E_LOCAL, K as K_NV, T as T_NV, _expected_dropped, _routing
    from threaded_ranks import run_ranks

    from components.moe_echo.comm import fp8_rows, rows_of_fp8
    from components.moe_echo.gathered_experts import nvlink_gathered_swiglu_combine
    from components.moe_echo.nvlink_dispatch import NVLinkDispatcher

    E, D, H, f64 = R * E_LOCAL, 8, 5, torch.float64
    gen = torch.Generator().manual_seed(11)
    W13 = torch.randn(E, 2 * H, D, generator=gen, dtype=f64) * 0.5
    W2 = torch.randn(E, D, H, generator=gen, dtype=f64) * 0.5
    inputs = []
    for rank in range(R):
        g = torch.Generator().manual_seed(100 + rank)
        ids = _routing(kind, R, rank, g)
        inputs.append((torch.randn(T_NV, D, generator=g, dtype=f64), ids, torch.rand(T_NV, K_NV, generator=g, dtype=f64),
                       torch.randn(T_NV, D, generator=g, dtype=f64)))

    def rank_fn(rank, ws):
        x, ids, w, dy = (t.clone() for t in inputs[rank])
        x.requires_grad_()
        w.requires_grad_()
        mine = slice(rank * E_LOCAL, (rank + 1) * E_LOCAL)
        w13, w2 = W13[mine].clone().requires_grad_(), W2[mine].clone().requires_grad_()
        disp = NVLinkDispatcher(E, None, R, capacity_factor, workspace=ws, name="layer")
        disp.wire = wire
        x_c, counts_e, h = disp.route(x, ids, w)
        y = nvlink_gathered_swiglu_combine(x_c, w13, w2, counts_e, disp, h)
        (y * dy).sum().backward()
        return y.detach(), x.grad, w.grad, w13.grad, w2.grad, int(h.dropped), set(ws.shared.buffers)

    outs = run_ranks(R, rank_fn)
    assert "layer/x" not in outs[0][6] and "layer/tok/torch.float64" in outs[0][6]  # no expert-row buffer
    cap = nvlink_capacity(T_NV, K_NV, capacity_factor)
    drops = _expected_dropped([inp[1] for inp in inputs], R, cap)
    assert sum(o[5] for o in outs) == sum(int(d.sum()) for d in drops)
    if capacity_factor < 1:
        assert sum(o[5] for o in outs) > 0  # the overflow case overflows

    # the reference: every rank's tokens through the global expert table, dropped choices weighted 0
    crossed = (lambda t: rows_of_fp8(fp8_rows(t), f64)) if wire == "fp8" else (lambda t: t)
    inputs = [(crossed(x), ids, w, crossed(dy)) for x, ids, w, dy in inputs]
    X = [inp[0].clone().requires_grad_() for inp in inputs]
    Wk = [(inp[2] * (~drops[r]).to(f64)).clone().requires_grad_() for r, inp in enumerate(inputs)]
    w13_ref, w2_ref = W13.clone().requires_grad_(), W2.clone().requires_grad_()
    total = sum((reference(X[r], w13_ref, w2_ref, Wk[r], inputs[r][1]) * inputs[r][3]).sum() for r in range(R))
    total.backward()
    for r, (y, gx, gw, gw13, gw2, *_) in enumerate(outs):
        y_ref = reference(X[r].detach(), W13, W2, Wk[r].detach(), inputs[r][1])
        torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gx, X[r].grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gw, Wk[r].grad * (~drops[r]).to(f64), rtol=1e-12, atol=1e-12)
        mine = slice(r * E_LOCAL, (r + 1) * E_LOCAL)
        torch.testing.assert_close(gw13, w13_ref.grad[mine], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gw2, w2_ref.grad[mine], rtol=1e-12, atol=1e-12)
