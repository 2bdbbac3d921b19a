"""The fast checkpoint tier (`checkpoint.local_every`): restored when newer, bit-exact, and a
corrupt or absent fast tier falls back to the persistent one.

In one process (`loop.run` in-process, the tiny GPT): a persistent checkpoint at step 3 and a
fast-tier step 5 of the same trajectory; the resume takes the fast step and ends with the very
parameters of the resume that fell back to step 3 (its fast tier corrupted) and trained 3 to 5
again. Across processes (`launch.py`, 2 processes, kill -9 of process 1 whose own copy is then
deleted): the restart reads process 1's shards from process 0's copy and finishes with the
parameters of the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import time

import numpy as np
import pytest

from jaxdist import goodput, loop
from jaxdist.checkpoint import offline
from tests.helpers import tiny_gpt_config


def _config(steps: int, every: int, local_every: int, local_dir: pathlib.Path):
    c = tiny_gpt_config(data=2, fsdp=2, tensor=2)
    c.train.steps, c.train.log_every, c.train.eval_batches = steps, 1, 1
    c.train.schedule, c.train.warmup_steps = "constant", 2  # steps changes nothing else
    c.checkpoint.every = every
    c.checkpoint.local_every = local_every
    c.checkpoint.local_dir = str(local_dir)
    return c


def _final_state(workdir: pathlib.Path, step: int) -> dict[str, np.ndarray]:
    return offline.read_arrays(workdir / "checkpoints", step)


def test_newer_fast_step_restores_bit_exact_and_corrupt_falls_back(tmp_path, capsys):
    persistent, ahead, local = tmp_path / "p", tmp_path / "ahead", tmp_path / "local"
    loop.run(_config(3, 3, 0, local), str(persistent))  # persistent step 3
    loop.run(_config(5, 0, 5, local), str(ahead))  # the same trajectory, fast step 5 in `local`
    assert sorted(os.listdir(local / "p0" / "own")) == ["5"]
    capsys.readouterr()

    # Corrupted: one byte of the shards flipped -> the CRC refuses it, step 3 is restored.
    broken_dir, broken_local = tmp_path / "broken", tmp_path / "broken_local"
    shutil.copytree(persistent, broken_dir)
    shutil.copytree(local, broken_local)
    shards = broken_local / "p0" / "own" / "5" / "shards.npz"
    raw = bytearray(shards.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    shards.write_bytes(bytes(raw))
    loop.run(_config(6, 3, 5, broken_local), str(broken_dir))
    out = capsys.readouterr().out
    assert (
        "checkpoint tier: fast tier step 5 unreadable; falling back to the persistent tier "
        "(step 3)" in out
    ), out
    assert f"resumed from {broken_dir}/checkpoints at step 3" in out, out

    # Intact: the fast step 5 is newer than the persistent step 3 and is used.
    loop.run(_config(6, 3, 5, local), str(persistent))
    out = capsys.readouterr().out
    assert f"checkpoint tier: fast (step 5 from process-local copies in {local})" in out, out
    assert "resumed from the fast tier at step 5" in out, out
    assert not local.exists()  # the final persistent save superseded it

    got, want = _final_state(persistent, 6), _final_state(broken_dir, 6)
    assert sorted(got) == sorted(want)
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=path)


def test_local_every_must_not_be_negative(tmp_path):
    from jaxdist.errors import ConfigError

    c = _config(2, 0, -1, tmp_path)
    with pytest.raises(ConfigError, match=r"checkpoint.local_every must be >= 0"):
        loop.run(c, str(tmp_path / "w"))


def test_remove_survives_a_peer_removing_the_shared_folder_first(tmp_path, monkeypatch):
    """Processes on one host share `local_dir`: at the end each removes its own folder and the
    shared one once empty. Process 1 may empty and remove it between process 0 finding it and
    listing it (it did, in a 2-process run: FileNotFoundError, exit 1); process 0 goes on."""
    from jaxdist.checkpoint import fast

    root = tmp_path / "local"
    tiers = []
    for process in (0, 1):
        tier = fast.FastTier(str(root), every=1)
        tier.process, tier.count = process, 2
        tier.mine = str(root / f"p{process}")
        os.makedirs(tier.mine)
        tiers.append(tier)
    listdir = os.listdir

    def peer_first(path):
        tiers[1].remove()  # the peer finishes in between
        return listdir(path)

    monkeypatch.setattr(fast.os, "listdir", peer_first)
    tiers[0].remove()
    assert not root.exists()


# ---------------------------------------------------------------------------------------------
# Two processes, kill -9 of one; its own copy deleted, so its shards come from the peer's copy.


@pytest.mark.slow
def test_kill_9_restores_the_lost_process_from_its_peer_bit_exact(tmp_path):
    from tests.helpers import python
    from tests.test_faults import EXIT_DEADLINE_S, Job, last_step, worker
    from tests.test_multihost import FSDP, records, train_cmd

    steps = 14
    flags = (*FSDP, f"--config.train.steps={steps}", "--config.checkpoint.every=100")
    tag = f"{os.getpid()}-{time.monotonic_ns()}"  # unique in /proc
    reference = tmp_path / f"ref-{tag}"
    # the reference's processes are forked (tests/prefork.py); the killed job's are the script's
    job = Job(
        train_cmd(reference, *flags, processes=2, interpreter=python()), tmp_path, "reference"
    )
    try:
        assert job.wait(300) == 0, job.text()[-3000:]
    finally:
        job.kill()

    workdir, local = tmp_path / f"w-{tag}", tmp_path / "local"
    cmd = train_cmd(
        workdir,
        *flags,
        "--config.checkpoint.local_every=3",
        f"--config.checkpoint.local_dir={local}",
        processes=2,
    )
    cut = cmd.index("--")
    job = Job([*cmd[:cut], "--max_restarts=1", *cmd[cut:]], tmp_path, "killed")
    try:
        job.wait_until(
            "a fast-tier save", lambda: last_step(workdir) >= 7 and (local / "p0" / "held").is_dir()
        )
        victim = worker(workdir, 1)
        os.kill(victim, signal.SIGSTOP)  # nothing more is written while its copy is deleted
        shutil.rmtree(local / "p1" / "own")  # its process-local storage lost with it
        os.kill(victim, signal.SIGKILL)
        rc = job.wait(300 + EXIT_DEADLINE_S)
    finally:
        job.kill()
    text = job.text()
    assert rc == 0, text[-4000:]
    assert "restart 1 of 1" in text, text[-4000:]
    line = next(x for x in text.splitlines() if "checkpoint tier: fast" in x)
    assert "process(es) 1 from process 0's copy" in line, line
    assert not (local / "p0").exists() and not (local / "p1").exists()
    got, want = _final_state(workdir, steps), _final_state(reference, steps)
    assert sorted(got) == sorted(want)
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=path)
    # The launcher's job-level goodput: both attempts, the causes adding up to its wall time.
    (job,) = [r for r in records(workdir) if r.get("kind") == "goodput_job"]
    assert (job["attempts"], job["attempts_finished"]) == (2, 1), job
    assert sum(job[c] for c in goodput.CAUSES) == pytest.approx(job["total"], rel=0.02), job
    assert job["total"] == pytest.approx(job["wall_s"], rel=0.02), job
    assert job["restart"] > 0 and job["productive"] > 0, job
    assert "launch.py: job goodput │ " in text, text[-2000:]


def test_saved_slices_are_put_together_onto_another_layout(tmp_path):
    """In one process: a state saved as eighths (and a replicated scalar) restores onto quarters
    along the other axis and onto a replicated layout, bit for bit; a slice dropped from the
    save is named by `newest_complete`, which then finds no complete step."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxdist.checkpoint.fast import FastTier

    devices = np.array(jax.devices()[:8])
    eight = Mesh(devices.reshape(8, 1), ("a", "b"))
    four = Mesh(devices[:4].reshape(2, 2), ("a", "b"))
    w = np.arange(16 * 6, dtype=np.float32).reshape(16, 6) * 0.37
    state = {
        "w": jax.device_put(w, NamedSharding(eight, P("a", None))),
        "n": jax.device_put(np.int32(7), NamedSharding(eight, P())),
    }
    tier = FastTier(str(tmp_path / "local"), every=1)
    tier.save(2, state, data_position=2)
    tier.save(3, state, data_position=3)

    for mesh, spec in ((four, P("b", "a")), (four, P())):
        abstract = {
            "w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(mesh, spec)),
            "n": jax.ShapeDtypeStruct((), np.int32, sharding=NamedSharding(mesh, P())),
        }
        step, listing, note = tier.newest_complete(abstract)
        assert (step, note) == (3, None)
        got, manifest, from_peer = tier.restore(step, listing, abstract)
        assert (manifest["step"], from_peer) == (3, {})
        assert got["w"].sharding == abstract["w"].sharding
        np.testing.assert_array_equal(np.asarray(got["w"]), w)
        assert int(got["n"]) == 7

    # A global shape the save does not have (a per-replica state on fewer replicas): refused,
    # though the saved slices cover the smaller array.
    smaller = {
        **abstract,
        "w": jax.ShapeDtypeStruct((8, 6), w.dtype, sharding=abstract["w"].sharding),
    }
    step, _, note = tier.newest_complete(smaller)
    assert step is None
    assert note == (
        3,
        "fast tier step 3 holds w as (16, 6), the run needs (8, 6) (another model "
        "or replica count)",
    ), note

    for drop in (3, 2):  # step 3 lacks a slice: step 2 is used; then step 2 too: none is
        folder = tmp_path / "local" / "p0" / "own" / str(drop)
        m = json.loads((folder / "manifest.json").read_text())
        m["shards"] = [x for x in m["shards"] if x["index"] != "4:6,0:6"]
        (folder / "manifest.json").write_text(json.dumps(m))
        step, _, note = tier.newest_complete(abstract)
        assert step == (2 if drop == 3 else None)
        want = "fast tier step 3 lacks slice w[0:16,0:6] (in none of the shards"
        want += " saved by 1 process(es))"
        assert note == (3, want), note


