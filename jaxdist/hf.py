"""Hugging Face checkpoints in and out: `config.json` + safetensors ↔ jaxdist parameters.

What a family's parameters are called in a Hugging Face checkpoint, and how its config.json maps to
`config.model`, the family declares (`models.api.HFFormat`; the Llama's table is in
models/llama.py). This module does the rest for any such family: it finds the family by the
config's `architectures`, checks every tensor's name and shape against the config before
converting it, gathers each stacked parameter's layers, and writes safetensors files (sharded past
a size limit, with transformers' index). Files are read and written with the `safetensors` numpy
API, one tensor at a time; nothing is unpickled.
"""

from __future__ import annotations

import glob
import json
import math
import os
import sys
from collections.abc import Iterator
from typing import Any

import ml_collections
import numpy as np

import models
from jaxdist.errors import ConfigError
from jaxdist.schema import base_config

MAX_SHARD_BYTES = 5 * 2**30  # transformers' default shard size
INDEX_FILE = "model.safetensors.index.json"
# Files copied along with the weights, so a run folder keeps the model's tokenizer ...
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# ... and how transformers generates from it (not a tokenizer file: named apart).
SIDE_FILES = (*TOKENIZER_FILES, "generation_config.json")
# Config fields are bounded before anything is built from them: sizes by the tensors the
# safetensors hold, the rest (positions, token ids) by int32, the type they are computed in.
MAX_INT = 2**31 - 1
SELF_CONTAINED = "a model folder is self-contained"


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _hub_blobs(folder: str) -> str | None:
    """`<cache>/models--org--name/blobs` when `folder` is a snapshot of the Hugging Face hub cache
    (`.../snapshots/<revision>`, whose files link into `../../blobs`), else None."""
    real = os.path.realpath(folder)
    if os.path.basename(os.path.dirname(real)) != "snapshots":
        return None
    blobs = os.path.join(os.path.dirname(os.path.dirname(real)), "blobs")
    return blobs if os.path.isdir(blobs) and not os.path.islink(blobs) else None


def inside(folder: str, name: str, named_by: str = "") -> str:
    """`folder/name`, refused in one line unless it lies in `folder`: `name` is a plain relative
    path and the file, links followed, is in the folder (or, for a snapshot of the hub cache, one
    of its `blobs`). A model folder is self-contained, so a link or an index entry cannot make an
    import read, copy or later export a file from elsewhere.

    Args:
      folder: the model folder.
      name: a file name in it (from a fixed list, a glob, or an index's weight_map).
      named_by: the file that named `name` (an index), for the message.
    """
    path = os.path.join(folder, name)
    by = f"{named_by} names {name!r}, which" if named_by else path
    parts = name.replace("\\", "/").split("/")
    _need(
        bool(name) and not os.path.isabs(name) and ".." not in parts,
        f"{by} is outside {folder}; {SELF_CONTAINED}",
    )
    real, base = os.path.realpath(path), os.path.realpath(folder)
    if os.path.commonpath([real, base]) == base:
        return path
    blobs = _hub_blobs(folder)
    _need(
        blobs is not None and os.path.dirname(real) == blobs,
        f"{by} links to {real}, outside {folder}; {SELF_CONTAINED} (copy the file in instead)",
    )
    return path


# ------------------------------------------------------------------------------------------------
# config.json ↔ config.model


