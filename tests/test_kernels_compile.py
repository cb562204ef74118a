"""Kernels no interpreter test runs (FP8 casts, the FP8 cross-entropy backward, the fused master-weight AdamW, also
writing FP8 copies, the nvlink expand writing FP8 rows) compile for sm_90 on a machine without a GPU: their wrappers
launch them on CPU tensors with launches recorded, not executed (tests/sm90_compile.py, SM90_COMPILE_ONLY), then
Triton compiles each launch to a cubin."""

from test_kernels import _interpret, needs_cpu_interpreter, run_in_interpreter

_SCRIPT = r"""
import os
os.environ["SM90_COMPILE_ONLY"] = "1"
import torch
from kernels import adamw, fp8
fp8._on_kernels = lambda x: True  # the CUDA branch of every wrapper, on CPU tensors
FP8 = fp8.FP8
fp8.gather_quant_rows(torch.randn(5, 300).bfloat16(), torch.tensor([4, 0, 0, 2]))
for n_valid in (None, torch.tensor([3], dtype=torch.int32)):
    fp8.quant_rows(torch.randn(5, 300).bfloat16(), n_valid)
    for bf16 in (True, False):  # with the bf16 copies, and the FP8 rows alone
        fp8.swiglu_quant(torch.randn(5, 2 * 96).bfloat16(), n_valid, bf16)
        fp8.swiglu_quant_bwd(torch.randn(5, 96).bfloat16(), torch.randn(5, 2 * 96).bfloat16(), n_valid, bf16)
for tile in (None, "m1", "m2_w4_split"):  # the default, one padded part, three parts (88 = 64 + 16 + 8)
    fp8.quant_rows(torch.randn(5, 300).bfloat16(), tile=tile)
    fp8.swiglu_quant(torch.randn(5, 2 * 88).bfloat16(), bf16=False, tile=tile)
    fp8.swiglu_quant_bwd(torch.randn(5, 88).bfloat16(), torch.randn(5, 2 * 88).bfloat16(), bf16=False, tile=tile)
w1, w3 = torch.randn(4, 96, 64), torch.randn(4, 96, 64)
fp8.cast_experts_scaled((w1, w3), torch.empty(4, 192, 64, dtype=FP8), torch.ones(4))
fp8.cast_experts_t(w1, torch.ones(4), torch.empty(4, 64, 192, dtype=FP8), 96)
for dtype in (FP8, fp8.FP8_GRAD):  # the output head's casts: one scale, both layouts
    fp8.cast_both(torch.randn(70, 48).bfloat16(), dtype)
from kernels import cross_entropy as ce
ce._use_triton = lambda *ts: True
x, labels = torch.randn(9, 300).bfloat16(), torch.tensor([3, -100, 299, 0, 5, 6, 7, 8, 9])
ce.cross_entropy_bwd_fp8(x, labels, torch.zeros(9), torch.ones(()), torch.full((), 8.0), -100)
adamw._use_triton = lambda t: True
step = torch.ones((), dtype=torch.float32)
for param_dtype in (torch.bfloat16, torch.float32):
    p, g, w, m, v = (torch.zeros(1000, dtype=param_dtype),) + tuple(torch.zeros(1000) for _ in range(4))
    adamw.adamw_master_(p, g, w, m, v, 1e-3, step, 0.9, 0.95, 1e-8, 0.1)
    adamw.adamw_master_(p, g, w, m, v, torch.full((), 1e-3), step, 0.9, 0.95, 1e-8, 0.1, skip=torch.zeros(()),
                        grad_mul=torch.ones(()))
# FP8 copies written in the optimizer's pass ([w1; w3] halves and a whole w2), their recast and transposition
E, H, D = 3, 40, 24
plain, step = torch.empty(E, 2 * H, D, dtype=FP8), torch.ones(())
c = fp8.Fp8Copy(plain, H, torch.ones(E), torch.zeros(E))
g13, p13 = torch.zeros(E, 2 * H, D).bfloat16(), torch.zeros(E, 2 * H, D).bfloat16()
w, m, v = (torch.zeros(E, H, D) for _ in range(3))
adamw.adamw_master_(p13[:, H:], g13[:, H:], w, m, v, torch.full((), 1e-3), step, 0.9, 0.95, 1e-8, 0.1,
                    skip=torch.zeros(()), fp8=c)
adamw.adamw_master_(torch.zeros(E, H, D).bfloat16(), torch.zeros(E, H, D).bfloat16(), w, m, v, 1e-3, step, 0.9,
                    0.95, 1e-8, 0.1, fp8=c)
adamw.adamw_master_(None, torch.zeros(E, H, D).bfloat16(), w, m, v, 1e-3, step, 0.9, 0.95, 1e-8, 0.1, fp8=c)
fp8.recast_moved_(w, c, torch.ones(E))
fp8.transpose_copy_(plain, torch.empty(E, D, 2 * H, dtype=FP8))
# the nvlink dispatcher's local expand writing FP8 rows beside the bf16 ones
from kernels import peer_rows
buf, row_TK = torch.zeros(16, 300).bfloat16(), torch.tensor([[3, -1], [0, 9], [-1, -1], [5, 6], [1, 2]], dtype=torch.int32)
for plain in (True, False):  # with the bf16 rows, and the FP8 rows alone
    peer_rows.peer_scatter(torch.randn(5, 300).bfloat16(), None, row_TK, torch.zeros(1, dtype=torch.int64), [buf],
                           fp8_out=(torch.empty(16, 300, dtype=FP8), torch.empty(16)), plain=plain)
# the combine's backward writing its gradient rows as FP8 rows, with and without the bf16 rows
from kernels import moe_rows
moe_rows._use_triton = lambda *ts: True
for plain in (True, False):
    moe_rows.combine_backward(torch.randn(4, 300).bfloat16(), torch.randn(8, 300).bfloat16(), torch.rand(4, 2),
                              torch.arange(8, dtype=torch.int32).view(4, 2), grad_y_out=torch.empty(8, 300).bfloat16(),
                              fp8_out=(torch.empty(8, 300, dtype=FP8), torch.empty(8)), plain=plain)
print("LAUNCHED-OK")
"""


@needs_cpu_interpreter
def test_fp8_and_adamw_kernels_compile_for_sm90():
    p = _interpret(_SCRIPT)
    run_in_interpreter(_SCRIPT, "LAUNCHED-OK", p)
    compiled = p.stderr.split("SM90-COMPILED", 1)[1].splitlines()[0]
    for kernel in ("_quant_rows_kernel", "_cast_amax_kernel", "_recast_kernel", "_cast_experts_t_kernel",
                   "_swiglu_quant_kernel", "_swiglu_quant_bwd_kernel", "_adamw_kernel", "_transpose_kernel",
                   "_cross_entropy_bwd_kernel", "_scatter_rows_kernel", "_combine_bwd_kernel"):
        assert kernel in compiled.split(": ", 1)[1].split(), compiled  # launched, so compiled (not a torch fallback)
