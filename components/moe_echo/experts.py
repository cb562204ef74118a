"""Grouped SwiGLU experts.

Weight layout (torchtitan's, so its checkpoints and HF state-dict adapters load unchanged):
    w1_EHD, w3_EHD: [E, H, D]  gate and up projections,   w2_EDH: [E, D, H]  down projection.
For the rows x_ND of expert e:  y = (silu(x @ w1[e]ᵀ) * (x @ w3[e]ᵀ)) @ w2[e]ᵀ.

Input rows are expert-major: rows [offs[e-1], offs[e]) belong to expert e, offs = cumsum(counts_E).
Rows at or past offs[-1] (padding of fixed-capacity buffers) produce zeros on the fallback path and
are unspecified on the grouped-GEMM path; callers never read them.

Paths (``GroupedExperts.precision = "fp8"``: FP8 GEMMs, components/moe_echo/fp8_experts.py;
``GroupedExperts.gemm = "quack"``: QuACK's grouped GEMMs on CUDA, components/moe_echo/quack_experts.py):
- CUDA + bf16 (or bf16 autocast): ``torch._grouped_mm`` with int32 offsets read from device memory (no host sync);
  experts outside FSDP (cast for compute) run the gate and up projections as one GEMM against [w1; w3]
  (``grouped_swiglu13``), which their one-pass cast concatenates for free.
- otherwise (CPU, fp32/fp64 references): a per-expert loop that reads the counts on the host.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from components.tensors import local_of, shape_only
from kernels.cast import cast_scale
from kernels.swiglu import swiglu, swiglu13

from .fp8_experts import Fp8WeightCopies, fp8_grouped_swiglu
from .quack_experts import quack_grouped_swiglu, quack_swiglu
from .weight_copies import WeightCopies, WeightCopy


def grouped_swiglu(
    x_ND: torch.Tensor, w1_EHD: torch.Tensor, w2_EDH: torch.Tensor, w3_EHD: torch.Tensor, counts_E: torch.Tensor
) -> torch.Tensor:
    if x_ND.is_cuda and (x_ND.dtype == torch.bfloat16 or _autocast_bf16()):
        return _grouped_mm_swiglu(x_ND.to(torch.bfloat16), w1_EHD, w2_EDH, w3_EHD, counts_E)
    return _looped_swiglu(x_ND, w1_EHD, w2_EDH, w3_EHD, counts_E)


W13 = 13  # ``extend``'s index of [w1; w3] (GroupedExperts.forward): its own clone buffer


def grouped_swiglu13(x_ND: torch.Tensor, w13_E2HD: torch.Tensor, w2_EDH: torch.Tensor,
                     counts_E: torch.Tensor) -> torch.Tensor:
    """``grouped_swiglu`` with the gate and up weights concatenated ([w1; w3] along dim 1): one GEMM gives
    [gate | up] per row, so its backward gives x's gradient in one GEMM (two GEMMs would leave two [N, D]
    gradients for autograd to sum)."""
    H = w13_E2HD.shape[1] // 2
    if not (x_ND.is_cuda and (x_ND.dtype == torch.bfloat16 or _autocast_bf16())):
        return _looped_swiglu(x_ND, w13_E2HD[:, :H], w2_EDH, w13_E2HD[:, H:], counts_E)
    offs_E = torch.cumsum(counts_E, dim=0, dtype=torch.int32)
    w13, w2 = w13_E2HD.to(torch.bfloat16), w2_EDH.to(torch.bfloat16)
    ab_N2H = torch._grouped_mm(x_ND.to(torch.bfloat16), w13.transpose(-2, -1), offs=offs_E)
    h_NH = swiglu13(ab_N2H, offs_E[-1:])  # used rows only
    return torch._grouped_mm(h_NH, w2.transpose(-2, -1), offs=offs_E)


def _autocast_bf16() -> bool:
    return torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16


def _grouped_mm_swiglu(x_ND, w1_EHD, w2_EDH, w3_EHD, counts_E):
    offs_E = torch.cumsum(counts_E, dim=0, dtype=torch.int32)
    w1, w2, w3 = (w.to(torch.bfloat16) for w in (w1_EHD, w2_EDH, w3_EHD))
    h_NH = swiglu(torch._grouped_mm(x_ND, w1.transpose(-2, -1), offs=offs_E),
                  torch._grouped_mm(x_ND, w3.transpose(-2, -1), offs=offs_E), offs_E[-1:])  # used rows only
    return torch._grouped_mm(h_NH, w2.transpose(-2, -1), offs=offs_E)


def _looped_swiglu(x_ND, w1_EHD, w2_EDH, w3_EHD, counts_E):
    sizes = counts_E.tolist()  # host read: this path is for CPU and references only
    used = sum(sizes)
    outs = []
    for e, x_nD in enumerate(torch.split(x_ND[:used], sizes)):
        h = F.silu(x_nD @ w1_EHD[e].t().to(x_nD.dtype)) * (x_nD @ w3_EHD[e].t().to(x_nD.dtype))
        outs.append(h @ w2_EDH[e].t().to(x_nD.dtype))
    outs.append(x_ND.new_zeros(x_ND.shape[0] - used, w2_EDH.shape[1]))
    return torch.cat(outs)


class _ComputeCast(torch.autograd.Function):
    """w.to(dtype); backward: the gradient in w's dtype times ``grad_scale``, in one pass."""

    @staticmethod
    def forward(ctx, w, dtype, grad_scale):
        ctx.w_dtype, ctx.grad_scale = w.dtype, grad_scale
        return w.to(dtype)

    @staticmethod
    def backward(ctx, grad):
        return cast_scale(grad, ctx.w_dtype, ctx.grad_scale), None, None


