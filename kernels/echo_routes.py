"""ECHO's row tables for the peer-memory transport, one kernel each (``kernels/peer_rows.py`` moves the rows).

A plan's ``slot_expert_G`` [G = R·S] names the global expert each slot g = ρ·S + s (slot s of rank ρ) clones, -1 for
none; rank ``rank`` is home to global experts rank·e .. rank·e + e − 1. An expert weight is ``rows`` rows.

    clone_routes(slot_expert_G, rank, S, e, rows) -> (src_N, dest_N1, row_N1)     N = G·rows, n = g·rows + r
        the forward multicast of my experts into the slots cloning them: route n reads row src_N[n] of my
        experts' rows (expert slot_expert[g] mod e, row r; row r of expert 0 where slot g clones none), goes
        to rank dest_N1[n] = g // S at row row_N1[n] = (g mod S)·rows + r of its slot buffer, or nowhere
        (-1) where slot g does not clone one of my experts
    pull_routes(slot_expert_G, rank, S, e, rows) -> (rank_TR, row_TR, home_T)      T = C·rows, C = min(e, G)
        the backward pull of the clones' gradients: my experts in clone order (those some slot clones first,
        then the others, each in expert order; the first C of them) — route t = c·rows + r adds into row
        home_T[t] = l_c·rows + r of my experts' gradient the row row_TR[t, ρ] = s·rows + r of rank ρ's slot
        buffer, where ρ's slot s clones my expert l_c (the planner never clones an expert twice on one
        rank), else -1; rank_TR[t, ρ] = ρ

Each table is one kernel on CUDA, where the torch forms below (the references, and the path off CUDA) are ~20
small kernels; TRITON_INTERPRET=1 runs the kernels on CPU tensors. All int64, no host read."""

import torch

from .moe_rows import _use_triton, triton

BLOCK = 1024  # routes a program writes


