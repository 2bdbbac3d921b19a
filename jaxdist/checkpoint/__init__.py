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

The package, one job per module:

- `manager`: `Checkpointer`, the trainer's saves, retention and restore;
- `offline`: reads on a host without the model or the mesh (`read_metadata`, `array_paths`,
  `read_arrays`, `restore_subtree`, `verify_checkpoint`, `export_params`), what `scripts/ckpt.py`
  and `jaxdist.weights` use;
- `integrity`: the CRC-32 per saved shard, written at save and checked by every read;
- `compat`: whether a checkpoint fits the reading run (config, arrays, replica count);
- `restore`: one step read onto a mesh for the trainer (checked, resharded, CRC-checked);
- `layout`: step folders and which of them are committed; `trees`: paths and message pieces;
- `processes`: all-gathers and barriers; `write_errors`: a failed save as one line.

Nothing here uses pickle.
"""

from jaxdist.checkpoint.compat import PER_REPLICA, check_config_compatible, check_matches
from jaxdist.checkpoint.integrity import checksum_mismatches, shard_checksums
from jaxdist.checkpoint.layout import (
    COMMIT_MARKER,
    FORMAT,
    META_ITEM,
    STATE_ITEM,
    committed_steps,
)
from jaxdist.checkpoint.manager import Checkpointer
from jaxdist.checkpoint.offline import (
    ArrayInfo,
    VerifyReport,
    array_paths,
    export_params,
    read_arrays,
    read_metadata,
    restore_subtree,
    verify_checkpoint,
)
from jaxdist.checkpoint.trees import (
    PyTree,
    describe_sharding,
    flatten,
    one_line_error,
    path_str,
)
from jaxdist.checkpoint.write_errors import CheckpointWriteError

__all__ = [
    "COMMIT_MARKER",
    "FORMAT",
    "META_ITEM",
    "PER_REPLICA",
    "STATE_ITEM",
    "ArrayInfo",
    "CheckpointWriteError",
    "Checkpointer",
    "PyTree",
    "VerifyReport",
    "array_paths",
    "check_config_compatible",
    "check_matches",
    "checksum_mismatches",
    "committed_steps",
    "describe_sharding",
    "export_params",
    "flatten",
    "one_line_error",
    "path_str",
    "read_arrays",
    "read_metadata",
    "restore_subtree",
    "shard_checksums",
    "verify_checkpoint",
]
