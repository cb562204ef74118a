"""The FP8 output head (components/train/fp8_head.py) and the FP8 backward of the cross-entropy
(kernels/cross_entropy.py): the casts and the FP8 gradient against their definitions and fp64, the handover
of the gradient from the loss to the head (taken only for the very logits, never lost), the recipe's swap, and
on a Hopper GPU the Triton kernels against the torch path, torchao's tensorwise head and a CUDA graph."""

import pytest
import torch
from torch import nn

from components.parallel.compile import compile_ends
from components.train import fp8_head as fh
from components.train.loss import lm_loss
from kernels import cross_entropy as ce
from kernels.fp8 import FP8, FP8_GRAD, Q_MAX, cast_both, pow2_scale
from cuda_graphs import warm_up_and_capture
from conftest import hopper


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def _case(N, V, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x_NV = (torch.randn(N, V, generator=g) * 3).to(dtype).to(device)
    labels_N = torch.randint(0, V, (N,), generator=g).to(device)
    labels_N[1] = -100  # an ignored row
    labels_N[0] = V - 1
    return x_NV, labels_N


@pytest.mark.parametrize("dtype", [FP8, FP8_GRAD])
def test_cast_both_is_one_power_of_two_scale_in_both_layouts(dtype):
    x = torch.randn(48, 80) * torch.logspace(-6, 6, 80)  # columns from 1e-6 to 1e6
    q, qt, s = cast_both(x, dtype)
    assert q.dtype == qt.dtype == dtype and q.shape == (48, 80) and qt.shape == (80, 48)
    assert torch.equal(s, pow2_scale(x.abs().amax(), Q_MAX[dtype]))
    assert torch.equal(q.view(torch.uint8), (x / s).to(dtype).view(torch.uint8))  # |x| / s <= max: no clamp
    assert torch.equal(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8))
    q0, _, s0 = cast_both(torch.zeros(16, 16), dtype)
    assert s0 == 1 and not q0.float().any()


@pytest.mark.parametrize("grad_loss", [1.0, 0.37, 1e-3])
def test_fp8_gradient_of_the_loss_is_the_fp64_gradient_in_e5m2(grad_loss):
    """q · s against fp64's gradient: within e5m2's rounding (relative 2^-3, or half a subnormal step); the scale
    the smallest power of two that fits the bound |grad_loss| / n_valid; ignored rows zero; qᵀ the same bytes."""
    x_NV, labels_N = _case(37, 300)
    labels_N[5] = 7
    x_NV[5, 7] = 40.0  # a row whose softmax is one-hot: gradient ~0 there
    x_NV[6] = 0.0  # a uniform row
    loss_N, lse_N = ce.cross_entropy_fwd_torch(x_NV, labels_N, -100)
    n_valid = (labels_N != -100).sum().float()
    g, q, qt, s = ce.cross_entropy_bwd_fp8(x_NV, labels_N, lse_N, torch.tensor(grad_loss), n_valid, -100, FP8_GRAD)
    assert g is None  # the bf16 form only where asked for
    bound = grad_loss / n_valid
    assert float(s) * Q_MAX[FP8_GRAD] >= bound > float(s) * Q_MAX[FP8_GRAD] / 2
    x64 = x_NV.double().requires_grad_()
    valid = labels_N != -100
    nll = -torch.log_softmax(x64, 1).gather(1, labels_N.clamp(min=0)[:, None])[:, 0]
    ((nll * valid).sum() / valid.sum() * grad_loss).backward()
    deq = q.double() * float(s)
    err = (deq - x64.grad).abs()
    assert (err <= x64.grad.abs() * 2**-3 * 1.001 + float(s) * 2**-17).all(), float(err.max())
    assert not deq[1].any() and deq[0].any()
    assert torch.equal(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8))


@pytest.mark.parametrize("rows, cols, plain", [(True, True, False), (False, True, True), (True, False, True),
                                               (False, False, True)])
