"""The exceptions a user sees, each printed as one line: a bad input, a training run gone non-finite."""


class ConfigError(ValueError):
    """Raised before compilation; the message is one line naming the field and what would be valid."""


class NonFiniteError(RuntimeError):
    """Training stopped on a non-finite loss or gradient (`train.on_nonfinite`, `train.max_skipped`).

    The message is one line naming the step and the last good checkpoint.
    """
