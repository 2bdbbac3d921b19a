"""Every reader of a checkpoint refuses a corrupted one; exports never overwrite or leave temps;
`verify` next to a trainer's retention; a symlinked step folder (issue 31, items 1, 3, 6, 10)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

import jax
import numpy as np
import pytest

import models
from jaxdist import checkpoint
from jaxdist.checkpoint import offline
from jaxdist.config import base_config, to_json_dict
from jaxdist.errors import ConfigError
from models import api
from tests.helpers import ORBAX_ABANDONED_READS, flip_a_bit_that_still_decodes, python

REPO = Path(__file__).resolve().parents[1]
pytestmark = ORBAX_ABANDONED_READS


def _llama_config():
    c = base_config()
    m = c.model
    m.name, m.num_layers, m.d_model, m.num_heads, m.num_kv_heads = "llama", 2, 32, 4, 2
    m.mlp_dim, m.seq_len, m.vocab_size = 64, 32, 256
    return c


def _make_run(path: Path, steps=(0,)) -> Path:
    """A jaxdist run folder (config.json, checkpoints/<step>) of a tiny random Llama, as
    `hf.py import` writes one."""
    config = _llama_config()
    model = api.abstract_model(models.get("llama").make(config.model, None))
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda a: (0.1 * rng.standard_normal(a.shape)).astype(a.dtype), model.params
    )
    cfg_json = to_json_dict(config)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg_json))
    with checkpoint.Checkpointer(
        path / "checkpoints", every=0, keep=0, config_json=cfg_json, async_save=False
    ) as saver:
        for step in steps:
            saver.save(
                step, {"step": np.int32(step), "params": params}, data_position=step, force=True
            )
            saver.wait()
    return path


@pytest.fixture(scope="module")
def corrupted_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("corrupt")
    run = _make_run(base / "run")
    path = flip_a_bit_that_still_decodes(run / "checkpoints", 0)
    return run, path


def _script(*args, cwd=REPO) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [python(), *map(str, args)],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_every_reader_refuses_a_flipped_bit_in_one_line_and_writes_nothing(corrupted_run, tmp_path):
    run, path = corrupted_run
    ckpt_dir = run / "checkpoints"
    tokens = np.random.default_rng(1).integers(0, 256, size=4096).astype(np.uint16)
    tokens.tofile(tmp_path / "val.bin")
    outs = {
        "ckpt export": tmp_path / "params.npz",
        "train init_from": tmp_path / "ft",
        "sample": tmp_path / "sample.jsonl",
        "eval": tmp_path / "eval.json",
        "hf export": tmp_path / "hf",
    }
    commands = {
        "ckpt export": ["scripts/ckpt.py", "export", ckpt_dir, "--out", outs["ckpt export"]],
        "train init_from": [
            "scripts/train.py",
            "--config=configs/llama_tiny.py",
            f"--workdir={outs['train init_from']}",
            f"--config.train.init_from={run}",
            f"--config.data.source={tmp_path / 'val.bin'}",
            "--config.model.seq_len=32",
            "--config.train.steps=1",
            "--config.train.batch_size=8",
        ],
        "sample": [
            "scripts/sample.py",
            f"--checkpoint={run}",
            "--prompt=ab",
            "--max_new_tokens=2",
            f"--out={outs['sample']}",
        ],
        "eval": [
            "scripts/eval.py",
            f"--checkpoint={run}",
            f"--data={tmp_path / 'val.bin'}",
            "--batches=1",
            f"--out={outs['eval']}",
        ],
        "hf export": ["scripts/hf.py", "export", run, "--out", outs["hf export"]],
    }
    procs = {name: _script(*cmd) for name, cmd in commands.items()}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2, (name, stderr[-3000:])
        assert "Traceback" not in stderr, (name, stderr[-3000:])
        assert len(errors) == 1, (name, stderr[-3000:])
        line = errors[0]
        assert f"checkpoint step 0 in {ckpt_dir} is corrupted: {path} shard [" in line, (name, line)
        assert "checksum mismatch" in line, (name, line)
        out = outs[name]
        written = [p for p in out.rglob("*") if p.is_file()] if out.is_dir() else []
        assert not written and not (out.exists() and out.is_file()), (name, written)
        leftovers = [p.name for p in tmp_path.iterdir() if ".tmp" in p.name]
        assert not leftovers, (name, leftovers)


def test_read_arrays_and_restore_subtree_refuse_a_flipped_bit(corrupted_run):
    run, path = corrupted_run
    ckpt_dir = run / "checkpoints"
    with pytest.raises(ConfigError, match=r"checkpoint step 0 in .* is corrupted: params/") as err:
        checkpoint.read_arrays(ckpt_dir, prefix="params")
    assert path in str(err.value) and "\n" not in str(err.value)
    # The sharded read (train.init_from, sample.py, eval.py) on a 2 x 2 mesh: each saved shard is
    # pieced together from the devices' blocks and checked.
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), devices=jax.devices()[:4])
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    saved = offline.read_arrays_unchecked(ckpt_dir, prefix="params")
    abstract = {
        p.removeprefix("params/"): jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=sharding if a.ndim and a.shape[0] % 2 == 0 else None
        )
        for p, a in saved.items()
    }
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    abstract = {
        k: v if v.sharding is not None else v.update(sharding=replicated)
        for k, v in abstract.items()
    }
    nested: dict = {}
    for key, leaf in abstract.items():
        node = nested
        *parents, last = key.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = leaf
    with pytest.raises(ConfigError, match=r"is corrupted: params/.* checksum mismatch"):
        checkpoint.restore_subtree(ckpt_dir, nested)


def test_the_undamaged_run_reads_and_exports(tmp_path):
    run = _make_run(tmp_path / "run")
    arrays = checkpoint.export_params(run / "checkpoints", tmp_path / "p.npz")
    assert arrays and (tmp_path / "p.npz").is_file()


# ---------------------------------------------------------------------------------------------
# Item 3: `ckpt.py export` never overwrites silently and never leaves a temporary file.


def test_export_refuses_an_existing_out_unless_force(tmp_path):
    ckpt_dir = _make_run(tmp_path / "run") / "checkpoints"
    out = tmp_path / "p.npz"
    out.write_bytes(b"precious")
    proc = _script("scripts/ckpt.py", "export", ckpt_dir, "--out", out)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2, stderr
    assert (
        stderr.strip() == f"error: output file {out} already exists; pass --force to overwrite it"
    )
    assert out.read_bytes() == b"precious"
    proc = _script("scripts/ckpt.py", "export", ckpt_dir, "--out", out, "--force")
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    with np.load(out) as f:
        assert "embed" in f.files or any(k.startswith("embed") for k in f.files), f.files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.npz", "run"]


def test_export_to_a_folder_is_refused_and_leaves_nothing(tmp_path):
    ckpt_dir = _make_run(tmp_path / "run") / "checkpoints"
    out = tmp_path / "p.npz"
    out.mkdir()
    for extra in ([], ["--force"]):
        proc = _script("scripts/ckpt.py", "export", ckpt_dir, "--out", out, *extra)
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 2, stderr
        assert stderr.strip().startswith(f"error: output file {out} is a folder"), stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["p.npz", "run"]
        assert not list(out.iterdir())


def test_export_that_fails_while_writing_leaves_no_temporary_file(tmp_path, monkeypatch):
    ckpt_dir = _make_run(tmp_path / "run") / "checkpoints"

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez", disk_full)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.export_params(ckpt_dir, tmp_path / "p.npz")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


# ---------------------------------------------------------------------------------------------
# Item 6: `ckpt.py verify` while a trainer's retention deletes the step it reads.


def _load_ckpt_script():
    spec = importlib.util.spec_from_file_location("ckpt_script", REPO / "scripts" / "ckpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _delete_on_first_read(monkeypatch, ckpt_dir: Path, step: int, *, partial: bool):
    """The first array read of `step` finds it being deleted, as `checkpoint.keep` does: whole
    (`partial=False`), or its arrays first and the folder (with the commit marker) 0.3 s later."""
    real = offline._restore_numpy
    state = {"done": False}

    def read(state_dir, tree_md, selected):
        if not state["done"] and Path(state_dir).parent.name == str(step):
            state["done"] = True
            if partial:
                shutil.rmtree(Path(state_dir) / "d")
                threading.Timer(0.3, shutil.rmtree, [ckpt_dir / str(step)]).start()
            else:
                shutil.rmtree(ckpt_dir / str(step))
        return real(state_dir, tree_md, selected)

    monkeypatch.setattr(offline, "_restore_numpy", read)


@pytest.mark.parametrize("partial", [False, True], ids=["whole", "file_by_file"])
def test_verify_of_a_step_removed_by_retention_checks_the_newest(tmp_path, monkeypatch, partial):
    ckpt_dir = _make_run(tmp_path / "run", steps=(1, 2, 3)) / "checkpoints"
    _delete_on_first_read(monkeypatch, ckpt_dir, 3, partial=partial)
    report = checkpoint.verify_checkpoint(ckpt_dir)
    assert not report.problems, report.problems
    assert report.step == 2 and report.arrays > 0
    assert report.notes == [
        f"step 3 in {ckpt_dir} was removed while it was being read (retention: a trainer's "
        "checkpoint.keep), which is not a failure; checking the newest committed step instead"
    ]


def test_verify_tool_says_so_and_exits_0(tmp_path, monkeypatch, capsys):
    ckpt_dir = _make_run(tmp_path / "run", steps=(1, 2)) / "checkpoints"
    _delete_on_first_read(monkeypatch, ckpt_dir, 2, partial=False)
    tool = _load_ckpt_script()
    assert tool.main(["verify", str(ckpt_dir)]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith(
        f"note: step 2 in {ckpt_dir} was removed while it was being read"
    )
    assert captured.out.startswith(f"ok: step 1 in {ckpt_dir}:")


def test_verify_of_a_named_step_removed_during_the_read_says_so(tmp_path, monkeypatch):
    ckpt_dir = _make_run(tmp_path / "run", steps=(1, 2)) / "checkpoints"
    _delete_on_first_read(monkeypatch, ckpt_dir, 2, partial=False)
    with pytest.raises(ConfigError, match=r"^step 2 in .* was removed while it was being read"):
        checkpoint.verify_checkpoint(ckpt_dir, 2)


def test_verify_still_fails_a_damaged_step_that_stays(tmp_path):
    ckpt_dir = _make_run(tmp_path / "run", steps=(1, 2)) / "checkpoints"
    data_file = max(
        (p for p in (ckpt_dir / "2" / "state").rglob("*") if p.parent.name == "d"),
        key=lambda p: p.stat().st_size,
    )
    data_file.write_bytes(b"\xff" * data_file.stat().st_size)
    report = checkpoint.verify_checkpoint(ckpt_dir)
    assert report.step == 2 and report.problems and not report.notes


# ---------------------------------------------------------------------------------------------
# Item 10: a step folder that is a symlink.


def test_a_symlinked_step_folder_is_refused_in_one_line(tmp_path):
    ckpt_dir = _make_run(tmp_path / "run", steps=(1, 2)) / "checkpoints"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(ckpt_dir / "2", elsewhere / "2")
    (ckpt_dir / "2").symlink_to(elsewhere / "2")
    with pytest.raises(ConfigError) as err:
        checkpoint.Checkpointer(ckpt_dir, every=1, keep=1, config_json={})
    assert str(err.value) == (
        f"checkpoint step folder {ckpt_dir / '2'} is a symbolic link (to {elsewhere / '2'}); the "
        "trainer renames and deletes step folders in place, so each must be a real folder: "
        f"replace the link with a copy of its target, or move it out of {ckpt_dir}"
    )
    assert (ckpt_dir / "2").is_symlink() and (elsewhere / "2").is_dir()  # nothing touched
