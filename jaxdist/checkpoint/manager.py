"""Checkpoints: the train state plus JSON metadata, saved with orbax's CheckpointManager.

One folder per saved step under the checkpoint directory::

    checkpoints/
      40/                       # committed: written as 40.orbax-checkpoint-tmp, then renamed
        _CHECKPOINT_METADATA    # orbax: item handlers, init and commit timestamps
        commit_success.txt      # orbax's commit marker
        state/                  # the train-state pytree: OCDBT + zarr, a data folder per process
        meta/metadata           # JSON: data_position, config, versions, per-array shardings,
                                #   a CRC-32 per saved array shard (`checksums`)
      50.orbax-checkpoint-tmp/  # a save in flight, or killed mid-write: never read

Saves are asynchronous and cooperative: every process calls `Checkpointer.save` with the same
step, each writes the shards it owns, and orbax's primary process commits the step (the rename)
once all have finished. A restore reads only the shards each process needs for the shardings in
`abstract_state`, so a checkpoint written on one mesh restores onto any mesh with the same global
shapes.

The functions after `Checkpointer` (`read_metadata`, `array_paths`, `read_arrays`,
`verify_checkpoint`, `export_params`) read a checkpoint as numpy on a host with no accelerator,
without the model or the mesh; `scripts/ckpt.py` wraps them. Nothing here uses pickle.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import logging
import math
import operator
import os
import sys
import threading
import time
import traceback
import types
import zlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import PartitionSpec as P

from jaxdist import compression, orbax_reads
from jaxdist.errors import ConfigError

log = logging.getLogger(__name__)

PyTree = Any

STATE_ITEM = "state"
META_ITEM = "meta"
FORMAT = "jaxdist-checkpoint/1"
# Orbax writes this file into a step folder just before the final rename. A `<step>` folder
# without it (and without a commit timestamp in _CHECKPOINT_METADATA) was never committed by
# orbax, e.g. it was partly copied, and is never read.
COMMIT_MARKER = getattr(
    getattr(ocp.path, "atomicity_types", None), "COMMIT_SUCCESS_FILE", "commit_success.txt"
)


# ------------------------------------------------------------------------------------------------
# Step folders: which ones count.


def _is_committed(step_metadata: Any) -> bool:
    """Whether an orbax step folder carries orbax's commit marker (file, or commit timestamp)."""
    if (step_metadata.path / COMMIT_MARKER).exists():
        return True
    try:
        return step_metadata.commit_timestamp_nsecs is not None
    except Exception:  # an unreadable _CHECKPOINT_METADATA is no commit
        return False


@dataclasses.dataclass(frozen=True)
class _CommittedStepFormat:
    """Orbax's standard `<step>` folder names, counting only folders with orbax's commit marker.

    Orbax skips its `*.orbax-checkpoint-tmp-*` folders itself, but on a local disk it takes any
    other `<step>` folder as committed, so a partly copied folder would be read. This hides those.
    """

    inner: Any = dataclasses.field(default_factory=ocp.path.step.standard_name_format)

    def build_name(self, step: int) -> str:
        return self.inner.build_name(step)

    def find_all(self, base_path: epath.PathLike) -> list[Any]:
        return [m for m in self.inner.find_all(base_path) if _is_committed(m)]

    def find_step(self, base_path: epath.PathLike, step: int) -> Any:
        found = self.inner.find_step(base_path, step)
        if not _is_committed(found):
            raise ValueError(f"step folder {found.path} has no orbax commit marker")
        return found


class _PreemptionPolicy:  # an orbax `SaveDecisionPolicy` (a Protocol: matched by shape)
    """orbax's preemption save decision, remembering whether it fired (the loop then stops).

    Several processes: `context.reached_preemption` is JAX's preemption sync point, true at one
    step on every process (what orbax's `PreemptionCheckpointingPolicy` reads). One process has no
    preemption service, so `stop_requested` (the loop's SIGTERM/SIGINT flag) stands in for it.
    """

    def __init__(self, stop_requested: Callable[[], bool]):
        self._stop_requested = stop_requested
        self.reached = False

    def should_save(self, step, previous_steps, *, context) -> bool:
        del step, previous_steps
        self.reached = bool(context.reached_preemption or self._stop_requested())
        return self.reached


def _as_path(directory: epath.PathLike) -> epath.Path:
    """`directory` as an epath; a local path made absolute (orbax refuses relative ones)."""
    text = os.fspath(directory)
    return epath.Path(text if "://" in text else os.path.abspath(text))


def _step_dir(directory: epath.Path, step: int) -> epath.Path:
    return directory / _CommittedStepFormat().build_name(step)


def committed_steps(directory: epath.PathLike) -> list[int]:
    """Steps under `directory` that orbax finished committing, ascending; [] if it is missing."""
    directory = _as_path(directory)
    if not directory.is_dir():
        return []
    return sorted(m.step for m in _CommittedStepFormat().find_all(directory))


