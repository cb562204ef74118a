"""kernels/cross_entropy.py: the torch path and the Triton kernels against log_softmax in fp64."""

import os

import pytest
import torch
import torch.nn.functional as F

from kernels import cross_entropy as ce
from kernels.cross_entropy import cross_entropy
from test_kernels import needs_cpu_interpreter, run_in_interpreter


def reference64(x_NV, labels_N, ignore_index=-100, grad_loss=1.0):
    """(loss, grad_NV, loss_N) in fp64: log_softmax, mean over the rows not ignored, autograd."""
    x = x_NV.detach().double().requires_grad_()
    valid_N = labels_N != ignore_index
    logp_NV = torch.log_softmax(x, dim=1)
    nll_N = -logp_NV.gather(1, torch.where(valid_N, labels_N, 0).long().unsqueeze(1)).squeeze(1)
    loss_N = torch.where(valid_N, nll_N, 0.0)
    loss = loss_N.sum() / valid_N.sum()
    (loss * grad_loss).backward()
    return loss.detach(), x.grad, loss_N.detach()


def _case(N, V, dtype=torch.float32, scale=3.0, ignored=0.25, seed=0):
    g = torch.Generator().manual_seed(seed)
    x_NV = (torch.randn(N, V, generator=g) * scale).to(dtype)
    labels_N = torch.randint(0, V, (N,), generator=g)
    labels_N[torch.rand(N, generator=g) < ignored] = -100
    labels_N[0] = 0 if V == 1 else V - 1  # the last column, past every full block
    return x_NV, labels_N


def assert_grad_close(got_NV, want_NV, rtol):
    """Every element to ``rtol`` (relative) + 2e-6 of the largest |gradient| (fp32 rounding of x − lse,
    |x − lse| up to ~30) + half an fp16 subnormal step for fp16 gradients."""
    atol = 2e-6 * want_NV.abs().max().item() + (2 ** -25 if got_NV.dtype == torch.float16 else 0.0)
    torch.testing.assert_close(got_NV.double(), want_NV, rtol=rtol, atol=atol)


def _check(x_NV, labels_N, ignore_index=-100, loss_rtol=1e-6, grad_rtol=1e-5, grad_loss=1.0):
    """The loss to ``loss_rtol`` and the gradient elementwise (assert_grad_close) against fp64."""
    x = x_NV.clone().requires_grad_()
    loss = cross_entropy(x, labels_N, ignore_index)
    (loss * grad_loss).backward()
    want, want_grad, _ = reference64(x_NV, labels_N, ignore_index, grad_loss)
    assert loss.dtype == (torch.float64 if x_NV.dtype == torch.float64 else torch.float32) and loss.dim() == 0
    assert x.grad.dtype == x_NV.dtype and x.grad.shape == x_NV.shape
    torch.testing.assert_close(loss.double(), want, rtol=loss_rtol, atol=0)
    assert_grad_close(x.grad, want_grad, grad_rtol)
    return loss, x.grad


# --- the torch path (CPU) ------------------------------------------------------------------------------------

@pytest.mark.parametrize("N, V", [(64, 1000), (33, 4099), (5, 7)])
def test_fp32_matches_fp64_log_softmax(N, V):
    _check(*_case(N, V))


def test_fp32_matches_f_cross_entropy():
    """What the recipes computed before: F.cross_entropy on the fp32 logits."""
    x_NV, labels_N = _case(128, 512)
    torch.testing.assert_close(cross_entropy(x_NV, labels_N), F.cross_entropy(x_NV, labels_N), rtol=1e-6, atol=0)


def test_bf16_logits_fp32_loss_bf16_grad():
    """bf16 / fp16 logits: the loss is the fp32 loss of the same values; the gradient is the fp64 one
    rounded to the logits' dtype (half an ulp, 2^-9 relative, plus the fp32 math)."""
    for dtype in (torch.bfloat16, torch.float16):
        _check(*_case(48, 777, dtype), grad_rtol=2 ** -8)


def test_grad_scales_with_the_incoming_gradient():
    _check(*_case(16, 100), grad_loss=3.5)


def test_huge_logits():
    """±1e4 in fp32 (exp overflows without the max), and bf16 values near 1e30: the loss is exact to
    fp32 rounding of lse and the gradient is a (near) one-hot difference."""
    x_NV, labels_N = _case(32, 300, scale=1e4)
    _check(x_NV, labels_N)
    x_NV, labels_N = _case(32, 300, torch.bfloat16, scale=1e30)
    assert torch.isfinite(x_NV).all() and x_NV.abs().max() > 1e30
    _check(x_NV, labels_N, grad_rtol=2 ** -8)


