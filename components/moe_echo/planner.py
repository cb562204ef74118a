"""ECHO planner: clone hot experts into spare slots on under-loaded EP ranks, every step.

Inputs (identical on every rank, gathered on device):
    counts_RE [R, E] int64: assignments source rank r sends to expert x (expert x lives on rank x // e,
                            e = E / R);  S: echo slots per rank.
Outputs (``EchoPlan``; static shapes, no host read, deterministic):
    slot_expert_G [G = R·S]: home expert cloned by global slot g = d·S + s (on rank d), -1 if unused;
    quota_RG [R, G]: how many of source r's assignments to slot_expert_G[g] move to slot g.

The problem: home experts are fixed, loads are splittable, a clone costs one of its rank's S slots;
minimise the makespan max_d load_d. Rule "fill" (default; all integer):

    fill(T), for a target makespan T, R·S steps (one slot each, a static loop):
        d  = the rank with the most room T − load_d among ranks with a free slot and load_d < T,
             rooms down to their last free slot first
        cap_x = what expert x can move: min(left at home, load_home − T) if its home is overloaded,
             or all it has left at home if that home also still has a free slot (the home then drops
             below T and its own slot takes a piece of another hot expert: chains through
             overloaded ranks); 0 if its home is not above T
        x  = with ≥ 2 free slots on d: the largest cap_x ≤ room_d (it moves whole, a later piece
             tops the room up), else the smallest cap_x ≥ room_d; on d's last slot: the smallest
             cap_x ≥ room_d (fills the room exactly), else the largest cap_x
        move m = min(cap_x, room_d) of x into d's next free slot (nothing once m = 0).
    Search over T: fill runs for B targets at once (batched over B, one program each on GPU):
        round 1: T_b = ceil(mean) + (max − ceil(mean))·b³/(B − 1)³, b < B (dense near the mean);
        round 2: B targets evenly between the largest round-1 target that failed (its makespan > T)
                 and the best makespan found;
        the plan is the candidate with the smallest makespan (first on ties).
    On drifting Zipf loads it reaches the optimum (benchmarks/planner.py); where the optimum lies
    above the mean (hot experts packed on a few ranks) it stays within 0.1% of the mixed-integer
    optimum on the instances of tests/test_planner.py. Rules "greedy" / "bestfit" (the earlier one-pass rules) move
    min(load left at home, home excess over ceil(mean)) of the largest movable expert into the
    roomiest rank / the fullest rank that takes it all, never into an overloaded rank.
Per slot, the sources' shares: the moved assignments of expert x are laid source by source, each
source contributing in proportion to its count (cumulative rounding, exact integer sums), and
the slots of x cut consecutive ranges of that line. Across hosts (``ranks_per_host`` L < R, host =
rank // L) the shares change, the loads do not: each slot first draws from the sources on its own
host (one line per (x, host), as above), then what it still needs from what every source has left
of x (one line per x). A clone thus takes tokens that would otherwise have crossed to the home's host
before any that must cross to it, so it adds network rows only where its host has too few of x's.
Complexity: 2 rounds × R·S sequential steps, each O(B·(E + R)) vectorised element ops. On GPU each
round is one Triton launch of B programs, one target each (kernels/echo_plan.py): as many
sequential steps per round as the one-pass rules at most (a candidate stops at its first step that
moves nothing), and round 2 does none when round 1 reached ceil(mean) (its candidates could not
win); the torch code here is the reference and CPU path.

``rewrite`` then turns each source's routing into "virtual" ids: the first quota assignments (in
token order) of source r to a cloned expert x go to its slots; every token keeps its K targets and
weights. ``fold_back`` maps virtual ids back to home experts (tests: fold_back(rewrite(ids)) == ids).
"""

from dataclasses import dataclass

import torch

from kernels import echo_plan
from kernels.route_layout import slot_ranks

RULES = ("fill", "greedy", "bestfit")
SEARCH_TARGETS = 16  # B: targets tried at once per search round
_NEG = -(1 << 62)  # below any key


@dataclass
class EchoPlan:
    slot_expert_G: torch.Tensor  # [R*S] int64, -1 = unused
    quota_RG: torch.Tensor  # [R, R*S] int64
    load_before_R: torch.Tensor  # [R] int64
    load_after_R: torch.Tensor  # [R] int64