def _uncommitted_step_folders(directory: epath.Path) -> list[str]:
    """`<step>` folders that look like checkpoints but were never committed (e.g. partly copied)."""
    if not directory.is_dir():
        return []
    committed = set(committed_steps(directory))
    names = [p.name for p in directory.iterdir() if p.name.isdigit() and p.is_dir()]
    return sorted((n for n in names if int(n) not in committed), key=int)


def _resolve_step(directory: epath.PathLike, step: int | None) -> tuple[epath.Path, int]:
    """The folder of `step` (default: the newest committed), or ConfigError saying what is wrong."""
    directory = _as_path(directory)
    if not directory.is_dir():
        what = "is not a directory" if directory.exists() else "does not exist"
        raise ConfigError(f"checkpoint directory {directory} {what}")
    steps = committed_steps(directory)
    if not steps:
        raise ConfigError(f"no committed checkpoint in {directory} (expected <step> folders)")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ConfigError(f"step {step} is not a committed checkpoint in {directory}; have {steps}")
    return _step_dir(directory, step), step


# ------------------------------------------------------------------------------------------------
# Small helpers.


def _key_str(key: Any) -> str:
    for attr in ("key", "name", "idx"):  # DictKey, GetAttrKey (NamedTuple fields), SequenceKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_str(keypath: Sequence[Any]) -> str:
    """`/`-joined tree path such as `opt_state/0/mu/dense/w`; equal for a state and its metadata."""
    return "/".join(_key_str(k) for k in keypath)


def _flatten(tree: PyTree) -> dict[str, Any]:
    return {path_str(kp): leaf for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def one_line_error(err: BaseException, limit: int = 300) -> str:
    """`Type: message` of the root cause (orbax wraps tensorstore's error), on one line."""
    while err.__cause__ is not None:
        err = err.__cause__
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _shape_of(md: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in (getattr(md, "shape", None) or ()))


def _dtype_of(md: Any) -> np.dtype:
    dtype = getattr(md, "dtype", None)  # not `or`: an np.dtype is falsy (its len() is 0)
    return np.dtype(np.float32 if dtype is None else dtype)


def _fmt_array(shape: Sequence[int], dtype: Any) -> str:
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


def _describe_sharding_metadata(sharding: Any) -> str:
    """The same string from orbax's ShardingMetadata, for checkpoints without our meta item."""
    spec = getattr(sharding, "partition_spec", None)
    names = getattr(sharding, "axis_names", None)
    sizes = getattr(sharding, "shape", None)
    if spec is None or names is None or sizes is None:
        return type(sharding).__name__ if sharding is not None else "unknown"
    return _fmt_sharding(spec, dict(zip(names, list(sizes), strict=False)))


def _jaxdist_version() -> str:
    import jaxdist

    if getattr(jaxdist, "__version__", None):
        return str(jaxdist.__version__)
    try:
        return importlib.metadata.version("jaxdist")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _all_processes_ok(ok: bool) -> bool:
    """True only if `ok` holds on every process, so that all processes take the same branch."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.asarray(ok, np.int32))))


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


# ------------------------------------------------------------------------------------------------
# Checksums: one CRC-32 per saved array shard, so a flipped bit in a data file is found.


def _slice_key(index: Sequence[slice], shape: Sequence[int]) -> str:
    """A shard's place in its global array, `0:8,0:64` (`` for a scalar)."""
    return ",".join(
        f"{sl.start or 0}:{dim if sl.stop is None else sl.stop}"
        for sl, dim in zip(index, shape, strict=True)
    )


def _parse_slice_key(key: str) -> tuple[slice, ...]:
    return tuple(slice(*map(int, part.split(":"))) for part in key.split(",") if part)


def _crc32(block: np.ndarray) -> str:
    """CRC-32 of an array's bytes in C order, as 8 hex digits (zlib releases the GIL)."""
    block = np.ascontiguousarray(block)
    return f"{zlib.crc32(block.reshape(-1).view(np.uint8)) & 0xFFFFFFFF:08x}"


def shard_checksums(state: PyTree) -> dict[str, dict[str, str]]:
    """{path: {slice key: CRC-32}} of the shards this process writes (replica 0 of each).

    Each process sums its own shards from a host copy of them; `Checkpointer.save` gathers the
    processes' results into the step's metadata.
    """
    jobs: list[tuple[str, str, Any]] = []
    for path, leaf in _flatten(state).items():
        if isinstance(leaf, jax.Array):
            for shard in leaf.addressable_shards:
                if shard.replica_id == 0:
                    jobs.append((path, _slice_key(shard.index, leaf.shape), shard.data))
        else:  # a host value: process 0 stands for it
            if jax.process_index() == 0:
                value = np.asarray(leaf)
                jobs.append((path, _slice_key((slice(None),) * value.ndim, value.shape), value))
    if not jobs:
        return {}
    host = jax.device_get([data for _, _, data in jobs])
    with ThreadPoolExecutor(max_workers=min(8, len(jobs))) as pool:
        sums = list(pool.map(_crc32, host))
    out: dict[str, dict[str, str]] = {}
    for (path, key, _), crc in zip(jobs, sums, strict=True):
        out.setdefault(path, {})[key] = crc
    return out


def _gather_json(obj: Any) -> list[Any]:
    """`obj` (JSON-serialisable) from every process, in process order."""
    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([data.size], np.int64)))
    sizes = sizes.reshape(-1)
    buf = np.zeros(int(sizes.max()), np.uint8)
    buf[: data.size] = data
    every = np.asarray(multihost_utils.process_allgather(buf))
    return [json.loads(bytes(every[i, : int(n)])) for i, n in enumerate(sizes)]


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
        index = _parse_slice_key(key)
        if offset is not None:  # offset: start/stop ints, as _check_restored makes them
            if not _inside(index, offset):
                continue
            index = tuple(
                slice(a.start - b.start, a.stop - b.start)
                for a, b in zip(index, offset, strict=True)
            )
        got = _crc32(value[index])
        if got != want:
            problems.append(
                f"{path} shard [{key}]: checksum mismatch (saved crc32 {want}, read {got}); "
                "its data file is corrupted"
            )
    return problems


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