def test_the_loss_writes_the_forms_asked_for(rows, cols, plain):
    """Each form of the FP8 backward where asked for, None where not: q_NV and q_VN the same bytes, the plain
    form fp64's gradient rounded to bf16 (and the FP8 form within e5m2's rounding of it), the scale the same
    whichever forms are written."""
    x_NV, labels_N = _case(29, 200, seed=4, dtype=torch.bfloat16)
    _, lse_N = ce.cross_entropy_fwd_torch(x_NV, labels_N, -100)
    n_valid, grad_loss = (labels_N != -100).sum().float(), torch.tensor(0.6)
    got = ce.cross_entropy_bwd_fp8(x_NV, labels_N, lse_N, grad_loss, n_valid, -100, FP8_GRAD, rows, cols, plain)
    every = ce.cross_entropy_bwd_fp8(x_NV, labels_N, lse_N, grad_loss, n_valid, -100, FP8_GRAD, True, True, True)
    assert torch.equal(got.s, every.s)
    for name, asked in (("q_NV", rows), ("q_VN", cols), ("g_NV", plain)):
        assert (getattr(got, name) is not None) == asked, name
        if asked:
            assert torch.equal(getattr(got, name).view(torch.uint8), getattr(every, name).view(torch.uint8)), name
    assert torch.equal(every.q_VN.view(torch.uint8), every.q_NV.t().contiguous().view(torch.uint8))
    assert every.g_NV.dtype == torch.bfloat16
    x64 = x_NV.double().requires_grad_()
    valid = labels_N != -100
    nll = -torch.log_softmax(x64, 1).gather(1, labels_N.clamp(min=0)[:, None])[:, 0]
    ((nll * valid).sum() / valid.sum() * 0.6).backward()
    g64 = x64.grad
    assert ((every.g_NV.double() - g64).abs() <= g64.abs() * 2**-8 + 1e-30).all()  # bf16's rounding of it
    deq = every.q_NV.double() * float(every.s)
    assert ((deq - g64).abs() <= g64.abs() * 2**-3 * 1.001 + float(every.s) * 2**-17).all()
    assert not every.g_NV[1].any() and not every.q_NV[1].float().any()  # the ignored row


def _head_and_input(V=96, D=64, B=2, S=8, seed=0, device="cpu"):
    """A small Fp8Head with all three GEMMs in FP8 (the loss hands over its gradient in FP8), h and labels."""
    torch.manual_seed(seed)
    linear = nn.Linear(D, V, bias=False, device=device)
    h = torch.randn(B, S, D, device=device)
    labels = torch.randint(0, V, (B, S), device=device)
    labels[0, 3] = -100
    head = fh.Fp8Head.from_linear(linear)
    head.fp8_gemms = fh.GEMMS
    return head, h, labels


def _fp64_grads(head, h, labels, extra=None):
    """Loss and gradients of h and W in fp64 without any quantisation (the truth FP8 approximates)."""
    w = head.weight.detach().double().requires_grad_()
    h64 = h.detach().double().requires_grad_()
    logits = h64 @ w.t()
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    total = loss + (extra(logits) if extra else 0)
    total.backward()
    return loss.detach(), h64.grad, w.grad


def test_the_head_takes_the_fp8_gradient_the_loss_wrote(monkeypatch):
    """The loss's backward writes the FP8 gradient and returns a broadcast zero in place of the bf16 one; the head
    reads the FP8 one (casts no gradient itself). Its two GEMMs then equal the same GEMMs on the torch
    reference's FP8 gradient bit for bit, and the gradients of h and W are fp64's within FP8's error."""
    head, h, labels = _head_and_input()
    casts = []
    monkeypatch.setattr(fh, "cast_both", lambda x, d: casts.append(d) or cast_both(x, d))
    hg = h.clone().requires_grad_()
    logits = head(hg)
    assert fh.handoff_of(logits) is head.handoff
    loss = lm_loss(logits, labels)
    puts = []
    put = head.handoff.put
    monkeypatch.setattr(head.handoff, "put", lambda g: puts.append(g) or put(g))
    loss.backward()
    assert casts == [FP8, FP8] and len(puts) == 1  # h and W in the forward; the gradient came in FP8
    g_NV, q_NV, q_VN, s = puts[0]
    assert g_NV is None  # both backward GEMMs read FP8: no bf16 gradient written
    _, qh_DT, s_h = cast_both(hg.detach().flatten(0, 1), FP8)
    _, qw_DV, s_w = cast_both(head.weight.detach(), FP8)
    assert torch.equal(hg.grad.flatten(0, 1), fh.scaled_mm(q_NV, qw_DV.t(), s, s_w, torch.float32))
    assert torch.equal(head.weight.grad, fh.scaled_mm(q_VN, qh_DT.t(), s, s_h, torch.float32))
    want_loss, want_h, want_w = _fp64_grads(head, h, labels)
    assert abs(loss.item() - want_loss.item()) < 0.02 * want_loss.item()
    assert _rel(hg.grad, want_h) < 0.12 and _rel(head.weight.grad, want_w) < 0.12
    assert fh.handoff_of(logits) is None  # taken: a second loss on the same logits would not get it


