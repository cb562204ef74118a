"""The MoE layer: router + dispatcher + grouped experts (+ shared experts).

    x_BSD ─► x_TD ─router─► ids_TK, w_TK, counts_E
          [ECHO, EP>1] ─plan + rewrite─► ids in the (home experts + echo slots) id space
          ─dispatch─► x_ND, counts_e ─experts (+ clone weights)─► y_ND ─combine─► routed_TD
          y_TD = routed_TD + shared_experts(x_TD)   (shared experts on a side stream, see below)

With ``overlap_chunks`` > 1 at EP > 1 the tokens go through dispatch -> experts -> combine in chunks, communication
of one chunk beside the experts of another (components/moe_echo/pipelined.py).

With ``gathered_experts`` (local or nvlink dispatcher) the experts read token rows by index and apply the
combine themselves (components/moe_echo/gathered_experts.py): no expert-major copy of the tokens.

Runs as-is at EP=1 (``local`` dispatcher); ``components.parallel.parallelize`` switches it to
expert parallelism (an EP dispatcher, sharded experts, optional ``Echo``). Fixed-capacity
dispatchers report dropped assignments in ``overflow_count`` (the training loop gates and replays).

A drop-in for torchtitan 0.2.2's ``MoE``: same constructor inputs (MoEArgs, dim, hidden_dim), same
forward signature, same parameter and buffer names (``router.gate``, ``experts.w1/w2/w3``,
``shared_experts.w1/w2/w3``, ``expert_bias``, ``tokens_per_expert``), same ``init_weights``.
torchtitan's optimizer hook for aux-loss-free balancing therefore works on it unchanged.

With ``shared_experts_stream`` on (default at EP > 1 on CUDA) the shared experts run on one side stream
per device, forked from the current stream after x_TD is ready and joined before the sum; autograd
runs their backward on the same side stream. Tensors crossing streams are ``record_stream``-ed, so
the caching allocator does not hand their memory to the other stream early; the fork and join are
stream waits, so a CUDA graph captures them.

Routing weights are applied after the experts, in fp32 at combine (``score_before_experts`` must
be False, as in every DeepSeek and Qwen3 flavour). The sequence-level auxiliary loss is added to
the training loss through the backward pass (``_AddAuxLossGrad``), so no loss function changes.
"""


import torch
import torch.utils.checkpoint
from torch import nn
from torchtitan.models.moe import MoEArgs

from components.debug import DEBUG_CHECKS, setup_work
from components.streams import side_stream

from .config import MoEEchoConfig
from .dispatcher import Dispatcher, LocalDispatcher
from .echo import EchoClones, echo_stats
from .experts import GroupedExperts, SwiGLU
from .gathered_experts import gathered_rows
from .pipelined import check_overlap, chunks_for, pipelined_routed
from .router import TopKRouter, sequence_aux_loss, updated_expert_bias


class _AddAuxLossGrad(torch.autograd.Function):
    """Identity on ``y``; in backward, gives ``aux_loss`` a gradient of 1 (adds it to the loss)."""

    @staticmethod
    def forward(ctx, y, aux_loss):
        ctx.aux_shape = aux_loss.shape
        ctx.aux_dtype = aux_loss.dtype
        return y

    @staticmethod
    def backward(ctx, grad_y):
        return grad_y, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad_y.device)


def _check_dispatch(moe, ids_TK, counts_e, rows):
    """MOE_ECHO_CHECK=1: after each eager dispatch, read the routing back on the host and raise on a
    broken invariant (ids in range, 0 <= counts, sum <= rows); skipped while a CUDA graph captures."""
    if ids_TK.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    with setup_work():
        ids, counts = ids_TK.cpu(), counts_e.cpu()
    moe._check_calls = getattr(moe, "_check_calls", 0) + 1
    X = getattr(moe.dispatcher, "num_experts", moe.num_experts)
    where = f"MOE_ECHO_CHECK call {moe._check_calls} ({type(moe.dispatcher).__name__}, ids < {X}, {rows} rows)"
    if int(ids.min()) < 0 or int(ids.max()) >= X:
        raise RuntimeError(f"{where}: routed ids out of range [{int(ids.min())}, {int(ids.max())}]")
    if int(counts.min()) < 0 or int(counts.sum()) > rows:
        raise RuntimeError(f"{where}: bad counts_e {counts.tolist()}")


