"""Reading a checkpoint on a host without the model or the mesh: metadata, arrays, verify, export.

What `scripts/ckpt.py`, `jaxdist.weights` (so `train.init_from`, `sample.py`, `eval.py` and
`hf.py export`) read checkpoints through. Every read of array data here checks the CRC-32s saved
with the step (`integrity`) before it returns: a mismatch is a one-line ConfigError naming the
array and the step, raised before the caller can write anything. Nothing here uses pickle.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import tempfile
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

import jaxdist.checkpoint.integrity as integrity
import jaxdist.checkpoint.processes as processes
from jaxdist.checkpoint.compat import check_matches
from jaxdist.checkpoint.layout import META_ITEM, STATE_ITEM, committed_steps, resolve_step
from jaxdist.checkpoint.trees import (
    PyTree,
    describe_sharding_metadata,
    dtype_of,
    flatten,
    one_line_error,
    path_str,
    shape_of,
    under,
)
from jaxdist.errors import ConfigError

log = logging.getLogger("jaxdist.checkpoint")

# How long `verify_checkpoint` waits for a step whose files vanished while it read them to leave
# the committed steps (a trainer's retention deleting it), seconds.
REMOVAL_WAIT_S = 5.0


def tree_metadata(state_dir: epath.Path) -> PyTree:
    """The saved tree of orbax ArrayMetadata (shape, dtype, sharding, storage name); no data."""
    handler = ocp.PyTreeCheckpointHandler()
    try:
        metadata = handler.metadata(state_dir)
    finally:
        handler.close()
    return getattr(metadata, "tree", metadata)


def saved_arrays(state_dir: epath.Path) -> dict[str, Any]:
    """Path -> orbax ArrayMetadata, in tree order."""
    return flatten(tree_metadata(state_dir))


def read_json_item(item_dir: epath.Path) -> dict[str, Any]:
    """A JSON item of a step folder (our `meta`), as a dict."""
    handler = ocp.JsonCheckpointHandler()
    try:
        return dict(handler.restore(item_dir, args=ocp.args.JsonRestore()))
    finally:
        handler.close()


def _checksums(step_dir: epath.Path) -> dict[str, dict[str, str]]:
    """The step's saved CRC table; {} for a checkpoint of an older version (none saved)."""
    meta_dir = step_dir / META_ITEM
    return (read_json_item(meta_dir) if meta_dir.exists() else {}).get("checksums") or {}


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    """One saved array, as `ckpt.py inspect` lists it."""

    path: str  # `/`-joined tree path, e.g. `params/blocks/0/attn/wq`
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    sharding: str  # the sharding it was saved with


def read_metadata(directory: epath.PathLike, step: int | None = None) -> dict[str, Any]:
    """The JSON metadata of `step` (default newest): `step`, `data_position`, `config`, ...

    Raises:
      ConfigError: the directory, any committed step, or the requested step is missing.
    """
    step_dir, step = resolve_step(directory, step)
    meta_dir = step_dir / META_ITEM
    return {**(read_json_item(meta_dir) if meta_dir.exists() else {}), "step": step}


def array_paths(
    directory: epath.PathLike, step: int | None = None, *, prefix: str = ""
) -> list[ArrayInfo]:
    """Every saved array of `step` (default newest) under `prefix`, from metadata alone."""
    step_dir, step = resolve_step(directory, step)
    meta_dir = step_dir / META_ITEM
    shardings = (read_json_item(meta_dir) if meta_dir.exists() else {}).get("shardings", {})
    infos = []
    for path, md in saved_arrays(step_dir / STATE_ITEM).items():
        if under(path, prefix):
            shape, dtype = shape_of(md), dtype_of(md)
            sharding = shardings.get(path) or describe_sharding_metadata(
                getattr(md, "sharding", None)
            )
            nbytes = math.prod(shape) * dtype.itemsize
            infos.append(ArrayInfo(path, shape, dtype.name, nbytes, sharding))
    return infos


def _restore_numpy(
    state_dir: epath.Path, tree_md: PyTree, selected: set[str]
) -> dict[str, np.ndarray]:
    """Reads the `selected` arrays of a saved tree as numpy; orbax skips PLACEHOLDER leaves."""
    placeholder = getattr(ocp, "PLACEHOLDER", None)  # absent in some orbax: read everything
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree_md)
    item = [
        md if placeholder is None or path_str(kp) in selected else placeholder for kp, md in leaves
    ]
    item = jax.tree_util.tree_unflatten(treedef, item)
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
    handler = ocp.PyTreeCheckpointHandler()
    try:
        out = handler.restore(
            state_dir, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args)
        )
    finally:
        handler.close()
    return {p: np.asarray(v) for p, v in flatten(out).items() if p in selected}


