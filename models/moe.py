"""Mixture-of-experts SwiGLU layers (the Llama family's `model.num_experts > 0`), expert parallel.

Routing (`route`) runs on the whole, automatically sharded token array in float32: router logits
[B, T, E], softmax, top-k (`model.experts_per_token`); with k > 1 the k weights are renormalised
to sum to 1 (Mixtral), with k = 1 the raw probability is kept so the router still gets a gradient
from the loss (Switch). Two auxiliary losses, averaged over layers and added to the loss with
their config weights:

* load balancing (Switch / GShard): E · Σ_e f_e · P_e, f_e the fraction of the n·k assignments
  that go to expert e, P_e the mean router probability of e; 1 when perfectly balanced.
* router z-loss (ST-MoE): mean over tokens of logsumexp(logits)², keeping logits small.

Packed documents (`data.packing=documents`): `valid` [B, T] marks the real tokens (segment id
> 0); padding counts in no statistic (f_e, P_e, the z-loss and the dropped fraction are means over
the real tokens, `token_mean`) and takes no expert capacity (its output is 0, and unused).
Dropless, a document's outputs in a packed row are those it has alone; with a capacity factor
they are not: a token keeps its slot only if fewer than C earlier real tokens on its device
(other documents of its row, other rows) chose the same expert.

Dispatch (`experts`) runs in a `jax.shard_map` manual over the axes that split tokens (data,
fsdp, expert, context), so every device sorts only its own n tokens (inside the pipeline's
stages, already manual over them, `sharding.token_axes()`, directly; the expert load is then
averaged over those axes so each microbatch's losses cover its whole rows). The per-replica
data-parallel strategies run the loss once per replica (`sharding.per_replica_loss`): the expert
load is averaged over the replicas too (`sharding.batch_stat_axes`), so each replica's losses are
linear in its own tokens given the batch's load, and their mean, loss and gradient, is the batch's
(as the `plain` strategy's and Hugging Face's):

* dropless (`model.moe_capacity_factor=0`), experts on one device: assignments sorted by expert,
  three `jax.lax.ragged_dot` grouped matmuls over the sorted rows, unsorted back.
  Under the per-replica vmap of the explicit data-parallel strategies (compressors, local SGD,
  `grad_sync.algorithm`) it runs the padded path below with C = n, which drops nothing either.
* capacity (factor > 0): each expert takes at most C = ceil(factor · n · k / E) assignments from
  each device's n tokens, in token order; the rest are dropped (their output is 0, the residual
  carries the token). Buffers [E, C, D].
* expert parallel (`mesh.expert` = ep > 1): each device holds E/ep experts; the [E, C, D] buffer
  goes out with one `all_to_all` over `expert` and the results come back with a second. Dropless
  runs this padded path with C = n (no expert can take more than n assignments from n tokens:
  the top-k experts of a token are distinct), so nothing is ever dropped; `ragged_all_to_all`
  would send only the used rows.

Shapes: B batch, T length, D d_model, E experts, F expert width, n tokens on one device, k top-k,
C capacity, ep = mesh.expert.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxdist import sharding

AXIS = "expert"
TOKEN_AXES = ("data", "fsdp", "expert")  # the mesh axes of logical `batch` (jaxdist/sharding.py)
# Logical axes of one layer's MoE parameters (without the leading `layers` axis).
AXES = {
    "router": ("embed", None),  # [D, E]
    "e_gate": ("experts", "embed", "mlp"),  # [E, D, F]
    "e_up": ("experts", "embed", "mlp"),  # [E, D, F]
    "e_down": ("experts", "mlp", "embed"),  # [E, F, D]
}


def token_count(valid: jax.Array | None, like: jax.Array) -> jax.Array:
    """The number of real tokens (`valid` [B, T], None: all of `like` [B, T, ...]'s), float32.
    In the pipeline's stages and the per-replica losses (`sharding.batch_stat_axes()`) it is
    their mean over the token shards or replicas, so that a statistic divided by it averages over
    them to the batch's (`token_mean`); 0 is returned as 1 (nothing to average: the sums are 0)."""
    if valid is None:
        return jnp.asarray(like.shape[0] * like.shape[1], jnp.float32)
    count = jnp.sum(valid.astype(jnp.float32))
    if sharding.batch_stat_axes():
        count = jax.lax.pmean(count, sharding.batch_stat_axes())
    return jnp.where(count > 0, count, 1.0)


def token_mean(x: jax.Array, valid: jax.Array | None) -> jax.Array:
    """Mean of x [B, T, ...] over its real tokens (`valid` [B, T] bool; None: all) → [...]. In
    the pipeline's stages each device's share (`token_count`): its mean over the token shards is
    the microbatch's mean over its real tokens."""
    if valid is None:
        return jnp.mean(x, axis=(0, 1))
    v = valid.astype(x.dtype).reshape(valid.shape + (1,) * (x.ndim - 2))
    return jnp.sum(x * v, axis=(0, 1)) / token_count(valid, x)


def route(
    h: jax.Array, router: jax.Array, k: int, valid: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, dict]:
    """Top-k routing of h [B, T, D]: (weights [B, T, k] float32, experts [B, T, k] int32, stats).

    stats: `moe_lb_loss`, `moe_z_loss` (scalars) and `moe_load` [E], the fraction of the
    assignments each expert got; `valid` [B, T] (packed rows: segment id > 0): the tokens they
    are taken over (None: all)."""
    logits = jnp.einsum("btd,de->bte", h.astype(jnp.float32), router.astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    w, idx = top_k(probs, k)
    if k > 1:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    E = router.shape[-1]
    assigned = jax.nn.one_hot(idx, E, dtype=jnp.float32)  # [B, T, k, E]
    if valid is None:
        load = jnp.mean(assigned, axis=(0, 1, 2))  # [E], sums to 1
    else:
        load = token_mean(jnp.mean(assigned, axis=2), valid)
    if sharding.batch_stat_axes():  # pipeline stages, per-replica losses: the whole batch's load
        load = jax.lax.pmean(load, sharding.batch_stat_axes())
    stats = {  # each linear in this device's tokens: their mean over token shards is the batch's
        "moe_lb_loss": E * jnp.sum(jax.lax.stop_gradient(load) * token_mean(probs, valid)),
        "moe_z_loss": token_mean(jax.nn.logsumexp(logits, axis=-1) ** 2, valid),
        "moe_load": jax.lax.stop_gradient(load),
    }
    return w, idx, stats


def top_k(p: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k` over the last axis of p >= 0, as k argmaxes: the same values and indices
    (ties to the lower index), but reductions that XLA's SPMD partitioner keeps split along the
    token axes, where it all-gathers `top_k`'s operand (the router probabilities [B, T, E] of the
    whole batch on every device under data parallelism, seen in the compiled step)."""
    idx, left = [], p
    for _ in range(k):
        i = jnp.argmax(left, axis=-1)
        idx.append(i)
        left = jnp.where(jax.nn.one_hot(i, p.shape[-1], dtype=bool), -1.0, left)
    idx = jnp.stack(idx, axis=-1).astype(jnp.int32)
    return jnp.take_along_axis(p, idx, axis=-1), idx


def capacity(n: int, k: int, num_experts: int, factor: float) -> int:
    """Slots per expert for n tokens on one device; factor 0 (dropless) → n, which never drops."""
    if factor <= 0:
        return n
    return max(1, min(n, math.ceil(factor * n * k / num_experts)))


def _swiglu(x, wg, wu, wd):
    """Expert SwiGLU on buffers x [..., E, C, D] with weights [E, D, F], [E, D, F], [E, F, D]."""
    g = jnp.einsum("...ecd,edf->...ecf", x, wg)
    u = jnp.einsum("...ecd,edf->...ecf", x, wu)
    return jnp.einsum("...ecf,efd->...ecd", jax.nn.silu(g) * u, wd)


def _dropless_local(x, flat, wg, wu, wd, k):
    """All experts here: assignments sorted by expert, grouped matmuls. x [n, D] → [n·k, D]."""
    E = wg.shape[0]
    order = jnp.argsort(flat, stable=True)
    xs = x[order // k]  # [n·k, D], rows grouped by expert
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    g = jax.lax.ragged_dot(xs, wg, sizes)
    u = jax.lax.ragged_dot(xs, wu, sizes)
    out = jax.lax.ragged_dot(jax.nn.silu(g) * u, wd, sizes)
    return out[jnp.argsort(order)], jnp.zeros((), jnp.int32)


def _padded(x, flat, wg, wu, wd, k, C, ep, valid=None):
    """Capacity buffers [E, C, D], all_to_all over `expert` when ep > 1. x [n, D] → [n·k, D].
    `valid` [n]: the real tokens; the others take no slot (their output is 0) and are not
    counted as dropped."""
    E = wg.shape[0] * ep
    oh = jax.nn.one_hot(flat, E, dtype=jnp.int32)  # [n·k, E]
    if valid is not None:
        real = jnp.repeat(valid, k)  # [n·k]: assignment a is token a // k's
        oh = oh * real[:, None].astype(oh.dtype)
    pos = jnp.sum((jnp.cumsum(oh, axis=0) - 1) * oh, axis=-1)  # rank within its expert
    keep = pos < C if valid is None else (pos < C) & real
    slot = jnp.where(keep, pos, C)  # C: out of range, dropped by the scatter and the gather
    buf = (
        jnp.zeros((E, C, x.shape[-1]), x.dtype)
        .at[flat, slot]
        .add(x[jnp.arange(flat.size) // k], mode="drop")
    )
    if ep > 1:
        # [ep, E/ep, C, D]: block j goes to device j; what arrives is [source, E/ep, C, D].
        buf = jax.lax.all_to_all(buf.reshape(ep, E // ep, *buf.shape[1:]), AXIS, 0, 0)
        out = jax.lax.all_to_all(_swiglu(buf, wg, wu, wd), AXIS, 0, 0).reshape(E, C, -1)
    else:
        out = _swiglu(buf, wg, wu, wd)
    y = out.at[flat, slot].get(mode="fill", fill_value=0)
    lost = ~keep if valid is None else ~keep & real
    return y, jnp.sum(lost).astype(jnp.int32)


def _local_experts(
    x,
    w,
    idx,
    wg,
    wu,
    wd,
    *,
    ep: int,
    factor: float,
    axes: tuple[str, ...],
    grouped: bool = True,
    valid=None,
):
    """One device's tokens x [b, t, D] through its experts; (out [b, t, D], dropped count).
    `grouped=False`: dropless runs the padded path with C = n (under a vmap: jax 0.10 has no
    batching rule for `ragged_dot` over a non-leading axis). `valid` [b, t]: the real tokens
    (`_padded`); dropless computes padding too (it takes nothing from a real token)."""
    b, t, D = x.shape
    k = idx.shape[-1]
    xf, flat = x.reshape(b * t, D), idx.reshape(-1)
    E = wg.shape[0] * ep
    if factor <= 0 and ep == 1 and grouped:
        y, dropped = _dropless_local(xf, flat, wg, wu, wd, k)
    else:
        C = capacity(b * t, k, E, factor)
        real = None if valid is None else valid.reshape(b * t)
        y, dropped = _padded(xf, flat, wg, wu, wd, k, C, ep, real)
    y = jnp.sum(y.reshape(b * t, k, D) * w.reshape(b * t, k, 1).astype(y.dtype), axis=1)
    if axes:
        dropped = jax.lax.psum(dropped, axes)
    return y.reshape(b, t, D), dropped


def experts(
    x, w, idx, wg, wu, wd, *, factor: float, valid: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """The experts' weighted output for x [B, T, D] routed by (w, idx) [B, T, k]: ([B, T, D],
    the number of dropped assignments, int32). Runs per device over the token-splitting axes.
    `valid` [B, T] bool (packed rows: segment id > 0): only these tokens take capacity."""
    one = dict(factor=factor, valid=valid)
    if sharding.active_mesh() is None:
        return _local_experts(x, w, idx, wg, wu, wd, ep=1, axes=(), **one)
    if sharding.token_axes():  # the pipeline's stages, manual over every axis splitting tokens
        ep = sharding.axis_size(AXIS)  # the weights are this device's E/ep experts
        return _local_experts(x, w, idx, wg, wu, wd, ep=ep, axes=(), **one)
    # Inside per-replica gradients (compressors, local SGD) the replica axes are already split.
    mesh, axes, mapped = sharding.nested_mesh((*TOKEN_AXES, "context"))
    if not axes and not mapped:  # nested, and nothing else splits the tokens
        return _local_experts(x, w, idx, wg, wu, wd, ep=1, axes=(), **one)
    ep = int(mesh.shape.get(AXIS, 1))
    tok = P(tuple(a for a in TOKEN_AXES if a in axes), "context" if "context" in axes else None)
    wspec = P(AXIS if ep > 1 else None)
    dt = wg.dtype

    def local(x, w, idx, *ws_valid):
        ws, real = ws_valid[:3], (ws_valid[3] if len(ws_valid) > 3 else None)
        # The weights come in as float32 and are cast here, after they are marked varying over
        # the token axes: the transpose of that mark, the gradient's sum over those axes, then
        # runs in float32 as every other parameter's gradient reduction does. In the compute
        # dtype (bf16) XLA's CPU backend aborts compiling it ("Invalid binary instruction opcode
        # copy": its all-reduce promotion meets the sum's copy root), on any multi-device mesh.
        if not mapped:  # (over `expert` they vary already when they are split over it)
            over = tuple(a for a in axes if not (a == AXIS and ep > 1))
            ws = [jax.lax.pcast(v, over, to="varying") for v in ws]
        ws = [v.astype(dt) for v in ws]
        return _local_experts(
            x, w, idx, *ws, ep=ep, factor=factor, axes=axes, grouped=not mapped, valid=real
        )

    extra = () if valid is None else (valid,)
    fn = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(tok, tok, tok, wspec, wspec, wspec) + (tok,) * len(extra),
        out_specs=(tok, P()),
        axis_names={*axes, *mapped},
        check_vma=not mapped,  # vmap's batched values vary over `mapped`, unbatched ones not
    )
    return fn(x, w, idx, *(v.astype(jnp.float32) for v in (wg, wu, wd)), *extra)
