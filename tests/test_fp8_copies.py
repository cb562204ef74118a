"""FP8 experts' weight copies written by the optimizer step (``Fp8WeightCopies``): after every step, gated
step, partial update and checkpoint load they equal a fresh cast of the fp32 masters, and the layer reading
them equals the layer casting those masters per call. CPU: the torch path; a Hopper GPU: the Triton kernels
against it, and a whole graphed step (forward, backward, optimizer) against the same step run eagerly."""

import pytest
import torch
from torchtitan.models.moe import MoEArgs

from components.moe_echo.config import MoEEchoConfig
from components.moe_echo.experts import GroupedExperts
from components.moe_echo.fp8_experts import Fp8WeightCopies, fp8_grouped_swiglu
from components.moe_echo.layer import MoELayer
from components.moe_echo.weight_copies import weight_copies
from components.train.master_adamw import AdamWWithCopies, MasterAdamW, refresh_compute_copies
from kernels.adamw import adamw_master_, adamw_master_reference_
from kernels.fp8 import expert_scales_torch, write_copy_reference_
from cuda_graphs import warm_up_and_capture
from conftest import hopper

HP = dict(lr=0.02, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)  # a large lr: the scales move between steps
E, H, D = 4, 16, 32


def _bytes(t):
    return t.view(torch.uint8)


def _fresh(w1, w2, w3) -> Fp8WeightCopies:
    c = Fp8WeightCopies(*w1.shape, w1.device)
    c.write_(w1, w2, w3)
    return c


def assert_copies_equal(a: Fp8WeightCopies, b: Fp8WeightCopies):
    """Equal bytes and scales; and a's transposed copies are its plain ones transposed (checked by torch)."""
    assert torch.equal(_bytes(a.t13_ED2H), _bytes(a.plain13_E2HD).transpose(1, 2))
    assert torch.equal(_bytes(a.t2_EHD), _bytes(a.plain2_EDH).transpose(1, 2))
    assert torch.equal(a.scale_2E, b.scale_2E)
    for name in ("plain13_E2HD", "plain2_EDH", "t13_ED2H", "t2_EHD"):
        assert torch.equal(_bytes(getattr(a, name)), _bytes(getattr(b, name))), name


def test_fresh_copies_are_the_weights_cast_with_one_scale_per_expert_in_both_layouts():
    g = torch.Generator().manual_seed(0)
    w1, w2, w3 = (torch.randn(E, *s, generator=g) for s in ((H, D), (D, H), (H, D)))
    w3[2] *= 1e4  # expert 2's w3 sets the scale it shares with w1
    w2[1] = 0  # an all-zero expert: scale 1
    c = _fresh(w1, w2, w3)
    assert torch.equal(c.scale_2E[0], expert_scales_torch(w1, w3)) and torch.equal(c.scale_2E[1], expert_scales_torch(w2))
    assert c.scale_2E[1, 1] == 1 and c.scale_2E[0, 2] > 1000 * c.scale_2E[0, 0]
    assert torch.equal(_bytes(c.plain13_E2HD.transpose(1, 2)), _bytes(c.t13_ED2H))
    assert torch.equal(_bytes(c.plain2_EDH.transpose(1, 2)), _bytes(c.t2_EHD))
    deq = c.plain13_E2HD.double() * c.scale_2E[0].double()[:, None, None]
    ref = torch.cat([w1, w3], 1).double()
    assert ((deq - ref).abs() <= ref.abs() * 2**-4 + c.scale_2E[0].double()[:, None, None] * 2**-10).all()


def _experts(opt_name: str, seed: int = 0) -> GroupedExperts:
    torch.manual_seed(seed)
    ge = GroupedExperts(D, H, E, precision="fp8")
    ge.init_weights(0.02)
    with torch.no_grad():
        ge.w2[3].mul_(40.0)  # one expert far from the others
    if opt_name == "copies":  # experts outside FSDP: bf16 compute copies, gradients in ge.copies[w].grad
        ge.compute_dtype = torch.bfloat16
        ge.enable_compute_copies()
    ge.enable_fp8_copies()
    return ge