def read_arrays_unchecked(
    directory: epath.PathLike, step: int | None = None, *, prefix: str = ""
) -> dict[str, np.ndarray]:
    """`read_arrays` without the CRC check: the bytes as they decode, damaged or not.

    For code that reports damage itself (`verify_checkpoint`) and tests that damage files on
    purpose; every reader that uses the values calls `read_arrays`.
    """
    step_dir, step = resolve_step(directory, step)
    state_dir = step_dir / STATE_ITEM
    tree_md = tree_metadata(state_dir)
    selected = {path for path in flatten(tree_md) if under(path, prefix)}
    if not selected:
        raise ConfigError(f"checkpoint step {step} in {directory} has no arrays under {prefix!r}")
    return _restore_numpy(state_dir, tree_md, selected)


def read_arrays(
    directory: epath.PathLike, step: int | None = None, *, prefix: str = ""
) -> dict[str, np.ndarray]:
    """The saved arrays under `prefix` (e.g. "params") as whole numpy arrays, by full path.

    Raises:
      ConfigError: no such directory, step or prefix; or a saved shard's CRC-32 differs from the
        one stored at save (one line naming the array and the step).
    """
    step_dir, step = resolve_step(directory, step)
    arrays = read_arrays_unchecked(directory, step, prefix=prefix)
    problems, _ = integrity.mismatches_in(arrays, _checksums(step_dir))
    if problems:
        raise integrity.corrupted_error(problems, directory, step)
    return arrays


def restore_subtree(
    directory: epath.PathLike, abstract: PyTree, *, prefix: str = "params", step: int | None = None
) -> PyTree:
    """Reads the arrays under `prefix` of `step` (default newest) onto the shardings of `abstract`
    (a tree of `jax.ShapeDtypeStruct(sharding=)` shaped like that subtree); the rest of the saved
    state (optimizer moments, ...) is not read. Each device reads only its own shards, and each
    saved shard's CRC-32 is checked (with several processes, by one that holds it whole).

    Raises:
      ConfigError: no such directory or step; an array's path, shape or dtype differs; or a
        checksum differs (one line naming the array and the step, the same on every process).
    """
    step_dir, step = resolve_step(directory, step)
    state_dir = step_dir / STATE_ITEM
    tree_md = tree_metadata(state_dir)
    saved = {p: md for p, md in flatten(tree_md).items() if under(p, prefix)}
    expected = {f"{prefix}/{p}": leaf for p, leaf in flatten(abstract).items()}
    check_matches(saved, expected, f"checkpoint step {step} in {directory}")
    placeholder = getattr(ocp, "PLACEHOLDER", None)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree_md)
    item, restore_args = [], []
    for kp, md in leaves:
        path = path_str(kp)
        want = expected.get(path)
        if want is None:
            item.append(md if placeholder is None else placeholder)
            restore_args.append(ocp.RestoreArgs(restore_type=np.ndarray))
        else:
            item.append(want)
            restore_args.append(
                ocp.ArrayRestoreArgs(
                    sharding=want.sharding, global_shape=want.shape, dtype=want.dtype
                )
            )
    handler = ocp.PyTreeCheckpointHandler()
    try:
        out = handler.restore(
            state_dir,
            args=ocp.args.PyTreeRestore(
                item=jax.tree_util.tree_unflatten(treedef, item),
                restore_args=jax.tree_util.tree_unflatten(treedef, restore_args),
            ),
        )
    finally:
        handler.close()
    got = flatten(out)
    problems = _subtree_mismatches(
        {p: got[p] for p in expected}, _checksums(step_dir), state_dir, tree_md
    )
    if problems:
        raise integrity.corrupted_error(problems, directory, step)
    paths = [
        f"{prefix}/{path_str(kp)}" for kp, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]
    ]
    return jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(abstract), [got[p] for p in paths]
    )


