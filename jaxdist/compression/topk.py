"""Top-k sparsification (Deep Gradient Compression; the two-phase gTop-k exchange) and its spec.

Each replica sends the k largest |grad + residual| entries of every tensor as (value, index)
pairs; the residual keeps the rest (error feedback). With momentum correction the local velocity
is what accumulates (DGC). `topk_exchange='two_phase'` is a sparse reduce-scatter whose bytes do
not grow with the number of replicas. Also a per-hop codec of the ring (jaxdist/allreduce.py).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import jaxdist.compression.replica as replica
import jaxdist.compression.tensors as tensors
from jaxdist.compression.replica import AxisName, num_replicas
from jaxdist.compression.spec import Codec, CompressorSpec, TrainFields, field, ring
from jaxdist.errors import ConfigError


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


def two_phase_k(size: int, k: int, replicas: int) -> int:
    """Entries of each of the R rows the two-phase exchange sends: ceil(k / R), within the row."""
    return min(-(-size // replicas), max(1, -(-k // replicas)))


def topk_k(ratio: float, size: int) -> int:
    """k = ceil(ratio * size), at least 1 and at most `size`: the entries a tensor sends."""
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
    init = functools.partial(
        _topk_init,
        axis_name=axis_name,
        error_feedback=error_feedback,
        momentum_correction=momentum_correction,
        two_phase=two_phase,
        batch_dims=batch_dims,
    )

    def update(grads, state, params=None):
        del params
        stages = [
            functools.partial(
                _topk_all, density=d, r=num_replicas(axis_name), momentum=momentum,
                axis_name=axis_name, two_phase=two_phase, batch_dims=batch_dims,
            )
            for d in densities
        ]  # fmt: skip
        parts = (state.residual, state.velocity, state.server)
        if len(stages) == 1:
            out, new = stages[0](grads, parts)
        else:
            stage = _topk_stage(state.count[0], densities, warmup_steps)
            out, new = jax.lax.switch(stage, stages, grads, parts)
        return out, TopKState(state.count + 1, *new)

    return optax.GradientTransformation(init, update)


def _topk_init(
    params, *, axis_name: AxisName, error_feedback, momentum_correction, two_phase, batch_dims
) -> TopKState:
    """`topk`'s state: the residual (error feedback), the velocity (momentum correction) and the
    server residual of the rows this replica reduces (two_phase with error feedback)."""
    residual = tensors.worker_zeros(params) if error_feedback else None
    velocity = tensors.worker_zeros(params) if momentum_correction else None
    server = None
    if two_phase and error_feedback:
        server = tensors.server_zeros(
            params, batch_dims, lambda n: -(-n // num_replicas(axis_name))
        )
    return TopKState(jnp.zeros((1,), jnp.int32), residual, velocity, server)


def _topk_stage(count: jax.Array, densities: list[float], warmup_steps: int) -> jax.Array:
    """The index into `densities` of step `count`: the warm-up's stages last equally long."""
    per = max(1, warmup_steps // max(1, len(densities) - 1))
    return jnp.minimum(count // per, len(densities) - 1)


def _topk_all(grads, parts, *, density, r, momentum, axis_name, two_phase, batch_dims):
    """`topk`'s update at one density: every float leaf, each of its layers (stacked axes) a
    tensor of its own, through `_exchange` at once. `parts`: the residual, velocity and server
    residual trees ([1, ...] leaves, or None). Returns (mean gradients, [new part trees])."""
    items = {}

    def collect(i, g, b, e, u, es):
        e0, u0, s0 = (None if x is None else x[0].astype(jnp.float32) for x in (e, u, es))
        acc, v = tensors.per_layer(functools.partial(_accumulate, momentum=momentum), b)(g, e0, u0)
        items[i] = (acc, v, s0, b)
        return (g, e, u, es)

    tensors.map_float_leaves(collect, grads, parts, batch_dims)
    k_of = functools.partial(topk_k, density)
    got = dict(zip(items, _exchange(list(items.values()), k_of, r, axis_name, two_phase)))

    def finish(i, g, b, e, u, es):
        mean, left, v, s1 = got[i]
        return (
            mean.reshape(g.shape).astype(g.dtype),
            None if e is None else left.reshape(g.shape)[None].astype(e.dtype),
            None if u is None else v.reshape(g.shape)[None].astype(u.dtype),
            None if es is None else s1[None],
        )

    return tensors.map_float_leaves(finish, grads, parts, batch_dims)


def _accumulate(g, e, u, *, momentum):
    """One layer's (what top-k selects from, the velocity it zeroes where sent), flat f32: g plus
    the residual e; with a velocity u (DGC) u <- momentum u + g accumulated instead."""
    flat = g.reshape(-1).astype(jnp.float32)
    if u is not None:  # DGC: accumulate the locally momentum-corrected gradient
        u = momentum * u.reshape(-1) + flat
        acc = e.reshape(-1) + u
    elif e is not None:
        acc = e.reshape(-1) + flat
    else:
        acc = flat
    return acc, acc if u is None else u


def _route(n: int, k: int, r: int, two_phase: bool) -> str:
    """How a tensor of n entries with k sent goes over r replicas: "all" (k >= n: the dense mean,
    nothing left), "two_phase" (the sparse reduce-scatter and all-gather), "union" (the pairs
    would outweigh the tensor: a dense all-reduce of the sparse union) or "gather" (an
    all-gather of every replica's k pairs)."""
    if k >= n:
        return "all"
    if two_phase and 2 * r * two_phase_k(n, k, r) < n:
        return "two_phase"
    return "union" if two_phase or r * k >= n else "gather"


def _exchange(items, k_of, r, axis_name: AxisName, two_phase: bool) -> list[tuple]:
    """Top-k of every tensor in `items`, each (acc [*L, n], u [*L, n], server residual [*L, s]
    or None, L's rank b), each of its L layers with k_of(n) entries sent (`_route`): per tensor
    (mean over replicas of what was sent, acc and u zeroed where sent, the new server residual).
    One all-reduce for every dense route's tensor (`replica.pmean_flat`), one all-to-all and one
    all-gather for every pair route's (`tensors.two_phase`): not two or four per tensor."""
    routes = [_route(it[0].shape[-1], k_of(it[0].shape[-1]), r, two_phase) for it in items]
    dense = [i for i, route in enumerate(routes) if route in ("all", "union")]
    pairs = [i for i, route in enumerate(routes) if route not in ("all", "union")]
    out: list[Any] = [None] * len(items)
    local = {}
    for i in dense:
        acc, u, es, b = items[i]
        one = functools.partial(_dense_local, k_of=k_of, route=routes[i])
        local[i] = (*tensors.per_layer(one, b)(acc, u), es)
    means = replica.pmean_flat([local[i][0] for i in dense], axis_name)
    for i, mean in zip(dense, means, strict=True):
        out[i] = (mean, *local[i][1:])
    phases = (_two_phase_phases if two_phase else _gather_phases)(k_of, r)
    sent = [items[i][:3] for i in pairs]
    for i, res in zip(
        pairs, tensors.two_phase(sent, [items[i][3] for i in pairs], *phases, axis_name)
    ):
        out[i] = res
    return out


def _dense_local(acc, u, *, k_of, route: str):
    """One layer's dense route: (what is all-reduced, acc left, u left)."""
    if route == "all":  # everything sent: nothing left, the velocity kept (momentum SGD)
        return acc, jnp.zeros_like(acc), u
    _, idx = jax.lax.top_k(jnp.abs(acc), k_of(acc.size))  # the union of everyone's top-k
    return jnp.zeros_like(acc).at[idx].set(acc[idx]), acc.at[idx].set(0), u.at[idx].set(0)


def _gather_phases(k_of, r: int):
    """The all-gather route as `tensors.two_phase`'s (first, middle, last) on one layer
    (acc [n], u [n], es): nothing in the all-to-all; every replica's k (value, index) pairs
    gathered and scatter-added. Returns (mean, acc and u zeroed where sent, es)."""

    def first(acc, u, es):
        _, idx = jax.lax.top_k(jnp.abs(acc), k_of(acc.size))
        return (), (acc[idx], idx.astype(jnp.int32), acc.at[idx].set(0), u.at[idx].set(0), es)

    def middle(got, kept):
        vals, idx, left, u, es = kept
        return (vals, idx), (left, u, es)

    def last(got, kept):
        (vals, idx), (left, u, es) = got, kept  # [R, k] each
        mean = jnp.zeros(left.shape, left.dtype).at[idx.reshape(-1)].add(vals.reshape(-1))
        return mean / r, left, u, es

    return first, middle, last


def _two_phase_phases(k_of, r: int):
    """The sparse reduce-scatter + all-gather (`topk`'s `two_phase`) as `tensors.two_phase`'s
    (first, middle, last) on one layer (acc [n], u [n], server residual es [s] or None)."""

    def layout(n):
        return -(-n // r), two_phase_k(n, k_of(n), r)  # (s, entries sent per row)

    def first(acc, u, es):
        n = acc.size
        shard, kr = layout(n)
        rows = jnp.pad(acc, (0, r * shard - n)).reshape(r, shard)
        _, idx = jax.lax.top_k(jnp.abs(rows), kr)  # [R, kr]
        vals = jnp.take_along_axis(rows, idx, axis=1)
        rows_idx = jnp.arange(r)[:, None]
        left = rows.at[rows_idx, idx].set(0).reshape(-1)[:n]
        u_rows = jnp.pad(u, (0, r * shard - n)).reshape(r, shard)
        u = u_rows.at[rows_idx, idx].set(0).reshape(-1)[:n]
        return (vals, idx.astype(jnp.int32)), (left, u, es)

    def middle(got, kept):
        (vals, idx), (left, u, es) = got, kept
        shard, kr = layout(left.size)
        mine = jnp.zeros((shard,), left.dtype).at[idx.reshape(-1)].add(vals.reshape(-1)) / r
        if es is not None:
            mine = mine + es
        _, idx2 = jax.lax.top_k(jnp.abs(mine), kr)
        es = None if es is None else mine.at[idx2].set(0)
        return (mine[idx2], idx2.astype(jnp.int32)), (left, u, es)

    def last(got, kept):
        (g_vals, g_idx), (left, u, es) = got, kept
        shard, _ = layout(left.size)
        full = jnp.zeros((r, shard), left.dtype).at[jnp.arange(r)[:, None], g_idx].set(g_vals)
        return full.reshape(-1)[: left.size], left, u, es

    return first, middle, last


def topk_send(acc, u, es, k, r, *, axis_name: AxisName, two_phase: bool):
    """Top-k of one tensor acc [n] over `r` replicas (1-bit Adam's top-k momentum exchange):
    (mean over replicas of what was sent, acc and u zeroed where sent, the server residual `es`
    (two_phase) or None); `_exchange` of one tensor."""
    return _exchange([(acc, u, es, 0)], lambda n: k, r, axis_name, two_phase)[0]


def topk_wire_ratio(size: int, replicas: int, ratio: float, two_phase: bool = False) -> float:
    """Bytes of an f32 ring all-reduce of a `size`-element tensor over those of top-k's exchange.

    Ring costs as `metrics.collective_bytes` charges them (all-reduce 2(R-1)/R S, all-gather and
    all-to-all (R-1)/R S); `size` counts one layer of one tensor. What the planner should use for
    top-k at R replicas (the ratio measured at R = 8 is not the one at R = 1024).
    """
    k = topk_k(ratio, size)
    dense = 2 * 4 * size  # (R-1)/R cancels
    if two_phase and 2 * replicas * two_phase_k(size, k, replicas) < size:
        return dense / (2 * replicas * two_phase_k(size, k, replicas) * 8)
    if two_phase or replicas * k >= size:
        return 1.0  # the dense reduce of the union
    return dense / (replicas * k * 8)


def topk_codec(cfg: Any) -> Codec:
    """Top-k per hop (cf. gTop-k, Shi et al. 2019): the ceil(topk_ratio * k) largest-magnitude
    values of the chunk, sent as one int32 buffer [2 kk] (the f32 values' bits, then their
    indices); the receiver scatters them into zeros (densifies) before adding its own chunk."""
    ratio = float(field(cfg, "topk_ratio"))

    def encode(x: jax.Array) -> jax.Array:
        _, idx = jax.lax.top_k(jnp.abs(x), topk_k(ratio, x.shape[0]))
        return jnp.concatenate([jax.lax.bitcast_convert_type(x[idx], jnp.int32), idx])

    def decode(payload: jax.Array, k: int) -> jax.Array:
        kk = payload.shape[0] // 2
        values = jax.lax.bitcast_convert_type(payload[:kk], jnp.float32)
        return jnp.zeros((k,), jnp.float32).at[payload[kk:]].set(values)

    return Codec(encode, decode, 1)


# --------------------------------------------------------------------------------------------------
# Spec


def topk_wire_bytes(grad_bytes: float, replicas: int, cfg: Any, shape=None) -> float:
    """`CompressorSpec.wire_bytes` of top-k (and of 1-bit Adam's top-k momentum exchange)."""
    two_phase = field(cfg, "topk_exchange") == "two_phase"
    n = int(grad_bytes // 4)
    ratio = topk_wire_ratio(n, replicas, float(field(cfg, "topk_ratio")), two_phase)
    return ring("all-reduce", grad_bytes, replicas) / ratio


def _topk_state(grad_bytes: float, replicas: int, cfg: Any) -> float:
    ef, mc = field(cfg, "error_feedback"), field(cfg, "momentum_correction")
    server = ef and field(cfg, "topk_exchange") == "two_phase"
    return grad_bytes * (bool(ef) + bool(mc)) + (grad_bytes / replicas if server else 0.0)


def _topk_from(axis_name: AxisName, cfg: Any, t: TrainFields) -> optax.GradientTransformation:
    return topk(
        axis_name, field(cfg, "topk_ratio"), error_feedback=bool(field(cfg, "error_feedback")),
        momentum_correction=bool(field(cfg, "momentum_correction")), momentum=t.momentum,
        warmup_steps=int(field(cfg, "warmup_steps")), batch_dims=t.batch_dims,
        dense_start=bool(field(cfg, "freeze_variance")),
        two_phase=field(cfg, "topk_exchange") == "two_phase",
    )  # fmt: skip


def _topk_check(cfg: Any) -> None:
    dgc_adam = field(cfg, "momentum_correction") and field(cfg, "freeze_variance")
    if not field(cfg, "momentum_masking") and not dgc_adam:
        raise ConfigError(
            "grad_sync.momentum_masking=False applies to compression='topk' with "
            "momentum_correction=True and freeze_variance=True (DGC under AdamW)"
        )


def _topk_per_hop_unsupported(cfg: Any) -> list[str]:
    dgc = [f for f in ("momentum_correction", "freeze_variance", "warmup_steps") if field(cfg, f)]
    return dgc or (["topk_exchange"] if field(cfg, "topk_exchange") != "all_gather" else [])


TOPK = CompressorSpec(
    name="topk",
    build=_topk_from,
    summary="the k largest |grad + residual| entries per tensor as (value, index) pairs (DGC)",
    wire_bytes=topk_wire_bytes,
    fields=(
        "topk_ratio",
        "error_feedback",
        "warmup_steps",
        "momentum_correction",
        "momentum_masking",
        "freeze_variance",
        "topk_exchange",
    ),  # fmt: skip
    error_feedback=True,
    residual_fields=("residual", "server"),
    momentum_corrected="DGC",
    freezes_variance=True,
    per_hop=topk_codec,
    local_adam=lambda cfg: {
        "topk_ratio": float(field(cfg, "topk_ratio")),
        "two_phase": field(cfg, "topk_exchange") == "two_phase",
        "masking": bool(field(cfg, "momentum_masking")),
    },
    per_hop_unsupported=_topk_per_hop_unsupported,
    check=_topk_check,
    state_bytes=_topk_state,
    # top_k's selection: ~log2(k) compare passes over the tensor
    extra_flops=lambda grad_bytes, replicas, cfg: (
        grad_bytes
        / 4
        * max(1.0, math.log2(max(2.0, float(field(cfg, "topk_ratio")) * grad_bytes / 4)))
    ),
    example={"topk_ratio": 0.1},
    dense_estimate=False,
)
