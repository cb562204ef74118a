"""What a checkpoint holds besides the lr scheduler: model + optimizer (DCP Stateful, FQN-keyed,
so a checkpoint saved at one EP / FSDP layout loads at another) and the train state (step, data
position, RNG)."""

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .data import TokenBatchLoader
from .master_adamw import refresh_compute_copies, with_masters


class ModelAndOptimizer:
    """DCP Stateful view of model + optimizer. With fp32 master weights (MasterAdamW) the model's
    entries are the masters: checkpoints hold fp32 weights on every path, and DCP loads into them in
    place before ``load_state_dict`` copies them into the bf16 parameters."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": with_masters(self.optimizer, model_sd), "optim": _lr_as_number(optim_sd)}

    def load_state_dict(self, sd):
        lr_tensors = [g["lr"] for g in self.optimizer.param_groups]
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        for group, old in zip(self.optimizer.param_groups, lr_tensors):
            if isinstance(old, torch.Tensor):  # a captured step reads this tensor: fill it, keep it
                group["lr"] = old.fill_(float(group["lr"]))
        refresh_compute_copies(self.model)  # the bf16 copies the optimizer writes, from the loaded weights


def _lr_as_number(optim_sd: dict) -> dict:
    """A graphed run's learning rate is a device tensor (``make_capturable``); checkpoints hold it as a number,
    so a checkpoint loads into a run with or without CUDA graphs (one host read per save)."""
    groups = [{k: float(v) if k == "lr" and isinstance(v, torch.Tensor) else v for k, v in g.items()}
              for g in optim_sd["param_groups"]]
    return {**optim_sd, "param_groups": groups}


class LRSchedule:
    """DCP Stateful view of the lr scheduler, its last learning rates as numbers (a graphed run's are device
    tensors), so a checkpoint loads into a run with or without CUDA graphs."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def state_dict(self):
        sd = self.scheduler.state_dict()
        return {**sd, "_last_lr": [float(lr) for lr in sd["_last_lr"]]}

    def load_state_dict(self, sd):
        self.scheduler.load_state_dict(sd)


class TrainState:
    """Step counter, data position and RNG state."""

    def __init__(self, loader: TokenBatchLoader):
        self.step = 0
        self.loader = loader

    def state_dict(self):
        sd = {"step": self.step, "data": self.loader.state_dict(), "rng_cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            sd["rng_cuda"] = torch.cuda.get_rng_state()
        return sd

    def load_state_dict(self, sd):
        self.step = int(sd["step"])
        self.loader.load_state_dict(sd["data"])
        torch.set_rng_state(sd["rng_cpu"])
        if torch.cuda.is_available() and "rng_cuda" in sd:
            torch.cuda.set_rng_state(sd["rng_cuda"])


def params_finite(model: torch.nn.Module) -> bool:
    """Every parameter finite on every rank (one host read; for checkpoint saves, not per step)."""
    bad = torch.zeros((), dtype=torch.float32, device=next(model.parameters()).device)
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        bad = bad + (~torch.isfinite(local.detach())).any().float()
    if dist.is_initialized():
        dist.all_reduce(bad)
    return float(bad) == 0
