"""The trainer's checkpointer: saves the train state on a cadence, keeps the newest, restores it.

`Checkpointer` wraps orbax's CheckpointManager: asynchronous, cooperative saves (every process
writes its own shards, orbax's primary process commits the step by renaming it), retention of the
newest `keep` steps, and a restore that reshards onto any mesh and falls back past unreadable or
corrupted steps. The format of a step folder is in the package docstring.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import logging
import operator
import types
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

import jaxdist
import jaxdist.checkpoint.integrity as integrity
import jaxdist.checkpoint.processes as processes
from jaxdist.checkpoint.layout import (
    FORMAT,
    META_ITEM,
    STATE_ITEM,
    CommittedStepFormat,
    as_path,
    move_aside,
    refuse_symlinked_steps,
    step_dir,
    uncommitted_step_folders,
)
from jaxdist.checkpoint.offline import read_json_item
from jaxdist.checkpoint.restore import read_step
from jaxdist.checkpoint.trees import PyTree, describe_sharding, flatten, one_line_error
from jaxdist.checkpoint.write_errors import (
    CheckpointWriteError,
    silence_failed_writes,
    write_error,
)
from jaxdist.errors import ConfigError

log = logging.getLogger("jaxdist.checkpoint")

# orbax saves a replicated array replica-parallel: each replica writes a slice of it, cut on its
# device by a compiled program (one per shape and device). In one process, for a slice under this
# size, the cut costs more than the parallel copies to the host gain: the default GPT's first save
# on 8 CPU devices compiled 64 of them, 1.2 s of XLA against 0.9 s for its train step. At and
# above it, saves stay replica-parallel.
REPLICA_PARALLEL_MIN_SLICE_BYTES = 1 << 20
_large_slices_only: ocp.type_handlers.ArrayHandler | None = None  # once registered, this one


def _replica_parallel_for_large_slices_only() -> None:
    """In a single process, registers orbax's `ArrayHandler` with
    `REPLICA_PARALLEL_MIN_SLICE_BYTES`, unless a handler other than orbax's default one (a
    subclass, or the one registered here before) is in place. With several processes orbax's
    default stays: there replica-parallel also spreads the writes of replicated arrays over the
    hosts."""
    global _large_slices_only
    handlers = ocp.type_handlers
    current = handlers.get_type_handler(jax.Array)
    if jax.process_count() > 1 or current is _large_slices_only:
        return
    if type(current) is not handlers.ArrayHandler:
        return
    _large_slices_only = handlers.ArrayHandler(
        min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_SLICE_BYTES
    )
    absl_log = logging.getLogger("absl")  # orbax warns of every override; this one is deliberate
    quiet = logging.Filter("jaxdist")  # passes only records of loggers named jaxdist*
    absl_log.addFilter(quiet)
    try:
        handlers.register_type_handler(jax.Array, _large_slices_only, override=True)
    finally:
        absl_log.removeFilter(quiet)


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
        self.directory = as_path(directory)
        refuse_symlinked_steps(self.directory)
        self._config_json = config_json
        # Committed steps that failed to restore; moved aside before the next save.
        self._unreadable: set[int] = set()
        self._in_flight: int | None = None  # the step of a save that may still be writing
        self._closed = False
        silence_failed_writes()  # a background save's failure is reported once, by `wait`/`save`
        # When to save is orbax's decision: a fixed interval, or a preemption (checked first, on
        # every call, so that every process asks JAX's sync point at every step).
        self._preemption = _PreemptionPolicy(stop_requested or (lambda: False))
        policies: list[Any] = [self._preemption]
        if self.every:
            policies.append(ocp.checkpoint_managers.FixedIntervalPolicy(self.every))
        self._save_policy = ocp.checkpoint_managers.AnySavePolicy(policies)
        _replica_parallel_for_large_slices_only()
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=self._save_policy,
            step_name_format=CommittedStepFormat(),
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
        ignored = uncommitted_step_folders(self.directory)
        if ignored:
            log.warning(
                "checkpoint folders without orbax's commit marker in %s (a save or deletion cut "
                "short, or a partial copy), moved aside to <step>.uncommitted-<ns>: %s",
                self.directory,
                ", ".join(ignored),
            )
            move_aside(self.directory, dict.fromkeys(ignored, "uncommitted"), "uncommitted_aside")
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
        return read_json_item(step_dir(self.directory, step) / META_ITEM)

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
        # A collective (the checksums are gathered): every process saves.
        meta = step_metadata(step, state, int(data_position), self._config_json)
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
        if step_dir(self.directory, step).exists() and step not in self._manager.all_steps():
            targets[step] = "uncommitted"  # orbax could not rename its tmp folder onto it
        if not targets:
            return
        self._manager.wait_until_finished()
        folders = {step_dir(self.directory, bad).name: why for bad, why in targets.items()}
        for name, moved in move_aside(self.directory, folders, f"move_aside_{step}").items():
            log.warning("moved %s checkpoint folder %s aside to %s", folders[name], name, moved)
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
        """Waits for pending saves and stops orbax's background threads (once; later calls return)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._manager.close()
        except Exception as err:
            raise self._write_error(err, self._in_flight) from None

    def _write_error(self, err: BaseException, step: int | None) -> CheckpointWriteError:
        """One line for a save that failed (`write_error`); no save is in flight after it."""
        self._in_flight = None
        return write_error(err, step, self.directory)

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
        expected = flatten(abstract_state)
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
            restored, error = read_step(self.directory, candidate, abstract_state, expected)
            if processes.all_processes_ok(error is None):
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


def step_metadata(
    step: int, state: PyTree, data_position: int, config_json: dict[str, Any] | None
) -> dict[str, Any]:
    """The JSON `meta` item saved with a step (docs/CHECKPOINTS.md lists its keys).

    Gathers every process's shard checksums: a collective, so every process calls it.
    """
    leaves = flatten(state)
    meshes = [
        leaf.sharding.mesh
        for leaf in leaves.values()
        if isinstance(getattr(leaf, "sharding", None), jax.sharding.NamedSharding)
    ]
    checksums: dict[str, dict[str, str]] = {}
    for part in processes.gather_json(integrity.shard_checksums(state)):
        for path, sums in part.items():
            checksums.setdefault(path, {}).update(sums)
    return {
        "format": FORMAT,
        "step": step,
        "data_position": data_position,
        "config": config_json,
        "jaxdist_version": _jaxdist_version(),
        "jax_version": jax.__version__,
        "process_count": jax.process_count(),
        "mesh": {k: int(v) for k, v in meshes[0].shape.items()} if meshes else None,
        "shardings": {
            p: describe_sharding(getattr(x, "sharding", None)) for p, x in leaves.items()
        },
        "checksums": checksums,
    }


def _jaxdist_version() -> str:
    if getattr(jaxdist, "__version__", None):
        return str(jaxdist.__version__)
    try:
        return importlib.metadata.version("jaxdist")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _non_negative_int(value: Any, field: str, meaning: str) -> int:
    try:
        value = operator.index(value)
    except TypeError:
        value = -1
    if value < 0:
        raise ConfigError(f"{field} must be an integer >= 0 ({meaning})")
    return value
