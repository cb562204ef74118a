"""ECHO planner: clone hot experts into spare slots on under-loaded EP ranks, every step.

Inputs (identical on every rank, gathered on device):
    counts_RE [R, E] int64: assignments source rank r sends to expert x (expert x lives on rank x // e,
                            e = E / R);  S: echo slots per rank.
Outputs (``EchoPlan``; static shapes, no host read, deterministic):
    slot_expert_G [G = R·S]: home expert cloned by global slot g = d·S + s (on rank d), -1 if unused;
    quota_RG [R, G]: how many of source r's assignments to slot_expert_G[g] move to slot g.

Algorithm (greedy overflow vs spare room), all integer:
    load_d = Σ_{x on d} Σ_r counts[r, x];  target = ceil(Σ load / R)
    repeat R·S times (one slot per iteration, a static loop):
        movable_x = min(load left at home of x, load_{home(x)} − target)   (0 unless home overloaded)
        pick x* = argmax movable,  d* = argmax room_d = target − load_d over ranks with a free slot
        (rule "greedy") or the fullest rank whose room still takes all of movable_x* ("bestfit",
        a priority bin-packing variant); move m = min(movable, room) to d*'s next free slot.
    Per slot, the sources' shares: the moved assignments of expert x are laid source by source, each
    source contributing in proportion to its count (cumulative rounding, exact integer sums), and
    the slots of x cut consecutive ranges of that line.
Complexity: O(R·S·(E + R)) element ops in R·S sequential steps (vectorised over E and R); on GPU the
loop is one single-program Triton kernel (kernels/echo_plan.py), here it is the reference.

``rewrite`` then turns each source's routing into "virtual" ids: the first quota assignments (in
token order) of source r to a cloned expert x go to its slots; every token keeps its K targets and
weights. ``fold_back`` maps virtual ids back to home experts (tests: fold_back(rewrite(ids)) == ids).
"""

from dataclasses import dataclass

import torch

from kernels import echo_plan


@dataclass
class EchoPlan:
    slot_expert_G: torch.Tensor  # [R*S] int64, -1 = unused
    quota_RG: torch.Tensor  # [R, R*S] int64
    load_before_R: torch.Tensor  # [R] int64
    load_after_R: torch.Tensor  # [R] int64


def plan_echo(counts_RE: torch.Tensor, slots_per_rank: int, rule: str = "greedy", kernel: bool | None = None) -> EchoPlan:
    """``kernel``: use the single-launch Triton version of the slot loop (default: on CUDA)."""
    R, E = counts_RE.shape
    S, e, dev = slots_per_rank, E // R, counts_RE.device
    counts_RE = counts_RE.long()
    L_E = counts_RE.sum(0)
    home_E = torch.arange(E, device=dev) // e
    load_R = L_E.view(R, e).sum(1)
    load_before = load_R.clone()
    target = (load_R.sum() + R - 1) // R
    if kernel if kernel is not None else echo_plan.can_use_kernel(counts_RE):  # two launches on GPU
        slot_expert, slot_amount, slot_start, load_R = echo_plan.greedy_slots(L_E, load_R, target, S, rule)
        moved_E = torch.zeros_like(L_E).scatter_add_(0, slot_expert.clamp(min=0), slot_amount)
        quota = echo_plan.source_quotas(counts_RE, slot_expert, slot_amount, slot_start, moved_E)
        return EchoPlan(slot_expert, quota, load_before, load_R)
    left_E = L_E.clone()
    free_R = torch.full((R,), S, dtype=torch.int64, device=dev)
    slot_expert = torch.full((R * S,), -1, dtype=torch.int64, device=dev)
    slot_amount = torch.zeros(R * S, dtype=torch.int64, device=dev)
    slot_start = torch.zeros(R * S, dtype=torch.int64, device=dev)
    ar_R = torch.arange(R, device=dev)
    for _ in range(R * S):
        excess_R = (load_R - target).clamp(min=0)
        movable_E = torch.minimum(left_E, excess_R.index_select(0, home_E))
        x = torch.argmax(movable_E)
        mv = movable_E[x]
        room_R = torch.where(free_R > 0, (target - load_R).clamp(min=0), -1)
        if rule == "bestfit":  # smallest room that takes everything, else the largest room
            fits = room_R >= mv
            key = torch.where(fits, 2 * (room_R.max() + 1) - room_R, room_R)
            d = torch.argmax(key)
        else:
            d = torch.argmax(room_R)
        m = torch.minimum(mv, room_R[d]).clamp(min=0)
        take = m > 0
        g = d * S + (S - free_R[d]).clamp(max=S - 1)
        slot_expert[g] = torch.where(take, x, slot_expert[g])
        slot_amount[g] = torch.where(take, m, slot_amount[g])
        slot_start[g] = torch.where(take, L_E[x] - left_E[x], slot_start[g])
        step = m * take
        load_R = load_R - step * (ar_R == home_E[x]) + step * (ar_R == d)
        left_E[x] = left_E[x] - step
        free_R[d] = free_R[d] - take.long()
    moved_E = L_E - left_E
    return EchoPlan(slot_expert, _source_quotas(counts_RE, slot_expert, slot_amount, slot_start, moved_E),
                    load_before, load_R)


