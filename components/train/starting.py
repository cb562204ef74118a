"""Ctrl-C while a recipe is still importing (torch, torchtitan: seconds): one line, no traceback.

    from components.train.starting import stop_while_starting
    stop_while_starting()   # first thing in a recipe; components/train/entry.py takes over in run_recipe

Imports nothing heavy, so the handlers are in place before the slow imports begin.
"""

import os
import signal
import sys

STARTING_LINE = "stopped while starting, before the first step; run the same command to start again"


def _stop(signum, _frame) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(STARTING_LINE, file=sys.stderr, flush=True)
    os._exit(128 + signum)


def stop_while_starting() -> None:
    """SIGINT / SIGTERM print ``STARTING_LINE`` (rank 0) and exit 128 + signal, until ``run_recipe`` installs
    the run's own handlers."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stop)
