"""FP8 experts: the quantisers against fp64, the aligned layout, the FP8 SwiGLU experts against the
fp64 experts (CPU: GEMMs emulated), and on a Hopper GPU the Triton kernels and scaled grouped GEMMs
against the CPU path, the bf16 layer, a CUDA graph and the sync-free rule."""

import pytest
import torch
from torchtitan.models.moe import MoEArgs

from components.errors import UserError
from components.moe_echo.config import MoEEchoConfig
from components.moe_echo.experts import _looped_swiglu
from components.moe_echo.fp8_experts import AlignedRows, check_fp8_supported, fp8_grouped_swiglu
from components.moe_echo.layer import MoELayer
from kernels import fp8
from kernels.fp8 import FP8_MAX, pow2_scale, quant_cols_torch, quant_rows_torch

# adversarial and random row counts per expert (N rows in all; N > sum leaves fixed-capacity padding)
COUNTS = {
    "random": [5, 0, 17, 9, 33, 1],
    "all_to_one": [0, 0, 64, 0, 0, 0],
    "empty_experts": [0, 31, 0, 0, 0, 16],
    "one_hot_per_rank": [40, 2, 3, 37, 1, 4],
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


@pytest.mark.parametrize("scale", [1e-4, 1.0, 1e3])
def test_quant_rows_error_bound_and_gather(scale):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 80, generator=g) * scale * torch.rand(37, 1, generator=g)).to(torch.bfloat16)
    x[3] = 0  # an all-zero row
    src = torch.tensor([4, -1, 0, 36, 3, 4])
    q, s = quant_rows_torch(x, src)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (6, 80) and s.shape == (6,)
    ref = torch.cat([x, x.new_zeros(1, 80)])[torch.where(src < 0, 37, src)].double()
    deq = q.double() * s.double()[:, None]
    # e4m3: 3 mantissa bits (relative half-step 2^-4) above 2^-6·s, absolute step 2^-9·s below
    assert ((deq - ref).abs() <= ref.abs() * 2**-4 + s.double()[:, None] * 2**-10).all()
    assert (q[1].float() == 0).all() and s[1] == 1 and s[4] == 1  # -1 row and zero row
    assert (ref.abs().amax(1) / s.double() <= FP8_MAX).all()


def test_quant_cols_per_group_scales_transposed_and_zero_padded():
    g = torch.Generator().manual_seed(1)
    counts = torch.tensor([5, 0, 17, 9])
    x = torch.randn(int(counts.sum()) + 3, 24, generator=g).to(torch.bfloat16)
    x[5:22, 7] *= 1000  # one column of one group is large: only that group's scale may grow
    start = torch.cumsum(counts, 0) - counts
    pad = (counts + 15) // 16 * 16
    start_al = torch.cumsum(pad, 0) - pad
    n_out = int(pad.sum()) + 16
    qT, s = quant_cols_torch(x, start, counts, start_al, n_out)
    qT = qT.view(24, n_out)
    for e in range(4):
        rows = x[start[e]:start[e] + counts[e]].double()
        if counts[e]:
            assert torch.equal(s[e], pow2_scale(rows.abs().amax(0)).float())
        blk = qT[:, start_al[e]:start_al[e] + pad[e]].double()
        deq = blk[:, :counts[e]] * s[e].double()[:, None]
        assert ((deq - rows.t()).abs() <= rows.t().abs() * 2**-4 + s[e].double()[:, None] * 2**-10).all()
        assert (blk[:, counts[e]:] == 0).all()  # 16-alignment padding is zero
    assert s[2, 7] >= 512 * s[0, 7]


@pytest.mark.parametrize("case", sorted(COUNTS))
def test_aligned_rows_map_every_row_once(case):
    counts = torch.tensor(COUNTS[case])
    N = int(counts.sum()) + 7  # fixed-capacity padding past the last expert
    lay = AlignedRows.build(counts, N)
    assert lay.rows == (N + 15) // 16 * 16 + 16 * len(counts)
    offs = lay.offs_al_E.long()
    assert (offs % 16 == 0).all() and (torch.diff(offs, prepend=offs.new_zeros(1)) >= counts).all()
    dst = lay.dst_N1.view(-1)
    used = int(counts.sum())
    assert (dst[used:] == -1).all() and (dst[:used] >= 0).all()
    assert torch.equal(lay.src_M[dst[:used]], torch.arange(used))  # src ∘ dst = identity
    assert int((lay.src_M >= 0).sum()) == used
    e_of_row = torch.repeat_interleave(torch.arange(len(counts)), counts)
    assert ((dst[:used] >= lay.start_al_E[e_of_row]) & (dst[:used] < offs[e_of_row])).all()


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
    """Output and every gradient within 12% (norm) of the fp64 experts; padding rows exactly zero."""
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
    assert (y[used:] == 0).all() and (dx[used:] == 0).all()
    assert dws[0].dtype == ws[0].dtype  # gradients in the weights' dtype (fp32 masters)


