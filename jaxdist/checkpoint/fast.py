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
from. This tier copies each process's shards to a peer instead, so it needs no replica axis.

Restoring onto another layout (`launch.py --elastic` restarting on fewer processes, process `q`
of the new job reading `p<q>/`): every shard is named by its global slice, so the processes
gather what their folders hold (own and peer copies), check that the saved slices cover every
slice of the new shardings (else the step is skipped, naming the first missing slice), read the
copies anyone needs (CRC-checked), pass them on through the key-value store to the processes that
need them, and each puts its new shards together from the saved slices they overlap: the bytes
are copied, so the restored state is bit-exact. Without a complete fast step newer than the
persistent one, the persistent tier is restored.
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
                shards.append({"path": path, "index": key, "name": name, "shape": leaf.shape})
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

    def _entries(self, kind: str) -> dict[str, dict[str, Any]]:
        """{step: what another process needs to plan a restore} of this process's `kind` copies."""
        out = {}
        for step in self.steps(kind):
            try:
                with open(os.path.join(self._folder(kind), str(step), MANIFEST)) as f:
                    m = json.load(f)
                out[str(step)] = {
                    "process": int(m["process"]),
                    "count": int(m["process_count"]),
                    "data_position": int(m["data_position"]),
                    "shards": [[s["path"], s["index"]] for s in m["shards"]],
                    "shapes": {s["path"]: s["shape"] for s in m["shards"] if "shape" in s},
                }
            except (OSError, ValueError, KeyError, TypeError):
                continue  # an unreadable manifest: that copy does not count
        return out

    def newest_complete(
        self, abstract_state: PyTree
    ) -> tuple[int | None, Listing, tuple[int, str] | None]:
        """(the newest step whose saved slices cover `abstract_state`, the listing, a note).

        A collective: every process lists its folders and all agree on the answer. The saved
        slices may come from any number of processes (an elastic restart on fewer processes reads
        the lost ones' shards from the copies that survive). The note (None when the newest step
        is complete) is (the newest incomplete step, a phrase naming the first slice it lacks).
        """
        listing = processes.gather_json(
            {"own": self._entries("own"), "held": self._entries("held")}
        )
        candidates = sorted(
            {int(t) for entry in listing for kind in ("own", "held") for t in entry[kind]},
            reverse=True,
        )
        note = None
        for step in candidates:
            missing = _missing_slice(_copies(listing, step), abstract_state)
            if missing is None:
                return step, listing, note
            if note is None:
                note = (step, f"fast tier step {step} {missing}")
        return None, listing, note

    def restore(
        self, step: int, listing: Listing, abstract_state: PyTree
    ) -> tuple[PyTree, dict[str, Any], dict[int, int]] | None:
        """Reads `step` onto `abstract_state`'s shardings on every process; None if any fails.

        Every process reads the copies it holds that any process needs (its own shards, or a
        lost process's from the peer copy it holds) and sends the others' through the
        coordination service; each then assembles its addressable shards from the saved global
        slices (which need not match the new ones). Returns (state, a manifest, {saving process:
        the process whose peer copy was read} for the shards that came from a peer copy).
        """
        copies = _copies(listing, step)
        holder = {s: min(c, key=lambda qk: (qk[1] != "own", qk[0])) for s, c in copies.items()}
        needs = _sources_needed(copies, holder, abstract_state)
        mine = needs.get(self.process, set())
        blobs: dict[int, tuple[bytes, dict[str, Any]]] = {}
        published: list[str] = []
        error = None
        try:
            client = _kv_client() if len(listing) > 1 else None
            for s, (q, kind) in sorted(holder.items()):
                wanted_by_others = any(s in n for p, n in needs.items() if p != self.process)
                if q != self.process or not (s in mine or wanted_by_others):
                    continue
                try:
                    blob, manifest = self._read(kind, step, source=s)
                except Exception as err:  # the others are told (empty bytes), not left waiting
                    blob, manifest, error = b"", {}, one_line_error(err)
                if s in mine and blob:
                    blobs[s] = (blob, manifest)
                if wanted_by_others and client is not None:
                    key = f"jaxdist_fast_restore/{step}/{s}"
                    client.key_value_set_bytes(key, blob)
                    client.key_value_set(f"{key}/manifest", json.dumps(manifest))
                    published += [key, f"{key}/manifest"]
            for s in sorted(mine - set(blobs)):
                if holder[s][0] == self.process:
                    continue  # unreadable here: `error` says why
                key = f"jaxdist_fast_restore/{step}/{s}"
                blob = client.blocking_key_value_get_bytes(key, KV_TIMEOUT_MS)
                manifest = json.loads(
                    client.blocking_key_value_get(f"{key}/manifest", KV_TIMEOUT_MS)
                )
                if not blob:
                    raise ValueError(
                        f"process {holder[s][0]}, holding process {s}'s step {step}, could not "
                        "read it"
                    )
                _check_crc(blob, manifest)
                blobs[s] = (blob, manifest)
        except Exception as err:  # unreadable, corrupt, or a peer that never sent
            error = error or one_line_error(err)
        state = None
        if error is None and not blobs:
            error = f"no copy of step {step} for process {self.process}"
        if error is None:
            try:
                state = _assemble(blobs, abstract_state)
            except Exception as err:
                error = one_line_error(err)
        ok = processes.all_processes_ok(error is None)
        for key in published:  # every process has read what it needed (the check above waits)
            client.key_value_delete(key)
        if not ok:
            log.warning(
                "fast tier step %d unreadable on process %d: %s",
                step,
                self.process,
                error or "failed on another process",
            )
            return None
        manifest = next(iter(blobs.values()))[1]
        from_peer = {s: q for s, (q, kind) in sorted(holder.items()) if kind == "held"}
        return state, manifest, from_peer

    def _read(self, kind: str, step: int, source: int | None = None) -> tuple[bytes, dict]:
        folder = os.path.join(self._folder(kind), str(step))
        with open(os.path.join(folder, MANIFEST)) as f:
            manifest = json.load(f)
        if source is not None and manifest.get("process") != source:
            raise ValueError(
                f"{folder} holds process {manifest.get('process')}'s shards, not {source}'s"
            )
        with open(os.path.join(folder, SHARDS), "rb") as f:
            blob = f.read()
        _check_crc(blob, manifest)
        return blob, manifest

    def remove(self) -> None:
        """Deletes this process's folders (a finished run's persistent save supersedes them).

        Process 0 also deletes the folders of processes beyond the job's count (those an elastic
        restart left behind), so that no host memory is left taken.
        """
        shutil.rmtree(self.mine, ignore_errors=True)
        try:  # the processes of one host share the folder: a peer may remove it at any moment
            names = os.listdir(self.root) if self.process == 0 else []
        except FileNotFoundError:
            names = []
        for name in names:
            if name[:1] == "p" and name[1:].isdigit() and int(name[1:]) >= self.count:
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        try:
            os.rmdir(self.root)  # once every process's folder is gone
        except OSError:
            pass


