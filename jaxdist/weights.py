"""Model weights from a PATH, whatever it is: a Hugging Face folder, a jaxdist run folder or its
`checkpoints/` folder. What `scripts/hf.py`, `scripts/sample.py`, `scripts/eval.py` and
`train.init_from` share.

    src = weights.resolve("runs/llama")        # or an HF folder, or runs/llama/checkpoints
    params = weights.load_params(src, abstract) # onto `abstract`'s shardings, one tensor at a time

An imported Hugging Face model is a run folder like any other: `DIR/config.json` (the jaxdist
config, its `model` from the HF config.json), `DIR/checkpoints/0` holding `{"step", "params"}` and
the tokenizer files next to them. Every write goes to a temporary folder renamed at the end, so a
failed import or export leaves nothing half-written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import secrets
import shutil
from typing import Any

import jax
import ml_collections
import numpy as np

import models
from jaxdist import checkpoint as ckpt
from jaxdist import hf, sharding
from jaxdist import mesh as mesh_lib
from jaxdist.errors import ConfigError
from jaxdist.schema import base_config, to_json_dict
from models import api

ONE_DEVICE = {"data": 1, "fsdp": 1, "tensor": 1, "pipeline": 1}


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclasses.dataclass
class Source:
    """Where weights come from.

    Attributes:
      kind: "hf" (config.json + safetensors) or "jaxdist" (orbax checkpoints).
      path: the folder given.
      config: the full jaxdist config (for "hf": the defaults with `model` from its config.json).
      checkpoints: the checkpoints folder ("jaxdist" only).
      step: the checkpoint step ("jaxdist" only).
      folders: where tokenizer files may be, most specific first.
    """

    kind: str
    path: str
    config: ml_collections.ConfigDict
    checkpoints: str | None = None
    step: int | None = None
    folders: tuple[str, ...] = ()

    def file(self, name: str) -> str | None:
        """`name` (e.g. tokenizer.json) in the first of `folders` that has it, else None.

        Raises:
          ConfigError: the file is a link to somewhere outside its folder (`hf.inside`).
        """
        for folder in self.folders:
            if os.path.lexists(os.path.join(folder, name)):
                path = hf.inside(folder, name)
                if os.path.isfile(path):
                    return path
        return None


def config_from_json(saved: dict[str, Any]) -> ml_collections.ConfigDict:
    """A saved config (`config.json`, a checkpoint's metadata) over today's defaults: fields added
    since it was saved keep their defaults, fields since removed are ignored."""

    def merge(node: ml_collections.ConfigDict, values: dict[str, Any]) -> None:
        for key, value in values.items():
            if key not in node:
                continue
            if isinstance(node[key], ml_collections.ConfigDict) and isinstance(value, dict):
                merge(node[key], value)
            elif isinstance(node[key], tuple) and isinstance(value, list):
                node[key] = tuple(value)
            elif isinstance(node[key], float) and isinstance(value, int):
                node[key] = float(value)
            else:
                node[key] = value

    config = base_config()
    merge(config, saved)
    return config


def config_for_hf(hf_dir: str) -> ml_collections.ConfigDict:
    """jaxdist's defaults with `model` from `HF_DIR/config.json`, checked for one device."""
    where = os.path.join(hf_dir, "config.json")
    m = hf.model_config_from_hf(hf.read_hf_config(hf_dir), where)
    hf.check_against_headers(hf.Weights(hf_dir), m, where)  # sizes bounded by the files
    try:
        models.check(m, ONE_DEVICE)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    config = base_config()
    config.model = m
    return config


def resolve(path: str, step: int | None = None) -> Source:
    """What `path` holds. Raises a one-line ConfigError when it is none of the three."""
    path = os.path.abspath(path)
    _need(os.path.exists(path), f"{path}: no such file or directory")
    _need(os.path.isdir(path), f"{path}: not a directory (expected a model folder)")
    if os.path.isfile(os.path.join(path, "config.json")) and not os.path.isdir(
        os.path.join(path, "checkpoints")
    ):
        raw = hf.read_hf_config(path)
        if "architectures" in raw or "model_type" in raw:
            _need(step is None, f"{path} is a Hugging Face folder: it has no steps (drop --step)")
            return Source("hf", path, config_for_hf(path), folders=(path,))
    if os.path.isdir(os.path.join(path, "checkpoints")):
        run_dir, checkpoints = path, os.path.join(path, "checkpoints")
    elif ckpt.committed_steps(path):
        run_dir, checkpoints = os.path.dirname(path), path
    else:
        raise ConfigError(
            f"{path} is neither a Hugging Face folder (config.json + safetensors), a jaxdist run "
            "folder (with checkpoints/) nor a checkpoints folder (with <step>/ folders)"
        )
    meta = ckpt.read_metadata(checkpoints, step)
    saved = meta.get("config")
    _need(isinstance(saved, dict), f"checkpoint step {meta['step']} in {checkpoints} has no config")
    config = config_from_json(saved)
    # A run trained on scripts/tokenize.py's shards uses the tokenizer saved with them.
    data_dir = config.data.source if os.path.isdir(config.data.source) else None
    folders = tuple(dict.fromkeys(f for f in (path, run_dir, data_dir) if f))
    return Source(
        "jaxdist", path, config, checkpoints=checkpoints, step=int(meta["step"]), folders=folders
    )


def load_params(src: Source, abstract: Any) -> Any:
    """The parameters of `src` as jax.Arrays on the shardings of `abstract` (a pure dict of
    `jax.ShapeDtypeStruct(sharding=)` like the model's params). HF tensors are converted and
    placed one at a time: host memory holds one parameter (all layers of it), each device only
    its shards."""
    if src.kind == "jaxdist":
        return ckpt.restore_subtree(src.checkpoints, abstract, step=src.step)
    m = src.config.model
    out: dict[str, Any] = {}
    for path, value in hf.read_params(hf.Weights(src.path), m, src.path):
        want = hf.get_path(abstract, path)
        _need(
            tuple(want.shape) == value.shape,
            f"{src.path}: {'/'.join(path)} is {list(value.shape)}, the model expects "
            f"{list(want.shape)}",
        )
        value = value.astype(want.dtype)
        array = jax.make_array_from_callback(want.shape, want.sharding, value.__getitem__)
        hf.set_path(out, path, array)
    return out


def load_onto_mesh(src: Source, data_ds: Any, *, data: int, tensor: int):
    """(family, model, mesh, params): `src`'s model on a data × tensor mesh of the first
    data·tensor devices, its weights read straight into their shardings (evaluation, sampling).

    `data_ds` is the dataset the family is built for (None when it needs none, as generation).
    """
    m = src.config.model
    family = models.get(m.name)
    mesh_cfg = {"data": data, "tensor": tensor, "fsdp": 1, "pipeline": 1}
    mesh_cfg.update({f"dcn_{a}": 1 for a in list(mesh_cfg)})
    models.check(m, mesh_cfg)
    mesh = mesh_lib.make_mesh(mesh_cfg, jax.devices()[: data * tensor])
    model = api.abstract_model(family.make(m, data_ds))
    shardings = sharding.tree_shardings(model.axes, model.params, mesh)
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), model.params, shardings
    )
    return family, model, mesh, load_params(src, abstract)


