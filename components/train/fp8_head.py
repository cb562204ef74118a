"""The output head in FP8 (tensorwise scaling, Hopper): its logits and weight gradient in FP8, its input gradient
in bf16 by default.

    head = Fp8Head.from_linear(model.output)     # the same weight Parameter: "output.weight" as before
    logits_BSV = head(h_BSD)                     # bf16; _scaled_mm of e4m3 h and W, one scale each
    loss = lm_loss(logits_BSV, labels_BS)        # the loss writes dlogits in bf16 and, transposed, in FP8 for
                                                 # the weight gradient (both backward GEMMs in FP8: never in bf16)

``fp8_gemms`` names the GEMMs that run in FP8 as torchao's tensorwise ``Float8Linear`` runs them: ``output``
(the logits), ``grad_input`` (the gradient into the network), ``grad_weight``; the others run in bf16 on
unquantised operands. Measured over 500 steps (docs/performance.md, FP8, Loss): with
all three in FP8 the loss ends ~2% above the bf16 head's, outside the noise floor; with ``grad_input`` or
``grad_weight`` in bf16 it ends within. The default, ``("output", "grad_weight")``, ended closest to bf16's.

The gradient of the logits, [tokens, vocab] and the largest activation gradient of the step, comes from the
cross-entropy's backward in the forms the head's backward GEMMs read, written in its one pass over the logits
(``cross_entropy_bwd_fp8``): in e5m2 with a scale it knows before computing a value (|softmax − one-hot| <= 1),
row by row for an FP8 input gradient, transposed for an FP8 weight gradient, and in bf16 where either GEMM is
bf16. Under torchao the loss writes it in bf16, then the head reads it for its amax, then again to cast and
transpose it. The handover (``Fp8GradHandoff``), per forward and backward:

    head forward    offer(logits, rows, cols): the tensor the loss may take the FP8 gradient path for
    loss forward    handoff_of(logits) -> the handoff where logits is that very tensor, unmodified (else None)
    loss backward   put(Fp8Grad) -> autograd's gradient for the logits: the bf16 one where written, else a zero
                    tensor broadcast to logits' shape
    head backward   take(grad) -> the FP8 forms where grad is what put returned, untouched; where something else
                    used the logits too, grad is the sum and the head casts it (the FP8 one added where no bf16
                    one was written: never lost)

Scales: powers of two on the device (kernels/fp8.py), e4m3 for h and W, e5m2 for the gradient (torchao's
choice for gradients). Saved for backward: h and W in FP8, transposed, where an FP8 GEMM reads them (half
the bytes of bf16). No host read: a CUDA graph captures it. Not compiled (``eager_only``): its casts are
kernels of its own, and the handover is Python state.
"""

import torch
from torch import nn

from kernels.cross_entropy import Fp8Grad
from kernels.fp8 import FP8, FP8_GRAD, cast_both


def scaled_mm(a_q, b_q, s_a, s_b, out_dtype):
    """(a_q · s_a) @ (b_q · s_b): a [M, K] row-major, b [K, N] column-major, one fp32 scale each (0-d)."""
    return torch._scaled_mm(a_q, b_q, scale_a=s_a, scale_b=s_b, out_dtype=out_dtype)


