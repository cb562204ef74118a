"""The ECHO planner's sequential slot assignment as one single-program Triton kernel.

Same algorithm, same integer arithmetic and same tie-breaking (first index of a maximum) as the
torch loop in components/moe_echo/planner.py, which stays the reference and the CPU path: R·S
steps, each an argmax over E experts and R ranks held in registers, so the whole loop is one
launch instead of ~20 small kernels per step (the planner must fit in a CUDA-graph step).

    greedy_slots(L_E, load_R, target, S, rule) -> (slot_expert_G, slot_amount_G, load_after_R)
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


NUM_WARPS = 1  # one warp: every argmax is a warp shuffle, no shared-memory barrier per step


def source_quotas(counts_RE, slot_expert_G, slot_amount_G, slot_start_G, moved_E):
    R, E = counts_RE.shape
    G = slot_expert_G.shape[0]
    quota = torch.empty(R, G, dtype=torch.int64, device=counts_RE.device)
    _quota_kernel[(G,)](counts_RE.contiguous(), slot_expert_G, slot_amount_G, slot_start_G, moved_E.contiguous(),
                        quota, E=E, R=R, G=G, BLOCK_R=max(2, triton.next_power_of_2(R)), num_warps=1)
    return quota