def test_peaked_rows():
    """A row with all its mass on the label (loss ≈ 1e-22, gradient ≈ 0) and one with all of it elsewhere."""
    x_NV, labels_N = _case(8, 1000, ignored=0)
    x_NV[0, labels_N[0]] = 60.0
    x_NV[1, (labels_N[1] + 1) % 1000] = 60.0
    _check(x_NV, labels_N)
    loss_N, _ = ce.cross_entropy_fwd_torch(x_NV, labels_N, -100)
    _, _, want_N = reference64(x_NV, labels_N)
    torch.testing.assert_close(loss_N.double(), want_N, rtol=1e-6, atol=1e-6)
    assert loss_N[0] < 1e-6 and loss_N[1] > 59


def test_minus_inf_logits():
    """Masked-out vocabulary (-inf), also a whole leading block of it: finite loss, zero gradient there."""
    x_NV, labels_N = _case(6, 5000, ignored=0)
    x_NV[:, :4096] = float("-inf")
    labels_N = 4096 + labels_N % 904
    loss, grad = _check(x_NV, labels_N)
    assert torch.isfinite(loss) and grad[:, :4096].abs().max() == 0


def test_ignored_rows():
    x_NV, labels_N = _case(10, 50, ignored=0)
    labels_N[1:] = -100  # all rows ignored but one: that row's loss, divided by 1
    loss, grad = _check(x_NV, labels_N)
    assert grad[1:].abs().max() == 0 and grad[0].abs().min() > 0
    labels_N = torch.where(labels_N == -100, 7, labels_N)  # another ignore_index, one that is a valid class
    labels_N[3] = 0
    _check(x_NV, labels_N, ignore_index=7)


def test_every_row_ignored_is_nan_with_zero_gradient_like_torch():
    x_NV, labels_N = _case(6, 20)
    labels_N[:] = -100
    x = x_NV.clone().requires_grad_()
    loss = cross_entropy(x, labels_N)
    loss.backward()
    x_t = x_NV.clone().requires_grad_()
    loss_t = F.cross_entropy(x_t, labels_N)
    loss_t.backward()
    assert torch.isnan(loss) and torch.isnan(loss_t)
    assert torch.equal(x.grad, x_t.grad) and x.grad.abs().max() == 0


def test_single_class():
    x_NV, labels_N = _case(5, 1, ignored=0.3)
    loss, grad = _check(x_NV, labels_N)
    assert loss == 0 and grad.abs().max() == 0


def test_fp64_gradcheck():
    """The hand-written backward against finite differences (fp64 runs the torch formulas everywhere)."""
    x_NV, labels_N = _case(6, 9, torch.float64)
    x = x_NV.requires_grad_()
    assert torch.autograd.gradcheck(lambda x: cross_entropy(x, labels_N), (x,))


def test_out_of_range_labels_raise_on_cpu_like_torch():
    x_NV, labels_N = _case(4, 10, ignored=0)
    for bad in (10, -1, -101):
        labels_N[2] = bad
        with pytest.raises(IndexError):
            F.cross_entropy(x_NV, labels_N)
        with pytest.raises(IndexError, match="out of bounds"):
            cross_entropy(x_NV, labels_N)


def test_out_of_range_label_formulas_give_nan_rows():
    """What runs where the labels are not checked (CUDA): nan loss and gradient on that row only."""
    x_NV, labels_N = _case(4, 10, ignored=0)
    labels_N[1] = -100
    labels_N[2] = 10
    loss_N, lse_N = ce.cross_entropy_fwd_torch(x_NV, labels_N, -100)
    assert torch.isnan(loss_N[2]) and torch.isfinite(loss_N[[0, 1, 3]]).all() and loss_N[1] == 0
    assert lse_N[1] == float("-inf")
    grad_NV = ce.cross_entropy_bwd_torch(x_NV, labels_N, lse_N, torch.tensor(1.0), torch.tensor(3.0), -100)
    assert torch.isnan(grad_NV[2]).all() and torch.isfinite(grad_NV[[0, 1, 3]]).all() and grad_NV[1].abs().max() == 0


def test_shapes_are_checked():
    with pytest.raises(ValueError):
        cross_entropy(torch.randn(2, 3, 4), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError):
        cross_entropy(torch.randn(4, 3), torch.zeros(5, dtype=torch.long))


def test_strided_rows():
    """A view with rows further apart than V (the kernel takes the row stride) and int32 labels."""
    x_big, labels_N = _case(12, 300)
    x_NV = x_big[:, :250]
    labels_N = (labels_N % 250).to(torch.int32)
    labels_N[3] = -100
    _check(x_NV, labels_N)


