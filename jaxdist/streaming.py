"""Streaming DiLoCo (Douillard et al., 2025): DiLoCo whose outer sync is cut into fragments.

Plain DiLoCo (`collectives.local_sgd` with the Nesterov outer optimizer) all-reduces every
parameter once per H inner steps: the network idles for H - 1 steps, then carries the whole model
at once. Streaming DiLoCo splits the parameters into F fragments and syncs fragment f after the
inner steps c with (c - offset_f) % H == 0, offset_f = f * H // F: every fragment is still synced
once per H steps, but no step sends more than one fragment (about 1/F of the model). Three knobs:

  grad_sync.fragments           F; the units are one layer of a stacked `[L, ...]` parameter and
                                every other parameter whole, packed into F fragments of about
                                equal size (largest first, each into the lightest fragment).
  grad_sync.outer_overlap       tau: a fragment's averaged outer gradient is applied tau inner
                                steps after it was sent, so its all-reduce may take that long;
                                on arrival the replica's fragment becomes outer_mix * its own +
                                (1 - outer_mix) * the new global fragment.
  grad_sync.outer_quantization  "int8" / "int4": the outer gradients (anchor - replica) cross the
                                network as int8 (`compression.int8`) or 4-bit levels -7..7, with
                                an f32 scale per 256 values, in a reduce-scatter then all-gather,
                                instead of an f32 all-reduce.

F = 1, tau = 0 and no quantization is plain DiLoCo, bit for bit (tests/test_streaming_diloco.py).
The replicas run vmapped as in `collectives.local_sgd(per_replica="vmap")`; each fragment's sync
is its own `lax.cond`, so the compiled program's costliest branch of any one of them is the most
a step sends (`peak_sync_bytes`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxdist import collectives, compression, hlo_cost
from jaxdist.compression import replica
from jaxdist.errors import ConfigError

ALL = "all"  # a fragment holds the whole parameter
PENDING = "outer_pending"  # the train state entry of the outer gradients in flight
QUANTIZATIONS = ("none", "int8", "int4")
Sel = Any  # None (not in the fragment), ALL, or a tuple of layer indices


def active(g) -> bool:
    """Whether `grad_sync` asks for streaming DiLoCo rather than plain local SGD / DiLoCo."""
    return g.fragments != 1 or g.outer_overlap != 0 or g.outer_quantization != "none"


def check(g, mesh_shape) -> None:
    """Streaming DiLoCo's field rules; one-line ConfigErrors before compiling."""
    h = g.local_steps
    if not active(g):
        return
    if h <= 1:
        raise ConfigError(
            "grad_sync.fragments / outer_overlap / outer_quantization stream DiLoCo's outer sync: "
            f"they need grad_sync.local_steps > 1, got {h}"
        )
    if not 1 <= g.fragments <= h:
        raise ConfigError(
            f"grad_sync.fragments={g.fragments} must be in [1, local_steps={h}] (each fragment "
            "gets its own step of the H-step cycle)"
        )
    if not 0 <= g.outer_overlap < h:
        raise ConfigError(
            f"grad_sync.outer_overlap={g.outer_overlap} must be in [0, local_steps={h}): a "
            "fragment's result must land before its next sync"
        )
    if g.outer_quantization not in QUANTIZATIONS:
        raise ConfigError(
            f"grad_sync.outer_quantization={g.outer_quantization!r} is not valid; choose one of "
            + ", ".join(QUANTIZATIONS)
        )
    if not 0 <= g.outer_mix <= 1:
        raise ConfigError(f"grad_sync.outer_mix={g.outer_mix} must be in [0, 1]")
    if mesh_shape["pipeline"] > 1:
        raise ConfigError(
            f"grad_sync.fragments={g.fragments} (streaming DiLoCo) runs the replicas vmapped: it "
            f"needs mesh.pipeline=1, got {mesh_shape['pipeline']}"
        )


@dataclasses.dataclass(frozen=True)
class Fragments:
    """Which part of each parameter leaf (in `jax.tree.leaves` order) each fragment holds."""

    sel: tuple[tuple[Sel, ...], ...]  # [F][leaf]
    layers: tuple[int, ...]  # per leaf: L of a stacked [L, ...] parameter split by layer, else 0
    sizes: tuple[int, ...]  # elements per fragment

    def mask(self, f: int, leaf: int, ndim: int) -> Any:
        """True where fragment f owns the leaf: a bool, or [L, 1, ...] over its layers."""
        s = self.sel[f][leaf]
        if s is None or s == ALL:
            return s == ALL
        m = np.zeros((self.layers[leaf],) + (1,) * (ndim - 1), bool)
        m[list(s)] = True
        return m


