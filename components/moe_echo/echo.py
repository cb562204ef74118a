"""ECHO for one MoE layer at EP > 1: gather counts, plan, rewrite routing, multicast clone weights.

Per step, on every rank of the EP group (R ranks, e = E / R home experts, S echo slots each):

    counts_E ─all_gather─► counts_RE ─plan_echo─► plan (identical on all ranks)
    ids_TK ─rewrite─► virtual ids ─rank_local_ids─► ids in the dispatcher's R·(e+S) id space
    weights: W_local [e+S] = home experts [e] ++ clones [S]; clone s of this rank receives its home
    expert's current weights (``multicast``), and in backward the clone's weight gradient flows
    back into the home expert's gradient (autograd through the same all_to_all).

Multicast, two ways (both static-shape, no host read):
- NCCL/gloo (``padded``/``alltoall`` dispatchers): every (home, destination) pair exchanges a block
  of S expert weights (zeros where the destination's slot s clones none of the home's experts), i.e.
  R·S expert blocks leave each rank per weight tensor, of which only the clones' are non-zero;
- over peer memory (``nvlink`` dispatcher, ``nvlink_dispatch.nvlink_multicast``): each home rank
  writes exactly its cloned experts into the clone ranks' slot buffers, and in backward pulls the
  clones' gradients from them.
"""

import torch
import torch.distributed as dist

from .comm import all_to_all
from .planner import EchoPlan, plan_echo, rank_local_ids, rewrite


class Echo:
    def __init__(self, num_experts: int, group, ep_size: int, ep_rank: int, slots_per_rank: int, rule: str,
                 nvlink=None):
        """``nvlink``: the layer's NVLinkDispatcher — clone weights then move over its peer memory."""
        self.E, self.group, self.R, self.rank, self.S, self.rule = num_experts, group, ep_size, ep_rank, slots_per_rank, rule
        self.e = num_experts // ep_size
        self.nvlink = nvlink
        # the last route()'s plan (and last_load, its echo_load_columns): the recipe logs last_load and
        # last_plan.slot_expert_G every step for the expert-load heatmaps
        self.last_plan: EchoPlan | None = None

    def gather_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        if self.nvlink is not None:  # over peer memory: one write per peer and a device barrier
            from .nvlink_dispatch import all_gather_rows

            return all_gather_rows(self.nvlink.ws, f"{self.nvlink.name}/echo_counts", counts_E)
        parts = [torch.empty_like(counts_E) for _ in range(self.R)]
        dist.all_gather(parts, counts_E.contiguous(), group=self.group)
        return torch.stack(parts)

    def route(self, ids_TK: torch.Tensor, counts_E: torch.Tensor) -> tuple[torch.Tensor, EchoPlan]:
        """ids in the dispatcher's id space (dest·(e+S) + local) and the step's plan."""
        counts_RE = self.gather_counts(counts_E)
        plan = plan_echo(counts_RE, self.S, self.rule)
        self.last_plan = plan
        self.last_load = echo_load_columns(plan, counts_RE.sum(0))
        virtual = rewrite(ids_TK, plan, self.rank, self.E)
        return rank_local_ids(virtual, self.E, self.R, self.S), plan

    def multicast(self, w_eX: torch.Tensor, plan: EchoPlan, index: int = 0) -> torch.Tensor:
        """Clone weights [S, ...] for this rank's slots from their home experts (differentiable);
        ``index`` tells the layer's weights (w1, w2, w3) apart."""
        x_G = plan.slot_expert_G
        if self.nvlink is not None:
            from .nvlink_dispatch import nvlink_multicast

            d = self.nvlink
            return nvlink_multicast(w_eX, x_G, d.ws, f"{d.name}/w{index}", self.rank, self.S, d.programs)
        flat = w_eX.reshape(self.e, -1)
        mine_G = (x_G >= 0) & (x_G // self.e == self.rank)  # slots (anywhere) that clone my experts
        send = flat.index_select(0, (x_G % self.e).clamp(min=0)) * mine_G.unsqueeze(1).to(flat.dtype)
        recv = all_to_all(send, None, None, self.group)  # row h·S + s: home h's weights for my slot s
        my_x = x_G[self.rank * self.S:(self.rank + 1) * self.S]
        used = (my_x >= 0).unsqueeze(1).to(flat.dtype)
        rows = (my_x.clamp(min=0) // self.e) * self.S + torch.arange(self.S, device=x_G.device)
        return (recv.index_select(0, rows) * used).view(self.S, *w_eX.shape[1:])

    def local_weights(self, w_eX: torch.Tensor, plan: EchoPlan, index: int = 0) -> torch.Tensor:
        """[e + S, ...]: home experts then this rank's clones."""
        return torch.cat([w_eX, self.multicast(w_eX, plan, index).to(w_eX.dtype)])


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
