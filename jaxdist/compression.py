"""Data-parallel gradient synchronization as optax transforms, optionally compressed.

Every compressor here is an `optax.GradientTransformation` whose `init` and `update` run *inside*
`jax.shard_map` with the data-parallel mesh axes (`axis_name`) manual. `update` takes this
replica's local gradient, communicates, and returns the mean gradient over replicas, identical on
every replica (typed invariant over `axis_name`, so it can leave the shard_map with `P()`).

State layout. Error-feedback residuals and PowerSGD factors belong to one replica each. Outside the
shard_map every state leaf has a leading replica axis of size R (the product of the data axes'
sizes) sharded over the data axes, `P(data_axes, *rest)`; inside, each replica sees its `[1, ...]`
slice. `init` returns leaves of that `[1, ...]` shape, `update` takes and returns them.
`init_global` builds the global state with a shard_map over the data axes and
`state_partition_spec` gives its PartitionSpecs.

Wire formats (per tensor; s = per-replica shard length, R * s >= size, cut into chunks of c):
  none      f32 all-reduce.
  bf16      all-to-all of bf16 [R, s], then all-gather of bf16 [s] (f32 sum in between).
  int8      all-to-all of int8 [R, s] + f32 scale per chunk, then all-gather of int8 [s] + scales.
  topk      all-gather of k f32 values + k int32 indices; `two_phase`: all-to-all of ceil(k / R)
            pairs per row, then all-gather of the reduced row's ceil(k / R) largest pairs.
  powersgd  all-reduce of P [n, r] and Q [m, r] (f32) per compressed matrix, else f32 all-reduce.
  sign      all-to-all of sign bits packed 8 per uint8 [R, s/8] + an f32 scale per chunk, then
            all-gather of packed bits [s/8] + scales.
  onebit_adam  as sign after its Adam warm-up (f32 all-reduce before).
  twobit_adam  as onebit_adam with 2 bits per element packed 4 per uint8 [R, s/4] (+ scales).
  topk_adam    as topk `two_phase` after its Adam warm-up.

See docs/COMPRESSION.md for when to use which.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxdist import sharding
from jaxdist.errors import ConfigError

AxisName = str | tuple[str, ...]


# --------------------------------------------------------------------------------------------------
# Helpers shared by the compressors. All of them run inside shard_map with `axis_name` manual.


def _axes(axis_name: AxisName) -> tuple[str, ...]:
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def num_replicas(axis_name: AxisName) -> int:
    """R, the number of data-parallel replicas; call inside shard_map."""
    return math.prod(jax.lax.axis_size(a) for a in _axes(axis_name))


def _gather(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """all_gather along a new leading axis, typed invariant: every replica holds the same result."""
    return jax.lax.all_gather(x, _axes(axis_name), to="invarying")


def _all_to_all(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """[R, ...] -> [R, ...]: row i of the result is row `my index` of replica i's input."""
    return jax.lax.all_to_all(x, _axes(axis_name), 0, 0)


def replica_local(tree: Any, axis_name: AxisName) -> Any:
    """`tree`, replicated over `axis_name`, retyped per-replica for differentiating in shard_map.

    `jax.grad` with respect to a value replicated over the manual axes returns the gradient already
    summed over replicas (JAX inserts an f32 psum: the transpose of the implicit broadcast), which
    would defeat any compressor. Differentiate with respect to `replica_local(params, axis_name)`
    instead to get this replica's own gradient.
    """
    return jax.lax.pcast(tree, _axes(axis_name), to="varying")


def _varying_like(x: jax.Array, ref: jax.Array) -> jax.Array:
    """`x`, typed varying wherever `ref` is; the branches of a cond must agree on that type."""
    return jnp.where(True, x, ref)


def _local(state: Any) -> Any:
    return jax.tree.map(lambda x: x[0], state)


def _stacked(state: Any) -> Any:
    return jax.tree.map(lambda x: x[None], state)


def _leaf_batch_dims(batch_dims: Any, treedef: Any, n: int) -> list[int]:
    """Per leaf, how many leading stacked-layer axes it has (`batch_dims`: None, an int or a tree)."""
    if batch_dims is None or isinstance(batch_dims, int):
        return [batch_dims or 0] * n
    return list(treedef.flatten_up_to(batch_dims))


def _per_layer(fn: Any, batch_dims: int) -> Any:
    """`fn` on one layer's slice, mapped over `batch_dims` leading stacked-layer axes.

    Compressing each layer of a stacked `[L, ...]` tensor on its own keeps the layer axis where it
    is: when the pipeline axis shards it, every stage compresses and exchanges only its own layers
    (flattening the whole tensor would gather it first). It is also what per-tensor methods mean
    for a model whose layers are separate tensors (DGC's top-k, per-layer scales).
    """
    for _ in range(batch_dims):
        fn = jax.vmap(fn)
    return fn


def _is_float(x: Any) -> bool:
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


def _to_rows(g: jax.Array, replicas: int, shard: int, c: int) -> jax.Array:
    """Flat, zero-padded, cut into [R, shard / c, c]: row j is the part replica j reduces."""
    flat = g.reshape(-1).astype(jnp.float32)
    return jnp.pad(flat, (0, replicas * shard - flat.size)).reshape(replicas, shard // c, c)


def _from_rows(x: jax.Array, like: jax.Array) -> jax.Array:
    return x.reshape(-1)[: like.size].reshape(like.shape).astype(like.dtype)


def _worker_zeros(params: Any) -> Any:
    """Params-shaped f32 [1, *shape] zeros per float leaf (None elsewhere): a per-replica buffer
    (residual, momentum), f32 even for bf16 gradients so it keeps what was not sent."""
    return jax.tree.map(
        lambda p: jnp.zeros((1, *p.shape), jnp.float32) if _is_float(p) else None, params
    )


def _server_zeros(params: Any, batch_dims: Any, shard_of: Any) -> Any:
    """Per float leaf f32 [1, *layers, shard_of(layer size)] zeros: the server residual of the
    shard this replica reduces in a two-phase exchange (None for other leaves)."""
    leaves, treedef = jax.tree.flatten(params)
    dims = _leaf_batch_dims(batch_dims, treedef, len(leaves))
    return treedef.unflatten(
        [
            jnp.zeros((1, *p.shape[:b], shard_of(math.prod(p.shape[b:]))), jnp.float32)
            if _is_float(p)
            else None
            for p, b in zip(leaves, dims)
        ]
    )


def _map_float_leaves(fn: Any, grads: Any, parts: Sequence[Any], batch_dims: Any):
    """`fn(i, g, b, *part_leaves) -> (out, *new_part_leaves)` on every float leaf of `grads`.

    `i` is the leaf's index in tree order, `b` its number of stacked-layer axes; `parts` are state
    trees laid out like `grads` (or None: each of its leaves None). Other leaves pass through with
    their parts unchanged. Returns (out tree, [new part trees, None where the part was None]).
    """
    leaves, treedef = jax.tree.flatten(grads)
    cols = [[None] * len(leaves) if x is None else treedef.flatten_up_to(x) for x in parts]
    dims = _leaf_batch_dims(batch_dims, treedef, len(leaves))
    outs = [[] for _ in range(len(parts) + 1)]
    for i, (g, b, *xs) in enumerate(zip(leaves, dims, *cols, strict=True)):
        for col, y in zip(outs, fn(i, g, b, *xs) if _is_float(g) else (g, *xs), strict=True):
            col.append(y)
    new = [None if x is None else treedef.unflatten(o) for x, o in zip(parts, outs[1:])]
    return treedef.unflatten(outs[0]), new


# --------------------------------------------------------------------------------------------------
# none, bf16


def none(axis_name: AxisName) -> optax.GradientTransformation:
    """Plain f32 mean over replicas (`lax.pmean`): what the compiler's implicit reduction does."""

    def update(grads, state, params=None):
        del params
        return jax.lax.pmean(grads, _axes(axis_name)), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _bf16_bits(x: jax.Array) -> jax.Array:
    """f32 -> bf16 (round to nearest even) as uint16 bits: XLA:CPU widens bf16 collectives."""
    return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)


def _from_bf16_bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16).astype(jnp.float32)


def bf16(
    axis_name: AxisName, two_phase: bool = True, batch_dims: Any = None
) -> optax.GradientTransformation:
    """bfloat16 on the wire, f32 accumulation: 2x fewer bytes than `none`.

    With `two_phase` (default), per tensor: cast to bf16, all-to-all so replica j receives every
    replica's bf16 shard j, sum those in f32, cast the mean to bf16, all-gather. Only the inputs
    and the result are rounded. The bf16 travels bitcast to uint16, since XLA:CPU widens bf16
    collectives to f32. `two_phase=False` is one bf16 psum: f32 on the wire on CPU, bf16 on GPUs
    (NCCL), where it also accumulates in bf16. `batch_dims` (an int or a tree like the params)
    marks leading stacked-layer axes: each layer is cut into shards on its own.
    """

    def update(grads, state, params=None):
        del params
        r = num_replicas(axis_name)

        def one(g):
            if not _is_float(g):
                return g
            if not two_phase:
                s = jax.lax.psum(g.astype(jnp.bfloat16), _axes(axis_name))
                return (s.astype(jnp.float32) / r).astype(g.dtype)
            shard, c = shard_layout(g.size, r, g.size)
            x = _all_to_all(_bf16_bits(_to_rows(g, r, shard, c)), axis_name)  # [R, 1, shard]
            mean = jnp.sum(_from_bf16_bits(x), axis=0) / r  # [1, shard], this replica's part
            return _from_rows(_from_bf16_bits(_gather(_bf16_bits(mean), axis_name)), g)

        leaves, treedef = jax.tree.flatten(grads)
        dims = _leaf_batch_dims(batch_dims, treedef, len(leaves))
        return treedef.unflatten([_per_layer(one, b)(g) for g, b in zip(leaves, dims)]), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


