"""The token-dispatcher interface every backend implements, and the ``local`` backend (EP=1).

    dispatch(x_TD, ids_TK, w_TK) -> (x_ND, counts_e, handle)
        x_ND: the rows this rank's experts process, expert-major (rows of local expert/slot j are
              contiguous and in order j = 0..e-1), N >= sum(counts_e) (fixed-capacity backends pad);
        counts_e: int64 rows per local expert/slot, on device;
        handle: what combine needs (backend-specific), never read on the host by sync-free backends.
    combine(y_ND, handle) -> y_TD = Σ_k w_TK[t, k] · y(row of (t, k)), accumulated in fp32,
        returned in x_TD's dtype on the source rank.

Both are differentiable: gradients flow to x_TD, w_TK and y_ND.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from .config import MoEEchoConfig
from .row_ops import gather_rows, weighted_combine


class Dispatcher(ABC):
    sync_free = False  # True: no host read on the step path (the step can be captured in a CUDA graph)
    fixed_capacity = False  # True: may overflow (counted in handle.dropped; the loop gates and replays)

    @abstractmethod
    def dispatch(
        self, x_TD: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, object]: ...

    @abstractmethod
    def combine(self, y_ND: torch.Tensor, handle: object) -> torch.Tensor: ...


@dataclass
class LocalHandle:
    token_of_row_N: torch.Tensor  # source token of each dispatched row
    row_of_slot_TK: torch.Tensor  # dispatched row of each (token, choice) slot
    w_TK: torch.Tensor  # combine weights (fp32, differentiable)
    out_dtype: torch.dtype
    dropped: torch.Tensor | None = None  # the local backend never drops


class LocalDispatcher(Dispatcher):
    """All E experts on this rank. Expert-major order by a stable sort of the flat expert ids;
    N = T·K exactly. Everything stays on device: no host read, no boolean masks."""

    sync_free = True

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def dispatch(self, x_TD, ids_TK, w_TK):
        T, K = ids_TK.shape
        flat_ids_N = ids_TK.reshape(-1)
        slot_of_row_N = torch.argsort(flat_ids_N, stable=True)  # row n holds slot t*K+k
        row_of_slot_N = torch.empty_like(slot_of_row_N).scatter_(
            0, slot_of_row_N, torch.arange(T * K, device=ids_TK.device)
        )
        token_of_row_N = slot_of_row_N // K
        counts_E = torch.zeros(self.num_experts, dtype=torch.int64, device=ids_TK.device)
        counts_E.scatter_add_(0, flat_ids_N, torch.ones_like(flat_ids_N))
        row_of_slot_TK = row_of_slot_N.view(T, K)
        x_ND = gather_rows(x_TD, token_of_row_N, row_of_slot_TK)
        return x_ND, counts_E, LocalHandle(token_of_row_N, row_of_slot_TK, w_TK, x_TD.dtype)

    def combine(self, y_ND, handle: LocalHandle):
        return weighted_combine(y_ND, handle.w_TK, handle.row_of_slot_TK, is_permutation=True).to(handle.out_dtype)


def resolve_backend(cfg: MoEEchoConfig, ep_size: int, on_cuda: bool = False) -> str:
    """The backend ``cfg.dispatcher`` means at this EP degree (``auto``: local at EP=1, else nvlink
    on CUDA and padded elsewhere)."""
    if cfg.dispatcher in ("auto", "fastest"):  # "fastest" is resolved by autotune before this
        return "local" if ep_size == 1 else ("nvlink" if on_cuda else "padded")
    if (cfg.dispatcher == "local") != (ep_size == 1):
        need = "expert_parallel_degree = 1" if cfg.dispatcher == "local" else "expert_parallel_degree > 1"
        raise ValueError(f"[moe_echo] dispatcher = {cfg.dispatcher!r} needs {need} (got {ep_size}); "
                         "use dispatcher = 'auto'")
    return cfg.dispatcher


def build_dispatcher(cfg: MoEEchoConfig, num_experts: int, ep_group=None, ep_size: int = 1,
                     on_cuda: bool = False) -> Dispatcher:
    backend = resolve_backend(cfg, ep_size, on_cuda)
    if backend == "local":
        return LocalDispatcher(num_experts)
    if backend == "nvlink":
        from .nvlink_dispatch import NVLinkDispatcher

        return NVLinkDispatcher(num_experts, ep_group, ep_size, cfg.capacity_factor, cfg.nvlink_sms)
    if backend == "deepep":
        from .deepep_dispatch import DeepEPDispatcher

        return DeepEPDispatcher(num_experts, ep_group, ep_size)
    from .ep_dispatch import AllToAllDispatcher, PaddedDispatcher

    if backend == "alltoall":
        return AllToAllDispatcher(num_experts, ep_group, ep_size)
    return PaddedDispatcher(num_experts, ep_group, ep_size, cfg.capacity_factor)


def peers_on_one_host(device_type: str, ep_size: int) -> bool:
    """Whether the EP ranks can be CUDA GPUs of this one host (what ``nvlink`` needs: peer memory)."""
    return device_type == "cuda" and ep_size <= torch.cuda.device_count()


def is_fixed_capacity(d: Dispatcher) -> bool:
    """Fixed-capacity backends (padded, nvlink) may overflow: the training loop gates and replays."""
    return d.fixed_capacity
