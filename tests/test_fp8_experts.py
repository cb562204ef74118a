"""FP8 experts: the quantisers and weight casts against their definitions, the FP8 SwiGLU experts
against the fp64 experts (CPU: GEMMs emulated), and on a Hopper GPU the Triton kernels and scaled
grouped GEMMs against the CPU path, the bf16 layer, a CUDA graph and the sync-free rule."""

import pytest
import torch
from torchtitan.models.moe import MoEArgs

from components.errors import UserError
from components.moe_echo.config import MoEEchoConfig
from components.moe_echo.experts import _looped_swiglu
from components.moe_echo.fp8_experts import check_fp8_supported, fp8_grouped_swiglu
from components.moe_echo.layer import MoELayer
from kernels import fp8
from kernels.fp8 import FP8, FP8_MAX, pow2_scale, quant_rows_torch
from cuda_graphs import warm_up_and_capture
from conftest import hopper

# adversarial and random row counts per expert (N rows in all; N > sum leaves fixed-capacity padding)
COUNTS = {
    "random": [5, 0, 17, 9, 33, 1],
    "all_to_one": [0, 0, 64, 0, 0, 0],
    "empty_experts": [0, 31, 0, 0, 0, 16],
    "one_hot_per_rank": [40, 2, 3, 37, 1, 4],
    "one_expert": [37],  # a dense feed-forward (fp8_dense_swiglu): cuBLAS's GEMMs on CUDA
}


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def test_pow2_scale_is_the_smallest_power_of_two_that_fits():
    amax = torch.tensor([0.0, 1e-6, 0.3, 447.9, 448.0, 448.1, 896.0, 3e4])
    s = pow2_scale(amax)
    assert s[0] == 1
    m, _ = torch.frexp(s)
    assert (m == 0.5).all()  # powers of two
    nz = amax > 0
    assert (amax[nz] / s[nz] <= FP8_MAX).all() and (amax[nz] / (s[nz] / 2) > FP8_MAX).all()


def _within_e4m3(deq, ref, s):
    """e4m3: 3 mantissa bits (relative half-step 2^-4) above 2^-6·s, absolute step 2^-9·s below."""
    return bool(((deq - ref).abs() <= ref.abs() * 2**-4 + s * 2**-10).all())


@pytest.mark.parametrize("scale", [1e-4, 1.0, 1e3])
def test_quant_rows_error_bound(scale):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 80, generator=g) * scale * torch.rand(37, 1, generator=g)).to(torch.bfloat16)
    x[3] = 0  # an all-zero row
    q, s = quant_rows_torch(x)
    assert q.dtype == FP8 and q.shape == (37, 80) and s.shape == (37,)
    assert _within_e4m3(q.double() * s.double()[:, None], x.double(), s.double()[:, None])
    assert s[3] == 1 and (q[3].float() == 0).all()
    assert (x.double().abs().amax(1) / s.double() <= FP8_MAX).all()


def test_expert_scales_and_weight_casts_in_both_layouts():
    """One scale per expert over w1 and w3 together; the plain copy stacked [w1; w3] and the transposed
    copy [w1ᵀ | w3ᵀ] hold the same quantised values, each within e4m3's error of the weights."""
    g = torch.Generator().manual_seed(1)
    E, H, D = 3, 24, 40
    w1, w3 = torch.randn(E, H, D, generator=g), torch.randn(E, H, D, generator=g) * 0.01
    w3[1] *= 1e5  # expert 1's w3 is large: its shared scale follows it, other experts' do not
    plain, hint = torch.zeros(E, 2 * H, D, dtype=FP8), torch.zeros(E)
    s = fp8.cast_experts_scaled((w1, w3), plain, hint)
    assert torch.equal(s, pow2_scale(torch.maximum(w1.abs().amax((1, 2)), w3.abs().amax((1, 2)))))
    assert torch.equal(hint, s) and s[1] > 100 * s[0]
    tr = torch.zeros(E, D, 2 * H, dtype=FP8)
    fp8.cast_experts_t(w1, s, tr, 0)
    fp8.cast_experts_t(w3, s, tr, H)
    assert torch.equal(plain.transpose(1, 2).view(torch.uint8), tr.view(torch.uint8))
    ref = torch.cat([w1, w3], 1).double()
    assert _within_e4m3(plain.double() * s.double()[:, None, None], ref, s.double()[:, None, None])


def test_swiglu_quant_matches_fp64_and_shares_one_scale_over_da_db():
    g = torch.Generator().manual_seed(2)
    M, H = 19, 32
    ab = (torch.randn(M, 2 * H, generator=g) * 3).to(torch.bfloat16)
    ab[4] = 0  # a zero row: scale 1, zero output
    a, b = ab.double().chunk(2, 1)
    h64 = a * torch.sigmoid(a) * b
    h, q, s = fp8.swiglu_quant_torch(ab)
    assert _rel(h, h64) < 4e-3 and h.dtype == torch.bfloat16
    assert _within_e4m3(q.double() * s.double()[:, None], h64, s.double()[:, None]) and s[4] == 1
    dh = torch.randn(M, H, generator=g).to(torch.bfloat16)
    sig = torch.sigmoid(a)
    da64, db64 = dh.double() * b * sig * (1 + a * (1 - sig)), dh.double() * a * sig
    da, db, q2, s2 = fp8.swiglu_quant_bwd_torch(dh, ab)
    assert _rel(da, da64) < 4e-3 and _rel(db, db64) < 4e-3
    both = torch.cat([da64, db64], 1)
    amax = both.abs().amax(1)
    assert q2.shape == (M, 2 * H) and (amax / s2 <= FP8_MAX * (1 + 1e-6)).all()  # one scale fits both halves
    assert (amax[amax > 0] / (s2[amax > 0] / 2) > FP8_MAX * (1 - 1e-6)).all()  # and is the smallest that does
    assert _within_e4m3(q2.double() * s2.double()[:, None], both, s2.double()[:, None])
    none_h, q_, s_ = fp8.swiglu_quant(ab, bf16=False)  # the FP8 rows alone: the same rows, no bf16 copy
    none_a, none_b, q2_, s2_ = fp8.swiglu_quant_bwd(dh, ab, bf16=False)
    assert none_h is none_a is none_b is None
    assert all(torch.equal(x.view(torch.uint8) if x.dtype == FP8 else x, y.view(torch.uint8) if y.dtype == FP8 else y)
               for x, y in ((q_, q), (s_, s), (q2_, q2), (s2_, s2)))