# --------------------------------------------------------------------------------------------------
# int8


def quantize_int8(x: jax.Array, key: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Absmax int8 quantization over the last axis.

    Args:
      x: [..., c] float32.
      key: if given, stochastic rounding (unbiased; error < scale) instead of round-to-nearest-even
        (error <= scale / 2).

    Returns:
      (q, scale): q int8 [..., c] in [-127, 127], scale float32 [...] = max|x| / 127.
    """
    scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
    y = x / jnp.where(scale > 0, scale, 1.0)[..., None]
    if key is None:
        y = jnp.round(y)
    else:
        y = jnp.floor(y + jax.random.uniform(key, y.shape, jnp.float32))
    return jnp.clip(y, -127, 127).astype(jnp.int8), scale


def dequantize_int8(q: jax.Array, scale: jax.Array) -> jax.Array:
    return q.astype(jnp.float32) * scale[..., None]


class Int8State(NamedTuple):
    key: jax.Array  # [1, 2] uint32 PRNG key data; advanced every step, folded with replica index
    worker: Any = None  # params-shaped f32 [1, ...]: phase-1 rounding error; None without EF
    server: Any = None  # per leaf f32 [1, *layers, s]: phase-2 rounding error; None without EF


def int8(
    axis_name: AxisName,
    chunk: int = 256,
    stochastic_rounding: bool = False,
    seed: int = 0,
    batch_dims: Any = None,
    error_feedback: bool = False,
) -> optax.GradientTransformation:
    """Two-phase int8 all-reduce (reduce-scatter then all-gather), int8 on the wire in both phases.

    Per tensor: quantize [R, s] in chunks of `chunk` (f32 scale = absmax / 127 per chunk);
    all-to-all so replica j receives every replica's int8 copy of shard j; dequantize and average;
    re-quantize the averaged shard; all-gather int8 + scales; dequantize. Wire: ~(1 + 4 / chunk)
    bytes per element per phase against 4 for an f32 ring all-reduce: ~3.9x fewer at chunk=256.
    `stochastic_rounding` rounds up or down at random (unbiased) instead of to nearest.
    `error_feedback` keeps each phase's rounding error (worker: this replica's gradient; server:
    the shard it reduces) and adds it before the next step's quantization, as `ef_sign` does.
    `batch_dims` (an int or a tree like the params) marks leading stacked-layer axes: each layer
    is cut into shards on its own.
    """
    if chunk <= 0:
        raise ValueError(f"int8: chunk={chunk} must be > 0")

    def init(params):
        key = jax.random.key_data(jax.random.key(seed))[None]
        if not error_feedback:
            return Int8State(key)
        shard_of = lambda size: shard_layout(size, num_replicas(axis_name), chunk)[0]  # noqa: E731
        return Int8State(key, _worker_zeros(params), _server_zeros(params, batch_dims, shard_of))

    def update(grads, state, params=None):
        del params
        key = jax.random.wrap_key_data(state.key[0])
        replica_key = jax.random.fold_in(key, jax.lax.axis_index(_axes(axis_name)))

        def leaf(i, g, b, ew, es):
            lead = g.shape[:b]
            keys = jax.random.split(jax.random.fold_in(replica_key, i), math.prod(lead))
            keys = keys.reshape(*lead, *keys.shape[1:])
            e0 = (None, None) if ew is None else (ew[0], es[0])
            mean, w, srv = _per_layer(one_int8, b)(g, *e0, keys)
            return mean, None if w is None else w[None], None if srv is None else srv[None]

        one_int8 = functools.partial(
            _int8_allreduce, axis_name=axis_name, chunk=chunk, stochastic=stochastic_rounding
        )
        out, (worker, server) = _map_float_leaves(
            leaf, grads, (state.worker, state.server), batch_dims
        )
        new_key = jax.random.key_data(jax.random.split(key)[0])[None]
        return out, Int8State(new_key, worker, server)

    return optax.GradientTransformation(init, update)


def _int8_allreduce(g, ew, es, key, *, axis_name: AxisName, chunk: int, stochastic: bool):
    """One layer's two-phase int8 mean: (mean, new worker residual, new server residual [s])."""
    r = num_replicas(axis_name)
    k1, k2 = jax.random.split(key) if stochastic else (None, None)
    acc = g.astype(jnp.float32) if ew is None else g.astype(jnp.float32) + ew
    shard, c = shard_layout(acc.size, r, chunk)
    q, scale = quantize_int8(_to_rows(acc, r, shard, c), k1)  # [R, s/c, c], [R, s/c]
    worker_left = None if ew is None else acc - _from_rows(dequantize_int8(q, scale), acc)
    q, scale = _all_to_all(q, axis_name), _all_to_all(scale, axis_name)
    mean = jnp.sum(dequantize_int8(q, scale), axis=0) / r  # [s/c, c]: my shard
    if es is not None:
        mean = mean + es.reshape(mean.shape)
    q2, scale2 = quantize_int8(mean, k2)
    server_left = None if es is None else (mean - dequantize_int8(q2, scale2)).reshape(-1)
    full = dequantize_int8(_gather(q2, axis_name), _gather(scale2, axis_name))
    return _from_rows(full, g), worker_left, server_left


# --------------------------------------------------------------------------------------------------
# top-k


class TopKState(NamedTuple):
    count: jax.Array  # [1] int32 steps taken (drives the warm-up)
    residual: Any  # params-shaped, f32 [1, ...] per leaf: not sent yet; None without EF
    velocity: Any  # params-shaped, f32 [1, ...]: DGC momentum; None without momentum correction
    server: Any = None  # two_phase: per leaf f32 [1, *layers, s], re-sparsifying error; else None


def topk_densities(ratio: float, warmup_steps: int) -> list[float]:
    """The density (fraction sent) per warm-up stage, ending at `ratio`: 1, 1/4, 1/16, ... (DGC)."""
    if warmup_steps <= 0:
        return [ratio]
    stages = [1.0]
    while stages[-1] / 4 > ratio:
        stages.append(stages[-1] / 4)
    return [*stages, ratio]