# ------------------------------------------------------------------------------------------------
# The trainer's checkpointer.


class Checkpointer:
    """Saves the train state every `every` steps, keeps the newest `keep`, restores onto any mesh.

    Every process of a job constructs it and calls `save`/`restore` with the same arguments;
    orbax makes each process write its own shards and commits the step once all are done.

    Example::

        ckpt = Checkpointer(workdir / "checkpoints", every=100, keep=3, config_json=cfg)
        if ckpt.latest_step() is not None:
            check_config_compatible(ckpt.saved_config(), cfg)
            state, meta = ckpt.restore(abstract_state)  # ShapeDtypeStructs with sharding=
            start = meta["data_position"]
        for step in range(start + 1, steps + 1):
            state, metrics = train_step(state, batches.get(step - 1))
            ckpt.save(step, state, data_position=step)  # when due; writes in the background
        ckpt.save(steps, state, data_position=steps, force=True)
        ckpt.close()  # waits for the last write
    """

    def __init__(
        self,
        directory: epath.PathLike,
        *,
        every: int,
        keep: int,
        config_json: dict[str, Any] | None,
        async_save: bool = True,
        stop_requested: Callable[[], bool] | None = None,
    ):
        """Opens (or creates) a checkpoint directory.

        Args:
          directory: the checkpoint folder; a local path or any URL orbax accepts (gs://...).
          every: save every this many steps; 0 turns periodic saves off (`force=True` still saves).
          keep: keep the newest this many committed steps; 0 keeps all.
          config_json: the resolved config, stored with every step; must be JSON-serialisable.
          async_save: write in a background thread once the state is copied to host memory.
          stop_requested: in a single process, whether a stop (SIGTERM/SIGINT) was asked for;
            `should_save` is then true and `preempted` says why. Several processes use JAX's
            preemption service instead.
        """
        self.every = _non_negative_int(every, "checkpoint.every", "steps; 0 = off")
        self.keep = _non_negative_int(keep, "checkpoint.keep", "0 = keep all")
        try:
            json.dumps(config_json)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"config is not JSON-serialisable: {one_line_error(err)}") from None
        self.directory = _as_path(directory)
        self._config_json = config_json
        # Committed steps that failed to restore; moved aside before the next save.
        self._unreadable: set[int] = set()
        self._in_flight: int | None = None  # the step of a save that may still be writing
        _silence_failed_writes()  # a background save's failure is reported once, by `wait`/`save`
        # When to save is orbax's decision: a fixed interval, or a preemption (checked first, on
        # every call, so that every process asks JAX's sync point at every step).
        self._preemption = _PreemptionPolicy(stop_requested or (lambda: False))
        policies: list[Any] = [self._preemption]
        if self.every:
            policies.append(ocp.checkpoint_managers.FixedIntervalPolicy(self.every))
        self._save_policy = ocp.checkpoint_managers.AnySavePolicy(policies)
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=self._save_policy,
            step_name_format=_CommittedStepFormat(),
            preservation_policy=ocp.checkpoint_managers.LatestN(n=self.keep or None),
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,  # tmp folders of saves killed mid-write
            create=True,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=(STATE_ITEM, META_ITEM)
        )
        # A `<step>` folder without orbax's commit marker is a save or a deletion (orbax deletes
        # old steps in place) cut short, or a partial copy: never read, and moved aside once so
        # that it is not warned about at every start. The primary process renames; all wait.
        ignored = _uncommitted_step_folders(self.directory)
        if ignored:
            stamp = time.time_ns()
            log.warning(
                "checkpoint folders without orbax's commit marker in %s (a save or deletion cut "
                "short, or a partial copy), moved aside to <step>.uncommitted-%d: %s",
                self.directory,
                stamp,
                ", ".join(ignored),
            )
            if jax.process_index() == 0:
                for name in ignored:
                    src = self.directory / name
                    if src.exists():
                        src.rename(self.directory / f"{name}.uncommitted-{stamp}")
            _barrier("jaxdist_checkpoint_uncommitted_aside")
            self._manager.reload()

    # -- queries -----------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Committed steps, ascending, and a save of this process still being written.

        Steps that `restore` found unreadable are left out.
        """
        return sorted(s for s in self._manager.all_steps() if s not in self._unreadable)

    def latest_step(self) -> int | None:
        """The newest committed step, or None when the directory holds no checkpoint."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def saved_config(self, step: int | None = None) -> dict[str, Any] | None:
        """The config stored with `step` (default: the newest whose metadata reads), or None.

        Reads one small JSON file, so a resume can run `check_config_compatible` before arrays.
        """
        for candidate in [step] if step is not None else self.all_steps()[::-1]:
            try:
                return self._read_meta(candidate).get("config")
            except Exception as err:
                log.warning("checkpoint step %d: metadata unreadable (%s)", candidate, err)
        return None

    def _read_meta(self, step: int) -> dict[str, Any]:
        return _read_json_item(_step_dir(self.directory, step) / META_ITEM)

    def should_save(self, step: int) -> bool:
        """True every `every` steps and when a preemption was signalled, unless `step` is saved.

        orbax's policies decide (`FixedIntervalPolicy`, and the preemption policy above), as in
        `CheckpointManager.should_save`, but over the steps this class counts: a committed step
        that failed to restore is not "saved" (the manager would still count it). With several
        processes JAX's preemption sync point is asked, which every process must do once per
        step: call this once per step on every process, then `save(..., force=True)`.
        """
        step = int(step)
        saved = self.all_steps()
        if saved and saved[-1] >= step:
            return False
        context = ocp.checkpoint_managers.DecisionContext(
            is_saving_in_progress=False,  # neither policy waits for a save in flight
            reached_preemption=self._manager.reached_preemption(step),
            multiprocessing_options=ocp.options.MultiprocessingOptions(),
        )
        # A `PolicyCheckpointInfo` (a Protocol, so any object with these fields).
        now = types.SimpleNamespace(
            step=step, time=datetime.datetime.now(tz=datetime.UTC), metrics=None
        )
        return bool(self._save_policy.should_save(now, previous_steps=[], context=context))

    @property
    def preempted(self) -> bool:
        """Whether the last `should_save` was true because of a preemption (then stop)."""
        return self._preemption.reached

    # -- save --------------------------------------------------------------------------------

    def save(self, step: int, state: PyTree, *, data_position: int, force: bool = False) -> bool:
        """Starts writing `state` as `step` if due (or `force`); returns whether it started.

        Returns once the state is copied to host memory: the caller may donate its buffers next.

        Args:
          step: the training step the state is at.
          state: the train-state pytree of jax.Arrays.
          data_position: batches the data iterator has consumed, so a resume skips exactly those.
          force: save even if `should_save(step)` is False; never overwrites a committed step.
        """
        step = int(step)
        if not (force or self.should_save(step)):
            return False
        self._move_aside_unusable(step)
        if step in self.all_steps():
            log.info("checkpoint step %d is already in %s", step, self.directory)
            return False
        leaves = _flatten(state)
        meshes = [
            leaf.sharding.mesh
            for leaf in leaves.values()
            if isinstance(getattr(leaf, "sharding", None), jax.sharding.NamedSharding)
        ]
        checksums: dict[str, dict[str, str]] = {}
        for part in _gather_json(shard_checksums(state)):  # a collective: every process saves
            for path, sums in part.items():
                checksums.setdefault(path, {}).update(sums)
        meta = {
            "format": FORMAT,
            "step": step,
            "data_position": int(data_position),
            "config": self._config_json,
            "jaxdist_version": _jaxdist_version(),
            "jax_version": jax.__version__,
            "process_count": jax.process_count(),
            "mesh": {k: int(v) for k, v in meshes[0].shape.items()} if meshes else None,
            "shardings": {
                p: describe_sharding(getattr(x, "sharding", None)) for p, x in leaves.items()
            },
            "checksums": checksums,
        }
        args = ocp.args.Composite(
            **{STATE_ITEM: ocp.args.StandardSave(state), META_ITEM: ocp.args.JsonSave(meta)}
        )
        try:  # a failure of the previous (background) save surfaces here too
            started = bool(self._manager.save(step, args=args, force=True))
        except Exception as err:  # most often the previous save, still in flight, failed
            raise self._write_error(err, self._in_flight or step) from None
        if started:
            self._in_flight = step
        return started

    def _move_aside_unusable(self, step: int) -> None:
        """Renames folders a save would collide with: an uncommitted `step`, unreadable steps.

        Renamed (`<step>.unreadable-<ns>`), not deleted, so they can still be examined; orbax and
        this module ignore such names. The primary process renames; all wait for it.
        """
        targets = {s: "unreadable" for s in self._unreadable}
        if _step_dir(self.directory, step).exists() and step not in self._manager.all_steps():
            targets[step] = "uncommitted"  # orbax could not rename its tmp folder onto it
        if not targets:
            return
        self._manager.wait_until_finished()
        stamp = time.time_ns()
        for bad, why in sorted(targets.items()):
            src = _step_dir(self.directory, bad)
            if jax.process_index() == 0 and src.exists():
                dst = src.parent / f"{src.name}.{why}-{stamp}"
                log.warning("moving %s checkpoint folder %s aside to %s", why, src, dst.name)
                src.rename(dst)
        _barrier(f"jaxdist_checkpoint_move_aside_{step}")  # the same name on every process
        self._unreadable.clear()
        self._manager.reload()

    def wait(self) -> None:
        """Blocks until the last save is committed; CheckpointWriteError if it failed."""
        try:
            self._manager.wait_until_finished()
        except Exception as err:
            raise self._write_error(err, self._in_flight) from None
        self._in_flight = None

    def close(self) -> None:
        """Waits for pending saves and stops orbax's background threads."""
        try:
            self._manager.close()
        except Exception as err:
            raise self._write_error(err, self._in_flight) from None

    def _write_error(self, err: BaseException, step: int | None) -> CheckpointWriteError:
        """One line for a save that failed: which step, where, why; the older steps are intact."""
        self._in_flight = None
        root = err
        while root.__cause__ is not None:
            root = root.__cause__
        cause = one_line_error(err)
        if "No space left on device" in str(root) or "os_error_code='28'" in str(root):
            why = "no space left on device"
            hint = "free space (or lower checkpoint.keep), then rerun the command to resume"
        else:
            why, hint = cause, "rerun the command to resume from the last committed step"
        kept = committed_steps(self.directory)
        older = f"steps {', '.join(map(str, kept))}" if kept else "none"
        what = f"checkpoint step {step}" if step is not None else "a checkpoint"
        return CheckpointWriteError(
            f"{what} could not be written to {self.directory}: {why}; the committed checkpoints "
            f"are untouched ({older}); {hint}"
        )

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- restore -----------------------------------------------------------------------------

    def restore(
        self, abstract_state: PyTree, step: int | None = None
    ) -> tuple[PyTree, dict[str, Any]]:
        """Reads a checkpoint onto the shardings of `abstract_state`, resharding as it reads.

        With `step=None` it reads the newest committed step; if that is unreadable it logs a
        warning and falls back to the next older step, and so on.

        Args:
          abstract_state: the train-state pytree of `jax.ShapeDtypeStruct(shape, dtype,
            sharding=...)` for the current mesh (e.g. `jax.eval_shape` plus the shardings).
          step: a specific step, or None.

        Returns:
          (state, meta): jax.Arrays with the requested shardings, and the saved JSON metadata
          (`step`, `data_position`, `config`, `shardings`, ...).

        Raises:
          ConfigError: no checkpoint; `step` is missing or unreadable; every step is unreadable;
            or an array's path, shape or dtype differs from `abstract_state` (checked from the
            metadata, before any array data is read).
        """
        expected = _flatten(abstract_state)
        for path, leaf in expected.items():
            if getattr(leaf, "sharding", None) is None:
                raise ConfigError(
                    f"abstract_state leaf {path} has no sharding; use ShapeDtypeStruct(sharding=)"
                )
        steps = self.all_steps()
        if step is None and not steps:
            raise ConfigError(f"no readable committed checkpoint in {self.directory}")
        if step is not None and step not in self._manager.all_steps():
            raise ConfigError(
                f"step {step} is not a committed checkpoint in {self.directory}; "
                f"have {sorted(self._manager.all_steps())}"
            )
        failures: list[tuple[int, str]] = []
        for candidate in [step] if step is not None else steps[::-1]:
            restored, error = self._try_restore(candidate, abstract_state, expected)
            if _all_processes_ok(error is None):
                self._unreadable.discard(candidate)
                if failures:
                    log.warning(
                        "checkpoint step(s) %s in %s unreadable; fell back to step %d",
                        [s for s, _ in failures],
                        self.directory,
                        candidate,
                    )
                return restored
            failures.append((candidate, error or "failed on another process"))
            log.warning(
                "checkpoint step %d in %s unreadable: %s",
                *failures[-1][:1],
                self.directory,
                failures[-1][1],
            )
            self._unreadable.add(candidate)
        if step is not None:
            raise ConfigError(
                f"checkpoint step {step} in {self.directory} is unreadable: {failures[0][1]}"
            )
        raise ConfigError(
            f"no readable checkpoint in {self.directory}: steps {[s for s, _ in failures]} all "
            f"failed (newest: {failures[0][1]}); move the folder aside to start from scratch"
        )

    def _try_restore(
        self, step: int, abstract_state: PyTree, expected: Mapping[str, Any]
    ) -> tuple[tuple[PyTree, dict[str, Any]] | None, str | None]:
        """(result, None), or (None, one-line reason) if unreadable; ConfigError on a mismatch."""
        try:
            saved = _saved_arrays(_step_dir(self.directory, step) / STATE_ITEM)
        except Exception as err:
            return None, f"metadata: {one_line_error(err)}"
        resized = _replica_resized(saved, expected)
        _check_matches(
            {**saved, **{p: expected[p] for p in resized}},
            expected,
            f"checkpoint step {step} in {self.directory}",
        )
        if resized:  # read those as saved, replicated, then redistribute them (elastic resume)
            abstract_state = _as_saved(abstract_state, saved, resized)
        # Orbax's handlers, not its Checkpointer: the Checkpointer ends a restore with a barrier
        # that a process whose read failed never reaches, leaving the others waiting in it. Here
        # every process returns, and `restore` agrees on the outcome with one all-gather.
        handler = ocp.StandardCheckpointHandler()
        try:
            args = ocp.args.StandardRestore(abstract_state)
            state = handler.restore(_step_dir(self.directory, step) / STATE_ITEM, args=args)
            meta = self._read_meta(step)
        except Exception as err:
            orbax_reads.silence_orphaned_reads()
            return None, one_line_error(err)
        finally:
            handler.close()
        problems = _check_restored(state, meta.get("checksums") or {})
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            return None, problems[0] + more
        if resized:
            state = _redistribute(state, expected)
            replicas = sorted({(_shape_of(saved[p])[0], expected[p].shape[0]) for p in resized})
            log.warning("per-replica state redistributed from %d to %d data replicas", *replicas[0])
        return (state, {**meta, "step": step}), None


