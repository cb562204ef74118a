"""components/train/fp8_linear.py: a dense linear layer in FP8 on the FP8 experts' kernels, against fp64 on random
and adversarial rows (one row 1000x the others, zero rows, an all-zero input, a weight with one entry 320x the rest), its
custom ops' fake shapes, torch.compile (one graph) against eager, and on Hopper the CUDA kernels against the
emulated path and under a CUDA graph."""

import pytest
import torch
from torch import nn

import components.train.fp8_linear as fp8_linear_module
from components.train.fp8_linear import (Fp8RowsLinear, fp8_linear, fp8_linear_backward, fp8_linear_forward, fp8_rows,
                                      fp8_rows_t)
from conftest import hopper
from kernels.fp8 import pow2_scale

FP8_ERR = 0.08  # e4m3 rounds to 3 mantissa bits: a product's relative error (Frobenius) stays well under this


def _case(name, M=96, K=64, N=48, seed=0):
    """x [2, M/2, K] bf16 values (as fp32), w [N, K] fp32, dy [2, M/2, N]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.logspace(-2, 2, M)[:, None]
    w = torch.randn(N, K, generator=g) / K**0.5
    dy = torch.randn(M, N, generator=g)
    if name == "row_1000x":
        x[7] *= 1000
    elif name == "zero_rows":
        x[::5] = 0
        dy[::3] = 0
    elif name == "all_zero":
        x.zero_()
    elif name == "huge_weight":
        w[3, 5] = 40.0  # 320x the rest: one scale for w still leaves them normal e4m3 values
    return (x.bfloat16().float().view(2, M // 2, K), w, dy.bfloat16().float().view(2, M // 2, N))


def _run(x, w, dy, device="cpu", hint=None):
    xb = x.to(device, torch.bfloat16).requires_grad_()
    wp = w.to(device).clone().requires_grad_()
    y = fp8_linear(xb, wp, hint)
    y.backward(dy.to(device, torch.bfloat16))
    return y.detach().cpu(), xb.grad.cpu(), wp.grad.cpu()


def _exact(x, w, dy):
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    return x64 @ w64.t(), dy64 @ w64, (dy64.reshape(-1, dy.shape[-1]).t() @ x64.reshape(-1, x.shape[-1]))


def _rel(got, want):
    want = want.double()
    return float((got.double() - want).norm() / want.norm()) if want.norm() > 0 else float(got.double().norm())


CASES = ("random", "row_1000x", "zero_rows", "all_zero", "huge_weight")


@pytest.mark.parametrize("case", CASES)
def test_fp8_linear_against_fp64(case):
    """y, dx and dw within FP8's error of fp64, row by row where rows differ by orders of magnitude; zero rows give
    zero outputs and zero input gradients, an all-zero input zero everywhere, and nothing is NaN."""
    x, w, dy = _case(case)
    y, dx, dw = _run(x, w, dy)
    ey, edx, edw = _exact(x, w, dy)
    assert y.dtype == torch.bfloat16 and y.shape == ey.shape and dw.dtype == w.dtype and dw.shape == w.shape
    assert all(t.isfinite().all() for t in (y, dx, dw))
    rows = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
    for got, want in ((y, ey), (dx, edx)):
        for r, (g, e) in enumerate(zip(rows(got), rows(want))):
            if e.norm() == 0:
                assert not g.any(), (case, r)
            else:
                assert _rel(g, e) < FP8_ERR, (case, r)
    if case == "all_zero":
        assert not y.any() and not dw.any()
    else:
        assert _rel(dw, edw) < FP8_ERR
    if case == "zero_rows":
        assert not rows(y)[::5].any() and not rows(dx)[::3].any()


def test_fake_shapes_match_the_ops():
    """The custom ops' fake implementations give the real outputs' shapes, dtypes and strides (torch.compile traces
    with them)."""
    x, w, dy = _case("random")
    x_MK = x.reshape(-1, x.shape[-1]).bfloat16()
    ok = {"test_faketensor": "SUCCESS"}
    assert torch.library.opcheck(fp8_rows, (x_MK,), test_utils=("test_faketensor",)) == ok
    x_q, x_s = fp8_rows(x_MK)
    assert torch.library.opcheck(fp8_rows_t, (x_q, x_s), test_utils=("test_faketensor",)) == ok
    hint = torch.zeros(1)
    assert torch.library.opcheck(fp8_linear_forward, (x_q, x_s, w, hint), test_utils=("test_faketensor",)) == ok
    _, s_w = fp8_linear_forward(x_q, x_s, w, hint)
    xt, s_x = fp8_rows_t(x_q, x_s)
    args = (dy.reshape(-1, dy.shape[-1]).bfloat16(), xt, s_x, w, s_w)
    assert torch.library.opcheck(fp8_linear_backward, args, test_utils=("test_faketensor",)) == ok


class _Block(nn.Module):
    """Two projections around an elementwise op, as an attention's are."""

    def __init__(self, D=64, H=96):
        super().__init__()
        self.wq, self.wo = nn.Linear(D, H, bias=False), nn.Linear(H, D, bias=False)

    def forward(self, x):
        return self.wo(torch.nn.functional.silu(self.wq(x)) * 2)