def _subtree_mismatches(
    arrays: dict[str, Any],
    checksums: dict[str, dict[str, str]],
    state_dir: epath.Path,
    tree_md: PyTree,
) -> list[str]:
    """CRC mismatches of restored jax.Arrays: the same list on every process.

    A saved shard that no process holds whole (a split that crosses processes) is read from disk
    by process 0 as numpy, one array at a time, and checked there.
    """
    problems, unchecked = integrity.mismatches_in(arrays, checksums)
    parts = processes.gather_json(unchecked)
    nobody = {
        path: {k: v for k, v in sums.items() if all(k in part.get(path, {}) for part in parts)}
        for path, sums in parts[0].items()
    }
    if jax.process_index() == 0:
        for path, sums in nobody.items():
            if sums:
                value = _restore_numpy(state_dir, tree_md, {path})[path]
                problems += integrity.checksum_mismatches(path, value, sums)
    return [line for part in processes.gather_json(problems) for line in part]


def _stored_array_names(state_dir: epath.Path) -> set[str]:
    """Names of the arrays present in storage (the OCDBT key-value store, or zarr folders)."""
    if (state_dir / "manifest.ocdbt").exists():
        import tensorstore as ts  # orbax's storage layer; only verify lists its keys directly

        base = os.fspath(state_dir)
        base = base if "://" in base else "file://" + os.path.abspath(base)
        kvstore = ts.KvStore.open({"driver": "ocdbt", "base": base.rstrip("/") + "/"}).result()
        keys = [k.decode() for k in kvstore.list().result()]
    else:
        keys = [
            f"{d.name}/{f.name}" for d in state_dir.iterdir() if d.is_dir() for f in d.iterdir()
        ]
    return {k.rsplit("/", 1)[0] for k in keys if k.endswith(("/.zarray", "/zarr.json"))}


@dataclasses.dataclass
class VerifyReport:
    """What `verify_checkpoint` found; the checkpoint is good when `problems` is empty."""

    step: int
    arrays: int = 0  # arrays read back and found finite
    nbytes: int = 0  # their bytes
    problems: list[str] = dataclasses.field(default_factory=list)  # one line each
    # Not failures: e.g. the step first chosen was removed by retention while it was read.
    notes: list[str] = dataclasses.field(default_factory=list)


def verify_checkpoint(directory: epath.PathLike, step: int | None = None) -> VerifyReport:
    """Reads every array of `step` (default newest) back, one at a time, against the metadata.

    Problems reported: metadata unreadable; the arrays in storage, in orbax's metadata and in our
    meta item differ; an array fails to read (a data file missing or corrupted); a shard's CRC-32
    differs from the one stored at save (a silently corrupted data file); an array holds NaN or
    Inf. Host memory stays within the largest single array.

    A step that a running trainer's `checkpoint.keep` deletes while it is read is no failure: with
    `step=None` the newest committed step is checked instead and `notes` says so; a `step` asked
    for by number raises ConfigError saying it was removed.
    """
    notes: list[str] = []
    for _ in range(10):  # a trainer saving every step could remove each newest in turn
        step_dir, chosen = resolve_step(directory, step)
        files = _files(step_dir)
        report = _verify_step(step_dir, chosen)
        if not report.problems or not _removed_while_read(directory, chosen, files):
            report.notes = notes + report.notes
            return report
        removed = (
            f"step {chosen} in {directory} was removed while it was being read (retention: a "
            "trainer's checkpoint.keep), which is not a failure"
        )
        if step is not None:
            raise ConfigError(f"{removed}; it no longer exists: verify a committed step")
        notes.append(f"{removed}; checking the newest committed step instead")
        log.info("%s", notes[-1])
    raise ConfigError(f"every step of {directory} was removed while it was being read")


def _files(step_dir: epath.Path) -> set[str]:
    """The files under a local step folder (empty for a URL: no removal detection there)."""
    root = os.fspath(step_dir)
    if "://" in root:
        return set()
    return {os.path.join(d, f) for d, _, names in os.walk(root) for f in names}