class Fp8GradHandoff:
    """Carries one logits tensor's gradient from the loss's backward to the head's backward, in FP8."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype  # the FP8 dtype the head reads its gradient in
        self.forms = (True, True, False)  # (rows, cols, plain): the forms the loss writes (``cross_entropy_bwd_fp8``)
        self._key = None  # (data_ptr, numel, last dim, version) of the logits the head returned last
        self._grad = None  # the Fp8Grad put by the loss, until the head takes it
        self._given = None  # (the gradient the loss returned to autograd, its version)
        self._dtype = None  # the logits' dtype (autograd casts a gradient of another dtype)

    @staticmethod
    def _key_of(t: torch.Tensor):
        return t.data_ptr(), t.numel(), t.shape[-1], t._version

    def offer(self, logits: torch.Tensor, rows: bool, cols: bool) -> None:
        """``rows``/``cols``: the head's input/weight gradient GEMM reads the gradient in FP8 (rows: [T, V], cols:
        transposed); the loss writes the bf16 gradient too unless both do."""
        self._key, self._grad, self._given, self._dtype = self._key_of(logits), None, None, logits.dtype
        self.forms = (rows, cols, not (rows and cols))

    def matches(self, logits: torch.Tensor) -> bool:
        """True where ``logits`` is (a view of) what the head returned, not modified since."""
        return self._key is not None and self._key_of(logits) == self._key and logits.is_contiguous()

    def put(self, grad: Fp8Grad) -> torch.Tensor:
        self._grad = grad
        given = grad.g_NV  # no bf16 form: both GEMMs read FP8, q_NV among them
        if given is None:
            given = torch.zeros((), dtype=self._dtype, device=grad.q_NV.device).expand(grad.q_NV.shape)
        self._given = (given, given._version)
        return given

    def take(self, grad: torch.Tensor) -> tuple[Fp8Grad | None, torch.Tensor | None]:
        """(fp8, grad): ``fp8`` the Fp8Grad the loss put where ``grad`` is what ``put`` returned, unmodified (grad
        is then its bf16 form, None where not written); otherwise fp8 is None and grad is the whole gradient
        (the FP8 one dequantised and added where the loss wrote no bf16 one)."""
        fp8, given, self._grad, self._given, self._key = self._grad, self._given, None, None, None
        if fp8 is None:
            return None, grad
        t, version = given
        if (grad.data_ptr() == t.data_ptr() and grad.numel() == t.numel() and grad.stride()[-1] == t.stride()[-1]
                and grad._version == version):
            return fp8, fp8.g_NV
        if fp8.g_NV is not None:  # the sum already holds the loss's bf16 gradient
            return None, grad
        return None, grad + (fp8.q_NV.float() * fp8.s).to(grad.dtype).view(grad.shape)


def handoff_of(logits: torch.Tensor) -> Fp8GradHandoff | None:
    """The handoff of the FP8 head that returned ``logits`` (or the tensor it views), if it still matches."""
    handoff = getattr(logits, "fp8_grad_handoff", None) or getattr(logits._base, "fp8_grad_handoff", None)
    return handoff if handoff is not None and handoff.matches(logits) else None


GEMMS = ("output", "grad_input", "grad_weight")  # the head's GEMMs, torchao's names: logits, dh, dW


class _Fp8HeadFn(torch.autograd.Function):
    """The head's three GEMMs, those named in ``gemms`` in FP8, the others in the input's dtype (bf16) on
    unquantised operands. The gradient comes from the loss in FP8 only where both backward GEMMs are FP8."""

    @staticmethod
    def forward(ctx, h_TD, w_VD, handoff, out_dtype, gemms):
        fwd8, dgrad8, wgrad8 = (g in gemms for g in GEMMS)
        if fwd8 or wgrad8:
            qh_TD, qh_DT, s_h = cast_both(h_TD, FP8)
        if fwd8 or dgrad8:
            qw_VD, qw_DV, s_w = cast_both(w_VD, FP8)
        w_hp = None if fwd8 and dgrad8 else w_VD.to(out_dtype)
        ctx.save_for_backward(*((qw_DV, s_w) if dgrad8 else (w_hp, None)), *((qh_DT, s_h) if wgrad8 else (h_TD, None)))
        ctx.handoff, ctx.dtypes, ctx.gemms = handoff, (h_TD.dtype, w_VD.dtype), (dgrad8, wgrad8)
        return scaled_mm(qh_TD, qw_VD.t(), s_h, s_w, out_dtype) if fwd8 else h_TD @ w_hp.t()

    @staticmethod
    def backward(ctx, g_TV):
        w, s_w, h, s_h = ctx.saved_tensors
        dgrad8, wgrad8 = ctx.gemms
        fp8, g_TV = ctx.handoff.take(g_TV) if dgrad8 or wgrad8 else (None, g_TV)
        if fp8 is None and (dgrad8 or wgrad8):
            fp8 = Fp8Grad(g_TV, *cast_both(g_TV.contiguous(), ctx.handoff.dtype))
        dh_TD = (scaled_mm(fp8.q_NV, w.t(), fp8.s, s_w, ctx.dtypes[0]) if dgrad8  # [T, V] @ [V, D]
                 else (g_TV @ w).to(ctx.dtypes[0]))
        dw_VD = (scaled_mm(fp8.q_VN, h.t(), fp8.s, s_h, ctx.dtypes[1]) if wgrad8  # [V, T] @ [T, D]
                 else (g_TV.t() @ h.to(g_TV.dtype)).to(ctx.dtypes[1]))
        return dh_TD, dw_VD, None, None, None


class Fp8Head(nn.Linear):
    """``nn.Linear`` without bias whose GEMMs named in ``fp8_gemms`` run in FP8."""

    eager_only = True  # components/parallel/compile.py leaves it uncompiled
    grad_dtype = FP8_GRAD  # the logits' gradient: e5m2, as torchao's tensorwise recipe casts gradients
    fp8_gemms = ("output", "grad_weight")  # the GEMMs in FP8, the others bf16 (benchmarks/fp8_head_gemms.py)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8Head":
        if linear.bias is not None:
            raise ValueError("Fp8Head: the output head has no bias")
        with torch.device("meta"):
            head = cls(linear.in_features, linear.out_features, bias=False)
        head.weight = linear.weight
        return head

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.handoff = Fp8GradHandoff(self.grad_dtype)

    def forward(self, h_BSD: torch.Tensor) -> torch.Tensor:
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else h_BSD.dtype
        gemms = tuple(g for g in GEMMS if g in self.fp8_gemms)
        logits_TV = _Fp8HeadFn.apply(h_BSD.reshape(-1, h_BSD.shape[-1]).to(dtype), self.weight, self.handoff, dtype,
                                     gemms)
        logits = logits_TV.view(*h_BSD.shape[:-1], -1)
        if self.takes_fp8_grad:
            self.handoff.offer(logits, rows="grad_input" in gemms, cols="grad_weight" in gemms)
            logits.fp8_grad_handoff = self.handoff
        return logits

    @property
    def fp8_backward(self) -> tuple[str, ...]:
        """The backward GEMMs in FP8 ("grad_input", "grad_weight")."""
        return tuple(g for g in GEMMS[1:] if g in self.fp8_gemms)

    @property
    def takes_fp8_grad(self) -> bool:
        """True where the loss writes the logits' gradient in FP8 for the head: a backward GEMM is FP8."""
        return bool(self.fp8_backward)
