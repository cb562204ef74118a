"""Experts outside FSDP with compute copies (GroupedExperts.enable_compute_copies + AdamWWithCopies): the
optimizer writes the bf16 weights the next forward reads and takes the bf16 gradients as they come, so
nothing is cast per step. Against the per-step cast path (same forward, same gradients after the divide) and
torch's AdamW on the equivalent fp32 gradients; clipping, the step gate and checkpoints included."""

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp

from components.moe_echo.experts import GroupedExperts
from components.moe_echo.weight_copies import WeightCopies, WeightCopy, weight_copies
from components.parallel.grad_norm import clip_grad_norm_
from components.train.master_adamw import AdamWWithCopies, refresh_compute_copies
from components.train.train_state import ModelAndOptimizer

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
COUNTS = torch.tensor([5, 0, 9, 2])  # an expert with no rows
DIVIDE = 3.0


class Block(torch.nn.Module):
    """A dense layer FSDP would manage (plain ``.grad``) and experts outside it."""

    def __init__(self, copies: bool, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.dense = torch.nn.Linear(16, 16)
        self.experts = GroupedExperts(16, 12, len(COUNTS))
        self.experts.init_weights(0.02)
        self.experts.compute_dtype = torch.bfloat16
        self.experts.set_gradient_divide_factor(DIVIDE)
        if copies:
            self.experts.enable_compute_copies()

    def forward(self, x):
        return self.experts(self.dense(x).bfloat16(), COUNTS).float()


def _loss(block, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(int(COUNTS.sum()) + 3, 16, generator=g)  # 3 rows of padding
    y = block(x)[: int(COUNTS.sum())]
    return (y * torch.randn(y.shape, generator=g)).sum()


def _experts(block):
    return (block.experts.w1, block.experts.w2, block.experts.w3)


def _adamw(block):
    """AdamWWithCopies over ``block``'s parameters, handed its weight copies (as build_optimizer does)."""
    return AdamWWithCopies(block.parameters(), fused=True, copies=weight_copies(block), **HP)


def test_copies_compute_like_the_cast_and_their_gradients_arrive_undivided():
    cast, copies = Block(copies=False), Block(copies=True)
    out_cast, out_copies = _loss(cast, 1), _loss(copies, 1)
    assert torch.equal(out_cast, out_copies)  # the copy is bf16(w), as the cast was
    out_cast.backward()
    out_copies.backward()
    cp = copies.experts.copies
    assert not any(hasattr(w, name) for w in _experts(copies) for name in ("compute_copy", "compute_grad", "fp8_copy"))
    for a, b in zip(_experts(cast), _experts(copies)):
        assert b.grad is None and cp[b].grad.dtype == torch.bfloat16 and cp[b].grad.abs().sum() > 0
        assert torch.equal(a.grad, cp[b].grad.float() * (1 / DIVIDE))  # the cast path's one-pass divide
    assert torch.equal(cast.dense.weight.grad, copies.dense.weight.grad)
    # the QuACK layout ([w1; w3] concatenated) sends each half's gradient to its weight
    w13, w2 = copies.experts.local_weights_13()
    (w13.float().sum() + 2 * w2.float().sum()).backward()
    assert torch.equal(cp[copies.experts.w1].grad.float(), torch.ones_like(copies.experts.w1))
    assert torch.equal(cp[copies.experts.w2].grad.float(), torch.full_like(copies.experts.w2, 2.0))


def test_optimizer_tracks_adamw_on_the_divided_fp32_gradients_and_writes_the_copies():
    ref, ours = Block(copies=False), Block(copies=True)
    opt_ref = torch.optim.AdamW(ref.parameters(), fused=True, **HP)
    opt = _adamw(ours)
    for step in range(5):
        for block, o in ((ref, opt_ref), (ours, opt)):
            _loss(block, step).backward()
            o.step()
            o.zero_grad(set_to_none=True)
        assert all(ours.experts.copies[w].grad is None for w in _experts(ours))
    for a, b in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=2e-5, atol=1e-7)
    for w in _experts(ours):
        assert torch.equal(ours.experts.copies[w].compute, w.detach().bfloat16())  # what the next forward reads
        state = opt.state[w]
        assert float(state["step"]) == 5 and state["exp_avg"].dtype == torch.float32
        assert state["exp_avg"].shape == w.shape


def test_found_inf_keeps_everything_and_grad_scale_divides():
    block = Block(copies=True)
    opt = _adamw(block)
    _loss(block, 0).backward()
    opt.step()
    opt.zero_grad()
    w, cw = block.experts.w2, block.experts.copies[block.experts.w2]
    before = (w.detach().clone(), cw.compute.clone(), opt.state[w]["exp_avg"].clone(), opt.state[w]["step"].clone())
    opt.found_inf = torch.ones(())
    _loss(block, 1).backward()
    opt.step()
    after = (w.detach(), cw.compute, opt.state[w]["exp_avg"], opt.state[w]["step"])
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    opt.zero_grad()
    # grad_scale = 4 (clipping): the update of gradients divided by 4
    twin = Block(copies=True, seed=5)
    opt_twin = _adamw(twin)
    twin.load_state_dict(block.state_dict())
    refresh_compute_copies(twin)  # nn.Module.load_state_dict leaves the copies alone
    opt_twin.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch would share the step tensors
    opt.found_inf, opt.grad_scale = torch.zeros(()), torch.tensor(4.0)
    _loss(block, 2).backward()
    _loss(twin, 2).backward()
    for p in twin.parameters():
        if p.grad is not None:
            p.grad /= 4
    for p in _experts(twin):
        twin.experts.copies[p].grad = twin.experts.copies[p].grad / 4  # exact: a power of two
    opt.step()
    opt_twin.step()
    for a, b in zip(block.parameters(), twin.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-7)


def test_clipping_counts_compute_gradients_divided():
    cast, copies = Block(copies=False), Block(copies=True)
    _loss(cast, 3).backward()
    _loss(copies, 3).backward()
    ref = clip_grad_norm_(list(cast.parameters()), 0.0)

    class Opt:
        grad_scale = None

    opt = Opt()
    got = clip_grad_norm_(list(copies.parameters()), 1e-3, opt, copies=weight_copies(copies))
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
    assert float(opt.grad_scale) > 1  # clipped: the factor goes to the optimizer
    # no optimizer: gradients scaled in place
    coef = clip_grad_norm_(list(copies.parameters()), 1e-3, copies=weight_copies(copies))
    g1 = copies.experts.copies[copies.experts.w1].grad
    assert float(coef) == float(got) and g1.abs().max() < cast.experts.w1.grad.abs().max()
    # without the copies the compute gradients are not seen: only the dense layer counts
    dense = clip_grad_norm_([copies.dense.weight, copies.dense.bias], 0.0)
    assert float(clip_grad_norm_(list(copies.parameters()), 0.0)) == float(dense)


def test_checkpoints_load_weights_moments_and_rewrite_the_copies(tmp_path):
    block = Block(copies=True)
    opt = _adamw(block)
    for step in range(3):
        _loss(block, step).backward()
        opt.step()
        opt.zero_grad()
    dcp.save({"app": ModelAndOptimizer(block, opt)}, checkpoint_id=str(tmp_path / "ck"))
    again = Block(copies=True, seed=1)
    opt2 = _adamw(again)
    dcp.load({"app": ModelAndOptimizer(again, opt2)}, checkpoint_id=str(tmp_path / "ck"))
    for a, b in zip(_experts(block), _experts(again)):
        assert torch.equal(a.detach(), b.detach())
        assert torch.equal(again.experts.copies[b].compute, b.detach().bfloat16())
        assert torch.equal(opt.state[a]["exp_avg_sq"], opt2.state[b]["exp_avg_sq"])
        assert float(opt2.state[b]["step"]) == 3
    # and into a run without copies (the per-step cast path, torch's AdamW): same weights and moments
    plain = Block(copies=False, seed=2)
    opt3 = torch.optim.AdamW(plain.parameters(), fused=True, **HP)
    dcp.load({"app": ModelAndOptimizer(plain, opt3)}, checkpoint_id=str(tmp_path / "ck"))
    for a, b in zip(_experts(block), _experts(plain)):
        assert torch.equal(a.detach(), b.detach()) and torch.equal(opt.state[a]["exp_avg"], opt3.state[b]["exp_avg"])


def test_quack_layout_keeps_w1_and_w3_copies_as_halves_of_one_buffer():
    """QuACK's gate/up GEMM reads [w1; w3]: with compute copies it is one persistent buffer whose halves are
    w1's and w3's copies (no per-step concatenation); its gradient's halves reach w1 and w3, and the
    optimizer writes each copy back into its half."""
    torch.manual_seed(0)
    ge = GroupedExperts(16, 12, 4, gemm="quack")
    ge.init_weights(0.02)
    ge.compute_dtype = torch.bfloat16
    ge.set_gradient_divide_factor(2.0)
    ge.enable_compute_copies()
    opt = AdamWWithCopies(ge.parameters(), fused=True, copies=ge.copies, **HP)
    cp = ge.copies
    for step in range(2):
        w13, w2 = ge.local_weights_13()
        assert w13.data_ptr() == ge._copy13.data_ptr()  # the buffer itself, not a concatenation
        assert torch.equal(w13, torch.cat([ge.w1.detach(), ge.w3.detach()], 1).bfloat16())
        g13 = torch.randn(w13.shape).bfloat16()
        (w13.float() * g13.float()).sum().backward(retain_graph=False)
        (w2.float().sum()).backward()
        assert torch.equal(cp[ge.w1].grad, g13[:, :12]) and torch.equal(cp[ge.w3].grad, g13[:, 12:])
        assert not cp[ge.w1].grad.is_contiguous()  # a half, read in place by the optimizer
        opt.step()
        opt.zero_grad()
    assert torch.equal(ge._copy13, torch.cat([ge.w1.detach(), ge.w3.detach()], 1).bfloat16())
    assert torch.equal(cp[ge.w2].compute, ge.w2.detach().bfloat16())


def test_a_weight_with_both_a_grad_and_a_compute_gradient_stops_the_step():
    """torch's AdamW would apply the .grad as well (a second step, which once came from a zero .grad that
    torch 2.11's DTensor.to_local backward wrote): the step refuses, and no weight moves."""
    torch.manual_seed(0)
    ge = GroupedExperts(16, 12, 4)
    ge.init_weights(0.02)
    ge.compute_dtype = torch.bfloat16
    ge.enable_compute_copies()
    opt = AdamWWithCopies(ge.parameters(), fused=True, copies=ge.copies, **HP)
    w1, w2, w3 = ge.local_weights()
    (w1.float().sum() + w2.float().sum() + w3.float().sum()).backward()
    assert all(w.grad is None and ge.copies[w].grad is not None for w in (ge.w1, ge.w2, ge.w3))
    ge.w2.grad = torch.zeros_like(ge.w2)
    before = ge.w2.detach().clone()
    with pytest.raises(RuntimeError, match="also has a .grad"):
        opt.step()
    assert torch.equal(ge.w2.detach(), before)


def test_one_gpu_bf16_weights_live_as_halves_of_one_w13_for_quack():
    """Plain bf16 parameters with fp32 masters (one GPU): QuACK's [w1; w3] is one tensor whose halves are
    w1's and w3's data (moved there once, no per-step concatenation); the gradient halves reach w1.grad and
    w3.grad, and MasterAdamW's update through them equals its update from contiguous gradients."""
    from components.train.master_adamw import MasterAdamW

    def make():
        torch.manual_seed(0)
        ge = GroupedExperts(16, 12, 4, gemm="quack")
        ge.init_weights(0.02)
        return ge, MasterAdamW(ge.parameters(), **HP)

    (ge, opt), (ref, opt_ref) = make(), make()
    for step in range(3):
        w13, w2 = ge.local_weights_13()
        assert w13.data_ptr() == ge.w1.data_ptr() and not ge.w1.is_contiguous()  # w1 is w13's first half
        assert torch.equal(w13, torch.cat([ref.w1, ref.w3], 1).detach())
        g = torch.Generator().manual_seed(step)
        g13 = torch.randn(w13.shape, generator=g).bfloat16()
        (w13.float() * g13.float()).sum().backward()
        assert torch.equal(ge.w1.grad, g13[:, :12]) and torch.equal(ge.w3.grad, g13[:, 12:])
        ge.w2.grad = torch.zeros_like(ge.w2)
        for p, gr in zip((ref.w1, ref.w2, ref.w3), (g13[:, :12].contiguous(), torch.zeros_like(ref.w2),
                                                   g13[:, 12:].contiguous())):
            p.grad = gr
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    for a, b in zip((ge.w1, ge.w2, ge.w3), (ref.w1, ref.w2, ref.w3)):
        assert torch.equal(a.detach(), b.detach()) and torch.equal(opt.masters[a], opt_ref.masters[b])
    assert ge._w13.data_ptr() == ge.w1.data_ptr()  # still the same buffer
    ge.float()  # a dtype change replaces the data: fp32 weights fall back to the concatenation
    assert ge._shared_13() is None and ge.local_weights_13()[0].dtype == torch.bfloat16


def test_norm_of_gradient_halves_reads_their_whole_buffer():
    """The [w1; w3] gradient's halves (QuACK's layout) enter the norm as their contiguous base (foreach's fused
    path), only where they tile it exactly; the norm equals the norm of separate copies either way."""
    from components.parallel.grad_norm import _whole

    g13 = torch.randn(3, 10, 4).bfloat16()
    h1, h3 = g13[:, :6], g13[:, 6:]
    assert [t is g13 for t in _whole([h3, h1])] == [True]
    other = torch.randn(5)
    out = _whole([other, h1])  # one half alone, or halves of different widths that leave a gap: kept as they are
    assert out[0] is other and out[1] is h1
    assert _whole([g13[:, :3], g13[:, 6:]])[0]._base is g13 and len(_whole([g13[:, :3], g13[:, 6:]])) == 2
    assert len(_whole([g13[:, :6], g13[:, 5:]])) == 2  # overlapping: kept
    ext = torch.randn(5, 10, 4).bfloat16()  # ECHO: the home rows [:3] of the [e + S] extended gradient
    rows = _whole([ext[:3, 6:], ext[:3, :6]])
    assert len(rows) == 1 and rows[0].is_contiguous() and torch.equal(rows[0], ext[:3])
    assert rows[0].data_ptr() == ext.data_ptr()  # no copy
    assert torch.equal(_whole([ext[1:4, :6], ext[1:4, 6:]])[0], ext[1:4])
    assert len(_whole([ext[:3, :6], ext[1:4, 6:]])) == 2  # halves of different rows: kept
    assert len(_whole([ext[3:, :6], ext[3:, 6:10]])) == 1 and len(_whole([ext[:3, :6], ext[:3, 7:]])) == 2

    def norm(*grads):
        params = [torch.nn.Parameter(torch.zeros(g.shape)) for g in grads]
        copies = WeightCopies({p: WeightCopy(grad=g, grad_divide=2.0) for p, g in zip(params, grads)})
        return clip_grad_norm_(params, 0.0, copies=copies)

    got = norm(h1, h3)
    ref = norm(h1.contiguous(), h3.contiguous())
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(got, g13.float().norm() / 2, rtol=1e-6, atol=0)
    got = norm(ext[:3, :6], ext[:3, 6:])  # ECHO's home rows: the norm of those rows only, not of the slot rows
    torch.testing.assert_close(got, ext[:3].float().norm() / 2, rtol=1e-6, atol=0)
    torch.testing.assert_close(got, norm(ext[:3, :6].contiguous(), ext[:3, 6:].contiguous()), rtol=1e-6, atol=0)


def test_echo_clones_land_in_the_copies_spare_rows_without_copying_the_home_experts():
    """Copies with ECHO's slot rows after them (``enable_compute_copies(spare_rows=S)``): the extended weights
    are those buffers (clones written into their last rows), the output and the compute gradients (clones'
    gradients added to their home experts) equal the concatenating path's, and the optimizer still writes the
    home rows; a buffer that does not hold the weight as its first rows is refused."""
    from types import SimpleNamespace

    from components.moe_echo.echo_transport import extend_with_clones

    S, clones = 2, [2, 0]  # slot s clones home expert clones[s]
    counts = torch.cat([COUNTS, torch.tensor([4, 3])])
    x = torch.randn(int(counts.sum()) + 3, 16, generator=torch.Generator().manual_seed(1)).bfloat16()
    gy = torch.randn(x.shape[0], 16, generator=torch.Generator().manual_seed(2))

    class Clones:  # a transport on one rank: slot s holds a copy of home expert clones[s]
        def __init__(self):
            self.S, self.seen = S, []

        def clones(self, w, slot_expert_G, index):
            self.seen.append(index)
            return w[clones].detach().clone()

        def add_clone_grads_(self, grad_eX, grad_SX, slot_expert_G, index):
            grad_eX.index_add_(0, torch.tensor(clones), grad_SX.to(grad_eX.dtype))

    def run(spare):
        torch.manual_seed(0)
        ge = GroupedExperts(16, 12, len(COUNTS))
        ge.init_weights(0.02)
        ge.compute_dtype = torch.bfloat16
        ge.set_gradient_divide_factor(DIVIDE)
        ge.enable_compute_copies(spare_rows=spare)
        t, ptrs = Clones(), []

        def extend(w, i, out=None):
            ext = extend_with_clones(w, None, t, i, out if spare else None)
            ptrs.append(ext.data_ptr() == w.data_ptr())
            return ext

        y = ge(x, counts, extend)
        (y.float() * gy).sum().backward()
        return ge, y, ptrs

    cat, y_cat, ptrs_cat = run(0)
    spare, y_spare, ptrs_spare = run(S)
    assert ptrs_cat == [False, False] and ptrs_spare == [True, True]  # [w1; w3] and w2: in place, no copy
    assert torch.equal(y_cat, y_spare)
    for a, b in zip((cat.w1, cat.w2, cat.w3), (spare.w1, spare.w2, spare.w3)):
        assert torch.equal(cat.copies[a].grad, spare.copies[b].grad)
    g1 = spare.copies[spare.w1].grad
    assert g1[2].abs().sum() > 0 and g1[1].abs().sum() == 0
    from components.parallel.grad_norm import _whole
    halves = [spare.copies[spare.w1].grad, spare.copies[spare.w3].grad]
    assert not any(h.is_contiguous() for h in halves)
    whole = _whole(halves)  # the norm reads the halves as the extended gradient's home rows, one dense tensor
    assert len(whole) == 1 and whole[0].is_contiguous() and whole[0].shape[0] == len(COUNTS)
    # the optimizer writes the home rows of the buffers; the slot rows are the clones' until the next forward
    opt = AdamWWithCopies([spare.w1, spare.w2, spare.w3], copies=spare.copies, **HP)
    opt.step()
    for w in (spare.w1, spare.w2, spare.w3):
        assert torch.equal(spare.copies[w].compute, w.detach().bfloat16())
    assert spare._full13.shape[0] == len(COUNTS) + S and spare._full13[:len(COUNTS)].data_ptr() == \
        spare.copies[spare.w1].compute.data_ptr()
    w = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="must hold w_eX"):
        extend_with_clones(w, None, SimpleNamespace(S=S), 0, torch.zeros(4 + S, 3))


