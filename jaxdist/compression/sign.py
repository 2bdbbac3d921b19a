"""Scaled signs and 2-bit codes in a two-phase reduce (EF-signSGD, `ef_sign`) and their specs.

Each replica's tensor (plus its worker residual) is cut into R shards and compressed per chunk to
sign bits (or 2-bit Lloyd-Max codes) and an f32 scale; an all-to-all gives replica j every copy of
shard j, which it averages, adds its server residual to and re-compresses; an all-gather returns
the result (DeepSpeed's `compressed_allreduce`). 1-bit Adam's exchange (onebit.py) is this one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxdist.compression.replica as replica
import jaxdist.compression.tensors as tensors
from jaxdist.compression.replica import AxisName, num_replicas
from jaxdist.compression.spec import CompressorSpec, TrainFields, field, ring
from jaxdist.compression.tensors import shard_layout

SIGN_CHUNK = 2048  # elements per f32 scale of ef_sign and 1-bit Adam


class SignState(NamedTuple):
    count: jax.Array  # [1] int32 steps taken (drives `start_step`)
    worker: Any  # params-shaped, f32 [1, ...] per leaf: this replica's compression error
    server: Any  # per leaf f32 [1, shard]: error re-compressing the shard this replica reduces
    momentum: Any  # params-shaped, f32 [1, ...]: the last synchronized momentum; None without it


def sign_compress(x: jax.Array, valid: jax.Array, rms: bool = False):
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


def sign_decompress(packed: jax.Array, scale: jax.Array, c: int) -> jax.Array:
    bits = jnp.unpackbits(packed, axis=-1, count=c).astype(bool)
    return jnp.where(bits, scale[..., None], -scale[..., None])


# The 4-level Lloyd-Max quantizer of a unit Gaussian (Max, 1960): |x| below the threshold maps to
# the inner level, above it to the outer one; in units of the chunk's RMS.
TWOBIT_THRESHOLD, TWOBIT_LEVELS = 0.9816, (0.4528, 1.5104)


def twobit_compress(x: jax.Array, valid: jax.Array, rms: bool = True):
    """2-bit quantization over the last axis: (bits uint8 [..., c/4], scale [...], approx).

    scale = ||x||_2 / sqrt(d) per chunk (d valid elements); each element keeps its sign and
    whether |x| >= TWOBIT_THRESHOLD scale (two bit planes, packed 4 elements per byte), and
    decompresses to +-TWOBIT_LEVELS[big] scale: the mean-squared-error optimal 2-bit code of a
    Gaussian. Padding decompresses to 0. (`rms` is accepted for `sign_compress`'s signature.)
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


def twobit_decompress(packed: jax.Array, scale: jax.Array, c: int) -> jax.Array:
    bits = jnp.unpackbits(packed, axis=-1, count=2 * c).astype(bool)
    return _twobit_values(bits.reshape(*packed.shape[:-1], c, 2), scale)


# bits per element -> (compress, decompress) of the two-phase exchange (`sign_phases`)
QUANTIZERS = {1: (sign_compress, sign_decompress), 2: (twobit_compress, twobit_decompress)}


def sign_phases(axis_name: AxisName, chunk: int, rms: bool = False, bits: int = 1):
    """DeepSpeed's `compressed_allreduce` of one tensor as `tensors.two_phase`'s (first, middle,
    last), `first(acc, es, like)`: acc this replica's tensor with its worker residual added, es
    its server residual [s] (or None); the result is (mean over replicas, new worker residual,
    new server residual [s]).

    Phase 1: cut into [R, s], compress per chunk to `bits` bits per element (`QUANTIZERS`),
    all-to-all; replica j decompresses and averages shard j and adds its server residual `es`.
    Phase 2: re-compress, all-gather.
    """
    compress, decompress = QUANTIZERS[bits]

    def layout(like):
        r = num_replicas(axis_name)
        return (r, *shard_layout(like.size, r, chunk, 8))

    def first(acc, es, like):
        r, shard, c = layout(like)
        x = tensors.to_rows(acc, r, shard, c)  # [R, s/c, c]
        valid = (np.arange(r * shard) < acc.size).reshape(x.shape)
        packed, scale, approx = compress(x, valid, rms)
        return (packed, scale), (like, acc - tensors.from_rows(approx, acc), es)

    def middle(got, kept):
        like, worker_left, es = kept
        r, shard, c = layout(like)
        me = jax.lax.axis_index(replica.axes(axis_name))
        my_valid = (me * shard + jnp.arange(shard) < like.size).reshape(shard // c, c)
        mean = jnp.where(my_valid, jnp.mean(decompress(*got, c), axis=0), 0)
        if es is not None:
            mean = mean + es.reshape(mean.shape)
        packed2, scale2, approx2 = compress(mean, my_valid, rms)
        return (packed2, scale2), (like, worker_left, (mean - approx2).reshape(shard))

    def last(got, kept):
        like, worker_left, server_left = kept
        full = decompress(*got, layout(like)[2])
        return tensors.from_rows(full, like), worker_left, server_left

    return first, middle, last


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
        momentum_buf = tensors.worker_zeros(params) if momentum_correction else None
        if not error_feedback:
            return SignState(count, None, None, momentum_buf)
        shard_of = lambda size: shard_layout(size, num_replicas(axis_name), chunk, 8)[0]  # noqa: E731
        server = tensors.server_zeros(params, batch_dims, shard_of)
        return SignState(count, tensors.worker_zeros(params), server, momentum_buf)

    phases = sign_phases(axis_name, chunk)
    start, end = _ef_sign_ends(momentum)

    def compressed(grads, parts):
        return tensors.two_phase_leaves(start, phases, end, grads, parts, batch_dims, axis_name)

    def dense(grads, parts):  # the first `start_step` steps: an exact f32 pmean
        def leaf(i, g, b, *xs):
            acc, es0, _ = start(i, g, b, *xs)
            mean = jax.lax.pmean(acc, replica.axes(axis_name)).astype(g.dtype)
            return end(i, g, (mean, jnp.zeros_like(acc), es0), *xs)

        return tensors.map_float_leaves(leaf, grads, parts, batch_dims)

    def update(grads, state, params=None):
        del params
        parts = (state.worker, state.server, state.momentum)
        if start_step > 0:
            out, new = jax.lax.cond(state.count[0] < start_step, dense, compressed, grads, parts)
        else:
            out, new = compressed(grads, parts)
        return out, SignState(state.count + 1, *new)

    return optax.GradientTransformation(init, update)


def _ef_sign_ends(momentum: float):
    """`tensors.two_phase_leaves`' (start, end) of `ef_sign`: each replica sends its gradient
    (with momentum correction m_i = momentum * m + g_i) plus its worker residual; the state
    fields (worker, server residual, momentum) are None where not kept."""

    def start(i, g, b, ew, es, u):
        acc = g.astype(jnp.float32)
        if u is not None:
            acc = momentum * u[0] + acc
        if ew is not None:
            acc = acc + ew[0]
        return acc, None if es is None else es[0], g

    def end(i, g, result, ew, es, u):
        mean, w, s = result
        return (
            mean,
            None if ew is None else w[None],
            None if es is None else s[None],
            None if u is None else mean.astype(jnp.float32)[None],
        )

    return start, end


sign = ef_sign  # the old name of `ef_sign`

# --------------------------------------------------------------------------------------------------
# Specs


def sign_wire_bytes(grad_bytes: float, replicas: int, bits: int = 1) -> float:
    """Both phases of `sign_phases` for one tensor at `bits` bits per element (chunk 2048)."""
    shard, c = shard_layout(int(grad_bytes // 4), replicas, SIGN_CHUNK, 8)
    phase = replicas * (shard * bits // 8 + 4 * (shard // c))
    return 2 * ring("all-to-all", phase, replicas)


def _sign_state(grad_bytes: float, replicas: int, cfg: Any) -> float:
    ef = field(cfg, "error_feedback")
    server = 4 * shard_layout(int(grad_bytes // 4), replicas, SIGN_CHUNK, 8)[0]
    return (grad_bytes + server if ef else 0.0) + (
        grad_bytes if field(cfg, "momentum_correction") else 0.0
    )


def _ef_sign_from(axis_name: AxisName, cfg: Any, t: TrainFields) -> optax.GradientTransformation:
    return ef_sign(
        axis_name, error_feedback=bool(field(cfg, "error_feedback")),
        momentum_correction=bool(field(cfg, "momentum_correction")), momentum=t.momentum,
        start_step=int(field(cfg, "warmup_steps")), batch_dims=t.batch_dims,
    )  # fmt: skip


EF_SIGN = CompressorSpec(
    name="ef_sign",
    build=_ef_sign_from,
    summary="scaled sign bits (8 per byte) in a two-phase reduce, worker + server error feedback",
    wire_bytes=lambda grad_bytes, replicas, cfg, shape=None: sign_wire_bytes(grad_bytes, replicas),
    fields=("error_feedback", "warmup_steps", "momentum_correction", "freeze_variance"),
    error_feedback=True,
    residual_fields=("worker", "server"),
    momentum_corrected="1-bit momentum SGD",
    freezes_variance=True,
    local_adam=lambda cfg: {"rms": False},
    state_bytes=_sign_state,
    extra_flops=lambda grad_bytes, replicas, cfg: 2 * grad_bytes,  # ~8 ops per element
    dense_estimate=False,
)
SIGN = dataclasses.replace(
    EF_SIGN, name="sign", summary="the old name of ef_sign", deprecated_for="ef_sign"
)
