"""Quiet the noise of orbax reads abandoned after one failed: the one place that patches hooks.

When one array of a restore fails, orbax abandons the concurrent reads of the others and ends its
event loop; they surface later as "Exception ignored in <coroutine ...>" / "Event loop is closed"
(through `sys.unraisablehook`) or asyncio's "Task exception was never retrieved" (logged), each with
a traceback, long after the one-line error that said what happened. `silence_orphaned_reads`
filters exactly those; anything else still reaches its hook or handler. It is installed only after a
read failed (jaxdist.checkpoint) or by `scripts/ckpt.py verify`, never at import time.
"""

from __future__ import annotations

import logging
import sys
import traceback


class _OrphanedReadFilter(logging.Filter):
    """Drops asyncio's "Task/Future exception was never retrieved" for orbax's abandoned reads."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if "exception was never retrieved" not in msg:
            return True
        detail = msg
        if record.exc_info and record.exc_info[0] is not None:
            detail += "".join(traceback.format_exception(*record.exc_info))
        return "orbax" not in detail and "_read_array_index_and_device_put" not in detail


def _orphaned(unraisable) -> bool:
    obj = getattr(unraisable, "object", None)
    name = getattr(obj, "__qualname__", "") or getattr(getattr(obj, "cr_code", None), "co_name", "")
    msg = str(getattr(unraisable, "exc_value", ""))
    return "_read_array_index_and_device_put" in name or "Event loop is closed" in msg


def silence_orphaned_reads() -> None:
    """Installs the asyncio log filter and the `sys.unraisablehook` filter, once per process."""
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _OrphanedReadFilter) for f in asyncio_log.filters):
        asyncio_log.addFilter(_OrphanedReadFilter())
    previous = sys.unraisablehook
    if getattr(previous, "_jaxdist_filter", False):
        return

    def hook(unraisable):
        if not _orphaned(unraisable):
            previous(unraisable)

    hook._jaxdist_filter = True
    sys.unraisablehook = hook
