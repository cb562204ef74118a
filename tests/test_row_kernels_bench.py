"""benchmarks/row_kernels.py builds an EP owner's view of routing; its rows must be the dispatcher's."""

import torch

from benchmarks.row_kernels import owner_rows


def test_owner_rows_are_expert_major_and_each_received_row_once():
    T, K, E, R = 50, 6, 16, 2
    gen = torch.Generator().manual_seed(3)
    idx, n = owner_rows(T, K, E, R, gen, torch.device("cpu"))
    ids = torch.rand(R * T, E, generator=torch.Generator().manual_seed(3)).topk(K, dim=-1).indices
    here = ids < E // R
    assert idx.shape == (R * T, K) and n == int(here.sum())
    assert bool((idx[~here] == -1).all())
    rows = idx[here]
    assert torch.equal(rows.sort().values, torch.arange(n, dtype=rows.dtype))  # every received row once
    # expert-major: along the rows, the expert id never decreases; within an expert, sources in order
    order = rows.argsort()
    expert_of_row, token_of_row = ids[here][order], here.nonzero()[:, 0][order]
    assert bool((expert_of_row[1:] >= expert_of_row[:-1]).all())
    same = expert_of_row[1:] == expert_of_row[:-1]
    assert bool((token_of_row[1:][same] >= token_of_row[:-1][same]).all())