# ---------------------------------------------------------------------------------------------
# Fewer processes: a 2-process job's fast tier reassembled onto 1 process (elastic restart).


def _saved_global(local: pathlib.Path, step: int, like: dict[str, np.ndarray]):
    """{path: whole array} put together from every fast-tier file of `step` under `local`
    (shapes from `like`); raises if a slice of `like` is not saved."""
    whole = {path: np.zeros_like(a) for path, a in like.items()}
    seen = {path: np.zeros(a.shape, bool) for path, a in like.items()}
    for manifest in sorted(local.glob(f"p*/*/{step}/manifest.json")):
        m = json.loads(manifest.read_text())
        with np.load(manifest.parent / "shards.npz", allow_pickle=False) as npz:
            for s in m["shards"]:
                bounds = [p.split(":") for p in s["index"].split(",")] if s["index"] else []
                ix = tuple(slice(int(lo), int(hi)) for lo, hi in bounds)
                whole[s["path"]][ix] = npz[s["name"]]
                seen[s["path"]][ix] = True
    assert all(v.all() for v in seen.values()), [p for p, v in seen.items() if not v.all()]
    return whole


@pytest.mark.slow
def test_two_process_fast_tier_restores_onto_one_process_bit_exact(tmp_path):
    """Both tiers hold step 4 of the same 2-process FSDP job (fsdp=8: eighths); process 1 and
    its local storage are lost. One process of 4 devices (fsdp=4: quarters, each put together
    from two saved eighths) resumes from the fast tier, process 1's eighths from process 0's
    peer copy, and ends at step 5 with the parameters and optimizer state of the same resume
    from the persistent step 4. Without the peer copy the one missing slice is named and the
    run falls back to the persistent tier."""
    from tests.helpers import python
    from tests.test_multihost import _env, in_parallel, train_cmd

    mesh = ("--config.mesh.data=1", "--config.mesh.fsdp=-1", "--config.mesh.tensor=1")
    fast_w, pers_w, lost_w = tmp_path / "fast", tmp_path / "pers", tmp_path / "lost"
    local, lost_local = tmp_path / "local", tmp_path / "lost_local"
    fast = ("--config.checkpoint.local_every=4", f"--config.checkpoint.local_dir={local}")
    env = _env(None, None)
    in_parallel(
        (
            train_cmd(
                fast_w,
                *mesh,
                "--config.train.steps=4",
                "--config.checkpoint.every=0",
                *fast,
                processes=2,
                interpreter=python(),
            ),
            env,
        ),
        (
            train_cmd(
                pers_w,
                *mesh,
                "--config.train.steps=4",
                "--config.checkpoint.every=4",
                processes=2,
                interpreter=python(),
            ),
            env,
        ),
    )
    assert sorted(p.name for p in local.iterdir()) == ["p0", "p1"]
    # The fast tier's step 4 is the persistent step 4, byte for byte.
    want4 = _final_state(pers_w, 4)
    saved = _saved_global(local, 4, want4)
    assert sorted(saved) == sorted(want4)
    for path in want4:
        np.testing.assert_array_equal(saved[path], want4[path], err_msg=path)

    shutil.rmtree(local / "p1")  # process 1 lost with its local storage
    shutil.copytree(local, lost_local)
    shutil.rmtree(lost_local / "p0" / "held")  # ... and the peer copy of its shards
    one = ("--config.runtime.cpu_devices=4", "--config.checkpoint.every=5")
    out_fast, _, out_lost = in_parallel(
        (
            train_cmd(fast_w, *mesh, *one, "--config.train.steps=5", *fast, interpreter=python()),
            env,
        ),
        (train_cmd(pers_w, *mesh, *one, "--config.train.steps=5", interpreter=python()), env),
        (
            train_cmd(
                lost_w,
                *mesh,
                *one,
                "--config.train.steps=1",
                "--config.checkpoint.local_every=4",
                f"--config.checkpoint.local_dir={lost_local}",
                interpreter=python(),
            ),
            env,
        ),
    )
    text = out_fast.stdout
    assert (
        f"checkpoint tier: fast (step 4 from process-local copies in {local}; process(es) 1 from "
        "process 0's copy; saved by 2 processes, reassembled onto 1)" in text
    ), text[-3000:]
    assert "resumed from the fast tier at step 4" in text, text[-3000:]
    assert not local.exists()  # the final persistent save superseded both processes' folders
    got, want = _final_state(fast_w, 5), _final_state(pers_w, 5)
    assert sorted(got) == sorted(want)
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=path)

    (line,) = [x for x in out_lost.stdout.splitlines() if x.startswith("checkpoint tier:")]
    assert re.fullmatch(
        r"checkpoint tier: fast tier step 4 lacks slice \S+\[[0-9:,]+\] \(no surviving copy of "
        r"the shards of process\(es\) 1 of 2\); falling back to the persistent tier \(none\)",
        line,
    ), line