class _ComputeCastCat(torch.autograd.Function):
    """[w1; w3] concatenated along dim 1 in ``dtype``, cast and copied in one pass; backward: each half of
    the gradient (read in place) in the weights' dtype times ``grad_scale``."""

    @staticmethod
    def forward(ctx, w1, w3, dtype, grad_scale):
        ctx.w_dtype, ctx.grad_scale, ctx.split = w1.dtype, grad_scale, w1.shape[1]
        out = torch.empty(w1.shape[0], w1.shape[1] + w3.shape[1], *w1.shape[2:], dtype=dtype, device=w1.device)
        return torch.cat([w1, w3], dim=1, out=out)

    @staticmethod
    def backward(ctx, grad):
        h = ctx.split
        return (cast_scale(grad[:, :h], ctx.w_dtype, ctx.grad_scale), cast_scale(grad[:, h:], ctx.w_dtype, ctx.grad_scale),
                None, None)


class _OptimizerCopy(torch.autograd.Function):
    """A weight's persistent low-precision copy (``copy.compute``, written by the optimizer step) as the
    weight's differentiable stand-in. Backward sums the gradient, in the copy's dtype, into ``copy.grad`` and
    gives the weight none: the optimizer (components/train/master_adamw.py, ``AdamWWithCopies``) divides,
    clips and applies it, writing the next copy in the same pass (components/moe_echo/weight_copies.py).

    The input is the weight itself, never ``w.to_local()``: torch 2.11 runs to_local's backward on the None
    returned here and gives the weight a zero ``.grad``, which torch's AdamW would then apply as a second step."""

    @staticmethod
    def forward(ctx, w, copy: WeightCopy):
        ctx.copy = copy
        return copy.compute.detach()  # the copy itself (an alias): no per-step cast

    @staticmethod
    def backward(ctx, grad):
        ctx.copy.add_grad(grad)
        return None, None


