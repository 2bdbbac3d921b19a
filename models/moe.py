"""Mixture-of-experts SwiGLU layers (the Llama family's `model.num_experts > 0`), expert parallel.

Routing (`route`) runs on the whole, automatically sharded token array in float32: router logits
[B, T, E], softmax, top-k (`model.experts_per_token`); with k > 1 the k weights are renormalised
to sum to 1 (Mixtral), with k = 1 the raw probability is kept so the router still gets a gradient
from the loss (Switch). Two auxiliary losses, averaged over layers and added to the loss with
their config weights:

* load balancing (Switch / GShard): E · Σ_e f_e · P_e, f_e the fraction of the n·k assignments
  that go to expert e, P_e the mean router probability of e; 1 when perfectly balanced.
* router z-loss (ST-MoE): mean over tokens of logsumexp(logits)², keeping logits small.

Dispatch (`experts`) runs in a `jax.shard_map` manual over the axes that split tokens (data,
fsdp, expert, context), so every device sorts only its own n tokens (inside the pipeline's
stages, already manual over them, `sharding.token_axes()`, directly; the expert load is then
averaged over those axes so each microbatch's losses cover its whole rows):

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


def route(h: jax.Array, router: jax.Array, k: int) -> tuple[jax.Array, jax.Array, dict]:
    """Top-k routing of h [B, T, D]: (weights [B, T, k] float32, experts [B, T, k] int32, stats).

    stats: `moe_lb_loss`, `moe_z_loss` (scalars) and `moe_load` [E], the fraction of the
    assignments each expert got."""
    logits = jnp.einsum("btd,de->bte", h.astype(jnp.float32), router.astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    w, idx = top_k(probs, k)
    if k > 1:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    E = router.shape[-1]
    load = jnp.mean(jax.nn.one_hot(idx, E, dtype=jnp.float32), axis=(0, 1, 2))  # [E], sums to 1
    if sharding.token_axes():  # the pipeline's stages: the load of the whole microbatch
        load = jax.lax.pmean(load, sharding.token_axes())
    stats = {  # each linear in this device's tokens: their mean over token shards is the batch's
        "moe_lb_loss": E * jnp.sum(jax.lax.stop_gradient(load) * jnp.mean(probs, axis=(0, 1))),
        "moe_z_loss": jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2),
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


def _padded(x, flat, wg, wu, wd, k, C, ep):
    """Capacity buffers [E, C, D], all_to_all over `expert` when ep > 1. x [n, D] → [n·k, D]."""
    E = wg.shape[0] * ep
    oh = jax.nn.one_hot(flat, E, dtype=jnp.int32)  # [n·k, E]
    pos = jnp.sum((jnp.cumsum(oh, axis=0) - 1) * oh, axis=-1)  # rank within its expert
    keep = pos < C
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
    return y, jnp.sum(~keep).astype(jnp.int32)


def _local_experts(
    x, w, idx, wg, wu, wd, *, ep: int, factor: float, axes: tuple[str, ...], grouped: bool = True
):
    """One device's tokens x [b, t, D] through its experts; (out [b, t, D], dropped count).
    `grouped=False`: dropless runs the padded path with C = n (under a vmap: jax 0.10 has no
    batching rule for `ragged_dot` over a non-leading axis)."""
    b, t, D = x.shape
    k = idx.shape[-1]
    xf, flat = x.reshape(b * t, D), idx.reshape(-1)
    E = wg.shape[0] * ep
    if factor <= 0 and ep == 1 and grouped:
        y, dropped = _dropless_local(xf, flat, wg, wu, wd, k)
    else:
        y, dropped = _padded(xf, flat, wg, wu, wd, k, capacity(b * t, k, E, factor), ep)
    y = jnp.sum(y.reshape(b * t, k, D) * w.reshape(b * t, k, 1).astype(y.dtype), axis=1)
    if axes:
        dropped = jax.lax.psum(dropped, axes)
    return y.reshape(b, t, D), dropped


def experts(x, w, idx, wg, wu, wd, *, factor: float) -> tuple[jax.Array, jax.Array]:
    """The experts' weighted output for x [B, T, D] routed by (w, idx) [B, T, k]: ([B, T, D],
    the number of dropped assignments, int32). Runs per device over the token-splitting axes."""
    if sharding.active_mesh() is None:
        return _local_experts(x, w, idx, wg, wu, wd, ep=1, factor=factor, axes=())
    if sharding.token_axes():  # the pipeline's stages, manual over every axis splitting tokens
        ep = sharding.axis_size(AXIS)  # the weights are this device's E/ep experts
        return _local_experts(x, w, idx, wg, wu, wd, ep=ep, factor=factor, axes=())
    # Inside per-replica gradients (compressors, local SGD) the replica axes are already split.
    mesh, axes, mapped = sharding.nested_mesh((*TOKEN_AXES, "context"))
    if not axes and not mapped:  # nested, and nothing else splits the tokens
        return _local_experts(x, w, idx, wg, wu, wd, ep=1, factor=factor, axes=())
    ep = int(mesh.shape.get(AXIS, 1))
    tok = P(tuple(a for a in TOKEN_AXES if a in axes), "context" if "context" in axes else None)
    wspec = P(AXIS if ep > 1 else None)
    dt = wg.dtype

    def local(x, w, idx, *ws):
        # The weights come in as float32 and are cast here, after they are marked varying over
        # the token axes: the transpose of that mark, the gradient's sum over those axes, then
        # runs in float32 as every other parameter's gradient reduction does. In the compute
        # dtype (bf16) XLA's CPU backend aborts compiling it ("Invalid binary instruction opcode
        # copy": its all-reduce promotion meets the sum's copy root), on any multi-device mesh.
        if not mapped:  # (over `expert` they vary already when they are split over it)
            over = tuple(a for a in axes if not (a == AXIS and ep > 1))
            ws = [jax.lax.pcast(v, over, to="varying") for v in ws]
        ws = [v.astype(dt) for v in ws]
        return _local_experts(x, w, idx, *ws, ep=ep, factor=factor, axes=axes, grouped=not mapped)

    fn = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(tok, tok, tok, wspec, wspec, wspec),
        out_specs=(tok, P()),
        axis_names={*axes, *mapped},
        check_vma=not mapped,  # vmap's batched values vary over `mapped`, unbatched ones not
    )
    return fn(x, w, idx, *(v.astype(jnp.float32) for v in (wg, wu, wd)))