def host_params(src: Source) -> dict[str, Any]:
    """The parameters of `src` as whole numpy arrays (for export), a nested dict."""
    if src.kind == "hf":
        out: dict[str, Any] = {}
        for path, value in hf.read_params(hf.Weights(src.path), src.config.model, src.path):
            hf.set_path(out, path, value)
        return out
    arrays = ckpt.read_arrays(src.checkpoints, src.step, prefix="params")
    out = {}
    for path, value in arrays.items():
        hf.set_path(out, tuple(path.split("/")[1:]), value)
    return out


@contextlib.contextmanager
def _staged(out_dir: str):
    """A temporary folder next to `out_dir`, renamed to it on success and removed on failure."""
    out_dir = os.path.abspath(out_dir)
    _need(
        not os.path.exists(out_dir) or (os.path.isdir(out_dir) and not os.listdir(out_dir)),
        f"--out {out_dir} already exists and is not empty; choose a new folder",
    )
    parent = os.path.dirname(out_dir)
    _need(os.path.isdir(parent), f"--out {out_dir}: the folder {parent} does not exist")
    # Private to this call (two imports to one --out may run at once, on one host or several).
    tmp = f"{out_dir}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    os.mkdir(tmp)
    try:
        yield tmp
        try:
            # Atomic, and onto an empty folder only: of two writers of one --out, the second is
            # refused here and the first's folder is left whole.
            os.rename(tmp, out_dir)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise
            raise ConfigError(
                f"--out {out_dir} was written by another process while this one ran (two "
                "imports or exports to one folder?); this one wrote nothing"
            ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _side_files(src: Source) -> dict[str, str]:
    """{name: path} of the `hf.SIDE_FILES` (the tokenizer's, generation_config.json) `src` has,
    each checked to lie in its folder before anything is read or written."""
    found = {name: src.file(name) for name in hf.SIDE_FILES}
    return {name: path for name, path in found.items() if path}


def _copy_tokenizer_files(side: dict[str, str], dst: str) -> list[str]:
    """Copies `side` (`_side_files`) into `dst`; returns the names copied."""
    for name, path in side.items():
        shutil.copyfile(path, os.path.join(dst, name))
    return list(side)


def import_hf(hf_dir: str, out_dir: str) -> dict[str, Any]:
    """A Hugging Face folder (any family with an `HFFormat`) → a jaxdist run folder `out_dir` (config.json, checkpoints/0,
    tokenizer files). Returns a summary: parameters, bytes, tokenizer files copied."""
    src = resolve(hf_dir)
    _need(src.kind == "hf", f"{hf_dir} is a jaxdist run, not a Hugging Face folder")
    side = _side_files(src)
    params: dict[str, Any] = {}
    for path, value in hf.read_params(hf.Weights(src.path), src.config.model, src.path):
        hf.set_path(params, path, value)
    cfg_json = to_json_dict(src.config)
    with _staged(out_dir) as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg_json, f, indent=2, sort_keys=True)
        saver = ckpt.Checkpointer(
            os.path.join(tmp, "checkpoints"),
            every=0,
            keep=1,
            config_json=cfg_json,
            async_save=False,
        )
        with saver:
            saver.save(0, {"step": np.int32(0), "params": params}, data_position=0, force=True)
        copied = _copy_tokenizer_files(side, tmp)
    leaves = jax.tree.leaves(params)
    return {
        "params": int(sum(a.size for a in leaves)),
        "bytes": int(sum(a.nbytes for a in leaves)),
        "tokenizer_files": [n for n in copied if n in hf.TOKENIZER_FILES],
        "other_files": [n for n in copied if n not in hf.TOKENIZER_FILES],
        "config": src.config,
    }