class MoELayer(nn.Module):
    def __init__(self, moe_args: MoEArgs, dim: int, hidden_dim: int, cfg: MoEEchoConfig | None = None):
        super().__init__()
        cfg = cfg or MoEEchoConfig()
        if moe_args.score_before_experts:
            raise ValueError(
                "MoEArgs.score_before_experts=True is not supported: moe-echo applies routing "
                "weights at combine in fp32; set score_before_experts=False"
            )
        E = moe_args.num_experts
        self.cfg = cfg
        self.router = TopKRouter(
            dim,
            E,
            moe_args.top_k,
            moe_args.score_func,
            moe_args.route_norm,
            moe_args.route_scale,
            moe_args.num_expert_groups,
            moe_args.num_limited_groups,
            moe_args.gate_bias,
        )
        self.experts = GroupedExperts(dim, hidden_dim, E, cfg.expert_precision, cfg.experts_gemm,
                                      cfg.expert_fp8_scaling, cfg.wgrad_precision())
        self.shared_experts = (
            SwiGLU(dim, hidden_dim * moe_args.num_shared_experts) if moe_args.num_shared_experts > 0 else None
        )
        # every expert on this rank until parallelize() applies expert parallelism (and cfg's backend)
        self.dispatcher: Dispatcher = LocalDispatcher(E, fp8_rows=cfg.expert_precision == "fp8")
        check_overlap(cfg, self.dispatcher)

        # torchtitan-compatible balancing state. ``load_balance_coeff`` doubles as the bias rate.
        self.load_balance_coeff = cfg.bias_update_rate if cfg.bias_update_rate > 0 else None
        self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(E, dtype=torch.float32), persistent=False)
        # (token, expert) assignments a fixed-capacity dispatcher could not send (never silent)
        self.register_buffer("overflow_count", torch.zeros((), dtype=torch.int64), persistent=False)
        # capacity_factor this step's dispatch needed (fixed-capacity backends; the gate grows to it)
        self.register_buffer("capacity_need", torch.zeros(()), persistent=False)
        self.register_buffer("echo_stats", torch.zeros(4), persistent=False)  # see echo.echo_stats
        # token rows this step's dispatches sent to other hosts (across-host dispatchers; 0 elsewhere)
        self.register_buffer("network_rows", torch.zeros((), dtype=torch.int64), persistent=False)
        self.ep_size = 1
        self.chunks = 1  # token chunks of the last forward (overlap_chunks; > 1: pipelined)
        self.echo = None  # components.moe_echo.echo.Echo, set by parallelize() when [moe_echo] echo
        self.last_aux_loss: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.experts.num_experts

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        use_bias = self.load_balance_coeff is not None or self.cfg.debug_hot_experts > 0
        bias_E = self.expert_bias if use_bias else None
        chunks = self.chunks = chunks_for(self.cfg, self.dispatcher, x_TD.shape[0], self.echo is not None)
        ends = self._shared_at_ends(x_TD, chunks)
        side = None if ends else self._shared_stream(x_TD)
        if side is not None:  # fork: the shared experts run beside everything up to the sum below
            side.wait_stream(torch.cuda.current_stream(x_TD.device))
            with torch.cuda.stream(side):
                shared_TD = self.shared_experts(x_TD)
            x_TD.record_stream(side)
        r = self.router(x_TD, bias_E)
        with torch.no_grad():
            self.tokens_per_expert.add_(r.counts_E)

        ids_TK, plan = r.topk_ids_TK, None
        if self.echo is not None:
            with torch.no_grad():
                ids_TK, plan = self.echo.route(ids_TK, r.counts_E, chunks)
                self.echo_stats.copy_(echo_stats(plan))
        if self.cfg.gathered_experts:
            y_TD = self._gathered(x_TD, ids_TK, r.topk_w_TK, plan)
        elif chunks > 1:
            y_TD = self._pipelined(x_TD, ids_TK, r.topk_w_TK, chunks, plan, shared_at_ends=ends)
        else:
            y_TD = self._dispatched(x_TD, ids_TK, r.topk_w_TK, plan)
        if side is not None:  # join
            torch.cuda.current_stream(x_TD.device).wait_stream(side)
            shared_TD.record_stream(torch.cuda.current_stream(x_TD.device))
            y_TD = y_TD + shared_TD
        elif self.shared_experts is not None and not ends:
            y_TD = y_TD + self.shared_experts(x_TD)

        if self.cfg.aux_loss_coeff > 0 and self.training and torch.is_grad_enabled():
            aux = sequence_aux_loss(
                r.scores_TE.view(B, S, -1), r.topk_ids_TK.view(B, S, -1), self.cfg.aux_loss_coeff
            )
            self.last_aux_loss = aux.detach()
            y_TD = _AddAuxLossGrad.apply(y_TD, aux)
        return y_TD.view(B, S, D)

    def _count_overflow(self, handle) -> None:
        """A fixed-capacity dispatch's dropped assignments and needed capacity, on the device."""
        with torch.no_grad():
            if handle.dropped is not None:
                self.overflow_count.add_(handle.dropped)
            if handle.needed_factor is not None:
                self.capacity_need.copy_(torch.maximum(self.capacity_need, handle.needed_factor))
            if handle.network_rows is not None:
                self.network_rows.add_(handle.network_rows)

    def _experts(self, *args, extend=None, apply=None, fp8_rows=None):
        """The experts' forward, recomputed in backward where ECHO asks (``echo_recompute``)."""
        if extend is not None and self.cfg.echo_recompute and torch.is_grad_enabled():
            # the recomputed forward finds x's FP8 rows taken and quantises them again, the same way
            return torch.utils.checkpoint.checkpoint(self.experts, *args, extend, apply, fp8_rows,
                                                     use_reentrant=False)
        return self.experts(*args, extend, apply, fp8_rows=fp8_rows)

    def _dispatched(self, x_TD, ids_TK, w_TK, plan) -> torch.Tensor:
        """dispatch -> experts (+ ECHO's clone weights) -> combine: the routed experts' y_TD."""
        x_ND, counts_e, handle = self.dispatcher.dispatch(x_TD, ids_TK, w_TK)
        if DEBUG_CHECKS:
            _check_dispatch(self, ids_TK, counts_e, x_ND.shape[0])
        self._count_overflow(handle)
        y_ND = self._experts(x_ND, counts_e, extend=self._extend(plan), fp8_rows=handle.fp8_rows)
        return self.dispatcher.combine(y_ND, handle)

    def _pipelined(self, x_TD, ids_TK, w_TK, chunks: int, plan, shared_at_ends: bool) -> torch.Tensor:
        """The routed experts over token chunks (pipelined.py); with ``shared_at_ends`` plus the shared experts,
        run on the current stream on the first half of the tokens while chunk 0 is dispatched and on the second
        half while the last chunk is combined (returns routed + shared)."""
        shared, beside = [], None
        if shared_at_ends:
            beside = tuple((lambda x=x: shared.append(self.shared_experts(x))) for x in x_TD.chunk(2))
        y_TD = pipelined_routed(self.dispatcher, lambda x, c, ext, rows: self._experts(x, c, extend=ext, fp8_rows=rows),
                                self._count_overflow, x_TD, ids_TK, w_TK, chunks, self._extend(plan), beside)
        return y_TD + torch.cat(shared) if shared else y_TD

    def _extend(self, plan):
        return None if plan is None else EchoClones(self.echo, plan)

    def _gathered(self, x_TD, ids_TK, w_TK, plan) -> torch.Tensor:
        """The experts read token rows themselves and apply the combine (``gathered_experts``; ECHO's clones
        included at EP > 1)."""
        run, handle = gathered_rows(self.dispatcher, x_TD, ids_TK, w_TK)
        if handle is not None:
            self._count_overflow(handle)
        return self._experts(None, None, extend=self._extend(plan), apply=run).to(x_TD.dtype)

    def enable_compute_copies(self) -> None:
        """The experts' optimizer-written compute copies (``GroupedExperts.enable_compute_copies``), with ECHO's
        slot rows after them where ECHO is on (its clones are written there: no concatenation per step)."""
        self.experts.enable_compute_copies(spare_rows=self.echo.S if self.echo is not None else 0)

    def enable_fp8_copies(self) -> None:
        """FP8 experts' optimizer-written FP8 weight copies (``GroupedExperts.enable_fp8_copies``), with ECHO's
        slot rows after them where ECHO is on (its clones are copied there from the home experts' copies). Nothing
        with bf16 experts or with gathered experts."""
        if self.experts.precision == "fp8" and not self.cfg.gathered_experts:
            self.experts.enable_fp8_copies(slots=self.echo.S if self.echo is not None else 0)

    def _shared_at_ends(self, x_TD: torch.Tensor, chunks: int) -> bool:
        """True where the shared experts fill the ends of a pipelined layer (``shared_experts_stream = "ends"``)."""
        return (self.shared_experts is not None and chunks > 1 and x_TD.shape[0] > 1
                and self.cfg.shared_experts_stream == "ends")

    def _shared_stream(self, x_TD: torch.Tensor) -> torch.cuda.Stream | None:
        """The side stream for the shared experts, or None where they run on the current stream."""
        mode = self.cfg.shared_experts_stream
        if self.shared_experts is None or not x_TD.is_cuda or mode == "off":
            return None
        if mode == "auto" and not self.dispatcher.communicates:
            return None
        return side_stream(x_TD.device, "shared_experts")

    @torch.no_grad()
    def update_expert_bias(self, counts_E: torch.Tensor | None = None, skip: torch.Tensor | None = None) -> None:
        """Apply one aux-loss-free balancing step from ``counts_E`` (default: the accumulated
        ``tokens_per_expert``, which the caller all-reduces over data-parallel ranks first); ``skip``
        (device flag) keeps the bias unchanged for a gated step."""
        if self.load_balance_coeff is None:
            return
        counts_E = self.tokens_per_expert if counts_E is None else counts_E
        new_E = updated_expert_bias(self.expert_bias, counts_E, self.load_balance_coeff)
        if skip is not None:  # gated step (device flag): keep the bias
            new_E = torch.where(skip > 0, self.expert_bias, new_E)
        self.expert_bias.copy_(new_E)

    @torch.no_grad()
    def reset_step_stats(self) -> None:
        """Zero the per-step counters (expert load, overflow, capacity need) in place, so a
        captured graph keeps pointing at them."""
        self.tokens_per_expert.zero_()
        self.overflow_count.zero_()
        self.capacity_need.zero_()
        self.network_rows.zero_()

    def init_weights(self, init_std: float, buffer_device: torch.device | None = None) -> None:
        self.experts.init_weights(init_std)
        self.router.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
        buffer_device = buffer_device or self.experts.w1.device
        with torch.device(buffer_device):
            self.expert_bias = torch.zeros(self.num_experts, dtype=torch.float32)
            self.tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.float32)
            self.overflow_count = torch.zeros((), dtype=torch.int64)
            self.capacity_need = torch.zeros(())
            self.network_rows = torch.zeros((), dtype=torch.int64)
            if self.cfg.debug_hot_experts:  # benchmarking aid: a few strongly preferred experts
                self.expert_bias[: self.cfg.debug_hot_experts] = 1.0