@pytest.mark.parametrize("gemms", [fh.GEMMS, fh.Fp8Head.fp8_gemms])
def test_another_use_of_the_logits_adds_its_gradient(gemms):
    """Logits used by the loss and by a second term: the head gets the sum (nothing lost), as in fp64 — where the
    loss wrote the gradient in FP8 only (all three GEMMs) and where it wrote it in bf16 too (the default)."""
    head, h, labels = _head_and_input(seed=1)
    head.fp8_gemms = gemms
    extra = lambda logits: 0.05 * (logits.float() ** 2).sum(-1).mean()
    hg = h.clone().requires_grad_()
    logits = head(hg)
    (lm_loss(logits, labels) + extra(logits)).backward()
    _, want_h, want_w = _fp64_grads(head, h, labels, extra)
    _, no_extra_h, _ = _fp64_grads(head, h, labels)
    assert _rel(hg.grad, want_h) < 0.12 and _rel(head.weight.grad, want_w) < 0.12
    assert _rel(want_h, no_extra_h) > 0.2  # the second term matters: dropping it would fail the check above


def test_modified_or_copied_logits_take_the_plain_path():
    head, h, labels = _head_and_input(seed=2)
    logits = head(h)
    assert fh.handoff_of(logits.clone()) is None  # a copy
    logits2 = head(h)
    assert fh.handoff_of(logits) is None  # the head returned other logits since
    logits2.mul_(1.0)
    assert fh.handoff_of(logits2) is None  # modified in place
    hg = h.clone().requires_grad_()
    logits3 = head(hg)
    (lm_loss(logits3 * 2.0, labels)).backward()  # the loss sees a product: the head casts its bf16 gradient
    _, want_h, want_w = _fp64_grads(head, h, labels, lambda lg: torch.nn.functional.cross_entropy(
        (2 * lg).flatten(0, 1), labels.flatten()) - torch.nn.functional.cross_entropy(lg.flatten(0, 1), labels.flatten()))
    assert _rel(hg.grad, want_h) < 0.12 and _rel(head.weight.grad, want_w) < 0.12


@pytest.mark.parametrize("gemms", [(), ("output",), ("grad_input", "grad_weight"), ("output", "grad_weight"),
                                   ("output", "grad_input")])
def test_each_gemm_of_the_head_in_fp8_or_unquantised_as_asked(gemms):
    """``fp8_gemms`` picks the head's GEMMs one by one: each named one equals ``_scaled_mm`` of the tensorwise-cast
    operands bit for bit (the gradient as the loss wrote it in FP8), each other one the unquantised product (fp32
    here). The loss writes the gradient in FP8 wherever a backward GEMM reads it so, in the forms that GEMM reads,
    and in full precision where the other one is not FP8; the head casts no gradient itself."""
    head, h, labels = _head_and_input(seed=3)
    head.fp8_gemms = gemms
    puts, put = [], head.handoff.put
    head.handoff.put = lambda *a: puts.append(a[0]) or put(*a)
    casts, cast = [], fh.cast_both
    fh.cast_both = lambda x, d: casts.append(d) or cast(x, d)
    try:
        hg = h.clone().requires_grad_()
        logits = head(hg)
        backward8 = {"grad_input", "grad_weight"} & set(gemms)
        assert (fh.handoff_of(logits) is not None) == head.takes_fp8_grad == bool(backward8)
        logits.retain_grad()
        lm_loss(logits, labels).backward()
    finally:
        fh.cast_both = cast
    assert FP8_GRAD not in casts and len(puts) == head.takes_fp8_grad
    h_TD, w_VD = hg.detach().flatten(0, 1), head.weight.detach()
    qh_TD, qh_DT, s_h = cast_both(h_TD, FP8)
    qw_VD, qw_DV, s_w = cast_both(w_VD, FP8)
    if puts:
        g = puts[0]
        assert ((g.q_NV is not None, g.q_VN is not None, g.g_NV is not None)
                == ("grad_input" in gemms, "grad_weight" in gemms, len(backward8) < 2))
    g_TV = logits.grad.flatten(0, 1)  # what the head's backward received: bf16 (fp32 here) where the loss wrote it
    if puts and puts[0].g_NV is None:
        g_TV = puts[0].q_NV.float() * puts[0].s
    fp8 = {"output": lambda: fh.scaled_mm(qh_TD, qw_VD.t(), s_h, s_w, torch.float32),
           "grad_input": lambda: fh.scaled_mm(puts[0].q_NV, qw_DV.t(), puts[0].s, s_w, torch.float32),
           "grad_weight": lambda: fh.scaled_mm(puts[0].q_VN, qh_DT.t(), puts[0].s, s_h, torch.float32)}
    exact = {"output": h_TD.double() @ w_VD.double().t(), "grad_input": g_TV.double() @ w_VD.double(),
             "grad_weight": g_TV.double().t() @ h_TD.double()}
    got = {"output": logits.detach().flatten(0, 1), "grad_input": hg.grad.flatten(0, 1), "grad_weight": head.weight.grad}
    for name in fh.GEMMS:
        if name in gemms:
            assert torch.equal(got[name], fp8[name]()), name
            assert _rel(got[name], exact[name]) > 1e-3, name  # quantised: visibly off the exact product
        else:
            assert _rel(got[name], exact[name]) < 1e-6, name
    _, want_h, want_w = _fp64_grads(head, h, labels)
    assert _rel(hg.grad, want_h) < 0.12 and _rel(head.weight.grad, want_w) < 0.12