def export_hf(
    path: str,
    out_dir: str,
    *,
    step: int | None = None,
    dtype: str = "float32",
    max_shard_bytes: int = hf.MAX_SHARD_BYTES,
) -> dict[str, Any]:
    """A jaxdist run (or checkpoints folder) of a family with an `HFFormat` → an HF folder `out_dir` that
    `transformers.AutoModelForCausalLM.from_pretrained` loads. Returns `hf.write_hf`'s summary."""
    src = resolve(path, step)
    _need(
        src.kind == "jaxdist",
        f"{path} is already a Hugging Face folder; export takes a jaxdist run",
    )
    m = src.config.model
    exportable = [n for n in models.names() if models.get(n).hf is not None]
    _need(
        m.name in models.names() and models.get(m.name).hf is not None,
        f"model.name={m.name!r} in {src.checkpoints} has no Hugging Face form; hf.py exports "
        + ", ".join(exportable),
    )
    side = _side_files(src)
    params = host_params(src)
    with _staged(out_dir) as tmp:
        summary = hf.write_hf(params, m, tmp, dtype=dtype, max_shard_bytes=max_shard_bytes)
        summary["tokenizer_files"] = _copy_tokenizer_files(side, tmp)
    summary["step"] = src.step
    return summary


# Model fields that belong to the run rather than to the weights: kept from the run's config when
# `train.init_from` brings the rest from the source.
RUN_MODEL_FIELDS = ("seq_len", "attention", "scan_unroll", "embed_grad")


def apply_init_from(config: ml_collections.ConfigDict) -> Source | None:
    """For `train.init_from=PATH`: the source, with `config.model` set to its architecture (every
    field but `RUN_MODEL_FIELDS`); None when the field is empty."""
    path = config.train.init_from
    if not path:
        return None
    try:
        src = resolve(path)
    except ConfigError as e:
        raise ConfigError(f"train.init_from={path!r}: {e}") from None
    for key, value in src.config.model.items():
        if key not in RUN_MODEL_FIELDS:
            config.model[key] = value
    return src


# A tokenizer.json's fields that say how text becomes ids; "truncation", "padding" and "version"
# do not, and a re-saved file (scripts/tokenize.py writes `Tokenizer.to_str()`) may differ there.
_TOKENIZER_IGNORED = ("truncation", "padding", "version")


def data_tokenizer(source: str) -> str | None:
    """The tokenizer.json a token folder `source` was made with (scripts/tokenize.py), or None."""
    path = os.path.join(source, "tokenizer.json") if os.path.isdir(source) else None
    return path if path and os.path.isfile(path) else None


def _tokenizer_meaning(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a readable tokenizer.json ({e})") from None
    _need(isinstance(raw, dict), f"{path}: not a tokenizer.json (expected a JSON object)")
    return {k: v for k, v in raw.items() if k not in _TOKENIZER_IGNORED}


def check_init_tokenizer(src: Source | None, data_source: str) -> None:
    """ConfigError when `train.init_from`'s tokenizer and the one `data.source` was tokenized with
    are both known and differ: the weights would learn ids that mean other text."""
    if src is None:
        return
    theirs, data_tok = src.file("tokenizer.json"), data_tokenizer(data_source)
    if theirs is None or data_tok is None:
        return
    if _tokenizer_meaning(theirs) != _tokenizer_meaning(data_tok):
        raise ConfigError(
            f"train.init_from={src.path} has its own tokenizer ({theirs}), but data.source="
            f"{data_source} was tokenized with another ({data_tok}); tokenize the text with the "
            f"model's: python scripts/tokenize.py --tokenizer={src.path} ..."
        )


def carry_tokenizer(src: Source | None, run_dir: str) -> list[str]:
    """Copies `train.init_from`'s tokenizer files into the run folder `run_dir`, so that
    `sample.py`, `eval.py` and `hf.py export` of the run use the tokenizer its weights know.
    Returns the files copied (none when the source has no tokenizer.json)."""
    if src is None or src.file("tokenizer.json") is None:
        return []
    tokenizer = {n: p for n, p in _side_files(src).items() if n in hf.TOKENIZER_FILES}
    return _copy_tokenizer_files(tokenizer, run_dir)
