"""How a run reports: ``MetricsWriter`` appends JSON lines to ``workdir/metrics.jsonl`` and mirrors
scalars to TensorBoard.

What a compiled step costs lives next door: bytes on the wire in `jaxdist.hlo_cost`, FLOPs and MFU
in `jaxdist.flops`. Their public names are re-exported here, so `metrics.collective_bytes`,
`metrics.peak_flops`, `metrics.mfu`, ... keep working for callers.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from jaxdist.flops import PEAK_FLOPS, mfu, model_flops_per_token, peak_flops
from jaxdist.hlo_cost import (
    COLLECTIVE_KINDS,
    CollectiveOp,
    collective_bytes,
    collective_ops,
    collective_phases,
    ring_wire_bytes,
)

_IMPORT_LOCK = threading.Lock()


def _summary_writer() -> type:
    """tensorboardX's `SummaryWriter`, imported without importing torch.

    tensorboardX's `writer` module imports torch whenever it is installed (the `hf` extra), only to
    name `torch.Tensor` in type hints; its torch features import torch again where they are used.
    jaxdist writes float scalars, so that import is ~2 s of CPU in every process that writes metrics
    for nothing. While tensorboardX is first imported, `import torch` fails as if torch were
    absent; torch stays importable before and after.
    """
    with _IMPORT_LOCK:
        if "tensorboardX" in sys.modules or "torch" in sys.modules:
            from tensorboardX import SummaryWriter

            return SummaryWriter
        sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` -> ImportError
        try:
            from tensorboardX import SummaryWriter
        finally:
            del sys.modules["torch"]
        return SummaryWriter


def human_duration(seconds: float) -> str:
    """`42s`, `3m05s`, `1h02m`: a duration at the precision a reader needs."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def human_bytes(n: float | None) -> str:
    """`n` bytes for a reader: "512 B", "2.0 KiB", "1.5 GiB"; None is "n/a"."""
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _to_json(value: Any) -> Any:
    """Plain JSON values: numpy/jax scalars to int/float, arrays to lists, NaN/inf to None."""
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        # Strict JSON has no NaN; null keeps every line loadable by any parser.
        return float(value) if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    if getattr(value, "is_fully_addressable", True) is False:
        value = value.addressable_data(0)  # a replicated multi-host jax.Array: the local copy
    try:
        array = np.asarray(value)
    except Exception:  # anything numpy cannot read is logged by its repr
        return str(value)
    if array.dtype == object:
        return str(value)
    return _to_json(array.item() if array.ndim == 0 else array.tolist())


def _scalars(record: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """(tag, value) for every number in a JSON-ready record; nested dicts become `a/b` tags."""
    for key, value in record.items():
        tag = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _scalars(value, tag + "/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield tag, float(value)


class MetricsWriter:
    """Appends one JSON object per line to ``workdir/metrics.jsonl``; scalars also to TensorBoard.

    Only process 0 of a multi-process job should write: construct the others with
    ``enabled=False`` and every method does nothing. Each line is flushed as it is written, so the
    file survives a crash. NaN and infinity are written as null, keeping every line strict JSON.

    Example::

        writer = MetricsWriter(workdir, enabled=jax.process_index() == 0)
        writer.write_layout({"mesh": {"data": 8}, "collective_bytes_per_step": bytes_by_kind})
        writer.write_step(10, {"loss": loss, "step_time_s": 0.12})
        writer.close()
    """

    def __init__(self, workdir: str, enabled: bool = True):
        self.workdir = workdir
        self.enabled = enabled
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._file = None
        self._tensorboard = None

    def _write(self, record: Mapping[str, Any]) -> dict[str, Any]:
        clean = _to_json(record)
        if self._file is None:
            os.makedirs(self.workdir, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # closed in close()
        self._file.write(json.dumps(clean, allow_nan=False) + "\n")
        self._file.flush()
        return clean

    def write_layout(self, record: Mapping[str, Any]) -> None:
        """Writes ``{"kind": "layout", **record}``: what the compiled step looks like."""
        if self.enabled:
            self._write({"kind": "layout", **record})

    def write_record(self, record: Mapping[str, Any]) -> None:
        """Writes `record` as it is (it names its own `kind`, e.g. the run's `goodput`)."""
        if self.enabled:
            self._write(record)

    def write_step(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Writes ``{"step": step, **metrics}``, and each scalar to TensorBoard at ``step``."""
        if not self.enabled:
            return
        clean = self._write({"step": int(step), **metrics})
        if self._tensorboard is None:
            # Imported late: tensorboardX pulls in protobuf, which disabled processes never need.
            self._tensorboard = _summary_writer()(logdir=self.workdir)
        for tag, value in _scalars({k: v for k, v in clean.items() if k != "step"}):
            self._tensorboard.add_scalar(tag, value, global_step=int(step))
        self._tensorboard.flush()

    def close(self) -> None:
        """Flushes and closes the files; safe to call twice."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


__all__ = [
    "COLLECTIVE_KINDS",
    "PEAK_FLOPS",
    "CollectiveOp",
    "MetricsWriter",
    "collective_bytes",
    "collective_ops",
    "collective_phases",
    "mfu",
    "model_flops_per_token",
    "peak_flops",
    "ring_wire_bytes",
]