def _check_restored(state: PyTree, checksums: Mapping[str, Mapping[str, str]]) -> list[str]:
    """Checksum problems in the shards this process restored.

    Each saved shard is checked where it lies inside one restored shard of this process: all of
    them when the mesh is the one saved with (or fewer devices split each array); with a finer or
    different split some cannot be, and `ckpt.py verify` (whole arrays) checks those.
    """
    problems: list[str] = []
    for path, leaf in _flatten(state).items():
        saved = checksums.get(path)
        if not saved or not isinstance(leaf, jax.Array):
            continue
        done: set[str] = set()
        for shard in leaf.addressable_shards:
            todo = {k: v for k, v in saved.items() if k not in done}
            if not todo:
                break
            block = np.asarray(shard.data)
            index = tuple(
                slice(sl.start or 0, dim if sl.stop is None else sl.stop)
                for sl, dim in zip(shard.index, leaf.shape, strict=True)
            )
            problems += checksum_mismatches(path, block, todo, offset=index)
            done |= {k for k in todo if _inside(_parse_slice_key(k), index)}
    return problems


def _inside(index: Sequence[slice], block: Sequence[slice]) -> bool:
    return all(a.start >= b.start and a.stop <= b.stop for a, b in zip(index, block, strict=True))


class CheckpointWriteError(ConfigError):
    """A save failed (disk full, permissions, ...); its message is one line for the user."""


