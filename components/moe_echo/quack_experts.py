"""Grouped SwiGLU experts on QuACK's CuTe-DSL grouped GEMMs (``[moe_echo] experts_gemm = "quack"``).

Same math and weight layout as ``experts.grouped_swiglu`` (x_ND expert-major, offsets from counts_E),
four GEMM kernels instead of three GEMMs plus SwiGLU kernels, each with the elementwise work in its
epilogue:

    forward   preact_N2H, h_NH = x_ND @ [w1; w3]ᵀ  with h = silu(gate) · up in the epilogue
              y_ND             = h_NH @ w2ᵀ
    backward  dpreact_N2H, h   = dy @ w2  with SwiGLU's backward (and h recomputed) in the epilogue
              dx = dpreact @ [w1; w3],  d[w1; w3] = dpreactᵀ @ x,  dw2 = dyᵀ @ h   (per expert)

``preact`` holds gate and up interleaved by column pairs (QuACK's layout); the weights stay
``[w1; w3]`` concatenated (``concat_layout``). Rows at or past offs[-1] (padding of fixed-capacity
buffers) are neither read nor written. The offsets stay on the device: no host read, capturable.

Needs ``pip install quack-kernels`` (nvidia-cutlass-dsl) and an SM90 GPU; ``check_quack_supported``
gives the one-line error otherwise.
"""

import functools

import torch

from components.errors import UserError


@functools.cache
def _quack():
    """quack.gemm_interface, imported on first use (quack is an optional dependency)."""
    from quack import gemm_interface

    return gemm_interface


def check_quack_supported(device: torch.device) -> None:
    """One-line error unless QuACK's grouped GEMMs can run on ``device`` (SM90 GPU, quack importable)."""
    fix = 'set experts_gemm = "torch"'
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        where = device.type if device.type != "cuda" else torch.cuda.get_device_name(device)
        raise UserError(f'[moe_echo] experts_gemm = "quack" needs a Hopper (SM90) GPU; this run is on {where}: {fix}')
    try:
        _quack()
    except ImportError as exc:
        raise UserError(f'[moe_echo] experts_gemm = "quack" needs quack-kernels ({exc}): '
                        f'pip install "moe-echo[quack]", or {fix}') from None


class _QuackSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, w13_E2HD, w2_EDH, cu_E1):
        q = _quack()
        N, H2 = x_ND.shape[0], w13_E2HD.shape[1]
        preact_N2H = x_ND.new_empty(N, H2)
        h_NH = x_ND.new_empty(N, H2 // 2)
        q.gemm_gated_out(x_ND, w13_E2HD.transpose(-2, -1), preact_N2H, h_NH, cu_seqlens_m=cu_E1, concat_layout="B")
        y_ND = q.gemm(h_NH, w2_EDH.transpose(-2, -1), cu_seqlens_m=cu_E1)
        ctx.save_for_backward(x_ND, w13_E2HD, w2_EDH, preact_N2H, cu_E1)
        return y_ND

    @staticmethod
    def backward(ctx, dy_ND):
        q = _quack()
        x_ND, w13_E2HD, w2_EDH, preact_N2H, cu_E1 = ctx.saved_tensors
        dy_ND = dy_ND.contiguous()
        dpreact_N2H = torch.empty_like(preact_N2H)
        h_NH = x_ND.new_empty(x_ND.shape[0], preact_N2H.shape[1] // 2)
        q.gemm_dgated_out(dy_ND, w2_EDH, preact_N2H, dpreact_N2H, h_NH, cu_seqlens_m=cu_E1)
        dx_ND = q.gemm(dpreact_N2H, w13_E2HD, cu_seqlens_m=cu_E1, concat_layout=("B",), dynamic_scheduler=True)
        dw13_E2HD = q.gemm(dpreact_N2H.T, x_ND, cu_seqlens_k=cu_E1, concat_layout=("out",), dynamic_scheduler=True)
        dw2_EDH = q.gemm(dy_ND.T, h_NH, cu_seqlens_k=cu_E1, dynamic_scheduler=True)
        return dx_ND, dw13_E2HD, dw2_EDH, None


def quack_swiglu(x_ND, w13_E2HD, w2_EDH, counts_E):
    """y_ND of the experts on expert-major rows (bf16 on an SM90 GPU), gate and up weights concatenated."""
    cu_E1 = torch.zeros(counts_E.shape[0] + 1, dtype=torch.int32, device=x_ND.device)
    torch.cumsum(counts_E, 0, dtype=torch.int32, out=cu_E1[1:])
    return _QuackSwiGLU.apply(x_ND.to(torch.bfloat16).contiguous(), w13_E2HD.to(torch.bfloat16),
                              w2_EDH.to(torch.bfloat16), cu_E1)


def quack_grouped_swiglu(x_ND, w1_EHD, w2_EDH, w3_EHD, counts_E):
    """``quack_swiglu`` on the separate weights (they are concatenated here, one copy)."""
    return quack_swiglu(x_ND, torch.cat([w1_EHD, w3_EHD], dim=1), w2_EDH, counts_E)
