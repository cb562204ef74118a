"""Fine-tune a torchtitan MoE model from pretrained weights: the same components and step as
recipes/pretrain.py, started from a DCP checkpoint of this repo or from HF safetensors.

    python recipes/finetune.py --job.config_file train_configs/debug_cpu.toml \\
        --checkpoint.initial_load_path outputs/debug_cpu/checkpoint/step-200 --job.dump_folder outputs/ft
    python recipes/finetune.py --job.config_file my.toml --checkpoint.initial_load_in_hf true \\
        --checkpoint.initial_load_path /models/DeepSeek-V2-Lite

Same CLI and TOML config as pretrain. ``[checkpoint] initial_load_path`` is required: a ``step-N``
folder written by pretrain, or — with ``initial_load_in_hf = true`` — a directory of HF
``*.safetensors``, converted with torchtitan's state-dict adapter of ``[model] name``
(components/train/hf_weights.py). Only the model weights are loaded; optimizer, lr schedule, data
position and step start fresh. The step below is pretrain's; edit it here for what fine-tuning
needs (e.g. a loss over the answer tokens only).

Default filled in only where you gave none: with ``initial_load_in_hf = true`` and no path, the
weights are read from ``[model] hf_assets_path`` (as torchtitan does). Nothing else differs from
pretrain — set the fine-tuning lr, steps and data in the config.

If this run's own ``<dump_folder>/<checkpoint.folder>`` already holds a complete checkpoint, the run
resumes from it and ``initial_load_path`` is ignored (as in torchtitan): give each fine-tune its own
``--job.dump_folder``. Bad input ends with one line ``error: ...`` and exit code 2.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from components.errors import UserError
from components.parallel.data_parallel import allreduce_sum
from components.parallel.grad_norm import clip_grad_norm_
from components.train.entry import run_recipe
from components.train.loop import fit
from components.train.loss import build_loss
from components.train.moe_balance import balance_experts
from components.train.overflow import stop_on_overflow
from components.train.setup import build_data, build_parallel_model, build_training, resume, start


def finetune(argv: list[str]) -> None:
    run = start(argv)
    ckpt, m, t = run.cfg.checkpoint, run.cfg.model, run.cfg.training
    if not ckpt.initial_load_path:  # weights are required; torchtitan's default for HF: hf_assets_path
        if not (ckpt.initial_load_in_hf and m.hf_assets_path != "bytes"):
            raise UserError("finetune needs --checkpoint.initial_load_path PATH: a step-N folder written by "
                            "recipes/pretrain.py, or a HF safetensors directory with --checkpoint.initial_load_in_hf true")
        ckpt.initial_load_path = m.hf_assets_path
    tokenizer, loader = build_data(run)
    model, n_params, flops_per_token = build_parallel_model(run, tokenizer)
    tr = build_training(run, model, loader)
    if not resume(run, tr, model):  # this run's own checkpoint wins; else the pretrained weights
        return
    optimizer, gate, layers = tr.optimizer, tr.gate, tr.layers
    cross_entropy = build_loss(run.cfg.compile, run.device)  # fused kernels on CUDA (components/train/loss.py)

    def loss_fn(inputs_BS, labels_BS):
        with tr.autocast():
            logits_BSV = model(inputs_BS)
        return cross_entropy(logits_BSV, labels_BS)

    def device_step(inputs_BS, labels_BS):
        loss = loss_fn(inputs_BS, labels_BS)
        loss.backward()
        grad_norm = clip_grad_norm_(list(model.parameters()), t.max_norm, tr.scale_into)
        skip = gate.gate(loss, grad_norm) if gate is not None else None
        if tr.fixed and not tr.replay:
            stop_on_overflow(layers, tr.state.step, run.cfg.moe_echo.capacity_factor)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        counts_LE, echo, net_L = balance_experts(layers, skip)
        return allreduce_sum(loss.detach()) / run.world, grad_norm, counts_LE, echo, net_L

    fit(run, tr, model, loader, device_step, loss_fn, n_params, flops_per_token)


if __name__ == "__main__":
    run_recipe(finetune)
