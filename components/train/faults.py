"""Fault injection for the end-to-end tests, driven by environment variables (off unless set).

    MOE_ECHO_FAULT_NAN_AT_STEP=N    before step N, one weight of the first MoE layer's experts
                                    becomes NaN (the non-finite guard must stop the run and name it)
    MOE_ECHO_FAULT_STOP_AT_STEP=N   before step N, the last rank stops itself (SIGSTOP), as a hung
                                    peer would (the collective timeout must end the run)

(``MOE_ECHO_FAULT_KILL_AT_CHECKPOINT`` lives in checkpoint.py.)
"""

import os
import signal

import torch

from components.tensors import local_of


def _at(name: str, step: int) -> bool:
    return os.environ.get(name) == str(step)


def inject(step: int, model: torch.nn.Module, layers, rank: int, world: int) -> None:
    if _at("MOE_ECHO_FAULT_NAN_AT_STEP", step) and layers:
        experts = layers[0][1].experts
        w1, copy = experts.w1, experts.copies.get(experts.w1)
        with torch.no_grad():
            for t in (local_of(w1), copy.compute if copy is not None else None):  # compute: what the forward reads
                if t is not None:  # (a view of half of [w1; w3] in QuACK's layout: indexed, not flattened)
                    t[(0,) * t.dim()] = float("nan")
    if _at("MOE_ECHO_FAULT_STOP_AT_STEP", step) and rank == world - 1 and world > 1:
        os.kill(os.getpid(), signal.SIGSTOP)