class _Halves13(torch.autograd.Function):
    """[w1; w3] held as one tensor whose halves are w1's and w3's (their compute copies, or one GPU's bf16
    parameters moved there once: GroupedExperts._shared_13): that tensor itself, no concatenation per step.
    Backward hands each half of the gradient, in place, to w1 and w3: into ``copies`` (w1's and w3's
    WeightCopy: their ``grad``, for AdamWWithCopies) where given, else into the parameters' own ``.grad``
    (the optimizer's kernel reads such halves: kernels/adamw.py). Its inputs are the weights themselves
    (see ``_OptimizerCopy``)."""

    @staticmethod
    def forward(ctx, w1, w3, w13, copies: tuple[WeightCopy, WeightCopy] | None):
        ctx.params, ctx.copies = (w1, w3), copies
        return w13.detach()

    @staticmethod
    def backward(ctx, grad13):
        h = grad13.shape[1] // 2
        halves = (grad13[:, :h], grad13[:, h:])
        if ctx.copies is not None:
            for c, g in zip(ctx.copies, halves):
                c.add_grad(g)
        else:
            for p, g in zip(ctx.params, halves):
                p.grad = g if p.grad is None else p.grad + g
        return None, None, None, None


class GroupedExperts(nn.Module):
    """E SwiGLU experts held as three stacked weights (see the module docstring for the layout)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, precision: str = "bf16", gemm: str = "torch",
                 fp8_scaling: str = "expert", wgrad_precision: str = "bf16"):
        super().__init__()
        self.num_experts = num_experts
        self.precision = precision  # "bf16" | "fp8": the GEMMs' precision (weights keep their dtype)
        self.fp8_scaling = fp8_scaling  # "expert" | "channel": FP8 weight scales per expert or per output channel
        self.wgrad_precision = wgrad_precision  # "bf16" | "fp8": the FP8 experts' weight-gradient GEMMs
        self.gemm = gemm  # "torch" | "quack": the kernels of the bf16 GEMMs on CUDA
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        # where FSDP does not manage the weights (each expert owned by one rank), the GEMMs' dtype
        # (bf16 from fp32 weights, as FSDP's MixedPrecisionPolicy would give) and the gradient divisor
        self.compute_dtype: torch.dtype | None = None
        self._grad_divide = 1.0
        self._grad_hooks: list = []
        self.compute_copies = False  # enable_compute_copies: the optimizer writes the compute dtype's copies
        self.fp8_copies: Fp8WeightCopies | None = None  # enable_fp8_copies: the optimizer writes the FP8 copies
        self.copies = WeightCopies()  # w1, w2, w3 -> what the optimizer writes for them (either of the two above)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the weights' gradients by ``factor`` (FSDPModule's method of the same name, for weights
        FSDP does not manage): every rank's tokens reach each expert, so its gradient sums the
        ranks' per-rank mean losses."""
        self._grad_divide = float(factor)
        for c in self.copies.values():
            c.grad_divide = self._grad_divide
        if not self._grad_hooks:
            for w in (self.w1, self.w2, self.w3):
                self._grad_hooks.append(w.register_hook(self._divide_grad))

    def _divide_grad(self, grad: torch.Tensor) -> torch.Tensor:
        if self.compute_dtype is not None or self._grad_divide == 1.0:
            return grad  # divided in the compute cast's backward (local_weights), or nothing to divide
        return grad / self._grad_divide

    def forward(self, x_ND: torch.Tensor | None, counts_e: torch.Tensor | None, extend=None,
                apply=None, fp8_rows=None) -> torch.Tensor:
        """counts_e: rows of each *local* expert; with expert parallelism the weights are DTensors
        sharded on dim 0 over the EP mesh and only this rank's e = E / EP experts are used.
        ``extend(w, i, out=None) -> w'`` appends echo-slot (clone) weights to local weight i (0, 1, 2: w1, w2, w3;
        ``W13``: [w1; w3]), into ``out``'s rows past w's where given (``out[:e]`` is w itself); it runs inside
        this forward so FSDP's unshard / gradient reduce-scatter hooks see every use. ``apply(w13, w2) -> y``
        (x_ND and counts_e unused): the experts' weights (``weights_13``) go to a caller's kernels instead of
        these GEMMs (the gathered experts, which read token rows themselves), still inside this forward.
        ``fp8_rows`` (``row_ops.Fp8Rows``): FP8 copies of x_ND and of y_ND's gradient that the dispatcher made as it
        moved the rows (FP8 experts read them instead of quantising; others ignore them)."""
        if apply is not None:
            return apply(*self.weights_13(extend, on_cuda=self.w1.is_cuda))
        quack = self.gemm == "quack" and x_ND.is_cuda
        if self.precision == "bf16" and (quack or self.compute_dtype is not None):
            # one gate/up GEMM on [w1; w3] (QuACK's layout, or free from the one-pass cast); ECHO clones it
            # whole, so the extended weights need no [w1; w3] concatenation and there is one multicast less
            w13, w2 = self.weights_13(extend, on_cuda=quack)
            return (quack_swiglu if quack else grouped_swiglu13)(x_ND, w13, w2, counts_e)
        weights = self.local_weights()
        copies = self.fp8_copies if self.precision == "fp8" else None
        if extend is not None and copies is not None and hasattr(extend, "fp8_weights"):
            # ECHO with FP8 copies: the clones' FP8 bytes copied into the copies' slot rows; the weights only
            # take the gradients (the clones' added into their home experts')
            copies = extend.fp8_weights(copies)
            weights = tuple(extend.slot_gradients(w, i) for i, w in enumerate(weights))
        elif extend is not None:  # the extended weights (clones appended), cast per call where FP8
            if copies is not None and self.compute_copies:
                raise ValueError("FP8 experts reading their FP8 copies take ECHO's clones from them "
                                 "(extend.fp8_weights): their compute copies hold no values to extend")
            weights, copies = tuple(extend(w, i) for i, w in enumerate(weights)), None
        if self.precision == "fp8":
            return fp8_grouped_swiglu(x_ND, *weights, counts_e, self._fp8_scale_hint(weights[0]), copies=copies,
                                      channels=self.fp8_scaling == "channel", rows=fp8_rows,
                                      wgrad_fp8=self.wgrad_precision == "fp8")
        if self.gemm == "quack" and x_ND.is_cuda:
            return quack_grouped_swiglu(x_ND, *weights, counts_e)
        return grouped_swiglu(x_ND, *weights, counts_e)

    def weights_13(self, extend=None, on_cuda: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """([w1; w3], w2) of this rank's experts, differentiable, extended with ECHO's clones by ``extend``: in bf16
        as the one gate/up GEMM reads them (``local_weights_13``) on CUDA or with a compute dtype, else in the
        weights' own dtype, [w1; w3] concatenated (CPU references)."""
        if self.precision == "bf16" and (on_cuda or self.compute_dtype is not None):
            w13, w2 = self.local_weights_13()
            if extend is not None:  # into the copies' spare rows where they have them (no concatenation)
                w13 = extend(w13, W13, getattr(self, "_full13", None))
                w2 = extend(w2, 1, getattr(self, "_full2", None))
            return w13, w2.to(w13.dtype)
        w1, w2, w3 = self.local_weights()
        if extend is not None:
            w1, w2, w3 = (extend(w, i) for i, w in enumerate((w1, w2, w3)))
        return torch.cat([w1, w3], dim=1), w2

    def _fp8_scale_hint(self, w1: torch.Tensor) -> torch.Tensor:
        """The FP8 weight scales of the previous step ([2, experts incl. echo slots], device; not saved):
        the FP8 path guesses with them and corrects on the device where they moved."""
        E = w1.shape[0]
        hint = getattr(self, "_fp8_hint", None)
        if hint is None or hint.shape[1] != E or hint.device != w1.device:
            hint = self._fp8_hint = torch.zeros(2, E, dtype=torch.float32, device=w1.device)
        return hint

    def enable_compute_copies(self, spare_rows: int = 0) -> None:
        """Experts outside FSDP (``compute_dtype`` set): keep each weight's local shard in ``compute_dtype`` as a
        persistent copy (``self.copies[w].compute``) that the optimizer step writes, instead of casting the fp32
        weights every forward and their gradients every backward. Gradients land in ``self.copies[w].grad``
        (compute dtype, not yet divided by its ``grad_divide``); ``w.grad`` stays None. Call
        ``refresh_compute_copies`` after loading weights (components/train/master_adamw.py).

        ``spare_rows`` (ECHO's slots per rank, bf16 GEMMs): the copies are rows [:e] of buffers of e + spare_rows
        experts ([w1; w3] and w2) whose last rows receive the clones, so the extended weights need no
        concatenation (``forward``'s ``extend(w, i, out)``)."""
        if self.compute_dtype is None:
            raise ValueError("compute copies are for experts with a compute_dtype (outside FSDP)")
        spare = spare_rows if self.precision == "bf16" else 0
        self._full13 = self._full2 = None
        cp1, cp2, cp3 = (self._copy_of(w) for w in (self.w1, self.w2, self.w3))
        for w, cp in ((self.w1, cp1), (self.w2, cp2), (self.w3, cp3)):
            cp.compute = local_of(w).detach().to(self.compute_dtype).contiguous()
            cp.grad, cp.grad_divide = None, self._grad_divide
        if self.precision == "bf16":  # w1's and w3's copies: halves of one [w1; w3] (the one gate/up GEMM)
            c1, c2, c3 = cp1.compute, cp2.compute, cp3.compute
            e, h = c1.shape[0], c1.shape[1]
            full13 = c1.new_zeros(e + spare, 2 * h, *c1.shape[2:])
            full13[:e, :h], full13[:e, h:] = c1, c3
            self._copy13 = full13[:e]
            cp1.compute, cp3.compute = self._copy13[:, :h], self._copy13[:, h:]
            if spare:
                full2 = c2.new_zeros(e + spare, *c2.shape[1:])
                full2[:e] = c2
                cp2.compute, self._full13, self._full2 = full2[:e], full13, full2
        self.compute_copies = True
        self._compute_copies_shape_only()

    def enable_fp8_copies(self, slots: int = 0) -> None:
        """FP8 experts whose optimizer writes their FP8 weight copies (``Fp8WeightCopies``; AdamWWithCopies and
        MasterAdamW, components/train/master_adamw.py, find them as ``self.copies[w].fp8 = (copies, role)``):
        the forward and the input gradient read them instead of casting the weights per call. Written here from
        the weights as they are; ``refresh_compute_copies`` rewrites them after weights were loaded. Nothing with
        per-channel scales (the copies hold one scale per expert). ``slots``: ECHO's slots per rank, expert rows
        after the copies' that receive the clones (``forward``'s ``extend.fp8_weights``)."""
        if self.precision != "fp8":
            raise ValueError("FP8 weight copies are for expert_precision = 'fp8'")
        if self.fp8_scaling == "channel":
            return
        w1, w2, w3 = (local_of(w).detach() for w in (self.w1, self.w2, self.w3))
        E, H, D = w1.shape
        self.fp8_copies = Fp8WeightCopies(E, H, D, w1.device, slots=slots)
        self.fp8_copies.write_(w1, w2, w3)
        for role, w in enumerate((self.w1, self.w2, self.w3), start=1):
            self._copy_of(w).fp8 = (self.fp8_copies, role)
        self._compute_copies_shape_only()

    def _compute_copies_shape_only(self) -> None:
        """With both FP8 copies and compute copies, the GEMMs read only the FP8 copies: the compute copies become
        stand-ins of their shape and dtype (``WeightCopy.compute_read`` False), which free their memory and which
        the optimizer step no longer writes."""
        if self.fp8_copies is None or not self.compute_copies:
            return
        for w in (self.w1, self.w2, self.w3):
            cp = self.copies[w]
            cp.compute, cp.compute_read = shape_only(cp.compute), False

    def _copy_of(self, w: nn.Parameter) -> WeightCopy:
        """``w``'s entry in ``self.copies``, created once (a map the optimizer was handed stays valid)."""
        if w not in self.copies:
            self.copies[w] = WeightCopy(grad_divide=self._grad_divide)
        return self.copies[w]

    def _new_forward(self) -> None:
        """A forward that will be differentiated: the compute gradients of the last step were applied."""
        if torch.is_grad_enabled():
            for w in (self.w1, self.w2, self.w3):
                self.copies[w].grad = None

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w2, w3) of this rank's experts as plain tensors (differentiable)."""
        params = (self.w1, self.w2, self.w3)
        if self.compute_copies:
            self._new_forward()
            return tuple(_OptimizerCopy.apply(w, self.copies[w]) for w in params)
        local = (local_of(w) for w in params)
        if self.compute_dtype is None:
            return tuple(local)
        return tuple(_ComputeCast.apply(w, self.compute_dtype, 1.0 / self._grad_divide) for w in local)

    def local_weights_13(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([w1; w3] concatenated along dim 1, w2) of this rank's experts in the compute dtype (bf16 where
        unset), differentiable: the layout of the one gate/up GEMM (``grouped_swiglu13``, QuACK's)."""
        if self.compute_copies:
            w1, w2, w3 = self.w1, self.w2, self.w3
            self._new_forward()
            copy13 = getattr(self, "_copy13", None)
            if copy13 is None:
                c1, c2, c3 = self.local_weights()
                return torch.cat([c1, c3], dim=1), c2
            copies13 = (self.copies[w1], self.copies[w3])
            return _Halves13.apply(w1, w3, copy13, copies13), _OptimizerCopy.apply(w2, self.copies[w2])
        w1, w2, w3 = (local_of(w) for w in (self.w1, self.w2, self.w3))
        if self.compute_dtype is None:
            w13 = self._shared_13()
            if w13 is not None:
                return _Halves13.apply(self.w1, self.w3, w13, None), w2  # into w1.grad, w3.grad
            return torch.cat([w1, w3], dim=1).to(torch.bfloat16), w2
        scale = 1.0 / self._grad_divide
        return (_ComputeCastCat.apply(w1, w3, self.compute_dtype, scale),
                _ComputeCast.apply(w2, self.compute_dtype, scale))

    def _shared_13(self) -> torch.Tensor | None:
        """[w1; w3] for QuACK without a per-step concatenation, where w1 and w3 are plain bf16 leaf parameters
        with nothing between them and their gradients (one GPU: bf16 parameters, fp32 masters in the
        optimizer): their data is moved once into the halves of one [E, 2H, D] tensor, which is returned.
        A later ``.to()`` replaces their data; the next call moves it again. None where this does not apply."""
        w1, w3 = self.w1, self.w3
        if (isinstance(w1, DTensor) or w1.dtype != torch.bfloat16 or w3.dtype != w1.dtype or self._grad_divide != 1.0
                or not w1.requires_grad):
            return None
        w13, h = getattr(self, "_w13", None), w1.shape[1]
        if (w13 is None or w13.dtype != w1.dtype or w13.device != w1.device or w1.data_ptr() != w13.data_ptr()
                or w3.data_ptr() != w13[:, h:].data_ptr()):
            with torch.no_grad():
                w13 = torch.cat([w1.detach(), w3.detach()], dim=1)
            w1.data, w3.data = w13[:, :h], w13[:, h:]
            self._w13 = w13
        return w13

    def init_weights(self, init_std: float) -> None:
        _trunc_normal(self.w1, 0.02)
        _trunc_normal(self.w2, init_std)
        _trunc_normal(self.w3, init_std)


class SwiGLU(nn.Module):
    """Dense SwiGLU FFN (shared experts). Names w1/w2/w3 match torchtitan's FeedForward."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float) -> None:
        _trunc_normal(self.w1.weight, 0.02)
        _trunc_normal(self.w2.weight, init_std)
        _trunc_normal(self.w3.weight, init_std)


def _trunc_normal(t: torch.Tensor, std: float) -> None:
    nn.init.trunc_normal_(t, mean=0.0, std=std, a=-2 * std, b=2 * std)