def clone_routes_torch(slot_expert_G: torch.Tensor, rank: int, S: int, e: int, rows: int):
    G, dev = slot_expert_G.shape[0], slot_expert_G.device
    mine_G = (slot_expert_G >= 0) & (slot_expert_G // e == rank)
    local_G = torch.where(slot_expert_G >= 0, slot_expert_G % e, 0)
    n_N = torch.arange(G * rows, device=dev)
    g_N, r_N = n_N // rows, n_N % rows
    src_N = local_G.index_select(0, g_N) * rows + r_N
    row_N = torch.where(mine_G.index_select(0, g_N), (g_N % S) * rows + r_N, -1)
    return src_N, (g_N // S).view(-1, 1), row_N.view(-1, 1)


def pull_routes_torch(slot_expert_G: torch.Tensor, rank: int, S: int, e: int, rows: int):
    G, dev = slot_expert_G.shape[0], slot_expert_G.device
    R, C = G // S, min(e, G)
    g_G = torch.arange(G, device=dev)
    mine_G = (slot_expert_G >= 0) & (slot_expert_G // e == rank)
    at_G = torch.where(mine_G, (slot_expert_G % e) * R + g_G // S, e * R)  # (my expert, clone rank); else a spare
    slot_lR = torch.full((e * R + 1,), -1, dtype=torch.int64, device=dev).scatter_(0, at_G, g_G % S)[:-1].view(e, R)
    cloned_l = (slot_lR >= 0).any(1)
    l_C = torch.sort((~cloned_l).to(torch.int8), stable=True).indices[:C]  # cloned experts first, each once
    slot_cR = slot_lR.index_select(0, l_C)
    r_1r1 = torch.arange(rows, device=dev).view(1, rows, 1)
    row_crR = torch.where(slot_cR.unsqueeze(1) >= 0, slot_cR.unsqueeze(1) * rows + r_1r1, -1)
    rank_crR = torch.arange(R, device=dev).view(1, 1, R).expand(C, rows, R)
    home_cr = l_C.view(C, 1) * rows + r_1r1.view(1, rows)
    return rank_crR.reshape(C * rows, R).contiguous(), row_crR.reshape(C * rows, R), home_cr.reshape(-1)


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _clone_routes_kernel(x_ptr, src_ptr, dest_ptr, row_ptr, rank, S, e, rows, N, BLOCK: tl.constexpr):
        n = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = n < N
        g = n // rows
        r = n - g * rows
        x = tl.load(x_ptr + g, mask=ok, other=-1)
        used = x >= 0
        mine = used & (x // e == rank)  # x >= 0 here: the division and remainder need no sign care
        tl.store(src_ptr + n, tl.where(used, x % e, 0) * rows + r, mask=ok)
        tl.store(dest_ptr + n, g // S, mask=ok)
        tl.store(row_ptr + n, tl.where(mine, (g % S) * rows + r, -1), mask=ok)

    @triton.jit
    def _pull_routes_kernel(x_ptr, rank_ptr, row_ptr, home_ptr, rank, S, e, rows, G, R,
                            E_POW2: tl.constexpr, R_POW2: tl.constexpr, S_POW2: tl.constexpr,
                            BLOCK: tl.constexpr):
        """Program (c, b): rows b·BLOCK.. of my c-th expert in clone order."""
        c = tl.program_id(0).to(tl.int64)
        lanes = tl.arange(0, E_POW2)
        cloned = lanes < 0
        for g in range(G):  # which of my experts some slot clones
            x = tl.load(x_ptr + g)
            cloned = cloned | ((x >= 0) & (x // e == rank) & (lanes == x - rank * e))
        real = lanes < e
        n_cloned = tl.sum(cloned.to(tl.int32), 0)
        pos = tl.where(cloned, tl.cumsum(cloned.to(tl.int32), 0) - 1,
                       n_cloned + tl.cumsum((real & ~cloned).to(tl.int32), 0) - 1)  # place in clone order
        l = tl.sum(tl.where(real & (pos == c), lanes, 0), 0)  # my c-th expert
        rho = tl.arange(0, R_POW2)
        s = tl.arange(0, S_POW2)
        in_RS = (rho[:, None] < R) & (s[None, :] < S)
        x_RS = tl.load(x_ptr + rho[:, None] * S + s[None, :], mask=in_RS, other=-1)
        slot_R = tl.max(tl.where(in_RS & (x_RS == rank * e + l), s[None, :], -1), 1)  # rank ρ's slot cloning it
        r = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = r < rows
        t = c * rows + r
        tl.store(home_ptr + t, l * rows + r, mask=ok)
        out = t[:, None] * R + rho[None, :]
        in_TR = ok[:, None] & (rho[None, :] < R)
        tl.store(rank_ptr + out, tl.zeros_like(out) + rho[None, :], mask=in_TR)
        tl.store(row_ptr + out, tl.where(slot_R[None, :] >= 0, slot_R[None, :] * rows + r[:, None], -1), mask=in_TR)


def clone_routes(slot_expert_G: torch.Tensor, rank: int, S: int, e: int, rows: int, block: int = BLOCK):
    """(src_N, dest_N1, row_N1), int64 (module docstring); ``block``: routes a program writes (a power of 2)."""
    if not _use_triton(slot_expert_G):
        return clone_routes_torch(slot_expert_G, rank, S, e, rows)
    N = slot_expert_G.shape[0] * rows
    src_N, dest_N, row_N = (torch.empty(N, dtype=torch.int64, device=slot_expert_G.device) for _ in range(3))
    if N:
        _clone_routes_kernel[(triton.cdiv(N, block),)](slot_expert_G.contiguous(), src_N, dest_N, row_N, rank, S, e,
                                                       rows, N, BLOCK=block, num_warps=4)
    return src_N, dest_N.view(-1, 1), row_N.view(-1, 1)


def pull_routes(slot_expert_G: torch.Tensor, rank: int, S: int, e: int, rows: int, block: int = BLOCK):
    """(rank_TR, row_TR, home_T), int64 (module docstring); ``block``: rows of an expert a program writes."""
    if not _use_triton(slot_expert_G):
        return pull_routes_torch(slot_expert_G, rank, S, e, rows)
    G, dev = slot_expert_G.shape[0], slot_expert_G.device
    R, C = G // S, min(e, G)
    rank_TR, row_TR = (torch.empty(C * rows, R, dtype=torch.int64, device=dev) for _ in range(2))
    home_T = torch.empty(C * rows, dtype=torch.int64, device=dev)
    if C and rows:
        _pull_routes_kernel[(C, triton.cdiv(rows, block))](
            slot_expert_G.contiguous(), rank_TR, row_TR, home_T, rank, S, e, rows, G, R,
            E_POW2=triton.next_power_of_2(e), R_POW2=triton.next_power_of_2(R), S_POW2=triton.next_power_of_2(S),
            BLOCK=block, num_warps=4)
    return rank_TR, row_TR, home_T