class _FailedWriteFilter(logging.Filter):
    """Drops orbax's own report of a background save that raised: jaxdist re-raises it as one line.

    Orbax logs the exception with its traceback from the writing thread (`future.py`) and then
    hands it to the caller, which turns it into CheckpointWriteError. Also drops its "Waiting for
    previous save to complete took N seconds" warning: on a loaded machine it lands between the
    console's lines and an `error:` line, and the console's ms/step already shows the wait.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        path = record.pathname.replace(os.sep, "/")
        if "/orbax/" in path and "Waiting for previous save to complete" in str(record.msg):
            return False
        failed_thread = path.endswith("/futures/future.py") or record.exc_info is not None
        return not ("/orbax/" in path and record.levelno >= logging.ERROR and failed_thread)


def _is_closed_loop_callback(exc_type, exc_value, tb) -> bool:
    """asyncio's "Event loop is closed" from a late callback of an abandoned write (or read)."""
    if exc_type is not RuntimeError or "Event loop is closed" not in str(exc_value):
        return False
    return any("asyncio" in frame.filename for frame in traceback.extract_tb(tb))


def _silence_failed_writes() -> None:
    """Keeps orbax's and asyncio's tracebacks of a failed background save off the console.

    When one write fails, orbax closes its event loop while tensorstore still completes the other
    writes; each completion's callback then raises "Event loop is closed", printed through
    sys.excepthook, one traceback per array. jaxdist reports the failure once, in one line.
    """
    orbax_reads.silence_orphaned_reads()
    if not getattr(sys.excepthook, "_jaxdist_filter", False):
        previous_excepthook = sys.excepthook

        def excepthook(exc_type, exc_value, tb):
            if not _is_closed_loop_callback(exc_type, exc_value, tb):
                previous_excepthook(exc_type, exc_value, tb)

        excepthook._jaxdist_filter = True
        sys.excepthook = excepthook
    for name in ("absl", "orbax", ""):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _FailedWriteFilter) for f in logger.filters):
            logger.addFilter(_FailedWriteFilter())
    previous = threading.excepthook
    if getattr(previous, "_jaxdist_filter", False):
        return

    def hook(args):
        if "Event loop is closed" in str(args.exc_value) or (
            args.exc_type is ImportError and "shutting down" in str(args.exc_value)
        ):
            return
        previous(args)

    hook._jaxdist_filter = True
    threading.excepthook = hook