def plan_echo(counts_RE: torch.Tensor, slots_per_rank: int, rule: str = "fill", kernel: bool | None = None,
              ranks_per_host: int | None = None) -> EchoPlan:
    """``kernel``: use the Triton version of the slot loop (default: on CUDA). ``ranks_per_host`` (L, dividing
    R; default R = one host): EP rank r lives on host r // L; below R the source shares prefer each clone's host."""
    if rule not in RULES:
        raise ValueError(f"echo planner rule {rule!r}: expected one of {RULES}")
    R, E = counts_RE.shape
    S, e, dev = slots_per_rank, E // R, counts_RE.device
    counts_RE = counts_RE.long()
    L_E = counts_RE.sum(0)
    load_R = L_E.view(R, e).sum(1)
    load_before = load_R  # never written in place: every path below rebinds load_R
    use_kernel = kernel if kernel is not None else echo_plan.can_use_kernel(counts_RE)
    if ranks_per_host is not None and ranks_per_host < R:
        if R % ranks_per_host:
            raise ValueError(f"echo planner: {R} EP ranks do not split into hosts of {ranks_per_host}")
        plan = plan_echo(counts_RE, S, rule, kernel)
        quota = host_source_quotas(counts_RE, plan.slot_expert_G, plan.quota_RG.sum(0), S, ranks_per_host)
        return EchoPlan(plan.slot_expert_G, quota, plan.load_before_R, plan.load_after_R)
    if rule == "fill":
        if use_kernel:  # four launches on GPU: two search rounds, the selection, the quotas
            slot_expert, slot_amount, slot_start, load_R, moved_E = echo_plan.fill_search(L_E, load_R, S, SEARCH_TARGETS)
            quota = echo_plan.source_quotas(counts_RE, slot_expert, slot_amount, slot_start, moved_E)
            return EchoPlan(slot_expert, quota, load_before, load_R)
        slot_expert, slot_amount, slot_start, load_R = _fill_search(L_E, load_R, S)
        moved_E = torch.zeros_like(L_E).scatter_add_(0, slot_expert.clamp(min=0), slot_amount)
        return EchoPlan(slot_expert, _source_quotas(counts_RE, slot_expert, slot_amount, slot_start, moved_E),
                        load_before, load_R)
    target = (load_R.sum() + R - 1) // R
    if use_kernel:  # two launches on GPU
        slot_expert, slot_amount, slot_start, load_R = echo_plan.greedy_slots(L_E, load_R, target, S, rule)
        moved_E = torch.zeros_like(L_E).scatter_add_(0, slot_expert.clamp(min=0), slot_amount)
        quota = echo_plan.source_quotas(counts_RE, slot_expert, slot_amount, slot_start, moved_E)
        return EchoPlan(slot_expert, quota, load_before, load_R)
    home_E = torch.arange(E, device=dev) // e
    left_E = L_E.clone()
    free_R = torch.full((R,), S, dtype=torch.int64, device=dev)
    slot_expert = torch.full((R * S,), -1, dtype=torch.int64, device=dev)
    slot_amount = torch.zeros(R * S, dtype=torch.int64, device=dev)
    slot_start = torch.zeros(R * S, dtype=torch.int64, device=dev)
    ar_R = torch.arange(R, device=dev)
    for _ in range(R * S):  # indices stay [1] tensors: no host read
        excess_R = (load_R - target).clamp(min=0)
        movable_E = torch.minimum(left_E, excess_R.index_select(0, home_E))
        x = torch.argmax(movable_E, 0, keepdim=True)
        mv = movable_E.gather(0, x)
        room_R = torch.where(free_R > 0, (target - load_R).clamp(min=0), -1)
        if rule == "bestfit":  # smallest room that takes everything, else the largest room
            fits = room_R >= mv
            key = torch.where(fits, 2 * (room_R.max() + 1) - room_R, room_R)
            d = torch.argmax(key, 0, keepdim=True)
        else:
            d = torch.argmax(room_R, 0, keepdim=True)
        m = torch.minimum(mv, room_R.gather(0, d)).clamp(min=0)
        take = m > 0
        g = d * S + (S - free_R.gather(0, d)).clamp(max=S - 1)
        slot_expert.scatter_(0, g, torch.where(take, x, slot_expert.gather(0, g)))
        slot_amount.scatter_(0, g, torch.where(take, m, slot_amount.gather(0, g)))
        slot_start.scatter_(0, g, torch.where(take, L_E.gather(0, x) - left_E.gather(0, x), slot_start.gather(0, g)))
        step = m * take
        load_R = load_R - step * (ar_R == home_E.gather(0, x)) + step * (ar_R == d)
        left_E.scatter_add_(0, x, -step)
        free_R.scatter_add_(0, d, -take.long())
    moved_E = L_E - left_E
    return EchoPlan(slot_expert, _source_quotas(counts_RE, slot_expert, slot_amount, slot_start, moved_E),
                    load_before, load_R)