def _optimizer(opt_name, ge):
    if opt_name == "copies":
        return AdamWWithCopies([ge.w1, ge.w2, ge.w3], fused=True, copies=ge.copies, **HP)
    return MasterAdamW([ge.w1, ge.w2, ge.w3], copies=ge.copies, **HP)


def _masters(opt, ge):
    get = opt.masters.__getitem__ if isinstance(opt, MasterAdamW) else (lambda w: w.detach())
    return [get(w) for w in (ge.w1, ge.w2, ge.w3)]


def _set_grads(opt_name, ge, seed, only=None):
    g = torch.Generator().manual_seed(100 + seed)
    for i, w in enumerate((ge.w1, ge.w2, ge.w3)):
        grad = (torch.randn(w.shape, generator=g) * (1 + seed)).bfloat16() if only in (None, i) else None
        if opt_name == "copies":
            ge.copies[w].grad = grad
        else:
            w.grad = grad


@pytest.mark.parametrize("opt_name", ["masters", "copies"])
def test_optimizer_written_copies_equal_a_fresh_cast_of_the_masters(opt_name):
    """After each step the incremental copies (old scales while the amax is taken, recast where it moved) are
    byte-for-byte a fresh cast of the new fp32 masters; a gated step changes nothing; a step that updates one
    weight only rewrites the copies whole; the experts' forward reads the copies."""
    ge = _experts(opt_name)
    opt = _optimizer(opt_name, ge)
    assert_copies_equal(ge.fp8_copies, _fresh(*_masters(opt, ge)))
    moved = kept = 0
    for step in range(6):
        before = ge.fp8_copies.scale_2E.clone()
        _set_grads(opt_name, ge, step)
        opt.step()
        opt.zero_grad()
        assert_copies_equal(ge.fp8_copies, _fresh(*_masters(opt, ge)))
        assert not ge.fp8_copies.amax_2E.any()
        moved += int((ge.fp8_copies.scale_2E != before).sum())
        kept += int((ge.fp8_copies.scale_2E == before).sum())
    assert moved > 0 and kept > 0  # both branches: recast experts and experts left as written
    snapshot = [t.clone() for t in (*_masters(opt, ge), ge.fp8_copies.plain13_E2HD, ge.fp8_copies.t2_EHD,
                                    ge.fp8_copies.scale_2E)]
    opt.found_inf = torch.ones(())  # a gated step (overflow replay, non-finite guard)
    _set_grads(opt_name, ge, 7)
    opt.step()
    opt.zero_grad()
    after = [*_masters(opt, ge), ge.fp8_copies.plain13_E2HD, ge.fp8_copies.t2_EHD, ge.fp8_copies.scale_2E]
    assert all(torch.equal(_bytes(a) if a.dtype.itemsize == 1 else a, _bytes(b) if b.dtype.itemsize == 1 else b)
               for a, b in zip(snapshot, after))
    opt.found_inf = torch.zeros(())
    _set_grads(opt_name, ge, 8, only=1)  # w2 alone has a gradient
    opt.step()
    opt.zero_grad()
    assert_copies_equal(ge.fp8_copies, _fresh(*_masters(opt, ge)))
    # the forward reads the copies: equal to the FP8 experts casting the fp32 masters per call
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, D, generator=g).bfloat16()
    counts = torch.tensor([9, 0, 25, 4])
    y = ge(x, counts)
    y_ref = fp8_grouped_swiglu(x, *_masters(opt, ge), counts)
    assert torch.equal(y[:38], y_ref[:38])


