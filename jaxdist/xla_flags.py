"""XLA flags for training on NVIDIA GPUs (`runtime.gpu_xla_flags`), merged into `XLA_FLAGS`.

XLA reads `XLA_FLAGS` once, when the first backend starts, so `apply` must run before any
computation (the train and bench scripts call it first thing). Flags the user already set in
`XLA_FLAGS` win. An unknown flag is fatal to XLA; `tests/test_xla_flags.py` checks that every flag
here is known to the installed jaxlib.
"""

from __future__ import annotations

import os

# What NVIDIA's JAX-Toolbox and MaxText's GPU recipes set for LLM training.
GPU_PERFORMANCE_FLAGS: dict[str, str] = {
    # Schedule collectives early and wait late, so FSDP gathers and gradient reductions run under
    # compute (`Hardware.overlap` in jaxdist/plan/hardware.py assumes this), on a high-priority stream.
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    "xla_gpu_enable_highest_priority_async_stream": "true",
    # Combine the per-layer collectives of the scanned layers into fewer, larger ones (128 MiB).
    "xla_gpu_all_reduce_combine_threshold_bytes": str(128 * 2**20),
    "xla_gpu_all_gather_combine_threshold_bytes": str(128 * 2**20),
    "xla_gpu_reduce_scatter_combine_threshold_bytes": str(128 * 2**20),
    # Start the next layer's gather / this layer's reduction in the previous / next loop iteration.
    "xla_gpu_enable_pipelined_all_gather": "true",
    "xla_gpu_enable_pipelined_reduce_scatter": "true",
    "xla_gpu_enable_pipelined_all_reduce": "true",
    "xla_gpu_enable_while_loop_double_buffering": "true",
}


def merged(existing: str, flags: dict[str, str]) -> str:
    """`existing` (an XLA_FLAGS string) plus every flag in `flags` it does not already set."""
    present = {tok[2:].split("=", 1)[0] for tok in existing.split() if tok.startswith("--")}
    extra = [f"--{name}={value}" for name, value in flags.items() if name not in present]
    return " ".join([existing.strip(), *extra]).strip()


def apply(enabled: bool, memory_fraction: float = 0.0) -> None:
    """Before any backend starts: adds `GPU_PERFORMANCE_FLAGS` to XLA_FLAGS when `enabled`, and sets
    XLA_PYTHON_CLIENT_MEM_FRACTION (the share of GPU memory JAX preallocates) when
    `memory_fraction` > 0, unless the user already set that variable."""
    if enabled:
        os.environ["XLA_FLAGS"] = merged(os.environ.get("XLA_FLAGS", ""), GPU_PERFORMANCE_FLAGS)
    if memory_fraction > 0:
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{memory_fraction:g}")
