"""Casts on the wire: `none` (f32), `fp16`, `bf16` and `int8` (absmax per chunk), and their specs.

`none` is the compiler's f32 mean. `fp16` is PyTorch DDP's `fp16_compress_hook`: one float16
all-reduce that also sums in float16 (gloo's ring on CPU, NCCL on GPUs). `bf16` and `int8` run a
two-phase reduce (all-to-all of each replica's shard rows, a mean in f32, all-gather of the
result) with the narrower type on the wire in both phases; `int8` optionally rounds
stochastically and keeps both phases' rounding error (error feedback). Both also run at every hop
of a ring (`per_hop` codecs, jaxdist/allreduce.py).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import jaxdist.compression.replica as replica
import jaxdist.compression.tensors as tensors
from jaxdist.compression.replica import AxisName, num_replicas
from jaxdist.compression.spec import (
    Codec,
    CompressorSpec,
    TrainFields,
    dense_wire_bytes,
    field,
    ring,
)
from jaxdist.compression.tensors import shard_layout


def none(axis_name: AxisName) -> optax.GradientTransformation:
    """Plain f32 mean over replicas (`lax.pmean`): what the compiler's implicit reduction does."""

    def update(grads, state, params=None):
        del params
        return jax.lax.pmean(grads, replica.axes(axis_name)), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def bf16_bits(x: jax.Array) -> jax.Array:
    """f32 -> bf16 (round to nearest even) as uint16 bits: XLA:CPU widens bf16 collectives."""
    return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)


def from_bf16_bits(x: jax.Array) -> jax.Array:
    """The inverse of `bf16_bits`: uint16 bits -> the bf16 value, widened to f32."""
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

        def psum(g):
            s = jax.lax.psum(g.astype(jnp.bfloat16), replica.axes(axis_name))
            return (s.astype(jnp.float32) / r).astype(g.dtype)

        def first(g):
            shard, c = shard_layout(g.size, r, g.size)
            return (bf16_bits(tensors.to_rows(g, r, shard, c)),), g  # [R, 1, shard]

        def middle(got, g):  # got: every replica's bf16 of this replica's part
            return (bf16_bits(jnp.sum(from_bf16_bits(got[0]), axis=0) / r),), g

        def last(got, g):
            return tensors.from_rows(from_bf16_bits(got[0]), g)

        if not two_phase:
            return tensors.map_float_leaves(
                lambda i, g, b: (tensors.per_layer(psum, b)(g),), grads, (), batch_dims
            )[0], state
        out, _ = tensors.two_phase_leaves(
            lambda i, g, b: (g,),
            (first, middle, last),
            lambda i, g, mean: (mean,),
            grads,
            (),
            batch_dims,
            axis_name,
        )
        return out, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def fp16(axis_name: AxisName) -> optax.GradientTransformation:
    """PyTorch DDP's `fp16_compress_hook`: each replica's gradient cast to float16 and divided by
    R in float16, summed over the replicas in float16 by one all-reduce, cast back: 2x fewer bytes
    than `none`.

    Every float leaf goes in one flat float16 buffer (`replica.psum_flat`). XLA:CPU keeps a
    float16 all-reduce in float16, so it runs as gloo's ring all-reduce at half the bytes, where
    `bf16`'s two phases (an all-to-all and an all-gather) send the same bytes to and from every
    peer (docs/AGGREGATION.md, "Half-duplex pairs"). Unlike `bf16`, the sum itself is rounded to
    float16 at every addition (as DDP's hook does); float16 has 3 more bits of mantissa than
    bfloat16 and far less range: a gradient over 65504 becomes inf, under ~6e-8 R flushes to 0.
    """

    def update(grads, state, params=None):
        del params
        r = jnp.float16(num_replicas(axis_name))
        leaves, treedef = jax.tree.flatten(grads)
        floats = [i for i, g in enumerate(leaves) if tensors.is_float(g)]
        halves = [leaves[i].astype(jnp.float16) / r for i in floats]
        for i, s in zip(floats, replica.psum_flat(halves, axis_name, jnp.float16), strict=True):
            leaves[i] = s.astype(leaves[i].dtype)
        return treedef.unflatten(leaves), state

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
    """The inverse of `quantize_int8`: q [..., c] int8, scale [...] -> f32 [..., c]."""
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
        return Int8State(
            key, tensors.worker_zeros(params), tensors.server_zeros(params, batch_dims, shard_of)
        )

    def update(grads, state, params=None):
        del params
        key = jax.random.wrap_key_data(state.key[0])
        replica_key = jax.random.fold_in(key, jax.lax.axis_index(replica.axes(axis_name)))

        def start(i, g, b, ew, es):
            lead = g.shape[:b]
            keys = jax.random.split(jax.random.fold_in(replica_key, i), math.prod(lead))
            e0 = (None, None) if ew is None else (ew[0], es[0])
            return g, *e0, keys.reshape(*lead, *keys.shape[1:])

        def end(i, g, result, ew, es):
            mean, w, srv = result
            return mean, None if w is None else w[None], None if srv is None else srv[None]

        phases = _int8_phases(num_replicas(axis_name), chunk, stochastic_rounding)
        out, (worker, server) = tensors.two_phase_leaves(
            start, phases, end, grads, (state.worker, state.server), batch_dims, axis_name
        )
        new_key = jax.random.key_data(jax.random.split(key)[0])[None]
        return out, Int8State(new_key, worker, server)

    return optax.GradientTransformation(init, update)