def _two_phase_k(size: int, k: int, replicas: int) -> int:
    """Entries of each of the R rows the two-phase exchange sends: ceil(k / R), within the row."""
    return min(-(-size // replicas), max(1, -(-k // replicas)))


def _topk_k(ratio: float, size: int) -> int:
    return min(size, max(1, math.ceil(ratio * size)))


def topk(
    axis_name: AxisName,
    ratio: float,
    error_feedback: bool = True,
    momentum_correction: bool = False,
    momentum: float = 0.9,
    warmup_steps: int = 0,
    batch_dims: Any = None,
    dense_start: bool = False,
    two_phase: bool = False,
) -> optax.GradientTransformation:
    """Per-tensor top-k sparsification by magnitude (Deep Gradient Compression).

    Each replica sends the k = ceil(ratio * size) largest |grad + residual| entries as f32 values
    and int32 indices (all-gather); every replica scatter-adds all R of them and divides by R. The
    residual keeps exactly the entries not sent. With `momentum_correction` the local velocity
    u <- m u + g is accumulated instead of the gradient and zeroed where sent (DGC); follow it with
    momentum-free SGD. With `warmup_steps` the density steps down 1, 1/4, 1/16, ... to `ratio`
    over that many steps (`dense_start`: all of them dense, then `ratio`). At density 1 nothing is
    masked: the velocity is kept, so DGC's dense warm-up steps are momentum SGD.
    Wire: an all-gather of R k (value, index) pairs, ~R k 8 bytes, vs ~8 size for an f32 ring
    all-reduce: ~1 / (R ratio) x fewer. Where R k >= size (large R or a dense warm-up stage) the
    pairs would cost more than the dense tensor, and each replica instead all-reduces its top-k
    scattered into a dense f32 tensor (the same sum: the dense reduce of the sparse union), so
    top-k never sends more than `none`.

    `two_phase` (`grad_sync.topk_exchange='two_phase'`): a sparse reduce-scatter whose bytes do
    not grow with R. The tensor is cut into R rows of s = ceil(size / R); each replica sends the
    ceil(k / R) largest entries of row j to replica j (all-to-all of values and indices), which
    averages them into its dense row, adds its server residual and keeps the ceil(k / R) largest
    of that (the rest stays in the server residual); an all-gather of those pairs gives everyone
    the result (global top-k of the mean, as gTop-k). Wire: ~8 k bytes per phase, ~size / (2 k)
    x fewer than f32 at any R (50x at 1%); where those pairs would outweigh the tensor
    (2 R ceil(k / R) >= size) it too all-reduces the dense union.
    `batch_dims` (an int or a tree like the params) marks leading stacked-layer axes: each layer
    is a tensor of its own, with its own k.
    """
    if not 0 < ratio <= 1:
        raise ValueError(f"topk: ratio={ratio} must be in (0, 1]")
    if momentum_correction and not error_feedback:
        raise ValueError(
            "topk: momentum_correction needs error_feedback=True (DGC accumulates locally)"
        )
    densities = topk_densities(ratio, warmup_steps)
    if dense_start and warmup_steps > 0:
        densities = [1.0, ratio]

    def init(params):
        residual = _worker_zeros(params) if error_feedback else None
        velocity = _worker_zeros(params) if momentum_correction else None
        server = None
        if two_phase and error_feedback:
            server = _server_zeros(params, batch_dims, lambda n: -(-n // num_replicas(axis_name)))
        return TopKState(jnp.zeros((1,), jnp.int32), residual, velocity, server)

    send = functools.partial(_topk_send, axis_name=axis_name, two_phase=two_phase)

    def update(grads, state, params=None):
        del params
        r = num_replicas(axis_name)
        per = max(1, warmup_steps // max(1, len(densities) - 1))
        stage = jnp.minimum(state.count[0] // per, len(densities) - 1)

        def one(g, e, u, es):
            ks = [_topk_k(d, g.size) for d in densities]
            return _topk_layer(g, e, u, es, ks=ks, stage=stage, send=send, r=r, momentum=momentum)

        def leaf(i, g, b, e, u, es):
            e0, u0, s0 = (None if x is None else x[0].astype(jnp.float32) for x in (e, u, es))
            mean, left, v, s1 = _per_layer(one, b)(g, e0, u0, s0)
            return (
                mean,
                None if e is None else left[None].astype(e.dtype),
                None if u is None else v[None].astype(u.dtype),
                None if es is None else s1[None],
            )

        parts = (state.residual, state.velocity, state.server)
        out, (residual, velocity, server) = _map_float_leaves(leaf, grads, parts, batch_dims)
        return out, TopKState(state.count + 1, residual, velocity, server)

    return optax.GradientTransformation(init, update)


def _topk_layer(g, e, u, es, *, ks, stage, send, r, momentum):
    """One layer of `topk`: g its gradient, e / u / es its residual, velocity, server residual;
    `ks[stage]` entries sent. Returns (mean, new e, new u, new es)."""
    flat = g.reshape(-1).astype(jnp.float32)
    if u is not None:  # DGC: accumulate the locally momentum-corrected gradient
        u = momentum * u.reshape(-1) + flat
        acc = e.reshape(-1) + u
    elif e is not None:
        acc = e.reshape(-1) + flat
    else:
        acc = flat
    branches = [lambda a, v, s, k=k: send(a, v, s, k, r) for k in ks]
    v = acc if u is None else u
    if len(set(ks)) == 1:
        mean, left, v, es = branches[0](acc, v, es)
    else:
        mean, left, v, es = jax.lax.switch(stage, branches, acc, v, es)
    left = None if e is None else left.reshape(g.shape)
    v = None if u is None else v.reshape(g.shape)
    return mean.reshape(g.shape).astype(g.dtype), left, v, es


def _topk_two_phase(acc, u, es, k, r, axis_name: AxisName):
    """Sparse reduce-scatter + all-gather of acc [n] (see `topk`)."""
    n = acc.size
    shard, kr = -(-n // r), _two_phase_k(n, k, r)
    rows = jnp.pad(acc, (0, r * shard - n)).reshape(r, shard)
    _, idx = jax.lax.top_k(jnp.abs(rows), kr)  # [R, kr]
    vals = jnp.take_along_axis(rows, idx, axis=1)
    rows_idx = jnp.arange(r)[:, None]
    left = rows.at[rows_idx, idx].set(0).reshape(-1)[:n]
    u_rows = jnp.pad(u, (0, r * shard - n)).reshape(r, shard)
    u = u_rows.at[rows_idx, idx].set(0).reshape(-1)[:n]
    vals, idx = _all_to_all(vals, axis_name), _all_to_all(idx.astype(jnp.int32), axis_name)
    mine = jnp.zeros((shard,), acc.dtype).at[idx.reshape(-1)].add(vals.reshape(-1)) / r
    if es is not None:
        mine = mine + es
    _, idx2 = jax.lax.top_k(jnp.abs(mine), kr)
    es = None if es is None else mine.at[idx2].set(0)
    g_vals, g_idx = _gather(mine[idx2], axis_name), _gather(idx2.astype(jnp.int32), axis_name)
    full = jnp.zeros((r, shard), acc.dtype).at[rows_idx, g_idx].set(g_vals)
    return full.reshape(-1)[:n], left, u, es


def _topk_send(acc, u, es, k, r, *, axis_name: AxisName, two_phase: bool):
    """Top-k of acc [n]: (mean over replicas of what was sent, acc and u zeroed where sent,
    the server residual `es` (two_phase) or None)."""
    if k >= acc.size:  # everything sent: nothing left, the velocity kept (momentum SGD)
        return jax.lax.pmean(acc, _axes(axis_name)), jnp.zeros_like(acc), u, es
    if two_phase and 2 * r * _two_phase_k(acc.size, k, r) < acc.size:
        return _topk_two_phase(acc, u, es, k, r, axis_name)
    _, idx = jax.lax.top_k(jnp.abs(acc), k)
    if two_phase or r * k >= acc.size:  # pairs outweigh the tensor: dense reduce of the union
        sparse = jnp.zeros_like(acc).at[idx].set(acc[idx])
        mean = jax.lax.pmean(sparse, _axes(axis_name))
    else:
        vals = _gather(acc[idx], axis_name)
        all_idx = _gather(idx.astype(jnp.int32), axis_name)
        mean = jnp.zeros(acc.shape, acc.dtype).at[all_idx.reshape(-1)].add(vals.reshape(-1))
        mean = mean / r
    return mean, acc.at[idx].set(0), u.at[idx].set(0), es


def topk_wire_ratio(size: int, replicas: int, ratio: float, two_phase: bool = False) -> float:
    """Bytes of an f32 ring all-reduce of a `size`-element tensor over those of top-k's exchange.

    Ring costs as `metrics.collective_bytes` charges them (all-reduce 2(R-1)/R S, all-gather and
    all-to-all (R-1)/R S); `size` counts one layer of one tensor. What the planner should use for
    top-k at R replicas (the ratio measured at R = 8 is not the one at R = 1024).
    """
    k = _topk_k(ratio, size)
    dense = 2 * 4 * size  # (R-1)/R cancels
    if two_phase and 2 * replicas * _two_phase_k(size, k, replicas) < size:
        return dense / (2 * replicas * _two_phase_k(size, k, replicas) * 8)
    if two_phase or replicas * k >= size:
        return 1.0  # the dense reduce of the union
    return dense / (replicas * k * 8)


# --------------------------------------------------------------------------------------------------
# PowerSGD


class PowerSGDState(NamedTuple):
    count: jax.Array  # [1] int32
    q: Any  # per leaf f32 [1, b, m, rank] warm start, the same on all replicas; None: uncompressed
    residual: Any  # per leaf f32 [1, ...]; None if uncompressed or without error feedback


def powersgd_shape(
    shape: Sequence[int], rank: int, min_compression: float, batch_dims: int = 0
) -> tuple[int, int, int] | None:
    """The (b, n, m) batch of matrices a tensor is compressed as, or None to send it uncompressed.

    The first `batch_dims` axes (stacked layers) index b separate matrices; the rest are split
    into rows and columns at the most nearly square cut (smallest n + m), e.g. a stacked QKV
    kernel [L, D, 3, N, H] becomes L matrices [D, 3 N H]. Rank-r factors of a square-ish matrix
    capture more and cost less. Compressed when n * m > min_compression * rank * (n + m).
    """
    core = [int(d) for d in shape[batch_dims:]]
    if len(core) < 2:
        return None
    b = int(np.prod(shape[:batch_dims], dtype=np.int64))
    splits = [(int(np.prod(core[:k])), int(np.prod(core[k:]))) for k in range(1, len(core))]
    n, m = min(splits, key=lambda nm: nm[0] + nm[1])
    return (b, n, m) if n * m > min_compression * rank * (n + m) else None


def powersgd(
    axis_name: AxisName,
    rank: int,
    start_iter: int = 0,
    error_feedback: bool = True,
    min_compression: float = 1.0,
    seed: int = 0,
    batch_dims: Any = None,
    warm_start: bool = True,
    orthogonalization_epsilon: float = 0.0,
) -> optax.GradientTransformation:
    """PowerSGD (Vogels et al., 2019): rank-`rank` power iteration with a warm-started Q.

    Knobs as in PyTorch's `PowerSGDState`: `start_iter` (dense f32 steps first),
    `min_compression` (compress a matrix only if n m > min_compression r (n + m)), `warm_start`
    (False: a fresh Gaussian Q every step, the same on all replicas), `orthogonalization_epsilon`
    (0: Householder QR; > 0: Gram-Schmidt dividing each column by its norm + epsilon, PyTorch's
    `_orthogonalize_gram_schmidt`).

    Per compressed tensor viewed as matrices M [n, m] (after adding this replica's residual):
      P = pmean(M Q); P = orthonormal basis of P (QR); Q_i = M^T P; Q = pmean(Q_i); out = P Q^T.
    The residual is M - P Q_i^T, the part of this replica's M outside span(P); its mean over
    replicas is mean(M) - out. Q starts as the same Gaussian on every replica and stays identical
    (it is a pmean). Other tensors, and all tensors for the first `start_iter` steps, are plain f32
    pmean (with error feedback, the residual is then zero). `batch_dims` (an int, or a tree of
    ints like the params) marks leading stacked-layer axes: each layer gets its own factors.
    Wire: b r (n + m) f32 all-reduced per tensor instead of b n m (see `powersgd_shape`).
    """
    if rank <= 0:
        raise ValueError(f"powersgd: rank={rank} must be > 0")
    if min_compression < 1:
        raise ValueError(f"powersgd: min_compression={min_compression} must be >= 1")

    def matrices(tree):
        leaves, treedef = jax.tree.flatten(tree)
        dims = _leaf_batch_dims(batch_dims, treedef, len(leaves))
        return [
            powersgd_shape(p.shape, rank, min_compression, d) if _is_float(p) else None
            for p, d in zip(leaves, dims, strict=True)
        ]

    def init(params):
        return _powersgd_init(params, matrices(params), rank, seed, error_feedback)

    compress = functools.partial(
        _powersgd_compress, axis_name=axis_name, epsilon=orthogonalization_epsilon
    )

    def dense(m_i, q):
        mean = jax.lax.pmean(m_i, _axes(axis_name))
        return mean, jnp.zeros_like(m_i), _varying_like(q, q)

    def compressed(m_i, q):
        mean, left, q_new = compress(m_i, q)
        return mean, left, _varying_like(q_new, q)

    def update(grads, state, params=None):
        del params
        count = state.count[0]
        shapes = matrices(grads)

        def leaf(i, g, b, q, e):
            bnm = shapes[i]
            if bnm is None:
                return jax.lax.pmean(g, _axes(axis_name)), None, None
            m_i = g.reshape(bnm).astype(jnp.float32)
            if e is not None:
                m_i = m_i + e[0].reshape(bnm).astype(jnp.float32)
            q = q[0]
            if not warm_start:  # a fresh Q each step, drawn alike on every replica
                key = jax.random.fold_in(jax.random.PRNGKey(seed + 1), count)
                fresh = jax.random.normal(jax.random.fold_in(key, i), q.shape[1:], jnp.float32)
                q = _varying_like(jnp.broadcast_to(fresh, q.shape), q)
            if start_iter > 0:
                mean, left, q = jax.lax.cond(count < start_iter, dense, compressed, m_i, q)
            else:
                mean, left, q = compress(m_i, q)
            left = None if e is None else left.reshape(e.shape).astype(e.dtype)
            return mean.reshape(g.shape).astype(g.dtype), q[None], left

        out, (qs, res) = _map_float_leaves(leaf, grads, (state.q, state.residual), None)
        return out, PowerSGDState(state.count + 1, qs, res)

    return optax.GradientTransformation(init, update)


def _powersgd_init(params, shapes, rank: int, seed: int, error_feedback: bool) -> PowerSGDState:
    """Per compressed leaf (`shapes[i]` = (b, n, m), else None): Q [1, b, m, rank] and a residual."""
    leaves, treedef = jax.tree.flatten(params)
    key = jax.random.PRNGKey(seed)
    qs, res = [], []
    for i, (p, bnm) in enumerate(zip(leaves, shapes, strict=True)):
        if bnm is None:
            qs.append(None)
            res.append(None)
            continue
        # One draw per tensor, shared by its layers: a stage holding some of the layers (a
        # pipeline shard) starts from the same Q as the whole stack would.
        b, _, m = bnm
        q = jax.random.normal(jax.random.fold_in(key, i), (m, rank), jnp.float32)
        qs.append(jnp.broadcast_to(q, (1, b, m, rank)))
        res.append(jnp.zeros((1, *p.shape), jnp.float32) if error_feedback else None)
    return PowerSGDState(jnp.zeros((1,), jnp.int32), treedef.unflatten(qs), treedef.unflatten(res))


def _orthogonalize(p: jax.Array, epsilon: float) -> jax.Array:
    """Orthonormal columns spanning p [b, n, r]: Householder QR (`epsilon` 0) or PyTorch's
    Gram-Schmidt dividing each column by its norm + `epsilon`."""
    if epsilon <= 0:
        return jnp.linalg.qr(p)[0]
    cols = []
    for i in range(p.shape[-1]):
        col = p[..., i]
        for prev in cols:
            col = col - jnp.sum(prev * col, axis=-1, keepdims=True) * prev
        norm = jnp.linalg.norm(col, axis=-1, keepdims=True)
        cols.append(col / (norm + epsilon))
    return jnp.stack(cols, axis=-1)


def _powersgd_compress(m_i, q, *, axis_name: AxisName, epsilon: float):
    """(mean approximation, this replica's residual, new Q); m_i [b, n, m], q [b, m, r]."""
    p = jax.lax.pmean(m_i @ q, _axes(axis_name))  # [b, n, r]
    p = _orthogonalize(p, epsilon)
    q_i = jnp.swapaxes(m_i, 1, 2) @ p  # [b, m, r]
    q_new = jax.lax.pmean(q_i, _axes(axis_name))
    return p @ jnp.swapaxes(q_new, 1, 2), m_i - p @ jnp.swapaxes(q_i, 1, 2), q_new


# --------------------------------------------------------------------------------------------------
# ef_sign (EF-signSGD; with momentum correction 1-bit compressed momentum SGD), 1-bit Adam


class SignState(NamedTuple):
    count: jax.Array  # [1] int32 steps taken (drives `start_step`)
    worker: Any  # params-shaped, f32 [1, ...] per leaf: this replica's compression error
    server: Any  # per leaf f32 [1, shard]: error re-compressing the shard this replica reduces
    momentum: Any  # params-shaped, f32 [1, ...]: the last synchronized momentum; None without it


def _sign_compress(x: jax.Array, valid: jax.Array, rms: bool = False):
    """Scaled sign over the last axis: (bits uint8 [..., c/8], scale [...], approx [..., c]).

    scale = ||x||_1 / d (`rms=False`: the scale that minimizes the error of the signs) or
    ||x||_2 / sqrt(d) (`rms=True`: 1-bit Adam's, DeepSpeed `compressed_allreduce`), with d the
    number of valid (non-padding) elements; bit 1 means x >= 0. Padding decompresses to 0.
    """
    d = jnp.maximum(jnp.sum(valid, axis=-1), 1).astype(jnp.float32)
    if rms:
        scale = jnp.sqrt(jnp.sum(jnp.where(valid, x * x, 0), axis=-1) / d)
    else:
        scale = jnp.sum(jnp.where(valid, jnp.abs(x), 0), axis=-1) / d
    bits = x >= 0
    approx = jnp.where(valid, jnp.where(bits, scale[..., None], -scale[..., None]), 0)
    return jnp.packbits(bits, axis=-1), scale, approx


def _sign_decompress(packed: jax.Array, scale: jax.Array, c: int) -> jax.Array:
    bits = jnp.unpackbits(packed, axis=-1, count=c).astype(bool)
    return jnp.where(bits, scale[..., None], -scale[..., None])


# The 4-level Lloyd-Max quantizer of a unit Gaussian (Max, 1960): |x| below the threshold maps to
# the inner level, above it to the outer one; in units of the chunk's RMS.
TWOBIT_THRESHOLD, TWOBIT_LEVELS = 0.9816, (0.4528, 1.5104)


def _twobit_compress(x: jax.Array, valid: jax.Array, rms: bool = True):
    """2-bit quantization over the last axis: (bits uint8 [..., c/4], scale [...], approx).

    scale = ||x||_2 / sqrt(d) per chunk (d valid elements); each element keeps its sign and
    whether |x| >= TWOBIT_THRESHOLD scale (two bit planes, packed 4 elements per byte), and
    decompresses to +-TWOBIT_LEVELS[big] scale: the mean-squared-error optimal 2-bit code of a
    Gaussian. Padding decompresses to 0. (`rms` is accepted for `_sign_compress`'s signature.)
    """
    del rms
    d = jnp.maximum(jnp.sum(valid, axis=-1), 1).astype(jnp.float32)
    scale = jnp.sqrt(jnp.sum(jnp.where(valid, x * x, 0), axis=-1) / d)
    bits = jnp.stack([x >= 0, jnp.abs(x) >= TWOBIT_THRESHOLD * scale[..., None]], axis=-1)
    approx = jnp.where(valid, _twobit_values(bits, scale), 0)
    return jnp.packbits(bits.reshape(*x.shape[:-1], -1), axis=-1), scale, approx


def _twobit_values(bits: jax.Array, scale: jax.Array) -> jax.Array:
    """bits [..., c, 2] (sign, big) and scale [...] -> values [..., c]."""
    inner, outer = TWOBIT_LEVELS
    mag = jnp.where(bits[..., 1], outer, inner) * scale[..., None]
    return jnp.where(bits[..., 0], mag, -mag)


def _twobit_decompress(packed: jax.Array, scale: jax.Array, c: int) -> jax.Array:
    bits = jnp.unpackbits(packed, axis=-1, count=2 * c).astype(bool)
    return _twobit_values(bits.reshape(*packed.shape[:-1], c, 2), scale)


# bits per element -> (compress, decompress) of the two-phase exchange (`_sign_allreduce`)
QUANTIZERS = {1: (_sign_compress, _sign_decompress), 2: (_twobit_compress, _twobit_decompress)}


def _sign_allreduce(
    acc, es, like, *, axis_name: AxisName, chunk: int, rms: bool = False, bits: int = 1
):
    """DeepSpeed's `compressed_allreduce` of one tensor `acc` (this replica's, worker residual
    already added): (mean over replicas, new worker residual, new server residual `[s]`).

    Phase 1: cut into [R, s], compress per chunk to `bits` bits per element (`QUANTIZERS`),
    all-to-all; replica j decompresses and averages shard j and adds its server residual `es`.
    Phase 2: re-compress, all-gather.
    """
    compress, decompress = QUANTIZERS[bits]
    r = num_replicas(axis_name)
    me = jax.lax.axis_index(_axes(axis_name))
    shard, c = shard_layout(acc.size, r, chunk, 8)
    x = _to_rows(acc, r, shard, c)  # [R, s/c, c]
    valid = (np.arange(r * shard) < acc.size).reshape(x.shape)
    packed, scale, approx = compress(x, valid, rms)
    worker_left = acc - _from_rows(approx, acc)
    packed, scale = _all_to_all(packed, axis_name), _all_to_all(scale, axis_name)
    my_valid = (me * shard + jnp.arange(shard) < acc.size).reshape(shard // c, c)
    mean = jnp.where(my_valid, jnp.mean(decompress(packed, scale, c), axis=0), 0)
    if es is not None:
        mean = mean + es.reshape(mean.shape)
    packed2, scale2, approx2 = compress(mean, my_valid, rms)
    server_left = (mean - approx2).reshape(shard)
    full = decompress(_gather(packed2, axis_name), _gather(scale2, axis_name), c)
    return _from_rows(full, like), worker_left, server_left


def ef_sign(
    axis_name: AxisName,
    error_feedback: bool = True,
    chunk: int = 2048,
    momentum_correction: bool = False,
    momentum: float = 0.9,
    start_step: int = 0,
    batch_dims: Any = None,
) -> optax.GradientTransformation:
    """Two-phase 1-bit reduction with worker- and server-side error feedback (EF-signSGD).

    `grad_sync.compression=ef_sign` (`sign` is its old name). No Adam in it: with
    `momentum_correction` it is error-compensated 1-bit momentum SGD with 1-bit Adam's
    communication scheme; `onebit_adam` is the Adam.

    Per tensor: x = grad + worker residual, cut into [R, s]; compress each chunk of `chunk`
    elements to sign bits (8 per uint8) and one f32 scale ||x||_1 / d; all-to-all so replica j
    gets every replica's bits for shard j; decompress and average; add the server residual for
    shard j and re-compress; all-gather packed bits + scales; decompress. Both residuals keep
    what their compression lost (none are kept with `error_feedback=False`). Wire: ~(1/8 +
    4/chunk) bytes per element per phase vs 4 for f32: ~31x fewer at chunk=2048.

    With `momentum_correction` the optimizer's momentum moves into the compressor, as in 1-bit Adam
    (Tang et al., 2021) but without its (1 - beta) and variance: each replica compresses
    m_i = momentum * m + g_i, where m is the last
    synchronized (compressed) momentum, the same on every replica, and the result is the new m.
    Follow it with momentum-free SGD. Without it, scaled signs of raw gradients are slow to
    converge (docs/COMPRESSION.md). The first `start_step` steps send an exact f32 pmean of the
    same quantity instead (1-bit Adam's full-precision warm-up). `batch_dims` (an int or a tree
    like the params) marks leading stacked-layer axes: each layer is cut into shards on its own,
    and the server residual of a leaf [L, ...] is [L, s].
    """
    if chunk <= 0 or chunk % 8:
        raise ValueError(f"ef_sign: chunk={chunk} must be a positive multiple of 8")

    def init(params):
        count = jnp.zeros((1,), jnp.int32)
        momentum_buf = _worker_zeros(params) if momentum_correction else None
        if not error_feedback:
            return SignState(count, None, None, momentum_buf)
        shard_of = lambda size: shard_layout(size, num_replicas(axis_name), chunk, 8)[0]  # noqa: E731
        server = _server_zeros(params, batch_dims, shard_of)
        return SignState(count, _worker_zeros(params), server, momentum_buf)

    compressed = functools.partial(_sign_allreduce, axis_name=axis_name, chunk=chunk)

    def dense(acc, es0, like):
        mean = jax.lax.pmean(acc, _axes(axis_name)).astype(like.dtype)
        return mean, jnp.zeros_like(acc), es0

    def update(grads, state, params=None):
        del params

        def one(acc, es0, like):
            if start_step > 0:
                return jax.lax.cond(state.count[0] < start_step, dense, compressed, acc, es0, like)
            return compressed(acc, es0, like)

        def leaf(i, g, b, ew, es, u):
            acc = g.astype(jnp.float32)
            if u is not None:  # compress m_i = momentum * m + g_i
                acc = momentum * u[0] + acc
            if ew is not None:
                acc = acc + ew[0]
            mean, w, s = _per_layer(one, b)(acc, None if es is None else es[0], g)
            return (
                mean,
                None if ew is None else w[None],
                None if es is None else s[None],
                None if u is None else mean.astype(jnp.float32)[None],
            )

        parts = (state.worker, state.server, state.momentum)
        out, (worker, server, mom) = _map_float_leaves(leaf, grads, parts, batch_dims)
        return out, SignState(state.count + 1, worker, server, mom)

    return optax.GradientTransformation(init, update)


sign = ef_sign  # the old name of `ef_sign`


class OneBitAdamState(NamedTuple):
    count: jax.Array  # [1] int32 steps taken (freeze at `freeze_step`)
    momentum: Any  # params-shaped, f32 [1, ...]: Adam's m, the same on every replica (DGC: u_i)
    worker: Any  # params-shaped, f32 [1, ...]: this replica's compression error
    server: Any  # per leaf f32 [1, *layers, s]: error re-compressing the shard this replica reduces


def _momentum_exchange(
    axis_name: AxisName,
    chunk: int,
    bits: int,
    topk_ratio: float | None,
    two_phase: bool = True,
    rms: bool = True,
):
    """How `onebit_adam` reduces the momenta after the freeze: (shard_of, reduce).

    `shard_of(size)` is the length of a layer's server residual; `reduce(acc, es, like, u)`
    returns (mean, new worker residual, new server residual, u zeroed where this replica sent):
    DeepSpeed's `compressed_allreduce` with `bits`-bit codes (everything is sent: u as it was;
    `rms=False`: ef_sign's scale ||x||_1 / d instead of ||x||_2 / sqrt(d)), or with `topk_ratio` `topk`'s exchange (`two_phase`: sparse reduce-scatter of ceil(k / R)
    pairs per row, server re-sparsification, all-gather; else an all-gather of each replica's k
    pairs), both with error feedback.
    """
    if bits not in QUANTIZERS:
        raise ValueError(f"onebit_adam: bits={bits} must be one of {sorted(QUANTIZERS)}")
    if chunk <= 0 or chunk % 8:
        raise ValueError(f"onebit_adam: chunk={chunk} must be a positive multiple of 8")
    if topk_ratio is None:
        sign = functools.partial(
            _sign_allreduce, axis_name=axis_name, chunk=chunk, rms=rms, bits=bits
        )
        return lambda n: shard_layout(n, num_replicas(axis_name), chunk, 8)[0], (
            lambda acc, es, like, u: (*sign(acc, es, like), u)
        )

    def reduce_topk(acc, es, like, u):
        del like
        flat, r = acc.reshape(-1), num_replicas(axis_name)
        k = _topk_k(topk_ratio, flat.size)
        mean, left, u2, es = _topk_send(
            flat, u.reshape(-1), es, k, r, axis_name=axis_name, two_phase=two_phase
        )
        return mean.reshape(acc.shape), left.reshape(acc.shape), es, u2.reshape(acc.shape)

    return lambda n: -(-n // num_replicas(axis_name)), reduce_topk


def onebit_adam(
    axis_name: AxisName,
    freeze_step: int,
    b1: float = 0.9,
    chunk: int = 2048,
    batch_dims: Any = None,
    bits: int = 1,
    topk_ratio: float | None = None,
    local_momentum: bool = False,
    two_phase: bool = True,
    masking: bool = True,
    rms: bool = True,
) -> optax.GradientTransformation:
    """1-bit Adam's communication (Tang et al., 2021; DeepSpeed `OnebitAdam`): the sync half.

    Pair it with `frozen_variance_adam(freeze_step, b1, b2)` as the optimizer (the strategy does).
    For the first `freeze_step` steps (Adam's full-precision warm-up) it returns the exact f32 mean
    gradient g and tracks Adam's momentum m <- b1 m + (1 - b1) g; the optimizer runs plain Adam on
    g. From then on each replica forms m_i = b1 m + (1 - b1) g_i from its own gradient, and m
    becomes DeepSpeed's `compressed_allreduce` of the m_i (`ef_sign`'s two phases: 1 bit per
    element, scale ||x||_2 / sqrt(d) per chunk of `chunk`, worker and server error feedback); it
    returns that m, on which the optimizer applies the variance frozen at `freeze_step`.
    Wire after the freeze: ~(1/8 + 4/chunk) bytes per element per phase (~31x fewer than f32).
    `bits=2` (`grad_sync.compression=twobit_adam`): the same scheme with the 2-bit Lloyd-Max
    code of `_twobit_compress` instead of signs, ~(1/4 + 4/chunk) bytes (~16x fewer).
    `topk_ratio` (`grad_sync.compression=topk_adam`): the momenta go through `topk`'s two-phase
    exchange at that density instead (8 bytes per pair, ~1 / (2 ratio) x fewer at any R;
    `two_phase=False`: the all-gather of each replica's k pairs).
    `local_momentum` (top-k; `grad_sync.compression=topk momentum_correction=True
    freeze_variance=True`: DGC under AdamW): after the freeze each replica keeps its own momentum
    u_i <- b1 u_i + (1 - b1) g_i (from Adam's m at the freeze), sends the top-k of u_i + worker
    residual and zeroes u_i where it sent (DGC's momentum correction and factor masking; with
    `masking=False` u_i is kept whole, so the sent sum stays the sum of the gradients).
    `local_momentum` with the sign code (`grad_sync.compression=ef_sign momentum_correction=True
    freeze_variance=True`, with `rms=False`: ef_sign's L1 scale): each replica's own momentum
    u_i, sent as 1-bit signs of u_i + worker residual with both error feedbacks and never masked
    (signs send every coordinate): error-compensated 1-bit local-momentum Adam.
    """
    if freeze_step < 0:
        raise ValueError(f"onebit_adam: freeze_step={freeze_step} must be >= 0")
    shard_of, reduce = _momentum_exchange(axis_name, chunk, bits, topk_ratio, two_phase, rms)

    def init(params):
        momentum = jax.tree.map(lambda p: jnp.zeros((1, *p.shape), jnp.float32), params)
        server = _server_zeros(params, batch_dims, shard_of)
        return OneBitAdamState(jnp.zeros((1,), jnp.int32), momentum, _worker_zeros(params), server)

    def update(grads, state, params=None):
        del params
        leaves, treedef = jax.tree.flatten(grads)
        dims = _leaf_batch_dims(batch_dims, treedef, len(leaves))
        ms, ws, ss = (treedef.flatten_up_to(x) for x in state[1:])
        frozen = state.count[0] >= freeze_step
        out, new_m, new_w, new_s = [], [], [], []
        for g, m, ew, es, b in zip(leaves, ms, ws, ss, dims, strict=True):
            if not _is_float(g):
                out.append(g)
                new_m.append(m)
                new_w.append(ew)
                new_s.append(es)
                continue

            def warm(g, m, ew, es, like):
                mean = jax.lax.pmean(g, _axes(axis_name))  # exact: Adam's warm-up
                m = b1 * m + (1 - b1) * mean
                return mean, _varying_like(m, ew), ew, es

            def comp(g, m, ew, es, like):
                u = b1 * m + (1 - b1) * g  # m: the last synchronized momentum, or (DGC) u_i
                mean, w, s, masked = reduce(u + ew, es, like, u)
                m = (masked if masking else u) if local_momentum else mean.astype(jnp.float32)
                return mean, _varying_like(m, ew), w, s

            def one(g, m, ew, es, like):
                if freeze_step == 0:  # no warm-up: compiled without it (bytes of the steady state)
                    return comp(g, m, ew, es, like)
                return jax.lax.cond(frozen, comp, warm, g, m, ew, es, like)

            mean, m2, w, s = _per_layer(one, b)(g.astype(jnp.float32), m[0], ew[0], es[0], g)
            out.append(mean.astype(g.dtype))
            new_m.append(m2[None])
            new_w.append(w[None])
            new_s.append(s[None])
        new = OneBitAdamState(
            state.count + 1, *(treedef.unflatten(x) for x in (new_m, new_w, new_s))
        )
        return treedef.unflatten(out), new

    return optax.GradientTransformation(init, update)


class FrozenAdamState(NamedTuple):
    count: jax.Array  # [] int32
    mu: Any  # Adam's first moment
    nu: Any  # Adam's second moment, frozen from `freeze_step` on


def frozen_variance_adam(
    freeze_step: int,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    takes: str = "momentum",
) -> optax.GradientTransformation:
    """1-bit Adam's optimizer half (after `onebit_adam`'s sync): Adam, then frozen variance.

    Steps t = 1 .. `freeze_step` take the mean gradient g: m <- b1 m + (1 - b1) g,
    v <- b2 v + (1 - b2) g^2, exactly `optax.scale_by_adam`. Later steps take the synchronized
    momentum m itself and leave v as it was at `freeze_step`. Output m_hat / (sqrt(v_hat) + eps)
    with Adam's bias corrections (1 - b1^t) and (1 - b2^min(t, freeze_step)), so that the warm-up is
    AdamW exactly (DeepSpeed's OnebitAdam leaves the bias correction out). Chain it before weight
    decay and the learning rate, as in AdamW.

    `takes="gradient"`: later steps take the (compressed) mean gradient too, and only v freezes.
    Adam is then a fixed linear filter of its inputs, so what error feedback guarantees (the sum
    of what is sent equals the sum of the gradients) carries through to the updates: the recipe
    that makes top-k and PowerSGD work with Adam (`grad_sync.freeze_variance`).
    """
    if takes not in ("momentum", "gradient"):
        raise ValueError(f"frozen_variance_adam: takes={takes!r} must be momentum or gradient")

    def init(params):
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        return FrozenAdamState(jnp.zeros((), jnp.int32), zeros, zeros)

    def update(updates, state, params=None):
        del params
        warm = state.count < freeze_step
        t = (state.count + 1).astype(jnp.float32)
        tv = jnp.minimum(state.count + 1, max(freeze_step, 1)).astype(jnp.float32)

        def moments(u, mu, nu):
            u = u.astype(jnp.float32)
            mu = (
                b1 * mu + (1 - b1) * u
                if takes == "gradient"
                else jnp.where(warm, b1 * mu + (1 - b1) * u, u)
            )
            nu = jnp.where(warm, b2 * nu + (1 - b2) * u * u, nu)
            return mu, nu

        both = jax.tree.map(moments, updates, state.mu, state.nu)
        mu = jax.tree.map(lambda x: x[0], both, is_leaf=lambda x: isinstance(x, tuple))
        nu = jax.tree.map(lambda x: x[1], both, is_leaf=lambda x: isinstance(x, tuple))
        out = jax.tree.map(
            lambda u, m, v: ((m / (1 - b1**t)) / (jnp.sqrt(v / (1 - b2**tv)) + eps)).astype(
                u.dtype
            ),
            updates,
            mu,
            nu,
        )
        return out, FrozenAdamState(state.count + 1, mu, nu)

    return optax.GradientTransformation(init, update)


# --------------------------------------------------------------------------------------------------
# Config, global state and its shardings


def _field(grad_sync_cfg: Any, name: str) -> Any:
    """A `grad_sync` field from a ConfigDict or a plain dict, with the schema's default."""
    if isinstance(grad_sync_cfg, dict):
        return grad_sync_cfg.get(name, _DEFAULTS[name])
    return getattr(grad_sync_cfg, name, _DEFAULTS[name])


_DEFAULTS = {
    "compression": "none",
    "rank": 2,
    "topk_ratio": 0.01,
    "error_feedback": True,
    "warmup_steps": 0,
    "momentum_correction": False,
    "momentum_masking": True,
    "min_compression": 1.0,
    "warm_start": True,
    "orthogonalization_epsilon": 0.0,
    "stochastic_rounding": False,
    "freeze_variance": False,
    "topk_exchange": "all_gather",
}
TOPK_EXCHANGES = ("all_gather", "two_phase")


class TrainFields(NamedTuple):
    """The `train` fields a compressor reads (its momentum or Adam betas) and the layer axes."""

    momentum: float = 0.9
    b1: float = 0.9
    b2: float = 0.95
    batch_dims: Any = None


def _from_fields(name: str, axis_name: AxisName, cfg: Any, t: TrainFields):
    ef, warmup = bool(_field(cfg, "error_feedback")), int(_field(cfg, "warmup_steps"))
    mc = bool(_field(cfg, "momentum_correction"))
    if name in ("ef_sign", "sign") and mc and _field(cfg, "freeze_variance"):  # under AdamW
        return onebit_adam(
            axis_name, warmup, b1=t.b1, batch_dims=t.batch_dims, local_momentum=True, rms=False
        )
    if name in ("ef_sign", "sign"):
        return ef_sign(
            axis_name, error_feedback=ef, momentum_correction=mc, momentum=t.momentum,
            start_step=warmup, batch_dims=t.batch_dims,
        )  # fmt: skip
    if name in PRECONDITIONERS:  # onebit_adam and its 2-bit and top-k codes
        bits = 2 if name == "twobit_adam" else 1
        ratio = float(_field(cfg, "topk_ratio")) if name == "topk_adam" else None
        return onebit_adam(
            axis_name, warmup, b1=t.b1, batch_dims=t.batch_dims, bits=bits, topk_ratio=ratio
        )
    if name == "int8":
        return int8(
            axis_name, stochastic_rounding=bool(_field(cfg, "stochastic_rounding")),
            error_feedback=ef, batch_dims=t.batch_dims,
        )  # fmt: skip
    if name == "topk" and mc and _field(cfg, "freeze_variance"):  # DGC under AdamW
        two_phase = _field(cfg, "topk_exchange") == "two_phase"
        return onebit_adam(
            axis_name, warmup, b1=t.b1, batch_dims=t.batch_dims,
            topk_ratio=float(_field(cfg, "topk_ratio")), local_momentum=True, two_phase=two_phase,
            masking=bool(_field(cfg, "momentum_masking")),
        )  # fmt: skip
    if name == "topk":
        return topk(
            axis_name, _field(cfg, "topk_ratio"), error_feedback=ef, momentum_correction=mc,
            momentum=t.momentum, warmup_steps=warmup, batch_dims=t.batch_dims,
            dense_start=bool(_field(cfg, "freeze_variance")),
            two_phase=_field(cfg, "topk_exchange") == "two_phase",
        )  # fmt: skip
    return powersgd(
        axis_name, int(_field(cfg, "rank")), start_iter=warmup, error_feedback=ef,
        min_compression=float(_field(cfg, "min_compression")),
        warm_start=bool(_field(cfg, "warm_start")),
        orthogonalization_epsilon=float(_field(cfg, "orthogonalization_epsilon")),
        batch_dims=t.batch_dims,
    )  # fmt: skip


# The one registry of `grad_sync.compression` names: name -> (axis_name, grad_sync config,
# TrainFields) -> compressor. config.validate reads the names from here.
COMPRESSORS: dict[str, Any] = {
    "none": lambda axis_name, cfg, t: none(axis_name),
    "bf16": lambda axis_name, cfg, t: bf16(axis_name, batch_dims=t.batch_dims),
    "int8": functools.partial(_from_fields, "int8"),
    "topk": functools.partial(_from_fields, "topk"),
    "powersgd": functools.partial(_from_fields, "powersgd"),
    "ef_sign": functools.partial(_from_fields, "ef_sign"),
    "onebit_adam": functools.partial(_from_fields, "onebit_adam"),
    "twobit_adam": functools.partial(_from_fields, "twobit_adam"),  # 1-bit Adam, 2-bit code
    "topk_adam": functools.partial(_from_fields, "topk_adam"),  # 1-bit Adam, top-k momentum
    "sign": functools.partial(_from_fields, "sign"),  # deprecated: the old name of ef_sign
}
DEPRECATED = {"sign": "ef_sign"}  # old name -> new name; still accepted, with a warning
MOMENTUM_CORRECTED = ("topk", "ef_sign", "sign")  # can carry the SGD momentum (DGC, 1-bit SGD)


# Compressors that replace the optimizer's preconditioner: name -> the optimizer half, built from
# (grad_sync config, TrainFields); the strategy chains it before weight decay and the learning rate.
def _frozen_adam_of(cfg: Any, t: TrainFields) -> optax.GradientTransformation:
    return frozen_variance_adam(int(_field(cfg, "warmup_steps")), b1=t.b1, b2=t.b2)


PRECONDITIONERS: dict[str, Any] = dict.fromkeys(
    ("onebit_adam", "twobit_adam", "topk_adam"), _frozen_adam_of
)


def check(grad_sync_cfg: Any) -> None:
    """The compressor fields' rules, each checked here only (config.validate calls this too).

    Accepts a ConfigDict or a plain dict; missing fields take the schema's defaults.

    Raises:
      ConfigError: an unknown compressor, `rank` <= 0, `topk_ratio` outside (0, 1],
        `warmup_steps` < 0, `min_compression` < 1,
        `orthogonalization_epsilon` < 0, or `momentum_correction` with a compressor that has none
        or without error feedback.
    """
    name = _field(grad_sync_cfg, "compression")
    if name not in COMPRESSORS:
        raise ConfigError(
            f"grad_sync.compression={name!r} is not valid; choose one of {', '.join(COMPRESSORS)}"
        )
    if _field(grad_sync_cfg, "momentum_correction"):
        if name not in MOMENTUM_CORRECTED:
            raise ConfigError(
                "grad_sync.momentum_correction applies to compression='topk' (DGC) or 'ef_sign' "
                f"(1-bit momentum SGD), not {name!r}"
            )
        if not _field(grad_sync_cfg, "error_feedback"):
            raise ConfigError("grad_sync.momentum_correction needs grad_sync.error_feedback=True")
    dgc_adam = all(_field(grad_sync_cfg, f) for f in ("momentum_correction", "freeze_variance"))
    if not _field(grad_sync_cfg, "momentum_masking") and not (name == "topk" and dgc_adam):
        raise ConfigError(
            "grad_sync.momentum_masking=False applies to compression='topk' with "
            "momentum_correction=True and freeze_variance=True (DGC under AdamW)"
        )
    if name == "none":
        return
    warmup, rank = _field(grad_sync_cfg, "warmup_steps"), _field(grad_sync_cfg, "rank")
    ratio = _field(grad_sync_cfg, "topk_ratio")
    if not isinstance(warmup, int | np.integer) or warmup < 0:
        raise ConfigError(f"grad_sync.warmup_steps={warmup} must be an integer >= 0")
    if not isinstance(rank, int | np.integer) or rank <= 0:
        raise ConfigError(f"grad_sync.rank={rank} must be a positive integer, e.g. 2")
    if not 0 < ratio <= 1:
        raise ConfigError(f"grad_sync.topk_ratio={ratio} must be in (0, 1], e.g. 0.01")
    if not _field(grad_sync_cfg, "min_compression") >= 1:
        raise ConfigError(
            f"grad_sync.min_compression={_field(grad_sync_cfg, 'min_compression')} must be >= 1"
        )
    if _field(grad_sync_cfg, "freeze_variance") and name not in FREEZES_VARIANCE:
        raise ConfigError(
            f"grad_sync.freeze_variance applies to compression {' or '.join(FREEZES_VARIANCE)} "
            f"(onebit_adam always freezes it), not {name!r}"
        )
    if _field(grad_sync_cfg, "topk_exchange") not in TOPK_EXCHANGES:
        raise ConfigError(
            f"grad_sync.topk_exchange={_field(grad_sync_cfg, 'topk_exchange')!r} is not valid; "
            f"choose one of {', '.join(TOPK_EXCHANGES)}"
        )
    if not _field(grad_sync_cfg, "orthogonalization_epsilon") >= 0:
        raise ConfigError("grad_sync.orthogonalization_epsilon must be >= 0, e.g. 0 or 1e-8")


def from_config(
    grad_sync_cfg: Any,
    axis_name: AxisName,
    *,
    momentum: float = 0.9,
    batch_dims: Any = None,
    betas: tuple[float, float] = (0.9, 0.95),
) -> optax.GradientTransformation:
    """The compressor `config.grad_sync` names, after `check`.

    Reads `compression` (a `COMPRESSORS` name; `sign` is the deprecated name of `ef_sign`),
    `rank`, `min_compression`, `warm_start`, `orthogonalization_epsilon` (powersgd), `topk_ratio`
    (topk), `error_feedback` (int8, topk, powersgd, ef_sign), `stochastic_rounding` (int8),
    `warmup_steps` (topk: density warm-up; powersgd: `start_iter`; ef_sign: `start_step`;
    onebit_adam, twobit_adam: the Adam steps before the variance freezes) and
    `momentum_correction` (topk, ef_sign: the SGD `momentum` is applied inside the compressor;
    with `freeze_variance` under AdamW each replica's own Adam momentum: DGC, 1-bit local Adam);
    `betas` are Adam's (onebit_adam, twobit_adam).
    Accepts a ConfigDict or a plain dict. `batch_dims` (a tree like the params) marks stacked-layer
    axes: every compressor treats each layer as a tensor of its own.

    Raises:
      ConfigError: see `check`.
    """
    check(grad_sync_cfg)
    name = _field(grad_sync_cfg, "compression")
    t = TrainFields(momentum, betas[0], betas[1], batch_dims)
    return COMPRESSORS[name](axis_name, grad_sync_cfg, t)


FREEZES_VARIANCE = (
    "topk",
    "powersgd",
    "ef_sign",
    "sign",
)  # grad_sync.freeze_variance: Adam with frozen v after


def preconditioner(
    grad_sync_cfg: Any, betas: tuple[float, float] = (0.9, 0.95)
) -> optax.GradientTransformation | None:
    """The optimizer half that replaces Adam's moments, else None: onebit_adam's, or with
    `freeze_variance` (topk, powersgd, ef_sign) Adam whose variance freezes after `warmup_steps`."""
    name = _field(grad_sync_cfg, "compression")
    if name in FREEZES_VARIANCE and _field(grad_sync_cfg, "freeze_variance"):
        warmup = int(_field(grad_sync_cfg, "warmup_steps"))
        # topk / ef_sign with momentum_correction send each replica's Adam momentum
        takes = "momentum" if _field(grad_sync_cfg, "momentum_correction") else "gradient"
        return frozen_variance_adam(warmup, b1=betas[0], b2=betas[1], takes=takes)
    if name not in PRECONDITIONERS:
        return None
    return PRECONDITIONERS[name](grad_sync_cfg, TrainFields(b1=betas[0], b2=betas[1]))


RESIDUAL_FIELDS = ("residual", "worker", "server")  # state fields holding compression error


def residual_norm(state: Any) -> jax.Array:
    """RMS over replicas of the L2 norm of each replica's compression error (all residual fields).

    `state` is the global sync state ([R, ...] leaves); 0 for compressors without residuals.
    """
    total, r = jnp.zeros((), jnp.float32), 1
    for name in RESIDUAL_FIELDS:
        for x in jax.tree.leaves(getattr(state, name, None)):
            total = total + jnp.sum(jnp.square(x.astype(jnp.float32)))
            r = x.shape[0]
    return jnp.sqrt(total / r)


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


def _data_spec(data_axes: AxisName) -> str | tuple[str, ...]:
    axes = _axes(data_axes)
    return axes[0] if len(axes) == 1 else axes


def init_global(
    tx: optax.GradientTransformation, params: Any, mesh: Mesh, data_axes: AxisName
) -> Any:
    """The global sync state: `tx.init` per replica, leaves stacked to [R, ...] over `data_axes`.

    `params` must be replicated over the data axes. Traceable: call it inside the jitted init, or
    under `jax.eval_shape` for the shapes `state_partition_spec` takes.
    """
    axes = _axes(data_axes)
    init = jax.shard_map(
        tx.init, mesh=mesh, in_specs=P(), out_specs=P(_data_spec(axes)), axis_names=set(axes)
    )
    return init(params)


def _tree_like(x: Any, pdef: Any) -> bool:
    """A state subtree with the params' tree structure (its leaves may be None)."""
    if x is None or isinstance(x, jax.ShapeDtypeStruct | jax.Array):
        return False
    try:
        pdef.flatten_up_to(x)
    except (ValueError, TypeError):
        return False
    return True


def _params_like(x: Any, pdef: Any, shapes: Sequence[tuple[int, ...]]) -> bool:
    """A state subtree structured like the params, each leaf [1 or R, *shape] or None."""
    if not _tree_like(x, pdef):
        return False
    leaves = pdef.flatten_up_to(x)
    return all(
        leaf is None or (hasattr(leaf, "shape") and tuple(leaf.shape[1:]) == shape)
        for leaf, shape in zip(leaves, shapes, strict=True)
    )


def _shard_leaf_spec(leaf, shape, pspec, *, mesh: Mesh, lead) -> P | None:
    """The spec of one per-shard state leaf of a parameter of shard shape `shape`, spec `pspec`."""
    if leaf is None:
        return None
    if tuple(leaf.shape[1:]) == shape:
        return P(lead, *pspec)
    # The shards' own copies, side by side: over the axes this parameter is split on (state of
    # a parameter replicated over an axis is the same on all its shards, typed so).
    split = [a for a in mesh.axis_names if a in jax.tree.leaves(tuple(pspec))]
    if leaf.ndim < 2 or not split:
        return P(lead, *(None,) * (leaf.ndim - 1))
    return P(lead, split[0] if len(split) == 1 else tuple(split), *(None,) * (leaf.ndim - 2))


def sharded_state(
    tx: optax.GradientTransformation,
    params: Any,
    param_specs: Any,
    mesh: Mesh,
    data_axes: AxisName,
    shard_axes: Sequence[str],
) -> tuple[Any, Any]:
    """The sync state when the compressor runs on each device's shard of the gradients.

    Inside `jax.shard_map` manual over `data_axes` and `shard_axes` (the axes that shard the
    parameters: fsdp, tensor, pipeline), `tx` sees this device's shard of its replica's gradient
    and keeps state for that shard alone (see `collectives.sync_grads`).

    Args:
      tx: a compressor built with `axis_name=data_axes`.
      params: the parameters (arrays or `jax.ShapeDtypeStruct`s), global shapes.
      param_specs: their PartitionSpecs (a tree like params).
      mesh: the device mesh.
      data_axes, shard_axes: the manual axes.

    Returns:
      (init, specs): `init(params) -> state`, traceable (run it inside the jitted init), and the
      PartitionSpecs of that state. Parameter-shaped leaves (residuals, momenta) are
      `P(data, *param_spec)`: [R, *param shape], sharded like their parameters. Other per-parameter
      leaves (PowerSGD's Q, sign's server residual) put the shards' own copies side by side along
      their first axis after the replica axis, over the mesh axes that split that parameter.
      Counters and keys are `P(data, ...)`, the same on every shard.
    """
    axes = _axes(data_axes)
    manual = set(axes) | set(shard_axes)
    lead = _data_spec(axes)
    shards = tuple(a for a in mesh.axis_names if a in set(shard_axes))
    p_specs = jax.tree.map(lambda sp: sharding.spec_only(sp, manual), param_specs)
    pdef = jax.tree.structure(params)
    local_shapes = [
        tuple(jax.sharding.NamedSharding(mesh, sp).shard_shape(tuple(p.shape)))
        for p, sp in zip(pdef.flatten_up_to(params), pdef.flatten_up_to(p_specs), strict=True)
    ]
    # Each device's own [1, ...] state, side by side on the leading axis: shapes of one shard.
    probe = jax.shard_map(
        tx.init,
        mesh=mesh,
        in_specs=(p_specs,),
        out_specs=P((*axes, *shards)),
        axis_names=manual,
    )
    local = jax.eval_shape(probe, params)

    structured = functools.partial(_tree_like, pdef=pdef)
    leaf_spec = functools.partial(_shard_leaf_spec, mesh=mesh, lead=lead)

    def spec(x):
        if structured(x):
            leaves = pdef.flatten_up_to(x)
            specs = pdef.flatten_up_to(p_specs)
            return pdef.unflatten(list(map(leaf_spec, leaves, local_shapes, specs)))
        return P(lead, *(None,) * (x.ndim - 1))  # counters, keys: the same on every shard

    specs = jax.tree.map(spec, local, is_leaf=structured)
    init = jax.shard_map(
        tx.init, mesh=mesh, in_specs=(p_specs,), out_specs=specs, axis_names=manual
    )
    return init, specs


def state_partition_spec(
    state: Any,
    data_axes: AxisName,
    params: Any = None,
    param_specs: Any = None,
) -> Any:
    """PartitionSpecs for the global sync state: `P(data_axes, ...)` on every leaf.

    Args:
      state: the global state, arrays or `jax.ShapeDtypeStruct`s (`jax.eval_shape(init_global...)`).
      data_axes: the data-parallel mesh axes, sharding the leading replica axis.
      params, param_specs: optional; parameter-shaped subtrees of the state (residuals, where
        leaves may be None) then get `P(data_axes, *param_spec)`, sharded like their parameters on
        the fsdp/tensor axes. Other leaves (PowerSGD Q, sign server residuals, counters, keys) are
        replicated beyond the leading axis. (The train step's compressor works on each device's
        shard instead: see `sharded_state`.)
    """
    lead = _data_spec(data_axes)

    def replicated(x):
        return P(lead, *(None,) * (x.ndim - 1))

    if params is None or param_specs is None:
        return jax.tree.map(replicated, state)
    pdef = jax.tree.structure(params)
    pshapes = [tuple(p.shape) for p in pdef.flatten_up_to(params)]
    pspecs = pdef.flatten_up_to(param_specs)

    params_like = functools.partial(_params_like, pdef=pdef, shapes=pshapes)

    def spec(x):
        if not params_like(x):
            return replicated(x)
        out = []
        for leaf, pspec, shape in zip(pdef.flatten_up_to(x), pspecs, pshapes, strict=True):
            rest = tuple(pspec) + (None,) * (len(shape) - len(tuple(pspec)))
            out.append(None if leaf is None else P(lead, *rest))
        return pdef.unflatten(out)

    return jax.tree.map(spec, state, is_leaf=params_like)
