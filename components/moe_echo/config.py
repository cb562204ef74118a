"""The ``[moe_echo]`` section of a train config: how our MoE layer runs.

Model hyper-parameters (experts, top-k, score function, groups) come from the torchtitan model
flavour (``MoEArgs``); this section holds what is ours: dispatcher backend, capacity, balancing.
"""

from dataclasses import dataclass
from typing import Literal


@dataclass
class MoEEchoConfig:
    enable: bool = True
    """Swap torchtitan's MoE modules for moe-echo's layer (False keeps torchtitan's own MoE)."""

    dispatcher: Literal["auto", "fastest", "local", "alltoall", "padded", "nvlink", "hierarchical", "deepep"] = "auto"
    """Token dispatcher backend. ``local``: all experts on this rank (EP=1). ``alltoall``: exact
    variable-size all_to_all, sizes read on the host (the baseline). ``padded``: fixed rows per
    peer over NCCL/gloo, no host read (sync-free). ``nvlink``: Triton kernels write tokens straight
    into the peers' symmetric-memory receive buffers (sync-free, CUDA GPUs of one host).
    ``hierarchical``: EP across hosts (sync-free): each token crosses the network once per destination
    host, to the rank with the same local index there, which fans it out to its host's experts; partial
    sums come back one row per (token, host). ``deepep``: DeepEP's intranode kernels (needs ``deep_ep``
    installed). ``auto``: local at EP=1, hierarchical where the EP ranks span hosts, nvlink at EP>1 on
    the CUDA GPUs of one host, padded elsewhere. ``fastest``: time the EP backends once for this
    run's shape on this machine and use the fastest (cached)."""

    expert_precision: Literal["bf16", "fp8"] = "bf16"
    """Precision of the routed experts' GEMMs (``fp8`` when ``[model] converters = ["float8"]`` without
    ``emulate`` and this key is not set). ``fp8``: e4m3 GEMMs for the forward and the input
    gradient (power-of-two scales per row for activations, per expert or per output channel for weights:
    ``expert_fp8_scaling``; computed on the device), the weight gradients as ``expert_wgrad_precision`` says
    (FP8 by default); Hopper or newer GPUs. Master weights, router, dispatch and combine stay as they are.
    Without ECHO (and with ``expert`` scales) the optimizer step writes the weights' FP8 copies from the fp32
    masters (2 bytes per expert weight element, resident); otherwise they are cast in every forward and backward.
    Measured on H200: the experts 1.13–1.22× bf16 graphed (docs/performance.md, FP8); 500-step losses within the
    drift of two equivalent bf16 runs."""

    expert_fp8_scaling: Literal["expert", "channel"] = "expert"
    """FP8 experts' weight scales: ``expert``, one per expert (the optimizer step can write the FP8 copies), or
    ``channel``, one per output channel of each GEMM (the weights cast in every forward and backward, each
    layout separately).
    Follows ``[quantize.linear.float8] recipe_name`` unless set: ``tensorwise`` (the default) picks ``expert``,
    ``rowwise`` and ``rowwise_with_gw_hp`` pick ``channel``. Activations are scaled per row either way. Measured
    on H200: the rowwise v2lite_1b step with ``channel`` runs at 0.92× its speed with ``expert``
    (docs/performance.md, FP8)."""

    expert_wgrad_precision: Literal["auto", "bf16", "fp8"] = "auto"
    """The FP8 routed experts' weight-gradient GEMMs. ``fp8``: from the e4m3 rows their other GEMMs read (x, h, dy,
    [da | db]), each copied transposed, expert by expert onto whole 128-row blocks at one power-of-two scale per
    expert, then contracted by one Triton kernel (kernels/fp8_wgrad.py); needs ``expert_precision = "fp8"``.
    ``bf16``: in bf16 on the bf16 operands. ``auto`` (the default): ``expert_precision``'s. Measured on H200,
    compiled and graphed: 1.035× the FP8 step at EP=2 (v2lite_6b_2gpu), 1.004-1.023× on one GPU (v2lite_1b), the
    loss within bf16's drift over 500 steps (docs/performance.md, FP8)."""

    dense_ffn_kernels: Literal["torchao", "experts"] = "torchao"
    """With ``[model] converters = ["float8"]``: how the dense SwiGLU feed-forwards (the MoE layers' shared experts
    and the dense layers' feed-forward) run in FP8. ``torchao``: their three linear layers as torchao's
    Float8Linear, scaled by ``recipe_name``. ``experts``: through the routed experts' FP8 kernels as one expert that
    every token reaches (components/moe_echo/fp8_experts.py ``fp8_dense_swiglu``): one power-of-two scale per
    token row and per weight, the SwiGLU writing its FP8 rows, FP8 weight gradients, cuBLAS's FP8 GEMMs, outside
    torch.compile. Measured on H200, compiled and graphed, the output head converted: 1.028× the FP8 step on one GPU
    (v2lite_1b), 1.009× at EP=2 (v2lite_6b_2gpu); the loss within bf16's drift over two seeds, 0.9%
    below bf16 at both (docs/performance.md, FP8)."""

    dense_linear_kernels: Literal["torchao", "experts"] = "torchao"
    """With ``[model] converters = ["float8"]``: how the other dense linear layers float8 converts (the attention
    projections; not the feed-forwards, ``dense_ffn_kernels``, nor the output head) run in FP8. ``torchao``:
    torchao's Float8Linear, scaled by ``recipe_name``. ``experts``: ``Fp8RowsLinear``
    (components/train/fp8_linear.py), the routed experts' FP8 recipe with one expert: one power-of-two scale per
    token row and per weight, FP8 weight gradients, cuBLAS's FP8 GEMMs, each pass one custom op inside the
    compiled attention. Measured on H200, compiled and graphed, with the feed-forwards' key and a converted head:
    1.007× the FP8 step on one GPU (v2lite_1b); with both keys the step runs 1.24× bf16 there and 1.30–1.31× at
    EP=2 (v2lite_6b_2gpu), the loss within bf16's drift at EP=2 and over four seeds on v2lite_1b (one seed outside
    its own floor; docs/performance.md, FP8)."""

    dispatch_precision: Literal["bf16", "fp8"] = "bf16"
    """How token rows cross GPUs (and hosts) toward the experts. ``fp8``: in e4m3 with a power-of-two fp32 scale
    per 128 columns (D + D/32 bytes a row instead of 2·D; ``nvlink`` pads rows to 64 bytes), read back in bf16
    on arrival: the tokens on dispatch and, in backward, the output gradients sent to the experts; the combined
    outputs and the gradients back to the tokens stay bf16. ``nvlink``, ``padded``, ``hierarchical`` and
    ``alltoall``."""

    experts_gemm: Literal["torch", "quack"] = "torch"
    """Kernels of the routed experts' bf16 GEMMs. ``torch``: ``torch._grouped_mm`` and fused SwiGLU
    kernels. ``quack``: QuACK's CuTe-DSL grouped GEMMs with SwiGLU and its backward in the GEMM
    epilogues (``pip install "moe-echo[quack]"``; Hopper GPUs; components/moe_echo/quack_experts.py)."""

    gathered_experts: bool = False
    """The routed experts read token rows through their GEMMs (row indices in the prologue) and take the
    combine weights into their backward's epilogue: no expert-major copy of the tokens (at EP > 1 the
    ``nvlink`` dispatcher's K-fold expansion of the received tokens is gone), and the experts' outputs are
    not kept for backward (components/moe_echo/gathered_experts.py). The ``local`` dispatcher (one EP rank)
    or ``nvlink``; bf16 experts; ECHO works; on CUDA with ``experts_gemm = "quack"`` (Hopper). Experimental:
    ``benchmarks/gather_gemm.py`` measures it against the expanded rows."""

    on_overflow: Literal["replay", "stop"] = "replay"
    """When a fixed-capacity (padded) buffer overflowed: ``replay`` — the step is gated on the device
    and replayed on the exact path (never drops a token; no host read before the optimizer step);
    ``stop`` — end the run with a message naming capacity_factor."""

    grow_capacity_after: int = 3
    """With on_overflow = "replay": every this many replays, raise capacity_factor to what the
    overflowed steps needed + 10% (at least +25%) (0: never)."""

    capacity_factor: float = 1.25
    """Fixed-capacity backends. padded: rows per (source, destination) block =
    round_up(ceil(capacity_factor · T · K / EP), 8); nvlink: expert rows per rank =
    round_up(ceil(capacity_factor · T · K), 128) (T = tokens per rank, K = top-k; its token buffer,
    EP · T rows, cannot overflow)."""

    nvlink_sms: int = 64
    """nvlink with ``nvlink_copy = "kernel"`` (the default): CTAs (about one per SM) the kernels that cross NVLink
    occupy (token sends, pulls of the combined rows and gradients); the kernels that only touch this GPU's memory
    (expanding tokens into expert rows, per-token sums) use the whole GPU."""

    nvlink_copy: Literal["kernel", "copy_engine"] = "kernel"
    """nvlink: what moves token rows across NVLink. ``kernel``: Triton kernels on ``nvlink_sms`` SMs write each
    token's row into, and read its sums from, only the ranks holding one of its experts. ``copy_engine``: the
    GPU's copy engines, no SM for the copies. Dispatch and combine's backward copy this rank's whole [T, D] block
    of token rows (or their gradients) into every rank (rows of tokens that go nowhere there cross too, and are
    never read); combine pulls each peer's [T, D] block of per-token sums for this rank's tokens into a local
    staging buffer while the SMs sum this rank's own expert outputs, then adds the blocks in one local pass (the
    staging holds EP · T rows of hidden size while a combine runs: 1.9 GB at EP=8, 16384 tokens, hidden 7168, bf16).
    It suits routing where most tokens reach most ranks (uniform routing over 64 experts: at EP=2 and K=6 each rank
    receives ~99% of the tokens, at EP=4 and K=8 ~91%). On 2×H200 (docs/performance.md) the graphed round trip
    is 1.06–1.25× faster with the copy engines at 16384 tokens per rank, but the eager one (before capture, after
    a replay) is up to 1.7× slower at 4096 tokens, and the graphed v2lite_1b step at EP=2 is the same (its clean
    windows 191–209k tokens/s per GPU with either): the kernels stay the default."""

    shared_experts_stream: Literal["auto", "on", "off", "ends"] = "auto"
    """Run the shared experts on a side CUDA stream, concurrent with the router, dispatch, routed
    experts and combine (their backward follows on the same stream). ``auto``: where the dispatcher
    moves tokens between GPUs (EP > 1); ``on``: also at EP=1; ``off``: one stream; ``ends``: in a
    pipelined layer (``overlap_chunks`` > 1) on the current stream, where it would wait for communication: on
    the first half of the tokens while the first chunk is dispatched and on the second half while the last
    chunk is combined (elsewhere as ``auto``). Same results (``ends``: up to the GEMMs' rounding on half the rows)."""

    overlap_chunks: int | Literal["auto"] = "auto"
    """Split each MoE layer's tokens into this many chunks and pipeline them: while the experts compute chunk
    i, chunk i + 1 is dispatched and chunk i − 1 combined on a communication stream (forward and backward;
    components/moe_echo/pipelined.py). Capacities are sized per chunk. 1: one dispatch per layer. ``nvlink``,
    ``padded``, ``hierarchical`` and ``alltoall`` (not ``deepep``); ignored at EP=1. ``auto``: 2 where the EP
    ranks span hosts (``hierarchical``; 1.08× the unsplit step on emulated hosts) and with ``nvlink`` from EP=4
    on where ECHO is on (1.01× at EP=4), else 1 (with ``nvlink`` the split measured 0.985× at EP=2 and 0.99×
    at EP=4 without ECHO, whose rank waits it does not shorten; 0.93–0.97× with ``padded``; 0.97× for the FP8 step
    at EP=2 with ECHO)."""

    aux_loss_coeff: float = 0.0
    """Coefficient of the sequence-level auxiliary balance loss (0 disables it)."""

    bias_update_rate: float = 1e-3
    """Aux-loss-free balancing: expert_bias += rate * sign(mean - count) after each step (0 disables)."""

    echo: bool | Literal["auto"] = "auto"
    """ECHO: clone hot experts into spare slots on under-loaded EP ranks every step (needs EP > 1). ``auto``: on
    where the dispatcher is ``nvlink`` (set, or picked by ``dispatcher = "auto"``) from EP=4 on, else off. At EP=4
    on one host it levels the ranks (v2lite_1b natural routing: rank load 1.4-1.6 -> 1.0, 1.00-1.04x the step, up to
    6.5 GiB less memory; 8 hot experts: 1.46x); at EP=2 it measured 0.99-1.03x, across emulated hosts 0.89-1.07x."""

    echo_slots_per_rank: int = 2
    """Echo slots per EP rank (each can host one clone of a hot expert per step)."""

    echo_planner: Literal["fill", "greedy", "bestfit"] = "fill"
    """Slot assignment rule: ``fill`` (fill the roomiest rank from the overloaded ranks, overloaded
    ranks may host clones too, searching the target makespan; within 0.1% of the optimum in
    benchmarks/planner.py), or the earlier one-pass rules toward ceil(mean): ``greedy`` (largest
    overflow to the roomiest rank), ``bestfit`` (the fullest rank whose room takes the whole overflow)."""

    echo_recompute: bool = False
    """Recompute the experts in backward (clone-weight multicast, grouped GEMMs, SwiGLU): clone
    weights and expert activations are not kept between forward and backward (one clone buffer
    serves all layers), at the cost of re-running the experts' forward."""

    debug_hot_experts: int = 0
    """Benchmarking aid: start with the router biased so the first N experts (on EP rank 0) are hot.
    Use with bias_update_rate = 0 to keep the skew. 0 = off."""

    load_heatmap_freq: int = 50
    """Write the per-layer expert-load heatmap image to TensorBoard every this many steps (0: never)."""

    def wgrad_precision(self) -> str:
        """The routed experts' weight-gradient precision, ``auto`` resolved: ``expert_precision``'s."""
        return self.expert_precision if self.expert_wgrad_precision == "auto" else self.expert_wgrad_precision
