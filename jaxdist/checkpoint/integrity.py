"""CRC-32 integrity of saved arrays: a checksum per shard at save, checked by every read.

`Checkpointer.save` stores `{path: {slice key: crc32}}` in the step's metadata (`checksums`). The
trainer's restore, every offline read (`read_arrays`, `restore_subtree`: what `ckpt.py export`,
`train.init_from`, `sample.py`, `eval.py` and `hf.py export` go through) and `ckpt.py verify`
compare what they read against it, so a silently flipped bit in a data file is never used.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from jaxdist.checkpoint.trees import PyTree, flatten
from jaxdist.errors import ConfigError

Index = tuple[slice, ...]  # start/stop ints, one slice per dimension


def slice_key(index: Sequence[slice], shape: Sequence[int]) -> str:
    """A shard's place in its global array, `0:8,0:64` (`` for a scalar)."""
    return ",".join(
        f"{sl.start or 0}:{dim if sl.stop is None else sl.stop}"
        for sl, dim in zip(index, shape, strict=True)
    )


def parse_slice_key(key: str) -> Index:
    """The slices of a `slice_key`."""
    return tuple(slice(*map(int, part.split(":"))) for part in key.split(",") if part)


def crc32(block: np.ndarray) -> str:
    """CRC-32 of an array's bytes in C order, as 8 hex digits (zlib releases the GIL)."""
    block = np.ascontiguousarray(block)
    return f"{zlib.crc32(block.reshape(-1).view(np.uint8)) & 0xFFFFFFFF:08x}"


def shard_checksums(state: PyTree) -> dict[str, dict[str, str]]:
    """{path: {slice key: CRC-32}} of the shards this process writes (replica 0 of each).

    Each process sums its own shards from a host copy of them; `Checkpointer.save` gathers the
    processes' results into the step's metadata.
    """
    jobs: list[tuple[str, str, Any]] = []
    for path, leaf in flatten(state).items():
        if isinstance(leaf, jax.Array):
            for shard in leaf.addressable_shards:
                if shard.replica_id == 0:
                    jobs.append((path, slice_key(shard.index, leaf.shape), shard.data))
        else:  # a host value: process 0 stands for it
            if jax.process_index() == 0:
                value = np.asarray(leaf)
                jobs.append((path, slice_key((slice(None),) * value.ndim, value.shape), value))
    if not jobs:
        return {}
    host = jax.device_get([data for _, _, data in jobs])
    with ThreadPoolExecutor(max_workers=min(8, len(jobs))) as pool:
        sums = list(pool.map(crc32, host))
    out: dict[str, dict[str, str]] = {}
    for (path, key, _), crc in zip(jobs, sums, strict=True):
        out.setdefault(path, {})[key] = crc
    return out


def inside(index: Sequence[slice], block: Sequence[slice]) -> bool:
    """Whether the slices `index` lie within `block` (both start/stop ints)."""
    return all(a.start >= b.start and a.stop <= b.stop for a, b in zip(index, block, strict=True))


def checksum_mismatches(
    path: str, value: np.ndarray, saved: Mapping[str, str], offset: Sequence[slice] | None = None
) -> list[str]:
    """One line per saved shard of `value` whose CRC-32 differs from `saved`.

    Args:
      path: the array's tree path, for the message.
      value: the array read back, whole, or the block of it at `offset` (a restored shard).
      saved: {slice key: CRC-32} from the metadata; shards outside the block are skipped.
      offset: where `value` sits in the global array (None: it is the whole array).
    """
    problems = []
    for key, want in saved.items():
        index = parse_slice_key(key)
        if offset is not None:  # offset: start/stop ints
            if not inside(index, offset):
                continue
            index = tuple(
                slice(a.start - b.start, a.stop - b.start)
                for a, b in zip(index, offset, strict=True)
            )
        got = crc32(value[index])
        if got != want:
            problems.append(
                f"{path} shard [{key}]: checksum mismatch (saved crc32 {want}, read {got}); "
                "its data file is corrupted"
            )
    return problems


