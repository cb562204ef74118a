"""kernels/route_layout.py: slot ranks and the layout tail against a brute-force placement of every
rank's slots (Python loops), on random and adversarial routing; the Triton kernels in the
interpreter (and compiled for sm_90) against the torch versions, bit for bit."""

import pytest
import torch

from kernels.route_layout import layout_tail_torch, slot_ranks_torch
from test_kernels import needs_cpu_interpreter, run_in_interpreter


def _ids(kind: str, R: int, e: int, N: int, rank: int) -> torch.Tensor:
    X = R * e
    g = torch.Generator().manual_seed(10 * rank + len(kind))
    if kind == "random":
        return torch.randint(0, X, (N,), generator=g)
    if kind == "all_to_one":  # every slot of every rank to id 0
        return torch.zeros(N, dtype=torch.long)
    if kind == "one_hot_per_rank":  # id 0 of each rank hot, the last id of each rank never chosen
        hot = torch.rand(N, generator=g) < 0.8
        return torch.where(hot, torch.randint(0, R, (N,), generator=g) * e,
                           torch.randint(0, R, (N,), generator=g) * e + torch.randint(0, e - 1, (N,), generator=g))
    raise ValueError(kind)


def _placement(ids_R: list[torch.Tensor], e: int, capacity: int):
    """Brute force: each owner's buffer is expert-major, then source-major, then slot order. Returns
    per source the row of each slot (-1 past capacity) and per owner its rows per local id (capped)."""
    R = len(ids_R)
    rows = [[-1] * len(ids) for ids in ids_R]
    kept = [[0] * e for _ in range(R)]
    for owner in range(R):
        at = 0
        for j in range(e):
            for src, ids in enumerate(ids_R):
                for n, x in enumerate(ids.tolist()):
                    if x == owner * e + j:
                        if at < capacity:
                            rows[src][n] = at
                            kept[owner][j] += 1
                        at += 1
    return rows, kept


@pytest.mark.parametrize("kind", ["random", "all_to_one", "one_hot_per_rank"])
@pytest.mark.parametrize("R, e, N, cf", [(2, 4, 60, 2.0), (3, 3, 50, 1.0), (4, 2, 33, 0.5)])
def test_layout_equals_brute_force_placement(kind, R, e, N, cf):
    ids_R = [_ids(kind, R, e, N, r) for r in range(R)]
    capacity = max(1, int(cf * N))
    rows, kept = _placement(ids_R, e, capacity)
    ranked = [slot_ranks_torch(ids, R * e) for ids in ids_R]
    for ids, (rank_N, counts_X) in zip(ids_R, ranked):
        seen: dict[int, int] = {}
        for n, x in enumerate(ids.tolist()):
            assert int(rank_N[n]) == seen.get(x, 0)
            seen[x] = seen.get(x, 0) + 1
        assert counts_X.tolist() == [seen.get(x, 0) for x in range(R * e)]
    counts_RX = torch.stack([c for _, c in ranked])
    busiest = max(int((torch.cat(ids_R) // e == r).sum()) for r in range(R))
    for rank in range(R):
        base_X, counts_e, dropped, needed = layout_tail_torch(counts_RX, rank, e, capacity, N)
        row_N = base_X[ids_R[rank]] + ranked[rank][0]
        row_N = torch.where(row_N < capacity, row_N, -1)
        assert row_N.tolist() == rows[rank]
        assert int(dropped) == rows[rank].count(-1)
        assert counts_e.tolist() == kept[rank]
        assert float(needed) == pytest.approx(busiest / N)


_SCRIPT = r"""
import torch
from kernels.route_layout import layout_tail, layout_tail_torch, slot_ranks, slot_ranks_torch
g = torch.Generator().manual_seed(0)
for R, e, N, cap in [(2, 4, 300, 500), (3, 5, 129, 40), (4, 16, 1000, 900), (8, 48, 4100, 3000)]:
    X = R * e
    counts = []
    for ids in (torch.randint(0, X, (N,), generator=g), torch.zeros(N, dtype=torch.long),
                torch.randint(0, 2, (N,), generator=g) * (X - 1)):
        got, want = slot_ranks(ids, X), slot_ranks_torch(ids, X)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (R, e, N)
        counts.append(got[1])
    counts_RX = torch.stack((counts * R)[:R])
    for rank in range(R):
        for a, b in zip(layout_tail(counts_RX, rank, e, cap, N), layout_tail_torch(counts_RX, rank, e, cap, N)):
            assert torch.equal(a, b), (R, e, rank, a, b)
print("ROUTE-LAYOUT-OK")
"""


@needs_cpu_interpreter
def test_route_layout_kernels_in_interpreter():
    run_in_interpreter(_SCRIPT, "ROUTE-LAYOUT-OK")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("R, e, N", [(2, 32, 4096 * 8), (8, 48, 16384 * 8), (64, 6, 4096 * 8)])
def test_route_layout_kernels_on_gpu(R, e, N):
    """The compiled kernels at training shapes (up to 131072 slots, 384 ids) equal the torch versions."""
    from kernels.route_layout import layout_tail, slot_ranks
    g = torch.Generator(device="cuda").manual_seed(N)
    X = R * e
    zipf = 1.0 / torch.arange(1, X + 1, device="cuda", dtype=torch.float64) ** 1.2
    counts = []
    for ids in (torch.multinomial(zipf, N, replacement=True, generator=g), torch.zeros(N, dtype=torch.long, device="cuda")):
        got, want = slot_ranks(ids, X), slot_ranks_torch(ids, X)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        counts.append(got[1])
    counts_RX = torch.stack([counts[r % 2] for r in range(R)])
    for rank in (0, R - 1):
        for cap in (N // 2, 2 * N):
            for a, b in zip(layout_tail(counts_RX, rank, e, cap, N), layout_tail_torch(counts_RX, rank, e, cap, N)):
                assert torch.equal(a, b)
