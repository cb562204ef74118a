"""ECHO's peer-memory row tables (kernels/echo_routes.py): the torch forms against a per-route loop written from
the definition, then the kernels against the torch forms in the Triton interpreter (and compiled for sm_90) and on
a GPU, over random plans and adversarial ones: no slot used, every slot cloning one rank's experts, more slots than
home experts (C = e), one slot a rank, an expert's rows over several program blocks."""

import pytest
import torch

from kernels.echo_routes import clone_routes, clone_routes_torch, pull_routes, pull_routes_torch
from test_kernels import needs_cpu_interpreter, run_in_interpreter


def _plan(kind: str, R: int, S: int, e: int, gen: torch.Generator) -> torch.Tensor:
    """slot_expert_G [R·S]: each rank's slots clone distinct experts of other ranks, or none (-1)."""
    x = torch.full((R * S,), -1, dtype=torch.int64)
    for rho in range(R):
        others = torch.tensor([g for g in range(R * e) if g // e != rho])
        if kind == "none":
            continue
        if kind == "rank0":  # every slot anywhere clones one of rank 0's experts (rank 0's own: rank 1's)
            pool = torch.arange(e) if rho != 0 else torch.arange(e, 2 * e)
        else:
            pool = others
        pick = pool[torch.randperm(len(pool), generator=gen)[:S]]
        keep = torch.rand(len(pick), generator=gen) < (0.7 if kind == "random" else 1.0)
        x[rho * S:rho * S + len(pick)] = torch.where(keep, pick, -1)
    return x


def clone_routes_loop(x, rank, S, e, rows):
    src, dest, row = [], [], []
    for g, xg in enumerate(x.tolist()):
        for r in range(rows):
            src.append((xg % e if xg >= 0 else 0) * rows + r)
            dest.append(g // S)
            row.append((g % S) * rows + r if xg >= 0 and xg // e == rank else -1)
    return torch.tensor(src), torch.tensor(dest).view(-1, 1), torch.tensor(row).view(-1, 1)


def pull_routes_loop(x, rank, S, e, rows):
    xs = x.tolist()
    R, C = len(xs) // S, min(e, len(xs))
    cloned = [l for l in range(e) if rank * e + l in xs]
    order = (cloned + [l for l in range(e) if l not in cloned])[:C]
    ranks, slots, home = [], [], []
    for l in order:
        slot = [next((s for s in range(S) if xs[rho * S + s] == rank * e + l), -1) for rho in range(R)]
        for r in range(rows):
            ranks.append(list(range(R)))
            slots.append([s * rows + r if s >= 0 else -1 for s in slot])
            home.append(l * rows + r)
    return torch.tensor(ranks).view(-1, R), torch.tensor(slots).view(-1, R), torch.tensor(home)


CASES = [  # (kind, R, S, e, rows)
    ("random", 4, 2, 5, 3), ("random", 2, 2, 32, 7), ("random", 8, 2, 3, 5),  # C = min(e, G) both ways
    ("none", 4, 2, 5, 3), ("rank0", 4, 2, 6, 4), ("rank0", 3, 1, 2, 6), ("random", 2, 3, 4, 1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_torch_routes_are_their_definition(case):
    kind, R, S, e, rows = case
    x = _plan(kind, R, S, e, torch.Generator().manual_seed(R * 100 + e))
    for rank in range(R):
        for got, want in zip(clone_routes_torch(x, rank, S, e, rows), clone_routes_loop(x, rank, S, e, rows)):
            assert torch.equal(got, want), (case, rank)
        for got, want in zip(pull_routes_torch(x, rank, S, e, rows), pull_routes_loop(x, rank, S, e, rows)):
            assert torch.equal(got, want), (case, rank)


_SCRIPT = r"""
import torch
from test_echo_routes import CASES, _plan
from kernels import echo_routes as er
for kind, R, S, e, rows in CASES + [("random", 2, 2, 5, 70), ("rank0", 4, 2, 6, 33)]:
    x = _plan(kind, R, S, e, torch.Generator().manual_seed(R * 100 + e))
    for rank in range(R):
        for block in (16, 64):  # an expert's rows, and the routes, over several programs, or one
            for got, want in zip(er.clone_routes(x, rank, S, e, rows, block), er.clone_routes_torch(x, rank, S, e, rows)):
                assert torch.equal(got, want), ("clone", kind, R, S, e, rows, rank, block, got, want)
            for got, want in zip(er.pull_routes(x, rank, S, e, rows, block), er.pull_routes_torch(x, rank, S, e, rows)):
                assert torch.equal(got, want), ("pull", kind, R, S, e, rows, rank, block, got, want)
print("ECHO-ROUTES-OK")
"""


@needs_cpu_interpreter
def test_route_kernels_equal_torch_in_interpreter():
    run_in_interpreter(_SCRIPT, "ECHO-ROUTES-OK")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_route_kernels_equal_torch_on_gpu():
    for kind, R, S, e, rows in CASES + [("random", 8, 2, 32, 2048), ("rank0", 16, 2, 16, 1408), ("random", 64, 2, 4, 5)]:
        x = _plan(kind, R, S, e, torch.Generator().manual_seed(R * 100 + e))
        for rank in (0, R - 1):
            for got, want in zip(clone_routes(x.cuda(), rank, S, e, rows), clone_routes_torch(x, rank, S, e, rows)):
                assert torch.equal(got.cpu(), want), ("clone", kind, R, S, e, rows, rank)
            for got, want in zip(pull_routes(x.cuda(), rank, S, e, rows), pull_routes_torch(x, rank, S, e, rows)):
                assert torch.equal(got.cpu(), want), ("pull", kind, R, S, e, rows, rank)
