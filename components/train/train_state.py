"""What a checkpoint holds: model + optimizer (DCP Stateful, FQN-keyed, so a checkpoint saved at one EP /
FSDP layout loads at another), the lr schedule and the train state (step, data position, RNG). Learning
rates are saved as numbers, so checkpoints load with or without CUDA graphs."""

import re

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from components.tensors import local_of

from .data import TokenBatchLoader
from .master_adamw import refresh_compute_copies, with_masters


class ModelAndOptimizer:
    """DCP Stateful view of model + optimizer. With fp32 master weights (MasterAdamW) the model's
    entries are the masters: checkpoints hold fp32 weights on every path, and DCP loads into them in
    place before ``load_state_dict`` copies them into the bf16 parameters."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.tensor_lr_groups: set[int] = set()  # groups whose lr the checkpoint being loaded holds as a tensor

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": with_masters(self.optimizer, model_sd),
                "optim": _lr_as_number(optim_sd, self.tensor_lr_groups)}

    def match_stored(self, tensor_keys: set[str]) -> None:
        """Checkpoints of graphed runs written before learning rates were saved as numbers hold them as tensors."""
        self.tensor_lr_groups = {int(m.group(1)) for k in tensor_keys
                                 if (m := re.fullmatch(r"optim\.param_groups\.(\d+)\.lr", k))}

    def load_state_dict(self, sd):
        lr_before = [g["lr"] for g in self.optimizer.param_groups]
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        for group, old in zip(self.optimizer.param_groups, lr_before):
            value = float(group["lr"])  # a captured step reads a tensor lr: fill it and keep it
            group["lr"] = old.fill_(value) if isinstance(old, torch.Tensor) else value
        self.tensor_lr_groups = set()
        refresh_compute_copies(self.model, self.optimizer)  # the copies the optimizer writes, from the loaded weights


def _lr_as_number(optim_sd: dict, as_tensor: set[int] = frozenset()) -> dict:
    """A graphed run's learning rate is a device tensor (``make_capturable``); checkpoints hold it as a number,
    so a checkpoint loads into a run with or without CUDA graphs (one host read per save). Groups in
    ``as_tensor``: a host tensor, to match a checkpoint that stored one."""
    def lr(i, v):
        return torch.tensor(float(v)) if i in as_tensor else float(v)

    groups = [{k: lr(i, v) if k == "lr" else v for k, v in g.items()} for i, g in enumerate(optim_sd["param_groups"])]
    return {**optim_sd, "param_groups": groups}


class LRSchedule:
    """DCP Stateful view of the lr scheduler, its last learning rates as numbers (a graphed run's are device
    tensors), so a checkpoint loads into a run with or without CUDA graphs."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.tensor_last_lr = False  # the checkpoint being loaded holds them as tensors (written by earlier versions)

    def state_dict(self):
        sd = self.scheduler.state_dict()
        last = [float(lr) for lr in sd["_last_lr"]]
        return {**sd, "_last_lr": [torch.tensor(v) for v in last] if self.tensor_last_lr else last}

    def match_stored(self, tensor_keys: set[str]) -> None:
        self.tensor_last_lr = any(k.startswith("_last_lr.") for k in tensor_keys)

    def load_state_dict(self, sd):
        self.scheduler.load_state_dict({**sd, "_last_lr": [float(lr) for lr in sd["_last_lr"]]})
        self.tensor_last_lr = False


class TrainState:
    """Step counter, data position (with the global batch it counts, so a run resumed at another rank count
    or batch size reads on from there) and RNG state."""

    def __init__(self, loader: TokenBatchLoader):
        self.step = 0
        self.loader = loader
        self.stored_global_batch = True  # False: the checkpoint being loaded predates that entry

    def state_dict(self):
        sd = {"step": self.step, "data": self.loader.state_dict(), "rng_cpu": torch.get_rng_state()}
        if self.stored_global_batch:
            sd["data_global_batch"] = torch.tensor(self.loader.batch_size * self.loader.world_size)
        if torch.cuda.is_available():
            sd["rng_cuda"] = torch.cuda.get_rng_state()
        return sd

    def match_stored(self, tensor_keys: set[str]) -> None:
        self.stored_global_batch = "data_global_batch" in tensor_keys

    def load_state_dict(self, sd):
        self.step = int(sd["step"])
        global_batch = int(sd["data_global_batch"]) if "data_global_batch" in sd else None
        self.loader.load_state_dict(sd["data"], global_batch)
        self.stored_global_batch = True
        torch.set_rng_state(sd["rng_cpu"])
        if torch.cuda.is_available() and "rng_cuda" in sd:
            torch.cuda.set_rng_state(sd["rng_cuda"])


def params_finite(model: torch.nn.Module) -> bool:
    """Every parameter finite on every rank (one host read; for checkpoint saves, not per step)."""
    bad = torch.zeros((), dtype=torch.float32, device=next(model.parameters()).device)
    for p in model.parameters():
        local = local_of(p)
        bad = bad + (~torch.isfinite(local.detach())).any().float()
    if dist.is_initialized():
        dist.all_reduce(bad)
    return float(bad) == 0