# --- the Triton kernels, interpreted on CPU ----------------------------------------------------------------

_INTERPRET_SCRIPT = r"""
import sys, torch
sys.path.insert(0, "tests")
from test_cross_entropy import _case, assert_grad_close, reference64
from kernels import cross_entropy as ce
for N, V, dtype in [(6, 5, torch.float32), (5, 300, torch.bfloat16), (4, 4133, torch.float32), (3, 1, torch.float32),
                    (4, 70, torch.float16)]:
    x, labels = _case(N, V, dtype, ignored=0.3, seed=V)
    if V == 4133:  # a leading block of -inf in one row; huge values in another
        x[1, :4096] = float("-inf"); labels[1] = 4100; x[2] *= 1e4
    assert ce._use_triton(x)
    loss_N, lse_N = ce.cross_entropy_fwd(x, labels, -100)
    want_loss_N, want_lse_N = ce.cross_entropy_fwd_torch(x, labels, -100)
    torch.testing.assert_close(loss_N, want_loss_N, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(lse_N, want_lse_N, rtol=1e-6, atol=1e-5)
    n_valid = (labels != -100).sum(dtype=torch.float32)
    grad = ce.cross_entropy_bwd(x, labels, lse_N, torch.tensor(2.5), n_valid, -100)
    want = ce.cross_entropy_bwd_torch(x, labels, lse_N, torch.tensor(2.5), n_valid, -100)  # the same lse
    assert grad.dtype == x.dtype
    rtol = 2 ** -7 if dtype != torch.float32 else 1e-5  # the interpreter rounds to bf16 by truncation
    torch.testing.assert_close(grad.float(), want.float(), rtol=rtol, atol=1e-7)
    xg = x.clone().requires_grad_()
    loss = ce.cross_entropy(xg, labels)
    assert type(loss.grad_fn).__name__ == "_CrossEntropyBackward", type(loss.grad_fn)
    loss.backward()
    want_loss, want_grad, _ = reference64(x, labels)
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-6, atol=0)
    assert_grad_close(xg.grad, want_grad, rtol)
# an out-of-range label (not checked in the kernel): nan on its row only; every row ignored: nan, zero gradient
x, labels = _case(4, 40, ignored=0)
labels[1] = 40; labels[3] = -100
loss_N, lse_N = ce.cross_entropy_fwd(x, labels, -100)
assert torch.isnan(loss_N[1]) and torch.isfinite(loss_N[[0, 2, 3]]).all() and loss_N[3] == 0
grad = ce.cross_entropy_bwd(x, labels, lse_N, torch.tensor(1.0), torch.tensor(3.0), -100)
assert torch.isnan(grad[1]).all() and torch.isfinite(grad[[0, 2, 3]]).all() and grad[3].abs().max() == 0
xg = x.clone().requires_grad_(); loss = ce.cross_entropy(xg, torch.full((4,), -100)); loss.backward()
assert torch.isnan(loss) and xg.grad.abs().max() == 0
# the FP8 backward's tile kernel (its FP8 values are checked on a GPU: the interpreter's e5m2 rounding is not the
# hardware's): each form asked for, the scale, q_VN the bytes of q_NV transposed, the bf16 form, nan and ignored rows
from kernels.fp8 import FP8_GRAD
for N, V in [(70, 300), (5, 16)]:
    x, labels = _case(N, V, torch.bfloat16, ignored=0.2, seed=N)
    labels[1] = -100; labels[3] = V  # an ignored row; a label out of range
    lse_N = ce.cross_entropy_fwd_torch(x, labels, -100)[1]
    n_valid = (labels != -100).sum(dtype=torch.float32)
    ref = ce.cross_entropy_bwd_fp8_torch(x, labels, lse_N, torch.tensor(0.7), n_valid, -100, FP8_GRAD, True, True, True)
    for forms in [(True, True, False), (False, True, True), (True, False, True)]:
        got = ce.cross_entropy_bwd_fp8(x, labels, lse_N, torch.tensor(0.7), n_valid, -100, FP8_GRAD, *forms)
        assert tuple(t is not None for t in got[1:3] + got[:1]) == forms and torch.equal(got.s, ref.s)
        q = got.q_NV if forms[0] else got.q_VN.t()
        assert q.dtype == FP8_GRAD and not q[1].float().any() and q[3].float().isnan().all()
        assert torch.isfinite(q.float()[[0, 2]]).all()
        if forms[0] and forms[1]:
            assert torch.equal(got.q_VN.view(torch.uint8), got.q_NV.t().contiguous().view(torch.uint8))
        if forms[2]:
            assert got.g_NV.dtype == torch.bfloat16 and got.g_NV[3].isnan().all()
            ok = ~ref.g_NV.isnan()
            torch.testing.assert_close(got.g_NV.float()[ok], ref.g_NV.float()[ok], rtol=2 ** -7, atol=1e-7)
print("CROSS-ENTROPY-OK")
"""


