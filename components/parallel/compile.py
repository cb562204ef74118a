"""torch.compile of the dense parts of a transformer block and of the model's ends, and of a loss function.

    names = compile_dense(block, backend)   # ["attention", "attention_norm", "ffn_norm", "moe.shared_experts"]
    names = compile_ends(model, backend)    # ["norm", "output"]
    loss_fn = compile_fn(loss_fn, backend)

``compile_dense`` compiles the ``forward`` of the block's attention, its two norms, its dense
feed-forward (non-MoE blocks) and the MoE's shared experts when they are a module. The routed MoE
path (router, ECHO, dispatcher, grouped experts, combine) stays eager: it launches Triton kernels,
touches symmetric memory / NCCL under EP and keeps Python state that guards would recompile on.
``compile_ends`` compiles the final norm and the output head, each its own graph: a torchao FP8
head's scaling (amax, cast, transpose of the [tokens, vocab] gradient) then fuses as the blocks' does
instead of running as torchao's separate eager kernels. A module with ``eager_only = True`` (the tensorwise
FP8 head, components/train/fp8_head.py) is left as it is. Invariants:

- modules are not wrapped: ``module.forward`` is replaced in place by its compiled version, so
  FQNs and state_dict keys are unchanged and DCP checkpoints load across compile on / off
  (``nn.Module.compile`` would keep them too, but on torch.nn built-ins such as ``nn.RMSNorm`` it
  compiles nothing: every frame it sees is in Dynamo's skip list);
- every compiled region is one graph (``fullgraph=True``: a graph break is an error, not a silent
  fallback) with static shapes (``dynamic=False``: the step's shapes come from the config);
- compile the block before wrapping it (activation checkpointing, FSDP2): the compiled
  submodules then run inside the checkpointed region and between FSDP's block hooks.
"""

import torch
from torch import nn

from components.errors import UserError

# the block's dense children, and the MoE's dense child (torchtitan's deepseek_v3 / qwen3 names)
DENSE_CHILDREN = ("attention", "attention_norm", "ffn_norm", "feed_forward")
MOE_DENSE_CHILDREN = ("shared_experts",)
END_CHILDREN = ("norm", "output")  # the model's final norm and output head (torchtitan's names)


def compile_options(backend: str) -> dict:
    """torch.compile keyword arguments; a one-line UserError for an unknown backend."""
    from torch._dynamo.backends.registry import lookup_backend
    from torch._dynamo.exc import InvalidBackend

    try:
        lookup_backend(backend)
    except InvalidBackend:
        raise UserError(f"[compile] backend = {backend!r} is not a torch.compile backend; "
                        "use 'inductor' (default), 'aot_eager' or 'eager'") from None
    return {"backend": backend, "fullgraph": True, "dynamic": False}


def is_compiled(module: nn.Module) -> bool:
    """Whether ``compile_dense`` compiled this module's forward."""
    return hasattr(module.__dict__.get("forward"), "_torchdynamo_orig_callable")


def compile_dense(block: nn.Module, backend: str) -> list[str]:
    """Compile the block's dense submodules in place; return their names (relative to the block)."""
    found = [(name, getattr(block, name, None)) for name in DENSE_CHILDREN]
    moe = getattr(block, "moe", None) if getattr(block, "moe_enabled", False) else None
    found += [(f"moe.{name}", getattr(moe, name, None)) for name in MOE_DENSE_CHILDREN if moe is not None]
    return _compile_in_place(found, backend)


def compile_ends(model: nn.Module, backend: str) -> list[str]:
    """Compile the model's final norm and output head in place; return their names."""
    return _compile_in_place([(name, getattr(model, name, None)) for name in END_CHILDREN], backend)


def _compile_in_place(found: list[tuple[str, nn.Module | None]], backend: str) -> list[str]:
    """Replace each module's ``forward`` by its compiled version (skipping None and those already compiled)."""
    opts = compile_options(backend)
    done = []
    for name, child in found:
        if isinstance(child, nn.Module) and not is_compiled(child) and not getattr(child, "eager_only", False):
            child.forward = torch.compile(child.forward, **opts)
            done.append(name)
    return done


def compile_fn(fn, backend: str):
    """``fn`` compiled as one static-shape graph."""
    return torch.compile(fn, **compile_options(backend))