def test_layer_with_copies_equals_per_call_casts_in_output_and_every_gradient():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(70, D, generator=g).bfloat16()
    ws = [torch.randn(E, *s, generator=g) * 0.05 for s in ((H, D), (D, H), (H, D))]
    gy = torch.randn(70, D, generator=g).bfloat16()
    for counts in ([0, 0, 64, 0], [20, 0, 30, 13], [1, 2, 3, 4]):  # all to one expert, an empty expert, few rows
        counts = torch.tensor(counts)
        used = int(counts.sum())
        runs = []
        for copies in (None, _fresh(*ws)):
            xx, ww = x.clone().requires_grad_(), [w.clone().requires_grad_() for w in ws]
            y = fp8_grouped_swiglu(xx, *ww, counts, copies=copies)
            y.backward(gy)
            runs.append([y[:used], xx.grad[:used], *(w.grad for w in ww)])
        for a, b in zip(*runs):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="belong to other weights"):
        fp8_grouped_swiglu(x, *[torch.cat([w, w[:1]]) for w in ws], counts, copies=_fresh(*ws))


def test_fp8_experts_compute_copies_are_stand_ins_the_optimizer_does_not_write():
    """Experts outside FSDP with FP8 copies: their GEMMs read the FP8 copies only, so each compute copy is a stand-in
    of its shape and dtype holding one element (its memory freed), never written by the step; forward and backward
    through it equal the FP8 experts on the fp32 weights, the gradients land in the copies' ``grad``, and clones
    asked for other than from the FP8 copies are refused."""
    ge = _experts("copies")
    opt = _optimizer("copies", ge)
    for w in (ge.w1, ge.w2, ge.w3):
        c = ge.copies[w]
        assert not c.compute_read and c.compute.shape == w.shape and c.compute.dtype == torch.bfloat16
        assert c.compute.untyped_storage().nbytes() == 2
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, D, generator=g).bfloat16()
    gy = torch.randn(40, D, generator=g).bfloat16()
    counts = torch.tensor([9, 0, 25, 4])
    for step in range(2):
        masters = [w.detach().clone().requires_grad_() for w in _masters(opt, ge)]
        xx, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        y = ge(xx, counts)
        y.backward(gy)
        y_ref = fp8_grouped_swiglu(xr, *masters, counts, wgrad_fp8=False)
        y_ref.backward(gy)
        assert torch.equal(y[:38], y_ref[:38]) and torch.equal(xx.grad[:38], xr.grad[:38])
        for w, m in zip((ge.w1, ge.w2, ge.w3), masters):
            assert w.grad is None and torch.equal(ge.copies[w].grad, m.grad.bfloat16())
        opt.step()
        opt.zero_grad()
        assert all(ge.copies[w].compute.untyped_storage().nbytes() == 2 for w in (ge.w1, ge.w2, ge.w3))
        assert_copies_equal(ge.fp8_copies, _fresh(*_masters(opt, ge)))
    with pytest.raises(ValueError, match="take ECHO's clones from them"):
        ge(x, counts, extend=lambda w, i, out=None: w)


def test_checkpoint_load_rewrites_the_copies_from_the_masters():
    ge = _experts("masters")
    opt = _optimizer("masters", ge)
    with torch.no_grad():
        for w in _masters(opt, ge):
            w.mul_(-3.0)  # what a load into the masters does
    refresh_compute_copies(ge, opt)
    assert_copies_equal(ge.fp8_copies, _fresh(*_masters(opt, ge)))


