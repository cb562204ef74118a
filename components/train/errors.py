"""User-facing errors: the recipes print ``error: <message>`` on one line and exit with code 2."""


class UserError(Exception):
    """Bad input from the user (config, data path, tokenizer, checkpoint). The message is one line
    that names the offending key or path, what was found, and what is expected."""