@needs_cpu_interpreter
def test_kernels_in_interpreter():
    run_in_interpreter(_INTERPRET_SCRIPT, "CROSS-ENTROPY-OK")


# --- the Triton kernels on a GPU -----------------------------------------------------------------------------

def _gpu_case(N, V, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x_NV = (torch.randn(N, V, device="cuda", generator=g) * 2).bfloat16()
    labels_N = torch.randint(0, V, (N,), device="cuda", generator=g)
    labels_N[torch.rand(N, device="cuda", generator=g) < 0.1] = -100
    labels_N[0] = V - 1
    return x_NV, labels_N


@pytest.mark.gpu
@pytest.mark.parametrize("V", [32000, 102400])
def test_kernels_on_gpu_bf16(V):
    N = 4096
    x_NV, labels_N = _gpu_case(N, V)
    x = x_NV.clone().requires_grad_()
    assert ce._use_triton(x, labels_N)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = cross_entropy(x, labels_N)
    torch.cuda.synchronize()
    fwd_extra = torch.cuda.max_memory_allocated() - base
    (grad,) = torch.autograd.grad(loss, x)  # the gradient itself, not accumulated into x.grad
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    # no copy of the logits in either pass (an fp32 one would be N·V·4 B): forward O(N) vectors only,
    # backward the gradient (N·V·2 B) and O(N)
    assert fwd_extra < (1 << 20), fwd_extra
    assert extra < x_NV.numel() * x_NV.element_size() + (1 << 20), extra
    assert type(loss.grad_fn).__name__ == "_CrossEntropyBackward" and loss.dtype == torch.float32
    want, want_grad, want_N = reference64(x_NV, labels_N)
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=0)
    loss_N, _ = ce.cross_entropy_fwd(x_NV, labels_N, -100)
    torch.testing.assert_close(loss_N.double(), want_N, rtol=1e-5, atol=1e-4)
    assert grad.dtype == torch.bfloat16
    assert_grad_close(grad, want_grad, 2 ** -8)
    # what the recipes computed before, to fp32 noise
    torch.testing.assert_close(loss.detach(), F.cross_entropy(x_NV.float(), labels_N), rtol=1e-5, atol=0)


@pytest.mark.gpu
def test_no_host_sync_and_cuda_graph_replay_equals_eager():
    N, V = 4096, 32000
    x_NV, labels_N = _gpu_case(N, V, seed=1)
    x2_NV, labels2_N = _gpu_case(N, V, seed=2)
    x = x_NV.clone().requires_grad_()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (Triton compiles here), as torch.cuda.graph's docs ask
        for _ in range(2):
            x.grad = None
            cross_entropy(x, labels_N).backward()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()

    x.grad = None
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host read raises
    try:
        loss = cross_entropy(x, labels_N)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    eager_loss, eager_grad = loss.detach().clone(), x.grad.clone()
    del loss  # its autograd graph holds x's AccumulateGrad node, bound to this stream: capture runs on another

    x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = cross_entropy(x, labels_N)
        static_loss.backward()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(x.grad, eager_grad)
    torch.testing.assert_close(static_loss.detach(), eager_loss, rtol=1e-6, atol=0)

    with torch.no_grad():  # new inputs into the captured buffers: the replay follows them
        x.copy_(x2_NV)
        labels_N.copy_(labels2_N)
    graph.replay()
    torch.cuda.synchronize()
    x_e = x2_NV.clone().requires_grad_()
    loss_e = cross_entropy(x_e, labels2_N)
    loss_e.backward()
    assert torch.equal(x.grad, x_e.grad)
    torch.testing.assert_close(static_loss.detach(), loss_e.detach(), rtol=1e-6, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_DEBUG", "0") not in ("", "0"), reason="TRITON_DEBUG device-asserts instead")
def test_out_of_range_label_on_gpu_is_nan_without_a_host_read():
    x_NV, labels_N = _gpu_case(64, 1000)
    labels_N[5] = 1000
    labels_N[6] = -100
    x = x_NV.clone().requires_grad_()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = cross_entropy(x, labels_N)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isnan(loss)
    assert torch.isnan(x.grad[5]).all() and torch.isfinite(x.grad[torch.arange(64, device="cuda") != 5]).all()
    assert x.grad[6].abs().max() == 0