def test_the_optimizer_refuses_to_be_built_without_the_copies():
    """Without ``copies`` the experts' weights (gradients in their copies, never in .grad) would silently stay put."""
    ge = GroupedExperts(16, 12, 4)
    with pytest.raises(TypeError, match="copies"):
        AdamWWithCopies(ge.parameters(), fused=True, **HP)


def test_nan_fault_reaches_the_weight_and_the_copy_the_forward_reads(monkeypatch):
    """The non-finite-weights fault (components/train/faults.py) on experts whose w1 copy is a strided half of
    [w1; w3]: both the weight and that copy get their NaN, and nothing else changes."""
    import types

    from components.train.faults import inject

    ge = GroupedExperts(16, 12, 4)
    ge.init_weights(0.02)
    ge.compute_dtype = torch.bfloat16
    ge.enable_compute_copies()
    c1 = ge.copies[ge.w1].compute
    assert not c1.is_contiguous()
    monkeypatch.setenv("MOE_ECHO_FAULT_NAN_AT_STEP", "3")
    inject(2, None, [("layers.1.moe", types.SimpleNamespace(experts=ge))], 0, 1)
    assert torch.isfinite(ge.w1).all() and torch.isfinite(c1).all()
    inject(3, None, [("layers.1.moe", types.SimpleNamespace(experts=ge))], 0, 1)
    assert torch.isnan(ge.w1).sum() == 1 and torch.isnan(c1).sum() == 1
    assert torch.isfinite(ge.copies[ge.w3].compute).all()