def _source_quotas(counts_RE, slot_expert_G, slot_amount_G, slot_start_G, moved_E):
    """quota_RG: source r's share of slot g. The M_x assignments moved off expert x form a line on
    which each source holds a contiguous range proportional to its count (cumulative rounding:
    exact integers, never more than the source has); slot g covers [start_g, start_g + amount_g)
    of that line (start_g = what x had already moved when g was assigned)."""
    x_G = slot_expert_G.clamp(min=0)
    used_G = slot_expert_G >= 0
    c_RG = counts_RE.index_select(1, x_G)
    cum_RG = torch.cumsum(c_RG, 0)
    L_G = cum_RG[-1].clamp(min=1)
    M_G = moved_E.index_select(0, x_G)
    hi = cum_RG * M_G // L_G  # end of source r's range on the line
    lo = (cum_RG - c_RG) * M_G // L_G  # its start
    q = torch.minimum(hi, slot_start_G + slot_amount_G) - torch.maximum(lo, slot_start_G)
    return q.clamp(min=0) * used_G


def rewrite(ids_TK: torch.Tensor, plan: EchoPlan, rank: int, num_experts: int) -> torch.Tensor:
    """Virtual ids for source ``rank``: ids < E are home experts, E + g is echo slot g."""
    T, K = ids_TK.shape
    E, G = num_experts, plan.slot_expert_G.shape[0]
    flat = ids_TK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sorted_ids = flat.index_select(0, order)
    counts_E = torch.zeros(E, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    first_E = torch.cumsum(counts_E, 0) - counts_E
    within_sorted = torch.arange(T * K, device=flat.device) - first_E.index_select(0, sorted_ids)
    # this source's slot ranges per expert, as sorted (expert, end) keys
    q_G = plan.quota_RG[rank]
    x_G = torch.where((plan.slot_expert_G >= 0) & (q_G > 0), plan.slot_expert_G, E)  # unused slots sort last
    key_order = torch.argsort(x_G * G + torch.arange(G, device=flat.device), stable=True)
    xs, qs = x_G.index_select(0, key_order), q_G.index_select(0, key_order)
    expert_start = torch.cumsum(qs, 0) - qs
    first_of_x = torch.zeros(E + 1, dtype=torch.int64, device=flat.device).scatter_reduce_(
        0, xs, expert_start, reduce="amin", include_self=False)
    end_in_x = expert_start + qs - first_of_x.index_select(0, xs)  # exclusive end of each slot's range
    big = T * K + 1
    slot_keys = xs * big + end_in_x
    j = torch.searchsorted(slot_keys, sorted_ids * big + within_sorted, right=True).clamp(max=G - 1)
    hit = (xs.index_select(0, j) == sorted_ids) & (within_sorted < end_in_x.index_select(0, j))
    new_sorted = torch.where(hit, E + key_order.index_select(0, j), sorted_ids)
    return torch.empty_like(flat).scatter_(0, order, new_sorted).view(T, K)


def fold_back(virtual_TK: torch.Tensor, plan: EchoPlan, num_experts: int) -> torch.Tensor:
    """Home expert of every virtual id."""
    slot = (virtual_TK - num_experts).clamp(min=0)
    return torch.where(virtual_TK < num_experts, virtual_TK, plan.slot_expert_G.index_select(0, slot.reshape(-1)).view_as(virtual_TK))


def rank_local_ids(virtual_TK: torch.Tensor, num_experts: int, ep_size: int, slots_per_rank: int) -> torch.Tensor:
    """Virtual ids → dest·(e+S) + local index (home experts first, then the rank's slots): the id
    space the EP dispatchers route with (e + S "experts" per rank)."""
    e, S = num_experts // ep_size, slots_per_rank
    home = virtual_TK < num_experts
    g = (virtual_TK - num_experts).clamp(min=0)
    dest = torch.where(home, virtual_TK // e, g // S)
    local = torch.where(home, virtual_TK % e, e + g % S)
    return dest * (e + S) + local
