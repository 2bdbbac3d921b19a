"""The blocks the experiment files in configs/ share: where they run and how they train.

def get_config():
    c = base_config()
    recipes.cpu_or_accelerators(c, data=2, fsdp=2, tensor=2)
    c.model.name = "llama"
    ...
    recipes.cpu_seconds_run(c)
    return locked(c)
"""

from __future__ import annotations

import glob
import importlib.util
import os

import ml_collections


def accelerator_present() -> bool:
    """Whether this machine has a GPU or TPU JAX could use, checked without starting a backend.

    Configs use it to choose between real devices and simulated CPU devices before JAX starts
    (after a backend starts, the simulated device count can no longer change).
    """
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return False
    if (
        glob.glob("/dev/nvidia[0-9]*")
        or glob.glob("/dev/accel[0-9]*")
        or glob.glob("/dev/vfio/[0-9]*")
    ):
        return any(
            importlib.util.find_spec(m) is not None
            for m in (
                "jax_plugins.xla_cuda12",
                "jax_plugins.xla_cuda13",
                "libtpu",
                "jax_cuda12_plugin",
                "jax_cuda13_plugin",
            )
        )
    return False


def cpu_or_accelerators(c: ml_collections.ConfigDict, **cpu_mesh: int) -> None:
    """With GPUs or TPUs every device is data-parallel; on a CPU-only machine the run simulates 8
    devices, split along the mesh axes `cpu_mesh` names (their product is 8)."""
    if accelerator_present():
        c.mesh.data = -1
        return
    c.runtime.cpu_devices = 8
    for axis, size in cpu_mesh.items():
        c.mesh[axis] = size


def cpu_seconds_run(
    c: ml_collections.ConfigDict, *, steps: int = 200, batch_size: int = 16
) -> None:
    """The tiny configs' schedule, seconds per hundred steps on a CPU: learning rate 3e-3 after
    20 warm-up steps, a line every 20 steps, an evaluation and a checkpoint every 100."""
    c.train.steps = steps
    c.train.batch_size = batch_size
    c.train.learning_rate = 3e-3
    c.train.warmup_steps = 20
    c.train.log_every = 20
    c.train.eval_every = 100
    c.checkpoint.every = 100


def accelerator_run(
    c: ml_collections.ConfigDict,
    *,
    batch_size: int,
    learning_rate: float = 3e-4,
    log_every: int = 20,
    checkpoint_every: int = 1000,
) -> None:
    """The real shapes' recipe for GPUs and TPUs: bfloat16 compute, flash attention where it applies
    (`model.attention=auto`), activations rematerialised except the matmul outputs without batch
    dimensions, the embedding gradient as a one-hot matmul (no scatter atomics), 10,000 steps
    after 500 of warm-up, weight decay 0.1, an evaluation every 1,000 steps."""
    c.model.attention = "auto"
    c.model.embed_grad = "matmul"
    c.train.steps = 10000
    c.train.batch_size = batch_size
    c.train.learning_rate = learning_rate
    c.train.warmup_steps = 500
    c.train.weight_decay = 0.1
    c.train.compute_dtype = "bfloat16"
    c.train.remat = "dots_no_batch"
    c.train.log_every = log_every
    c.train.eval_every = 1000
    c.checkpoint.every = checkpoint_every
