"""Fixed capacities equal their documented formulas, also where cf·T·K is not an integer."""

import math
from fractions import Fraction

import pytest

from components.moe_echo.ep_dispatch import padded_capacity
from components.moe_echo.nvlink_dispatch import nvlink_capacity


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@pytest.mark.parametrize("T, K, R, cf", [(13, 2, 4, 1.25), (16, 2, 4, 1.25), (100, 6, 8, 1.1), (7, 3, 2, 1.0),
                                         (4096, 8, 64, 1.5), (1, 1, 2, 3.0)])
def test_padded_capacity_is_round_up_of_ceil_cf_T_K_over_R(T, K, R, cf):
    exact = Fraction(str(cf)) * T * K / R  # exact rational arithmetic: no float rounding
    assert padded_capacity(T, K, R, cf) == max(8, _round_up(math.ceil(exact), 8))


def test_padded_capacity_at_a_non_integer_cf_T_K():
    assert padded_capacity(13, 2, 4, 1.25) == 16  # 1.25 * 13 * 2 / 4 = 8.125 -> 9 rows -> 16


@pytest.mark.parametrize("T, K, cf", [(13, 2, 1.25), (1000, 6, 1.1), (4096, 8, 1.5), (3, 1, 1.0)])
def test_nvlink_capacity_is_round_up_of_ceil_cf_T_K(T, K, cf):
    assert nvlink_capacity(T, K, cf) == _round_up(math.ceil(Fraction(str(cf)) * T * K), 128)


def test_fixed_capacity_backends_share_the_base_and_grow():
    """padded and nvlink are both ExpertParallel + FixedCapacity: one divisibility check, one growth rule."""
    from components.moe_echo.dispatcher import DispatchHandle, ExpertParallel, FixedCapacity, LocalHandle, is_fixed_capacity
    from components.moe_echo.ep_dispatch import AllToAllDispatcher, EPHandle, PaddedDispatcher
    from components.moe_echo.nvlink_dispatch import NVLinkDispatcher, NVLinkHandle

    for cls in (PaddedDispatcher, NVLinkDispatcher):
        assert issubclass(cls, ExpertParallel) and issubclass(cls, FixedCapacity)
    assert issubclass(AllToAllDispatcher, ExpertParallel) and not issubclass(AllToAllDispatcher, FixedCapacity)
    for h in (LocalHandle, EPHandle, NVLinkHandle):
        assert issubclass(h, DispatchHandle)
    with pytest.raises(ValueError, match="not divisible"):
        PaddedDispatcher(10, None, 4, 1.25)
    d = PaddedDispatcher(8, None, 2, 1.25)
    assert is_fixed_capacity(d) and d.sync_free
    assert d.grow_capacity(1.0) == pytest.approx(1.5625)  # at least +25%
    assert d.grow_capacity(3.0) == 3.0  # or what the overflowed steps needed
    assert padded_capacity(13, 2, 4, d.capacity_factor) == _round_up(math.ceil(3.0 * 13 * 2 / 4), 8)
