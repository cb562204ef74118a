"""Parallelize a torchtitan deepseek_v3 / qwen3 model carrying moe-echo's MoE layer.

Per transformer block, in this order (torchtitan's conventions):
1. expert parallelism: each MoE layer keeps e = E / EP experts — its w1/w2/w3 become DTensors
   sharded on dim 0 over the "ep" mesh (global shape and FQN unchanged, so DCP checkpoints
   reshard between EP layouts) — and gets the configured EP dispatcher;
2. torch.compile of the block's dense submodules (``[compile] enable``, "model" in components;
   components/parallel/compile.py): attention, norms, dense FFN, shared experts, each one static
   graph; the routed MoE path stays eager. In place, so FQNs and checkpoints are unchanged. After the
   blocks, the final norm and the output head the same way;
3. activation checkpointing: none | full (every block) | selective (every N-th block, N =
   ``selective_ac_option``), around the block and so around its compiled submodules (compile
   inside AC, as torchtitan does for MoE blocks);
4. FSDP2: ``fully_shard`` of the experts over the expert-FSDP mesh (gradient divide factor =
   world size, since every rank's tokens reach every expert), then of the block over the dense
   mesh; then of the embeddings, and of the final norm with the output head (their own units, as
   torchtitan's); finally of the root. bf16 params on GPU, gradients reduced in
   ``[training] mixed_precision_reduce`` (fp32 by default). Where EP spans every rank (expert-FSDP
   group of one), the experts stay out of FSDP: fp32 DTensor weights cast to bf16 in the layer, their
   gradients divided by the world size in a hook, no gather, copy or reduce.
"""

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from components.moe_echo.backends import build_dispatcher, peers_on_one_host, resolve_backend, resolve_echo
from components.moe_echo.echo import Echo
from components.moe_echo.echo_transport import build_transport
from components.moe_echo.layer import MoELayer
from components.moe_echo.pipelined import check_overlap
from components.errors import UserError

from .compile import compile_dense, compile_ends
from .hosts import ep_hosts, require_spanning
from .mesh import Meshes, ParallelDims


