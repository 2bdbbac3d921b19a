"""The fast checkpoint tier: each process's shards in process-local storage, copied to one peer.

`checkpoint.local_every=K` saves the train state every K steps next to the persistent orbax
checkpoints, much more cheaply: every process writes only the shards it holds, to a local folder
(`/dev/shm` by default, host memory), and sends the same bytes to its peer (process `p` holds a
copy of process `p - 1`'s shards), so the loss of any one process, or of its whole local storage,
loses nothing. After a restart the job restores from the newest step of either tier; a process
whose own copy is gone gets its shards from the peer that holds them. Layout::

    <local_dir>/p<process>/own/<step>/    manifest.json + shards.npz: this process's shards
    <local_dir>/p<process>/held/<step>/   the same, for process (process - 1) mod N

`manifest.json` names each shard (tree path, global index, shape, dtype), the CRC-32 of
`shards.npz`, the data position, the process count and the config; `shards.npz` is read with
`allow_pickle=False`. The peer copy travels through JAX's distributed key-value store (the
coordination service the job already runs), one transfer per process per save.

Why not orbax's `experimental.emergency` managers: they replicate along a *slice* axis (a
multi-slice TPU job, `multislice.replica_count` of the mesh's first axis) and restore by
broadcasting a whole replica from a slice that kept its local copy; a job whose state is sharded
across its processes with no slice replica (FSDP over 2 CPU processes) has no replica to restore
from. This tier copies each process's shards to a peer instead, so it needs no replica axis. It
restores onto the same number of processes and the same shardings only; anything else (an
elastic restart on fewer processes) falls back to the persistent tier.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import tempfile
import time
import zlib
from typing import Any

import jax
import numpy as np

from jaxdist.checkpoint import processes
from jaxdist.checkpoint.trees import PyTree, flatten, one_line_error

log = logging.getLogger("jaxdist.checkpoint")

MANIFEST = "manifest.json"
SHARDS = "shards.npz"
KV_TIMEOUT_MS = 120_000


def default_dir(workdir: str) -> str:
    """`/dev/shm/jaxdist-fast-<hash of workdir>` (the system temp folder without /dev/shm)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    digest = hashlib.sha1(os.path.abspath(workdir).encode()).hexdigest()[:12]
    return os.path.join(base, f"jaxdist-fast-{digest}")


def _index_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> str:
    """`0:4,0:8`: a shard's global slice per dimension (normalised, so equal shards agree)."""
    parts = []
    for sl, n in zip(index, shape, strict=True):
        start, stop, _ = sl.indices(n)
        parts.append(f"{start}:{stop}")
    return ",".join(parts)


def _kv_client():
    from jax._src.distributed import global_state  # the job's coordination-service client

    return global_state.client