def _normalized(index: Sequence[slice], shape: Sequence[int]) -> Index:
    return tuple(
        slice(sl.start or 0, dim if sl.stop is None else sl.stop)
        for sl, dim in zip(index, shape, strict=True)
    )


def _local_blocks(leaf: jax.Array) -> list[tuple[Index, np.ndarray]]:
    """This process's distinct shards of `leaf` (replicas once), as (index, host copy)."""
    seen: dict[tuple[tuple[int, int], ...], tuple[Index, np.ndarray]] = {}
    for shard in leaf.addressable_shards:
        index = _normalized(shard.index, leaf.shape)
        key = tuple((s.start, s.stop) for s in index)  # slices are unhashable before 3.12
        if key not in seen:
            seen[key] = (index, np.asarray(shard.data))
    return list(seen.values())


def _assemble(
    index: Index, blocks: list[tuple[Index, np.ndarray]], dtype: Any
) -> np.ndarray | None:
    """The region `index` of an array pieced together from `blocks`, or None if they miss a part."""
    for where, data in blocks:  # the common case: the mesh saved with, one block is the shard
        if all(a.start == b.start and a.stop == b.stop for a, b in zip(index, where)):
            return data
    out = np.empty(tuple(s.stop - s.start for s in index), dtype)
    covered = 0
    for where, data in blocks:
        cut = [(max(a.start, b.start), min(a.stop, b.stop)) for a, b in zip(index, where)]
        if any(lo >= hi for lo, hi in cut):
            continue
        dst = tuple(slice(lo - a.start, hi - a.start) for (lo, hi), a in zip(cut, index))
        src = tuple(slice(lo - b.start, hi - b.start) for (lo, hi), b in zip(cut, where))
        out[dst] = data[src]
        covered += math.prod(hi - lo for lo, hi in cut)
    return out if covered == out.size else None


def mismatches_in(
    tree: PyTree, checksums: Mapping[str, Mapping[str, str]], *, prefix: str = ""
) -> tuple[list[str], dict[str, dict[str, str]]]:
    """Checks every saved shard of `tree` that this process holds against `checksums`.

    Args:
      tree: arrays as read: numpy (whole) or jax.Arrays (their addressable shards are used; a
        saved shard split over several of them is pieced together).
      checksums: the step's `checksums` metadata, keyed by full path.
      prefix: the path of `tree` inside the saved state (`params` for a params subtree).

    Returns:
      (problems, unchecked): one line per mismatch; and {path: {slice key: crc}} of the saved
      shards this process holds no complete copy of (another process may; only possible for
      arrays that are not fully addressable).
    """
    problems: list[str] = []
    unchecked: dict[str, dict[str, str]] = {}
    for sub, leaf in flatten(tree).items():
        path = f"{prefix}/{sub}" if prefix and sub else (prefix or sub)
        saved = checksums.get(path)
        if not saved:
            continue
        if not isinstance(leaf, jax.Array):
            problems += checksum_mismatches(path, np.asarray(leaf), saved)
            continue
        blocks = _local_blocks(leaf)
        for key, want in saved.items():
            block = _assemble(parse_slice_key(key), blocks, leaf.dtype)
            if block is None:
                unchecked.setdefault(path, {})[key] = want
            elif crc32(block) != want:
                problems += checksum_mismatches(path, block, {key: want}, parse_slice_key(key))
    return problems, unchecked


def corrupted_error(problems: Sequence[str], directory: Any, step: int) -> ConfigError:
    """The one line a reader raises for a step whose CRCs do not match: the array and the step."""
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return ConfigError(
        f"checkpoint step {step} in {directory} is corrupted: {problems[0]}{more}; nothing was "
        f"read from it (`python scripts/ckpt.py verify {directory} --step {step}` lists every "
        "damaged array; read another step with --step)"
    )
