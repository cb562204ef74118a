"""The environment of a subprocess in the tests (a training run, a Triton interpreter script): os.environ, the
caller's additions, and TorchDynamo off (TORCHDYNAMO_DISABLE=1) unless the run's arguments turn ``[compile] enable``
on.

torchtitan calls torch.compile while it is imported (its attention wrappers), and that loads TorchInductor: ~2.5 s
of CPU in every process, which a run that compiles nothing never uses (a third of tests/test_recipe.py's time on
two cores). With TorchDynamo off torch.compile returns the function as it is, so such a run executes the same code.
"""

import os
from collections.abc import Iterable

FALSE = ("false", "0", "no", "off")


def compiles(args: Iterable) -> bool:
    """Whether these recipe arguments turn ``[compile] enable`` on (the last mention wins; a bare flag means on)."""
    args, on = [str(a) for a in args], False
    for i, a in enumerate(args):
        if a == "--compile.enable":
            value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else "true"
        elif a.startswith("--compile.enable="):
            value = a.split("=", 1)[1]
        else:
            continue
        on = value.lower() not in FALSE
    return on


def run_env(args: Iterable = (), **extra: str) -> dict:
    """os.environ + ``extra``, with TORCHDYNAMO_DISABLE=1 where ``args`` leave compile off."""
    args = list(args)
    env = {**os.environ, **extra}
    if not compiles(args):
        env["TORCHDYNAMO_DISABLE"] = "1"
    return env
