"""Random-k sparsification with a key shared by every replica (`randk`), and its spec.

Every replica draws the same k = ceil(topk_ratio * size) random coordinates of each tensor (the
key is the step number, the same everywhere), so no indices cross the network: every tensor's k
values in one f32 all-reduce (`replica.pmean_flat`), ~size / k times fewer bytes than `none`, at
any number of replicas (top-k's all-gather grows with it). Two ways to account for what is not sent:

  error_feedback=True   (default) the values go unscaled and this replica's residual keeps the
                        rest, added next step: the sum of what is sent follows the sum of the
                        gradients (Stich et al., 2018, "Sparsified SGD with memory").
  error_feedback=False  unbiased: the values are scaled by size / k, so the expected result is the
                        mean gradient; its variance grows by ~size / k (Wangni et al., 2018).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import jaxdist.compression.replica as replica
import jaxdist.compression.tensors as tensors
from jaxdist.compression.replica import AxisName
from jaxdist.compression.spec import CompressorSpec, TrainFields, field, ring
from jaxdist.compression.topk import topk_k


class RandKState(NamedTuple):
    count: jax.Array  # [1] int32 steps taken: the step's shared key
    residual: Any  # params-shaped f32 [1, ...] per leaf: not sent yet; None without EF


def randk(
    axis_name: AxisName,
    ratio: float,
    error_feedback: bool = True,
    seed: int = 0,
    batch_dims: Any = None,
) -> optax.GradientTransformation:
    """Random-k sparsification, the same k coordinates on every replica (see the module doc).

    The replica-invariance contract (jaxdist/compression/replica.py): the coordinates must be
    typed invariant over `axis_name` for the mean to leave the shard_map replicated. The step
    counter is a per-replica state leaf, typed varying although it is equal everywhere, so it
    goes through one `pmax` (a 4-byte all-reduce per step) before it seeds the draw. `batch_dims`
    (an int or a tree like the params) marks leading stacked-layer axes: each layer draws its own
    coordinates.
    """
    if not 0 < ratio <= 1:
        raise ValueError(f"randk: ratio={ratio} must be in (0, 1]")
    axes = replica.axes(axis_name)

    def init(params):
        residual = tensors.worker_zeros(params) if error_feedback else None
        return RandKState(jnp.zeros((1,), jnp.int32), residual)

    def pick(g, e, key):
        """One layer's k coordinates: (their values, their indices, the error-fed gradient)."""
        acc = g.reshape(-1).astype(jnp.float32)
        if e is not None:
            acc = acc + e.reshape(-1)
        n = acc.size
        k = topk_k(ratio, n)
        if k >= n:
            return acc, jnp.arange(n), acc
        idx = jax.random.choice(key, n, (k,), replace=False)  # the same on every replica
        return acc[idx], idx, acc

    def place(mean, idx, acc):
        """The mean of the k values back at their coordinates; what stays in the residual."""
        n, k = acc.size, idx.size
        scale = 1.0 if error_feedback or k >= n else n / k
        return jnp.zeros((n,), jnp.float32).at[idx].set(mean * scale), acc.at[idx].set(0)

    def update(grads, state, params=None):
        del params
        step = jax.lax.pmax(state.count[0], axes)  # typed invariant: see the contract above
        key = jax.random.fold_in(jax.random.key(seed), step)
        picked = {}

        def select(i, g, b, e):
            lead = g.shape[:b]
            keys = jax.random.split(jax.random.fold_in(key, i), math.prod(lead)).reshape(lead)
            picked[i] = tensors.per_layer(pick, b)(g, None if e is None else e[0], keys)
            return g, e

        tensors.map_float_leaves(select, grads, (state.residual,), batch_dims)
        order = sorted(picked)
        means = replica.pmean_flat([picked[i][0] for i in order], axis_name)  # the one collective
        means = dict(zip(order, means, strict=True))

        def leaf(i, g, b, e):
            _, idx, acc = picked[i]
            out, left = tensors.per_layer(place, b)(means[i], idx, acc)
            return out.reshape(g.shape).astype(g.dtype), (
                None if e is None else left.reshape(e.shape[1:])[None]
            )

        out, (residual,) = tensors.map_float_leaves(leaf, grads, (state.residual,), batch_dims)
        return out, RandKState(state.count + 1, residual)

    return optax.GradientTransformation(init, update)


def _randk_wire(grad_bytes: float, replicas: int, cfg: Any, shape=None) -> float:
    """One f32 all-reduce of k values (the 4-byte pmax of the step is per step, not per tensor)."""
    n = int(grad_bytes // 4)
    return ring("all-reduce", 4 * topk_k(float(field(cfg, "topk_ratio")), n), replicas)


def _randk_from(axis_name: AxisName, cfg: Any, t: TrainFields) -> optax.GradientTransformation:
    return randk(
        axis_name, float(field(cfg, "topk_ratio")),
        error_feedback=bool(field(cfg, "error_feedback")), batch_dims=t.batch_dims,
    )  # fmt: skip


RANDK = CompressorSpec(
    name="randk",
    build=_randk_from,
    summary="the same k random coordinates on every replica, one all-reduce of k values",
    wire_bytes=_randk_wire,
    fields=("topk_ratio", "error_feedback"),
    error_feedback=True,
    residual_fields=("residual",),
    state_bytes=lambda grad_bytes, replicas, cfg: grad_bytes if field(cfg, "error_feedback") else 0,
    # the draw (a permutation: ~log2(n) passes) and the gather / scatter
    extra_flops=lambda grad_bytes, replicas, cfg: (
        grad_bytes / 4 * math.log2(max(2, grad_bytes / 4))
    ),
    example={"topk_ratio": 0.1},
    dense_estimate=False,
)
