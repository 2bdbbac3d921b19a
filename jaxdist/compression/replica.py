"""The replica collectives: what every step inside the data-parallel `shard_map` shares.

A compressor, local SGD and the exact algorithms all run inside `jax.shard_map` with the
data-parallel mesh axes (`axis_name`) manual, and keep per-replica state as leaves with a leading
replica axis of size R sharded over those axes (`[1, ...]` per replica inside the shard_map).
These are the small pieces they share: the axes as a tuple, R, the two collectives with a typed
result (`gather`, `all_to_all`) and their one-buffer forms for many arrays (`*_many`,
`pmean_flat`), the type casts between replicated and per-replica values, and the `[1, ...]` block
convention. All but `data_spec` must be called inside the shard_map.

The invariance contract: a value that leaves the shard_map with `P()` (the mean gradient) must be
typed invariant over `axis_name`, i.e. come out of a collective that makes it so (`psum`,
`pmean`, `pmax`, `gather`), not just be equal on every replica. A per-replica state leaf is typed
varying even where its values agree on all replicas (a step counter, a shared PRNG key): anything
that must be the same on every replica and is derived from state goes through such a collective
first (see `randk`), or the program fails to compile.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxdist import sharding

AxisName = str | tuple[str, ...]


def axes(axis_name: AxisName) -> tuple[str, ...]:
    """`axis_name` as a tuple of mesh axis names (a single name becomes a 1-tuple)."""
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def num_replicas(axis_name: AxisName) -> int:
    """R, the number of data-parallel replicas; call inside shard_map."""
    return math.prod(jax.lax.axis_size(a) for a in axes(axis_name))


def gather(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """[...] -> [R, ...]: every replica's `x` along a new leading axis, typed invariant (every
    replica holds the same result, so it may leave the shard_map replicated)."""
    return jax.lax.all_gather(x, axes(axis_name), to="invarying")


def all_to_all(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """[R, ...] -> [R, ...]: row i of the result is row `my index` of replica i's input (the
    first phase of a two-phase reduce: replica j receives every replica's shard j)."""
    return jax.lax.all_to_all(x, axes(axis_name), 0, 0)


def replica_local(tree: Any, axis_name: AxisName) -> Any:
    """`tree`, replicated over `axis_name`, retyped per-replica for differentiating in shard_map.

    `jax.grad` with respect to a value replicated over the manual axes returns the gradient already
    summed over replicas (JAX inserts an f32 psum: the transpose of the implicit broadcast), which
    would defeat any compressor. Differentiate with respect to `replica_local(params, axis_name)`
    instead to get this replica's own gradient.
    """
    return jax.lax.pcast(tree, axes(axis_name), to="varying")


def pmean_flat(xs: list[jax.Array], axis_name: AxisName) -> list[jax.Array]:
    """Each array's mean over the replicas, all of them reduced as one flat float32 buffer.

    One all-reduce of one array, where a pmean per array (which XLA's combiner joins into one
    variadic all-reduce) runs on XLA:CPU as one gloo call per array, each paying its messages'
    latency (docs/AGGREGATION.md, "Latency and loss"). Same sums, up to the order of additions.
    Arrays that vary over different manual axes (a pipeline stage's own layers beside the
    embedding) go in separate buffers, so each mean keeps its type.
    """
    means = _flat(xs, jnp.float32, lambda flat: jax.lax.pmean(flat, axes(axis_name)))
    return [m.astype(x.dtype) for m, x in zip(means, xs, strict=True)]


def psum_flat(xs: list[jax.Array], axis_name: AxisName, dtype: Any) -> list[jax.Array]:
    """Each array's sum over the replicas in `dtype` (the sum's type too), as one flat buffer
    per vma type (`pmean_flat`). A float16 all-reduce stays float16 on XLA:CPU (gloo sums in it);
    a bfloat16 one is widened to float32 there."""
    return _flat(xs, dtype, lambda flat: jax.lax.psum(flat, axes(axis_name)))


