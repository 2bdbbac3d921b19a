"""The exceptions a user sees, each printed as one line: a bad input, a training run gone non-finite."""

from __future__ import annotations

import sys
from collections.abc import Callable


class ConfigError(ValueError):
    """Raised before compilation; the message is one line naming the field and what would be valid."""


class NonFiniteError(RuntimeError):
    """Training stopped on a non-finite loss or gradient (`train.on_nonfinite`, `train.max_skipped`).

    The message is one line naming the step and the last good checkpoint.
    """


def run_command(fn: Callable[..., int | None], *args, extra: str = "", **kwargs) -> int:
    """Runs a script's command and returns its exit status: `fn`'s result if an int, else 0.

    A `ConfigError` or `NonFiniteError` prints one `error:` line and gives 2. With `extra`, so does
    a missing optional package (an ImportError), naming the extra that brings it. An absl
    `app.run` may be `fn`: its own exit on success passes through.
    """
    try:
        status = fn(*args, **kwargs)
    except (ConfigError, NonFiniteError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ImportError as err:
        if not extra:
            raise
        print(f"error: {err}; install the extra: pip install -e '.[{extra}]'", file=sys.stderr)
        return 2
    return status if isinstance(status, int) else 0
