"""QuACK grouped-GEMM experts (experts_gemm = "quack"): forward and gradients against an fp64 reference on
random, all-to-one-expert and empty-expert routings, with NaN padding rows past the used rows; no host
sync; a captured CUDA graph equals eager. The GPU tests need quack-kernels and a Hopper GPU."""

import importlib.util

import pytest
import torch

from components.errors import UserError
from components.moe_echo.experts import GroupedExperts
from components.moe_echo.quack_experts import check_quack_supported
from cuda_graphs import warm_up_and_capture

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
QUACK = importlib.util.find_spec("quack") is not None
needs_quack = pytest.mark.skipif(not (HOPPER and QUACK), reason="needs a Hopper GPU and quack-kernels")


def test_quack_on_cpu_is_a_one_line_error():
    with pytest.raises(UserError, match='experts_gemm = "quack" needs a Hopper.*set experts_gemm = "torch"'):
        check_quack_supported(torch.device("cpu"))


def _reference(x_ND, w1, w2, w3, counts, g_ND):
    """fp64 per-expert loop on the used rows: (y, dx, dw1, dw2, dw3)."""
    x = x_ND[: int(counts.sum())].double().requires_grad_()
    ws = [w.detach().double().requires_grad_() for w in (w1, w2, w3)]
    ys, start = [], 0
    for e, n in enumerate(counts.tolist()):
        xe = x[start:start + n]
        ys.append((torch.nn.functional.silu(xe @ ws[0][e].T) * (xe @ ws[2][e].T)) @ ws[1][e].T)
        start += n
    y = torch.cat(ys)
    y.backward(g_ND[: y.shape[0]].double())
    return y, x.grad, *(w.grad for w in ws)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _counts(kind, E, used):
    if kind == "all_to_one":
        c = torch.zeros(E, dtype=torch.int64)
        c[E // 2] = used
    elif kind == "empty_experts":  # every other expert gets nothing
        c = torch.zeros(E, dtype=torch.int64)
        c[1::2] = torch.distributions.Multinomial(used, torch.ones(E // 2)).sample().long()
    else:
        c = torch.distributions.Multinomial(used, torch.ones(E)).sample().long()
    return c.cuda()


@needs_quack
@pytest.mark.gpu
@pytest.mark.parametrize("kind, owned", [("random", False), ("all_to_one", False), ("empty_experts", False),
                                         ("random", True)])
def test_quack_experts_match_fp64_reference(kind, owned):
    """owned: experts outside FSDP (fp32 weights cast to bf16 with [w1; w3] in one pass, gradients divided
    by 2 in the cast's backward)."""
    torch.manual_seed(0)
    E, D, H, used, capacity = 8, 512, 384, 3000, 3328
    experts = GroupedExperts(D, H, E, gemm="quack").cuda()
    experts.init_weights(0.02)
    if owned:
        experts.compute_dtype = torch.bfloat16
        experts.set_gradient_divide_factor(2.0)
    counts = _counts(kind, E, used)
    x = torch.randn(capacity, D, device="cuda", dtype=torch.bfloat16)
    x[used:] = float("nan")  # padding rows past the used ones must not be read
    g = torch.randn(capacity, D, device="cuda", dtype=torch.bfloat16)
    g[used:] = float("nan")
    x.requires_grad_()
    y = experts(x, counts)
    y.backward(g)
    ref = _reference(x.detach(), experts.w1, experts.w2, experts.w3, counts.cpu(), g)
    assert _rel(y[:used], ref[0]) < 1e-2
    assert _rel(x.grad[:used], ref[1]) < 2e-2
    for w, r in zip((experts.w1, experts.w2, experts.w3), ref[2:]):
        assert torch.isfinite(w.grad).all() and w.grad.dtype == torch.float32
        assert _rel(w.grad, r / 2 if owned else r) < 2e-2
    empty = counts == 0
    for w in (experts.w1, experts.w2, experts.w3):
        assert (w.grad[empty] == 0).all()  # experts without rows get a zero gradient


@needs_quack
@pytest.mark.gpu
def test_quack_experts_no_host_sync_and_graph_equals_eager():
    torch.manual_seed(1)
    E, D, H, capacity = 16, 512, 256, 4096
    experts = GroupedExperts(D, H, E, gemm="quack").cuda()
    experts.init_weights(0.02)
    counts = _counts("random", E, 3500)
    x = torch.randn(capacity, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(capacity, D, device="cuda", dtype=torch.bfloat16)

    def step():
        x.grad = None
        experts.zero_grad(set_to_none=False)
        y = experts(x, counts)
        y.backward(g)
        return y.detach()  # no autograd node outlives the step (its stream would leak into the capture)

    step()  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = step()[:3500].clone()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    eager_dw1 = experts.w1.grad.clone()
    graph, y = warm_up_and_capture(step)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y[:3500], eager)
    assert torch.equal(experts.w1.grad, eager_dw1)
