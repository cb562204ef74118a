"""The fp8 wire (``[moe_echo] dispatch_precision = "fp8"``): rows packed as e4m3 and a power-of-two scale per 128
columns, against fp64."""

import pytest
import torch

from components.moe_echo.comm import fp8_rows, rows_of_fp8


def _rows(gen):
    x = torch.randn(64, 256, generator=gen, dtype=torch.float64)
    x[1] *= 1e-6  # tiny row
    x[2] *= 1e4  # large row
    x[3] = 0.0  # zero row
    x[4, :128] *= 1e-5  # a row spanning eight decades: its first 128 columns get a scale of their own
    x[5, 128:] = 0.0  # a zero block
    x[6, 7] = 1e6  # an outlier: only its block's scale follows it
    return x


def test_rows_cross_as_d_plus_d_over_32_bytes_within_e4m3_rounding():
    x = _rows(torch.Generator().manual_seed(0))
    packed = fp8_rows(x)
    assert packed.dtype == torch.uint8 and packed.shape == (64, 256 + 2 * 4)  # vs 2 * 256 bytes in bf16
    back = rows_of_fp8(packed, torch.float64)
    assert torch.equal(back[3], x[3]) and torch.equal(back[5, 128:], x[5, 128:])
    scale_NB = packed[:, 256:].contiguous().view(torch.float32).double()
    assert scale_NB.shape == (64, 2) and torch.equal(torch.log2(scale_NB), torch.round(torch.log2(scale_NB)))
    amax_NB = x.abs().view(64, 2, 128).amax(2)
    nz = amax_NB > 0
    assert torch.all(amax_NB[nz] / scale_NB[nz] <= 448) and torch.all(amax_NB[nz] / scale_NB[nz] > 224)
    assert torch.all(scale_NB[~nz] == 1)
    # e4m3: 3 mantissa bits, so a normal value is off by at most 2^-4 of itself; below 2^-6 (subnormal) by at
    # most half its spacing, 2^-10, times its block's scale
    err = (back - x).abs()
    bound = torch.maximum(x.abs() * 2.0 ** -4, scale_NB.repeat_interleave(128, 1) * 2.0 ** -10)
    assert torch.all(err <= bound * (1 + 1e-9)), (err / bound).max()
    assert err.max() > 0  # it does quantise
    # per block, the small half of row 4 and the block of row 6 without the outlier keep e4m3's relative precision
    # (one scale per row would push them into subnormals, off by up to 2^-10 of the row's scale: most of them by
    # far more than 2^-4 of themselves)
    for r, b in ((4, 0), (6, 1)):
        cols = slice(128 * b, 128 * (b + 1))
        normal = x[r, cols].abs() >= 2.0 ** -6 * scale_NB[r, b]
        assert normal.float().mean() > 0.9
        assert torch.all(err[r, cols][normal] <= x[r, cols].abs()[normal] * 2.0 ** -4 * (1 + 1e-9))


def test_a_row_on_the_grid_crosses_unchanged():
    x = rows_of_fp8(fp8_rows(_rows(torch.Generator().manual_seed(1))), torch.float64)
    assert torch.equal(rows_of_fp8(fp8_rows(x), torch.float64), x)
    assert torch.equal(rows_of_fp8(fp8_rows(x.bfloat16()), torch.float64), x)  # bf16 holds e4m3 values exactly
    x258 = torch.cat([x, x[:, :2]], dim=1)  # a third block of values on the first's grid: on its own too
    for rows in (x258, x258[5:6], x[5:6]):  # scale bytes off a 4-byte boundary; one row
        assert torch.equal(rows_of_fp8(fp8_rows(rows), torch.float64), rows)


def test_wire_rows_padded_to_an_alignment_carry_the_same_rows():
    """``align``: the nvlink wire pads each row to a multiple of 64 bytes (zeros after the scales); dequantised into
    a given buffer, the rows equal the unpadded wire's."""
    x = _rows(torch.Generator().manual_seed(3))
    packed = fp8_rows(x, align=64)
    assert packed.shape == (64, 320) and torch.equal(packed[:, 264:], torch.zeros(64, 56, dtype=torch.uint8))
    assert torch.equal(packed[:, :264], fp8_rows(x))
    out = torch.full((64, 256), float("nan"), dtype=torch.bfloat16)
    assert rows_of_fp8(packed, torch.bfloat16, D=256, out=out) is out
    assert torch.equal(out.double(), rows_of_fp8(fp8_rows(x), torch.float64))


def test_deepep_refuses_the_wire():
    from components.errors import UserError
    from components.moe_echo.backends import build_dispatcher
    from components.moe_echo.config import MoEEchoConfig

    class Group:
        def size(self):
            return 2

    with pytest.raises(UserError, match=r"dispatch_precision = 'fp8' needs dispatcher 'nvlink', 'padded', "
                                        r"'hierarchical' or 'alltoall' \(this run's is 'deepep'\)"):
        build_dispatcher(MoEEchoConfig(dispatcher="deepep", dispatch_precision="fp8"), 8, Group(), 2, on_cuda=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D", [2048, 258])  # 258: the scale bytes start off a 4-byte boundary
def test_fp8_wire_kernel_on_gpu_equals_the_torch_path(dtype, D):
    """On CUDA the rows are quantised by the Triton kernel: bit for bit the CPU (torch) path's bytes, both ways."""
    x = torch.randn(300, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    x[1] *= 1e-6
    x[2] *= 1e4
    x[3] = 0.0
    x[4, : D // 2] *= 1e-3
    x = x.to(dtype)
    x[5] = rows_of_fp8(fp8_rows(x[5:6]), dtype)[0]  # a row already on the grid
    packed = fp8_rows(x.cuda())
    assert torch.equal(packed.cpu(), fp8_rows(x))
    back = rows_of_fp8(packed, dtype)
    assert torch.equal(back.cpu(), rows_of_fp8(fp8_rows(x), dtype)) and torch.equal(back[5].cpu(), x[5])
    B = -(-D // 128)
    assert fp8_rows(x[:0].cuda()).shape == (0, D + 4 * B)
    padded = fp8_rows(x.cuda(), align=64)  # the nvlink wire's rows: written in place by the kernel where D % 4 == 0
    assert torch.equal(padded[:, :D + 4 * B].cpu(), fp8_rows(x)) and not padded[:, D + 4 * B:].any()
    out = torch.empty(300, D, dtype=dtype, device="cuda")
    assert torch.equal(rows_of_fp8(padded, dtype, D=D, out=out).cpu(), rows_of_fp8(fp8_rows(x), dtype))
