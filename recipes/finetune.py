"""Fine-tune a torchtitan MoE model from pretrained weights: recipes/pretrain.py's training loop,
started from a DCP checkpoint of this repo or from HF safetensors.

    python recipes/finetune.py --job.config_file train_configs/debug_cpu.toml \\
        --checkpoint.initial_load_path outputs/debug_cpu/checkpoint/step-200 --job.dump_folder outputs/ft
    python recipes/finetune.py --job.config_file my.toml --checkpoint.initial_load_in_hf true \\
        --checkpoint.initial_load_path /models/DeepSeek-V2-Lite

Same CLI and TOML config as pretrain. ``[checkpoint] initial_load_path`` is required: a ``step-N``
folder written by pretrain, or — with ``initial_load_in_hf = true`` — a directory of HF
``*.safetensors``, converted with torchtitan's state-dict adapter of ``[model] name``
(components/train/hf_weights.py). Only the model weights are loaded; optimizer, lr schedule, data
position and step start fresh.

Default filled in only where you gave none: with ``initial_load_in_hf = true`` and no path, the
weights are read from ``[model] hf_assets_path`` (as torchtitan does). Nothing else differs from
pretrain — set the fine-tuning lr, steps and data in the config.

If this run's own ``<dump_folder>/<checkpoint.folder>`` already holds a complete checkpoint, the run
resumes from it and ``initial_load_path`` is ignored (as in torchtitan): give each fine-tune its own
``--job.dump_folder``. Bad input ends with one line ``error: ...`` and exit code 2.
"""

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import pretrain  # recipes/pretrain.py, next to this file
from components.train.entry import run_recipe

from components.train.config import load_config
from components.errors import UserError


def finetune(argv: list[str]) -> None:
    cfg = load_config(argv)
    ckpt, m = cfg.checkpoint, cfg.model
    if not ckpt.initial_load_path:
        if not (ckpt.initial_load_in_hf and m.hf_assets_path != "bytes"):
            raise UserError("finetune needs --checkpoint.initial_load_path PATH: a step-N folder written by "
                            "recipes/pretrain.py, or a HF safetensors directory with --checkpoint.initial_load_in_hf true")
        argv = [*argv, "--checkpoint.initial_load_path", m.hf_assets_path]
    pretrain.train(argv)


if __name__ == "__main__":
    run_recipe(finetune)
