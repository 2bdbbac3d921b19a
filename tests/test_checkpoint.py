"""Checkpoints: round trips, retention, resharding onto another mesh, robustness, scripts/ckpt.py."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist import checkpoint
from jaxdist.errors import ConfigError
from tests.helpers import (
    ORBAX_ABANDONED_READS,
    flip_a_bit_that_still_decodes,
    largest_data_file,
    python,
)

REPO = Path(__file__).resolve().parents[1]
pytestmark = ORBAX_ABANDONED_READS
CONFIG = {"model": {"name": "mlp", "d_model": 64}, "train": {"steps": 4}}


def _mesh8():
    return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def _mesh4():
    # A different layout on half of the devices: 2-way FSDP x 2-way tensor.
    return jax.make_mesh(
        (2, 2),
        ("fsdp", "tensor"),
        devices=jax.devices()[:4],
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
    )


@jax.jit  # one compilation, instead of one per eager optax op
def _adamw_state_after_one_update(params):
    tx = optax.adamw(1e-3)
    grads = jax.tree.map(jnp.ones_like, params)
    return tx.update(grads, tx.init(params), params)[1]  # non-zero mu and nu, count=1


def _make_state(step: int):
    """A small train state on the 8-device data-parallel mesh; w's shards (2 KiB each) are large
    enough that orbax keeps them in data files rather than inline in the index."""
    mesh = _mesh8()
    rng = np.random.default_rng(step)
    params = {
        "dense": {"w": rng.standard_normal((64, 64)), "b": rng.standard_normal(64)},
        "out": {"w": rng.standard_normal((64, 8))},
    }
    params = jax.tree.map(lambda x: x.astype(np.float32), params)
    state = {
        "step": np.int32(step),
        "params": params,
        "opt_state": _adamw_state_after_one_update(params),
        "rng": jax.random.key_data(jax.random.key(step + 100)),
    }

    def place(x):
        spec = P("data") if np.ndim(x) == 2 else P()  # 2-D arrays split by rows, rest replicated
        return jax.device_put(x, NamedSharding(mesh, spec))

    return jax.tree.map(place, state)


def _abstract(state, mesh=None, spec_2d=None):
    def one(x):
        sharding = x.sharding
        if mesh is not None:
            sharding = NamedSharding(mesh, spec_2d if x.ndim == 2 else P())
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(one, state)


def _assert_bit_exact(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def states():
    return {2: _make_state(2), 4: _make_state(4)}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, states):
    """A checkpoint directory holding steps 2 and 4, written once; tests copy it before damaging."""
    directory = tmp_path_factory.mktemp("pristine") / "checkpoints"
    with checkpoint.Checkpointer(directory, every=2, keep=3, config_json=CONFIG) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save(step, states.get(step, states[2]), data_position=step * 10)
    return directory


@pytest.fixture
def ckpt_dir(pristine, tmp_path):
    directory = tmp_path / "checkpoints"
    shutil.copytree(pristine, directory)
    return directory


def test_save_restore_round_trip_is_bit_exact(pristine, states):
    assert checkpoint.committed_steps(pristine) == [2, 4]  # every=2: steps 1 and 3 were skipped
    ckpt = checkpoint.Checkpointer(pristine, every=2, keep=3, config_json=CONFIG)
    assert ckpt.latest_step() == 4 and ckpt.all_steps() == [2, 4]
    restored, meta = ckpt.restore(_abstract(states[4]))
    _assert_bit_exact(restored, states[4])
    assert isinstance(restored["opt_state"][0], optax.ScaleByAdamState)  # NamedTuples come back
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(states[4]), strict=True):
        assert got.sharding == want.sharding
    assert meta["step"] == 4 and meta["data_position"] == 40 and meta["config"] == CONFIG
    assert meta["shardings"]["params/dense/w"] == "P('data') on mesh(data=8)"
    older, meta2 = ckpt.restore(_abstract(states[2]), step=2)
    _assert_bit_exact(older, states[2])
    assert meta2["data_position"] == 20
    assert ckpt.saved_config() == CONFIG
    ckpt.close()


def test_async_save_survives_donated_buffers_then_wait(tmp_path):
    state = _make_state(7)
    expected = jax.tree.map(np.asarray, state)
    ckpt = checkpoint.Checkpointer(
        tmp_path / "c", every=1, keep=2, config_json=None, async_save=True
    )
    assert ckpt.save(7, state, data_position=7)
    for leaf in jax.tree.leaves(state):
        leaf.delete()  # what donating the state to the next train step does
    ckpt.wait()
    assert checkpoint.committed_steps(tmp_path / "c") == [7]
    restored, _ = ckpt.restore(_abstract(_make_state(7)))
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    ckpt.close()


def test_replicated_arrays_are_cut_for_replica_parallel_saving_only_when_large(
    tmp_path, monkeypatch
):
    """orbax cuts a replicated array into one slice per replica with `jax.lax.slice_in_dim` (a
    compiled program per shape and device); below `REPLICA_PARALLEL_MIN_SLICE_BYTES` a slice
    the Checkpointer saves whole from replica 0 instead, and both round-trip to the bit."""
    cuts = []
    slice_in_dim = jax.lax.slice_in_dim

    def counting(operand, *args, **kwargs):
        cuts.append(operand.shape)
        return slice_in_dim(operand, *args, **kwargs)

    monkeypatch.setattr(jax.lax, "slice_in_dim", counting)
    replicated = NamedSharding(jax.sharding.Mesh(np.array(jax.devices()), ("data",)), P())
    per_replica = checkpoint.manager.REPLICA_PARALLEL_MIN_SLICE_BYTES // 4  # float32 elements
    rng = np.random.default_rng(0)
    small = rng.standard_normal((8, per_replica - 1), dtype=np.float32)  # slices 4 bytes under it
    large = rng.standard_normal((8, per_replica), dtype=np.float32)  # slices of exactly the size
    for name, value in (("small", small), ("large", large)):
        state = {"w": jax.device_put(value, replicated)}
        cuts.clear()
        with checkpoint.Checkpointer(tmp_path / name, every=1, keep=1, config_json=None) as ckpt:
            assert ckpt.save(1, state, data_position=1)
            ckpt.wait()
            restored, _ = ckpt.restore(
                {"w": jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=replicated)}
            )
        np.testing.assert_array_equal(np.asarray(restored["w"]), value)
        assert cuts == ([] if name == "small" else [value.shape] * 8), (name, cuts)


def test_keep_retains_the_newest_steps(tmp_path, states):
    with checkpoint.Checkpointer(tmp_path, every=1, keep=2, config_json=None) as ckpt:
        for step in range(1, 5):
            assert ckpt.should_save(step)
            assert ckpt.save(step, states[2], data_position=step)
        assert not ckpt.should_save(4)  # already saved
        assert not ckpt.save(4, states[2], data_position=4, force=True)  # never overwritten
    assert checkpoint.committed_steps(tmp_path) == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3", "4"]


def test_restore_onto_a_different_mesh_reshards(pristine, states):
    mesh = _mesh4()
    abstract = _abstract(states[4], mesh, P("fsdp", "tensor"))
    ckpt = checkpoint.Checkpointer(pristine, every=2, keep=3, config_json=CONFIG)
    restored, _ = ckpt.restore(abstract)
    ckpt.close()
    _assert_bit_exact(restored, states[4])
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(abstract), strict=True):
        assert got.sharding == want.sharding
        assert set(got.sharding.device_set) == set(jax.devices()[:4])
    w = restored["params"]["dense"]["w"]
    assert {s.data.shape for s in w.addressable_shards} == {(32, 32)}


def test_shape_mismatch_is_one_line_naming_the_array_before_reading_data(ckpt_dir, states):
    # Damage the data: the mismatch must still be reported, as it is read from metadata alone.
    data_file = largest_data_file(ckpt_dir / "4")
    data_file.write_bytes(b"\xff" * data_file.stat().st_size)
    abstract = _abstract(states[4])
    abstract["params"]["dense"]["w"] = jax.ShapeDtypeStruct(
        (32, 64), jnp.float32, sharding=abstract["params"]["dense"]["w"].sharding
    )
    ckpt = checkpoint.Checkpointer(ckpt_dir, every=2, keep=3, config_json=CONFIG)
    with pytest.raises(ConfigError) as err:
        ckpt.restore(abstract)
    message = str(err.value)
    assert "\n" not in message
    assert (
        "params/dense/w" in message and "float32[64,64]" in message and "float32[32,64]" in message
    )

    abstract = _abstract(states[4])
    abstract["params"]["extra"] = abstract["params"]["out"]
    with pytest.raises(ConfigError, match="no array params/extra/w"):
        ckpt.restore(abstract)
    ckpt.close()


def test_half_written_folders_are_ignored(ckpt_dir, states, caplog):
    half = ckpt_dir / "6"
    shutil.copytree(ckpt_dir / "4", half)
    (half / checkpoint.COMMIT_MARKER).unlink()
    (half / "_CHECKPOINT_METADATA").unlink()
    (ckpt_dir / "8.orbax-checkpoint-tmp-1234").mkdir()  # a save killed mid-write
    assert checkpoint.committed_steps(ckpt_dir) == [2, 4]
    with caplog.at_level(logging.WARNING, logger="jaxdist.checkpoint"):
        ckpt = checkpoint.Checkpointer(ckpt_dir, every=2, keep=3, config_json=CONFIG)
    assert "without orbax's commit marker" in caplog.text and ": 6" in caplog.text
    assert ckpt.latest_step() == 4
    _, meta = ckpt.restore(_abstract(states[4]))
    assert meta["step"] == 4
    # Saving step 6 moves the stale folder aside instead of failing on it.
    assert ckpt.save(6, states[2], data_position=60)
    ckpt.wait()
    assert ckpt.latest_step() == 6
    assert any(p.name.startswith("6.uncommitted-") for p in ckpt_dir.iterdir())
    _, meta = ckpt.restore(_abstract(states[2]))
    assert meta["step"] == 6 and meta["data_position"] == 60
    ckpt.close()


def test_corrupted_newest_step_falls_back_with_a_warning(ckpt_dir, states, caplog):
    data_file = largest_data_file(ckpt_dir / "4")
    data_file.write_bytes(b"\xff" * data_file.stat().st_size)
    ckpt = checkpoint.Checkpointer(ckpt_dir, every=2, keep=3, config_json=CONFIG)
    with caplog.at_level(logging.WARNING, logger="jaxdist.checkpoint"):
        restored, meta = ckpt.restore(_abstract(states[2]))
    assert meta["step"] == 2
    _assert_bit_exact(restored, states[2])
    assert "unreadable" in caplog.text and "fell back to step 2" in caplog.text
    assert ckpt.latest_step() == 2 and ckpt.should_save(4)
    with pytest.raises(ConfigError, match="step 4 .* is unreadable"):
        ckpt.restore(_abstract(states[4]), step=4)
    # The next save moves the unreadable step aside, so it is never picked up again.
    assert ckpt.save(4, states[4], data_position=40)
    ckpt.wait()
    assert ckpt.all_steps() == [2, 4]
    _, meta = ckpt.restore(_abstract(states[4]))
    assert meta["step"] == 4
    ckpt.close()


def test_every_step_unreadable_raises_instead_of_starting_over(ckpt_dir, states):
    for step in (2, 4):
        data_file = largest_data_file(ckpt_dir / str(step))
        data_file.write_bytes(b"\xff" * data_file.stat().st_size)
    ckpt = checkpoint.Checkpointer(ckpt_dir, every=2, keep=3, config_json=CONFIG)
    with pytest.raises(ConfigError, match=r"no readable checkpoint .*\[4, 2\]"):
        ckpt.restore(_abstract(states[4]))
    ckpt.close()


@pytest.mark.filterwarnings("ignore:Sharding info not provided")  # plain orbax reads the saved one
def test_plain_orbax_reads_the_saved_params(pristine, states):
    restored = ocp.PyTreeCheckpointer().restore(pristine / "4" / "state")
    for path, want in checkpoint.flatten(states[4]["params"]).items():
        got = checkpoint.flatten(restored["params"])[path]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


_PLAIN_ORBAX_EPILOGUE = """
import sys