def test_compiled_equals_eager():
    """Inside a block compiled as one graph (fullgraph, as components/parallel/compile.py compiles the attention)
    the layers' custom ops run as in eager: output and every gradient equal to the bit."""
    torch.manual_seed(0)
    block = _Block()
    for name in ("wq", "wo"):
        Fp8RowsLinear.from_linear(getattr(block, name))
    x = torch.randn(2, 16, 64).bfloat16().requires_grad_()

    def run():
        x.grad = block.wq.weight.grad = block.wo.weight.grad = None
        y = block(x)
        y.float().square().sum().backward()
        return y.detach(), x.grad, block.wq.weight.grad, block.wo.weight.grad

    eager = run()
    block.forward = torch.compile(block.forward, fullgraph=True, dynamic=False)
    compiled = run()
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


class _SharedInput(nn.Module):
    """Two projections of one input (an attention's wq and wkv_a), then a third of their concatenation."""

    def __init__(self, D=64):
        super().__init__()
        self.wq, self.wkv, self.wo = nn.Linear(D, 96, bias=False), nn.Linear(D, 32, bias=False), nn.Linear(128, D,
                                                                                                         bias=False)

    def forward(self, x):
        return self.wo(torch.cat([self.wq(x), self.wkv(x)], -1))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, hopper])])
def test_compiled_quantises_a_shared_input_once(monkeypatch, device):
    """Compiled, two layers reading one input quantise it once and copy it transposed once (the graph's
    common-subexpression pass merges ``fp8_rows`` and ``fp8_rows_t``): 5 row quantisations and 5 transposed copies
    a step where eager runs 6 of each (x of each layer, dy of each layer), and every output and gradient as eager's
    to the bit."""
    torch.manual_seed(0)
    block = _SharedInput().to(device)
    for name in ("wq", "wkv", "wo"):
        Fp8RowsLinear.from_linear(getattr(block, name))
    x = torch.randn(2, 16, 64, device=device).bfloat16().requires_grad_()
    calls = {"rows": 0, "rows_t": 0}

    def counted(fn, key):
        def call(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(fp8_linear_module, "quant_rows", counted(fp8_linear_module.quant_rows, "rows"))
    monkeypatch.setattr(fp8_linear_module, "requant_expert_t", counted(fp8_linear_module.requant_expert_t, "rows_t"))

    def run():
        x.grad = None
        for p in block.parameters():
            p.grad = None
        calls.update(rows=0, rows_t=0)
        y = block(x)
        y.float().square().sum().backward()
        return (y.detach(), x.grad, *(p.grad for p in block.parameters())), dict(calls)

    eager, eager_calls = run()
    block.forward = torch.compile(block.forward, fullgraph=True, dynamic=False)
    run()  # compiles
    compiled, compiled_calls = run()
    assert eager_calls == {"rows": 6, "rows_t": 6} and compiled_calls == {"rows": 5, "rows_t": 5}
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, hopper])])
def test_the_weight_scale_guess_changes_no_value_and_is_updated(device):
    """The scale hint, whatever it holds (none, the right power of two, a wrong one, NaN), gives the same output
    and gradients to the bit, and holds w's scale afterwards; on CUDA the right guess takes the cast's one-pass
    path and a wrong one its recast."""
    x, w, dy = _case("huge_weight", M=256, K=128, N=64)
    want = _run(x, w, dy, device)
    scale = pow2_scale(w.abs().max())
    for guess in (0.0, float(scale), float(scale) * 4, float("nan")):
        hint = torch.full((1,), guess, device=device)
        got = _run(x, w, dy, device, hint)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), guess
        assert torch.equal(hint.cpu(), scale.view(1)), guess


def test_from_linear_keeps_the_weight_and_refuses_a_bias():
    lin = nn.Linear(64, 32, bias=False)
    w = lin.weight
    assert Fp8RowsLinear.from_linear(lin) is lin and type(lin) is Fp8RowsLinear and lin.weight is w
    assert list(lin.state_dict()) == ["weight"]  # the scale hint is a buffer checkpoints leave out
    lin(torch.randn(3, 64).bfloat16())
    assert torch.equal(lin.fp8_hint, pow2_scale(w.detach().abs().max()).view(1))
    with pytest.raises(ValueError, match="no bias"):
        Fp8RowsLinear.from_linear(nn.Linear(64, 32))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("case", CASES)
def test_cuda_kernels_against_emulation_and_graph(case):
    """On Hopper the Triton and cuBLAS kernels against the emulated path on the same inputs (the same quantisation;
    fp32 against FP8 MMA accumulation), against fp64, and a CUDA graph of forward and backward replays to the same
    values."""
    from cuda_graphs import warm_up_and_capture

    x, w, dy = _case(case, M=4096, K=2048, N=1536)
    got, emulated, exact = _run(x, w, dy, "cuda"), _run(x, w, dy), _exact(x, w, dy)
    for g, e, ex in zip(got, emulated, exact):
        assert g.isfinite().all()
        assert _rel(g, e) < 2e-2 if e.any() else not g.any()
        assert _rel(g, ex) < FP8_ERR if ex.any() else not g.any()
    xb = x.cuda().bfloat16().requires_grad_()
    wp = w.cuda().clone().requires_grad_()
    dyb = dy.cuda().bfloat16()

    hint = torch.zeros(1, device="cuda")  # held across replays: right from the second call on

    def step():
        xb.grad = wp.grad = None
        y = fp8_linear(xb, wp, hint)
        y.backward(dyb)
        return y.detach(), xb.grad, wp.grad

    graph, out = warm_up_and_capture(step)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a.cpu(), b) for a, b in zip(out, got))