def _non_negative_int(value: Any, field: str, meaning: str) -> int:
    try:
        value = operator.index(value)
    except TypeError:
        value = -1
    if value < 0:
        raise ConfigError(f"{field} must be an integer >= 0 ({meaning})")
    return value


# Train-state subtrees that exist only with some grad_sync settings, with a leading replica axis.
_PER_REPLICA = {"grad_sync": "grad_sync.compression", "local": "grad_sync.local_steps"}


def _replica_resized(saved: Mapping[str, Any], expected: Mapping[str, Any]) -> set[str]:
    """Paths of per-replica subtrees saved with another number of data replicas (all of them)."""
    paths = [p for p in expected if p.split("/", 1)[0] in _PER_REPLICA and p in saved]
    changed = {
        p
        for p in paths
        if _shape_of(saved[p])[:1] != tuple(expected[p].shape)[:1]
        and len(_shape_of(saved[p])) == len(expected[p].shape)
        and _dtype_of(saved[p]) == np.dtype(expected[p].dtype)
    }
    if not changed:
        return set()
    roots = {p.split("/", 1)[0] for p in changed}
    return {p for p in paths if p.split("/", 1)[0] in roots}


def _as_saved(abstract_state: PyTree, saved: Mapping[str, Any], paths: set[str]) -> PyTree:
    """`abstract_state` with the leaves at `paths` as saved (shape), replicated on the mesh."""

    def leaf(kp, x):
        path = path_str(kp)
        if path not in paths:
            return x
        mesh = x.sharding.mesh
        return jax.ShapeDtypeStruct(
            _shape_of(saved[path]), x.dtype, sharding=jax.sharding.NamedSharding(mesh, P())
        )

    return jax.tree_util.tree_map_with_path(leaf, abstract_state)