Listing = list[dict[str, dict[str, dict[str, Any]]]]  # per process: {"own"|"held": {step: entry}}
Ranges = tuple[tuple[int, int], ...]


def _check_crc(blob: bytes, manifest: dict[str, Any]) -> None:
    if zlib.crc32(blob) != manifest.get("crc32"):
        raise ValueError(
            f"step {manifest.get('step')} of process {manifest.get('process')}: CRC-32 mismatch"
        )


def _ranges(key: str) -> Ranges:
    """`0:4,0:8` -> ((0, 4), (0, 8)); `` (a scalar) -> ()."""
    if not key:
        return ()
    return tuple((int(a), int(b)) for a, b in (part.split(":") for part in key.split(",")))


def _size(r: Ranges) -> int:
    return int(np.prod([b - a for a, b in r], dtype=np.int64))


def _overlap(a: Ranges, b: Ranges) -> Ranges | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def _copies(listing: Listing, step: int) -> dict[int, dict[tuple[int, str], dict[str, Any]]]:
    """{saving process: {(process now holding it, "own"|"held"): its entry}} at `step`."""
    out: dict[int, dict[tuple[int, str], dict[str, Any]]] = {}
    for q, entry in enumerate(listing):
        for kind in ("own", "held"):
            e = entry[kind].get(str(step))
            if e is not None:
                out.setdefault(e["process"], {})[(q, kind)] = e
    return out


def _pieces(copies: dict[int, dict]) -> dict[str, dict[str, int]]:
    """{tree path: {saved global slice: the lowest saving process that has it}}."""
    pieces: dict[str, dict[str, int]] = {}
    for s in sorted(copies):
        entry = next(iter(copies[s].values()))
        for path, key in entry["shards"]:
            pieces.setdefault(path, {}).setdefault(key, s)
    return pieces


def _regions(leaf) -> dict[str, list[int]]:
    """{global slice: the processes whose devices hold it} of `leaf`'s sharding."""
    out: dict[str, list[int]] = {}
    for device, index in leaf.sharding.devices_indices_map(leaf.shape).items():
        out.setdefault(_index_key(index, leaf.shape), []).append(device.process_index)
    return out


