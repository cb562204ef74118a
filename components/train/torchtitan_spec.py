"""moe-echo inside torchtitan 0.2.2's own trainer: ``moe_echo_deepseek_v3`` / ``moe_echo_qwen3`` TrainSpecs.

    torchrun --nproc_per_node 2 -m torchtitan.train --job.config_file train_configs/debug_gpu.toml \\
        --job.custom_config_module components.train.job_config \\
        --experimental.custom_import components.train.torchtitan_spec \\
        --model.name moe_echo_deepseek_v3 --parallelism.expert_parallel_degree 2 --moe_echo.echo True

Importing this module registers the specs (idempotent; ``TRAIN_SPECS`` names them). torchtitan's
CLI spells booleans as flags (``--checkpoint.no-enable``) and a key that also takes ``"auto"`` as
``True`` / ``False`` / ``auto`` (``--moe_echo.echo True``). On a CPU-only
machine torchtitan's trainer needs tests/torchtitan_cpu_main.py in place of ``-m torchtitan.train``
(torchtitan falls back to "cuda" without an accelerator). With the same config and seed, a run here
and a recipes/pretrain.py run log the same losses (tests/test_torchtitan_trainer.py).
``--job.custom_config_module components.train.job_config`` adds the ``[moe_echo]`` section and our
``[training]`` data keys to torchtitan's JobConfig (torchtitan merges the two dataclasses).

What each spec swaps in (torchtitan's trainer loop, loss, checkpointing and metrics stay its own):

- ``model_cls``: torchtitan's model with our ``MoELayer`` in every MoE block (built on meta).
- ``parallelize_fn``: ours. It rebuilds the MoE layers with the job's ``[moe_echo]`` config,
  materialises and initialises the whole model exactly as ``recipes/pretrain.py`` does (seed =
  ``[debug] seed``, else ``[training] seed``; every rank the same full weights), builds our
  ``ParallelDims``/meshes from ``[parallelism]`` and the world size and runs
  ``components.parallel.parallelize.parallelize`` (EP sharding + our dispatcher, ECHO, AC, compile,
  FSDP2). The trainer's later ``to_empty`` + ``init_weights`` are then no-ops for this model.
  FSDP gradient division is switched off: torchtitan's loss is (local token-loss sum) / (global
  token count), so the gradients must be summed over ranks, not averaged; for the same reason the
  sequence aux loss (added to each rank's gradient as is) gets ``aux_loss_coeff / world``.
- ``build_optimizers_fn``: torchtitan's AdamW container plus our aux-loss-free router-bias update
  after each optimizer step (the recipe's formula: counts all-reduced over all ranks).
- ``build_lr_schedulers_fn``: our warm-up/stable/decay formula (components/train/optim.py; torchtitan
  adds a virtual last step, so its decay runs one step behind ours).
- ``build_dataloader_fn`` / ``build_tokenizer_fn``: ours when ``[training] dataset`` is
  ``python_stdlib`` or ``local`` (our token stream, ``TokenBatchLoader`` per data-parallel rank with
  the same seed, so each rank sees the batches the recipe's rank sees); torchtitan's otherwise.

Dropless: torchtitan's trainer has no overflow gate or replay (recipes/pretrain.py has), so a
fixed-capacity dispatcher would drop tokens silently. Here ``[moe_echo] dispatcher = "auto"`` means
the exact ``alltoall`` backend at EP > 1; ``padded``, ``nvlink`` and ``fastest`` (which may pick
them) are refused with a one-line ``UserError``. ``local`` (EP = 1), ``alltoall`` and ``deepep``
(exact) run.
"""

import copy
import dataclasses
import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from components.errors import UserError
from components.moe_echo.config import MoEEchoConfig
from components.moe_echo.dispatcher import is_fixed_capacity
from components.moe_echo.experts import GroupedExperts
from components.moe_echo.layer import MoELayer
from components.moe_echo.models import FLAVORS, MODEL_CLASSES, is_moe_block, moe_layers, swap_moe
from components.parallel.mesh import build_mesh, parallel_dims
from components.parallel.parallelize import parallelize
from components.tensors import local_of

from .data import TokenBatchLoader, build_token_stream
from .optim import lr_factor
from .tokenizer import build_tokenizer

OUR_DATASETS = ("python_stdlib", "local")
_FIXED_CAPACITY = ("padded", "nvlink", "hierarchical", "fastest")


# --- model -----------------------------------------------------------------------------------------

def _model_cls(base: type) -> type:
    """torchtitan's ``base`` with our MoE layer; materialised and initialised by ``parallelize_fn``."""

    class MoEEchoModel(base):
        def __init__(self, model_args):
            super().__init__(model_args)
            swap_moe(self, getattr(model_args, "moe_echo", None))
            self._moe_echo_ready = False  # set once parallelize_fn has materialised the weights

        def to_empty(self, *, device, recurse: bool = True):
            # the trainer calls this after parallelize_fn, which already placed and initialised the weights
            return self if self._moe_echo_ready else super().to_empty(device=device, recurse=recurse)

        def init_weights(self, *args, **kwargs):
            if not self._moe_echo_ready:
                super().init_weights(*args, **kwargs)

    MoEEchoModel.__name__ = MoEEchoModel.__qualname__ = f"MoEEcho{base.__name__}"
    return MoEEchoModel


