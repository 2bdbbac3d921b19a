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
import os
from collections.abc import Iterator
from typing import Any

import ml_collections
import numpy as np

from jaxdist.errors import ConfigError

MAX_SHARD_BYTES = 5 * 2**30  # transformers' default shard size
INDEX_FILE = "model.safetensors.index.json"
# Files copied along with the weights, so a run folder keeps the model's tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


# ------------------------------------------------------------------------------------------------
# config.json ↔ config.model


def read_hf_config(hf_dir: str) -> dict[str, Any]:
    """`HF_DIR/config.json` as a dict; ConfigError when missing, unreadable or malformed."""
    path = os.path.join(hf_dir, "config.json")
    _need(os.path.isdir(hf_dir), f"{hf_dir}: no such directory")
    _need(os.path.isfile(path), f"{path}: no such file (a Hugging Face model folder has one)")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: unreadable ({e})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
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
    import models
    from jaxdist.config import base_config

    family = models.for_hf(hf.get("architectures"), where)
    m = base_config().model
    m.name = family.name
    family.hf.config_from_hf(hf, m, where)
    return m


def _format(m) -> Any:
    import models

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


def hf_names(m) -> list[str]:
    """Every HF tensor name the model has, layers expanded."""
    names = []
    for t in tensor_map(m):
        layers = range(m.num_layers) if t.stacked else [None]
        names += [t.hf_name.format(i=i) for i in layers]
    return names


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
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                _need(isinstance(weight_map, dict), "weight_map is not an object")
            except (OSError, ValueError, KeyError, TypeError, ConfigError) as e:
                raise ConfigError(f"{index}: malformed index ({e})") from None
            files = sorted(set(weight_map.values()))
            for name in files:
                _need(
                    os.path.isfile(os.path.join(hf_dir, name)),
                    f"{index} names {name}, which is missing from {hf_dir}",
                )
            self.file_of = {k: os.path.join(hf_dir, v) for k, v in weight_map.items()}
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
                for name in self._keys(path):
                    self.file_of[name] = path
        self._shapes: dict[str, tuple[int, ...]] = {}

    def _keys(self, path: str) -> list[str]:
        try:
            with self._open(path, framework="numpy") as f:
                return list(f.keys())
        except Exception as e:  # safetensors raises its own error type for a corrupt header
            raise ConfigError(f"{path}: not a readable safetensors file ({e})") from None

    def names(self) -> list[str]:
        return list(self.file_of)

    def get(self, name: str) -> np.ndarray:
        path = self.file_of[name]
        try:
            with self._open(path, framework="numpy") as f:
                return f.get_tensor(name)
        except Exception as e:
            raise ConfigError(f"{path}: tensor {name} unreadable ({e})") from None


def check_names(weights: Weights, m, where: str) -> None:
    """ConfigError for a missing tensor or one no Llama parameter takes."""
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
    layers. Shapes are checked against config.json before each is converted."""
    check_names(weights, m, where)
    for t in tensor_map(m):
        layers = range(m.num_layers) if t.stacked else [None]
        out = None
        for j, i in enumerate(layers):
            name = t.hf_name.format(i=i)
            a = weights.get(name)
            _need(
                tuple(a.shape) == t.hf_shape,
                f"{weights.file_of[name]}: {name} has shape {list(a.shape)}, but config.json "
                f"implies {list(t.hf_shape)}",
            )
            value = t.to_jax(a.astype(dtype))
            if not t.stacked:
                out = np.ascontiguousarray(value)
                break
            if out is None:
                out = np.empty((m.num_layers, *value.shape), dtype)
            out[j] = value
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
    `max_shard_bytes`) of jaxdist Llama `params` (host arrays) into the existing `out_dir`.

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
        layers = range(m.num_layers) if t.stacked else [None]
        _need(
            not t.stacked or value.shape[0] == m.num_layers,
            f"params/{'/'.join(t.path)} has {value.shape[0]} layers, model.num_layers="
            f"{m.num_layers}",
        )
        for i in layers:
            a = np.ascontiguousarray(t.to_hf(value[i] if t.stacked else value).astype(np_dtype))
            _need(
                a.shape == t.hf_shape,
                f"params/{'/'.join(t.path)} is {list(value.shape)}, which does not fit the "
                f"config's {t.hf_name.format(i=i)} {list(t.hf_shape)}",
            )
            if size and size + a.nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][t.hf_name.format(i=i)] = a
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