def test_only_fp8_layers_get_copies_with_echo_slots_after_them():
    from types import SimpleNamespace

    args = MoEArgs(num_experts=8, num_shared_experts=0, top_k=2, score_func="softmax", route_norm=False,
                   score_before_experts=False)
    bf16 = MoELayer(args, 32, 16, MoEEchoConfig())
    bf16.enable_fp8_copies()
    assert bf16.experts.fp8_copies is None
    fp8 = MoELayer(args, 32, 16, MoEEchoConfig(expert_precision="fp8"))
    fp8.enable_fp8_copies()
    c = fp8.experts.fp8_copies
    assert c is not None and fp8.experts.copies[fp8.experts.w2].fp8 == (c, 2)
    assert c.with_slots.plain2_EDH.data_ptr() == c.plain2_EDH.data_ptr() and c.with_slots.plain2_EDH.shape[0] == 8
    assert weight_copies(bf16) == {} and len(weight_copies(fp8)) == 3
    with pytest.raises(ValueError, match="expert_precision"):
        bf16.experts.enable_fp8_copies()
    echo = MoELayer(args, 32, 16, MoEEchoConfig(expert_precision="fp8"))
    echo.echo = SimpleNamespace(S=3)  # ECHO's slots per rank: three expert rows after the copies' eight
    echo.enable_fp8_copies()
    c = echo.experts.fp8_copies
    for name in ("plain13_E2HD", "plain2_EDH", "t13_ED2H", "t2_EHD"):
        home, full = getattr(c, name), getattr(c.with_slots, name)
        assert home.shape[0] == 8 and full.shape[0] == 11 and home.data_ptr() == full.data_ptr(), name
    assert c.scale_2E.shape == (2, 8) and c.with_slots.scale_2E.shape == (2, 11)
    gathered = MoELayer(args, 32, 16, MoEEchoConfig(expert_precision="fp8", gathered_experts=True))
    gathered.enable_fp8_copies()
    assert gathered.experts.fp8_copies is None


