"""Errors the recipes turn into one line on stderr and an exit code (the bottom floor of the
import ladder: every package may import it)."""


class UserError(Exception):
    """Bad input from the user (config, data path, tokenizer, checkpoint): ``error: <message>``,
    exit code 2. The message is one line that names the offending key or path, what was found,
    and what is expected."""

    exit_code = 2


class NonFiniteError(Exception):
    """Training produced non-finite values for too many consecutive steps: ``error: <message>``,
    exit code 3. The weights were never updated from them (the optimizer step was gated)."""

    exit_code = 3


class PeerTimeoutError(Exception):
    """A collective waited longer than the process-group timeout (a peer rank is hung or dead):
    ``error: <message>``, exit code 4."""

    exit_code = 4
