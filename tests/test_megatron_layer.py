"""benchmarks/megatron_layer.py on CPU (fp32): Megatron-Core's MoE layer built from ours gives our
outputs and input gradients, with and without a routing bias, on both expert paths (GroupedMLP with
a per-expert reference GEMM in place of the CUDA grouped_gemm). Skipped without megatron-core."""

import pytest
import torch
from torchtitan.models.moe import MoEArgs

pytest.importorskip("megatron.core")

from benchmarks import megatron_layer as ml  # noqa: E402
from components.moe_echo.config import MoEEchoConfig  # noqa: E402
from components.moe_echo.layer import MoELayer  # noqa: E402

D, H, E, K = 32, 16, 8, 3


@pytest.fixture(scope="module", autouse=True)
def megatron_state():
    if ml.unavailable():
        pytest.skip(ml.unavailable())
    did = ml.init_megatron("cpu")
    yield
    if did:
        ml.teardown_megatron()


def make_ours(seed=0):
    torch.manual_seed(seed)
    args = MoEArgs(num_experts=E, num_shared_experts=0, top_k=K, score_func="softmax", route_norm=False,
                   score_before_experts=False)
    ours = MoELayer(args, D, H, MoEEchoConfig())
    ours.init_weights(0.2, torch.device("cpu"))
    with torch.no_grad():
        ours.router.gate.weight.normal_(0, 0.5)
    return ours


class _LoopGmm:
    """grouped_gemm.ops.gmm on CPU: a[rows of expert e] @ b[e] (or b[e]ᵀ), differentiable."""

    @staticmethod
    def gmm(a, b, batch_sizes, trans_b=False):
        outs = [a_e @ (b[e].t() if trans_b else b[e]) for e, a_e in enumerate(torch.split(a, batch_sizes.tolist()))]
        return torch.cat(outs)


@pytest.fixture
def grouped_on_cpu(monkeypatch):
    from megatron.core.transformer.moe import experts, grouped_gemm_util

    monkeypatch.setattr(grouped_gemm_util, "grouped_gemm", object())
    monkeypatch.setattr(grouped_gemm_util, "ops", _LoopGmm)
    monkeypatch.setattr(experts, "jit_fuser", lambda f: f)  # no torch.compile of the GLU on CPU


def fwd_bwd(layer, x, g):
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(g)
    return y.detach(), x.grad


@pytest.mark.parametrize("skewed", [False, True])
@pytest.mark.parametrize("grouped", [False, True])
def test_matches_ours(skewed, grouped, request, monkeypatch):
    if grouped:
        request.getfixturevalue("grouped_on_cpu")
    ours = make_ours()
    if skewed:  # strong enough to move many top-k choices
        ours.expert_bias.copy_(torch.linspace(0.3, -0.3, E))
    mega = ml.build_megatron_moe(ours, grouped=grouped)
    assert mega.path == ("grouped_gemm" if grouped else "sequential")
    if grouped:
        monkeypatch.setattr(mega.moe.experts.config, "bf16", True)  # GroupedMLP asserts bf16 mode

    x = torch.randn(4, 24, D)
    agree, rel = ml.compare(ours, mega, x)
    assert agree == 1.0 and rel < 1e-5

    g = torch.randn_like(x)
    y_ours, gx_ours = fwd_bwd(ours, x, g)
    y_mega, gx_mega = fwd_bwd(mega, x, g)
    torch.testing.assert_close(y_mega, y_ours, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx_mega, gx_ours, rtol=1e-4, atol=1e-6)

    if skewed:  # the bias really changed Megatron's routing
        x_TD = x.reshape(-1, D)
        biased = mega.routing_map(x_TD)
        mega.moe.router.use_bias(None)
        assert (mega.routing_map(x_TD) != biased).any()


def test_expert_weight_layout(grouped_on_cpu):
    """fc1 = [gate; up] per expert (Megatron's GLU: silu(first half) * second half)."""
    ours = make_ours()
    w1, w2, w3 = ours.experts.w1.detach(), ours.experts.w2.detach(), ours.experts.w3.detach()
    seq = ml.build_megatron_moe(ours, grouped=False).moe.experts.local_experts
    grp = ml.build_megatron_moe(ours, grouped=True).moe.experts
    for e in (0, E - 1):
        torch.testing.assert_close(seq[e].linear_fc1.weight, torch.cat([w1[e], w3[e]]))
        torch.testing.assert_close(seq[e].linear_fc2.weight, w2[e])
        torch.testing.assert_close(grp.weight1.view(E, D, 2 * H)[e], torch.cat([w1[e], w3[e]]).t())
        torch.testing.assert_close(grp.weight2.view(E, H, D)[e], w2[e].t())