def read_hf_config(hf_dir: str) -> dict[str, Any]:
    """`HF_DIR/config.json` as a dict; ConfigError when missing, unreadable or malformed."""
    path = os.path.join(hf_dir, "config.json")
    _need(os.path.isdir(hf_dir), f"{hf_dir}: no such directory")
    _need(os.path.isfile(path), f"{path}: no such file (a Hugging Face model folder has one)")
    inside(hf_dir, "config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: unreadable ({e})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except ValueError as e:  # Python's limit on the digits of an integer it converts
        limit = sys.get_int_max_str_digits()
        why = f"an integer of more than {limit} digits" if "digits" in str(e) else str(e)
        raise ConfigError(f"{path}: not valid JSON ({why.splitlines()[0]})") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid JSON (nested too deeply)") from None
    _need(isinstance(cfg, dict), f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def is_hf_folder(path: str) -> bool:
    """A folder with a Hugging Face `config.json` (one naming `architectures` or `model_type`)."""
    try:
        cfg = read_hf_config(path)
    except ConfigError:
        return False
    return "architectures" in cfg or "model_type" in cfg


def model_config_from_hf(hf: dict, where: str = "config.json") -> ml_collections.ConfigDict:
    """The `config.model` of a Hugging Face config.json, by the family its `architectures` names.

    Raises:
      ConfigError: an architecture no family imports, or a field the family cannot take; one
        line naming `where` and the field.
    """
    family = models.for_hf(hf.get("architectures"), where)
    m = base_config().model
    m.name = family.name
    family.hf.config_from_hf(hf, m, where)
    _check_bounds(m, where)
    return m


def _check_bounds(node, where: str, prefix: str = "model") -> None:
    """Every integer of config.model within int32 and every number finite: what JSON allows
    beyond that (a 100-digit integer, 1e999 read as infinity) is refused before use."""
    for key, value in node.items():
        field = f"{prefix}.{key}"
        if isinstance(value, ml_collections.ConfigDict):
            _check_bounds(value, where, field)
        elif isinstance(value, bool):
            continue
        elif isinstance(value, int):
            _need(
                -MAX_INT <= value <= MAX_INT,
                f"{where}: {field}={_short(value)} is out of range (at most {MAX_INT})",
            )
        elif isinstance(value, float):
            _need(math.isfinite(value), f"{where}: {field}={value} must be a finite number")


def _short(value: int) -> str:
    """An integer for a one-line message: a huge one by its first digits and its length."""
    digits = str(abs(value)) if value.bit_length() < 20_000 else ""
    if digits and len(digits) <= 30:
        return str(value)
    n = len(digits) if digits else int(value.bit_length() * math.log10(2)) + 1
    return f"{'-' if value < 0 else ''}{digits[:8] or '?'}... ({n} digits)"


def _format(m) -> Any:
    family = models.get(m.name)
    _need(
        family.hf is not None,
        f"model.name={m.name!r} has no Hugging Face form; families that have one: "
        + ", ".join(n for n in models.names() if models.get(n).hf is not None),
    )
    return family.hf


def hf_config_from(m, dtype: str = "float32") -> dict[str, Any]:
    """The config.json of config.model `m`."""
    return _format(m).config_to_hf(m, dtype)


def tensor_map(m) -> list[Any]:
    """Every parameter's `models.api.HFTensor`, in the params' tree order."""
    return _format(m).tensors(m)


def each_tensor(t: Any, m) -> Iterator[tuple[tuple[int, ...], str]]:
    """(index into the parameter, HF name) of every tensor one `HFTensor` stands for: one per
    layer of a stacked parameter, times one per expert for one stored expert by expert."""
    layers = range(m.num_layers) if t.stacked else [None]
    experts = range(t.experts) if t.experts else [None]
    for i in layers:
        for e in experts:
            yield tuple(j for j in (i, e) if j is not None), t.hf_name.format(i=i, e=e)


def hf_names(m) -> list[str]:
    """Every HF tensor name the model has, layers (and experts) expanded."""
    return [name for t in tensor_map(m) for _, name in each_tensor(t, m)]


# ------------------------------------------------------------------------------------------------
# Reading safetensors.


class Weights:
    """The tensors of an HF folder: `model.safetensors`, or the shards its index names, or (with
    neither) every `*.safetensors` file in it. Tensors are read one at a time (memory-mapped)."""

    def __init__(self, hf_dir: str):
        from safetensors import safe_open

        self._open = safe_open
        index = os.path.join(hf_dir, INDEX_FILE)
        single = os.path.join(hf_dir, "model.safetensors")
        # Every file's header (names, shapes) is read up front: config.json is checked against
        # what the files hold before anything is read or built (`check_against_headers`).
        self._headers: dict[str, dict[str, tuple[int, ...]]] = {}
        if os.path.isfile(index):
            inside(hf_dir, INDEX_FILE)
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                _need(isinstance(weight_map, dict), "weight_map is not an object")
                _need(
                    all(isinstance(v, str) for v in weight_map.values()),
                    "weight_map values must be file names",
                )
            except (OSError, ValueError, KeyError, TypeError, RecursionError, ConfigError) as e:
                raise ConfigError(f"{index}: malformed index ({e})") from None
            files = sorted(set(weight_map.values()))
            for name in files:
                path = inside(hf_dir, name, named_by=index)
                _need(os.path.isfile(path), f"{index} names {name}, which is missing from {hf_dir}")
                self._header(path)
            self.file_of = {k: os.path.join(hf_dir, v) for k, v in weight_map.items()}
            for k, path in self.file_of.items():
                _need(
                    k in self._header(path),
                    f"{index} puts {k} in {os.path.basename(path)}, which does not hold it",
                )
        else:
            files = (
                [single] if os.path.isfile(single) else sorted(glob.glob(f"{hf_dir}/*.safetensors"))
            )
            _need(
                bool(files),
                f"{hf_dir}: no model.safetensors, {INDEX_FILE} or *.safetensors file "
                "(PyTorch .bin checkpoints are not read: they are pickles)",
            )
            self.file_of = {}
            for path in files:
                inside(hf_dir, os.path.basename(path))
                for name in self._header(path):
                    self.file_of[name] = path
        self.shape_of = {k: self._header(path)[k] for k, path in self.file_of.items()}

    def _header(self, path: str) -> dict[str, tuple[int, ...]]:
        """{tensor name: shape} of one file, from its header alone (no tensor data is read)."""
        if path not in self._headers:
            try:
                with self._open(path, framework="numpy") as f:
                    self._headers[path] = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            except Exception as e:  # safetensors raises its own error type for a corrupt header
                raise ConfigError(f"{path}: not a readable safetensors file ({e})") from None
        return self._headers[path]

    def names(self) -> list[str]:
        return list(self.file_of)

    def get(self, name: str) -> np.ndarray:
        path = self.file_of[name]
        try:
            with self._open(path, framework="numpy") as f:
                return f.get_tensor(name)
        except Exception as e:
            raise ConfigError(f"{path}: tensor {name} unreadable ({e})") from None


def check_against_headers(weights: Weights, m, where: str) -> None:
    """config.json against the tensors the safetensors hold, from their headers alone: the layer
    count first (so an absurd one is refused before a name is listed per layer), then every
    tensor's name and shape. Bounds every size field by the files, before anything is built.

    Raises:
      ConfigError: one line naming the layer count, the tensor or the shape that disagrees.
    """
    import re

    layers: set[int] = set()
    for t in tensor_map(m):
        if t.stacked:
            head, _, tail = t.hf_name.format(i="{i}", e=0).partition("{i}")
            pattern = re.compile(re.escape(head) + r"(\d+)" + re.escape(tail))
            layers.update(int(g[1]) for n in weights.names() if (g := pattern.fullmatch(n)))
    _need(
        m.num_layers <= len(layers),
        f"{where}: {_short(m.num_layers)} layers ({m.name} model.num_layers), but the "
        f"safetensors hold {len(layers)}; config.json must describe the weights next to it",
    )
    check_names(weights, m, where)
    for t in tensor_map(m):
        for _, name in each_tensor(t, m):
            shape = weights.shape_of[name]
            _need(
                shape == tuple(t.hf_shape),
                f"{weights.file_of[name]}: {name} has shape {list(shape)}, but config.json "
                f"implies [{', '.join(_short(int(d)) for d in t.hf_shape)}]",
            )


def check_names(weights: Weights, m, where: str) -> None:
    """ConfigError for a missing tensor or one no parameter of the family takes."""
    want = set(hf_names(m))
    ignored = tuple(_format(m).ignored(m))
    have = {n for n in weights.names() if not ignored or not n.endswith(ignored)}
    missing = sorted(want - have, key=_natural)
    _need(
        not missing,
        f"{where}: missing tensor {missing[0] if missing else ''} ({len(missing)} missing; "
        f"config.json implies {len(want)} tensors)",
    )
    extra = sorted(have - want, key=_natural)
    _need(
        not extra,
        f"{where}: unexpected tensor {extra[0] if extra else ''} ({len(extra)} such) for a "
        f"{m.name} model with this config.json",
    )


def _natural(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in name.split(".")]


def read_params(
    weights: Weights, m, where: str, dtype=np.float32
) -> Iterator[tuple[tuple[str, ...], np.ndarray]]:
    """(path, jaxdist array) for every parameter, one at a time; stacked ones gather their L
    layers (and experts their E tensors). Shapes are checked against config.json before each is
    converted."""
    check_against_headers(weights, m, where)
    for t in tensor_map(m):
        out = None
        for index, name in each_tensor(t, m):
            a = weights.get(name)
            _need(
                tuple(a.shape) == t.hf_shape,
                f"{weights.file_of[name]}: {name} has shape {list(a.shape)}, but config.json "
                f"implies {list(t.hf_shape)}",
            )
            value = t.to_jax(a.astype(dtype))
            if not index:
                out = np.ascontiguousarray(value)
                break
            if out is None:
                lead = (m.num_layers,) * t.stacked + (t.experts,) * bool(t.experts)
                out = np.empty((*lead, *value.shape), dtype)
            out[index] = value
        yield t.path, out


def set_path(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def get_path(tree: dict, path: tuple[str, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


# ------------------------------------------------------------------------------------------------
# Writing safetensors.


def write_hf(
    params: dict, m, out_dir: str, *, dtype: str = "float32", max_shard_bytes: int = MAX_SHARD_BYTES
) -> dict[str, Any]:
    """Writes `config.json` and the weights (`model.safetensors`, or shards and their index past
    `max_shard_bytes`) of jaxdist `params` (host arrays) into the existing `out_dir`.

    Returns: {"files": [...], "tensors": n, "bytes": total}.
    """
    import ml_dtypes
    from safetensors.numpy import save_file

    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    total = 0
    for t in tensor_map(m):
        try:
            value = np.asarray(get_path(params, t.path))
        except (KeyError, TypeError):
            raise ConfigError(f"the checkpoint has no params/{'/'.join(t.path)}") from None
        _need(
            not t.stacked or value.shape[0] == m.num_layers,
            f"params/{'/'.join(t.path)} has {value.shape[0]} layers, model.num_layers="
            f"{m.num_layers}",
        )
        _need(
            not t.experts or value.shape[int(t.stacked)] == t.experts,
            f"params/{'/'.join(t.path)} is {list(value.shape)}: not {t.experts} experts",
        )
        for index, name in each_tensor(t, m):
            a = np.ascontiguousarray(t.to_hf(value[index]).astype(np_dtype))
            _need(
                a.shape == t.hf_shape,
                f"params/{'/'.join(t.path)} is {list(value.shape)}, which does not fit the "
                f"config's {name} {list(t.hf_shape)}",
            )
            if size and size + a.nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = a
            size += a.nbytes
            total += a.nbytes
    n = len(shards)
    names = (
        ["model.safetensors"]
        if n == 1
        else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    )
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file(shard, os.path.join(out_dir, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config_from(m, dtype), f, indent=2)
    return {"files": names, "tensors": len(weight_map), "bytes": total}