def _rebuild_moe(model: nn.Module, cfg: MoEEchoConfig, dp_world: int) -> None:
    """Replace the (meta) MoE layers by ones built with the job's ``[moe_echo]`` config.

    The sequence aux loss gets coefficient ``aux_loss_coeff / dp_world``: the recipe averages
    gradients over data-parallel ranks (each rank's loss is its token mean), torchtitan sums them
    (each rank's loss is its token sum / the global token count), so each rank's aux-loss gradient
    is divided by the number of ranks here to give the same total."""
    cfg = dataclasses.replace(cfg, aux_loss_coeff=cfg.aux_loss_coeff / dp_world)
    moe_args = model.model_args.moe_args
    for block in model.layers.values():
        if is_moe_block(block):
            old = block.moe
            E, H, D = old.experts.w1.shape
            with torch.device(old.experts.w1.device):
                block.moe = MoELayer(moe_args, D, H, cfg)


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _seed(job_config) -> int:
    return job_config.training.seed if job_config.debug.seed is None else job_config.debug.seed


def _check_dispatcher(cfg: MoEEchoConfig, ep: int) -> None:
    if ep > 1 and cfg.dispatcher == "auto":
        cfg.dispatcher = "alltoall"  # dropless without the recipe's overflow gate
    if ep > 1 and cfg.dispatcher in _FIXED_CAPACITY:
        raise UserError(f"[moe_echo] dispatcher = {cfg.dispatcher!r} is fixed-capacity and torchtitan's trainer cannot "
                        "replay an overflowed step; use 'alltoall' (or 'auto') here, or recipes/pretrain.py, "
                        "which gates and replays overflowed steps")


def parallelize_fn(model: nn.Module, tt_dims, job_config) -> nn.Module:
    """TrainSpec ``parallelize_fn``: our EP (+ ECHO), AC, compile and FSDP2 on a meta-built model."""
    par = job_config.parallelism
    for key in ("tensor_parallel_degree", "context_parallel_degree", "pipeline_parallel_degree",
                "expert_tensor_parallel_degree"):
        if getattr(par, key, 1) != 1:
            raise UserError(f"[parallelism] {key} = {getattr(par, key)}: moe-echo's parallelize supports "
                            "data parallel (FSDP/HSDP) and expert parallel only; set it to 1")
    cfg = getattr(job_config, "moe_echo", None)
    if cfg is None:
        raise UserError("the moe_echo TrainSpecs need --job.custom_config_module components.train.job_config "
                        "(it adds the [moe_echo] section)")
    if not cfg.enable:
        raise UserError("[moe_echo] enable = false: use torchtitan's own spec (--model.name deepseek_v3 / qwen3)")
    from components.moe_echo.models import shape_overrides

    sizes = shape_overrides(job_config.model)
    if sizes:  # torchtitan's trainer builds the flavour as registered: the keys would be ignored
        first = next(iter(sizes))
        raise UserError(f"[model] {first} = {sizes[first]}: torchtitan's trainer builds the flavour's shape; "
                        "remove the [model] size keys here or train with recipes/pretrain.py, which applies them")
    moe_args = getattr(model.model_args, "moe_args", None)
    world = dist.get_world_size() if dist.is_initialized() else 1
    dims = parallel_dims(par, world, moe_args.num_experts if moe_layers(model) else None)
    _check_dispatcher(cfg, dims.ep)
    device = _device()

    # the recipe's model: full weights on every rank from one seed, then sharded
    _rebuild_moe(model, cfg, world)
    model.to_empty(device=device)
    torch.manual_seed(_seed(job_config))
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    model._moe_echo_ready = True

    mesh = build_mesh(dims, device.type)
    model = parallelize(model, mesh, dims, job_config, device)
    for module in model.modules():  # torchtitan's loss is already divided by the global token count
        if isinstance(module, GroupedExperts):  # experts left out of FSDP (EP over every rank)
            module.set_gradient_divide_factor(1.0)
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if hasattr(module, "set_force_sum_reduction_for_comms"):  # plain SUM (gloo has no PREMUL_SUM)
                module.set_force_sum_reduction_for_comms(True)

    layers = moe_layers(model)
    if any(is_fixed_capacity(moe.dispatcher) for _, moe in layers):
        raise UserError(f"[moe_echo] dispatcher = {cfg.dispatcher!r} built a fixed-capacity backend; use 'alltoall'")
    if layers and (not dist.is_initialized() or dist.get_rank() == 0):
        _, moe = layers[0]
        w1 = moe.experts.w1
        local = local_of(w1)
        mesh_dims = getattr(getattr(w1, "device_mesh", None), "mesh_dim_names", None)
        print(f"moe_echo parallelize_fn: {len(layers)} MoE layers, dispatcher {type(moe.dispatcher).__name__}, "
              f"ep {dims.ep}, echo {'on' if moe.echo is not None else 'off'}, experts {w1.shape[0]}, "
              f"local expert rows {local.shape[0]} (w1 mesh {mesh_dims}, placements {getattr(w1, 'placements', None)})",
              flush=True)
    return model


