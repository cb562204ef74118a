"""Pretrain a torchtitan MoE model (deepseek_v3 or qwen3) with moe-echo's MoE layer.

    python recipes/pretrain.py --job.config_file train_configs/debug_cpu.toml [--training.steps 20]
    torchrun --nproc_per_node 2 recipes/pretrain.py --job.config_file ...

Reads top to bottom: config and processes → tokenizer + data → model (EP-sharded, FSDP-wrapped) →
optimizer, lr schedule, step gate → resume → the step (forward, backward, clip, gated optimizer
step, router-bias update) → the loop (components/train/loop.py: steps confirmed one step late,
overflowed ones replayed exactly, non-finite ones skipped; logs, checkpoints, summary).
Exit codes: 2 bad input, 3 too many non-finite steps, 4 a peer rank hung or died, 130 / 143 stopped by
SIGINT (Ctrl-C) / SIGTERM (components/train/entry.py).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install
from components.train.starting import stop_while_starting  # noqa: E402

stop_while_starting()  # Ctrl-C during the imports below: one line, no traceback

from components.parallel.data_parallel import allreduce_sum
from components.train.entry import run_recipe
from components.train.loop import fit
from components.train.loss import build_loss
from components.train.moe_balance import balance_experts
from components.train.setup import (build_data, build_parallel_model, build_training, resume, start,
                                    verify_initial_weights)


def train(argv: list[str]) -> None:
    run = start(argv)  # config, processes, device meshes
    verify_initial_weights(run)  # [checkpoint] initial_load_path's checksums, before anything is built
    tokenizer, loader = build_data(run)
    model, n_params, flops_per_token = build_parallel_model(run, tokenizer)
    tr = build_training(run, model, loader)  # precision, optimizer, lr schedule, step gate, checkpoint states
    if not resume(run, tr, model):  # the run's own checkpoint, else [checkpoint] initial_load_path
        return
    optimizer, layers = tr.optimizer, tr.layers
    cross_entropy = build_loss(run.cfg.compile, run.device)  # fused kernels on CUDA (components/train/loss.py)

    def loss_fn(inputs_BS, labels_BS):
        with tr.autocast():  # bf16 autocast, or nothing (bf16 parameters / FSDP's policy)
            logits_BSV = model(inputs_BS)
        return cross_entropy(logits_BSV, labels_BS)

    def device_step(inputs_BS, labels_BS):
        """No host read (a CUDA graph captures this whole function), except on_overflow = 'stop'."""
        loss = loss_fn(inputs_BS, labels_BS)
        loss.backward()
        grad_norm, skip = tr.clip_and_gate(model, loss)  # skip: device flag (overflow / non-finite), read a step late
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        counts_LE, echo, net_L = balance_experts(layers, skip)  # aux-loss-free bias step from the global counts
        return allreduce_sum(loss.detach()) / run.world, grad_norm, counts_LE, echo, net_L

    fit(run, tr, model, loader, device_step, loss_fn, n_params, flops_per_token)


if __name__ == "__main__":
    run_recipe(train)