class _OneRankClones:
    """ECHO's transport on one rank (R = 1): slot s clones home expert ``slot_expert_G[s]`` (-1: unused)."""

    rank = 0

    def __init__(self, S):
        self.S, self.moved = S, []

    def all_gather(self, x, what="counts"):
        return x[None].clone()

    def clones(self, w_eX, slot_expert_G, index=0):
        self.moved.append((index, w_eX.dtype))
        used = (slot_expert_G >= 0).view(-1, *[1] * (w_eX.dim() - 1))
        return w_eX[slot_expert_G.clamp(min=0)] * used.to(w_eX.dtype)

    def add_clone_grads_(self, grad_eX, grad_SX, slot_expert_G, index=0):
        used = slot_expert_G >= 0
        grad_eX.index_add_(0, slot_expert_G[used], grad_SX[used].to(grad_eX.dtype))


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, hopper])])
@pytest.mark.parametrize("slot_expert", [[2, 0, -1], [3, 3, 3], [-1, -1, -1]])
def test_echo_clones_from_the_fp8_copies_equal_casting_the_extended_weights(slot_expert, dev):
    """ECHO with FP8 copies (the clones' FP8 bytes copied into the copies' slot rows, the weights only taking the
    gradients) against ECHO casting the extended weights per call: the same output, input gradient and weight
    gradients bit for bit (one expert cloned into every slot, an unused slot, no clone at all); only the FP8 bytes
    moved, the home rows untouched, an unused slot zero bytes at scale 1. On a GPU: the Triton kernels."""
    from components.moe_echo.echo import Echo, EchoClones
    from components.moe_echo.echo_transport import extend_with_clones
    from components.moe_echo.planner import EchoPlan

    S = len(slot_expert)
    slot_G = torch.tensor(slot_expert)
    counts = torch.tensor([5, 0, 7, 3] + [4, 2, 6][:S])
    counts[E:][slot_G < 0] = 0  # an unused slot gets no rows
    g = torch.Generator().manual_seed(3)
    x = torch.randn(int(counts.sum()) + 3, D, generator=g).bfloat16().to(dev)
    gy = torch.randn(x.shape[0], D, generator=g).to(dev)
    slot_G, counts = slot_G.to(dev), counts.to(dev)

    def run(copies):
        torch.manual_seed(0)
        ge = GroupedExperts(D, H, E, precision="fp8").to(dev)
        ge.init_weights(0.02)
        with torch.no_grad():
            ge.w2[3].mul_(40.0)  # one expert far from the others
        t = _OneRankClones(S)
        if copies:
            ge.enable_fp8_copies(slots=S)
            before = [_bytes(getattr(ge.fp8_copies, n)).clone() for n in ("plain13_E2HD", "t2_EHD")]
            none = torch.zeros(1, dtype=torch.int64, device=dev)
            extend = EchoClones(Echo(E, 1, 0, S, "fill", t), EchoPlan(slot_G, none, none, none))
        else:
            extend = lambda w, i, out=None: extend_with_clones(w, slot_G, t, i)  # noqa: E731
        xg = x.clone().requires_grad_()
        y = ge(xg, counts, extend)
        (y.float() * gy).sum().backward()
        if copies:
            c = ge.fp8_copies
            assert all(torch.equal(b, _bytes(getattr(c, n))) for b, n in zip(before, ("plain13_E2HD", "t2_EHD")))
            full = c.with_slots
            for s, home in enumerate(slot_expert):
                want = _bytes(full.plain13_E2HD[home]) if home >= 0 else torch.zeros_like(_bytes(full.plain13_E2HD[0]))
                assert torch.equal(_bytes(full.plain13_E2HD[E + s]), want)
                one = torch.ones(2, device=dev)
                assert torch.equal(full.scale_2E[:, E + s], full.scale_2E[:, home] if home >= 0 else one)
            for tr, plain in ((full.t13_ED2H, full.plain13_E2HD), (full.t2_EHD, full.plain2_EDH)):
                assert torch.equal(_bytes(tr[E:]), _bytes(plain[E:]).transpose(1, 2))  # the slots' transposed copies
            assert {dtype for _, dtype in t.moved} == {torch.uint8}  # FP8 bytes; the weights stay
        else:
            assert {dtype for _, dtype in t.moved} == {torch.float32}
        return y, xg.grad, [w.grad for w in (ge.w1, ge.w2, ge.w3)]

    y_cast, dx_cast, dw_cast = run(copies=False)
    y, dx, dw = run(copies=True)
    used = int(counts.sum())  # rows past the experts' are unspecified in y and dx
    assert torch.equal(y[:used], y_cast[:used]) and torch.equal(dx[:used], dx_cast[:used])
    for a, b in zip(dw, dw_cast):
        assert torch.equal(a, b)
    if slot_expert[0] >= 0:  # a cloned expert's gradient holds its clone's rows
        assert dw[0][slot_expert[0]].abs().sum() > 0


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("E, H, D", [(5, 72, 136), (4, 256, 512), (3, 64, 80)])
def test_optimizer_kernel_writes_the_reference_copies_and_finish_equals_a_fresh_cast(E, H, D):
    """The fused AdamW + FP8 kernel on [w1; w3] halves and w2 (ragged blocks, and 16-divisible shapes, where
    Triton's vectorised layouts differ): moments and masters as the reference, the plain FP8 copies exactly the
    cast of its new masters with the held scales, the amax exact; ``finish_`` (recast and transpose kernels)
    byte-equal to a fresh cast; a gated step changes nothing."""
    torch.manual_seed(0)
    dev = "cuda"
    ws = [torch.randn(E, *s, device=dev) * torch.logspace(-3, 0, E, device=dev)[:, None, None]
          for s in ((H, D), (D, H), (H, D))]
    ms = [torch.randn_like(w) * 1e-3 for w in ws]
    vs = [torch.rand_like(w) * 1e-5 for w in ws]
    g13 = torch.randn(E, 2 * H, D, device=dev).bfloat16()
    grads = [g13[:, :H], torch.randn(E, D, H, device=dev).bfloat16(), g13[:, H:]]
    p13 = torch.zeros(E, 2 * H, D, device=dev, dtype=torch.bfloat16)
    params = [p13[:, :H], torch.zeros(E, D, H, device=dev, dtype=torch.bfloat16), p13[:, H:]]
    copies, on_cpu = _fresh(*ws), _fresh(*[w.cpu() for w in ws])  # the Triton casts against the torch reference
    for name in ("plain13_E2HD", "plain2_EDH", "t13_ED2H", "t2_EHD", "scale_2E"):
        a, b = getattr(copies, name).cpu(), getattr(on_cpu, name)
        assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                           b.view(torch.uint8) if b.dtype.itemsize == 1 else b), name
    step, lr = torch.tensor(3.0, device=dev), torch.tensor(0.01, device=dev)
    refs = [[t.clone() for t in (w, m, v)] for w, m, v in zip(ws, ms, vs)]
    held = copies.scale_2E.clone()
    for i, role in enumerate((1, 2, 3)):  # w2 without a model copy (param None: the FP8 copies alone)
        adamw_master_(params[i] if i != 1 else None, grads[i], ws[i], ms[i], vs[i], lr, step, 0.9, 0.95, 1e-8, 0.1,
                      None, None, copies.copy(role))
        adamw_master_reference_(torch.empty_like(params[i]), grads[i], *refs[i], lr, step, 0.9, 0.95, 1e-8, 0.1)
        for a, b in zip((ws[i], ms[i], vs[i]), refs[i]):
            torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)
        assert torch.equal(params[i], ws[i].bfloat16()) if i != 1 else not params[i].any()
    expect = Fp8WeightCopies(E, H, D, dev)
    expect.scale_2E.copy_(held)
    for role, w in zip((1, 2, 3), ws):
        write_copy_reference_(w, expect.copy(role))
    for name in ("plain13_E2HD", "plain2_EDH"):
        assert torch.equal(_bytes(getattr(copies, name)), _bytes(getattr(expect, name))), name
    assert torch.equal(copies.amax_2E, expect.amax_2E)
    copies.finish_(dict(zip((1, 2, 3), ws)), {1, 2, 3}, torch.zeros((), device=dev))
    assert_copies_equal(copies, _fresh(*ws))
    assert (copies.scale_2E != held).any() and (copies.scale_2E == held).any()
    before = [t.clone() for t in (*ws, copies.plain13_E2HD.view(torch.uint8), copies.t13_ED2H.view(torch.uint8),
                                  copies.scale_2E)]
    skip = torch.ones((), device=dev)
    for i, role in enumerate((1, 2, 3)):
        adamw_master_(params[i], grads[i], ws[i], ms[i], vs[i], lr, step, 0.9, 0.95, 1e-8, 0.1, skip, None,
                      copies.copy(role))
    copies.finish_(dict(zip((1, 2, 3), ws)), {1, 2, 3}, skip)
    after = [*ws, copies.plain13_E2HD.view(torch.uint8), copies.t13_ED2H.view(torch.uint8), copies.scale_2E]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.gpu
