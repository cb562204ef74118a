"""Megatron-Core's MoE layer built from a moe-echo ``MoELayer``: same weights, routing bias and inputs.

Path: megatron-core 0.16.1 without transformer-engine (``get_moe_module_spec(use_te=False, ...)``):
- experts: the non-TE grouped path, ``GroupedMLP`` (``moe_grouped_gemm=True``,
  ``moe_use_legacy_grouped_gemm=True``). Its GEMMs are ``grouped_gemm.ops.gmm`` from the
  ``nv_grouped_gemm`` CUDA extension (Megatron's recommended grouped_gemm; cuBLAS GEMMs spread
  over several streams on sm_90), and its SwiGLU × routing weight is ``torch.compile``d. Without
  that extension: ``SequentialMLP``, one ColumnParallelLinear / RowParallelLinear pair per expert
  with Megatron's fused weighted SwiGLU. ``expert_path()`` names the one in use.
- dispatcher: ``allgather`` (Megatron's default; at EP = TP = 1 it is a local permute / unpermute).
- router: fp32 gate logits (``moe_router_dtype="fp32"``), softmax over all E before top-k
  (``moe_router_pre_softmax``), no renormalisation, no auxiliary loss.

Why not transformer-engine: its PyTorch extension is published as source only (it must be
compiled against the installed torch, 2.11 here) and its core library is a 263 MB wheel; neither
is installed with the benchmark's packages. Why 0.16.1: the newest release with a non-TE grouped
expert path. 0.17+ removed ``GroupedMLP``: their only non-TE training experts are
``SequentialMLP``; ``torch._grouped_mm`` appears there only in the inference-only
``InferenceGroupedMLP``, which builds on TE.

Weight mapping (ours → Megatron), per expert e, with w1 = gate, w3 = up (torchtitan layout):
    fc1_e = cat([w1[e], w3[e]]) : [2H, D]   Megatron's GLU is silu(first half) * second half
    fc2_e = w2[e]               : [D, H]
    GroupedMLP stores them transposed and stacked: weight1 = [D, E·2H] (viewed [E, D, 2H]),
    weight2 = [E·H, D] (viewed [E, H, D]).
    router.weight = router.gate.weight : [E, D].

Routing bias: Megatron accepts an expert bias only with sigmoid scores. For a nonzero bias, the
router's top-k hook (``router_replay``) selects on softmax scores + bias and keeps the unbiased
scores as weights, exactly as our router and torchtitan's do; a zero bias leaves Megatron's own
top-k untouched.
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

MEGATRON_VERSION = "0.16.1"


def unavailable() -> str | None:
    """None if megatron-core with the non-TE ``GroupedMLP`` imports, else why not."""
    try:
        import megatron.core
        from megatron.core.transformer.moe import experts
    except Exception as e:  # ImportError, or a failing import inside megatron
        return f"megatron-core not importable: {type(e).__name__}: {e}"
    if not hasattr(experts, "GroupedMLP"):
        return f"megatron-core {megatron.core.__version__} has no GroupedMLP (removed in 0.17); install {MEGATRON_VERSION}"
    return None


def version() -> str:
    import megatron.core

    return megatron.core.__version__


def expert_path(device: torch.device | str = "cuda") -> str:
    """'grouped_gemm' (GroupedMLP) when the grouped_gemm extension imports and ``device`` is CUDA,
    else 'sequential' (SequentialMLP)."""
    from megatron.core.transformer.moe import grouped_gemm_util

    ok = grouped_gemm_util.grouped_gemm_is_available() and torch.device(device).type == "cuda"
    return "grouped_gemm" if ok else "sequential"


def init_megatron(device: torch.device | str) -> bool:
    """A one-process group (nccl on CUDA, gloo on CPU) and Megatron's parallel state with
    TP = PP = EP = 1. Returns True when it initialised anything (the caller may tear down)."""
    from megatron.core import parallel_state

    _patch_without_te()
    did = False
    if not dist.is_initialized():
        device = torch.device(device)
        if device.type == "cuda":
            torch.cuda.set_device(device.index if device.index is not None else torch.cuda.current_device())
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=0,
            world_size=1,
        )
        did = True
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        did = True
    return did


def teardown_megatron() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _patch_without_te() -> None:
    """megatron-core 0.16.1's router gate GEMM reads ``te_general_gemm``, which it defines only when
    transformer-engine imports (later releases set it to None); None selects its torch.mm path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class _BiasedTopK:
    """Megatron's top-k hook (the ``router_replay`` slot): top-k of scores + bias, weights = the
    unbiased scores of the picks. scores: [T, E] (softmax, fp32) → ([T, K], [T, K] ids)."""

    def __init__(self, router: nn.Module):
        self.router = router

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        ids = torch.topk(scores + self.router.choice_bias, k=topk, dim=1).indices
        return scores.gather(1, ids), ids


def _router_class():
    from megatron.core.transformer.moe.moe_utils import router_gating_linear
    from megatron.core.transformer.moe.router import TopKRouter

    class Router(TopKRouter):
        """Megatron's TopKRouter plus a routing bias (``choice_bias``, [E] fp32, see
        ``_BiasedTopK``); on CPU the gate stays on CPU (Megatron's gating moves it to CUDA)."""

        def __init__(self, config, pg_collection=None):
            super().__init__(config=config, pg_collection=pg_collection)
            self.register_buffer("choice_bias", torch.zeros(config.num_moe_experts), persistent=False)

        def use_bias(self, bias_E: torch.Tensor | None) -> None:
            if bias_E is None or not bool(bias_E.ne(0).any()):
                self.router_replay = None
                return
            self.choice_bias.copy_(bias_E.float())
            self.router_replay = _BiasedTopK(self)

        def gating(self, input):
            if self.weight.device.type == "cpu" and input.device.type == "cpu":
                return router_gating_linear(input, self.weight, self.bias, torch.float32)
            return super().gating(input)

    return Router


