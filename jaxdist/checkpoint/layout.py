"""Where a checkpoint lives on disk: the step folders, which of them orbax committed, the item names.

One folder per saved step under the checkpoint directory (see the package docstring); a `<step>`
folder counts only once orbax's commit marker is in it. Every reader and the trainer's
`Checkpointer` find steps through `committed_steps` / `resolve_step`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

import jaxdist.checkpoint.processes as processes
from jaxdist.errors import ConfigError

STATE_ITEM = "state"
META_ITEM = "meta"
FORMAT = "jaxdist-checkpoint/1"
# Orbax writes this file into a step folder just before the final rename. A `<step>` folder
# without it (and without a commit timestamp in _CHECKPOINT_METADATA) was never committed by
# orbax, e.g. it was partly copied, and is never read.
COMMIT_MARKER = getattr(
    getattr(ocp.path, "atomicity_types", None), "COMMIT_SUCCESS_FILE", "commit_success.txt"
)


def is_committed(step_metadata: Any) -> bool:
    """Whether an orbax step folder carries orbax's commit marker (file, or commit timestamp)."""
    if (step_metadata.path / COMMIT_MARKER).exists():
        return True
    try:
        return step_metadata.commit_timestamp_nsecs is not None
    except Exception:  # an unreadable _CHECKPOINT_METADATA is no commit
        return False


@dataclasses.dataclass(frozen=True)
class CommittedStepFormat:
    """Orbax's standard `<step>` folder names, counting only folders with orbax's commit marker.

    Orbax skips its `*.orbax-checkpoint-tmp-*` folders itself, but on a local disk it takes any
    other `<step>` folder as committed, so a partly copied folder would be read. This hides those.
    """

    inner: Any = dataclasses.field(default_factory=ocp.path.step.standard_name_format)

    def build_name(self, step: int) -> str:
        return self.inner.build_name(step)

    def find_all(self, base_path: epath.PathLike) -> list[Any]:
        return [m for m in self.inner.find_all(base_path) if is_committed(m)]

    def find_step(self, base_path: epath.PathLike, step: int) -> Any:
        found = self.inner.find_step(base_path, step)
        if not is_committed(found):
            raise ValueError(f"step folder {found.path} has no orbax commit marker")
        return found


def as_path(directory: epath.PathLike) -> epath.Path:
    """`directory` as an epath; a local path made absolute (orbax refuses relative ones)."""
    text = os.fspath(directory)
    return epath.Path(text if "://" in text else os.path.abspath(text))


def step_dir(directory: epath.Path, step: int) -> epath.Path:
    """The folder of `step` under `directory` (whether or not it exists)."""
    return directory / CommittedStepFormat().build_name(step)


def committed_steps(directory: epath.PathLike) -> list[int]:
    """Steps under `directory` that orbax finished committing, ascending; [] if it is missing."""
    directory = as_path(directory)
    if not directory.is_dir():
        return []
    return sorted(m.step for m in CommittedStepFormat().find_all(directory))


def uncommitted_step_folders(directory: epath.Path) -> list[str]:
    """`<step>` folders that look like checkpoints but were never committed (e.g. partly copied)."""
    if not directory.is_dir():
        return []
    committed = set(committed_steps(directory))
    names = [p.name for p in directory.iterdir() if p.name.isdigit() and p.is_dir()]
    return sorted((n for n in names if int(n) not in committed), key=int)


def move_aside(directory: epath.Path, folders: Mapping[str, str], barrier: str) -> dict[str, str]:
    """Renames each folder `name` under `directory` to `<name>.<why>-<ns>` ({name: why}).

    Renamed, not deleted, so they can still be examined; orbax and jaxdist ignore such names.
    Process 0 renames; every process waits for it at the barrier `barrier` (the same name on
    every process). Returns {name: new name} of what this process renamed.
    """
    stamp = time.time_ns()
    moved = {}
    if jax.process_index() == 0:
        for name, why in sorted(folders.items()):
            src = directory / name
            if src.exists():
                src.rename(directory / f"{name}.{why}-{stamp}")
                moved[name] = f"{name}.{why}-{stamp}"
    processes.barrier(f"jaxdist_checkpoint_{barrier}")
    return moved


def refuse_symlinked_steps(directory: epath.Path) -> None:
    """ConfigError naming the first step folder (`<step>`, or orbax's tmp) that is a symlink.

    A trainer renames, moves aside and deletes its step folders in place; through a link those
    operations hit the link or its target, and every later save fails with a message about
    something else. A local directory only (a URL has no links).
    """
    if "://" in os.fspath(directory) or not directory.is_dir():
        return
    for entry in sorted(os.scandir(os.fspath(directory)), key=lambda e: e.name):
        if entry.name.split(".", 1)[0].isdigit() and entry.is_symlink():
            target = os.readlink(entry.path)
            raise ConfigError(
                f"checkpoint step folder {entry.path} is a symbolic link (to {target}); the trainer "
                "renames and deletes step folders in place, so each must be a real folder: "
                "replace the link with a copy of its target, or move it out of "
                f"{directory}"
            )


def resolve_step(directory: epath.PathLike, step: int | None) -> tuple[epath.Path, int]:
    """The folder of `step` (default: the newest committed), or ConfigError saying what is wrong."""
    directory = as_path(directory)
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
    return step_dir(directory, step), step