def _flat(xs: list[jax.Array], dtype: Any, reduce: Any) -> list[jax.Array]:
    """`reduce` of each vma-alike group of `xs`, raveled as `dtype` into one buffer, cut back
    into the arrays' shapes (in `dtype`)."""
    out: list[Any] = [None] * len(xs)
    for members in _alike(xs):
        flat = reduce(jnp.concatenate([jnp.ravel(xs[i]).astype(dtype) for i in members]))
        start = 0
        for i in members:
            out[i] = flat[start : start + xs[i].size].reshape(xs[i].shape)
            start += xs[i].size
    return out


def all_to_all_many(xs: list[jax.Array], axis_name: AxisName) -> list[jax.Array]:
    """`all_to_all` of every array in `xs` (each [R, ...]), as one collective of one byte buffer.

    The same values as one `all_to_all` per array (nothing is summed: bytes only move), in one
    gloo call where XLA:CPU would make one per array, each paying its messages' latency
    (docs/AGGREGATION.md, "Latency and loss"). Arrays varying over other manual axes (a pipeline
    stage's own layers) go in a buffer of their own.
    """
    return _bytes_exchange(xs, lambda b: jax.lax.all_to_all(b, axes(axis_name), 0, 0), True)


def gather_many(xs: list[jax.Array], axis_name: AxisName) -> list[jax.Array]:
    """`gather` of every array in `xs` ([...] -> [R, ...]), as one collective of one byte buffer
    (`all_to_all_many`)."""
    return _bytes_exchange(xs, lambda b: gather(b[0], axis_name), False)


def _bytes_exchange(xs, exchange, rows: bool) -> list[jax.Array]:
    """Each group of `xs` alike in vma type, viewed as bytes (`rows`: [x.shape[0], -1], else
    [1, -1]), concatenated along the last axis and passed through `exchange` ([m, n] -> [R, n]);
    the result cut back into [R, *x.shape[1:]] (`rows`) or [R, *x.shape] arrays."""
    out: list[Any] = [None] * len(xs)
    for members in _alike(xs):
        views = [_as_bytes(xs[i]).reshape(xs[i].shape[0] if rows else 1, -1) for i in members]
        got = exchange(jnp.concatenate(views, axis=1))
        start = 0
        for i, v in zip(members, views, strict=True):
            x, n = xs[i], v.shape[1]
            shape = (got.shape[0], *(x.shape[1:] if rows else x.shape))
            out[i] = _from_bytes(got[:, start : start + n], shape, x.dtype)
            start += n
    return out


def _alike(xs: list[jax.Array]) -> list[list[int]]:
    """The indices of `xs` grouped by vma type (the manual axes each varies over): what may
    share one buffer of a collective and keep its type."""
    groups: dict[frozenset[str], list[int]] = {}
    for i, x in enumerate(xs):
        groups.setdefault(sharding.varying_axes(x), []).append(i)
    return list(groups.values())


def _as_bytes(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.uint8)  # [..., itemsize] (no new axis for 1)


def _from_bytes(b: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    size = jnp.dtype(dtype).itemsize
    return jax.lax.bitcast_convert_type(b.reshape(*shape, *([size] if size > 1 else [])), dtype)


def varying_like(x: jax.Array, ref: jax.Array) -> jax.Array:
    """`x`, typed varying wherever `ref` is: the branches of a `lax.cond` must agree on that type
    (e.g. one branch returns a pmean, the other a per-replica buffer)."""
    return jnp.where(True, x, ref)


def local(tree: Any) -> Any:
    """This replica's `[1, ...]` block of every state leaf, without the replica axis: `[...]`."""
    return jax.tree.map(lambda x: x[0], tree)


def stacked(tree: Any) -> Any:
    """The inverse of `local`: every leaf `[...]` -> this replica's `[1, ...]` block."""
    return jax.tree.map(lambda x: x[None], tree)


def data_spec(data_axes: AxisName) -> str | tuple[str, ...]:
    """The PartitionSpec entry of the leading replica axis: one axis name or a tuple of them."""
    names = axes(data_axes)
    return names[0] if len(names) == 1 else names
