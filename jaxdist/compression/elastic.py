"""The elastic compressor state: what error feedback owes, kept across a change of replica count.

`resize_replicas` redistributes per-replica state saved with R replicas onto R' (an elastic
resume, jaxdist/checkpoint.py) so that the mean over replicas of what the residuals owe the model
is preserved exactly; `residual_norm` is that debt's size, a metric.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.compression.registry import residual_fields
from jaxdist.errors import ConfigError


def residual_norm(state: Any) -> jax.Array:
    """RMS over replicas of the L2 norm of each replica's compression error (all residual fields).

    `state` is the global sync state ([R, ...] leaves, split over the data axes); 0 for
    compressors without residuals. Each replica's squares are summed over all its residuals
    first, so the replicas meet in one scalar all-reduce, not one per residual array (on
    XLA:CPU each array's all-reduce pays its own messages' latency).
    """
    per_replica, r = None, 1
    for name in residual_fields():
        for x in jax.tree.leaves(getattr(state, name, None)):
            sq = jnp.sum(jnp.square(x.astype(jnp.float32)), axis=tuple(range(1, x.ndim)))
            per_replica, r = sq if per_replica is None else per_replica + sq, x.shape[0]
    if per_replica is None:
        return jnp.zeros((), jnp.float32)
    return jnp.sqrt(jnp.sum(per_replica) / r)


def resize_replicas(saved: dict[str, np.ndarray], shapes: dict[str, tuple[int, ...]]) -> dict:
    """Per-replica state saved with R replicas, redistributed onto R' (an elastic resume).

    What error feedback owes the model is the mean over replicas of the residuals (the mean
    gradient later gets it back), so that mean is what is preserved, exactly:
      - float leaves shaped alike apart from the replica axis (residuals, DGC velocities, 1-bit
        Adam's momentum, PowerSGD's Q, local SGD's parameters and inner optimizer states): every
        new replica gets the mean of the saved ones. Leaves the same on all replicas stay as they
        are; local SGD's replicas restart from their average.
      - integer leaves (step counters, PRNG keys): the saved replica 0's, on every replica.
      - a two-phase compressor's server residuals (`.../server/...`, one shard of the tensor per
        replica, their layout depends on R): the shards are put back together into the tensor,
        which is owed to the mean directly, and added to every new worker residual
        (`.../worker/...`); the new server residuals are zero.

    Args:
      saved: path -> array [R, ...] for every leaf of the per-replica subtrees.
      shapes: path -> the shape the restoring run expects, [R', ...].

    Returns:
      path -> array of the expected shape.

    Raises:
      ConfigError: a leaf that cannot be redistributed (its shape changed in another way, e.g. a
        different model, or server residuals kept per fsdp/tensor shard).
    """
    out: dict[str, np.ndarray] = {}
    folded: dict[str, np.ndarray] = {}
    for path, x in saved.items():
        want = tuple(shapes[path])
        parts = path.split("/")
        if "server" not in parts and tuple(x.shape[1:]) == want[1:]:
            if np.issubdtype(x.dtype, np.floating):
                row = x.astype(np.float64).mean(0).astype(x.dtype)
            else:
                row = x[0]
            out[path] = np.broadcast_to(row, want).copy()
            continue
        worker = "/".join("worker" if p == "server" else p for p in parts)
        if worker not in saved:  # top-k's two-phase server residual pairs with `residual`
            worker = "/".join("residual" if p == "server" else p for p in parts)
        if "server" not in parts or worker not in saved:
            raise ConfigError(
                f"{path} is saved as {list(x.shape)} and cannot be redistributed onto "
                f"{list(want)} (resume with {x.shape[0]} data replicas, or use a new workdir)"
            )
        param_shape = tuple(saved[worker].shape[1:])
        layers = tuple(x.shape[1:-1])
        n = math.prod(param_shape) // max(math.prod(layers), 1)
        if param_shape[: len(layers)] != layers or x.shape[0] * x.shape[-1] < n:
            raise ConfigError(
                f"{path}: server residuals kept per fsdp/tensor/pipeline shard cannot be "
                f"redistributed onto another number of data replicas (resume with {x.shape[0]})"
            )
        whole = np.moveaxis(x, 0, -2).reshape(*layers, -1)[..., :n]  # [*layers, R s] -> trimmed
        folded[worker] = whole.reshape(param_shape)
        out[path] = np.zeros(want, x.dtype)
    for worker, owed in folded.items():
        out[worker] = (out[worker] + owed[None]).astype(out[worker].dtype)
    return out