class MegatronMoE(nn.Module):
    """Megatron-Core's ``MoELayer`` as a [B, S, D] → [B, S, D] module (Megatron reads [S, B, D];
    routing is per token, so the flattened token order is all that matters)."""

    def __init__(self, moe: nn.Module, path: str):
        super().__init__()
        self.moe = moe
        self.path = path

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        y, _ = self.moe(x_BSD)
        return y

    @torch.no_grad()
    def routing_map(self, x_TD: torch.Tensor) -> torch.Tensor:
        """[T, E] bool: the experts Megatron's router picks for each token."""
        return self.moe.router(x_TD.unsqueeze(1))[1].view(x_TD.shape[0], -1)


def _routing_bias(ours) -> torch.Tensor | None:
    """The bias our layer adds to the scores before top-k (None when it routes without one)."""
    used = ours.load_balance_coeff is not None or ours.cfg.debug_hot_experts > 0
    return ours.expert_bias if used else None


def build_megatron_moe(ours, dispatcher: str = "allgather", grouped: bool | None = None) -> MegatronMoE:
    """Megatron's MoE layer with ``ours``' router gate, experts and routing bias copied in, on
    ``ours``' device and dtype. ``grouped``: GroupedMLP (default: when ``expert_path`` says so) or
    SequentialMLP. Call ``init_megatron`` first."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    _patch_without_te()
    w1, w2, w3 = (w.detach() for w in ours.experts.local_weights())  # [E, H, D], [E, D, H], [E, H, D]
    E, H, D = w1.shape
    if ours.shared_experts is not None or ours.router.gate.bias is not None or ours.ep_size != 1:
        raise ValueError("Megatron comparison needs no shared experts, no gate bias and EP = 1")
    r = ours.router
    if r.score_func != "softmax" or r.route_norm or r.route_scale != 1.0 or r.num_expert_groups is not None:
        raise ValueError("Megatron comparison needs softmax scores, no renorm, scale 1, no group limit")
    device, dtype = w1.device, w1.dtype
    if grouped is None:
        grouped = expert_path(device) == "grouped_gemm"
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=D,
        num_attention_heads=1,
        ffn_hidden_size=H,
        num_moe_experts=E,
        moe_ffn_hidden_size=H,
        moe_router_topk=r.top_k,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=True,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=grouped,
        moe_use_legacy_grouped_gemm=grouped,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=cuda,  # Megatron's fused weighted SwiGLU (SequentialMLP), as its trainer defaults
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        perform_initialization=False,
        use_cpu_initialization=not cuda,
    )
    spec = get_moe_module_spec(
        use_te=False, num_experts=E, moe_grouped_gemm=grouped, moe_use_legacy_grouped_gemm=grouped
    )
    spec.submodules.router = _router_class()
    moe = build_module(spec, config=cfg).to(device)

    with torch.no_grad():
        moe.router.weight.copy_(r.gate.weight)
        fc1_E2HD = torch.cat([w1, w3], dim=1)  # [E, 2H, D]: gate rows, then up rows
        if grouped:
            moe.experts.weight1.view(E, D, 2 * H).copy_(fc1_E2HD.transpose(1, 2))
            moe.experts.weight2.view(E, H, D).copy_(w2.transpose(1, 2))
        else:
            for e, mlp in enumerate(moe.experts.local_experts):
                mlp.linear_fc1.weight.copy_(fc1_E2HD[e])
                mlp.linear_fc2.weight.copy_(w2[e])
        moe.router.use_bias(_routing_bias(ours))
    return MegatronMoE(moe, "grouped_gemm" if grouped else "sequential")


@torch.no_grad()
def compare(ours, mega: MegatronMoE, x_BSD: torch.Tensor) -> tuple[float, float]:
    """(fraction of tokens whose expert sets agree, relative L2 difference of the two layers'
    outputs on those tokens). Both routers score in fp32; near-ties may still differ."""
    D = x_BSD.shape[-1]
    x_TD = x_BSD.reshape(-1, D)
    ids_TK = ours.router(x_TD, _routing_bias(ours)).topk_ids_TK
    ours_TE = torch.zeros(x_TD.shape[0], ours.num_experts, dtype=torch.bool, device=x_TD.device)
    ours_TE.scatter_(1, ids_TK, True)
    same_T = (ours_TE == mega.routing_map(x_TD)).all(-1)
    a = ours(x_BSD).reshape(-1, D)[same_T].float()
    b = mega(x_BSD).reshape(-1, D)[same_T].float()
    return float(same_T.float().mean()), float((a - b).norm() / b.norm())


if __name__ == "__main__":  # smoke check on whatever device is present
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from torchtitan.models.moe import MoEArgs

    from components.moe_echo.config import MoEEchoConfig
    from components.moe_echo.layer import MoELayer

    reason = unavailable()
    if reason:
        sys.exit(reason)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    init_megatron(dev)
    torch.manual_seed(0)
    args = MoEArgs(num_experts=8, num_shared_experts=0, top_k=2, score_func="softmax", route_norm=False,
                   score_before_experts=False)
    ours = MoELayer(args, 64, 32, MoEEchoConfig()).to(dev)
    ours.init_weights(0.02, torch.device(dev))
    if dev == "cuda":
        ours.to(torch.bfloat16)
        ours.expert_bias.data = ours.expert_bias.float()
    mega = build_megatron_moe(ours)
    x = torch.randn(2, 128, 64, device=dev, dtype=ours.experts.w1.dtype)
    print(f"megatron path {mega.path}: routing_agree, out_rel_diff = {compare(ours, mega, x)}")