def _removed_while_read(directory: epath.PathLike, step: int, files_before: set[str]) -> bool:
    """Whether `step` left the committed steps during the read (a retention deletion).

    Orbax deletes a step in place, file by file, so its commit marker may outlive the arrays for
    a moment: when files present before the read are gone, wait up to REMOVAL_WAIT_S for it.
    """
    deadline = time.monotonic() + REMOVAL_WAIT_S
    while step in committed_steps(directory):
        if not any(not os.path.exists(f) for f in files_before) or time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _verify_step(step_dir: epath.Path, step: int) -> VerifyReport:
    report = VerifyReport(step)
    state_dir = step_dir / STATE_ITEM
    checksums: dict[str, dict[str, str]] = {}
    try:
        meta = read_json_item(step_dir / META_ITEM)
        listed = set(meta.get("shardings", {}))
        checksums = meta.get("checksums") or {}  # absent in checkpoints of older versions
    except Exception as err:
        listed = None
        report.problems.append(f"{step_dir / META_ITEM} unreadable ({one_line_error(err)})")
    try:
        tree_md = tree_metadata(state_dir)
        saved = flatten(tree_md)
    except Exception as err:
        report.problems.append(f"array metadata in {state_dir} unreadable ({one_line_error(err)})")
        return report

    if listed is not None:
        report.problems += [
            f"{p} is in {META_ITEM} but not in the array metadata"
            for p in sorted(listed - set(saved))
        ]
        report.problems += [
            f"{p} is in the array metadata but not in {META_ITEM}"
            for p in sorted(set(saved) - listed)
        ]
    missing = set()
    try:
        stored = _stored_array_names(state_dir)
    except Exception as err:
        report.problems.append(f"storage index of {state_dir} unreadable ({one_line_error(err)})")
    else:
        names = {path: getattr(md, "name", None) for path, md in saved.items()}
        for path, name in names.items():
            if name is not None and name not in stored:
                missing.add(path)
                report.problems.append(f"{path} is missing on disk (no {name} in {state_dir})")
        report.problems += [
            f"{name} is on disk in {state_dir} but not in the metadata"
            for name in sorted(stored - set(names.values()))
        ]

    for path, md in saved.items():
        if path in missing:
            continue
        try:
            value = _restore_numpy(state_dir, tree_md, {path})[path]
        except Exception as err:
            report.problems.append(f"{path} unreadable ({one_line_error(err)})")
            continue
        if value.shape != shape_of(md):
            report.problems.append(f"{path} read back as {value.shape}, saved as {shape_of(md)}")
            continue
        mismatches = integrity.checksum_mismatches(path, value, checksums.get(path, {}))
        if mismatches:
            report.problems += mismatches
            continue
        if jax.numpy.issubdtype(value.dtype, jax.numpy.inexact):
            finite = np.isfinite(value if value.dtype.kind in "fc" else value.astype(np.float32))
            if not finite.all():
                report.problems.append(
                    f"{path} has non-finite values ({int((~finite).sum())} of {value.size})"
                )
                continue
        report.arrays += 1
        report.nbytes += value.nbytes
    return report


def export_params(
    directory: epath.PathLike,
    out: str | os.PathLike,
    step: int | None = None,
    *,
    force: bool = False,
) -> dict[str, np.ndarray]:
    """Writes the `params` subtree of `step` (default newest) as one `.npz` or `.safetensors`.

    Keys are `/`-joined paths inside `params` (`blocks/0/attn/wq`). `.npz` cannot hold bfloat16 or
    float8, so those are widened to float32 there (exactly); `.safetensors` keeps them. The file
    is written under a temporary name next to `out` and renamed; whatever fails, the temporary
    file is removed. Returns the arrays written.

    Raises:
      ConfigError: `out` has another suffix, is a folder, its folder is missing, or it exists and
        `force` is False; or the checkpoint cannot be read (a CRC mismatch included): then
        nothing is written.
    """
    out = os.fspath(out)
    if not out.endswith((".npz", ".safetensors")):
        raise ConfigError(f"output file {out} must end with .npz or .safetensors")
    if os.path.isdir(out):
        raise ConfigError(f"output file {out} is a folder; name a file (e.g. {out}/params.npz)")
    if os.path.lexists(out) and not force:
        raise ConfigError(f"output file {out} already exists; pass --force to overwrite it")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise ConfigError(f"output file {out}: the folder {parent} does not exist")
    if out.endswith(".safetensors"):
        try:  # before reading anything, so a missing extra costs nothing
            from safetensors.numpy import save_file  # an optional extra
        except ImportError:
            raise ConfigError(
                f"writing {out} needs the safetensors package: pip install -e '.[export]' "
                "(or write .npz)"
            ) from None
    arrays = {
        path.removeprefix("params/"): np.ascontiguousarray(a)
        for path, a in read_arrays(directory, step, prefix="params").items()
    }
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(out)}.", suffix=".tmp", dir=parent)
    try:
        with os.fdopen(fd, "wb") as f:  # a file object, so numpy adds no suffix
            if out.endswith(".npz"):
                arrays = {
                    k: a if a.dtype.kind in "biufc" else a.astype(np.float32)
                    for k, a in arrays.items()
                }
                np.savez(f, **arrays)
        if out.endswith(".safetensors"):
            save_file(arrays, tmp)
        os.replace(tmp, out)
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise
    return arrays