def _experts_case(counts, D=48, H=32, extra=5, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    E = len(counts)
    N = sum(counts) + extra
    x = torch.randn(N, D, generator=g).to(torch.bfloat16)
    ws = [torch.randn(*shape, generator=g) * 0.1 for shape in ((E, H, D), (E, D, H), (E, H, D))]
    gy = torch.randn(N, D, generator=g).to(torch.bfloat16)
    return (x.to(device), [w.to(device) for w in ws], torch.tensor(counts, device=device), gy.to(device))


def _run(fn, x, ws, counts, gy):
    x = x.clone().requires_grad_()
    ws = [w.clone().requires_grad_() for w in ws]
    y = fn(x, *ws, counts)
    y.backward(gy)
    return y.detach(), x.grad, [w.grad for w in ws]


@pytest.mark.parametrize("case", sorted(COUNTS))
def test_fp8_experts_track_fp64_experts(case):
    """Output and every gradient within 12% (norm) of the fp64 experts (padding rows are not read)."""
    x, ws, counts, gy = _experts_case(COUNTS[case])
    y, dx, dws = _run(fp8_grouped_swiglu, x, ws, counts, gy)
    y64, dx64, dws64 = _run(_looped_swiglu, x.double(), [w.double() for w in ws], counts, gy.double())
    used = int(counts.sum())
    assert _rel(y[:used], y64[:used]) < 0.12 and _rel(dx[:used], dx64[:used]) < 0.12
    for e in range(len(counts)):
        if counts[e]:
            for d, d64 in zip(dws, dws64):
                assert _rel(d[e], d64[e]) < 0.12
        else:  # an expert without rows gets exactly zero gradient
            assert all((d[e] == 0).all() for d in dws)
    assert dws[0].dtype == ws[0].dtype  # gradients in the weights' dtype (fp32 masters)


@pytest.mark.parametrize("case", sorted(COUNTS))
def test_fp8_weight_gradients_track_fp64_and_leave_the_rest_as_it_was(case):
    """``wgrad_fp8``: the weight gradients from the FP8 weight-gradient GEMMs within 12% (norm) of fp64's, an expert
    without rows exactly zero; the output and the input gradient bit for bit those of the bf16 weight gradients'
    run (only the weight-gradient GEMMs change); padding rows past the experts' not read."""
    x, ws, counts, gy = _experts_case(COUNTS[case])
    used = int(counts.sum())
    y8, dx8, dws8 = _run(lambda *a: fp8_grouped_swiglu(*a, wgrad_fp8=True), x, ws, counts, gy)
    y, dx, dws = _run(fp8_grouped_swiglu, x, ws, counts, gy)
    _, _, dws64 = _run(_looped_swiglu, x.double(), [w.double() for w in ws], counts, gy.double())
    assert torch.equal(y8, y) and torch.equal(dx8, dx)
    for e in range(len(counts)):
        for d8, d, d64 in zip(dws8, dws, dws64):
            if counts[e]:
                assert _rel(d8[e], d64[e]) < 0.12 and not torch.equal(d8[e], d[e])  # FP8: not the bf16 GEMMs' sums
            else:
                assert (d8[e] == 0).all()
    x2 = x.clone()
    x2[used:] = 1e4  # padding rows (unspecified in the step's fixed-capacity buffers)
    assert all(torch.equal(a, b) for a, b in zip(_run(lambda *a: fp8_grouped_swiglu(*a, wgrad_fp8=True), x2, ws,
                                                      counts, gy)[2], dws8))


def test_fp8_needs_a_hopper_gpu_one_line_error():
    with pytest.raises(UserError) as e:
        check_fp8_supported(torch.device("cpu"))
    msg = str(e.value)
    assert "\n" not in msg and 'expert_precision = "bf16"' in msg


def test_fp8_layer_config_reaches_the_experts():
    args = MoEArgs(num_experts=8, num_shared_experts=0, top_k=2, score_func="softmax", route_norm=False,
                   score_before_experts=False)
    layer = MoELayer(args, 32, 16, MoEEchoConfig(expert_precision="fp8"))
    assert layer.experts.precision == "fp8" and layer.experts.wgrad_precision == "fp8"  # "auto": the experts'
    layer = MoELayer(args, 32, 16, MoEEchoConfig(expert_precision="fp8", expert_wgrad_precision="bf16"))
    assert layer.experts.wgrad_precision == "bf16"
    assert MoELayer(args, 32, 16, MoEEchoConfig()).experts.wgrad_precision == "bf16"


# --- GPU: the Triton kernels and torch._scaled_grouped_mm ----------------------------------------


@pytest.mark.gpu
@hopper
def test_recasts_walking_several_blocks_a_program_equal_torch_reference():
    """More blocks an expert than recast programs (``fp8._programs``: ~2048 in all), so each program walks several:
    the experts' cast whatever the scale guess, and the optimizer copies' recast of the experts whose scale moved,
    byte-equal to the torch reference."""
    E, H, D = 64, 256, 640  # 40 blocks of 4096 elements an expert, 32 programs an expert
    assert fp8._programs(H * D // 4096, E) < H * D // 4096
    g = torch.Generator().manual_seed(5)
    w1, w3 = (torch.randn(E, H, D, generator=g) * torch.logspace(-3, 1, E)[:, None, None] for _ in range(2))
    s13 = fp8.expert_scales_torch(w1, w3)
    ref = torch.zeros(E, 2 * H, D, dtype=FP8)
    fp8.cast_experts_torch(w1, s13, ref, 0)
    fp8.cast_experts_torch(w3, s13, ref, H)
    held = s13.clone()
    held[::3] *= 2  # every third expert's scale moved since the copy was written
    for guess in (torch.zeros(E), held):
        hint, out = guess.cuda(), torch.zeros(E, 2 * H, D, dtype=FP8, device="cuda")
        s = fp8.cast_experts_scaled((w1.cuda(), w3.cuda()), out, hint)
        assert torch.equal(s.cpu(), s13) and torch.equal(out.cpu().view(torch.uint8), ref.view(torch.uint8))
    plain = torch.zeros(E, 2 * H, D, dtype=FP8)
    fp8.cast_experts_torch(w1, held, plain, 0)
    fp8.cast_experts_torch(w3, held, plain, H)
    copy = fp8.Fp8Copy(plain.cuda(), 0, held.cuda(), torch.zeros(E, device="cuda"))
    for w, row0 in ((w1, 0), (w3, H)):
        fp8.recast_moved_(w.cuda(), copy._replace(row0=row0), s13.cuda())
    assert torch.equal(copy.plain_EPI.cpu().view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.gpu
@hopper
def test_triton_quantisers_equal_torch_reference():
    """quant_rows and both weight casts (the plain one whatever the scale guess) bit-exact against the
    torch reference; the fused
    SwiGLU quantisers within bf16 rounding (sigmoid differs in the last bits); rows at or past n_valid
    are skipped."""
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(300, 1408, generator=g) * torch.logspace(-3, 3, 300)[:, None]).to(torch.bfloat16)
    x[7] = 0
    for xx in (x, x.double()):  # fp64 too: the kernels, not a host-reading path
        q, s = fp8.quant_rows(xx.cuda())
        qr, sr = quant_rows_torch(xx)
        assert torch.equal(s.cpu(), sr) and torch.equal(q.cpu().view(torch.uint8), qr.view(torch.uint8))
    n_valid = torch.tensor([250], dtype=torch.int32, device="cuda")
    q, s = fp8.quant_rows(x.cuda(), n_valid)
    assert torch.equal(s[:250].cpu(), quant_rows_torch(x)[1][:250])
    E, H, D = 5, 192, 320
    w1, w3 = torch.randn(E, H, D, generator=g), torch.randn(E, H, D, generator=g) * 3
    s13 = fp8.expert_scales_torch(w1, w3)
    ref = torch.zeros(E, 2 * H, D, dtype=FP8)
    fp8.cast_experts_torch(w1, s13, ref, 0)
    fp8.cast_experts_torch(w3, s13, ref, H)
    wrong = s13.clone()
    wrong[1], wrong[3] = s13[1] * 2, s13[3] / 4  # the guess too large for one expert, too small for another
    for guess in (torch.zeros(E), s13, wrong, torch.full((E,), float("nan"))):  # none, right, partly wrong, NaN
        hint, out = guess.cuda(), torch.zeros(E, 2 * H, D, dtype=FP8, device="cuda")
        s = fp8.cast_experts_scaled((w1.cuda(), w3.cuda()), out, hint)
        assert torch.equal(s.cpu(), s13) and torch.equal(hint.cpu(), s13)
        assert torch.equal(out.cpu().view(torch.uint8), ref.view(torch.uint8))
    out, ref = torch.zeros(E, D, 2 * H, dtype=FP8, device="cuda"), torch.zeros(E, D, 2 * H, dtype=FP8)
    for w, at in ((w1, 0), (w3, H)):
        fp8.cast_experts_t(w.cuda(), s13.cuda(), out, at)
        fp8.cast_experts_t(w, s13, ref, at)
    assert torch.equal(out.cpu().view(torch.uint8), ref.view(torch.uint8))
    ab = (torch.randn(300, 2 * H, generator=g) * 4).to(torch.bfloat16)
    h, q, s = fp8.swiglu_quant(ab.cuda())
    hr, qr, sr = fp8.swiglu_quant_torch(ab)
    assert _rel(h.cpu(), hr) < 1e-2 and (s.cpu() == sr).float().mean() > 0.99
    assert _rel(q.cpu().float() * s.cpu()[:, None], qr.float() * sr[:, None]) < 0.05
    dh = torch.randn(300, H, generator=g).to(torch.bfloat16)
    da, db, q, s = fp8.swiglu_quant_bwd(dh.cuda(), ab.cuda(), n_valid)
    dar, dbr, qr, sr = fp8.swiglu_quant_bwd_torch(dh, ab)
    assert _rel(da[:250].cpu(), dar[:250]) < 1e-2 and _rel(db[:250].cpu(), dbr[:250]) < 1e-2
    assert _rel(q[:250].cpu().float() * s[:250].cpu()[:, None], qr[:250].float() * sr[:250, None]) < 0.05
    # the FP8 rows alone (no bf16 copies written): the same bytes and scales
    h8, q8, s8 = fp8.swiglu_quant(ab.cuda(), bf16=False)
    hq, hs = fp8.swiglu_quant(ab.cuda())[1:]
    none_a, none_b, dq8, ds8 = fp8.swiglu_quant_bwd(dh.cuda(), ab.cuda(), n_valid, bf16=False)
    assert h8 is none_a is none_b is None
    assert torch.equal(q8.view(torch.uint8), hq.view(torch.uint8)) and torch.equal(s8, hs)
    assert torch.equal(dq8[:250].view(torch.uint8), q[:250].view(torch.uint8)) and torch.equal(ds8[:250], s[:250])


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("H", [1408, 2816, 88, 96])  # in three, three, three and two power-of-two parts
def test_row_quantisers_equal_at_every_launch_tile(H):
    """quant_rows, gather_quant_rows and both SwiGLU quantisers give the same bytes and scales at the default launch
    and every tile of ROW_TILES (rows a program, warps, a row in parts or one padded part) as one padded row a
    program (``m1``, the form the reference test above checks), with a row count that no tile divides and a
    device count of valid rows; quant_rows equals the torch reference bit for bit at each."""
    g = torch.Generator().manual_seed(H)
    M, valid = 37, 23
    ab = (torch.randn(M, 2 * H, generator=g) * torch.logspace(-2, 2, M)[:, None]).to(torch.bfloat16).cuda()
    ab[3] = 0  # a zero row: scale 1
    dh = torch.randn(M, H, generator=g).to(torch.bfloat16).cuda()
    x = (torch.randn(M, 3 * H, generator=g) * 5).to(torch.bfloat16).cuda()
    src = torch.randint(0, M, (M + 4,), generator=g).cuda()
    n = torch.tensor([valid], dtype=torch.int32, device="cuda")

    def outputs(tile):
        return {"fwd": fp8.swiglu_quant(ab, None, True, tile),
                "fwd_n": fp8.swiglu_quant(ab, n, False, tile),
                "bwd": fp8.swiglu_quant_bwd(dh, ab, None, True, tile),
                "bwd_n": fp8.swiglu_quant_bwd(dh, ab, n, False, tile),
                "rows_n": fp8.quant_rows(x, n, tile),
                "gather": fp8.gather_quant_rows(x, src, tile)}

    def rows_of(name, t):
        t = t[:valid] if name.endswith("_n") else t
        return t.view(torch.uint8) if t.dtype == FP8 else t

    want = outputs("m1")
    q_ref, s_ref = quant_rows_torch(x.cpu())
    assert torch.equal(want["rows_n"][1][:valid].cpu(), s_ref[:valid])
    assert torch.equal(rows_of("rows_n", want["rows_n"][0]).cpu(), q_ref[:valid].view(torch.uint8))
    for tile in (None, *fp8.ROW_TILES):
        for name, got in outputs(tile).items():
            for a, b in zip(got, want[name]):
                assert (a is None and b is None) or torch.equal(rows_of(name, a), rows_of(name, b)), (tile, name)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("channels, wgrad_fp8", [(False, False), (True, False), (False, True)],
                         ids=["per_expert", "per_channel", "fp8_weight_gradients"])
@pytest.mark.parametrize("case", sorted(COUNTS))
def test_fp8_experts_gpu_equal_the_emulated_path(case, channels, wgrad_fp8):
    """Triton quantisers + the Triton FP8 GEMMs == the CPU path's quantisation + fp32 GEMMs, up to bf16 rounding
    of the GEMM outputs (the FP8 error itself, ~5%, is far larger); weights scaled per expert or per output
    channel; the weight gradients in bf16 or in FP8 (kernels/fp8_wgrad.py)."""
    x, ws, counts, gy = _experts_case([c * 16 + 3 for c in COUNTS[case]], D=256, H=128)  # unaligned groups
    fn = lambda *a: fp8_grouped_swiglu(*a, channels=channels, wgrad_fp8=wgrad_fp8)
    cpu = _run(fn, x, ws, counts, gy)
    gpu = _run(fn, x.cuda(), [w.cuda() for w in ws], counts.cuda(), gy.cuda())
    used = int(counts.sum())
    assert _rel(gpu[0][:used].cpu(), cpu[0][:used]) < 0.02
    assert _rel(gpu[1][:used].cpu(), cpu[1][:used]) < 0.02
    for d, dc in zip(gpu[2], cpu[2]):
        assert _rel(d.cpu(), dc) < 0.02


@pytest.mark.gpu
@hopper
def test_fp8_experts_do_not_depend_on_the_scale_guess():
    """Cold guess (zeros), the guess a previous call left, and a stale guess after the weights moved:
    output and gradients bitwise the same as with a fresh guess (on the rows that are read)."""
    x, ws, counts, gy = _experts_case([40, 3, 0, 77, 16, 9], D=256, H=128, device="cuda")
    E, used = len(ws[0]), int(counts.sum())

    def flat(r):  # y and dx on the used rows (rows past them are unspecified), every weight gradient
        return [r[0][:used], r[1][:used], *r[2]]

    hint = torch.zeros(2, E, device="cuda")
    cold = _run(lambda *a: fp8_grouped_swiglu(*a, torch.zeros(2, E, device="cuda")), x, ws, counts, gy)
    _run(lambda *a: fp8_grouped_swiglu(*a, hint), x, ws, counts, gy)  # leaves this call's scales in hint
    warm = _run(lambda *a: fp8_grouped_swiglu(*a, hint), x, ws, counts, gy)
    for a, b in zip(flat(cold), flat(warm)):
        assert torch.equal(a, b)
    ws2 = [w * 5 for w in ws]  # the weights moved past the guessed scales
    stale = _run(lambda *a: fp8_grouped_swiglu(*a, hint), x, ws2, counts, gy)
    fresh = _run(lambda *a: fp8_grouped_swiglu(*a, torch.zeros(2, E, device="cuda")), x, ws2, counts, gy)
    for a, b in zip(flat(stale), flat(fresh)):
        assert torch.equal(a, b)


@pytest.mark.gpu
@hopper
def test_fp8_layer_tracks_bf16_layer_graphs_and_never_syncs():
    torch.manual_seed(0)
    args = MoEArgs(num_experts=16, num_shared_experts=1, top_k=4, score_func="softmax", route_norm=False,
                   score_before_experts=False)
    layer = MoELayer(args, 512, 256, MoEEchoConfig(expert_precision="fp8")).cuda()
    layer.init_weights(0.02, torch.device("cuda"))
    x = torch.randn(4, 1024, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn_like(x)

    def step():
        x.grad = None
        layer.zero_grad(set_to_none=False)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        y.backward(gy)
        return y.detach()  # no autograd graph outlives the step (a later capture needs none alive)

    outs = {}
    for p in ("bf16", "fp8"):
        layer.experts.precision = p
        outs[p] = (step().clone(), x.grad.clone(), layer.experts.w1.grad.clone())
    for a, b in zip(outs["fp8"], outs["bf16"]):
        assert _rel(a.float(), b.float()) < 0.1
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()  # no device-to-host read on the FP8 path
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    graph, y_g = warm_up_and_capture(step)
    x.data.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    y_graph, dx_graph = y_g.clone(), x.grad.clone()
    assert torch.equal(y_graph, step()) and torch.equal(dx_graph, x.grad)


@pytest.mark.parametrize("case", ["random", "all_to_one", "empty_experts"])
def test_per_channel_weight_scales_track_fp64_and_survive_an_outlier_channel(case):
    """``channels=True``: output and every gradient track the fp64 experts as the per-expert scaling does; with one
    output channel of w2 10⁵× the others in every expert, that channel's scale leaves the rest of each expert's
    weights in e4m3's subnormals under per-expert scaling, while per-channel scaling keeps the other output
    columns as close to fp64 as before."""
    x, ws, counts, gy = _experts_case(COUNTS[case])
    used = int(counts.sum())
    run = lambda ch, w: _run(lambda *a: fp8_grouped_swiglu(*a, channels=ch), x, w, counts, gy)
    y, dx, dws = run(True, ws)
    y64, dx64, dws64 = _run(_looped_swiglu, x.double(), [w.double() for w in ws], counts, gy.double())
    assert _rel(y[:used], y64[:used]) < 0.12 and _rel(dx[:used], dx64[:used]) < 0.12
    for e in range(len(counts)):
        for d, d64 in zip(dws, dws64):
            assert (d[e] == 0).all() if not counts[e] else _rel(d[e], d64[e]) < 0.12
    outlier = [ws[0], ws[1].clone(), ws[2]]
    outlier[1][:, 0] *= 1e5  # w2's row 0: output column 0 of every expert
    y64 = _run(_looped_swiglu, x.double(), [w.double() for w in outlier], counts, gy.double())[0][:used, 1:]
    err_channel = _rel(run(True, outlier)[0][:used, 1:], y64)
    err_expert = _rel(run(False, outlier)[0][:used, 1:], y64)
    assert err_channel < 0.12 and err_expert > 3 * err_channel, (err_channel, err_expert)


def test_per_channel_casts_scale_each_row_or_column_within_e4m3():
    """cast_channels: one power-of-two scale per row of [w1; w3] (the smallest that fits); cast_channels_t: the
    transposed stack with one per column. Each within e4m3's error of the weights."""
    from components.moe_echo.fp8_experts import cast_channels, cast_channels_t

    g = torch.Generator().manual_seed(3)
    E, H, D = 3, 32, 48
    w1 = torch.randn(E, H, D, generator=g) * torch.logspace(-3, 3, H)[None, :, None]
    w3 = torch.randn(E, H, D, generator=g) * torch.logspace(-2, 2, D)[None, None, :]
    both = torch.cat([w1, w3], 1).double()  # [E, 2H, D]
    q = torch.zeros(E, 2 * H, D, dtype=FP8)
    s = cast_channels((w1, w3), q)
    assert s.shape == (E, 2 * H)
    amax = both.abs().amax(2)
    assert (amax / s.double() <= FP8_MAX).all() and (amax / (s.double() / 2) > FP8_MAX).all()
    assert _within_e4m3(q.double() * s.double()[..., None], both, s.double()[..., None])
    qt = torch.zeros(E, D, 2 * H, dtype=FP8)
    st = cast_channels_t((w1, w3), qt)
    assert st.shape == (E, D)
    amax_t = both.abs().amax(1)
    assert (amax_t / st.double() <= FP8_MAX).all() and (amax_t / (st.double() / 2) > FP8_MAX).all()
    assert _within_e4m3(qt.double() * st.double()[..., None], both.transpose(1, 2), st.double()[..., None])


def test_rowwise_recipe_picks_per_channel_expert_scales_and_no_copies():
    """One key: recipe_name = "rowwise" gives the FP8 experts per-channel weight scales (unless the experts' own key
    is set); the layer takes it, and its experts then keep no optimizer-written copies."""
    from components.moe_echo.experts import GroupedExperts
    from components.train.config import load_config

    f8 = ["--model.converters", "float8", "--quantize.linear.float8.recipe_name"]
    assert load_config([*f8, "rowwise"]).moe_echo.expert_fp8_scaling == "channel"
    assert load_config([*f8, "rowwise_with_gw_hp"]).moe_echo.expert_fp8_scaling == "channel"
    assert load_config([*f8, "tensorwise"]).moe_echo.expert_fp8_scaling == "expert"
    assert load_config([]).moe_echo.expert_fp8_scaling == "expert"
    kept = load_config([*f8, "rowwise", "--moe_echo.expert_fp8_scaling", "expert"])
    assert kept.moe_echo.expert_fp8_scaling == "expert"
    args = MoEArgs(num_experts=8, num_shared_experts=0, top_k=2, score_func="softmax", route_norm=False,
                   score_before_experts=False)
    layer = MoELayer(args, 32, 16, MoEEchoConfig(expert_precision="fp8", expert_fp8_scaling="channel"))
    assert layer.experts.fp8_scaling == "channel"
    experts = GroupedExperts(32, 16, 4, "fp8", fp8_scaling="channel")
    experts.enable_fp8_copies()
    assert experts.fp8_copies is None
    experts = GroupedExperts(32, 16, 4, "fp8")
    torch.nn.init.normal_(experts.w1), torch.nn.init.normal_(experts.w2), torch.nn.init.normal_(experts.w3)
    experts.enable_fp8_copies()
    assert experts.fp8_copies is not None


# --- the local dispatcher's FP8 rows (quantised by the kernels that move the rows) ----------------

def _fp8_layer(device, fp8_rows: bool, seed=0, E=8, D=64, H=32, K=3):
    torch.manual_seed(seed)
    args = MoEArgs(num_experts=E, num_shared_experts=1, top_k=K, score_func="softmax", route_norm=False,
                   score_before_experts=False)
    layer = MoELayer(args, D, H, MoEEchoConfig(expert_precision="fp8")).to(device)
    layer.init_weights(0.05, torch.device(device))
    layer.dispatcher.fp8_rows = fp8_rows
    return layer


def _layer_step(layer, x_BSD, gy_BSD):
    x = x_BSD.clone().requires_grad_()
    y = layer(x)
    y.backward(gy_BSD)
    return [y.detach(), x.grad] + [p.grad for p in layer.parameters()]


def test_dispatched_fp8_rows_replace_the_experts_quantisation(monkeypatch):
    """The local dispatcher hands the FP8 experts x_ND and y_ND's gradient already quantised: the experts then
    quantise no [N, D] rows themselves, and output and every gradient are bitwise those of quantising there
    (one token's rows all to one expert; a token row of zeros)."""
    import components.moe_echo.fp8_experts as fe

    quantised = []
    real = fe.quant_rows
    monkeypatch.setattr(fe, "quant_rows", lambda x, *a: quantised.append(tuple(x.shape)) or real(x, *a))
    B, S, D, K = 2, 24, 64, 3
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, D, generator=g).to(torch.bfloat16)
    x[0, 5] = 0
    gy = torch.randn(B, S, D, generator=g).to(torch.bfloat16)
    runs = {}
    for fp8_rows in (False, True):
        quantised.clear()
        layer = _fp8_layer("cpu", fp8_rows)
        layer.to(torch.bfloat16)
        layer.expert_bias[2] = 5.0  # expert 2 takes every token: one hot expert
        layer.load_balance_coeff = 1e-3
        runs[fp8_rows] = _layer_step(layer, x, gy)
        rows = [s for s in quantised if s == (B * S * K, D)]
        assert len(rows) == (0 if fp8_rows else 2), quantised
    for a, b in zip(runs[True], runs[False]):
        assert a is not None and torch.equal(a, b)


def test_fp8_rows_give_a_gradient_only_for_the_tensor_it_was_made_from():
    from components.moe_echo.row_ops import Fp8Rows

    g = torch.randn(6, 4)
    q, s = fp8.quant_rows(g)
    rows = Fp8Rows()
    rows.put_grad(g, q, s)
    assert rows.take_grad(g) == (q, s) and rows.take_grad(g) is None  # once
    rows.put_grad(g, q, s)
    assert rows.take_grad(g.clone()) is None  # other memory
    rows.put_grad(g, q, s)
    g.add_(1)  # modified after it was quantised (an accumulated gradient)
    assert rows.take_grad(g) is None
    rows.put_grad(g, q, s)
    assert rows.take_grad(g[:3]) is None  # a part of it


def test_fp8_rows_alone_are_the_experts_only_values():
    """``Fp8Rows(plain=False)``: the x_ND and output gradient handed over are stand-ins (one element expanded), the
    FP8 rows their only values. The experts' output and every gradient equal those from the real bf16 rows and the
    same FP8 rows; a gradient other than the stand-in is refused, as are bf16 weight gradients (they read x_ND)."""
    from components.moe_echo.row_ops import Fp8Rows
    from components.tensors import shape_only

    g = torch.Generator().manual_seed(6)
    E, H, D, N = 4, 32, 64, 40
    ws = [torch.randn(E, *s, generator=g) * 0.05 for s in ((H, D), (D, H), (H, D))]
    x = torch.randn(N, D, generator=g).bfloat16()
    gy = torch.randn(N, D, generator=g).bfloat16()
    counts = torch.tensor([9, 0, 25, 4])
    runs = []
    for plain in (True, False):
        rows = Fp8Rows(plain=plain)
        rows.x = fp8.quant_rows(x)
        x_in = x.clone().requires_grad_() if plain else shape_only(x).requires_grad_()
        ww = [w.clone().requires_grad_() for w in ws]
        y = fp8_grouped_swiglu(x_in, *ww, counts, rows=rows, wgrad_fp8=True)
        grad = gy if plain else shape_only(gy)
        rows.put_grad(grad, *fp8.quant_rows(gy))
        y.backward(grad)
        assert rows.x is None and rows._grad is None  # both taken
        runs.append([y[:38], x_in.grad[:38], *(w.grad for w in ww)])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    rows = Fp8Rows(plain=False)
    rows.put_grad(shape_only(gy), *fp8.quant_rows(gy))
    with pytest.raises(RuntimeError, match="nothing may use the experts' output but the combine"):
        rows.take_grad(gy)
    rows = Fp8Rows(plain=False)
    rows.x = fp8.quant_rows(x)
    with pytest.raises(ValueError, match="need FP8 weight gradients"):
        fp8_grouped_swiglu(shape_only(x), *ws, counts, rows=rows, wgrad_fp8=False)


@pytest.mark.gpu
@hopper
def test_row_movers_quantise_bit_for_bit_like_quant_rows():
    """gather_quant_rows == index_select + quant_rows, and combine_backward's fp8_out == quant_rows(grad_y), bit for
    bit: rows spanning 10⁻⁶..10⁶, zero rows, zero / negative / tiny / huge combine weights, a width that is not a
    power of two, and fp8 token gradients with block scales (the fp8 wire)."""
    from kernels.moe_rows import combine_backward, combine_backward_torch

    g = torch.Generator().manual_seed(4)
    for D in (1408, 2048):
        T, K = 257, 6
        x = (torch.randn(T, D, generator=g) * torch.logspace(-6, 6, T)[:, None]).to(torch.bfloat16).cuda()
        x[3] = 0
        src = torch.randint(0, T, (T * K,), generator=g).cuda()
        x_ND, q, s = fp8.gather_quant_rows(x, src)
        ref = x.index_select(0, src)
        qr, sr = fp8.quant_rows(ref)
        assert torch.equal(x_ND, ref) and torch.equal(s, sr) and torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
        row_of_slot = torch.randperm(T * K, generator=g).view(T, K).cuda()
        w = torch.rand(T, K, generator=g) * torch.logspace(-8, 4, T * K).view(T, K)
        w[0] = 0
        w[1] = -w[1]
        y = torch.randn(T * K, D, generator=g).to(torch.bfloat16).cuda()
        gt = x.flip(0).contiguous()
        fp8_g = fp8.quant_blocks(gt, 128)
        for grad, scales in ((gt, None), fp8_g):
            out = torch.empty(T * K, D, dtype=FP8, device="cuda"), torch.empty(T * K, device="cuda")
            kw = dict(allow_missing=False, g_scales=scales, scale_block=128 if scales is not None else 0)
            gy, gw = combine_backward(grad, y, w.cuda(), row_of_slot, fp8_out=out, **kw)
            gy0, gw0 = combine_backward(grad, y, w.cuda(), row_of_slot, **kw)
            qr, sr = fp8.quant_rows(gy0)
            g_deq = grad if scales is None else fp8.dequant_blocks(*fp8_g, 128, torch.empty(T, D, device="cuda"))
            gy_ref, gw_ref = combine_backward_torch(g_deq, y, w.cuda(), row_of_slot)
            assert torch.equal(gy0, gy_ref) and _rel(gw0, gw_ref) < 1e-5
            assert torch.equal(gy, gy0) and torch.equal(gw, gw0)
            assert torch.equal(out[1], sr) and torch.equal(out[0].view(torch.uint8), qr.view(torch.uint8))
            # plain=False: the FP8 rows alone, grad_y_out as it was
            held = torch.full((T * K, D), 3.0, dtype=torch.bfloat16, device="cuda")
            alone = torch.empty(T * K, D, dtype=FP8, device="cuda"), torch.empty(T * K, device="cuda")
            _, gw1 = combine_backward(grad, y, w.cuda(), row_of_slot, grad_y_out=held, fp8_out=alone, plain=False,
                                      **kw)
            assert (held == 3.0).all() and torch.equal(gw1, gw0) and torch.equal(alone[1], sr)
            assert torch.equal(alone[0].view(torch.uint8), qr.view(torch.uint8))


@pytest.mark.gpu
@hopper
def test_dispatched_fp8_rows_equal_quantising_in_the_experts_on_gpu():
    """The FP8 layer on the GPU kernels: bitwise the same output and gradients whether the dispatcher's kernels
    or the experts quantise the rows."""
    B, S, D = 2, 512, 256
    x = torch.randn(B, S, D, device="cuda").to(torch.bfloat16)
    gy = torch.randn(B, S, D, device="cuda").to(torch.bfloat16)
    runs = []
    for fp8_rows in (False, True):
        layer = _fp8_layer("cuda", fp8_rows, E=16, D=D, H=128, K=4).to(torch.bfloat16)
        runs.append(_layer_step(layer, x, gy))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


# --- the nvlink dispatcher's FP8 rows (its local expand and combine backward quantise them) --------

@pytest.mark.parametrize("routing, chunks, recompute", [("random", 1, False), ("all_to_one", 1, False),
                                                         ("random", 2, False), ("all_to_one", 1, True)])
def test_nvlink_fp8_rows_replace_the_experts_quantisation(monkeypatch, routing, chunks, recompute):
    """FP8 experts behind the nvlink dispatcher at EP=2 (threads as ranks, CPU): with ``fp8_rows`` the dispatcher
    hands over x_ND and y_ND's gradient as FP8 rows and the experts quantise no [N, D] rows themselves; output and
    every gradient are bitwise those of quantising in the experts (``all_to_one``: every token to one expert of
    rank 0, whose peer then receives nothing; ``chunks``: the layer pipelined in token chunks, overlap_chunks;
    ``recompute``: ECHO on with echo_recompute, whose recomputed forward quantises x once more)."""
    import copy
    import dataclasses

    from components.moe_echo.echo import Echo
    from components.moe_echo.echo_transport import build_transport

    import components.moe_echo.fp8_experts as fe
    from components.moe_echo.nvlink_dispatch import NVLinkDispatcher
    from threaded_ranks import run_ranks

    quantised = []
    real = fe.quant_rows
    monkeypatch.setattr(fe, "quant_rows", lambda x, *a: quantised.append(tuple(x.shape)) or real(x, *a))
    R, E, D, S, K = 2, 8, 64, 24, 3
    e = E // R
    ref = _fp8_layer("cpu", False, E=E, D=D, K=K).to(torch.bfloat16)
    if routing == "all_to_one":
        ref.expert_bias[1] = 50.0
    g = torch.Generator().manual_seed(3)
    x_all = torch.randn(R, 1, S, D, generator=g).to(torch.bfloat16)
    gy_all = torch.randn(R, 1, S, D, generator=g).to(torch.bfloat16)
    runs = {}
    for fp8_rows in (False, True):
        layers = [copy.deepcopy(ref) for _ in range(R)]
        quantised.clear()

        def rank_fn(rank, ws, layers=layers, fp8_rows=fp8_rows):
            layer = layers[rank]
            for name in ("w1", "w2", "w3"):
                full = getattr(layer.experts, name).data
                setattr(layer.experts, name, torch.nn.Parameter(full[rank * e:(rank + 1) * e].clone()))
            slots = 2 if recompute else 0  # ECHO's clone slots per rank
            layer.dispatcher = NVLinkDispatcher(R * (e + slots), None, R, float(R), workspace=ws, name="layer",
                                                fp8_rows=fp8_rows)
            layer.ep_size = R
            layer.cfg = dataclasses.replace(layer.cfg, overlap_chunks=chunks, echo_recompute=recompute)
            if recompute:
                transport = build_transport(layer.dispatcher, None, R, rank, slots, e)
                layer.echo = Echo(E, R, rank, slots, "greedy", transport)
            out = _layer_step(layer, x_all[rank], gy_all[rank])
            assert not recompute or float(layer.echo_stats[2]) >= 1  # ECHO cloned: the recompute path ran
            return out

        runs[fp8_rows] = run_ranks(R, rank_fn)
        cap = 128 * -(-R * (S // chunks) * K // 128)  # nvlink_capacity at capacity factor R, per chunk
        rows = [s for s in quantised if s == (cap, D)]
        assert len(rows) == R * chunks * ((1 if recompute else 0) if fp8_rows else (3 if recompute else 2)), quantised
    for rank in range(R):
        for a, b in zip(runs[True][rank], runs[False][rank]):
            assert a is not None and torch.equal(a, b)


@pytest.mark.gpu
@hopper
def test_nvlink_expand_quantises_bit_for_bit_like_quant_rows():
    """The nvlink dispatcher's local expand (``peer_scatter`` into one buffer) with ``fp8_out``: every row it writes
    is also written as quant_rows would quantise it, bit for bit, from bf16 token rows and from the fp8 wire's
    block-scaled rows (dequantised on the way); rows no choice lands on keep what they held. Rows spanning
    10⁻⁶..10⁶, a zero row, a token sent nowhere, a width that is not a power of two."""
    from kernels.peer_rows import peer_scatter

    g = torch.Generator().manual_seed(5)
    for D in (1408, 2048):
        U, K, N = 300, 6, 2048
        tok = (torch.randn(U, D, generator=g) * torch.logspace(-6, 6, U)[:, None]).to(torch.bfloat16).cuda()
        tok[7] = 0
        row_UK = torch.randperm(N, generator=g)[:U * K].view(U, K)
        row_UK[torch.rand(U, K, generator=g) < 0.6] = -1  # most choices land on other ranks
        row_UK[11] = -1
        row_UK = row_UK.to(torch.int32).cuda()
        written = row_UK[row_UK >= 0].long()
        for scales in (None, fp8.quant_blocks(tok, 128)):
            src = tok if scales is None else scales[0]
            buf = torch.full((N, D), 3.0, dtype=torch.bfloat16, device="cuda")
            q = torch.full((N, D), 1.0, device="cuda").to(FP8)
            s = torch.full((N,), -1.0, device="cuda")
            ptrs = torch.tensor([buf.data_ptr()], dtype=torch.int64, device="cuda")
            peer_scatter(src, None, row_UK, ptrs, [buf], x_scales=None if scales is None else scales[1],
                         scale_block=0 if scales is None else 128, fp8_out=(q, s))
            qr, sr = fp8.quant_rows(buf.index_select(0, written))
            assert torch.equal(s[written], sr)
            assert torch.equal(q[written].view(torch.uint8), qr.view(torch.uint8))
            kept = torch.ones(N, dtype=torch.bool, device="cuda")
            kept[written] = False
            assert kept.any() and (s[kept] == -1).all() and (q[kept].float() == 1).all()
            assert torch.equal(buf[kept], torch.full_like(buf[kept], 3.0))
            # plain=False: the same FP8 rows, the buffer left as it was
            buf2 = torch.full((N, D), 3.0, dtype=torch.bfloat16, device="cuda")
            q2, s2 = torch.full((N, D), 1.0, device="cuda").to(FP8), torch.full((N,), -1.0, device="cuda")
            ptrs2 = torch.tensor([buf2.data_ptr()], dtype=torch.int64, device="cuda")
            peer_scatter(src, None, row_UK, ptrs2, [buf2], x_scales=None if scales is None else scales[1],
                         scale_block=0 if scales is None else 128, fp8_out=(q2, s2), plain=False)
            assert (buf2 == 3.0).all() and torch.equal(s2, s) and torch.equal(q2.view(torch.uint8), q.view(torch.uint8))


def test_fp8_rows_alone_only_where_the_experts_read_nothing_else():
    """The rule that builds ``nvlink`` with FP8 rows alone: FP8 experts whose weight gradients are FP8 (``auto``
    resolves to the experts' precision, as the layer resolves it) and no ``echo_recompute``."""
    from components.moe_echo.backends import _fp8_rows_alone

    assert _fp8_rows_alone(MoEEchoConfig(expert_precision="fp8"))
    assert _fp8_rows_alone(MoEEchoConfig(expert_precision="fp8", expert_wgrad_precision="fp8"))
    assert not _fp8_rows_alone(MoEEchoConfig(expert_precision="fp8", expert_wgrad_precision="bf16"))
    assert not _fp8_rows_alone(MoEEchoConfig(expert_precision="fp8", echo_recompute=True))
    assert not _fp8_rows_alone(MoEEchoConfig())
    for cfg in (MoEEchoConfig(expert_precision="fp8"), MoEEchoConfig(expert_precision="fp8",
                                                                     expert_wgrad_precision="bf16")):
        layer = MoELayer(MoEArgs(num_experts=4, num_shared_experts=0, top_k=2, score_func="softmax",
                                 route_norm=False, score_before_experts=False), 32, 16, cfg)
        assert layer.experts.wgrad_precision == cfg.wgrad_precision()