def _missing_slice(copies: dict[int, dict], abstract_state: PyTree) -> str | None:
    """None when the saved slices cover every slice of `abstract_state`, else what is missing:
    `lacks slice PATH[SLICE] (...)` naming the saving processes of which no copy is here, or
    `holds PATH as SHAPE, ...` when an array's global shape differs (another model, or a
    per-replica state saved with another replica count, which only the persistent tier resizes).
    """
    if not copies:
        return "lacks every slice (no copy)"
    counts = {e["count"] for c in copies.values() for e in c.values()}
    if len(counts) > 1:
        return f"lacks a consistent save (copies from jobs of {sorted(counts)} processes)"
    lost = sorted(set(range(counts.pop())) - set(copies))
    pieces = _pieces(copies)
    shapes = {
        p: tuple(sh) for c in copies.values() for e in c.values() for p, sh in e["shapes"].items()
    }
    for path, leaf in flatten(abstract_state).items():
        if path in shapes and shapes[path] != tuple(leaf.shape):
            return (
                f"holds {path} as {shapes[path]}, the run needs {tuple(leaf.shape)} (another "
                "model or replica count)"
            )
        saved = [_ranges(k) for k in pieces.get(path, {})]
        for key in _regions(leaf):
            region = _ranges(key)
            covered = sum(_size(o) for p in saved if (o := _overlap(region, p)) is not None)
            if covered < _size(region):
                n = len(copies) + len(lost)
                if lost:
                    whose = ", ".join(map(str, lost))
                    why = f"no surviving copy of the shards of process(es) {whose} of {n}"
                else:
                    why = f"in none of the shards saved by {n} process(es)"
                return f"lacks slice {path}[{key}] ({why})"
    return None


def _sources_needed(copies, holder, abstract_state: PyTree) -> dict[int, set[int]]:
    """{process now: the saving processes whose shards it needs for its addressable slices}."""
    pieces = _pieces(copies)
    needs: dict[int, set[int]] = {}
    for path, leaf in flatten(abstract_state).items():
        saved = [(_ranges(k), s) for k, s in pieces.get(path, {}).items()]
        for key, procs in _regions(leaf).items():
            region = _ranges(key)
            for r, s in saved:
                if _overlap(region, r) is not None:
                    for q in procs:
                        needs.setdefault(q, set()).add(s)
    return needs


def _assemble(blobs: dict[int, tuple[bytes, dict[str, Any]]], abstract_state: PyTree) -> PyTree:
    """The state's jax.Arrays from saved shards: each addressable slice is the saved slice of the
    same global index, or is copied together from the saved slices it overlaps."""
    pool: dict[str, dict[str, np.ndarray]] = {}
    for s in sorted(blobs):
        blob, manifest = blobs[s]
        with np.load(io.BytesIO(blob), allow_pickle=False) as npz:
            for sh in manifest["shards"]:
                pool.setdefault(sh["path"], {}).setdefault(sh["index"], npz[sh["name"]])
    out = []
    for path, leaf in flatten(abstract_state).items():
        saved = pool.get(path, {})
        pieces = []
        for device, index in leaf.sharding.addressable_devices_indices_map(leaf.shape).items():
            key = _index_key(index, leaf.shape)
            data = saved.get(key)
            if data is None:
                data = _copy_together(path, key, saved, leaf.dtype)
            if data.dtype != leaf.dtype:
                raise ValueError(f"{path}: saved {data.dtype}, expected {leaf.dtype}")
            pieces.append(jax.device_put(data, device))
        out.append(jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, pieces))
    treedef = jax.tree_util.tree_structure(abstract_state)
    return jax.tree_util.tree_unflatten(treedef, out)


def _copy_together(path: str, key: str, saved: dict[str, np.ndarray], dtype) -> np.ndarray:
    """The global slice `key` of `path` from the saved slices that overlap it (bytes copied)."""
    region = _ranges(key)
    out = np.empty([b - a for a, b in region], dtype)
    covered = 0
    for k, data in saved.items():
        o = _overlap(region, _ranges(k))
        if o is None:
            continue
        if data.dtype != out.dtype:
            raise ValueError(f"{path}: saved {data.dtype}, expected {out.dtype}")
        src = _ranges(k)
        dst_ix = tuple(slice(lo - r0, hi - r0) for (lo, hi), (r0, _) in zip(o, region, strict=True))
        src_ix = tuple(slice(lo - s0, hi - s0) for (lo, hi), (s0, _) in zip(o, src, strict=True))
        out[dst_ix] = data[src_ix]
        covered += _size(o)
    if covered < _size(region):
        raise ValueError(f"{path}: no saved slices cover [{key}]")
    return out