def _redistribute(state: PyTree, expected: Mapping[str, Any]) -> PyTree:
    """The resized per-replica leaves of `state` through `compression.resize_replicas`."""
    flat = _flatten(state)
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
    field = _PER_REPLICA.get(path.split("/", 1)[0])
    return f"keep the saved {field} or use a new workdir" if field else None


def _check_matches(saved: Mapping[str, Any], expected: Mapping[str, Any], where: str) -> None:
    """ConfigError naming the first array whose path, shape or dtype differs from the model's."""
    for path, want in expected.items():
        if path not in saved:
            hint = _setting_hint(path) or "a different model?"
            raise ConfigError(
                f"{where} has no array {path}, which the model expects as "
                f"{_fmt_array(want.shape, want.dtype)} ({hint})"
            )
        have_shape, have_dtype = _shape_of(saved[path]), _dtype_of(saved[path])
        if have_shape != tuple(want.shape) or have_dtype != np.dtype(want.dtype):
            hint = ""
            if _setting_hint(path) and have_shape[1:] == tuple(want.shape)[1:] and have_shape:
                hint = (
                    f" (per-replica state of {have_shape[0]} data-parallel replicas: resume with "
                    f"{have_shape[0]}, or use a new workdir)"
                )
            raise ConfigError(
                f"{where}: {path} is saved as {_fmt_array(have_shape, have_dtype)} "
                f"but the model expects {_fmt_array(want.shape, want.dtype)}{hint}"
            )
    extra = [path for path in saved if path not in expected]
    if extra:
        hint = _setting_hint(extra[0]) or "a different model?"
        raise ConfigError(
            f"{where} has array {extra[0]} that the model lacks ({len(extra)} such; {hint})"
        )


# ------------------------------------------------------------------------------------------------
# Reading without a mesh: orbax metadata, and arrays as numpy.


def _tree_metadata(state_dir: epath.Path) -> PyTree:
    """The saved tree of orbax ArrayMetadata (shape, dtype, sharding, storage name); no data."""
    handler = ocp.PyTreeCheckpointHandler()
    try:
        metadata = handler.metadata(state_dir)
    finally:
        handler.close()
    return getattr(metadata, "tree", metadata)


def _saved_arrays(state_dir: epath.Path) -> dict[str, Any]:
    """Path -> orbax ArrayMetadata, in tree order."""
    return _flatten(_tree_metadata(state_dir))


def _read_json_item(item_dir: epath.Path) -> dict[str, Any]:
    handler = ocp.JsonCheckpointHandler()
    try:
        return dict(handler.restore(item_dir, args=ocp.args.JsonRestore()))
    finally:
        handler.close()


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
    step_dir, step = _resolve_step(directory, step)
    meta_dir = step_dir / META_ITEM
    return {**(_read_json_item(meta_dir) if meta_dir.exists() else {}), "step": step}


def _under(path: str, prefix: str) -> bool:
    return not prefix or path == prefix or path.startswith(prefix.rstrip("/") + "/")


