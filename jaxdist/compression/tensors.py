"""How a compressor cuts the gradient's tensors: per-layer mapping, padded rows, state buffers.

Shared by every method family in this package: which leaves are floats, how many leading
stacked-layer axes a leaf has (`batch_dims`), how a flat tensor is cut into R zero-padded rows for
a two-phase (all-to-all, all-gather) reduce, the per-replica f32 buffers (residuals, momenta) a
compressor keeps, and the walk over a gradient tree with its state trees alongside.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

import jaxdist.compression.replica as replica


def leaf_batch_dims(batch_dims: Any, treedef: Any, n: int) -> list[int]:
    """Per leaf, how many leading stacked-layer axes it has (`batch_dims`: None, an int or a tree)."""
    if batch_dims is None or isinstance(batch_dims, int):
        return [batch_dims or 0] * n
    return list(treedef.flatten_up_to(batch_dims))


def per_layer(fn: Any, batch_dims: int) -> Any:
    """`fn` on one layer's slice, mapped over `batch_dims` leading stacked-layer axes.

    Compressing each layer of a stacked `[L, ...]` tensor on its own keeps the layer axis where it
    is: when the pipeline axis shards it, every stage compresses and exchanges only its own layers
    (flattening the whole tensor would gather it first). It is also what per-tensor methods mean
    for a model whose layers are separate tensors (DGC's top-k, per-layer scales).
    """
    for _ in range(batch_dims):
        fn = jax.vmap(fn)
    return fn


def two_phase(args, dims, first, middle, last, axis_name) -> list[Any]:
    """Every leaf's two-phase reduce (all-to-all, then all-gather), all leaves in one collective
    per phase (`replica.all_to_all_many`, `replica.gather_many`): two gloo calls a step, not two
    per tensor, with the same values.

    For leaf i, each function mapped over its `dims[i]` stacked-layer axes (`per_layer`):
    `first(*args[i]) -> (sent, kept)`, sent a tuple of [R, ...] arrays whose row j goes to
    replica j; `middle(received, kept) -> (sent2, kept2)`, received shaped like sent, row j from
    replica j; `last(gathered, kept2) -> result`, each of sent2 gathered to [R, ...]. Returns the
    results, one per leaf.
    """
    ones = [per_layer(first, b)(*a) for a, b in zip(args, dims, strict=True)]
    got = _exchange(replica.all_to_all_many, [s for s, _ in ones], dims, axis_name, True)
    twos = [per_layer(middle, b)(g, k) for g, (_, k), b in zip(got, ones, dims, strict=True)]
    got = _exchange(replica.gather_many, [s for s, _ in twos], dims, axis_name, False)
    return [per_layer(last, b)(g, k) for g, (_, k), b in zip(got, twos, dims, strict=True)]


def two_phase_leaves(start, phases, end, grads, parts, batch_dims, axis_name):
    """`two_phase` over every float leaf of `grads`, laid out as `map_float_leaves`:
    `start(i, g, b, *part_leaves)` gives leaf i's arguments of `first`, `end(i, g, result,
    *part_leaves)` its `(out, *new_part_leaves)`; `phases` is (first, middle, last)."""
    args, dims = {}, {}

    def collect(i, g, b, *xs):
        args[i], dims[i] = start(i, g, b, *xs), b
        return (g, *xs)

    map_float_leaves(collect, grads, parts, batch_dims)
    got = two_phase(list(args.values()), list(dims.values()), *phases, axis_name)
    results = dict(zip(args, got, strict=True))
    return map_float_leaves(
        lambda i, g, b, *xs: end(i, g, results[i], *xs), grads, parts, batch_dims
    )


def _exchange(collective, sent, dims, axis_name, rows: bool) -> list[tuple[jax.Array, ...]]:
    """`collective` of every leaf's arrays at once: a leaf's stacked-layer axes go after the
    replica axis (its rows if `rows`) for the exchange and back in front after it."""
    flat = [jnp.moveaxis(x, b, 0) if rows else x for xs, b in zip(sent, dims) for x in xs]
    got = iter(collective(flat, axis_name))
    return [tuple(jnp.moveaxis(next(got), 0, b) for _ in xs) for xs, b in zip(sent, dims)]


def is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def shard_layout(size: int, replicas: int, chunk: int, multiple: int = 1) -> tuple[int, int]:
    """How a flat tensor of `size` elements is cut for a two-phase (all-to-all, all-gather) reduce.

    Returns (shard, c): each replica owns `shard` elements (R * shard >= size, the tail
    zero-padded), quantized in chunks of `c` <= `chunk` elements; `shard` is a multiple of `c`,
    `c` a multiple of `multiple`.
    Small tensors get one short chunk rather than padding to a full `chunk` per replica.
    """
    shard = -(-size // replicas)
    c = min(chunk, -(-shard // multiple) * multiple)
    return -(-shard // c) * c, c


def to_rows(g: jax.Array, replicas: int, shard: int, c: int) -> jax.Array:
    """Flat, zero-padded, cut into [R, shard / c, c]: row j is the part replica j reduces."""
    flat = g.reshape(-1).astype(jnp.float32)
    return jnp.pad(flat, (0, replicas * shard - flat.size)).reshape(replicas, shard // c, c)


def from_rows(x: jax.Array, like: jax.Array) -> jax.Array:
    return x.reshape(-1)[: like.size].reshape(like.shape).astype(like.dtype)


def worker_zeros(params: Any) -> Any:
    """Params-shaped f32 [1, *shape] zeros per float leaf (None elsewhere): a per-replica buffer
    (residual, momentum), f32 even for bf16 gradients so it keeps what was not sent."""
    return jax.tree.map(
        lambda p: jnp.zeros((1, *p.shape), jnp.float32) if is_float(p) else None, params
    )


def server_zeros(params: Any, batch_dims: Any, shard_of: Any) -> Any:
    """Per float leaf f32 [1, *layers, shard_of(layer size)] zeros: the server residual of the
    shard this replica reduces in a two-phase exchange (None for other leaves)."""
    leaves, treedef = jax.tree.flatten(params)
    dims = leaf_batch_dims(batch_dims, treedef, len(leaves))
    return treedef.unflatten(
        [
            jnp.zeros((1, *p.shape[:b], shard_of(math.prod(p.shape[b:]))), jnp.float32)
            if is_float(p)
            else None
            for p, b in zip(leaves, dims)
        ]
    )


def map_float_leaves(fn: Any, grads: Any, parts: Sequence[Any], batch_dims: Any):
    """`fn(i, g, b, *part_leaves) -> (out, *new_part_leaves)` on every float leaf of `grads`.

    `i` is the leaf's index in tree order, `b` its number of stacked-layer axes; `parts` are state
    trees laid out like `grads` (or None: each of its leaves None). Other leaves pass through with
    their parts unchanged. Returns (out tree, [new part trees, None where the part was None]).
    """
    leaves, treedef = jax.tree.flatten(grads)
    cols = [[None] * len(leaves) if x is None else treedef.flatten_up_to(x) for x in parts]
    dims = leaf_batch_dims(batch_dims, treedef, len(leaves))
    outs = [[] for _ in range(len(parts) + 1)]
    for i, (g, b, *xs) in enumerate(zip(leaves, dims, *cols, strict=True)):
        for col, y in zip(outs, fn(i, g, b, *xs) if is_float(g) else (g, *xs), strict=True):
            col.append(y)
    new = [None if x is None else treedef.unflatten(o) for x, o in zip(parts, outs[1:])]
    return treedef.unflatten(outs[0]), new
