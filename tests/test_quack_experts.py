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
from reference import expert_counts, experts_fp64

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
QUACK = importlib.util.find_spec("quack") is not None
needs_quack = pytest.mark.skipif(not (HOPPER and QUACK), reason="needs a Hopper GPU and quack-kernels")


def test_quack_on_cpu_is_a_one_line_error():
    with pytest.raises(UserError, match='experts_gemm = "quack" needs a Hopper.*set experts_gemm = "torch"'):
        check_quack_supported(torch.device("cpu"))


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@needs_quack
@pytest.mark.gpu
@pytest.mark.parametrize("kind, mode", [("random", "fp32"), ("all_to_one", "fp32"), ("empty_experts", "fp32"),
                                        ("none", "fp32"), ("random", "owned"), ("random", "copies"),
                                        ("all_to_one", "bf16")])
def test_quack_experts_match_fp64_reference(kind, mode):
    """owned: experts outside FSDP (fp32 weights cast to bf16 with [w1; w3] in one pass, gradients divided
    by 2 in the cast's backward); copies: the same with optimizer-written bf16 copies ([w1; w3] one buffer,
    bf16 gradients in ``experts.copies[w].grad``, undivided); bf16: plain bf16 weights stored as halves of one
    [w1; w3]."""
    torch.manual_seed(0)
    E, D, H, capacity = 8, 512, 384, 3328
    used = 0 if kind == "none" else 3000
    experts = GroupedExperts(D, H, E, gemm="quack").cuda()
    experts.init_weights(0.02)
    if mode in ("owned", "copies"):
        experts.compute_dtype = torch.bfloat16
        experts.set_gradient_divide_factor(2.0)
    if mode == "copies":
        experts.enable_compute_copies()
    if mode == "bf16":
        experts.bfloat16()
    counts = expert_counts(kind, E, used).cuda()
    x = torch.randn(capacity, D, device="cuda", dtype=torch.bfloat16)
    x[used:] = float("nan")  # padding rows past the used ones must not be read
    g = torch.randn(capacity, D, device="cuda", dtype=torch.bfloat16)
    g[used:] = float("nan")
    x.requires_grad_()
    y = experts(x, counts)
    y.backward(g)
    ref = experts_fp64(x, experts.w1, experts.w2, experts.w3, counts, g)
    assert _rel(y[:used], ref[0]) < 1e-2
    assert _rel(x.grad[:used], ref[1]) < 2e-2
    grads = [experts.copies[w].grad if mode == "copies" else w.grad for w in (experts.w1, experts.w2, experts.w3)]
    want = {"fp32": torch.float32, "owned": torch.float32, "copies": torch.bfloat16, "bf16": torch.bfloat16}[mode]
    if mode == "bf16":
        assert experts.w1.data_ptr() == experts._w13.data_ptr()  # w1, w3 live in one [w1; w3]
    for grad, r in zip(grads, ref[2:]):
        assert torch.isfinite(grad).all() and grad.dtype == want
        assert _rel(grad, r / 2 if mode == "owned" else r) < 2e-2
    empty = counts == 0
    for grad in grads:
        assert (grad[empty] == 0).all()  # experts without rows get a zero gradient


@needs_quack
@pytest.mark.gpu
def test_quack_experts_no_host_sync_and_graph_equals_eager():
    torch.manual_seed(1)
    E, D, H, capacity = 16, 512, 256, 4096
    experts = GroupedExperts(D, H, E, gemm="quack").cuda()
    experts.init_weights(0.02)
    counts = expert_counts("random", E, 3500).cuda()
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
