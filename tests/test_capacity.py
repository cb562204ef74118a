"""The nvlink receive capacity equals its documented formula, also where cf·T·K is not an integer."""

import math
from fractions import Fraction

import pytest

from components.moe_echo.nvlink_dispatch import nvlink_capacity


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@pytest.mark.parametrize("T, K, cf", [(13, 2, 1.25), (1000, 6, 1.1), (4096, 8, 1.5), (3, 1, 1.0)])
def test_nvlink_capacity_is_round_up_of_ceil_cf_T_K(T, K, cf):
    assert nvlink_capacity(T, K, cf) == _round_up(math.ceil(Fraction(str(cf)) * T * K), 128)
