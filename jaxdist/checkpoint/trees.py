"""A state pytree as `/`-joined paths, and the short strings checkpoint messages are made of.

`path_str` is the key every part of a checkpoint agrees on: the saved metadata, the CRC table, the
arrays `read_arrays` returns and the messages that name an array.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

PyTree = Any


def _key_str(key: Any) -> str:
    for attr in ("key", "name", "idx"):  # DictKey, GetAttrKey (NamedTuple fields), SequenceKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_str(keypath: Sequence[Any]) -> str:
    """`/`-joined tree path such as `opt_state/0/mu/dense/w`; equal for a state and its metadata."""
    return "/".join(_key_str(k) for k in keypath)


def flatten(tree: PyTree) -> dict[str, Any]:
    """{path: leaf} of `tree`, in tree order, keyed by `path_str`."""
    return {path_str(kp): leaf for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def under(path: str, prefix: str) -> bool:
    """Whether `path` is `prefix` or inside it (every path is under the empty prefix)."""
    return not prefix or path == prefix or path.startswith(prefix.rstrip("/") + "/")


def one_line_error(err: BaseException, limit: int = 300) -> str:
    """`Type: message` of the root cause (orbax wraps tensorstore's error), on one line."""
    while err.__cause__ is not None:
        err = err.__cause__
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shape_of(md: Any) -> tuple[int, ...]:
    """The shape of an orbax ArrayMetadata (or anything with `.shape`), as ints."""
    return tuple(int(d) for d in (getattr(md, "shape", None) or ()))


def dtype_of(md: Any) -> np.dtype:
    """The dtype of an orbax ArrayMetadata (float32 when it has none)."""
    dtype = getattr(md, "dtype", None)  # not `or`: an np.dtype is falsy (its len() is 0)
    return np.dtype(np.float32 if dtype is None else dtype)


def fmt_array(shape: Sequence[int], dtype: Any) -> str:
    """`float32[64,8]`."""
    return f"{np.dtype(dtype).name}[{','.join(str(d) for d in shape)}]"


def _fmt_sharding(spec: Sequence[Any], axis_sizes: Mapping[str, int]) -> str:
    axes = ", ".join(f"{name}={int(size)}" for name, size in axis_sizes.items())
    return f"P({', '.join(repr(e) for e in spec)}) on mesh({axes})"


def describe_sharding(sharding: Any) -> str:
    """A short string for a sharding, e.g. `P('data', None) on mesh(data=8)`."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return _fmt_sharding(sharding.spec, sharding.mesh.shape)
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return "single device"
    return type(sharding).__name__ if sharding is not None else "host (not a jax.Array)"


def describe_sharding_metadata(sharding: Any) -> str:
    """The same string from orbax's ShardingMetadata, for checkpoints without our meta item."""
    spec = getattr(sharding, "partition_spec", None)
    names = getattr(sharding, "axis_names", None)
    sizes = getattr(sharding, "shape", None)
    if spec is None or names is None or sizes is None:
        return type(sharding).__name__ if sharding is not None else "unknown"
    return _fmt_sharding(spec, dict(zip(names, list(sizes), strict=False)))
