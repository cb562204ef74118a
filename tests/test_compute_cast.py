"""Experts outside FSDP compute in bf16 from fp32 weights: the cast's backward returns the gradient
in fp32 already divided by the data-parallel size (kernels/cast.py, one pass) — equal to dividing
afterwards, never divided twice; the Triton kernel equals the torch version bit for bit."""

import pytest
import torch

from components.moe_echo.experts import GroupedExperts
from test_kernels import needs_cpu_interpreter, run_in_interpreter


def _grads(divide: float, counts=(5, 0, 9, 2)):
    torch.manual_seed(0)
    ge = GroupedExperts(16, 12, len(counts))
    ge.init_weights(0.02)
    ge.compute_dtype = torch.bfloat16
    ge.set_gradient_divide_factor(divide)
    x = torch.randn(sum(counts) + 3, 16).bfloat16()  # 3 rows of padding
    y = ge(x, torch.tensor(counts))
    (y.float() * torch.linspace(-1, 1, y.shape[1])).sum().backward()
    return [w.grad for w in (ge.w1, ge.w2, ge.w3)]


def test_cast_backward_divides_once_in_fp32():
    one, three = _grads(1.0), _grads(3.0)
    for g1, g3 in zip(one, three):
        assert g1.dtype == g3.dtype == torch.float32 and g1.abs().sum() > 0
        assert torch.equal(g3, g1 * (1 / 3))  # the bf16 gradient times fp32(1/3), once


def test_cast_cat_equals_separate_casts_then_cat():
    """[w1; w3] cast in one pass (QuACK's layout): same values, and each half's gradient equals the one
    the separate casts give (bf16 gradient times the fp32 scale, once)."""
    from components.moe_echo.experts import _ComputeCast, _ComputeCastCat

    torch.manual_seed(0)
    w1, w3 = torch.randn(4, 6, 8, requires_grad=True), torch.randn(4, 6, 8, requires_grad=True)
    g = torch.randn(4, 12, 8).bfloat16()
    fused = _ComputeCastCat.apply(w1, w3, torch.bfloat16, 0.25)
    fused.backward(g)
    got = w1.grad.clone(), w3.grad.clone()
    w1.grad = w3.grad = None
    ref = torch.cat([_ComputeCast.apply(w1, torch.bfloat16, 0.25), _ComputeCast.apply(w3, torch.bfloat16, 0.25)], 1)
    ref.backward(g)
    assert fused.dtype == torch.bfloat16 and torch.equal(fused, ref)
    assert torch.equal(got[0], w1.grad) and torch.equal(got[1], w3.grad) and got[0].dtype == torch.float32


def test_echo_clones_w13_whole_like_w1_and_w3_apart():
    """With ECHO (``extend`` appends clone rows), experts cast for compute clone [w1; w3] as one tensor (one
    multicast, no concatenation of the extended weights): output and fp32 gradients equal cloning w1, w2 and
    w3 apart and running two gate/up GEMMs; clone rows' gradients reach their home experts."""
    from components.moe_echo.experts import W13, grouped_swiglu

    counts = torch.tensor([5, 0, 9, 2, 4, 3])  # 4 home experts, then clones of experts 2 and 0
    clones = [2, 0]
    x = torch.randn(int(counts.sum()) + 3, 16, generator=torch.Generator().manual_seed(1)).bfloat16()
    gy = torch.linspace(-1, 1, 16)

    def make():
        torch.manual_seed(0)
        ge = GroupedExperts(16, 12, 4)
        ge.init_weights(0.02)
        ge.compute_dtype = torch.bfloat16
        ge.set_gradient_divide_factor(2.0)
        return ge

    seen = []

    def extend(w, i, out=None):  # no spare rows here (experts cast per step): out is None
        assert out is None
        seen.append(i)
        return torch.cat([w, w[clones]])

    ours = make()
    y = ours(x, counts, extend)
    (y.float() * gy).sum().backward()
    assert sorted(seen) == [1, W13]  # [w1; w3] and w2: two multicasts, not three

    ref = make()
    w1, w2, w3 = (extend(w, i) for i, w in enumerate(ref.local_weights()))
    y_ref = grouped_swiglu(x, w1, w2, w3, counts)
    (y_ref.float() * gy).sum().backward()
    assert torch.equal(y, y_ref)
    for a, b in zip((ours.w1, ours.w2, ours.w3), (ref.w1, ref.w2, ref.w3)):
        assert a.grad.dtype == torch.float32 and torch.equal(a.grad, b.grad)
    assert ours.w1.grad[2].abs().sum() > 0 and ours.w1.grad[1].abs().sum() == 0  # a clone's rows; no rows


_SCRIPT = r"""
import pytest
import torch
from kernels.cast import cast_scale
g = torch.Generator().manual_seed(0)
for n, src, dst, scale in [(5000, torch.bfloat16, torch.float32, 0.5), (4097, torch.float32, torch.bfloat16, 1 / 3),
                           (1, torch.float32, torch.float32, 0.25), (0, torch.bfloat16, torch.float32, 1.0)]:
    x = (torch.randn(n, generator=g) * 100).to(src)
    got = cast_scale(x, dst, scale)
    want = (x.float() * scale).to(dst)
    assert got.dtype == dst, (n, src, dst)
    if dst == torch.float32:  # exact: the fp32 product of a value and the scale
        assert torch.equal(got, want), (n, src, dst)
    else:  # the interpreter's bf16 store need not round to nearest even: within one bf16 step
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -7).all(), (n, src, dst)
# a strided view (one half of a [E, 2H, D] gradient along dim 1) is read in place, equal to its contiguous copy
w = (torch.randn(3, 10, 7, generator=g) * 100).bfloat16()
for half in (w[:, :5], w[:, 5:]):
    assert not half.is_contiguous()
    assert torch.equal(cast_scale(half, torch.float32, 0.5), half.float() * 0.5)
print("CAST-OK")
"""


@needs_cpu_interpreter
def test_cast_kernel_in_interpreter():
    run_in_interpreter(_SCRIPT, "CAST-OK")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cast_kernel_on_gpu_equals_torch():
    from kernels.cast import cast_scale
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, src, dst, scale in [(3 * 2048 * 768 + 5, torch.bfloat16, torch.float32, 0.5),
                               (1 << 20, torch.float32, torch.bfloat16, 1 / 3)]:
        x = (torch.randn(n, device="cuda", generator=g) * 100).to(src)
        assert torch.equal(cast_scale(x, dst, scale), (x.float() * scale).to(dst))
    w = (torch.randn(32, 2 * 1408, 2048, device="cuda", generator=g) * 100).bfloat16()
    for half in (w[:, :1408], w[:, 1408:]):  # the halves of a [w1; w3] gradient, read in place
        assert torch.equal(cast_scale(half, torch.float32, 0.5), half.float() * 0.5)
