"""Helpers of the stages' SPMD program: the varying cast and one-slot buffer reads and writes."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxdist import sharding


def varying(x: jax.Array) -> jax.Array:
    """Marks `x` as different on every device of the manual axes (shard_map's vma typing).

    Values made inside the shard_map or passed in replicated start out invariant; mixing them with
    per-stage values needs this cast, and doing it once up front (rather than implicitly inside the
    tick loop) makes autodiff transpose it into one psum after the loop instead of one per tick.
    """
    manual = tuple(jax.sharding.get_abstract_mesh().manual_axes)
    have = sharding.varying_axes(x)
    missing = tuple(a for a in manual if a not in have)
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)  # jax releases before pcast


def take(x: jax.Array, i: jax.Array) -> jax.Array:
    """x[i] along the leading axis, `i` traced."""
    return jax.lax.dynamic_index_in_dim(x, i, keepdims=False)


def put(buf: jax.Array, i: jax.Array, value: jax.Array, when: jax.Array) -> jax.Array:
    """buf[i] = value where `when`, else unchanged (one dynamic-update-slice)."""
    value = jnp.where(when, value, take(buf, i))
    return jax.lax.dynamic_update_index_in_dim(buf, value, i, 0)