def test_head_gemms_study_reads_the_gemms_by_name():
    from benchmarks.fp8_head_gemms import parse_gemms

    assert parse_gemms("grad_weight, output") == ("output", "grad_weight")  # the head's order
    assert parse_gemms("none") == () == parse_gemms("")
    with pytest.raises(SystemExit, match="'dgrad' is not one of the head's GEMMs"):
        parse_gemms("output,dgrad")


def test_recipe_swaps_a_tensorwise_head_and_compile_leaves_it_eager():
    from components.moe_echo.models import build_model
    from components.train import float8
    from components.train.config import load_config

    for recipe, swapped in (("tensorwise", True), ("rowwise", False)):
        cfg = load_config(["--model.converters", "float8", "--quantize.linear.float8.filter_fqns", "router.gate",
                           "--quantize.linear.float8.recipe_name", recipe])
        model = build_model("deepseek_v3", "tiny", cfg.moe_echo, seq_len=32, device=torch.device("cpu"), seed=0,
                            overrides={"num_experts": 16})
        weight = model.output.weight
        names = float8.convert_float8(model, cfg)
        assert "output" in names and (type(model.output) is fh.Fp8Head) == swapped, recipe
        # warned only where both backward GEMMs are FP8: torchao's rowwise head, or an Fp8Head told so
        assert (float8.head_note(names, model.output) is None) == swapped, recipe
        if swapped:
            assert model.output.fp8_gemms == ("output", "grad_weight") and model.output.fp8_backward == ("grad_weight",)
            model.output.fp8_gemms = fh.GEMMS
            assert "~2% above bf16's loss" in float8.head_note(names, model.output)
        assert model.output.weight is weight and "output.weight" in dict(model.named_parameters())
    assert compile_ends(model, "eager") == ["norm", "output"]  # torchao's rowwise head compiles
    cfg = load_config(["--model.converters", "float8", "--quantize.linear.float8.filter_fqns", "router.gate"])
    model = build_model("deepseek_v3", "tiny", cfg.moe_echo, seq_len=32, device=torch.device("cpu"), seed=0,
                        overrides={"num_experts": 16})
    float8.convert_float8(model, cfg)
    assert compile_ends(model, "eager") == ["norm"]  # the FP8 head stays eager


# --- GPU (Hopper): the kernels, the head against torchao's, a CUDA graph ------------------------------------


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("dtype", [FP8, FP8_GRAD])
def test_cast_both_kernel_equals_torch(dtype):
    for R, C in ((16384, 2048), (300, 130), (1, 16)):
        x = (torch.randn(R, C, device="cuda") * torch.logspace(-5, 5, C, device="cuda")).bfloat16()
        q, qt, s = cast_both(x, dtype)
        rq, rqt, rs = cast_both(x.cpu(), dtype)
        assert torch.equal(s.cpu(), rs)
        assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))
        assert torch.equal(qt.cpu().view(torch.uint8), rqt.view(torch.uint8))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("N, V", [(4096, 32768), (333, 1000), (5, 16)])
