"""benchmarks/fp8_rows.py: its shapes parse as written, and a bad one is refused with the form it wants."""

import argparse

import pytest

from benchmarks.fp8_rows import DEFAULT_SHAPES, KERNELS, _shape


def test_shapes_parse_and_a_bad_one_names_the_form():
    assert _shape("swiglu_quant:98304x1408x196608") == ("swiglu_quant", 98304, 1408, 196608)
    assert _shape("quant_rows:16384x2048") == ("quant_rows", 16384, 2048, 16384)  # no buffer: as many rows
    assert {_shape(s)[0] for s in DEFAULT_SHAPES} == set(KERNELS)
    for bad in ("swiglu_quant:98304", "swiglu:1x2", "quant_rows:1x2x3x4", "quant_rows:ax2", "16384x2048"):
        with pytest.raises(argparse.ArgumentTypeError, match="KERNEL:ROWSxWIDTH"):
            _shape(bad)