def apply_expert_parallel(moe: MoELayer, ep_mesh, cfg) -> None:
    """Keep this rank's experts (a dim-0 shard over ``ep_mesh``) and switch to an EP dispatcher."""
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for name in ("w1", "w2", "w3"):
        full = getattr(moe.experts, name).data
        local = full.chunk(ep, dim=0)[rank].clone()
        setattr(moe.experts, name, nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)))
    hosts, on_one_host = _ep_layout(ep_mesh, ep)
    echo, _ = _echo_on(cfg, ep, hosts, on_one_host)
    slots = cfg.echo_slots_per_rank if echo else 0
    # with ECHO the dispatcher routes over e + S "experts" per rank: home experts, then echo slots
    if cfg.dispatcher == "nvlink" and not on_one_host:
        raise UserError(f"[moe_echo] dispatcher = 'nvlink' needs the {ep} EP ranks on the CUDA GPUs of one host "
                        f"(they span {hosts.hosts} hosts; {torch.cuda.device_count()} GPUs here); use 'hierarchical', "
                        "'padded' or 'auto'")
    if cfg.dispatcher == "hierarchical":
        require_spanning(hosts, ep)
    elif not hosts.regular:
        hosts = None  # auto: flat padded where the ranks are not laid out host by host
    moe.dispatcher = build_dispatcher(cfg, ep * (moe.num_experts // ep + slots), ep_mesh.get_group(), ep,
                                      on_one_host, hosts)
    check_overlap(moe.cfg, moe.dispatcher)  # what the layer's forward reads
    moe.ep_size = ep
    if echo:
        transport = build_transport(moe.dispatcher, ep_mesh.get_group(), ep, rank, slots, moe.num_experts // ep)
        per_host = hosts.ranks_per_host if hosts is not None and hosts.spans_hosts else None
        moe.echo = Echo(moe.num_experts, ep, rank, slots, cfg.echo_planner, transport, ranks_per_host=per_host)


def _ep_layout(ep_mesh, ep: int):
    """(the EP group's host layout, whether its ranks are CUDA GPUs of this one host)."""
    hosts = ep_hosts(ep_mesh.get_group())
    return hosts, peers_on_one_host(ep_mesh.device_type, ep) and not hosts.spans_hosts


def _echo_on(cfg, ep: int, hosts, on_one_host: bool) -> tuple[bool, str]:
    """(whether the EP layers run ECHO, the dispatcher backend that decided it) for ``cfg.echo`` true, false or
    ``"auto"``."""
    backend = "local" if ep == 1 else cfg.dispatcher
    if backend == "auto":
        backend = resolve_backend(cfg, ep, on_one_host, hosts.spans_hosts and hosts.regular)
    return resolve_echo(cfg, backend, ep), backend


def _resolve_echo(mesh, dims: ParallelDims, cfg) -> None:
    """``[moe_echo] echo = "auto"`` made true or false, in place, before anything sizes ECHO's slots."""
    if cfg.echo != "auto":
        return
    hosts, on_one_host = _ep_layout(mesh.ep, dims.ep) if dims.ep > 1 else (None, False)
    cfg.echo, backend = _echo_on(cfg, dims.ep, hosts, on_one_host)
    if cfg.echo and torch.distributed.get_rank() == 0:
        print(f"echo: auto = on ({backend} dispatcher at EP={dims.ep}; echo = false turns it off)", flush=True)


def _fastest_backend(model, mesh, dims, cfg, device) -> str:
    from components.moe_echo.autotune import choose_backend

    args = model.model_args
    slots = cfg.moe_echo.echo_slots_per_rank if cfg.moe_echo.echo else 0
    E = dims.ep * (args.moe_args.num_experts // dims.ep + slots)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = cfg.training.local_batch_size * cfg.training.seq_len
    backend, timings, cached = choose_backend(cfg.moe_echo, E, args.moe_args.top_k, args.dim, tokens,
                                              mesh.ep.get_group(), dims.ep, device, dtype,
                                              hosts=ep_hosts(mesh.ep.get_group()))
    if torch.distributed.get_rank() == 0:
        detail = ", ".join(f"{k} {v:.2f} ms" for k, v in timings.items())
        print(f"dispatcher: fastest = {backend} ({detail}{'; cached' if cached else ''})", flush=True)
    return backend


def _ac_wrap(block: nn.Module, index: int, ac_cfg) -> nn.Module:
    mode = ac_cfg.mode
    if mode == "none":
        return block
    if mode == "full":
        return checkpoint_wrapper(block, preserve_rng_state=ac_cfg.preserve_rng_state)
    if mode == "selective":
        try:
            every = int(ac_cfg.selective_ac_option)
        except ValueError:
            raise UserError(f"[activation_checkpoint] selective_ac_option = {ac_cfg.selective_ac_option!r}: "
                            "moe-echo supports a block interval (e.g. '2' = every 2nd block)") from None
        if every < 1:
            raise UserError(f"[activation_checkpoint] selective_ac_option = {every} must be >= 1")
        return checkpoint_wrapper(block, preserve_rng_state=ac_cfg.preserve_rng_state) if index % every == 0 else block
    raise UserError(f"[activation_checkpoint] mode = {mode!r} is not supported; expected 'none', 'full' or 'selective'")


def parallelize(model: nn.Module, mesh: Meshes | None, dims: ParallelDims, cfg, device: torch.device) -> nn.Module:
    _resolve_echo(mesh, dims, cfg.moe_echo)
    if dims.ep > 1 and cfg.moe_echo.dispatcher == "fastest":
        cfg.moe_echo.dispatcher = _fastest_backend(model, mesh, dims, cfg, device)
    for i, (name, block) in enumerate(list(model.layers.items())):
        if getattr(block, "moe_enabled", False) and dims.ep > 1:
            apply_expert_parallel(block.moe, mesh.ep, cfg.moe_echo)
        if cfg.compile.enable and "model" in cfg.compile.components:
            compile_dense(block, cfg.compile.backend)
        block = _ac_wrap(block, i, cfg.activation_checkpoint)
        model.layers[name] = block
    if cfg.compile.enable and "model" in cfg.compile.components:
        compile_ends(model, cfg.compile.backend)

    if not dims.fsdp:
        return model
    mp = None
    if device.type == "cuda" and cfg.training.mixed_precision_param == "bfloat16":
        reduce = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.training.mixed_precision_reduce]
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)
    kw = {"mp_policy": mp} if mp is not None else {}
    reshard = cfg.parallelism.fsdp_reshard_after_forward != "never"
    dmesh, emesh = mesh.dense, mesh.expert_fsdp
    # expert parallelism over every rank (efsdp = dp_replicate = 1): each expert has one owner, so FSDP
    # would only copy its weights and gradients through a one-rank group; they are cast for compute
    # in the layer instead, and left out of FSDP
    owned_once = dims.efsdp * dims.dp_replicate == 1
    ignored: set = set()
    for block in model.layers.values():
        moe = getattr(block, "moe", None)
        if isinstance(moe, MoELayer):
            if owned_once:
                moe.experts.compute_dtype = mp.param_dtype if mp is not None else None
                ignored |= set(moe.experts.parameters())
            else:
                fully_shard(moe.experts, mesh=emesh, reshard_after_forward=reshard, **kw)
            moe.experts.set_gradient_divide_factor(dims.world)
        fully_shard(block, mesh=dmesh, reshard_after_forward=reshard,
                    ignored_params=ignored & set(block.parameters()) or None, **kw)
    _shard_ends(model, dmesh, kw)
    fully_shard(model, mesh=dmesh, reshard_after_forward=False, ignored_params=ignored or None, **kw)
    return model


def _shard_ends(model: nn.Module, dmesh, kw: dict) -> None:
    """The embeddings, and the final norm with the output head, as FSDP units of their own (as torchtitan does):
    the head's gradients are reduce-scattered while the blocks' backward runs instead of after all of it, and the
    all-gather before the first block moves the embeddings only. Both stay gathered from forward to backward, as
    they did in the root: the head's backward follows its forward at once, and the embeddings' backward needs no
    weight, so gathering it again would only add traffic. Kept in the root where the head shares the embeddings'
    weight."""
    emb, norm, head = (getattr(model, n, None) for n in ("tok_embeddings", "norm", "output"))
    if emb is None or norm is None or head is None or getattr(head, "weight", None) is getattr(emb, "weight", 0):
        return
    fully_shard(emb, mesh=dmesh, reshard_after_forward=False, **kw)
    fully_shard([norm, head], mesh=dmesh, reshard_after_forward=False, **kw)
