"""The loss-spike detector: a running mean and standard deviation of the loss, in the train state.

With `train.on_spike` other than `none` the state holds `spike = {mean, var, count}`: an
exponentially weighted mean and variance of the finite, non-spike losses (weight
`max(1 / (count + 1), 1 - train.spike_decay)`, so the first steps are a plain average). A step is
a spike when, after `train.spike_warmup` such losses, its loss exceeds

    mean + train.spike_k * sqrt(var)

A spike does not move the statistics. `skip` then drops the step's update inside the step, as
`train.on_nonfinite=skip` drops a non-finite one (`skipped` counts both), and the loop prints one
line and writes a `kind: "spike"` record; `train.max_skipped` spikes in a row stop the run.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxdist.state import Entry

KEY = "spike"
MODES = ("none", "skip", "rollback")


def entry(mesh: Mesh) -> Entry:
    """The `spike` state entry: replicated scalars, zero at the start."""
    abstract = {
        "mean": jax.ShapeDtypeStruct((), jnp.float32),
        "var": jax.ShapeDtypeStruct((), jnp.float32),
        "count": jax.ShapeDtypeStruct((), jnp.int32),
    }
    specs = {k: PartitionSpec() for k in abstract}

    def init(params: Any) -> dict[str, jax.Array]:
        del params
        return {
            "mean": jnp.zeros((), jnp.float32),
            "var": jnp.zeros((), jnp.float32),
            "count": jnp.zeros((), jnp.int32),
        }

    return Entry.from_specs(abstract, specs, mesh, init)


def judge(
    stats: dict[str, jax.Array], loss: jax.Array, finite: jax.Array, train_cfg
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """(is_spike, threshold, the statistics after this step) for the step's `loss`."""
    mean, var, count = stats["mean"], stats["var"], stats["count"]
    threshold = mean + train_cfg.spike_k * jnp.sqrt(var)
    loss = loss.astype(jnp.float32)
    spike = finite & (count >= train_cfg.spike_warmup) & (loss > threshold)
    take = finite & ~spike
    a = jnp.maximum(1.0 / (count + 1).astype(jnp.float32), 1.0 - train_cfg.spike_decay)
    d = jnp.where(take, loss - mean, 0.0)
    new = {
        "mean": jnp.where(take, mean + a * d, mean),
        "var": jnp.where(take, (1.0 - a) * (var + a * d * d), var),
        "count": count + take.astype(jnp.int32),
    }
    return spike, threshold, new