def search_targets(load_R: torch.Tensor, B: int = SEARCH_TARGETS) -> torch.Tensor:
    """Round-1 targets T_B [B] int64: lo + (max − lo)·b³/(B − 1)³ (in 1/65536), lo = ceil(mean), so
    T_0 = lo, dense near lo, T_{B-1} = max load (nothing to move)."""
    R = load_R.shape[0]
    lo = (load_R.sum() + R - 1) // R
    b_B = torch.arange(B, device=load_R.device)
    return lo + (load_R.max() - lo) * (b_B ** 3 * 65536 // (B - 1) ** 3) // 65536


def refine_targets(T1_B: torch.Tensor, M1_B: torch.Tensor) -> torch.Tensor:
    """Round-2 targets T_B [B]: evenly in (lo2, best], best = the smallest round-1 makespan M, lo2 =
    the largest round-1 target below best that failed (M > T), else ceil(mean) − 1."""
    B = T1_B.shape[0]
    best = M1_B.min()
    lo2 = torch.where((M1_B > T1_B) & (T1_B < best), T1_B, T1_B[0] - 1).max()
    return lo2 + (best - lo2) * torch.arange(1, B + 1, device=T1_B.device) // (B + 1)


def fill_slots(L_E: torch.Tensor, load_R: torch.Tensor, T_B: torch.Tensor, S: int):
    """Rule "fill" for B targets at once (the torch reference of kernels.echo_plan.fill_search).
    Returns slot_expert_BG (-1 unused), slot_amount_BG, slot_start_BG (x's amount moved before the
    slot), load_BR after the moves; Σ_g amount of x ≤ L_x, every rank's slots used in order."""
    B, E, R = T_B.shape[0], L_E.shape[0], load_R.shape[0]
    dev = L_E.device
    home_E = torch.arange(E, device=dev) // (E // R)
    load_BR = load_R.unsqueeze(0).repeat(B, 1)
    left_BE = L_E.unsqueeze(0).repeat(B, 1)
    free_BR = torch.full((B, R), S, dtype=torch.int64, device=dev)
    slot_expert = torch.full((B, R * S), -1, dtype=torch.int64, device=dev)
    slot_amount = torch.zeros(B, R * S, dtype=torch.int64, device=dev)
    slot_start = torch.zeros(B, R * S, dtype=torch.int64, device=dev)
    T_B1 = T_B.unsqueeze(1)
    b_B = torch.arange(B, device=dev)
    for _ in range(R * S):
        excess_BR = load_BR - T_B1
        room_BR = torch.where((free_BR > 0) & (excess_BR < 0), -excess_BR, -1)
        last_BR = (room_BR > 0) & (free_BR == 1)  # rooms down to their last slot go first
        first_B1 = last_BR.any(1, keepdim=True)
        d_B = torch.where(last_BR | ~first_B1, room_BR, -1).argmax(1)
        room_B1 = room_BR.gather(1, d_B.unsqueeze(1))
        free_B1 = free_BR.gather(1, d_B.unsqueeze(1))
        ex_home_BE = excess_BR.index_select(1, home_E)
        cap_BE = torch.where(free_BR.index_select(1, home_E) > 0, left_BE, torch.minimum(left_BE, ex_home_BE))
        cap_BE = torch.where(ex_home_BE > 0, cap_BE, 0)
        whole_BE = torch.where((cap_BE > 0) & (cap_BE <= room_B1), cap_BE, _NEG)  # moves all it can, fits
        top_BE = torch.where((cap_BE > 0) & (cap_BE >= room_B1), -cap_BE, _NEG)  # fills the room
        has_whole_B1 = whole_BE.max(1, keepdim=True).values > _NEG
        has_top_B1 = top_BE.max(1, keepdim=True).values > _NEG
        use_whole_B1 = torch.where(free_B1 >= 2, has_whole_B1, ~has_top_B1)
        x_B = torch.where(use_whole_B1, whole_BE, top_BE).argmax(1)
        m_B = torch.minimum(cap_BE.gather(1, x_B.unsqueeze(1)), room_B1).squeeze(1).clamp(min=0)
        take_B = m_B > 0
        g_B = d_B * S + (S - free_BR[b_B, d_B]).clamp(max=S - 1)
        slot_expert[b_B, g_B] = torch.where(take_B, x_B, slot_expert[b_B, g_B])
        slot_amount[b_B, g_B] = torch.where(take_B, m_B, slot_amount[b_B, g_B])
        slot_start[b_B, g_B] = torch.where(take_B, L_E[x_B] - left_BE[b_B, x_B], slot_start[b_B, g_B])
        load_BR[b_B, home_E[x_B]] -= m_B
        load_BR[b_B, d_B] += m_B
        left_BE[b_B, x_B] -= m_B
        free_BR[b_B, d_B] -= take_B.long()
    return slot_expert, slot_amount, slot_start, load_BR


def _fill_search(L_E, load_R, S, B: int = SEARCH_TARGETS):
    """Rule "fill" over two rounds of B targets: (slot_expert_G, slot_amount_G, slot_start_G,
    load_after_R) of the candidate with the smallest makespan (first on ties)."""
    T1_B = search_targets(load_R, B)
    out1 = fill_slots(L_E, load_R, T1_B, S)
    out2 = fill_slots(L_E, load_R, refine_targets(T1_B, out1[3].max(1).values), S)
    slot_expert, slot_amount, slot_start, load_BR = (torch.cat([a, b]) for a, b in zip(out1, out2))
    i = load_BR.max(1).values.argmin().view(1)  # a tensor index, not a host read
    return tuple(t.index_select(0, i).squeeze(0) for t in (slot_expert, slot_amount, slot_start, load_BR))


def _source_quotas(counts_RE, slot_expert_G, slot_amount_G, slot_start_G, moved_E):
    """quota_RG: source r's share of slot g. The M_x assignments moved off expert x form a line on
    which each source holds a contiguous range proportional to its count (cumulative rounding:
    exact integers, never more than the source has); slot g covers [start_g, start_g + amount_g)
    of that line (start_g = what x had already moved when g was assigned)."""
    x_G = slot_expert_G.clamp(min=0)
    used_G = slot_expert_G >= 0
    c_RG = counts_RE.index_select(1, x_G)
    return _cut_line(c_RG, moved_E.index_select(0, x_G), slot_start_G, slot_amount_G) * used_G


def _cut_line(c_RG, N_G, start_G, amount_G):
    """[R, G]: sources laid on a line of N_G assignments, each a contiguous range in proportion to c_RG
    (cumulative rounding; N_G <= Σ_r c_RG, so no source gives more than its count); slot g takes the
    part of [start_g, start_g + amount_g) each range covers."""
    cum_RG = torch.cumsum(c_RG, 0)
    total_G = cum_RG[-1].clamp(min=1)
    hi = cum_RG * N_G // total_G  # end of source r's range on the line
    lo = (cum_RG - c_RG) * N_G // total_G  # its start
    return (torch.minimum(hi, start_G + amount_G) - torch.maximum(lo, start_G)).clamp(min=0)


def host_source_quotas(counts_RE, slot_expert_G, slot_amount_G, slots_per_rank: int, ranks_per_host: int):
    """quota_RG with each slot's sources on its own host first (module docstring). slot_amount_G: what each
    slot takes (Σ_r quota_RG of any split); the result has the same column sums, and Σ_g quota ≤ counts per
    (source, expert). Static shapes, no host read ([G, G] masks; G = R·S)."""
    R, E = counts_RE.shape
    G, dev = slot_expert_G.shape[0], counts_RE.device
    used_G = slot_expert_G >= 0
    x_G = slot_expert_G.clamp(min=0)
    amount_G = slot_amount_G * used_G
    c_RG = counts_RE.index_select(1, x_G)
    g_G = torch.arange(G, device=dev)
    host_G = g_G // (slots_per_rank * ranks_per_host)
    local_RG = (torch.arange(R, device=dev) // ranks_per_host).unsqueeze(1) == host_G.unsqueeze(0)
    same_x_GG = (x_G.unsqueeze(1) == x_G.unsqueeze(0)) & used_G.unsqueeze(1) & used_G.unsqueeze(0)
    earlier_GG = g_G.unsqueeze(0) < g_G.unsqueeze(1)  # [g, g']: g' comes before g
    same_host_GG = same_x_GG & (host_G.unsqueeze(1) == host_G.unsqueeze(0))
    # pass 1: the slots of x on host h cut one line of host h's sources, as long as the shorter of the two
    c1_RG = c_RG * local_RG
    want_G = (same_host_GG * amount_G).sum(1)
    start1_G = (same_host_GG & earlier_GG).mul(amount_G).sum(1)
    q1_RG = _cut_line(c1_RG, torch.minimum(want_G, c1_RG.sum(0)), start1_G, amount_G)
    # pass 2: what the slots still need, from what each source has left of x (one line per x)
    taken_RE = torch.zeros(R, E, dtype=q1_RG.dtype, device=dev).index_add_(1, x_G, q1_RG * used_G)
    rest_RG = c_RG - taken_RE.index_select(1, x_G)
    need_G = amount_G - q1_RG.sum(0)
    q2_RG = _cut_line(rest_RG, (same_x_GG * need_G).sum(1), (same_x_GG & earlier_GG).mul(need_G).sum(1), need_G)
    return (q1_RG + q2_RG) * used_G


def rewrite(ids_TK: torch.Tensor, plan: EchoPlan, rank: int, num_experts: int, chunks: int = 1) -> torch.Tensor:
    """Virtual ids for source ``rank``: ids < E are home experts, E + g is echo slot g. The assignments of one expert
    keep token order: its first ones (by their rank among that expert's, ``slot_ranks``: no sort) fill the
    expert's slots in slot order, each up to this source's quota, and the rest stay home.

    ``chunks`` > 1 (a layer pipelined in token chunks of ceil(T / chunks) tokens, ``overlap_chunks``): each slot's
    quota is split over the chunks in proportion to its expert's assignments in each (cumulative rounding: the
    parts sum to the quota), and the rule above applies within every chunk, so each chunk moves its share to
    the clones instead of the first chunk moving all of it. ``chunks = 1`` is the rule above."""
    T, K = ids_TK.shape
    E = num_experts
    flat = ids_TK.reshape(-1)
    q_G = plan.quota_RG[rank]
    x_G = torch.where((plan.slot_expert_G >= 0) & (q_G > 0), plan.slot_expert_G, E)  # unused slots: expert E
    if chunks == 1:
        hit, slot = _fill_slots(flat, x_G, q_G, E)
        return torch.where(hit, E + slot, flat).view(T, K)
    C = chunks
    chunk_N = torch.arange(T, device=flat.device).div(-(-T // C), rounding_mode="floor").repeat_interleave(K)
    key_N = flat * C + chunk_N  # (expert, chunk) as one id in [0, E·C)
    n_XC = torch.zeros(E * C + C, dtype=torch.int64, device=flat.device).scatter_add_(
        0, key_N, torch.ones_like(key_N)).view(E + 1, C)
    cum_XC = torch.cumsum(n_XC, 1)
    n_X = cum_XC[:, -1:].clamp(min=1)
    share_GC = torch.div(q_G[:, None] * cum_XC.index_select(0, x_G), n_X.index_select(0, x_G), rounding_mode="floor")
    q_GC = share_GC - torch.nn.functional.pad(share_GC[:, :-1], (1, 0))  # slot g's quota in chunk c, >= 0
    x_GC = torch.where(x_G[:, None] < E, x_G[:, None] * C + torch.arange(C, device=flat.device), E * C)
    hit, slot = _fill_slots(key_N, x_GC.reshape(-1), q_GC.reshape(-1), E * C)
    return torch.where(hit, E + slot.div(C, rounding_mode="floor"), flat).view(T, K)


def _fill_slots(key_N: torch.Tensor, x_G: torch.Tensor, q_G: torch.Tensor, X: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hit_N, slot_N): the first assignments of each key (ids in [0, X), token order) fill the slots of that key
    (``x_G``: each slot's key, X for an unused slot) in slot order, slot g up to ``q_G[g]`` assignments."""
    G = x_G.shape[0]
    within_N = slot_ranks(key_N, X)[0].long()
    # the slot ranges per key, as sorted (key, end) pairs
    key_order = torch.argsort(x_G * G + torch.arange(G, device=key_N.device), stable=True)
    xs, qs = x_G.index_select(0, key_order), q_G.index_select(0, key_order)
    key_start = torch.cumsum(qs, 0) - qs
    first_of_x = torch.zeros(X + 1, dtype=torch.int64, device=key_N.device).scatter_reduce_(
        0, xs, key_start, reduce="amin", include_self=False)
    end_in_x = key_start + qs - first_of_x.index_select(0, xs)  # exclusive end of each slot's range
    big = key_N.numel() + 1
    slot_keys = xs * big + end_in_x
    j = torch.searchsorted(slot_keys, key_N * big + within_N, right=True).clamp(max=G - 1)
    hit = (xs.index_select(0, j) == key_N) & (within_N < end_in_x.index_select(0, j))
    return hit, key_order.index_select(0, j)


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