def array_paths(
    directory: epath.PathLike, step: int | None = None, *, prefix: str = ""
) -> list[ArrayInfo]:
    """Every saved array of `step` (default newest) under `prefix`, from metadata alone."""
    step_dir, step = _resolve_step(directory, step)
    meta_dir = step_dir / META_ITEM
    shardings = (_read_json_item(meta_dir) if meta_dir.exists() else {}).get("shardings", {})
    infos = []
    for path, md in _saved_arrays(step_dir / STATE_ITEM).items():
        if _under(path, prefix):
            shape, dtype = _shape_of(md), _dtype_of(md)
            sharding = shardings.get(path) or _describe_sharding_metadata(
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
    return {p: np.asarray(v) for p, v in _flatten(out).items() if p in selected}


def read_arrays(
    directory: epath.PathLike, step: int | None = None, *, prefix: str = ""
) -> dict[str, np.ndarray]:
    """The saved arrays under `prefix` (e.g. "params") as whole numpy arrays, by full path."""
    step_dir, step = _resolve_step(directory, step)
    state_dir = step_dir / STATE_ITEM
    tree_md = _tree_metadata(state_dir)
    selected = {path for path in _flatten(tree_md) if _under(path, prefix)}
    if not selected:
        raise ConfigError(f"checkpoint step {step} in {directory} has no arrays under {prefix!r}")
    return _restore_numpy(state_dir, tree_md, selected)


def _stored_array_names(state_dir: epath.Path) -> set[str]:
    """Names of the arrays present in storage (the OCDBT key-value store, or zarr folders)."""
    if (state_dir / "manifest.ocdbt").exists():
        import tensorstore as ts

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


def verify_checkpoint(directory: epath.PathLike, step: int | None = None) -> VerifyReport:
    """Reads every array of `step` (default newest) back, one at a time, against the metadata.

    Problems reported: metadata unreadable; the arrays in storage, in orbax's metadata and in our
    meta item differ; an array fails to read (a data file missing or corrupted); a shard's CRC-32
    differs from the one stored at save (a silently corrupted data file); an array holds NaN or
    Inf. Host memory stays within the largest single array.
    """
    step_dir, step = _resolve_step(directory, step)
    report = VerifyReport(step)
    state_dir = step_dir / STATE_ITEM
    checksums: dict[str, dict[str, str]] = {}
    try:
        meta = _read_json_item(step_dir / META_ITEM)
        listed = set(meta.get("shardings", {}))
        checksums = meta.get("checksums") or {}  # absent in checkpoints of older versions
    except Exception as err:
        listed = None
        report.problems.append(f"{step_dir / META_ITEM} unreadable ({one_line_error(err)})")
    try:
        tree_md = _tree_metadata(state_dir)
        saved = _flatten(tree_md)
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
        if value.shape != _shape_of(md):
            report.problems.append(f"{path} read back as {value.shape}, saved as {_shape_of(md)}")
            continue
        mismatches = checksum_mismatches(path, value, checksums.get(path, {}))
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
    directory: epath.PathLike, out: str | os.PathLike, step: int | None = None
) -> dict[str, np.ndarray]:
    """Writes the `params` subtree of `step` (default newest) as one `.npz` or `.safetensors`.

    Keys are `/`-joined paths inside `params` (`blocks/0/attn/wq`). `.npz` cannot hold bfloat16 or
    float8, so those are widened to float32 there (exactly); `.safetensors` keeps them. The file
    is written under a temporary name and renamed. Returns the arrays written.
    """
    out = os.fspath(out)
    if not out.endswith((".npz", ".safetensors")):
        raise ConfigError(f"output file {out} must end with .npz or .safetensors")
    if out.endswith(".safetensors"):
        try:  # before reading anything, so a missing extra costs nothing
            from safetensors.numpy import save_file
        except ImportError:
            raise ConfigError(
                f"writing {out} needs the safetensors package: pip install -e '.[export]' "
                "(or write .npz)"
            ) from None
    arrays = {
        path.removeprefix("params/"): np.ascontiguousarray(a)
        for path, a in read_arrays(directory, step, prefix="params").items()
    }
    tmp = f"{out}.tmp-{os.getpid()}"
    if out.endswith(".npz"):
        arrays = {
            k: a if a.dtype.kind in "biufc" else a.astype(np.float32) for k, a in arrays.items()
        }
        with open(tmp, "wb") as f:  # a file object, so numpy adds no suffix
            np.savez(f, **arrays)
    else:
        save_file(arrays, tmp)
    os.replace(tmp, out)
    return arrays


def restore_subtree(
    directory: epath.PathLike, abstract: PyTree, *, prefix: str = "params", step: int | None = None
) -> PyTree:
    """Reads the arrays under `prefix` of `step` (default newest) onto the shardings of `abstract`
    (a tree of `jax.ShapeDtypeStruct(sharding=)` shaped like that subtree); the rest of the saved
    state (optimizer moments, ...) is not read. Each device reads only its own shards.

    Raises:
      ConfigError: no such directory or step, or an array's path, shape or dtype differs.
    """
    step_dir, step = _resolve_step(directory, step)
    state_dir = step_dir / STATE_ITEM
    tree_md = _tree_metadata(state_dir)
    saved = {p: md for p, md in _flatten(tree_md).items() if _under(p, prefix)}
    expected = {f"{prefix}/{p}": leaf for p, leaf in _flatten(abstract).items()}
    _check_matches(saved, expected, f"checkpoint step {step} in {directory}")
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
    got = _flatten(out)
    paths = [
        f"{prefix}/{path_str(kp)}" for kp, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]
    ]
    return jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(abstract), [got[p] for p in paths]
    )
