"""Debugging aids shared by the layers and the step wrapper.

    DEBUG_CHECKS   MOE_ECHO_CHECK=1 in the environment: host-side invariant checks after dispatch and
                   on symmetric-memory setup (they read the device, so they sync: slow, never default)
    setup_work()   context for one-time setup (allocation, rendezvous, graph capture) that may wait on
                   the device: exempt from ``torch.cuda.set_sync_debug_mode``, which guards the step
"""

import os
from contextlib import contextmanager

import torch

DEBUG_CHECKS = os.environ.get("MOE_ECHO_CHECK") == "1"


@contextmanager
def setup_work():
    if not torch.cuda.is_available():
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)
