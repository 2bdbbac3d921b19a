"""Logical axis names → mesh axes (Mesh-TensorFlow style).

Model code names dimensions only logically (`"embed"`, `"mlp"`, `"heads"`, ...). The tables below are
the single place that decides where each lands on the mesh. Two tables, as in Levanter:

* `STORAGE_RULES` say how parameters and optimizer state are *stored*: `embed` is split over `fsdp`,
  so each device holds 1/fsdp of every weight (ZeRO-3 / FSDP).
* `COMPUTE_RULES` say how they are *used*: `embed` is whole, so each layer's weights are all-gathered
  over `fsdp` right before its matmul (and the gradient reduce-scattered back), while `heads` and
  `mlp` stay split over `tensor` (Megatron: column-parallel QKV / up-projection, row-parallel output /
  down-projection, one all-reduce after each).

Resolution is ordered with first-free-mesh-axis semantics (as Flax Linen, unlike NNX's last-rule-wins):
for each dimension in order, the first rule for its name whose mesh axes are still unused in this
array wins; used axes are skipped, so one mesh axis never shards two dimensions of one array.

| logical | storage            | compute            | why                                          |
|---------|--------------------|--------------------|----------------------------------------------|
| batch   | (data, fsdp, expert) | (data, fsdp, expert) | replicas, FSDP and expert shards take examples |
| vocab   | tensor             | tensor             | embedding / head split by vocabulary         |
| heads   | tensor             | tensor             | attention heads split (Megatron)             |
| mlp     | tensor             | tensor             | MLP hidden units split (Megatron)            |
| embed   | fsdp               | —                  | ZeRO-3 storage; gathered for compute         |
| layers  | pipeline           | pipeline           | stacked layers split into pipeline stages    |
| stage   | pipeline           | pipeline           | pipeline activations buffer                  |
| length  | context            | context            | sequence (context) parallelism               |
| experts | expert             | expert             | MoE experts split (expert parallelism)       |
| kv, conv | —                 | —                  | never split                                  |
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist.errors import ConfigError

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]
LogicalAxes = tuple[str | None, ...]

STORAGE_RULES: Rules = (
    ("batch", ("data", "fsdp", "expert")),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("embed", "fsdp"),
    ("layers", "pipeline"),
    ("stage", "pipeline"),
    ("experts", "expert"),
    ("length", "context"),
    ("kv", None),
)

COMPUTE_RULES: Rules = tuple(
    (name, None if name == "embed" else axes) for name, axes in STORAGE_RULES
)


def logical_to_spec(
    names: Sequence[str | None],
    rules: Rules,
    mesh: Mesh,
    shape: Sequence[int] | None = None,
) -> PartitionSpec:
    """Resolves logical dimension names to a PartitionSpec, first free mesh axis wins.

    Mesh axes of size 1 are left out (they shard nothing). When `shape` is given, a dimension whose
    size the chosen mesh axes do not divide raises ConfigError naming it.
    """
    used: set[str] = set()
    spec: list[Any] = []
    for dim, name in enumerate(names):
        chosen: tuple[str, ...] = ()
        if name is not None:
            for rule_name, axes in rules:
                if rule_name != name or axes is None:
                    continue
                cand = (axes,) if isinstance(axes, str) else tuple(axes)
                free = tuple(a for a in cand if a not in used and mesh.shape.get(a, 1) > 1)
                if free:
                    chosen = free
                    break
        used.update(chosen)
        if shape is not None and chosen:
            n = int(np.prod([mesh.shape[a] for a in chosen]))
            if shape[dim] % n:
                raise ConfigError(
                    f"dimension {name!r} of size {shape[dim]} is not divisible by mesh axes "
                    f"{'×'.join(chosen)} = {n}; resize the model or the mesh"
                )
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
    check_no_collision(spec)
    return PartitionSpec(*spec)


def check_no_collision(spec: Sequence[Any]) -> None:
    """Raises if one mesh axis shards two dimensions of one array."""
    seen: list[str] = []
    for entry in spec:
        for axis in (entry,) if isinstance(entry, str) else (entry or ()):
            if axis in seen:
                raise ConfigError(f"mesh axis {axis!r} shards two dimensions of one array: {spec}")
            seen.append(axis)


def is_axes(x: Any) -> bool:
    """True for a logical-axes tuple: the leaves of a `param_axes` tree (`jax.tree.map(is_leaf=)`)."""
    return isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x)


def _filter_entry(entry: Any, keep: Any) -> Any:
    """One PartitionSpec entry (None, an axis, or a tuple of axes) with only the axes `keep` accepts."""
    kept = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if keep(a))
    return None if not kept else kept[0] if len(kept) == 1 else kept


def spec_without(spec: Sequence[Any], axes: Any) -> PartitionSpec:
    """`spec` with the mesh axes in `axes` dropped (e.g. the manual axes inside a shard_map)."""
    return PartitionSpec(*(_filter_entry(e, lambda a: a not in axes) for e in spec))


def spec_only(spec: Sequence[Any], axes: Any) -> PartitionSpec:
    """`spec` with every mesh axis outside `axes` dropped (a shard_map names only its manual axes)."""
    return PartitionSpec(*(_filter_entry(e, lambda a: a in axes) for e in spec))


def rules_without(rules: Rules, axes: Any) -> Rules:
    """Rules that never name the mesh axes in `axes` (for code inside a shard_map manual over them)."""
    return tuple(
        (name, None if target is None else _filter_entry(target, lambda a: a not in axes))
        for name, target in rules
    )


def tree_shardings(
    axes_tree: Any, shapes_tree: Any, mesh: Mesh, rules: Rules = STORAGE_RULES
) -> Any:
    """NamedShardings for a tree of logical-axis tuples (leaves) and matching shapes."""
    return jax.tree.map(
        lambda names, sds: NamedSharding(mesh, logical_to_spec(names, rules, mesh, sds.shape)),
        axes_tree,
        shapes_tree,
        is_leaf=is_axes,
    )


# The mesh and rules active while tracing a model, so model code can say `constrain(x, names)`
# without being handed the mesh (as flax.linen's axis_rules context).
_context = threading.local()


@contextlib.contextmanager
def activation_rules(mesh: Mesh, rules: Rules = COMPUTE_RULES):
    prev = getattr(_context, "value", None)
    _context.value = (mesh, rules)
    try:
        yield
    finally:
        _context.value = prev


def axis_size(axis: str) -> int:
    """Size of mesh axis `axis` while tracing inside `activation_rules` (1 outside, or absent)."""
    ctx = getattr(_context, "value", None)
    return 1 if ctx is None else int(ctx[0].shape.get(axis, 1))


def active_mesh() -> Mesh | None:
    """The mesh of the enclosing `activation_rules` (None outside)."""
    ctx = getattr(_context, "value", None)
    return None if ctx is None else ctx[0]


def constrain(x: jax.Array, names: LogicalAxes) -> jax.Array:
    """Pins `x` to the compute sharding of its logical axes; a no-op outside `activation_rules`."""
    ctx = getattr(_context, "value", None)
    if ctx is None:
        return x
    mesh, rules = ctx
    if len(names) != x.ndim:
        raise ValueError(f"logical axes {names} do not match array of rank {x.ndim}")
    return constrain_to(x, NamedSharding(mesh, logical_to_spec(names, rules, mesh)))


def _manual_axes() -> tuple[Any, set[str]]:
    """The mesh seen while tracing and its manual axes (non-empty inside a `jax.shard_map`)."""
    am = jax.sharding.get_abstract_mesh()
    manual = getattr(am, "manual_axes", None)
    if manual is None:
        types = getattr(am, "axis_types", ()) or ()
        manual = [n for n, t in zip(am.axis_names, types) if t == jax.sharding.AxisType.Manual]
    return am, set(manual or ())


def manual_axes() -> set[str]:
    """The mesh axes manual where this is traced: a model op whose axis is already manual (the
    pipeline's stages are manual over `context` and `expert` too) runs its per-shard body directly
    instead of opening a nested `jax.shard_map`."""
    return _manual_axes()[1]


def varying_axes(x: jax.Array) -> frozenset[str]:
    """The manual axes over which `x` may differ (shard_map's vma type): empty outside a
    `jax.shard_map` and for values replicated there."""
    aval = jax.typeof(x)
    if hasattr(aval, "manual_axis_type"):  # jax >= 0.10
        return frozenset(aval.manual_axis_type.varying)
    return frozenset(getattr(aval, "vma", ()))


_tokens = threading.local()


@contextlib.contextmanager
def split_tokens(axes: Sequence[str]):
    """Manual mesh axes that split the tokens of the batch a model block sees (the pipeline's
    stages: data, fsdp, expert, context): a statistic that must cover all of them (the MoE
    router's expert load) is combined over these axes."""
    prev = getattr(_tokens, "value", ())
    _tokens.value = tuple(axes)
    try:
        yield
    finally:
        _tokens.value = prev


def token_axes() -> tuple[str, ...]:
    """The axes of the enclosing `split_tokens` (none outside)."""
    return getattr(_tokens, "value", ())


_replicas = threading.local()


@contextlib.contextmanager
def per_replica_loss(axes: Sequence[str]):
    """The loss traced inside runs once per data replica, on its rows, under the named axes
    `axes` (the per-replica strategies: a shard_map manual over `data`, or their vmap's
    `axis_name`; jaxdist/collectives.py, jaxdist/overlap.py): a statistic of the whole batch
    (the MoE router's expert load) is averaged over them, so that each replica's loss is linear
    in its own tokens and the replicas' mean loss and gradient are the batch's."""
    prev = getattr(_replicas, "value", ())
    _replicas.value = (*prev, *axes)
    try:
        yield
    finally:
        _replicas.value = prev


def batch_stat_axes() -> tuple[str, ...]:
    """The named axes a batch statistic is averaged over where this is traced: the pipeline
    stages' `token_axes` and the per-replica loss's replica axes (`per_replica_loss`)."""
    return (*token_axes(), *getattr(_replicas, "value", ()))


_mapped = threading.local()


@contextlib.contextmanager
def mapped_axes(axes: Sequence[str]):
    """Mesh axes an enclosing `jax.vmap(..., spmd_axis_name=axes)` already shards the mapped
    dimension over (per-replica gradients, `jaxdist.collectives.sync_grads`): constraints traced
    inside leave them out, and vmap puts them on the mapped dimension."""
    prev = getattr(_mapped, "value", frozenset())
    _mapped.value = prev | frozenset(axes)
    try:
        yield
    finally:
        _mapped.value = prev


def nested_mesh(axes: Sequence[str]) -> tuple[Any, tuple[str, ...], tuple[str, ...]]:
    """(mesh, free, mapped) for a `jax.shard_map` over `axes` traced inside `activation_rules`.

    Inside an enclosing shard_map (per-replica gradients, `jaxdist.collectives`) the mesh is the
    tracing abstract mesh and the axes it holds manual are not free. Inside `mapped_axes` the
    vmapped axes are not free either: the nested shard_map names them in `axis_names` only (not
    in its specs), since vmap's batching puts them on the mapped dimension of the specs but not
    among the manual axes (jax 0.10). `free`: the axes of `axes` on the mesh to split over; when
    nested, only those of size > 1 (Shardy rejects a nested manual size-1 axis after a free one).
    """
    am, manual = _manual_axes()
    mapped = getattr(_mapped, "value", frozenset())
    mesh = am if manual else active_mesh()
    nested = bool(manual or mapped)
    free = tuple(
        a
        for a in axes
        if a in mesh.shape and (mesh.shape[a] > 1 or not nested) and a not in manual | mapped
    )
    return mesh, free, tuple(a for a in mesh.axis_names if a in mapped and a not in manual)


def constrain_to(x: jax.Array, target: NamedSharding) -> jax.Array:
    """with_sharding_constraint that also works inside a partially manual shard_map or a vmap.

    Inside `shard_map(..., axis_names={"data"})` the `data` axis is manual: each body sees its own
    slice, so the constraint drops that axis and targets the tracing mesh's remaining (automatic)
    axes. Inside `mapped_axes` the constraint drops those axes too.
    """
    am, manual = _manual_axes()
    drop = manual | getattr(_mapped, "value", frozenset())
    if not drop:
        return jax.lax.with_sharding_constraint(x, target)
    mesh = am if manual else target.mesh
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec_without(target.spec, drop)))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def per_device_bytes(shardings: Any, shapes: Any) -> int:
    """Bytes one device holds for a tree of arrays with these shardings (the largest shard)."""
    total = 0
    for sh, sds in zip(jax.tree.leaves(shardings), jax.tree.leaves(shapes)):
        shard = sh.shard_shape(sds.shape)
        total += int(np.prod(shard, dtype=np.int64)) * np.dtype(sds.dtype).itemsize
    return total
