"""The recipes' ``main``: run the training function, turn known failures into one line and an exit
code, and shut the process group down.

    error: <message>      exit 2  bad input (UserError: config, data, tokenizer, checkpoint)
    error: <message>      exit 3  too many consecutive non-finite steps (NonFiniteError)
    error: <message>      exit 4  a collective timed out or lost its connection: a peer rank (or its
                                  host) is hung or dead

Bad input and non-finite stops are the same on every rank, so only rank 0 prints them (the other
ranks exit a moment later, so torchrun's stop of the job cannot cut rank 0 off before its line); a
timeout or a lost peer is seen by the ranks still running, so each of them prints its own line.
"""

import os
import re
import sys
import time

import torch.distributed as dist

from components.errors import NonFiniteError, PeerTimeoutError, UserError

from .config import help_text

_QUIET_RANK_DELAY_S = 3.0
_LOST_PEER = ("connection closed by peer", "connection reset by peer", "remote process exited")


def _is_timeout(err: BaseException) -> bool:
    """A collective's timeout (gloo raises it as a RuntimeError, NCCL with blocking wait as a
    DistBackendError); other errors that merely mention a timeout are not mislabelled."""
    text = str(err).lower()
    if isinstance(err, dist.DistBackendError):
        return "timeout" in text or "timed out" in text
    return isinstance(err, RuntimeError) and "timed out" in text and ("gloo" in text or "collective" in text
                                                                       or "wait" in text)


def _peer_lost(err: BaseException) -> bool:
    """A collective's connection to a peer closed under it: the peer's process or host died (gloo reports the
    closed socket; NCCL a remote error)."""
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(s in text for s in _LOST_PEER)


def run_recipe(train_fn, argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(help_text(argv))
        return
    rank = int(os.environ.get("RANK", "0"))
    try:
        train_fn(argv)
    except (UserError, NonFiniteError) as err:
        if rank == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        else:
            time.sleep(_QUIET_RANK_DELAY_S)  # torchrun stops every rank once one exits: rank 0 exits first
        _shutdown()
        sys.exit(err.exit_code)
    except PeerTimeoutError as err:
        print(f"error: [rank {rank}] {err}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(err.exit_code)  # the process group cannot be shut down cleanly without the peer
    except Exception as err:
        timeout, lost = _is_timeout(err), _peer_lost(err)
        if not (timeout or lost):
            raise
        text = str(err).strip()
        first = text.splitlines()[0] if text else type(err).__name__
        first = re.sub(r"^\[[^\]]*\.cc:\d+\]\s*", "", first).split(". ")[0][:160]  # gloo's without its source line
        if timeout:
            print(f"error: [rank {rank}] a collective timed out ({first}): a peer rank is hung or dead; "
                  "[comm] train_timeout_seconds sets the limit", file=sys.stderr, flush=True)
        else:
            print(f"error: [rank {rank}] a collective lost its connection to a peer ({first}): a peer rank or its "
                  "host died; resume from the last checkpoint", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(PeerTimeoutError.exit_code)
    _shutdown()


def _shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