def test_fp8_needs_a_hopper_gpu_one_line_error():
    with pytest.raises(UserError) as e:
        check_fp8_supported(torch.device("cpu"))
    msg = str(e.value)
    assert "\n" not in msg and 'expert_precision = "bf16"' in msg


def test_fp8_layer_config_reaches_the_experts():
    args = MoEArgs(num_experts=8, num_shared_experts=0, top_k=2, score_func="softmax", route_norm=False,
                   score_before_experts=False)
    layer = MoELayer(args, 32, 16, MoEEchoConfig(expert_precision="fp8"))
    assert layer.experts.precision == "fp8"


# --- GPU: the Triton kernels and torch._scaled_grouped_mm ----------------------------------------

hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                            reason="needs a Hopper (sm90+) GPU")


@pytest.mark.gpu
@hopper
def test_triton_quantisers_equal_torch_reference():
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(300, 1408, generator=g) * torch.logspace(-3, 3, 300)[:, None]).to(torch.bfloat16)
    x[7] = 0
    src = torch.randint(-1, 300, (333,), generator=g)
    for args in ((x, None), (x, src), (x.double(), src)):  # fp64 too: the kernels, not a host-reading path
        q, s = fp8.quant_rows(*(a.cuda() if a is not None else None for a in args))
        qr, sr = quant_rows_torch(*args)
        assert torch.equal(s.cpu(), sr) and torch.equal(q.cpu().view(torch.uint8), qr.view(torch.uint8))
    counts = torch.tensor([0, 17, 100, 1, 0, 150, 32])
    start = torch.cumsum(counts, 0) - counts
    pad = (counts + 15) // 16 * 16
    start_al = torch.cumsum(pad, 0) - pad
    n_out = 300 + 16 * 7
    q, s = fp8.quant_cols(x.cuda(), start.cuda(), counts.cuda(), start_al.cuda(), n_out)
    qr, sr = quant_cols_torch(x, start, counts, start_al, n_out)
    used = int(pad.sum())
    assert torch.equal(s.cpu()[counts > 0], sr[counts > 0])
    assert torch.equal(q.cpu().view(1408, n_out)[:, :used].view(torch.uint8), qr.view(1408, n_out)[:, :used].view(torch.uint8))
    # weights: [E·O, I] transposed per expert
    w = torch.randn(4 * 64, 96, generator=g)
    ar = torch.arange(4)
    q, s = fp8.quant_cols(w.cuda(), (ar * 64).cuda(), torch.full((4,), 64).cuda(), torch.zeros(4, dtype=torch.int64).cuda(), 64, 96 * 64)
    qr, sr = quant_cols_torch(w, ar * 64, torch.full((4,), 64), torch.zeros(4, dtype=torch.int64), 64, 96 * 64)
    assert torch.equal(s.cpu(), sr) and torch.equal(q.cpu().view(torch.uint8), qr.view(torch.uint8))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("case", sorted(COUNTS))
def test_fp8_experts_gpu_equal_the_emulated_path(case):
    """Triton quantisers + torch._scaled_grouped_mm == the CPU path's quantisation + fp32 GEMMs, up to
    bf16 rounding of the GEMM outputs (the FP8 error itself, ~5%, is far larger)."""
    x, ws, counts, gy = _experts_case([c * 16 + 3 for c in COUNTS[case]], D=256, H=128)
    cpu = _run(fp8_grouped_swiglu, x, ws, counts, gy)
    gpu = _run(fp8_grouped_swiglu, x.cuda(), [w.cuda() for w in ws], counts.cuda(), gy.cuda())
    used = int(counts.sum())
    assert _rel(gpu[0][:used].cpu(), cpu[0][:used]) < 0.02
    assert _rel(gpu[1][:used].cpu(), cpu[1][:used]) < 0.02
    for d, dc in zip(gpu[2], cpu[2]):
        assert _rel(d.cpu(), dc) < 0.02
    assert (gpu[0][used:] == 0).all() and (gpu[1][used:] == 0).all()


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
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_g = step()
    x.data.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    y_graph, dx_graph = y_g.clone(), x.grad.clone()
    assert torch.equal(y_graph, step()) and torch.equal(dx_graph, x.grad)


def test_loss_match_reports_the_largest_and_tail_differences(tmp_path):
    from benchmarks.loss_match import compare, losses

    ref, other = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    ref.write_text("".join(f'{{"step": {s}, "loss": {10 / s}}}\n' for s in range(1, 31)) + '{"step": 31}\n')
    other.write_text("".join(f'{{"step": {s}, "loss": {10 / s * (1.05 if s == 7 else 1.002)}}}\n'
                             for s in range(1, 31, 2)))
    r = compare(losses(str(ref)), losses(str(other)))
    assert r["steps"] == 15 and r["max_rel_step"] == 7 and abs(r["max_rel"] - 0.05) < 1e-9
    assert abs(r["tail_mean_rel"] - 0.002) < 1e-9