class FastTier:
    """Process-local saves of the train state every `every` steps, each copied to a peer.

    Every process of the job constructs it and calls `save` and `restore` at the same steps.
    """

    def __init__(self, local_dir: str, *, every: int, keep: int = 2, config_json=None):
        self.every, self.keep, self.config_json = every, keep, config_json
        self.root = os.path.abspath(local_dir)
        self.process, self.count = jax.process_index(), jax.process_count()
        self.mine = os.path.join(self.root, f"p{self.process}")
        self.last_save_s = 0.0
        self.last_bytes = 0

    # -- folders ------------------------------------------------------------------------------

    def _folder(self, kind: str) -> str:
        return os.path.join(self.mine, kind)

    def steps(self, kind: str = "own") -> list[int]:
        """Steps with a manifest in this process's `own` (or `held`) folder, ascending."""
        folder = self._folder(kind)
        if not os.path.isdir(folder):
            return []
        return sorted(
            int(n)
            for n in os.listdir(folder)
            if n.isdigit() and os.path.isfile(os.path.join(folder, n, MANIFEST))
        )

    def latest_step(self) -> int | None:
        """The newest step of this process's own copy (what an in-process rollback reads)."""
        steps = self.steps("own")
        return steps[-1] if steps else None

    def _write(self, kind: str, step: int, blob: bytes, manifest: dict[str, Any]) -> None:
        """Writes `step` atomically (a temporary folder renamed), then keeps the newest `keep`."""
        folder = self._folder(kind)
        os.makedirs(folder, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f"{step}.tmp-", dir=folder)
        with open(os.path.join(tmp, SHARDS), "wb") as f:
            f.write(blob)
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump({**manifest, "crc32": zlib.crc32(blob), "bytes": len(blob)}, f)
        final = os.path.join(folder, str(step))
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        for old in self.steps(kind)[: -self.keep]:
            shutil.rmtree(os.path.join(folder, str(old)), ignore_errors=True)
        for name in os.listdir(folder):  # temporary folders of a save killed mid-write
            if ".tmp-" in name and name != os.path.basename(tmp):
                shutil.rmtree(os.path.join(folder, name), ignore_errors=True)

    # -- save ---------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, step: int, state: PyTree, *, data_position: int) -> None:
        """Writes this process's shards of `state` locally and swaps copies with the peers.

        Blocks until both copies are written (a few milliseconds for small states): a process
        killed right after `save` returns has lost nothing.
        """
        t0 = time.perf_counter()
        arrays: dict[str, np.ndarray] = {}
        shards = []
        for path, leaf in flatten(state).items():
            seen = set()
            for shard in leaf.addressable_shards:
                key = _index_key(shard.index, leaf.shape)
                if key in seen:
                    continue
                seen.add(key)
                name = f"a{len(arrays)}"
                arrays[name] = np.asarray(shard.data)
                shards.append({"path": path, "index": key, "name": name})
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        blob = buf.getvalue()
        manifest = {
            "step": int(step),
            "data_position": int(data_position),
            "process": self.process,
            "process_count": self.count,
            "shards": shards,
            "config": self.config_json,
        }
        self._write("own", step, blob, manifest)
        if self.count > 1:
            client = _kv_client()
            client.key_value_set_bytes(f"jaxdist_fast/{step}/{self.process}", blob)
            client.key_value_set(
                f"jaxdist_fast/{step}/{self.process}/manifest", json.dumps(manifest)
            )
            source = (self.process - 1) % self.count
            theirs = client.blocking_key_value_get_bytes(
                f"jaxdist_fast/{step}/{source}", KV_TIMEOUT_MS
            )
            their_manifest = json.loads(
                client.blocking_key_value_get(
                    f"jaxdist_fast/{step}/{source}/manifest", KV_TIMEOUT_MS
                )
            )
            self._write("held", step, theirs, their_manifest)
            client.key_value_delete(f"jaxdist_fast/{step}/{source}")
            client.key_value_delete(f"jaxdist_fast/{step}/{source}/manifest")
        self.last_save_s = time.perf_counter() - t0
        self.last_bytes = len(blob) * (2 if self.count > 1 else 1)

    # -- restore ------------------------------------------------------------------------------

    def newest_complete(self) -> tuple[int | None, list[dict[str, list[int]]]]:
        """(the newest step every process's shards can be read at, each process's listing).

        A collective: every process lists its folders and all agree on the answer.
        """
        listing = processes.gather_json({"own": self.steps("own"), "held": self.steps("held")})
        n = len(listing)
        candidates = set()
        for entry in listing:
            candidates.update(entry["own"])
            candidates.update(entry["held"])
        for step in sorted(candidates, reverse=True):
            if all(
                step in listing[q]["own"] or step in listing[(q + 1) % n]["held"] for q in range(n)
            ):
                return step, listing
        return None, listing

    def restore(
        self, step: int, listing: list[dict[str, list[int]]], abstract_state: PyTree
    ) -> tuple[PyTree, dict[str, Any], str] | None:
        """Reads `step` onto `abstract_state`'s shardings on every process; None if any fails.

        A process without its own copy gets its shards from the peer holding them. Returns
        (state, manifest, where this process's shards came from: "own" or "peer").
        """
        n = len(listing)
        have_own = step in listing[self.process]["own"]
        ours: tuple[bytes, dict[str, Any]] | None = None
        error = None
        try:
            if have_own:
                ours = self._read("own", step)
            if n > 1:
                lost = (self.process - 1) % n  # the process whose shards this one holds
                if step not in listing[lost]["own"]:
                    try:
                        blob, manifest = self._read("held", step)
                    except Exception as err:  # the peer is told (empty bytes), not left waiting
                        blob, manifest, error = b"", {}, one_line_error(err)
                    client = _kv_client()
                    client.key_value_set_bytes(f"jaxdist_fast_restore/{step}/{lost}", blob)
                    client.key_value_set(
                        f"jaxdist_fast_restore/{step}/{lost}/manifest", json.dumps(manifest)
                    )
                if not have_own:
                    client = _kv_client()
                    key = f"jaxdist_fast_restore/{step}/{self.process}"
                    blob = client.blocking_key_value_get_bytes(key, KV_TIMEOUT_MS)
                    manifest = json.loads(
                        client.blocking_key_value_get(f"{key}/manifest", KV_TIMEOUT_MS)
                    )
                    if not blob:
                        raise ValueError(f"the peer holding step {step}'s copy could not read it")
                    _check_crc(blob, manifest)
                    ours = (blob, manifest)
        except Exception as err:  # unreadable, corrupt, or a peer that never sent
            error = one_line_error(err)
        state = None
        if error is None and ours is None:
            error = f"no copy of step {step} for process {self.process}"
        if error is None and ours is not None:
            try:
                state = _assemble(ours[0], ours[1], abstract_state, self.count)
            except Exception as err:
                error = one_line_error(err)
        if not processes.all_processes_ok(error is None):
            log.warning(
                "fast tier step %d unreadable on process %d: %s",
                step,
                self.process,
                error or "failed on another process",
            )
            return None
        return state, ours[1], "own" if have_own else "peer"

    def _read(self, kind: str, step: int) -> tuple[bytes, dict[str, Any]]:
        folder = os.path.join(self._folder(kind), str(step))
        with open(os.path.join(folder, MANIFEST)) as f:
            manifest = json.load(f)
        with open(os.path.join(folder, SHARDS), "rb") as f:
            blob = f.read()
        _check_crc(blob, manifest)
        return blob, manifest

    def remove(self) -> None:
        """Deletes this process's folders (a finished run's persistent save supersedes them)."""
        shutil.rmtree(self.mine, ignore_errors=True)
        try:
            os.rmdir(self.root)  # once every process's folder is gone
        except OSError:
            pass