def _int8_phases(r: int, chunk: int, stochastic: bool):
    """One layer's two-phase int8 mean as `tensors.two_phase`'s (first, middle, last): the mean,
    the new worker residual and the new server residual [s] (both None without error feedback)."""

    def first(g, ew, es, key):
        k1, k2 = jax.random.split(key) if stochastic else (None, None)
        acc = g.astype(jnp.float32) if ew is None else g.astype(jnp.float32) + ew
        shard, c = shard_layout(acc.size, r, chunk)
        q, scale = quantize_int8(tensors.to_rows(acc, r, shard, c), k1)  # [R, s/c, c], [R, s/c]
        left = None if ew is None else acc - tensors.from_rows(dequantize_int8(q, scale), acc)
        return (q, scale), (g, left, es, k2)

    def middle(got, kept):
        g, worker_left, es, k2 = kept
        mean = jnp.sum(dequantize_int8(*got), axis=0) / r  # [s/c, c]: my shard
        if es is not None:
            mean = mean + es.reshape(mean.shape)
        q2, scale2 = quantize_int8(mean, k2)
        server_left = None if es is None else (mean - dequantize_int8(q2, scale2)).reshape(-1)
        return (q2, scale2), (g, worker_left, server_left)

    def last(got, kept):
        g, worker_left, server_left = kept
        return tensors.from_rows(dequantize_int8(*got), g), worker_left, server_left

    return first, middle, last


# --------------------------------------------------------------------------------------------------
# Per-hop codecs (jaxdist/allreduce.py `ring_per_hop`)

INT8_BLOCK = 256  # values per f32 scale of the int8 per-hop codec (int8's default chunk)


def _int8_encode(x: jax.Array) -> jax.Array:
    """f32 [k] -> int8 [k/256, 260]: each block's values and its f32 scale's 4 bytes, one
    buffer so that a hop is one collective-permute."""
    q, scale = quantize_int8(x.reshape(-1, INT8_BLOCK))  # [k/256, 256], [k/256]
    return jnp.concatenate([q, jax.lax.bitcast_convert_type(scale, jnp.int8)], axis=1)


def _int8_decode(payload: jax.Array, k: int) -> jax.Array:
    scale = jax.lax.bitcast_convert_type(payload[:, INT8_BLOCK:], jnp.float32)  # [k/256]
    return dequantize_int8(payload[:, :INT8_BLOCK], scale).reshape(-1)