# --- optimizer and lr schedule ----------------------------------------------------------------------

def build_optimizers_fn(model_parts, optimizer_config, parallel_dims_, ft_manager=None):
    """torchtitan's AdamW container + our router-bias update after each optimizer step."""
    from torchtitan.components.optimizer import build_optimizers

    optimizers = build_optimizers(model_parts, optimizer_config, parallel_dims_)
    layers = [moe for part in model_parts for _, moe in moe_layers(part) if isinstance(moe, MoELayer)]

    def update_router_bias(*_args, **_kwargs):
        if not layers:
            return
        counts_LE = torch.stack([moe.tokens_per_expert for moe in layers])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts_LE)
        for moe, counts_E in zip(layers, counts_LE):
            moe.update_expert_bias(counts_E)
            moe.reset_step_stats()

    optimizers.register_step_post_hook(update_router_bias)
    return optimizers


def build_lr_schedulers_fn(optimizers, lr_scheduler_config, training_steps: int):
    from torchtitan.components.lr_scheduler import LRSchedulersContainer

    c = lr_scheduler_config
    total = c.total_steps or training_steps
    fn = functools.partial(lr_factor, warmup=int(c.warmup_steps), total=total, decay_ratio=c.decay_ratio,
                           decay_type=c.decay_type, min_factor=c.min_lr_factor)
    return LRSchedulersContainer(optimizers, fn)


# --- tokenizer and data ----------------------------------------------------------------------------

def _ours(job_config) -> bool:
    return getattr(job_config.training, "dataset", None) in OUR_DATASETS


class TokenStreamDataLoader:
    """torchtitan ``BaseDataLoader`` over our ``TokenBatchLoader``: yields ``({"input": inputs_BS}, labels_BS)``."""

    def __init__(self, loader: TokenBatchLoader):
        self.loader = loader

    def __iter__(self):
        while True:
            inputs_BS, labels_BS = self.loader.next_batch()
            yield {"input": inputs_BS}, labels_BS

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, state_dict):
        self.loader.load_state_dict(state_dict)


def _dataloader_class():
    from torchtitan.components.dataloader import BaseDataLoader

    return type("TokenStreamDataLoader", (TokenStreamDataLoader, BaseDataLoader), {})


def _tokenizer_fn(base_fn):
    def build_tokenizer_fn(job_config):
        if _ours(job_config):
            return build_tokenizer(job_config.model.hf_assets_path)
        if job_config.model.hf_assets_path == "bytes":
            raise UserError(f"[model] hf_assets_path = 'bytes' needs [training] dataset = 'python_stdlib' or 'local' "
                            f"(got {job_config.training.dataset!r}, a torchtitan dataset)")
        return base_fn(job_config)

    return build_tokenizer_fn


def _dataloader_fn(base_fn):
    def build_dataloader_fn(dp_world_size: int, dp_rank: int, tokenizer, job_config, **kwargs):
        if not _ours(job_config):
            return base_fn(dp_world_size=dp_world_size, dp_rank=dp_rank, tokenizer=tokenizer,
                           job_config=job_config, **kwargs)
        t = job_config.training
        tokens = build_token_stream(t.dataset, t.dataset_path, tokenizer, text_field=t.text_field,
                                    max_bytes=t.max_corpus_mb * 1_000_000)
        loader = TokenBatchLoader(tokens, t.local_batch_size, t.seq_len, rank=dp_rank, world_size=dp_world_size,
                                  seed=_seed(job_config))
        return _dataloader_class()(loader)

    return build_dataloader_fn


# --- registration ----------------------------------------------------------------------------------

def register_train_specs() -> list[str]:
    """Register ``moe_echo_<name>`` TrainSpecs with torchtitan (idempotent); returns their names."""
    from torchtitan.protocols.train_spec import _extra_train_specs, get_train_spec, register_train_spec

    names = []
    for name, cls in MODEL_CLASSES.items():
        spec_name = f"moe_echo_{name}"
        names.append(spec_name)
        if spec_name in _extra_train_specs:
            continue
        base = get_train_spec(name)
        spec = dataclasses.replace(
            base,
            model_cls=_model_cls(cls),
            model_args={k: copy.deepcopy(v) for k, v in FLAVORS[name].items()},
            parallelize_fn=parallelize_fn,
            pipelining_fn=None,
            build_optimizers_fn=build_optimizers_fn,
            build_lr_schedulers_fn=build_lr_schedulers_fn,
            build_dataloader_fn=_dataloader_fn(base.build_dataloader_fn),
            build_tokenizer_fn=_tokenizer_fn(base.build_tokenizer_fn),
        )
        register_train_spec(spec_name, spec)
    return names


TRAIN_SPECS = register_train_specs()
