"""``moe-echo-run``: torchrun with the recipes' own report instead of torchrun's.

    .venv/bin/moe-echo-run --nproc_per_node 2 recipes/pretrain.py --job.config_file train_configs/debug_cpu.toml
    .venv/bin/moe-echo-run --nnodes 2 --node_rank 0 --nproc_per_node 8 --master_addr HOST0 recipes/pretrain.py ...

Every torchrun argument means what it means to torchrun (``python -m components.train.launch`` is the same
command). The workers print how the run ended (``error: ...`` once, or ``stopped at step N ...``); this
launcher adds no failure summary and no traceback, and exits with the run's code:

    0        every rank finished
    2, 3, 4  the first rank that failed: bad input, too many non-finite steps, a lost or hung peer
             (components/train/entry.py)
    128 + n  the launcher stopped by signal n (Ctrl-C: 130; the workers get the signal too and stop
             with their one line), or the first failed rank killed by signal n

torchrun's own log lines (the OMP_NUM_THREADS note, forwarded signals, the failed rank and the workers it
stopped after it) are not shown; what it raises (a rendezvous that cannot start, ...) still is.
"""

import logging
import sys

QUIET_LOGGERS = ("torch.distributed.run", "torch.distributed.elastic", "torch.distributed.launcher")


def exit_code(failure_exitcode: int) -> int:
    """A worker's exit status as a shell reports it: negative (killed by signal n) becomes 128 + n."""
    return 128 - failure_exitcode if failure_exitcode < 0 else failure_exitcode


def quiet(prefixes: tuple[str, ...]) -> None:
    """Silence the loggers under ``prefixes`` (each of torch's elastic modules sets its own level, so the
    parents' level alone does not reach them)."""
    names = [n for n in logging.root.manager.loggerDict if n.startswith(prefixes)]
    for name in (*prefixes, *names):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    quiet(QUIET_LOGGERS)
    try:
        run(args)
    except ChildFailedError as err:
        _, failure = err.get_first_failure()
        return exit_code(failure.exitcode)
    except SignalException as err:
        return 128 + int(err.sigval)
    except KeyboardInterrupt:  # Ctrl-C before torchrun's agent installed its handlers
        return 130
    return 0


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
