"""Reads one committed step onto a mesh for the trainer: checked from metadata, resharded, CRC-checked.

`Checkpointer.restore` calls `read_step` for each candidate step, newest first, and agrees with the
other processes on the outcome; a step that fails here is skipped (a fallback), while a step that
does not fit the model raises at once.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

import jaxdist.checkpoint.compat as compat
import jaxdist.checkpoint.integrity as integrity
from jaxdist import orbax_reads
from jaxdist.checkpoint.layout import META_ITEM, STATE_ITEM, step_dir
from jaxdist.checkpoint.offline import read_json_item, saved_arrays
from jaxdist.checkpoint.trees import PyTree, one_line_error, shape_of

log = logging.getLogger("jaxdist.checkpoint")


def read_step(
    directory: epath.Path, step: int, abstract_state: PyTree, expected: Mapping[str, Any]
) -> tuple[tuple[PyTree, dict[str, Any]] | None, str | None]:
    """Reads `step` onto the shardings of `abstract_state` (`expected`: it flattened by path).

    Returns:
      ((state, meta), None) when this process read it and every saved shard it holds whole
      matches its CRC-32; (None, one-line reason) when it is unreadable or corrupted here.

    Raises:
      ConfigError: an array's path, shape or dtype differs from the model's (from metadata,
        before any array data is read).
    """
    folder = step_dir(directory, step)
    try:
        saved = saved_arrays(folder / STATE_ITEM)
    except Exception as err:
        return None, f"metadata: {one_line_error(err)}"
    resized = compat.replica_resized(saved, expected)
    compat.check_matches(
        {**saved, **{p: expected[p] for p in resized}},
        expected,
        f"checkpoint step {step} in {directory}",
    )
    if resized:  # read those as saved, replicated, then redistribute them (elastic resume)
        abstract_state = compat.as_saved(abstract_state, saved, resized)
    # Orbax's handlers, not its Checkpointer: the Checkpointer ends a restore with a barrier
    # that a process whose read failed never reaches, leaving the others waiting in it. Here
    # every process returns, and `Checkpointer.restore` agrees on the outcome with one all-gather.
    handler = ocp.StandardCheckpointHandler()
    try:
        args = ocp.args.StandardRestore(abstract_state)
        state = handler.restore(folder / STATE_ITEM, args=args)
        meta = read_json_item(folder / META_ITEM)
    except Exception as err:
        orbax_reads.silence_orphaned_reads()
        return None, one_line_error(err)
    finally:
        handler.close()
    problems, _ = integrity.mismatches_in(state, meta.get("checksums") or {})
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return None, problems[0] + more
    if resized:
        state = compat.redistribute(state, expected)
        replicas = sorted({(shape_of(saved[p])[0], expected[p].shape[0]) for p in resized})
        log.warning("per-replica state redistributed from %d to %d data replicas", *replicas[0])
    return (state, {**meta, "step": step}), None
