"""The ECHO planner's sequential slot assignment as single-program Triton kernels.

Same algorithms, same integer arithmetic and same tie-breaking (first index of a maximum) as the
torch loops in components/moe_echo/planner.py, which stay the reference and the CPU path: R·S
steps, each an argmax over E experts and R ranks held in registers, so a whole loop is one
launch instead of ~20 small kernels per step (the planner must fit in a CUDA-graph step).

    fill_slots(L_E, load_R, T_B, S, run) -> (slot_expert_BG, slot_amount_BG, slot_start_BG, load_BR)
        rule "fill" for B targets: B programs, one per target, side by side on B SMs
    greedy_slots(L_E, load_R, target, S, rule) -> (slot_expert_G, slot_amount_G, slot_start_G, load_after_R)
        rules "greedy" / "bestfit": one program
"""

import torch

from .moe_rows import _use_triton, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _greedy_slots_kernel(L_ptr, load_ptr, target_ptr, slot_expert_ptr, slot_amount_ptr, slot_start_ptr,
                             load_after_ptr,
                             E: tl.constexpr, R: tl.constexpr, S: tl.constexpr, e: tl.constexpr,
                             BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr, BESTFIT: tl.constexpr):
        offs_e = tl.arange(0, BLOCK_E)
        offs_r = tl.arange(0, BLOCK_R)
        me = offs_e < E
        mr = offs_r < R
        target = tl.load(target_ptr)
        total = tl.load(L_ptr + offs_e, mask=me, other=0)
        left = total
        home = offs_e // e
        load = tl.load(load_ptr + offs_r, mask=mr, other=0)
        homeload = tl.load(load_ptr + home, mask=me, other=0)  # load of each expert's home rank
        free = tl.where(mr, S, 0).to(tl.int64)
        for _ in range(R * S):
            movable = tl.where(me, tl.minimum(left, tl.maximum(homeload - target, 0)), -1)
            mv = tl.max(movable, 0)
            x = tl.argmax(movable, 0)
            room = tl.where(mr & (free > 0), tl.maximum(target - load, 0), -1)
            if BESTFIT:
                key = tl.where(room >= mv, 2 * (tl.max(room, 0) + 1) - room, room)
            else:
                key = room
            d = tl.argmax(key, 0)
            rm = tl.sum(tl.where(offs_r == d, room, 0), 0)
            fd = tl.sum(tl.where(offs_r == d, free, 0), 0)
            m = tl.maximum(tl.minimum(mv, rm), 0)
            hx = x // e
            g = d * S + tl.minimum(S - fd, S - 1)
            if m > 0:
                tl.store(slot_expert_ptr + g, x.to(tl.int64))
                tl.store(slot_amount_ptr + g, m)
                tl.store(slot_start_ptr + g, tl.sum(tl.where(offs_e == x, total - left, 0), 0))
            load = load - tl.where(offs_r == hx, m, 0) + tl.where(offs_r == d, m, 0)
            homeload = homeload - tl.where(home == hx, m, 0) + tl.where(home == d, m, 0)
            left = left - tl.where(offs_e == x, m, 0)
            free = free - tl.where((offs_r == d) & (m > 0), 1, 0)
        tl.store(load_after_ptr + offs_r, load, mask=mr)

    @triton.jit
    def _fill_kernel(L_ptr, load_ptr, T1_ptr, M_ptr, slot_expert_ptr, slot_amount_ptr, slot_start_ptr, load_after_ptr,
                     moved_ptr, E: tl.constexpr, R: tl.constexpr, S: tl.constexpr, e: tl.constexpr, B: tl.constexpr,
                     BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_B: tl.constexpr,
                     ROUND: tl.constexpr):
        """Program b of search round ROUND: rule "fill" with its target T; writes candidate row
        (ROUND - 1)·B + b of the slot arrays [2B, G], load_after [2B, R], moved [2B, E] and makespan M [2B]."""
        G: tl.constexpr = R * S
        b = tl.program_id(0)
        offs_e = tl.arange(0, BLOCK_E)
        offs_r = tl.arange(0, BLOCK_R)
        offs_g = tl.arange(0, BLOCK_G)
        me = offs_e < E
        mr = offs_r < R
        load = tl.load(load_ptr + offs_r, mask=mr, other=0)
        lo = (tl.sum(load, 0) + R - 1) // R  # ceil(mean)
        if ROUND == 1:  # ceil(mean) + (max - ceil(mean)) · b³ / (B - 1)³  (in 1/65536)
            hi = tl.max(load, 0)
            b64 = b.to(tl.int64)
            T = lo + (hi - lo) * (b64 * b64 * b64 * 65536 // ((B - 1) * (B - 1) * (B - 1))) // 65536
            tl.store(T1_ptr + b, T)
            steps = R * S
            row = b
        else:  # evenly between the largest failed round-1 target and the best round-1 makespan
            offs_b = tl.arange(0, BLOCK_B)
            mb = offs_b < B
            T1 = tl.load(T1_ptr + offs_b, mask=mb, other=0)
            M1 = tl.load(M_ptr + offs_b, mask=mb, other=4611686018427387904)  # 2**62: above any load
            best = tl.min(M1, 0)
            lo2 = tl.max(tl.where(mb & (M1 > T1) & (T1 < best), T1, lo - 1), 0)
            T = lo2 + (best - lo2) * (b + 1) // (B + 1)
            steps = tl.where(best > lo, R * S, 0)  # round 1 already reached ceil(mean): no step
            row = B + b
        total = tl.load(L_ptr + offs_e, mask=me, other=0)
        left = total
        home = offs_e // e
        homeload = tl.load(load_ptr + home, mask=me, other=0)  # load of each expert's home rank
        free = tl.where(mr, S, 0).to(tl.int64)
        homefree = tl.where(me, S, 0).to(tl.int64)  # free slots of each expert's home rank
        sx = tl.full((BLOCK_G,), -1, tl.int64)
        sa = tl.zeros((BLOCK_G,), tl.int64)
        ss = tl.zeros((BLOCK_G,), tl.int64)
        for _ in range(0, steps):
            excess = load - T
            room = tl.where(mr & (free > 0) & (excess < 0), -excess, -1)
            last = (room > 0) & (free == 1)  # rooms down to their last slot go first
            n_last = tl.max(last.to(tl.int32), 0)
            d = tl.argmax(tl.where(last | (n_last == 0), room, -1), 0)
            rd = tl.sum(tl.where(offs_r == d, room, 0), 0)
            fd = tl.sum(tl.where(offs_r == d, free, 0), 0)
            exh = homeload - T
            cap = tl.where(homefree > 0, left, tl.minimum(left, exh))
            cap = tl.where(me & (exh > 0), cap, 0)
            whole = tl.where((cap > 0) & (cap <= rd), cap, -4611686018427387904)  # moves whole, fits
            top = tl.where((cap > 0) & (cap >= rd), -cap, -4611686018427387904)  # fills the room
            has_whole = (tl.max(whole, 0) > -4611686018427387904).to(tl.int32)
            has_top = (tl.max(top, 0) > -4611686018427387904).to(tl.int32)
            use_whole = tl.where(fd >= 2, has_whole, 1 - has_top) > 0
            x = tl.argmax(tl.where(use_whole, whole, top), 0)
            m = tl.maximum(tl.minimum(tl.sum(tl.where(offs_e == x, cap, 0), 0), rd), 0)
            hx = x // e
            g = d * S + tl.minimum(S - fd, S - 1)
            start = tl.sum(tl.where(offs_e == x, total - left, 0), 0)
            took = (m > 0).to(tl.int64)
            hit = (offs_g == g) & (m > 0)
            sx = tl.where(hit, x.to(tl.int64), sx)
            sa = tl.where(hit, m, sa)
            ss = tl.where(hit, start, ss)
            load = load - tl.where(offs_r == hx, m, 0) + tl.where(offs_r == d, m, 0)
            homeload = homeload - tl.where(home == hx, m, 0) + tl.where(home == d, m, 0)
            left = left - tl.where(offs_e == x, m, 0)
            free = free - tl.where(offs_r == d, took, 0)
            homefree = homefree - tl.where(home == d, took, 0)
        mg = offs_g < G
        tl.store(slot_expert_ptr + row * G + offs_g, sx, mask=mg)
        tl.store(slot_amount_ptr + row * G + offs_g, sa, mask=mg)
        tl.store(slot_start_ptr + row * G + offs_g, ss, mask=mg)
        tl.store(load_after_ptr + row * R + offs_r, load, mask=mr)
        tl.store(moved_ptr + row * E + offs_e, total - left, mask=me)
        tl.store(M_ptr + row, tl.max(load, 0))

    @triton.jit
    def _select_kernel(M_ptr, slot_expert_ptr, slot_amount_ptr, slot_start_ptr, load_after_ptr, moved_ptr,
                       out_expert_ptr, out_amount_ptr, out_start_ptr, out_load_ptr, out_moved_ptr,
                       E: tl.constexpr, R: tl.constexpr, G: tl.constexpr, N: tl.constexpr,
                       BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr):
        """Copy out the candidate with the smallest makespan (first on ties) of N = 2B."""
        offs_n = tl.arange(0, BLOCK_N)
        i = tl.argmin(tl.load(M_ptr + offs_n, mask=offs_n < N, other=4611686018427387904), 0)  # other: 2**62
        offs_g = tl.arange(0, BLOCK_G)
        mg = offs_g < G
        tl.store(out_expert_ptr + offs_g, tl.load(slot_expert_ptr + i * G + offs_g, mask=mg), mask=mg)
        tl.store(out_amount_ptr + offs_g, tl.load(slot_amount_ptr + i * G + offs_g, mask=mg), mask=mg)
        tl.store(out_start_ptr + offs_g, tl.load(slot_start_ptr + i * G + offs_g, mask=mg), mask=mg)
        offs_r = tl.arange(0, BLOCK_R)
        tl.store(out_load_ptr + offs_r, tl.load(load_after_ptr + i * R + offs_r, mask=offs_r < R), mask=offs_r < R)
        offs_e = tl.arange(0, BLOCK_E)
        tl.store(out_moved_ptr + offs_e, tl.load(moved_ptr + i * E + offs_e, mask=offs_e < E), mask=offs_e < E)

    @triton.jit
    def _quota_kernel(counts_ptr, slot_expert_ptr, slot_amount_ptr, slot_start_ptr, moved_ptr, quota_ptr,
                      E: tl.constexpr, R: tl.constexpr, G: tl.constexpr, BLOCK_R: tl.constexpr):
        """quota[r, g] = overlap of source r's proportional range of expert x's moved line with slot g's range."""
        g = tl.program_id(0)
        offs_r = tl.arange(0, BLOCK_R)
        mr = offs_r < R
        x = tl.load(slot_expert_ptr + g)
        used = x >= 0
        xc = tl.maximum(x, 0)
        c = tl.load(counts_ptr + offs_r * E + xc, mask=mr, other=0)
        cum = tl.cumsum(c, 0)
        L = tl.maximum(tl.sum(c, 0), 1)
        M = tl.load(moved_ptr + xc)
        hi = cum * M // L
        lo = hi - (cum * M // L - (cum - c) * M // L)
        start = tl.load(slot_start_ptr + g)
        amount = tl.load(slot_amount_ptr + g)
        q = tl.maximum(tl.minimum(hi, start + amount) - tl.maximum(lo, start), 0)
        q = tl.where(used, q, 0)
        tl.store(quota_ptr + offs_r * G + g, q, mask=mr)


def can_use_kernel(t: torch.Tensor) -> bool:
    return _use_triton(t)


def greedy_slots(L_E: torch.Tensor, load_R: torch.Tensor, target: torch.Tensor, slots_per_rank: int, rule: str):
    """(slot_expert_G, slot_amount_G, slot_start_G, load_after_R); start = x's amount moved before g."""
    E, R, S = L_E.shape[0], load_R.shape[0], slots_per_rank
    dev = L_E.device
    slot_expert = torch.full((R * S,), -1, dtype=torch.int64, device=dev)
    slot_amount = torch.zeros(R * S, dtype=torch.int64, device=dev)
    slot_start = torch.zeros(R * S, dtype=torch.int64, device=dev)
    load_after = torch.empty_like(load_R)
    _greedy_slots_kernel[(1,)](L_E.contiguous(), load_R.contiguous(), target.reshape(1), slot_expert, slot_amount,
                               slot_start, load_after, E=E, R=R, S=S, e=E // R, BLOCK_E=triton.next_power_of_2(E),
                               BLOCK_R=max(2, triton.next_power_of_2(R)), BESTFIT=rule == "bestfit",
                               num_warps=NUM_WARPS)
    return slot_expert, slot_amount, slot_start, load_after


def fill_search(L_E: torch.Tensor, load_R: torch.Tensor, slots_per_rank: int, B: int):
    """Rule "fill" with its two-round search over B targets, in three launches (round 1: B programs,
    round 2: B programs, selection). Returns the chosen candidate's (slot_expert_G, slot_amount_G,
    slot_start_G, load_after_R, moved_E)."""
    E, R, S = L_E.shape[0], load_R.shape[0], slots_per_rank
    G, dev = R * S, L_E.device
    i64 = dict(dtype=torch.int64, device=dev)
    T1 = torch.empty(B, **i64)
    M = torch.empty(2 * B, **i64)
    expert, amount, start = (torch.empty(2 * B, G, **i64) for _ in range(3))
    load_after, moved = torch.empty(2 * B, R, **i64), torch.empty(2 * B, E, **i64)
    blocks = dict(E=E, R=R, BLOCK_E=triton.next_power_of_2(E), BLOCK_R=max(2, triton.next_power_of_2(R)),
                  BLOCK_G=max(2, triton.next_power_of_2(G)))
    L_E, load_R = L_E.contiguous(), load_R.contiguous()
    for rnd in (1, 2):
        _fill_kernel[(B,)](L_E, load_R, T1, M, expert, amount, start, load_after, moved, S=S, e=E // R, B=B,
                           BLOCK_B=max(2, triton.next_power_of_2(B)), ROUND=rnd, num_warps=NUM_WARPS, **blocks)
    out = (torch.empty(G, **i64), torch.empty(G, **i64), torch.empty(G, **i64), torch.empty(R, **i64),
           torch.empty(E, **i64))
    _select_kernel[(1,)](M, expert, amount, start, load_after, moved, *out, G=G, N=2 * B,
                         BLOCK_N=triton.next_power_of_2(2 * B), num_warps=NUM_WARPS, **blocks)
    return out

NUM_WARPS = 1  # one warp: every argmax is a warp shuffle, no shared-memory barrier per step


def source_quotas(counts_RE, slot_expert_G, slot_amount_G, slot_start_G, moved_E):
    R, E = counts_RE.shape
    G = slot_expert_G.shape[0]
    quota = torch.empty(R, G, dtype=torch.int64, device=counts_RE.device)
    _quota_kernel[(G,)](counts_RE.contiguous(), slot_expert_G, slot_amount_G, slot_start_G, moved_E.contiguous(),
                        quota, E=E, R=R, G=G, BLOCK_R=max(2, triton.next_power_of_2(R)), num_warps=1)
    return quota
