"""Microbatches: what the plain and the pipelined gradients share.

The compute-dtype cast of the parameters, the split of a batch into microbatches that moves no row
to another device, and gradient accumulation over such a split. `train.py` and `pipeline/` both
use these; neither imports the other for them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from jaxdist import sharding

GradFn = Callable[[Any, dict[str, jax.Array]], tuple[jax.Array, dict, Any]]


def cast_floating(tree: Any, dtype: Any) -> Any:
    """Every floating-point leaf of `tree` as `dtype` (the compute dtype); other leaves unchanged."""
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


def split_rows(x: jax.Array, n: int, axes: tuple[str | None, ...], mesh: Mesh) -> jax.Array:
    """[B, ...] -> [n, B/n, ...]: microbatch a takes rows a, a+n, a+2n, ...

    Every device keeps its own rows (no reshuffle); the result is pinned to the compute sharding of
    `(None, *axes)`, minus the axes a surrounding shard_map or vmap holds manually.
    """
    x = x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1)
    spec = sharding.logical_to_spec((None, *axes), sharding.COMPUTE_RULES, mesh)
    return sharding.constrain_to(x, NamedSharding(mesh, spec))


def accumulated(
    grad_fn: GradFn,
    steps: int,
    batch_axes: dict[str, tuple[str | None, ...]],
    mesh: Mesh,
    *,
    constrain: Callable[[Any], Any] = lambda tree: tree,
) -> GradFn:
    """`grad_fn` averaged over `steps` microbatches of each batch, one `lax.scan` step each.

    Args:
      grad_fn: (params, batch) -> (mean loss, aux metrics, grads shaped like params).
      steps: microbatches per batch (`train.grad_accum`); 1 returns `grad_fn` itself.
      batch_axes: logical axes of each batch entry.
      mesh: the device mesh.
      constrain: applied to the running gradient sum (e.g. pin it to the parameter shardings).
    Returns:
      (params, batch) -> (mean loss, mean aux, mean grads).
    """
    if steps == 1:
        return grad_fn

    def gradients(params, batch):
        micro = {k: split_rows(v, steps, batch_axes[k], mesh) for k, v in batch.items()}

        def body(carry, mb):
            g_sum, l_sum = carry
            loss, aux, g = grad_fn(params, mb)
            return (constrain(jax.tree.map(jnp.add, g_sum, g)), l_sum + loss), aux

        zeros = constrain(jax.tree.map(jnp.zeros_like, params))
        # Inside the gradient-sync shard_map the carries must be per-replica ("varying") like the
        # microbatch losses; zeros_like of the (per-replica) params already is.
        loss0 = jnp.zeros_like(jax.tree.leaves(zeros)[0], shape=(), dtype=jnp.float32)
        (g_sum, l_sum), aux = jax.lax.scan(body, (zeros, loss0), micro)
        grads = jax.tree.map(lambda g: g / steps, g_sum)
        return l_sum / steps, jax.tree.map(jnp.mean, aux), grads

    return gradients
