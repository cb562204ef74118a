"""The ECHO planner's sequential slot assignment as single-program Triton kernels.

Same algorithms, same integer arithmetic and same tie-breaking (first index of a maximum) as the
torch loops in components/moe_echo/planner.py, which stay the reference and the CPU path: R·S
steps over E experts and R ranks held in registers, so a whole loop is one launch instead of ~20
small kernels per step (the planner must fit in a CUDA-graph step).

    fill_search(L_E, load_R, S, B) -> (slot_expert_G, slot_amount_G, slot_start_G, load_after_R, moved_E)
        rule "fill": per round B programs, one per target, side by side on B SMs, then a selection
    greedy_slots(L_E, load_R, target, S, rule) -> (slot_expert_G, slot_amount_G, slot_start_G, load_after_R)
        rules "greedy" / "bestfit": one program

A "fill" step, one warp: two max-reductions, over a packed rank key (→ d, its room, its free
slots) and a packed expert key (→ x, what it can move); elementwise ~15 int32 ops per expert and
rank a thread holds; three scalar stores (the step log). About 240 SASS instructions a step at
E = 256, R = 64 (sm_90), no shuffle and no shared memory. The arithmetic follows the largest
load, picked on the device: below 2**SMALL_VB (SMALL_VB = 29 − max(log2 BLOCK_E, log2 BLOCK_R +
log2 next_pow2(S + 1)), 21 at E = 256, R = 64, S ≤ 2) int32 keys, each reduction one warp-wide
redux instruction; below 2**29 int32 values with int64 keys (two redux); else int64. A program
stops at its first step that moves nothing (nothing changes after it), and a slot's start (what
x moved before it) comes from the step log in the selection, not from a reduction per step.
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
    def _fill_run(L_ptr, load_ptr, log_x_ptr, log_m_ptr, log_g_ptr, n_ptr, load_after_ptr, moved_ptr, M_ptr,
                  T64, steps, row, E: tl.constexpr, R: tl.constexpr, S: tl.constexpr, e: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr, IB: tl.constexpr, RB: tl.constexpr,
                  FB: tl.constexpr, DT: tl.constexpr, KT: tl.constexpr, VB: tl.constexpr):
        """Rule "fill" with target T64 for at most ``steps`` steps, values in DT, keys in KT, every
        load < 2**VB. Writes candidate ``row``: the step log (x, m, slot g of step j at row·G + j; the
        entries with m > 0 first), n = entries written, load_after, moved and the makespan M.

        A step is two max-reductions of packed keys (the first index of a maximum is the largest
        reversed index in the low bits; IB = log2 BLOCK_E, RB = log2 BLOCK_R, FB = log2 next_pow2(S + 1)):
            rank key   [last slot: 1][room + 1: VB + 1][BLOCK_R - 1 - r: RB][free: FB]  → d, room_d, free_d
            expert key [band ± cap_x: VB + 2][BLOCK_E - 1 - x: IB]                    → x, cap_x
        cap_x = left_x where x's home is above T, else 0, equals the reference's cap: a rank receives
        only while below T and never rises above T again, so a rank above T still has its S slots.
        exh_E (x's home load − T) is lowered at x's home only, not raised at d: d stays ≤ T, so
        exh_E > 0 stays exact. A step that moves nothing changes nothing: the loop stops there."""
        G: tl.constexpr = R * S
        LO: tl.constexpr = 1 << VB  # expert key bands: whole ones at Kw + cap, top ones at Kt − cap,
        HI: tl.constexpr = 3 << VB  # {Kw, Kt} = {LO, HI}, the preferred set's band above the other
        offs_e = tl.arange(0, BLOCK_E)
        offs_r = tl.arange(0, BLOCK_R)
        me = offs_e < E
        mr = offs_r < R
        T = T64.to(DT)
        left = tl.load(L_ptr + offs_e, mask=me, other=0).to(DT)
        home = offs_e // e
        inv_e = (BLOCK_E - 1 - offs_e).to(KT)
        inv_r = ((BLOCK_R - 1 - offs_r) << FB).to(KT)
        exc = tl.load(load_ptr + offs_r, mask=mr, other=0).to(DT) - T  # load − T; masked ranks have no slot
        exh = tl.where(me, tl.load(load_ptr + home, mask=me, other=0).to(DT) - T, 0)
        free = tl.where(mr, S, 0)
        step = steps * 0
        go = step < steps
        while go:
            # d: the most room among ranks with a free slot below T, rooms down to their last slot first
            has_room = (free > 0) & (exc < 0)
            room1 = tl.where(has_room, 1 - exc, 0)  # room + 1 (room = -1: none)
            last = has_room & (free == 1)
            key_r = (((room1.to(KT) + tl.where(last, 2 << VB, 0)) << (RB + FB)) | inv_r) | free
            kd = tl.max(key_r, 0)
            fd = (kd & ((1 << FB) - 1)).to(tl.int32)
            d = BLOCK_R - 1 - ((kd >> FB) & (BLOCK_R - 1)).to(tl.int32)
            rd = (((kd >> (RB + FB)) & ((2 << VB) - 1)) - 1).to(DT)
            # x: with ≥ 2 free slots on d the largest cap ≤ rd (whole), else the smallest cap ≥ rd (top);
            # on d's last slot the smallest cap ≥ rd, else the largest cap
            two = fd >= 2
            Kw = tl.where(two, HI, LO).to(DT)
            Kt = tl.where(two, LO, HI).to(DT)
            key1 = tl.where(left < rd + two.to(DT), Kw + left, Kt - left)
            key1 = tl.where((exh > 0) & (left > 0), key1, 0)
            kx = tl.max((key1.to(KT) << IB) | inv_e, 0)
            x = BLOCK_E - 1 - (kx & (BLOCK_E - 1)).to(tl.int32)
            k1 = (kx >> IB).to(DT)
            cw = k1 - Kw
            cx = tl.where((cw > 0) & (cw < LO), cw, Kt - k1)  # cap_x
            m = tl.where(k1 > 0, tl.maximum(tl.minimum(cx, rd), 0), 0)
            took = m > 0
            hx = x // e
            log = row * G + step  # the step that moves nothing (the last) leaves an entry past n
            tl.store(log_x_ptr + log, x)
            tl.store(log_m_ptr + log, m)
            tl.store(log_g_ptr + log, d * S + tl.minimum(S - fd, S - 1))
            exc = exc + tl.where(offs_r == d, m, tl.where(offs_r == hx, -m, 0))  # d ≠ hx: d is below T
            free = free - tl.where((offs_r == d) & took, 1, 0)
            exh = exh - tl.where(home == hx, m, 0)
            left = left - tl.where(offs_e == x, m, 0)
            step += 1
            go = took & (step < steps)
        load = exc + T
        tl.store(n_ptr + row, step)  # entries written; all but a last one with m = 0 moved something
        tl.store(load_after_ptr + row * R + offs_r, load, mask=mr)
        tl.store(moved_ptr + row * E + offs_e, tl.load(L_ptr + offs_e, mask=me, other=0) - left, mask=me)
        tl.store(M_ptr + row, tl.max(tl.where(mr, load, 0), 0).to(tl.int64))

    @triton.jit
    def _fill_kernel(L_ptr, load_ptr, T1_ptr, M_ptr, log_x_ptr, log_m_ptr, log_g_ptr, n_ptr, load_after_ptr, moved_ptr,
                     E: tl.constexpr, R: tl.constexpr, S: tl.constexpr, e: tl.constexpr, B: tl.constexpr,
                     BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, IB: tl.constexpr,
                     RB: tl.constexpr, FB: tl.constexpr, SMALL_VB: tl.constexpr, ROUND: tl.constexpr):
        """Program b of search round ROUND: rule "fill" with its target T, candidate row (ROUND - 1)·B + b
        of the step logs [2B, G], n [2B], load_after [2B, R], moved [2B, E] and makespan M [2B].
        The largest load picks the arithmetic (a uniform branch, no host read): below 2**SMALL_VB
        int32 values and int32 keys (a reduction is one warp instruction), below 2**29 int32 values
        and int64 keys, else int64 throughout (loads < 2**47, as the round-1 target arithmetic)."""
        b = tl.program_id(0)
        offs_r = tl.arange(0, BLOCK_R)
        mr = offs_r < R
        load = tl.load(load_ptr + offs_r, mask=mr, other=0)
        lo = (tl.sum(load, 0) + R - 1) // R  # ceil(mean)
        hi = tl.max(load, 0)
        if ROUND == 1:  # ceil(mean) + (max - ceil(mean)) · b³ / (B - 1)³  (in 1/65536)
            b64 = b.to(tl.int64)
            T = lo + (hi - lo) * (b64 * b64 * b64 * 65536 // ((B - 1) * (B - 1) * (B - 1))) // 65536
            tl.store(T1_ptr + b, T)
            steps = b * 0 + R * S  # an int32 scalar
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
        if hi < (1 << SMALL_VB):
            _fill_run(L_ptr, load_ptr, log_x_ptr, log_m_ptr, log_g_ptr, n_ptr, load_after_ptr, moved_ptr, M_ptr,
                      T, steps, row, E, R, S, e, BLOCK_E, BLOCK_R, IB, RB, FB, tl.int32, tl.int32, SMALL_VB)
        elif hi < (1 << 29):
            _fill_run(L_ptr, load_ptr, log_x_ptr, log_m_ptr, log_g_ptr, n_ptr, load_after_ptr, moved_ptr, M_ptr,
                      T, steps, row, E, R, S, e, BLOCK_E, BLOCK_R, IB, RB, FB, tl.int32, tl.int64, 29)
        else:
            _fill_run(L_ptr, load_ptr, log_x_ptr, log_m_ptr, log_g_ptr, n_ptr, load_after_ptr, moved_ptr, M_ptr,
                      T, steps, row, E, R, S, e, BLOCK_E, BLOCK_R, IB, RB, FB, tl.int64, tl.int64, 47)

    @triton.jit
    def _select_kernel(M_ptr, log_x_ptr, log_m_ptr, log_g_ptr, n_ptr, load_after_ptr, moved_ptr,
                       out_expert_ptr, out_amount_ptr, out_start_ptr, out_load_ptr, out_moved_ptr,
                       E: tl.constexpr, R: tl.constexpr, G: tl.constexpr, N: tl.constexpr,
                       BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                       BG: tl.constexpr):
        """Copy out the candidate with the smallest makespan (first on ties) of N = 2B. Program p
        builds slots [p·BG, (p + 1)·BG) from its step log: slot g holds the entry j with g_j = g and
        m_j > 0 (at most one; none: expert -1, amount 0, start 0), start_g = Σ m_j' over its earlier
        entries j' < j of the same expert."""
        p = tl.program_id(0)
        offs_n = tl.arange(0, BLOCK_N)
        i = tl.argmin(tl.load(M_ptr + offs_n, mask=offs_n < N, other=4611686018427387904), 0)  # other: 2**62
        n = tl.load(n_ptr + i)
        offs_j = tl.arange(0, BLOCK_G)
        mj = offs_j < n
        m_j = tl.load(log_m_ptr + i * G + offs_j, mask=mj, other=0)  # 0: no move
        x_j = tl.load(log_x_ptr + i * G + offs_j, mask=mj, other=0)
        g_j = tl.where(m_j > 0, tl.load(log_g_ptr + i * G + offs_j, mask=mj, other=0), -1)
        offs_g = p * BG + tl.arange(0, BG)
        mg = offs_g < G
        hit = g_j[None, :] == offs_g[:, None]
        x_g = tl.max(tl.where(hit, x_j[None, :], -1), 1)
        j_g = tl.max(tl.where(hit, offs_j[None, :], -1), 1)
        before = (x_j[None, :] == x_g[:, None]) & (offs_j[None, :] < j_g[:, None])
        tl.store(out_expert_ptr + offs_g, x_g, mask=mg)
        tl.store(out_amount_ptr + offs_g, tl.sum(tl.where(hit, m_j[None, :], 0), 1), mask=mg)
        tl.store(out_start_ptr + offs_g, tl.sum(tl.where(before, m_j[None, :], 0), 1), mask=mg)
        if p == 0:
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


def _log2(n: int) -> int:
    return n.bit_length() - 1


def fill_search(L_E: torch.Tensor, load_R: torch.Tensor, slots_per_rank: int, B: int):
    """Rule "fill" with its two-round search over B targets, in three launches (round 1: B programs,
    round 2: B programs, selection). Returns the chosen candidate's (slot_expert_G, slot_amount_G,
    slot_start_G, load_after_R, moved_E). Loads must stay below 2**47 (as the round-1 target arithmetic)."""
    E, R, S = L_E.shape[0], load_R.shape[0], slots_per_rank
    G, dev = R * S, L_E.device
    i64 = dict(dtype=torch.int64, device=dev)
    T1 = torch.empty(B, **i64)
    M, n = torch.empty(2 * B, **i64), torch.empty(2 * B, **i64)
    log_x, log_m, log_g = (torch.empty(2 * B, G, **i64) for _ in range(3))
    load_after, moved = torch.empty(2 * B, R, **i64), torch.empty(2 * B, E, **i64)
    blocks = dict(E=E, R=R, BLOCK_E=triton.next_power_of_2(E), BLOCK_R=max(2, triton.next_power_of_2(R)))
    bits = dict(IB=_log2(blocks["BLOCK_E"]), RB=_log2(blocks["BLOCK_R"]), FB=_log2(triton.next_power_of_2(S + 1)))
    # key widths: expert VB + 2 + IB, rank VB + 2 + RB + FB; int32 keys below 31 bits, int64 ones (VB = 47) below 63
    small_vb = 29 - max(bits["IB"], bits["RB"] + bits["FB"])
    if small_vb < 15:
        raise ValueError(f"fill kernel: E = {E}, R = {R}, S = {S} leave too few key bits "
                         "(needs next_pow2(E) and next_pow2(R)·next_pow2(S + 1) ≤ 2**14)")
    L_E, load_R = L_E.contiguous(), load_R.contiguous()
    for rnd in (1, 2):
        _fill_kernel[(B,)](L_E, load_R, T1, M, log_x, log_m, log_g, n, load_after, moved, S=S, e=E // R, B=B,
                           BLOCK_B=max(2, triton.next_power_of_2(B)), SMALL_VB=small_vb, ROUND=rnd,
                           num_warps=NUM_WARPS, **bits, **blocks)
    out = (torch.empty(G, **i64), torch.empty(G, **i64), torch.empty(G, **i64), torch.empty(R, **i64),
           torch.empty(E, **i64))
    BLOCK_G = max(2, triton.next_power_of_2(G))
    BG = max(1, min(BLOCK_G, 2048 // BLOCK_G))  # a [BG, BLOCK_G] tile per program
    _select_kernel[(triton.cdiv(G, BG),)](M, log_x, log_m, log_g, n, load_after, moved, *out, G=G, N=2 * B,
                                          BLOCK_G=BLOCK_G, BLOCK_N=triton.next_power_of_2(2 * B), BG=BG,
                                          num_warps=4, **blocks)
    return out

NUM_WARPS = 1  # one warp: every reduction stays in the warp (redux / shuffles), no shared-memory barrier per step


def source_quotas(counts_RE, slot_expert_G, slot_amount_G, slot_start_G, moved_E):
    R, E = counts_RE.shape
    G = slot_expert_G.shape[0]
    quota = torch.empty(R, G, dtype=torch.int64, device=counts_RE.device)
    _quota_kernel[(G,)](counts_RE.contiguous(), slot_expert_G, slot_amount_G, slot_start_G, moved_E.contiguous(),
                        quota, E=E, R=R, G=G, BLOCK_R=max(2, triton.next_power_of_2(R)), num_warps=1)
    return quota