def bf16_codec(cfg: Any = None) -> Codec:
    """bf16 bits per hop (uint16: XLA:CPU would widen a bf16 collective back to f32)."""
    del cfg
    return Codec(bf16_bits, lambda q, k: from_bf16_bits(q), 1)


def int8_codec(cfg: Any = None) -> Codec:
    """int8 per hop, absmax scale per `INT8_BLOCK` values."""
    del cfg
    return Codec(_int8_encode, _int8_decode, INT8_BLOCK)


# --------------------------------------------------------------------------------------------------
# Specs


def _two_phase_bytes(shard: int, replicas: int, bytes_per_elem: float, scales: int) -> float:
    """Both phases of a two-phase reduce: all-to-all of [R, shard] then all-gather of [shard]
    (gathered [R, shard]), each with `scales` f32 scales per row."""
    phase = ring("all-to-all", replicas * (shard * bytes_per_elem + 4 * scales), replicas)
    return 2 * phase


def _bf16_wire(grad_bytes: float, replicas: int, cfg: Any, shape=None) -> float:
    n = int(grad_bytes // 4)
    shard, _ = shard_layout(n, replicas, n)
    return _two_phase_bytes(shard, replicas, 2, 0)


def _int8_wire(grad_bytes: float, replicas: int, cfg: Any, shape=None) -> float:
    shard, c = shard_layout(int(grad_bytes // 4), replicas, INT8_BLOCK)
    return _two_phase_bytes(shard, replicas, 1, shard // c)


def _int8_state(grad_bytes: float, replicas: int, cfg: Any) -> float:
    if not field(cfg, "error_feedback"):
        return 0.0
    return grad_bytes + 4 * shard_layout(int(grad_bytes // 4), replicas, INT8_BLOCK)[0]


def _int8_from(axis_name: AxisName, cfg: Any, t: TrainFields) -> optax.GradientTransformation:
    return int8(
        axis_name, stochastic_rounding=bool(field(cfg, "stochastic_rounding")),
        error_feedback=bool(field(cfg, "error_feedback")), batch_dims=t.batch_dims,
    )  # fmt: skip


NONE = CompressorSpec(
    name="none",
    build=lambda axis_name, cfg, t: none(axis_name),
    summary="f32 mean over replicas (lax.pmean)",
    wire_bytes=dense_wire_bytes,
)
FP16 = CompressorSpec(
    name="fp16",
    build=lambda axis_name, cfg, t: fp16(axis_name),
    summary="PyTorch DDP's fp16_compress_hook: one float16 all-reduce, summed in float16",
    wire_bytes=lambda grad_bytes, replicas, cfg, shape=None: ring(
        "all-reduce", grad_bytes / 2, replicas
    ),
    extra_flops=lambda grad_bytes, replicas, cfg: grad_bytes / 2,  # casts in and out
)
BF16 = CompressorSpec(
    name="bf16",
    build=lambda axis_name, cfg, t: bf16(axis_name, batch_dims=t.batch_dims),
    summary="bf16 on the wire in a two-phase reduce, f32 accumulation (2x fewer bytes)",
    wire_bytes=_bf16_wire,
    per_hop=bf16_codec,
    extra_flops=lambda grad_bytes, replicas, cfg: grad_bytes / 2,  # casts in and out
)
INT8 = CompressorSpec(
    name="int8",
    build=_int8_from,
    summary="int8 + an f32 absmax scale per 256 values in both phases (~3.9x fewer bytes)",
    wire_bytes=_int8_wire,
    fields=("error_feedback", "stochastic_rounding"),
    error_feedback=True,
    residual_fields=("worker", "server"),
    per_hop=int8_codec,
    state_bytes=_int8_state,
    extra_flops=lambda grad_bytes, replicas, cfg: 2 * grad_bytes,  # ~8 ops per element
)