def partition(abstract_params: Any, param_axes: Any, num_fragments: int) -> Fragments:
    """Pack the layers of stacked parameters and every other parameter into F fragments.

    Raises:
      ConfigError: fewer units (layers + unstacked parameters) than fragments.
    """
    leaves = jax.tree.leaves(abstract_params)
    axes = jax.tree.structure(abstract_params).flatten_up_to(param_axes)
    layers = tuple(
        p.shape[0] if ax and ax[0] == "layers" and p.shape[0] > 1 else 0
        for p, ax in zip(leaves, axes, strict=True)
    )
    units = []  # (elements, leaf, layer or None)
    for i, (p, n) in enumerate(zip(leaves, layers, strict=True)):
        size = int(np.prod(p.shape))
        units += [(size // n, i, k) for k in range(n)] if n else [(size, i, None)]
    if len(units) < num_fragments:
        raise ConfigError(
            f"grad_sync.fragments={num_fragments} exceeds the model's {len(units)} units "
            "(layers + unstacked parameters)"
        )
    load = [0] * num_fragments
    owned: list[dict[int, list]] = [{} for _ in range(num_fragments)]
    for size, i, k in sorted(units, key=lambda u: (-u[0], u[1], u[2] or 0)):
        f = int(np.argmin(load))  # largest first, into the lightest fragment
        load[f] += size
        owned[f].setdefault(i, []).append(k)

    def sel(f: int, i: int) -> Sel:
        if i not in owned[f]:
            return None
        ks = owned[f][i]
        return ALL if ks == [None] or len(ks) == layers[i] else tuple(sorted(ks))

    sels = tuple(tuple(sel(f, i) for i in range(len(leaves))) for f in range(num_fragments))
    return Fragments(sels, layers, tuple(load))


def _take(x: jax.Array, s: Sel, axis: int) -> jax.Array:
    return x if s == ALL else jnp.take(x, np.asarray(s), axis=axis)


def _put(full: jax.Array, part: jax.Array, s: Sel) -> jax.Array:
    return part if s == ALL else full.at[np.asarray(s)].set(part)


def _where(mask: Any, new: jax.Array, old: jax.Array) -> jax.Array:
    if isinstance(mask, bool | np.bool_):
        return new if mask else old
    return jnp.where(mask, new, old)


INT4_BLOCK = 256  # values per f32 scale of the 4-bit outer gradients


def _int4_encode(x: jax.Array) -> jax.Array:
    """f32 [B, 256] -> uint8 [B, 132]: absmax 4-bit levels -7..7, two per byte, then the block's
    f32 scale as 4 bytes (one buffer: one collective per phase)."""
    scale = jnp.max(jnp.abs(x), axis=-1) / 7.0
    q = jnp.round(x / jnp.where(scale > 0, scale, 1.0)[:, None])
    q = jnp.clip(q, -7, 7).astype(jnp.int32) + 8  # 1..15
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(jnp.uint8)  # [B, 128]
    return jnp.concatenate([packed, jax.lax.bitcast_convert_type(scale, jnp.uint8)], axis=1)


def _int4_decode(payload: jax.Array) -> jax.Array:
    half = INT4_BLOCK // 2
    scale = jax.lax.bitcast_convert_type(payload[:, half:], jnp.float32)  # [B]
    nibbles = payload[:, :half].astype(jnp.int32)
    q = jnp.stack([(nibbles & 15) - 8, (nibbles >> 4) - 8], axis=-1).reshape(-1, INT4_BLOCK)
    return q.astype(jnp.float32) * scale[:, None]


def _int4(axes: tuple[str, ...]) -> optax.GradientTransformation:
    """The mean over `axes` of a tree, 4-bit on the wire in both phases of a reduce-scatter
    (all-to-all) then all-gather, as `compression.int8` runs int8; the state passes through."""

    def one(x):  # per leaf: leaves differ in which manual axes they vary over
        r = replica.num_replicas(axes)
        per = -(-x.size // (r * INT4_BLOCK)) * INT4_BLOCK  # elements each replica reduces
        flat = x.reshape(-1).astype(jnp.float32)
        rows = jnp.pad(flat, (0, r * per - x.size)).reshape(r, -1, INT4_BLOCK)
        mine = replica.all_to_all(jax.vmap(_int4_encode)(rows), axes)  # [R, per/256, 132]
        mean = jnp.mean(jax.vmap(_int4_decode)(mine), axis=0)  # my shard, [per/256, 256]
        full = jax.vmap(_int4_decode)(replica.gather(_int4_encode(mean), axes))
        return full.reshape(-1)[: x.size].reshape(x.shape).astype(x.dtype)

    def update(tree, state, params=None):
        del params
        return jax.tree.map(one, tree), state

    return optax.GradientTransformation(lambda params: None, update)


def _quantized_mean(
    frags: Fragments, f: int, mesh: Mesh, axes: tuple[str, ...], specs: list, kind: str
):
    """[outer gradients [R, ...] of fragment f's parts] -> their means, int8 or int4 on the wire:
    a reduce-scatter (all-to-all) and an all-gather, on each device's own shard (as the
    compressors run in the `compressed` strategy)."""
    idx = [i for i, s in enumerate(frags.sel[f]) if s is not None]
    if kind == "int8":
        tx = compression.int8(axes, batch_dims=[int(frags.layers[i] > 0) for i in idx])
    else:
        tx = _int4(axes)
    shard_axes = tuple(a for a in ("fsdp", "tensor") if mesh.shape[a] > 1)
    lead = P(axes[0] if len(axes) == 1 else axes)
    reduce = collectives.sharded_reduce(
        tx, mesh, axes, shard_axes, [specs[i] for i in idx], compression.Int8State(lead)
    )
    r = int(np.prod([mesh.shape[a] for a in axes]))

    def mean(parts: list) -> list:
        key = jnp.zeros((r, 2), jnp.uint32)  # round-to-nearest: the key is not used
        return reduce(parts, compression.Int8State(key))[0]

    return mean


@dataclasses.dataclass(frozen=True)
class _Outer:
    """Fragment-wise outer steps: what one fragment's sync reads, sends and writes."""

    frags: Fragments
    treedef: Any  # of the parameters
    outer: optax.GradientTransformation
    tau: int  # outer_overlap
    mix: float  # outer_mix
    int8_means: list  # per fragment: the int8 mean of its outer gradients, or None (f32)

    def parts(self, f: int, tree: Any, axis: int) -> list:
        """Fragment f's parts of a params tree (axis 0) or of the replicas' [R, ...] (axis 1)."""
        leaves = self.treedef.flatten_up_to(tree)
        return [_take(x, s, axis) for x, s in zip(leaves, self.frags.sel[f]) if s is not None]

    def delta(self, f: int, anchor: Any, local: Any) -> list:
        """Fragment f's averaged outer gradient anchor - mean(local): its parts only."""
        a, x = self.parts(f, anchor, 0), self.parts(f, local, 1)
        if self.int8_means[f] is not None:
            return self.int8_means[f]([ai[None] - xi for ai, xi in zip(a, x, strict=True)])
        return [ai - jnp.mean(xi, axis=0) for ai, xi in zip(a, x, strict=True)]  # all-reduce

    def written(self, f: int, full: Any, new_parts: list) -> Any:
        """`full` (a params tree) with fragment f's parts replaced by `new_parts`."""
        it = iter(new_parts)
        leaves = self.treedef.flatten_up_to(full)
        return self.treedef.unflatten(
            [x if s is None else _put(x, next(it), s) for x, s in zip(leaves, self.frags.sel[f])]
        )

    def apply(self, f: int, anchor, outer_state, local, delta_parts):
        """The outer step on fragment f (the rest of anchor and outer state kept); the replicas'
        copies of the fragment restart from it (tau = 0) or mix with it."""
        flat = self.treedef.flatten_up_to
        delta = self.written(f, jax.tree.map(jnp.zeros_like, anchor), delta_parts)
        upd, new_state = self.outer.update(delta, outer_state, anchor)
        new = optax.apply_updates(anchor, upd)
        masks = [self.frags.mask(f, i, x.ndim) for i, x in enumerate(flat(anchor))]
        anchor = self.treedef.unflatten(list(map(_where, masks, flat(new), flat(anchor))))
        mask_state = optax.tree_map_params(
            self.outer,
            lambda _, m: m,
            new_state,
            self.treedef.unflatten(masks),
            transform_non_params=lambda _: True,
        )
        outer_state = jax.tree.map(_where, mask_state, new_state, outer_state)

        def merged(m, a, x):
            a = jnp.broadcast_to(a, x.shape)
            arrived = a if self.tau == 0 else self.mix * x + (1 - self.mix) * a
            return _where(m if isinstance(m, bool) else m[None], arrived, x)

        local = self.treedef.unflatten(list(map(merged, masks, flat(anchor), flat(local))))
        return anchor, outer_state, local


def local_sgd(
    grad_fn: collectives.GradFn,
    inner_tx: optax.GradientTransformation,
    outer: optax.GradientTransformation,
    mesh: Mesh,
    axes: tuple[str, ...],
    g: Any,
    frags: Fragments,
    abstract_params: Any,
    param_specs: Any,
) -> collectives.LocalSGD:
    """Streaming DiLoCo as a `collectives.LocalSGD` (init, step); `g` is the grad_sync config.

    State: `collectives.LocalSGDState`, with `pending` when outer_overlap > 0: a params-shaped tree
    holding each fragment's averaged outer gradient from its send until it is applied.
    """
    h, tau, num = g.local_steps, g.outer_overlap, len(frags.sizes)
    offsets = [(f * h) // num for f in range(num)]
    treedef = jax.tree.structure(abstract_params)
    specs = treedef.flatten_up_to(param_specs)
    kind = g.outer_quantization
    means = [
        None if kind == "none" else _quantized_mean(frags, f, mesh, axes, specs, kind)
        for f in range(num)
    ]
    ops = _Outer(frags, treedef, outer, tau, g.outer_mix, means)
    replica_steps = collectives.vmap_inner_steps(grad_fn, inner_tx, mesh, axes)
    base_init = collectives.vmap_init(inner_tx, outer, mesh, axes)

    def init(params):
        pending = jax.tree.map(jnp.zeros_like, params) if tau > 0 else None
        return base_init(params)._replace(pending=pending)

    def sync_now(f):  # outer_overlap = 0: send and apply in the same step (DiLoCo)
        return lambda a, s, x: ops.apply(f, a, s, x, ops.delta(f, a, x))

    def send(f):
        return lambda a, x, pending: ops.written(f, pending, ops.delta(f, a, x))

    def arrive(f):
        return lambda a, s, x, pending: ops.apply(f, a, s, x, ops.parts(f, pending, 0))

    def step(state, batch):
        local, inner, losses, norms = replica_steps(state.local_params, state.inner_state, batch)
        anchor, outer_state, pending = state.params, state.outer_state, state.pending
        c = state.step + 1  # inner steps taken
        for f, off in enumerate(offsets):  # each fragment's sync is its own conditional
            due = (c - off) % h == 0
            if tau == 0:
                anchor, outer_state, local = jax.lax.cond(
                    due, sync_now(f), collectives.keep, anchor, outer_state, local
                )
            else:
                pending = jax.lax.cond(due, send(f), lambda a, x, p: p, anchor, local, pending)
        for f, off in enumerate(offsets if tau > 0 else []):
            due = ((c - tau - off) % h == 0) & (c - tau >= 1)
            anchor, outer_state, local = jax.lax.cond(
                due, arrive(f), lambda a, s, x, p: (a, s, x), anchor, outer_state, local, pending
            )
        metrics = {"loss": jnp.mean(losses), "grad_norm": jnp.mean(norms)}
        return collectives.LocalSGDState(c, anchor, outer_state, local, inner, pending), metrics

    return collectives.LocalSGD(init, step)


def peak_sync_bytes(hlo_text: str) -> float:
    """Bytes one device sends in the costliest single sync of a compiled local SGD step.

    Every fragment's sync (or plain DiLoCo's one) is its own `conditional`, and no two fire on the
    same step (offsets f * H // F are distinct for F <= H), so this is the most any one step sends
    for the parameter average: the costliest branch of any one conditional, ring-costed as
    `hlo_cost.collective_ops` costs every op.
    """
    branches = hlo_cost.conditional_ops(hlo_text)
    return max((sum(op.wire_bytes for op in ops) for ops in branches), default=0.0)