assert not [m for m in sys.modules if m.split(".")[0] in ("jaxdist", "models")], "imported jaxdist"
assert jax.device_count() == 1, jax.devices()
try:  # the bare form the docs warn about fails here, so this machine differs from the writer
    ocp.PyTreeCheckpointer().restore(path)
    print("bare restore worked")
except ValueError as err:
    print("bare restore failed:", str(err).splitlines()[0])
np.savez("params.npz", **{jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(params)})
"""


def test_docs_plain_orbax_form_reads_params_on_another_device_count(pristine, states, tmp_path):
    """docs/CHECKPOINTS.md's plain-orbax block, as written, on 1 device and with no jaxdist import."""
    doc = (REPO / "docs" / "CHECKPOINTS.md").read_text()
    blocks = [b.split("\n", 1)[1] for b in doc.split("```")[1::2] if b.startswith("python")]
    (snippet,) = [b for b in blocks if "PyTreeCheckpointer" in b]
    # The checkpoint where the block looks for it, written on 8 devices (mesh data=8).
    shutil.copytree(pristine / "4", tmp_path / "runs/default/checkpoints/300")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    out = subprocess.run(
        [python(), "-c", snippet + _PLAIN_ORBAX_EPILOGUE],
        cwd=tmp_path,
        env={**env, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "bare restore failed: sharding passed to deserialization" in out.stdout, out.stdout
    want = jax.tree_util.tree_leaves_with_path(states[4]["params"])
    with np.load(tmp_path / "params.npz", allow_pickle=False) as got:
        assert sorted(got.files) == sorted(jax.tree_util.keystr(k) for k, _ in want)
        for k, v in want:
            np.testing.assert_array_equal(got[jax.tree_util.keystr(k)], np.asarray(v))


def test_verify_reports_non_finite_values(tmp_path):
    state = _make_state(3)
    state["params"]["dense"]["b"] = state["params"]["dense"]["b"].at[5].set(jnp.nan)
    with checkpoint.Checkpointer(tmp_path, every=1, keep=1, config_json=None) as ckpt:
        ckpt.save(3, state, data_position=3)
    report = checkpoint.verify_checkpoint(tmp_path)
    assert report.problems == ["params/dense/b has non-finite values (1 of 64)"]


def test_per_replica_state_mismatch_says_which_setting_and_replica_count():
    """Compression and local SGD state has a leading replica axis: the error says how to resume."""
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    saved = {"params/w": f32(4, 3), "grad_sync/residual/w": f32(8, 4, 3)}
    expected = {"params/w": f32(4, 3), "grad_sync/residual/w": f32(4, 4, 3)}
    with pytest.raises(ConfigError, match="state of 8 data-parallel replicas: resume with 8"):
        checkpoint.check_matches(saved, expected, "ckpt")
    with pytest.raises(ConfigError, match="keep the saved grad_sync.compression"):
        checkpoint.check_matches(saved, {"params/w": f32(4, 3)}, "ckpt")
    with pytest.raises(ConfigError, match="keep the saved grad_sync.local_steps"):
        checkpoint.check_matches(saved, {**saved, "local/params/w": f32(8, 4, 3)}, "ckpt")
    with pytest.raises(ConfigError, match="a different model"):
        checkpoint.check_matches(saved, {**saved, "params/b": f32(3)}, "ckpt")


def test_check_config_compatible_names_the_first_differing_field():
    checkpoint.check_config_compatible(CONFIG, {**CONFIG, "train": {"steps": 99}})
    checkpoint.check_config_compatible(None, CONFIG)
    changed = {**CONFIG, "model": {"name": "mlp", "d_model": 128}}
    with pytest.raises(ConfigError, match=r"model\.d_model .*saved 64, now 128"):
        checkpoint.check_config_compatible(CONFIG, changed)
    with pytest.raises(ConfigError, match=r"train\.steps"):
        checkpoint.check_config_compatible(CONFIG, {**CONFIG, "train": {}}, fields=("train.steps",))


def test_bad_arguments_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint.every"):
        checkpoint.Checkpointer(tmp_path, every=-1, keep=1, config_json=None)
    with pytest.raises(ConfigError, match="JSON"):
        checkpoint.Checkpointer(tmp_path, every=1, keep=1, config_json={"x": object()})


# ------------------------------------------------------------------------------------------------
# scripts/ckpt.py, run as a user would.


def _tool(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [python(), "scripts/ckpt.py", *map(str, args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_tool_inspect_lists_paths_shapes_and_config(pristine):
    out = _tool("inspect", pristine)
    assert out.returncode == 0, out.stderr
    assert "steps: 2, 4 (latest 4)" in out.stdout
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line.strip()}
    assert "(64, 64)" in lines["params/dense/w"] and "float32" in lines["params/dense/w"]
    assert (
        "16384" in lines["params/dense/w"]
        and "P('data') on mesh(data=8)" in lines["params/dense/w"]
    )
    assert "(64, 8)" in lines["params/out/w"]
    assert "opt_state/0/mu/dense/w" in lines and "rng" in lines and "step" in lines
    assert json.loads(out.stdout.split("config:\n", 1)[1]) == CONFIG


def test_tool_export_npz_and_safetensors_match_the_params(pristine, states, tmp_path):
    want = {k: np.asarray(v) for k, v in checkpoint.flatten(states[2]["params"]).items()}
    out = _tool("export", pristine, "--out", tmp_path / "p.npz", "--step", "2")
    assert out.returncode == 0, out.stderr
    with np.load(tmp_path / "p.npz", allow_pickle=False) as npz:
        assert sorted(npz.files) == sorted(want) == ["dense/b", "dense/w", "out/w"]
        for key, value in want.items():
            np.testing.assert_array_equal(npz[key], value)

    from safetensors.numpy import load_file

    out = _tool("export", pristine, "--out", tmp_path / "p.safetensors", "--step", "2")
    assert out.returncode == 0, out.stderr
    loaded = load_file(tmp_path / "p.safetensors")
    assert sorted(loaded) == sorted(want)
    np.testing.assert_array_equal(loaded["dense/w"], want["dense/w"])


def test_tool_verify_passes_then_names_a_corrupted_or_deleted_data_file(ckpt_dir):
    out = _tool("verify", ckpt_dir)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok: step 4")

    data_file = largest_data_file(ckpt_dir / "4")
    original = data_file.read_bytes()
    data_file.write_bytes(b"\xff" * len(original))
    out = _tool("verify", ckpt_dir)
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1 and "params/dense/w unreadable" in out.stderr

    data_file.unlink()
    out = _tool("verify", ckpt_dir)
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1 and "params/dense/w unreadable" in out.stderr


def test_tool_accepts_a_relative_directory_as_the_docs_show_it(pristine, tmp_path):
    """`ckpt.py inspect runs/default/checkpoints`: orbax wants absolute paths; the tool resolves."""
    relative = os.path.relpath(pristine, REPO)
    assert not os.path.isabs(relative)
    out = _tool("inspect", relative)
    assert out.returncode == 0, out.stderr
    assert "steps: 2, 4 (latest 4)" in out.stdout
    out = _tool("verify", relative)
    assert out.returncode == 0 and out.stdout.startswith("ok: step 4"), out.stderr
    out = _tool("export", relative, "--out", os.path.relpath(tmp_path / "p.npz", REPO))
    assert out.returncode == 0, out.stderr
    with np.load(tmp_path / "p.npz", allow_pickle=False) as npz:
        assert sorted(npz.files) == ["dense/b", "dense/w", "out/w"]


def test_tool_export_safetensors_without_the_extra_says_how_to_install(pristine, tmp_path):
    # A module that fails to import stands in for a missing package (sys.path comes first).
    fake = tmp_path / "fake"
    (fake / "safetensors").mkdir(parents=True)
    (fake / "safetensors" / "__init__.py").write_text("raise ImportError('not installed')\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(fake)}
    out = subprocess.run(
        [
            python(),
            os.path.join(REPO, "scripts/ckpt.py"),
            "export",
            str(pristine),
            "--out",
            "w.safetensors",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert "pip install -e '.[export]'" in out.stderr and out.stderr.startswith("error: ")
    assert not list(tmp_path.glob("w.safetensors*"))  # nothing half-written


@pytest.mark.parametrize(
    "args, message",
    [
        (("inspect", "/nonexistent/checkpoints"), "does not exist"),
        (("verify", "{dir}", "--step", "3"), "step 3 is not a committed checkpoint"),
    ],
)
def test_tool_errors_are_one_line_with_exit_code_2(pristine, args, message):
    out = _tool(*(a.format(dir=pristine) for a in args))
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and message in out.stderr and "Traceback" not in out.stderr


# ------------------------------------------------------------------------------------------------
# Two processes (scripts/launch.py, 2 x 4 CPU devices), each running `_two_process_worker` below.


@pytest.mark.slow
def test_two_processes_save_cooperatively_and_agree_on_fallback(tmp_path):
    out = subprocess.run(
        [
            python(),
            "scripts/launch.py",
            "--num_processes=2",
            "--devices_per_process=4",
            "--platform=cpu",
            "--",
            "python",
            "tests/test_checkpoint.py",
            str(tmp_path / "c"),
        ],
        cwd=REPO,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    for rank in (0, 1):
        assert f"[{rank}] worker ok" in out.stdout, (out.stdout + out.stderr)[-4000:]


def _two_process_worker(directory: str) -> None:
    from jax.experimental import multihost_utils

    from jaxdist import distributed
    from jaxdist import mesh as mesh_lib

    distributed.initialize()
    mesh_lib.configure_cpu_devices(4)
    assert jax.process_count() == 2 and jax.device_count() == 8
    w = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)

    def state(k, mesh, spec):  # a global array assembled from each process's slices
        make = lambda x, s: jax.make_array_from_callback(
            x.shape, NamedSharding(mesh, s), x.__getitem__
        )
        return {"step": make(np.int32(k), P()), "params": {"w": make(w * k, spec)}}

    ckpt = checkpoint.Checkpointer(directory, every=1, keep=3, config_json=CONFIG)
    for k in (1, 2):
        assert ckpt.save(k, state(k, _mesh8(), P("data")), data_position=k)
    ckpt.wait()
    state_dir = Path(directory, "2", "state")
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= {p.name for p in state_dir.iterdir()}

    # Onto a 4x2 mesh over both processes' devices: each process reads only its own slices.
    mesh42 = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        state(0, mesh42, P("fsdp", "tensor")),
    )
    restored, meta = ckpt.restore(abstract)
    assert meta["step"] == 2
    for shard in restored["params"]["w"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), (w * 2)[shard.index])

    # Damage data that only some reads touch: both processes must still fall back together.
    multihost_utils.sync_global_devices("before_damage")
    if jax.process_index() == 0:
        data_file = max(
            (p for p in (state_dir / "ocdbt.process_1" / "d").iterdir()),
            key=lambda p: p.stat().st_size,
        )
        data_file.write_bytes(b"\xff" * data_file.stat().st_size)
    multihost_utils.sync_global_devices("after_damage")
    ckpt = checkpoint.Checkpointer(directory, every=1, keep=3, config_json=CONFIG)
    _, meta = ckpt.restore(abstract)
    assert meta["step"] == 1
    assert ckpt.save(2, state(2, _mesh8(), P("data")), data_position=2)  # moves the bad 2 aside
    ckpt.wait()
    _, meta = ckpt.restore(abstract)
    assert meta["step"] == 2
    ckpt.close()
    print(f"worker ok {jax.process_index()}", flush=True)


if __name__ == "__main__":
    _two_process_worker(sys.argv[1])


def test_checksums_catch_a_silently_flipped_byte(ckpt_dir, states, caplog):
    meta = checkpoint.read_metadata(ckpt_dir, 4)
    w_sums = meta["checksums"]["params/dense/w"]
    assert set(w_sums) == {f"{8 * i}:{8 * i + 8},0:64" for i in range(8)}  # one per shard
    assert set(meta["checksums"]) == set(meta["shardings"])

    # The step still reads, finite, with different numbers: only the checksums can tell.
    path = flip_a_bit_that_still_decodes(ckpt_dir, 4)
    report = checkpoint.verify_checkpoint(ckpt_dir, 4)
    assert report.problems and all(" checksum mismatch " in p for p in report.problems), report
    assert report.problems[0].startswith(f"{path} shard ["), report.problems
    out = _tool("verify", ckpt_dir)
    assert out.returncode == 1 and f"{path} shard [" in out.stderr, out.stderr
    assert "checksum mismatch" in out.stderr

    ckpt = checkpoint.Checkpointer(ckpt_dir, every=2, keep=3, config_json=CONFIG)
    with caplog.at_level(logging.WARNING, logger="jaxdist.checkpoint"):
        restored, meta = ckpt.restore(_abstract(states[2]))
    assert meta["step"] == 2
    _assert_bit_exact(restored, states[2])
    assert "checksum mismatch" in caplog.text and "fell back to step 2" in caplog.text
    # Restored onto another layout (4 devices, 2-D arrays 16 rows each), it is still seen.
    mesh4 = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    with pytest.raises(ConfigError, match="checksum mismatch"):
        ckpt.restore(_abstract(states[4], mesh4, P("data")), step=4)
    ckpt.close()
