"""moe-echo's extension of torchtitan 0.2.2's JobConfig, merged the way torchtitan merges a
``custom_config_module``: new sections are added, same-named sections are merged field by field.

Adds ``[moe_echo]`` (see components/moe_echo/config.py), the model's shape keys to ``[model]``
(n_layers, dim, num_experts, top_k, ...) and a few data keys to ``[training]``;
changes two defaults so the main job needs no files: the tokenizer (``[model] hf_assets_path =
"bytes"``, a built-in byte tokenizer) and the dataset (``python_stdlib``, the standard library's
own source text).
"""

from dataclasses import dataclass, field
from typing import Literal

from components.moe_echo.config import MoEEchoConfig


@dataclass
class Model:
    """The model: a family (``name``), one of its flavours, and optional shape keys that override
    the flavour's dimensions (unset: the flavour's value; ``--help`` shows it). A checkpoint records
    the shape it was saved with; resuming it, or fine-tuning from it, with another shape is refused
    with one line naming the key to set."""

    name: str = "deepseek_v3"
    """Model family: "deepseek_v3" (multi-head latent attention, dense first layers, shared experts)
    or "qwen3" (grouped-query attention, every layer MoE)."""
    flavor: str = "tiny"
    """Which preset of the family to build (components/moe_echo/models.py lists them); the shape keys
    below change single dimensions of it."""
    hf_assets_path: str = "bytes"
    """Tokenizer (and HF weights) location: "bytes" (built-in byte tokenizer), a directory with
    tokenizer.json (and *.safetensors for finetune), or a tokenizer .json file."""
    n_layers: int | None = None
    """Transformer blocks (deepseek_v3: the first n_dense_layers are dense, the rest MoE)."""
    dim: int | None = None
    """Hidden size of the residual stream, a multiple of 16."""
    n_heads: int | None = None
    """Attention heads."""
    n_kv_heads: int | None = None
    """qwen3 only: key/value heads (grouped-query attention); divides n_heads."""
    head_dim: int | None = None
    """qwen3 only: size of one attention head, even (rotary embedding)."""
    vocab_size: int | None = None
    """Embedding rows and output logits; at least the tokenizer's ids."""
    n_dense_layers: int | None = None
    """deepseek_v3 only: leading blocks with a dense FFN instead of MoE; fewer than n_layers."""
    inter_dim: int | None = None
    """Hidden size of the dense FFN (deepseek_v3's dense blocks; qwen3's hidden_dim, used only by its
    dense flavours), a multiple of 16."""
    moe_inter_dim: int | None = None
    """Hidden size of each routed expert (and of each shared expert), a multiple of 16."""
    num_experts: int | None = None
    """Routed experts per MoE layer; [parallelism] expert_parallel_degree must divide it."""
    num_shared_experts: int | None = None
    """Shared experts per MoE layer, which every token passes through (0: none)."""
    top_k: int | None = None
    """Routed experts each token is sent to, in [1, num_experts]."""


@dataclass
class Training:
    dataset: str = "python_stdlib"
    """"python_stdlib" (offline default corpus) or "local" (files at dataset_path)."""
    dataset_path: str | None = None
    """.jsonl / .parquet file, a directory of them, or a dataset saved with datasets.save_to_disk."""
    text_field: str = "text"
    """Column / JSON key holding the document text."""
    max_corpus_mb: int = 16
    """Read at most this many MB of text (the python_stdlib corpus and local files)."""
    seed: int = 0
    """Seed for weights init and data order."""
    cuda_graph: bool = False
    """Capture forward + backward + optimizer step as one CUDA graph after ``cuda_graph_warmup``
    eager steps (GPU, sync-free dispatcher). When capture is impossible the run says why and
    continues eagerly."""
    cuda_graph_warmup: int = 2
    """Eager steps (real training steps) before the capture."""
    cuda_graph_after_replay: Literal["eager", "recapture"] = "recapture"
    """After an overflow was replayed eagerly on the exact path: "recapture" warms up and captures
    the step again (capacity may have grown meanwhile); "eager" runs eagerly from then on."""
    sync_debug: bool = False
    """Raise on any device-to-host synchronisation inside training steps
    (torch.cuda.set_sync_debug_mode("error")); for checking the sync-free path. With [compile] enable
    the first step is not checked: torch.compile compiles there, which reads the device."""
    max_nonfinite_steps: int = 3
    """Non-finite guard: a step whose loss or gradient norm is not finite is skipped on the device
    (the optimizer step is gated, as GradScaler does); after this many consecutive ones the run
    stops with exit code 3, naming the step and the first module whose output or gradient went
    non-finite. 0 = off (then [optimizer] implementation may be 'foreach' or 'for-loop')."""
    master_weights: bool = True
    """With mixed_precision_param = "bfloat16" on a GPU and no FSDP: the model's parameters are bf16
    and the optimizer keeps fp32 master weights and moments, writing the bf16 copy after each update
    (no weight casts per step, bf16 gradients). false: fp32 parameters under bf16 autocast. Checkpoints
    hold fp32 weights either way. (With FSDP, its MixedPrecisionPolicy casts in the all-gather; experts
    each rank owns alone stay out of FSDP, and with this on the optimizer writes their bf16 copies and
    takes their bf16 gradients, so they are not cast every step either.)"""
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """The dtype FSDP reduce-scatters gradients in: "float32" sums the ranks' bf16 gradients in fp32;
    "bfloat16" halves the bytes and skips the fp32 cast copies, rounding each partial sum to bf16 (one
    rounding per rank added). Applies where FSDP casts for compute: GPUs with mixed_precision_param = "bfloat16"."""
    hang_report_s: float = 900.0
    """When no step has finished for this many seconds, every rank prints its Python stacks (where a
    hung collective or peer-memory barrier waits); the run goes on. 0 = off. The first step, which
    compiles kernels and sets up buffers, counts too: keep it generous."""


@dataclass
class JobConfig:
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    moe_echo: MoEEchoConfig = field(default_factory=MoEEchoConfig)
