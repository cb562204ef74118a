"""Pick and build a token dispatcher from ``[moe_echo] dispatcher`` (the factory sits above the
backends, which import only the interface in dispatcher.py).

    d = build_dispatcher(cfg, num_experts, ep_group, ep_size, on_cuda, hosts)

``hosts`` (components.parallel.hosts.EPHosts, or anything with ``hosts``, ``host_rank``, ``net_group``,
``host_group``): how the EP group spans hosts; ``hierarchical`` needs it.
"""

import torch

from components.errors import UserError

from .config import MoEEchoConfig
from .deepep_dispatch import DeepEPDispatcher
from .dispatcher import Dispatcher, LocalDispatcher
from .ep_dispatch import AllToAllDispatcher, PaddedDispatcher
from .hierarchical_dispatch import HierarchicalDispatcher
from .nvlink_dispatch import NVLinkDispatcher


def resolve_backend(cfg: MoEEchoConfig, ep_size: int, on_cuda: bool = False, spans_hosts: bool = False) -> str:
    """The backend ``cfg.dispatcher`` means at this EP degree (``auto``: local at EP=1, hierarchical where
    the EP group spans hosts, else nvlink on the CUDA GPUs of one host and padded elsewhere)."""
    if cfg.dispatcher in ("auto", "fastest"):  # "fastest" is resolved by autotune before this
        if ep_size == 1:
            return "local"
        return "hierarchical" if spans_hosts else ("nvlink" if on_cuda else "padded")
    if cfg.dispatcher == "hierarchical" and not spans_hosts:
        raise ValueError(f"[moe_echo] dispatcher = 'hierarchical' needs the {ep_size} EP ranks to span several "
                         "hosts (torchrun --nnodes > 1 and expert_parallel_degree > --nproc_per_node); use "
                         "dispatcher = 'auto'")
    if (cfg.dispatcher == "local") != (ep_size == 1):
        need = "expert_parallel_degree = 1" if cfg.dispatcher == "local" else "expert_parallel_degree > 1"
        raise ValueError(f"[moe_echo] dispatcher = {cfg.dispatcher!r} needs {need} (got {ep_size}); "
                         "use dispatcher = 'auto'")
    return cfg.dispatcher


CLASSES = {"local": LocalDispatcher, "hierarchical": HierarchicalDispatcher, "nvlink": NVLinkDispatcher,
           "deepep": DeepEPDispatcher, "alltoall": AllToAllDispatcher, "padded": PaddedDispatcher}


def resolve_echo(cfg: MoEEchoConfig, backend: str, ep_size: int) -> bool:
    """Whether the layers run ECHO: ``cfg.echo`` where set; ``"auto"``: from the backend's ``echo_from_ep`` on
    (``nvlink``: EP >= 4), off elsewhere (also for ``"fastest"``, which picks its backend with ECHO off)."""
    if cfg.echo != "auto":
        return bool(cfg.echo)
    start = getattr(CLASSES.get(backend), "echo_from_ep", 0)
    return 0 < start <= ep_size


def build_dispatcher(cfg: MoEEchoConfig, num_experts: int, ep_group=None, ep_size: int = 1,
                     on_cuda: bool = False, hosts=None) -> Dispatcher:
    spans = hosts is not None and hosts.hosts > 1
    backend = resolve_backend(cfg, ep_size, on_cuda, spans)
    if cfg.dispatch_precision != "bf16" and backend == "deepep":
        raise UserError(f"[moe_echo] dispatch_precision = {cfg.dispatch_precision!r} needs dispatcher 'nvlink', "
                        f"'padded', 'hierarchical' or 'alltoall' (this run's is {backend!r}); choose one of them or "
                        f"set dispatch_precision = 'bf16'")
    d = _build(cfg, backend, num_experts, ep_group, ep_size, hosts)
    if d.communicates:
        d.wire = cfg.dispatch_precision
    return d


def _fp8_rows_alone(cfg: MoEEchoConfig) -> bool:
    """Whether FP8 experts read their rows and output gradient only as the FP8 rows the dispatcher writes: FP8
    weight gradients (nothing reads the bf16 rows), and no recomputed experts' forward (``echo_recompute``: it
    finds the FP8 rows taken and quantises the bf16 rows again)."""
    return cfg.expert_precision == "fp8" and cfg.wgrad_precision() == "fp8" and not cfg.echo_recompute


def _build(cfg: MoEEchoConfig, backend: str, num_experts: int, ep_group, ep_size: int, hosts) -> Dispatcher:
    if backend == "local":
        return LocalDispatcher(num_experts, fp8_rows=cfg.expert_precision == "fp8")
    if backend == "hierarchical":
        return HierarchicalDispatcher(num_experts, ep_group, ep_size, cfg.capacity_factor, hosts.hosts,
                                      hosts.net_group, hosts.host_group, hosts.host_rank)
    if backend == "nvlink":
        return NVLinkDispatcher(num_experts, ep_group, ep_size, cfg.capacity_factor, cfg.nvlink_sms, copies=cfg.nvlink_copy,
                                fp8_rows=cfg.expert_precision == "fp8", fp8_plain=not _fp8_rows_alone(cfg))
    if backend == "deepep":
        return DeepEPDispatcher(num_experts, ep_group, ep_size)
    if backend == "alltoall":
        return AllToAllDispatcher(num_experts, ep_group, ep_size)
    return PaddedDispatcher(num_experts, ep_group, ep_size, cfg.capacity_factor)


def peers_on_one_host(device_type: str, ep_size: int) -> bool:
    """Whether the EP ranks can be CUDA GPUs of this one host (what ``nvlink`` needs: peer memory)."""
    return device_type == "cuda" and ep_size <= torch.cuda.device_count()