def _check_crc(blob: bytes, manifest: dict[str, Any]) -> None:
    if zlib.crc32(blob) != manifest.get("crc32"):
        raise ValueError(
            f"step {manifest.get('step')} of process {manifest.get('process')}: CRC-32 mismatch"
        )


def _assemble(blob: bytes, manifest: dict[str, Any], abstract_state: PyTree, count: int) -> PyTree:
    """The state's jax.Arrays from one process's saved shards (each placed on its device)."""
    if manifest["process_count"] != count:
        raise ValueError(f"saved by {manifest['process_count']} processes, now {count}")
    with np.load(io.BytesIO(blob), allow_pickle=False) as npz:
        pool = {(s["path"], s["index"]): npz[s["name"]] for s in manifest["shards"]}
    leaves = flatten(abstract_state)
    out = []
    for path, leaf in leaves.items():
        sharding = leaf.sharding
        pieces = []
        for device, index in sharding.addressable_devices_indices_map(leaf.shape).items():
            key = (path, _index_key(index, leaf.shape))
            if key not in pool:
                raise ValueError(f"{path}: no saved shard {key[1]} (another mesh?)")
            data = pool[key]
            if data.dtype != leaf.dtype:
                raise ValueError(f"{path}: saved {data.dtype}, expected {leaf.dtype}")
            pieces.append(jax.device_put(data, device))
        out.append(jax.make_array_from_single_device_arrays(leaf.shape, sharding, pieces))
    treedef = jax.tree_util.tree_structure(abstract_state)
    return jax.tree_util.tree_unflatten(treedef, out)
