"""benchmarks/gather_gemm.py's routing: the expert-major rows both designs of the experts read; the shape
arguments the benchmarks share."""

import torch

from benchmarks.gather_gemm import routing
from kernels.moe_rows import gather_sum_torch


def test_rows_are_expert_major_and_map_back_to_their_tokens():
    T, E, K = 40, 8, 3
    for skew in (0.0, 4.0):
        tok_N, s_N, s_TK, row_of_slot_TK, cu_E1 = routing(T, E, K, skew, torch.Generator().manual_seed(1))
        scores = torch.rand(T, E, generator=torch.Generator().manual_seed(1)) - skew * torch.arange(E) / E
        ids_TK = scores.softmax(-1).topk(K, dim=-1).indices
        N = T * K
        assert torch.equal(row_of_slot_TK.flatten().sort().values, torch.arange(N))  # each row once
        assert torch.equal(tok_N[row_of_slot_TK].long(), torch.arange(T)[:, None].expand(T, K))
        assert torch.equal(s_N[row_of_slot_TK], s_TK)
        expert_N = torch.empty(N, dtype=torch.long).scatter_(0, row_of_slot_TK.flatten(), ids_TK.flatten())
        assert bool((expert_N[1:] >= expert_N[:-1]).all())  # expert-major
        assert cu_E1[0] == 0 and torch.equal(cu_E1[1:].diff().long(), torch.bincount(ids_TK.flatten(), minlength=E)[1:])
        assert int(cu_E1[-1]) == N
        # combining the rows of x gathered by token with weight 1 gives each token K times itself
        x_TD = torch.randn(T, 5, dtype=torch.float64)
        assert torch.allclose(gather_sum_torch(x_TD[tok_N.long()], row_of_slot_TK), K * x_TD)
    skewed = routing(T, E, K, 4.0, torch.Generator().manual_seed(1))[4]
    assert int(skewed[1]) > N // E  # the hot expert (id 0) gets more than its share


def test_shape_arguments_parse_or_name_the_form():
    """The benchmarks' --shapes type (benchmarks/common.py shape_arg): ints of the named form, any case of x; a wrong
    count or a non-number is one line naming the form and an example."""
    import argparse

    import pytest

    from benchmarks.common import shape_arg
    from benchmarks.gather_gemm import _shape

    assert _shape("64x1408x2048x16384x6") == (64, 1408, 2048, 16384, 6)
    parse = shape_arg("EXPERTSxCOLUMNSxROWS", "64x2048x98304")
    assert parse("64X2048x98304") == (64, 2048, 98304)
    for bad in ("64x2048", "64x2048x98304x1", "64xtwox3", ""):
        with pytest.raises(argparse.ArgumentTypeError, match=r"a shape is EXPERTSxCOLUMNSxROWS, e\.g\. 64x2048x98304"):
            parse(bad)


def test_checked_fwd_bwd_against_fp64_passes_close_and_stops_far():
    """The FP8 benchmarks' check (benchmarks/common.py): a bf16 copy of a layer is within a bf16 bound of its fp64
    reference and its step() fills the gradients; a layer with one perturbed weight is refused with one line naming
    it and the error."""
    import copy

    import pytest
    from torch import nn

    from benchmarks.common import checked_fwd_bwd, fp64_fwd_bwd

    torch.manual_seed(0)
    lin = nn.Linear(64, 32, bias=False)
    x, dy = torch.randn(16, 64), torch.randn(16, 32)

    def grads(m, x):
        return [x.grad, m.weight.grad]

    want = fp64_fwd_bwd(lin, x, dy, grads)
    assert [tuple(w.shape) for w in want] == [(16, 32), (16, 64), (32, 64)] and want[0].dtype == torch.float64
    assert torch.allclose(want[1], (dy @ lin.weight.detach()).double(), rtol=1e-5, atol=1e-5)  # dx = dy W
    b16 = copy.deepcopy(lin).bfloat16()
    step, err = checked_fwd_bwd(b16, x.bfloat16(), dy.bfloat16(), want, grads, "bf16", limit=0.02)
    assert 0 < err < 0.02
    b16.weight.grad = None
    step()
    assert b16.weight.grad is not None and b16.weight.grad.abs().sum() > 0
    off = copy.deepcopy(lin)
    with torch.no_grad():
        off.weight[0] += 10.0
    with pytest.raises(SystemExit, match=r"^off is off by [0-9.]+ \(limit 0\.15\)$"):
        checked_fwd_bwd(off, x, dy, want, grads, "off", limit=0.15)
