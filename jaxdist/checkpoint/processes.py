"""Agreement between a job's processes for checkpoints: one all-gather or barrier per decision.

With one process each function is the identity (or nothing), so single-process code pays nothing.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


def all_processes_ok(ok: bool) -> bool:
    """True only if `ok` holds on every process, so that all processes take the same branch."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.asarray(ok, np.int32))))


def barrier(name: str) -> None:
    """Waits for every process at `name` (the same name on every process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def gather_json(obj: Any) -> list[Any]:
    """`obj` (JSON-serialisable) from every process, in process order."""
    if jax.process_count() == 1:
        return [obj]
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([data.size], np.int64)))
    sizes = sizes.reshape(-1)
    buf = np.zeros(int(sizes.max()), np.uint8)
    buf[: data.size] = data
    every = np.asarray(multihost_utils.process_allgather(buf))
    return [json.loads(bytes(every[i, : int(n)])) for i, n in enumerate(sizes)]
