"""A save that failed, told once in one line: `CheckpointWriteError`, and orbax's noise kept quiet.

When a background write fails, orbax logs it with a traceback from its writing thread, asyncio
prints "Event loop is closed" once per abandoned array write, and the exception reaches the caller
later. `silence_failed_writes` filters exactly those; `write_error` is the line the user sees.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback

from jaxdist import orbax_reads
from jaxdist.checkpoint.layout import committed_steps
from jaxdist.checkpoint.trees import one_line_error
from jaxdist.errors import ConfigError


class CheckpointWriteError(ConfigError):
    """A save failed (disk full, permissions, ...); its message is one line for the user."""


def write_error(err: BaseException, step: int | None, directory: object) -> CheckpointWriteError:
    """One line for a save that failed: which step, where, why; the older steps are intact."""
    root = err
    while root.__cause__ is not None:
        root = root.__cause__
    cause = one_line_error(err)
    if "No space left on device" in str(root) or "os_error_code='28'" in str(root):
        why = "no space left on device"
        hint = "free space (or lower checkpoint.keep), then rerun the command to resume"
    else:
        why, hint = cause, "rerun the command to resume from the last committed step"
    kept = committed_steps(directory)
    older = f"steps {', '.join(map(str, kept))}" if kept else "none"
    what = f"checkpoint step {step}" if step is not None else "a checkpoint"
    return CheckpointWriteError(
        f"{what} could not be written to {directory}: {why}; the committed checkpoints "
        f"are untouched ({older}); {hint}"
    )


class _FailedWriteFilter(logging.Filter):
    """Drops orbax's own report of a background save that raised: jaxdist re-raises it as one line.

    Orbax logs the exception with its traceback from the writing thread (`future.py`) and then
    hands it to the caller, which turns it into CheckpointWriteError. Also drops its "Waiting for
    previous save to complete took N seconds" warning: on a loaded machine it lands between the
    console's lines and an `error:` line, and the console's ms/step already shows the wait.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        path = record.pathname.replace(os.sep, "/")
        if "/orbax/" in path and "Waiting for previous save to complete" in str(record.msg):
            return False
        failed_thread = path.endswith("/futures/future.py") or record.exc_info is not None
        return not ("/orbax/" in path and record.levelno >= logging.ERROR and failed_thread)


def _is_closed_loop_callback(exc_type, exc_value, tb) -> bool:
    """asyncio's "Event loop is closed" from a late callback of an abandoned write (or read)."""
    if exc_type is not RuntimeError or "Event loop is closed" not in str(exc_value):
        return False
    return any("asyncio" in frame.filename for frame in traceback.extract_tb(tb))


def silence_failed_writes() -> None:
    """Keeps orbax's and asyncio's tracebacks of a failed background save off the console.

    When one write fails, orbax closes its event loop while tensorstore still completes the other
    writes; each completion's callback then raises "Event loop is closed", printed through
    sys.excepthook, one traceback per array. jaxdist reports the failure once, in one line.
    """
    orbax_reads.silence_orphaned_reads()
    if not getattr(sys.excepthook, "_jaxdist_filter", False):
        previous_excepthook = sys.excepthook

        def excepthook(exc_type, exc_value, tb):
            if not _is_closed_loop_callback(exc_type, exc_value, tb):
                previous_excepthook(exc_type, exc_value, tb)

        excepthook._jaxdist_filter = True
        sys.excepthook = excepthook
    for name in ("absl", "orbax", ""):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _FailedWriteFilter) for f in logger.filters):
            logger.addFilter(_FailedWriteFilter())
    previous = threading.excepthook
    if getattr(previous, "_jaxdist_filter", False):
        return

    def hook(args):
        if "Event loop is closed" in str(args.exc_value) or (
            args.exc_type is ImportError and "shutting down" in str(args.exc_value)
        ):
            return
        previous(args)

    hook._jaxdist_filter = True
    threading.excepthook = hook
