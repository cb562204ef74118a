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
position and step start fresh. A ``step-N`` folder is first checked against the sizes and checksums
its ``COMPLETE`` marker records, as a resume checks its own checkpoint: a damaged file stops the run
with one line naming it. The step below is pretrain's; edit it here for what fine-tuning needs (e.g. a
loss over the answer tokens only).

Fine-tuning defaults, filled in only where the command line gives none (the config file is the
pretraining one, so its values count as pretraining's):

    --optimizer.lr                 0.1 x the config's [optimizer] lr (a fine-tune that re-warmed to
                                   the pretraining peak would first undo what was learnt)
    --lr_scheduler.warmup_steps    5% of [training] steps, at least 1
    --checkpoint.initial_load_path [model] hf_assets_path, with initial_load_in_hf = true (as torchtitan)

The run prints the schedule it uses. Everything else (steps, data, decay) is the config's.

If this run's own ``<dump_folder>/<checkpoint.folder>`` already holds a complete checkpoint, the run
resumes from it and ``initial_load_path`` is ignored (as in torchtitan): give each fine-tune its own
``--job.dump_folder``. Bad input ends with one line ``error: ...`` and exit code 2; Ctrl-C with one
line ``stopped at step N; ...`` and exit code 130 (components/train/entry.py).
"""

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install
from components.train.starting import stop_while_starting  # noqa: E402

stop_while_starting()  # Ctrl-C during the imports below: one line, no traceback

from components.errors import UserError
from components.parallel.data_parallel import allreduce_sum
from components.train.entry import run_recipe
from components.train.loop import fit
from components.train.loss import build_loss
from components.train.moe_balance import balance_experts
from components.train.setup import (build_data, build_parallel_model, build_training, resume, start,
                                    verify_initial_weights)

LR_FACTOR = 0.1  # fine-tuning lr = LR_FACTOR x the config's [optimizer] lr, unless --optimizer.lr is given
WARMUP_SHARE = 0.05  # fine-tuning warm-up = this share of [training] steps, unless --lr_scheduler.warmup_steps is given

HELP = f"""recipes/finetune.py: pretrain's keys below, with fine-tuning defaults where the command line gives none:
  --optimizer.lr                {LR_FACTOR:g} x the config's [optimizer] lr (shown below)
  --lr_scheduler.warmup_steps   {WARMUP_SHARE:.0%} of [training] steps, at least 1
  --checkpoint.initial_load_path  required: a step-N folder of recipes/pretrain.py (its checksums are verified),
                                or HF safetensors with --checkpoint.initial_load_in_hf true ([model] hf_assets_path)"""


def given(argv: list[str], key: str) -> bool:
    """``--key VALUE`` or ``--key=VALUE`` is on the command line (``key``: ``section.name``)."""
    return any(a.startswith("--") and a[2:].split("=", 1)[0].replace("-", "_") == key for a in argv)


def finetune_schedule(cfg, argv: list[str]) -> str:
    """Set the fine-tuning lr and warm-up the command line leaves open; returns what the run uses."""
    o, s, t = cfg.optimizer, cfg.lr_scheduler, cfg.training
    lr_from = "--optimizer.lr"
    if not given(argv, "optimizer.lr"):
        lr_from = f"{LR_FACTOR:g} x [optimizer] lr {o.lr:g}; --optimizer.lr sets it"
        o.lr *= LR_FACTOR
    warmup_from = "--lr_scheduler.warmup_steps"
    if not given(argv, "lr_scheduler.warmup_steps"):
        s.warmup_steps = max(1, math.ceil(WARMUP_SHARE * t.steps))
        warmup_from = f"{WARMUP_SHARE:.0%} of {t.steps} steps; --lr_scheduler.warmup_steps sets it"
    return f"fine-tuning schedule: lr {o.lr:g} ({lr_from}), warm-up {s.warmup_steps} steps ({warmup_from})"


def finetune(argv: list[str]) -> None:
    run = start(argv)
    ckpt, m = run.cfg.checkpoint, run.cfg.model
    if not ckpt.initial_load_path:  # weights are required; torchtitan's default for HF: hf_assets_path
        if not (ckpt.initial_load_in_hf and m.hf_assets_path != "bytes"):
            raise UserError("finetune needs --checkpoint.initial_load_path PATH: a step-N folder written by "
                            "recipes/pretrain.py, or a HF safetensors directory with --checkpoint.initial_load_in_hf true")
        ckpt.initial_load_path = m.hf_assets_path
    verify_initial_weights(run)  # what a resume of the run's own checkpoint checks
    schedule = finetune_schedule(run.cfg, argv)
    tokenizer, loader = build_data(run)
    model, n_params, flops_per_token = build_parallel_model(run, tokenizer)
    tr = build_training(run, model, loader)
    if not resume(run, tr, model):  # this run's own checkpoint wins; else the pretrained weights
        return
    run.say(schedule)
    optimizer, layers = tr.optimizer, tr.layers
    cross_entropy = build_loss(run.cfg.compile, run.device)  # fused kernels on CUDA (components/train/loss.py)

    def loss_fn(inputs_BS, labels_BS):
        with tr.autocast():
            logits_BSV = model(inputs_BS)
        return cross_entropy(logits_BSV, labels_BS)

    def device_step(inputs_BS, labels_BS):
        loss = loss_fn(inputs_BS, labels_BS)
        loss.backward()
        grad_norm, skip = tr.clip_and_gate(model, loss)  # skip: device flag (overflow / non-finite), read a step late
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        counts_LE, echo, net_L = balance_experts(layers, skip)
        return allreduce_sum(loss.detach()) / run.world, grad_norm, counts_LE, echo, net_L

    fit(run, tr, model, loader, device_step, loss_fn, n_params, flops_per_token)


if __name__ == "__main__":
    run_recipe(finetune, help_note=HELP)