@hopper
def test_graphed_fp8_training_step_with_copies_equals_eager_and_never_syncs():
    """Forward, backward and MasterAdamW (writing the FP8 copies) captured in one CUDA graph: each replay equals
    the same step run eagerly on a twin layer, outputs and copies byte for byte; no device-to-host read."""
    args = MoEArgs(num_experts=16, num_shared_experts=1, top_k=4, score_func="softmax", route_norm=False,
                   score_before_experts=False)

    def make():
        torch.manual_seed(0)
        layer = MoELayer(args, 512, 256, MoEEchoConfig(expert_precision="fp8")).cuda()
        layer.init_weights(0.02, torch.device("cuda"))
        layer.enable_fp8_copies()
        opt = MasterAdamW(layer.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1,
                          copies=weight_copies(layer))
        return layer, opt

    xs = [torch.randn(4, 1024, 512, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    gy = torch.randn_like(xs[0])
    x = xs[0].clone().requires_grad_()

    def step(layer, opt):
        def run():
            y = layer(x)
            y.backward(gy)
            opt.step()
            opt.zero_grad(set_to_none=False)
            return y.detach()
        return run

    eager, opt_e = make()
    graphed, opt_g = make()
    ys = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for xi in xs:
            x.data.copy_(xi)
            ys.append(step(eager, opt_e)().clone())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    x.data.copy_(xs[0])
    graph, y_g = warm_up_and_capture(step(graphed, opt_g))  # the warm-up is step 1; y_g: the replays' output
    for xi, y in zip(xs[1:], ys[1:]):
        x.data.copy_(xi)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y_g, y)
    assert_copies_equal(graphed.experts.fp8_copies, eager.experts.fp8_copies)
