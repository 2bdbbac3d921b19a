"""1-bit Adam's two halves (`onebit_adam` sync, `frozen_variance_adam` optimizer) and specs.

After a full-precision Adam warm-up the variance freezes and each replica's momentum
b1 m + (1 - b1) g_i is what crosses the network, compressed by the sign exchange (sign.py: 1 bit,
`twobit_adam` 2 bits) or the top-k exchange (topk.py, `topk_adam`), with error feedback. The
same scheme with each replica's own momentum is DGC / 1-bit local Adam under AdamW (the
`local_adam` ability of topk and ef_sign, built by `registry.from_config`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import jaxdist.compression.replica as replica
import jaxdist.compression.tensors as tensors
from jaxdist.compression.replica import AxisName, num_replicas
from jaxdist.compression.sign import (
    QUANTIZERS,
    SIGN_CHUNK,
    sign_phases,
    sign_wire_bytes,
)
from jaxdist.compression.spec import CompressorSpec, TrainFields, field
from jaxdist.compression.tensors import shard_layout
from jaxdist.compression.topk import topk_k, topk_send, topk_wire_bytes


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

    `shard_of(size)` is the length of a layer's server residual. With `topk_ratio`,
    `reduce(acc, es, like, u)` is `topk`'s exchange of one layer (`two_phase`: sparse
    reduce-scatter of ceil(k / R) pairs per row, server re-sparsification, all-gather; else an
    all-gather of each replica's k pairs) with error feedback, returning (mean, new worker
    residual, new server residual, u zeroed where this replica sent). Without, reduce is None:
    the momenta go through DeepSpeed's `compressed_allreduce` with `bits`-bit codes
    (`sign_phases`; `rms=False`: ef_sign's scale ||x||_1 / d instead of ||x||_2 / sqrt(d)), every
    layer in one exchange (`tensors.two_phase`).
    """
    if bits not in QUANTIZERS:
        raise ValueError(f"onebit_adam: bits={bits} must be one of {sorted(QUANTIZERS)}")
    if chunk <= 0 or chunk % 8:
        raise ValueError(f"onebit_adam: chunk={chunk} must be a positive multiple of 8")
    if topk_ratio is None:
        return lambda n: shard_layout(n, num_replicas(axis_name), chunk, 8)[0], None

    def reduce_topk(acc, es, like, u):
        del like
        flat, r = acc.reshape(-1), num_replicas(axis_name)
        k = topk_k(topk_ratio, flat.size)
        mean, left, u2, es = topk_send(
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
    code of `twobit_compress` instead of signs, ~(1/4 + 4/chunk) bytes (~16x fewer).
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
        server = tensors.server_zeros(params, batch_dims, shard_of)
        return OneBitAdamState(
            jnp.zeros((1,), jnp.int32), momentum, tensors.worker_zeros(params), server
        )

    warm = functools.partial(_warm_momentum, b1=b1, axis_name=axis_name)
    comp = functools.partial(
        _compressed_momentum, b1=b1, reduce=reduce, local_momentum=local_momentum, masking=masking
    )

    def compressed(grads, parts):
        if topk_ratio is not None:
            return _each_leaf(comp, batch_dims, grads, parts)
        phases = sign_phases(axis_name, chunk, rms, bits)
        start, end = _sign_momentum_ends(b1, local_momentum)
        return tensors.two_phase_leaves(start, phases, end, grads, parts, batch_dims, axis_name)

    warmup = functools.partial(_each_leaf, warm, batch_dims)

    def update(grads, state, params=None):
        del params
        parts = tuple(state[1:])
        if freeze_step == 0:  # no warm-up: compiled without it (bytes of the steady state)
            out, new = compressed(grads, parts)
        else:
            frozen = state.count[0] >= freeze_step
            out, new = jax.lax.cond(frozen, compressed, warmup, grads, parts)
        return out, OneBitAdamState(state.count + 1, *new)

    return optax.GradientTransformation(init, update)


def _each_leaf(step, batch_dims, grads, parts):
    """`onebit_adam`'s `step` (`_warm_momentum`, `_compressed_momentum`) one tensor at a time,
    per layer: (mean gradients, [momentum, worker, server residual trees])."""

    def leaf(i, g, b, m, ew, es):
        mean, m2, w, s = tensors.per_layer(step, b)(g.astype(jnp.float32), m[0], ew[0], es[0], g)
        return mean.astype(g.dtype), m2[None], w[None], s[None]

    return tensors.map_float_leaves(leaf, grads, parts, batch_dims)


def _sign_momentum_ends(b1: float, local_momentum: bool):
    """`tensors.two_phase_leaves`' (start, end) of `onebit_adam` with the sign code after the
    freeze: each replica sends u = b1 m + (1 - b1) g plus its worker residual (every layer's in
    one exchange); the next m is the mean, or with `local_momentum` u itself (signs send every
    coordinate: nothing is masked)."""

    def start(i, g, b, m, ew, es):
        return b1 * m[0] + (1 - b1) * g.astype(jnp.float32) + ew[0], es[0], g

    def end(i, g, result, m, ew, es):
        mean, w, s = result
        u = b1 * m[0] + (1 - b1) * g.astype(jnp.float32)
        m2 = replica.varying_like(u if local_momentum else mean.astype(jnp.float32), w)
        return mean.astype(g.dtype), m2[None], w[None], s[None]

    return start, end


def _warm_momentum(g, m, ew, es, like, *, b1: float, axis_name: AxisName):
    """One layer of `onebit_adam` before the freeze: the exact f32 mean gradient (Adam's warm-up)
    and Adam's momentum of it; both residuals as they were. Returns (mean, m, ew, es)."""
    mean = jax.lax.pmean(g, replica.axes(axis_name))
    m = b1 * m + (1 - b1) * mean
    return mean, replica.varying_like(m, ew), ew, es


def _compressed_momentum(g, m, ew, es, like, *, b1: float, reduce, local_momentum, masking):
    """One layer of `onebit_adam` after the freeze: this replica's momentum u = b1 m + (1 - b1) g
    plus its worker residual, through `reduce` (`_momentum_exchange`). Returns (mean, the next m:
    the mean, or with `local_momentum` u itself, zeroed where sent if `masking`; the new worker
    and server residuals)."""
    u = b1 * m + (1 - b1) * g  # m: the last synchronized momentum, or (DGC) u_i
    mean, w, s, masked = reduce(u + ew, es, like, u)
    m = (masked if masking else u) if local_momentum else mean.astype(jnp.float32)
    return mean, replica.varying_like(m, ew), w, s


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
# Specs


def _frozen_adam_of(cfg: Any, t: TrainFields) -> optax.GradientTransformation:
    return frozen_variance_adam(int(field(cfg, "warmup_steps")), b1=t.b1, b2=t.b2)


def _adam_from(bits: int, topk: bool):
    def build(axis_name: AxisName, cfg: Any, t: TrainFields) -> optax.GradientTransformation:
        ratio = float(field(cfg, "topk_ratio")) if topk else None
        return onebit_adam(
            axis_name, int(field(cfg, "warmup_steps")), b1=t.b1, batch_dims=t.batch_dims,
            bits=bits, topk_ratio=ratio,
        )  # fmt: skip

    return build


def _adam_state(grad_bytes: float, replicas: int, cfg: Any) -> float:
    """Momentum and worker residual per element, the server residual per shard (Adam's own
    moments then live in `frozen_variance_adam`, as AdamW's would)."""
    return 2 * grad_bytes + 4 * shard_layout(int(grad_bytes // 4), replicas, SIGN_CHUNK, 8)[0]


def _sign_adam_spec(name: str, bits: int, summary: str) -> CompressorSpec:
    """1-bit Adam's scheme with a `bits`-bit code of the momentum (1: its sign)."""
    return CompressorSpec(
        name=name,
        build=_adam_from(bits, False),
        summary=summary,
        wire_bytes=lambda grad_bytes, replicas, cfg, shape=None: sign_wire_bytes(
            grad_bytes, replicas, bits=bits
        ),
        fields=("warmup_steps",),
        error_feedback=True,
        residual_fields=("worker", "server"),
        preconditioner=_frozen_adam_of,
        state_bytes=_adam_state,
        extra_flops=lambda grad_bytes, replicas, cfg: 2 * grad_bytes,
        example={"warmup_steps": 2},
        dense_estimate=False,
    )


ONEBIT_ADAM = _sign_adam_spec(
    "onebit_adam",
    1,
    "1-bit Adam: Adam warm-up, then sign-compressed momentum with a frozen variance",
)
TWOBIT_ADAM = _sign_adam_spec(
    "twobit_adam", 2, "1-bit Adam's scheme with a 2-bit Lloyd-Max code of the momentum"
)
TOPK_ADAM = CompressorSpec(
    name="topk_adam",
    build=_adam_from(1, True),
    summary="1-bit Adam's scheme with the momentum sent by top-k's two-phase exchange",
    wire_bytes=lambda grad_bytes, replicas, cfg, shape=None: topk_wire_bytes(
        grad_bytes, replicas, {"topk_ratio": field(cfg, "topk_ratio"), "topk_exchange": "two_phase"}
    ),
    fields=("warmup_steps", "topk_ratio"),
    error_feedback=True,
    residual_fields=("worker", "server"),
    preconditioner=_frozen_adam_of,
    state_bytes=lambda grad_bytes, replicas, cfg: 2 * grad_bytes + grad_bytes / replicas,
    extra_flops=lambda grad_bytes, replicas, cfg: 4 * grad_bytes,
    example={"warmup_steps": 2, "topk_ratio": 0.05},
    dense_estimate=False,
)
