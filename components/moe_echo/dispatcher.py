"""The token-dispatcher interface every backend implements, and the ``local`` backend (EP=1).

    dispatch(x_TD, ids_TK, w_TK) -> (x_ND, counts_e, handle)
        x_ND: the rows this rank's experts process, expert-major (rows of local expert/slot j are
              contiguous and in order j = 0..e-1), N >= sum(counts_e) (fixed-capacity backends pad);
        counts_e: int64 rows per local expert/slot, on device;
        handle: a ``DispatchHandle`` with what combine needs (backend-specific), never read on the
                host by sync-free backends.
    combine(y_ND, handle) -> y_TD = Σ_k w_TK[t, k] · y(row of (t, k)), accumulated in fp32,
        returned in x_TD's dtype on the source rank (``nvlink``: each owner's share of the sum is
        accumulated in fp32 and crosses back in y's dtype; the source adds the shares in fp32).

Both are differentiable: gradients flow to x_TD, w_TK and y_ND.

Bases shared by the backends:
    ExpertParallel   E experts over R ranks (E divisible by R), e = E / R local ids each;
    FixedCapacity    static-shape buffers sized from ``capacity_factor`` (``capacity_rows``), which may
                     overflow: ``handle.dropped`` counts what was not sent, ``handle.needed_factor`` what
                     would have fit, and ``grow_capacity`` raises the factor between steps.
"""

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from .row_ops import Fp8Rows, gather_rows, weighted_combine


@dataclass(kw_only=True)
class DispatchHandle:
    """What every backend's handle carries for the layer and the training loop (device scalars)."""

    dropped: torch.Tensor | None = None  # int64: (token, choice) assignments not sent (fixed capacity)
    needed_factor: torch.Tensor | None = None  # fp32: the capacity_factor this dispatch needed
    network_rows: torch.Tensor | None = None  # int64: token rows sent to other hosts (across-host backends)
    fp8_rows: Fp8Rows | None = None  # the rows (and later their output's gradient) as FP8 rows, for FP8 experts


class Dispatcher(ABC):
    sync_free = False  # True: no host read on the step path (the step can be captured in a CUDA graph)
    fixed_capacity = False  # True: may overflow (counted in handle.dropped; the loop gates and replays)
    communicates = True  # False: one rank, nothing crosses (no side stream to hide communication behind)
    reentrant = False  # True: no per-layer buffers, so several dispatches of one layer may be alive at once
    overlap_from_ep = 0  # overlap_chunks = "auto" pipelines a layer in 2 chunks from this EP size on (0: never)
    overlap_needs_echo = False  # ... and only where ECHO levels the ranks' expert load
    echo_from_ep = 0  # echo = "auto" turns ECHO on from this EP size on (0: never)

    @abstractmethod
    def dispatch(
        self, x_TD: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, object]: ...

    @abstractmethod
    def combine(self, y_ND: torch.Tensor, handle: object) -> torch.Tensor: ...


class ExpertParallel(Dispatcher):
    """E experts (ids, echo slots included) over the R ranks of ``group``; e = E / R per rank."""

    wire = "bf16"  # how token rows cross on dispatch ("fp8": e4m3, a scale per 128 columns; not deepep)

    def __init__(self, num_experts: int, group, ep_size: int):
        if num_experts % ep_size != 0:
            raise ValueError(f"num_experts={num_experts} is not divisible by expert_parallel_degree={ep_size}")
        self.num_experts, self.group, self.ep_size = num_experts, group, ep_size
        self.num_local = num_experts // ep_size


def capacity_rows(capacity_factor: float, rows: int, multiple: int, ranks: int = 1) -> int:
    """round_up(ceil(capacity_factor · rows / ranks), multiple), at least ``multiple``."""
    need = math.ceil(round(capacity_factor * rows / ranks, 6))  # round: 1.1 * 10 is 11.000000000000002
    return max(multiple, -(-need // multiple) * multiple)


class FixedCapacity:
    """Mixin of the static-shape backends: buffers sized from ``capacity_factor``; overflow is counted
    on the device, gated and replayed by the training loop, which may grow the factor."""

    fixed_capacity = True
    sync_free = True

    def __init__(self, capacity_factor: float):
        self.capacity_factor = capacity_factor

    def grow_capacity(self, need: float) -> float:
        """Raise capacity_factor to max(1.25 × now, need) before the next step; returns the new one.
        (The next dispatch allocates the larger buffers; a captured graph must be re-captured.)"""
        self.capacity_factor = max(1.25 * self.capacity_factor, need)
        return self.capacity_factor


@dataclass
class LocalHandle(DispatchHandle):
    token_of_row_N: torch.Tensor  # source token of each dispatched row
    row_of_slot_TK: torch.Tensor  # dispatched row of each (token, choice) slot
    w_TK: torch.Tensor  # combine weights (fp32, differentiable)
    out_dtype: torch.dtype  # the local backend never drops: dropped stays None


class LocalDispatcher(Dispatcher):
    """All E experts on this rank. Expert-major order by a stable sort of the flat expert ids;
    N = T·K exactly. Everything stays on device: no host read, no boolean masks. ``fp8_rows`` (FP8 experts):
    bf16 rows are also handed over as FP8 rows (``handle.fp8_rows``), quantised by the gather and by combine's
    backward as they move the rows."""

    sync_free = True
    communicates = False
    reentrant = True

    def __init__(self, num_experts: int, fp8_rows: bool = False):
        self.num_experts = num_experts
        self.fp8_rows = fp8_rows

    def rows(self, ids_TK):
        """The expert-major rows of ``ids_TK`` without moving any token: (token_of_row_N, row_of_slot_TK,
        counts_E), int64 (what ``dispatch`` gathers by; experts that read token rows themselves take these)."""
        T, K = ids_TK.shape
        flat_ids_N = ids_TK.reshape(-1)
        slot_of_row_N = torch.argsort(flat_ids_N, stable=True)  # row n holds slot t*K+k
        row_of_slot_N = torch.empty_like(slot_of_row_N).scatter_(
            0, slot_of_row_N, torch.arange(T * K, device=ids_TK.device)
        )
        counts_E = torch.zeros(self.num_experts, dtype=torch.int64, device=ids_TK.device)
        counts_E.scatter_add_(0, flat_ids_N, torch.ones_like(flat_ids_N))
        return slot_of_row_N // K, row_of_slot_N.view(T, K), counts_E

    def dispatch(self, x_TD, ids_TK, w_TK):
        token_of_row_N, row_of_slot_TK, counts_E = self.rows(ids_TK)
        fp8 = Fp8Rows() if self.fp8_rows and x_TD.dtype == torch.bfloat16 else None
        x_ND = gather_rows(x_TD, token_of_row_N, row_of_slot_TK, fp8)
        return x_ND, counts_E, LocalHandle(token_of_row_N, row_of_slot_TK, w_TK, x_TD.dtype, fp8_rows=fp8)

    def combine(self, y_ND, handle: LocalHandle):
        return weighted_combine(y_ND, handle.w_TK, handle.row_of_slot_TK, is_permutation=True,
                                fp8=handle.fp8_rows).to(handle.out_dtype)


def is_fixed_capacity(d: Dispatcher) -> bool:
    """Fixed-capacity backends (padded, nvlink) may overflow: the training loop gates and replays."""
    return d.fixed_capacity
