"""ECHO for one MoE layer at EP > 1: gather counts, plan, rewrite routing, multicast clone weights.

Per step, on every rank of the EP group (R ranks, e = E / R home experts, S echo slots each):

    counts_E ─all_gather─► counts_RE ─plan_echo─► plan (identical on all ranks)
    ids_TK ─rewrite─► virtual ids ─rank_local_ids─► ids in the dispatcher's R·(e+S) id space
    weights: W_local [e+S] = home experts [e] ++ clones [S]; clone s of this rank receives its home
    expert's current weights (``extend_with_clones``), and in backward the clone's weight gradient is
    added into its home expert's rows of W_local's gradient.

Counts and clone weights move through a transport (``echo_transport.py``): the group's collectives,
or the ``nvlink`` dispatcher's peer memory.
"""

import torch

from .echo_transport import clone_fp8_weights_, extend_with_clones, slot_gradients
from .planner import EchoPlan, plan_echo, rank_local_ids, rewrite


class Echo:
    def __init__(self, num_experts: int, ep_size: int, ep_rank: int, slots_per_rank: int, rule: str, transport,
                 ranks_per_host: int | None = None):
        """``transport``: an ``echo_transport`` object (collectives, the nvlink dispatcher's peer memory, or host by
        host across hosts). ``ranks_per_host``: where the EP ranks span hosts, the ranks of one host (the planner
        then feeds each clone from its own host's tokens first)."""
        self.E, self.R, self.rank, self.S, self.rule = num_experts, ep_size, ep_rank, slots_per_rank, rule
        self.ranks_per_host = ranks_per_host
        self.e = num_experts // ep_size
        self.transport = transport
        # the last route()'s plan (and last_load, its echo_load_columns): the recipe logs last_load and
        # last_plan.slot_expert_G every step for the expert-load heatmaps
        self.last_plan: EchoPlan | None = None

    def route(self, ids_TK: torch.Tensor, counts_E: torch.Tensor, chunks: int = 1) -> tuple[torch.Tensor, EchoPlan]:
        """ids in the dispatcher's id space (dest·(e+S) + local) and the step's plan; ``chunks``: the token chunks
        the layer is pipelined in (each moves its share of the plan's quotas)."""
        with torch.profiler.record_function("echo_route"):  # benchmarks/step_breakdown.py's "echo"
            counts_RE = self.transport.all_gather(counts_E)
            plan = plan_echo(counts_RE, self.S, self.rule, ranks_per_host=self.ranks_per_host)
            self.last_plan = plan
            self.last_load = echo_load_columns(plan, counts_RE.sum(0))
            virtual = rewrite(ids_TK, plan, self.rank, self.E, chunks)
            return rank_local_ids(virtual, self.E, self.R, self.S), plan

    def local_weights(self, w_eX: torch.Tensor, plan: EchoPlan, index: int = 0, out=None) -> torch.Tensor:
        """[e + S, ...]: home experts then this rank's clones (their gradients reach the home experts); ``out``:
        a buffer whose rows [:e] are w_eX itself (the clones are written into its last S rows)."""
        return extend_with_clones(w_eX, plan.slot_expert_G, self.transport, index, out)


class EchoClones:
    """One step's clones, as the experts ask for them (``GroupedExperts.forward``'s ``extend``):

        clones(w, i, out=None)   [e + S, ...]: weight i with its clones appended (``Echo.local_weights``)
        clones.slot_gradients(w, i)   [e + S, ...] whose values are unset: its gradient reaches w as the above's
        clones.fp8_weights(copies)    the FP8 copies' ``Fp8Weights`` [e + S] with the clones written into the
                                      slots from the home experts' copies (once per step, however many calls)
    With FP8 weight copies the experts read the last and differentiate through the second: the clones move as
    FP8 bytes and no weight is cast or sent."""

    def __init__(self, echo: Echo, plan: EchoPlan):
        self.echo, self.plan = echo, plan
        self._fp8 = None

    def __call__(self, w_eX: torch.Tensor, index: int = 0, out=None) -> torch.Tensor:
        return self.echo.local_weights(w_eX, self.plan, index, out)

    def slot_gradients(self, w_eX: torch.Tensor, index: int = 0) -> torch.Tensor:
        return slot_gradients(w_eX, self.plan.slot_expert_G, self.echo.transport, index)

    def fp8_weights(self, copies):
        if self._fp8 is None:  # the chunks of a pipelined layer, and a recomputed forward, read the same clones
            self._fp8 = clone_fp8_weights_(copies.with_slots, copies.E, self.plan.slot_expert_G, self.echo.transport)
        return self._fp8


def echo_stats(plan: EchoPlan) -> torch.Tensor:
    """[4] fp32: max/mean rank load before and after, active clones, fraction of assignments moved."""
    before, after = plan.load_before_R.float(), plan.load_after_R.float()
    mean = before.mean().clamp_min(1e-9)
    total = before.sum().clamp_min(1.0)
    return torch.stack([before.max() / mean, after.max() / mean, (plan.slot_expert_G >= 0).sum().float(),
                        plan.quota_RG.sum().float() / total])


def echo_load_columns(plan: EchoPlan, counts_RE_total_E: torch.Tensor) -> torch.Tensor:
    """[E + G] fp32: each home expert's load after ECHO, then each echo slot's (clone) load."""
    slot_load_G = plan.quota_RG.sum(0)
    moved_E = torch.zeros_like(counts_RE_total_E).scatter_add_(0, plan.slot_expert_G.clamp(min=0), slot_load_G)
    return torch.cat([counts_RE_total_E - moved_E, slot_load_G]).float()