@pytest.mark.parametrize("rows, cols, plain", [(True, True, False), (False, True, True)])
def test_fp8_backward_kernel_equals_torch(N, V, rows, cols, plain):
    """The kernel against the torch path on the same lse: the same scale, the layouts the same bytes, values equal
    but for fp32 exp's last bit flipping a rounding (<= 1 e5m2 step on < 0.1% of them; the bf16 form <= 1 bf16
    step); ignored rows zero; only the forms asked for written."""
    x_NV, labels_N = _case(N, V, seed=N, dtype=torch.bfloat16, device="cuda")
    labels_N[2] = -100
    _, lse_N = ce.cross_entropy_fwd(x_NV, labels_N, -100)
    n_valid = (labels_N != -100).sum().float()
    grad_loss = torch.tensor(0.8, device="cuda")
    got = ce.cross_entropy_bwd_fp8(x_NV, labels_N, lse_N, grad_loss, n_valid, -100, FP8_GRAD, rows, cols, plain)
    ref = ce.cross_entropy_bwd_fp8_torch(x_NV, labels_N, lse_N, grad_loss, n_valid, -100, FP8_GRAD, True, True, True)
    assert torch.equal(got.s, ref.s)
    assert ((got.q_NV is not None, got.q_VN is not None, got.g_NV is not None) == (rows, cols, plain))
    q = got.q_NV if rows else got.q_VN.t()
    if rows and cols:
        assert torch.equal(got.q_VN.view(torch.uint8), got.q_NV.t().contiguous().view(torch.uint8))
    differ = q.view(torch.uint8) != ref.q_NV.view(torch.uint8)
    assert float(differ.float().mean()) < 1e-3
    assert ((q.float() - ref.q_NV.float()).abs()[differ] <= ref.q_NV.float().abs()[differ] * 2**-2 + 2**-16).all()
    assert not q[1].float().any() and not q[2].float().any()
    if plain:
        plain_ref = ce.cross_entropy_bwd(x_NV, labels_N, lse_N, grad_loss, n_valid, -100)  # the row kernel
        err = (got.g_NV.float() - plain_ref.float()).abs()
        assert (err <= plain_ref.float().abs() * 2**-7).all() and float((err > 0).float().mean()) < 1e-3
        assert not got.g_NV[1].float().any() and not got.g_NV[2].float().any()


def _torchao_head(linear):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    m = nn.Sequential(linear)
    convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    return m[0]


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("gemms", [fh.Fp8Head.fp8_gemms, fh.GEMMS])
def test_head_tracks_torchaos_tensorwise_head_and_a_cuda_graph_replays_it(gemms):
    """v2lite_1b's head shape: loss and gradients as close to fp64's as torchao's tensorwise head (another FP8
    implementation) gets; a CUDA graph of forward + loss + backward replays to the eager result. With the
    default GEMMs and with all three in FP8 (the loss's FP8 gradient kernel)."""
    import copy

    torch.manual_seed(0)
    T, D, V = 4096, 2048, 32768
    linear = nn.Linear(D, V, bias=False, device="cuda", dtype=torch.bfloat16)
    nn.init.normal_(linear.weight, std=D**-0.5)
    h = torch.randn(1, T, D, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, V, (1, T), device="cuda")
    head, ao = fh.Fp8Head.from_linear(copy.deepcopy(linear)), _torchao_head(copy.deepcopy(linear))
    head.fp8_gemms = gemms
    want_loss, want_h, want_w = _fp64_grads(head, h, labels)
    errs = {}
    for name, m in (("ours", head), ("torchao", ao)):
        hg = h.clone().requires_grad_()
        loss = lm_loss(m(hg), labels)
        loss.backward()
        errs[name] = (abs(float(loss) - float(want_loss)), _rel(hg.grad, want_h), _rel(m.weight.grad, want_w))
    for ours, theirs in zip(errs["ours"], errs["torchao"]):
        assert ours <= 1.5 * theirs + 1e-3, errs
    eager_w = head.weight.grad.clone()

    hg = h.clone().requires_grad_()

    def step():
        head.weight.grad = None
        hg.grad = None
        loss = lm_loss(head(hg), labels)
        loss.backward()
        return loss

    graph, loss = warm_up_and_capture(step)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(head.weight.grad, eager_w) and abs(float(loss) - float(want_loss)) < 0.02
