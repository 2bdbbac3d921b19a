"""Whether a checkpoint fits the run that reads it: its config, its arrays, its replica count.

Checked from metadata alone, before any array data is read, each refusal one line naming the
field or array and what would be valid. Per-replica state (compressor residuals, local SGD
replicas) saved with another number of data replicas is the one difference bridged: it is read as
saved and redistributed (`redistribute`, an elastic resume).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxdist import compression
from jaxdist.checkpoint.trees import PyTree, dtype_of, flatten, fmt_array, path_str, shape_of
from jaxdist.errors import ConfigError


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


_ABSENT = _Absent()


def check_config_compatible(
    saved_config: Mapping[str, Any] | None,
    config: Mapping[str, Any],
    fields: Sequence[str] = ("model",),
    why: Mapping[str, str] | None = None,
) -> None:
    """Raises ConfigError naming the first field where `config` differs from `saved_config`.

    Args:
      saved_config: the resolved config stored in a checkpoint; None (none stored) passes.
      config: the resolved config of the run that wants to resume from it.
      fields: sections or dotted fields that must agree, e.g. `("model", "train.optimizer")`.
      why: per entry of `fields`, the reason it must agree, added to the message.
    """
    if saved_config is None:
        return

    def get(cfg: Any, dotted: str) -> Any:
        for part in dotted.split("."):
            if not isinstance(cfg, Mapping) or part not in cfg:
                return _ABSENT
            cfg = cfg[part]
        return cfg

    def first_diff(a: Any, b: Any, where: str) -> tuple[str, Any, Any] | None:
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            # `name` first: a different model family explains every other difference.
            for key in sorted(set(a) | set(b), key=lambda k: (k != "name", str(k))):
                diff = first_diff(a.get(key, _ABSENT), b.get(key, _ABSENT), f"{where}.{key}")
                if diff:
                    return diff
            return None
        if isinstance(a, list | tuple) and isinstance(b, list | tuple):  # JSON has no tuples
            a, b = list(a), list(b)
        return None if a == b else (where, a, b)

    for field in fields:
        diff = first_diff(get(saved_config, field), get(config, field), field)
        if diff:
            where, saved, now = diff
            reason = f" ({why[field]})" if why and field in why else ""
            raise ConfigError(
                f"config field {where} differs from the checkpoint: saved {saved!r}, now {now!r}"
                f"{reason}; use the saved value or a new workdir"
            )


# Train-state subtrees that exist only with some grad_sync settings, with a leading replica axis.
PER_REPLICA = {"grad_sync": "grad_sync.compression", "local": "grad_sync.local_steps"}


def replica_resized(saved: Mapping[str, Any], expected: Mapping[str, Any]) -> set[str]:
    """Paths of per-replica subtrees saved with another number of data replicas (all of them)."""
    paths = [p for p in expected if p.split("/", 1)[0] in PER_REPLICA and p in saved]
    changed = {
        p
        for p in paths
        if shape_of(saved[p])[:1] != tuple(expected[p].shape)[:1]
        and len(shape_of(saved[p])) == len(expected[p].shape)
        and dtype_of(saved[p]) == np.dtype(expected[p].dtype)
    }
    if not changed:
        return set()
    roots = {p.split("/", 1)[0] for p in changed}
    return {p for p in paths if p.split("/", 1)[0] in roots}


def as_saved(abstract_state: PyTree, saved: Mapping[str, Any], paths: set[str]) -> PyTree:
    """`abstract_state` with the leaves at `paths` as saved (shape), replicated on the mesh."""

    def leaf(kp, x):
        path = path_str(kp)
        if path not in paths:
            return x
        mesh = x.sharding.mesh
        return jax.ShapeDtypeStruct(
            shape_of(saved[path]), x.dtype, sharding=jax.sharding.NamedSharding(mesh, P())
        )

    return jax.tree_util.tree_map_with_path(leaf, abstract_state)


def redistribute(state: PyTree, expected: Mapping[str, Any]) -> PyTree:
    """The resized per-replica leaves of `state` through `compression.resize_replicas`."""
    flat = flatten(state)
    resized = {p: np.asarray(x) for p, x in flat.items() if x.shape != expected[p].shape}
    roots = {p.split("/", 1)[0] for p in resized}
    group = {p: np.asarray(x) for p, x in flat.items() if p.split("/", 1)[0] in roots}
    new = compression.resize_replicas(group, {p: tuple(expected[p].shape) for p in group})

    def leaf(kp, x):
        path = path_str(kp)
        if path not in new:
            return x
        host, want = new[path], expected[path]
        return jax.make_array_from_callback(want.shape, want.sharding, lambda idx: host[idx])

    return jax.tree_util.tree_map_with_path(leaf, state)


def _setting_hint(path: str) -> str | None:
    field = PER_REPLICA.get(path.split("/", 1)[0])
    return f"keep the saved {field} or use a new workdir" if field else None


def check_matches(saved: Mapping[str, Any], expected: Mapping[str, Any], where: str) -> None:
    """ConfigError naming the first array whose path, shape or dtype differs from the model's."""
    for path, want in expected.items():
        if path not in saved:
            hint = _setting_hint(path) or "a different model?"
            raise ConfigError(
                f"{where} has no array {path}, which the model expects as "
                f"{fmt_array(want.shape, want.dtype)} ({hint})"
            )
        have_shape, have_dtype = shape_of(saved[path]), dtype_of(saved[path])
        if have_shape != tuple(want.shape) or have_dtype != np.dtype(want.dtype):
            hint = ""
            if _setting_hint(path) and have_shape[1:] == tuple(want.shape)[1:] and have_shape:
                hint = (
                    f" (per-replica state of {have_shape[0]} data-parallel replicas: resume with "
                    f"{have_shape[0]}, or use a new workdir)"
                )
            raise ConfigError(
                f"{where}: {path} is saved as {fmt_array(have_shape, have_dtype)} "
                f"but the model expects {fmt_array(want.shape, want.dtype)}{hint}"
            )
    extra = [path for path in saved if path not in expected]
    if extra:
        hint = _setting_hint(extra[0]) or "a different model?"
        raise ConfigError(
            f"{where} has array {extra[0]} that the model lacks ({len(extra)} such; {hint})"
        )
