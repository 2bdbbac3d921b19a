"""Shared builders for tests: tiny configs, meshes over a subset of the 8 simulated devices."""

from __future__ import annotations

import math
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxdist import config as config_lib
from jaxdist import data, mesh, train
from jaxdist.checkpoint import offline


def tiny_gpt_config(**mesh_sizes):
    c = config_lib.base_config()
    for axis in config_lib.MESH_AXES:
        c.mesh[axis] = mesh_sizes.get(axis, 1)
    c.model.num_layers = 2
    c.model.d_model = 32
    c.model.num_heads = 4
    c.model.seq_len = 16
    c.model.vocab_size = 256
    c.train.batch_size = 16
    c.train.steps = 5
    c.train.warmup_steps = 2
    c.train.learning_rate = 1e-2
    c.data.max_bytes = 400_000
    return c


def n_devices(c) -> int:
    return math.prod(int(c.mesh[a]) for a in config_lib.MESH_AXES)


_DATASETS = {}


def dataset(c):
    key = (c.data.source, c.data.max_bytes, c.model.seq_len)
    if key not in _DATASETS:
        _DATASETS[key] = data.load(c.data, seq_len=c.model.seq_len, vocab_size=c.model.vocab_size)
    return _DATASETS[key]


def engine_for(c):
    devices = jax.devices()[: n_devices(c)]
    config_lib.validate(c, len(devices))
    m = mesh.make_mesh(c.mesh, devices=devices)
    ds = dataset(c)
    eng = train.build(c, m, ds)
    batches = data.Batches(
        ds,
        batch_size=c.train.batch_size,
        seq_len=c.model.seq_len,
        seed=c.train.seed,
        shardings=eng.batch_shardings,
    )
    return eng, batches


_INITIAL_PARAMS = {}


def initial_state(eng, c):
    """`eng.init()`, with the random weights drawn once per model, dataset, seed and shapes.

    The first engine of a model draws them (its own init program, on its layout; a family's
    constructor sees the model and the dataset); every later one starts from those weights put on
    its shardings (`eng.init(params=...)`, as `train.init_from` does), whose init program only
    builds the optimizer's state: the threefry of every parameter is most of an init's compile
    time. That a random init is the same on every layout is tests/test_init_layouts.py's to
    check, to the bit.
    """
    params = eng.abstract_state["params"]
    shapes = tuple((jax.tree_util.keystr(k), v.shape, str(v.dtype)) for k, v in
                   jax.tree_util.tree_leaves_with_path(params))  # fmt: skip
    model, data_ = (c[k].to_json_best_effort(sort_keys=True) for k in ("model", "data"))
    key = (model, data_, int(c.train.seed), shapes)  # the family's make reads the model and data
    if key not in _INITIAL_PARAMS:
        state = eng.init()
        _INITIAL_PARAMS[key] = jax.device_get(eng.to_user(state)["params"])
        return state
    shardings = jax.tree.map(lambda a: a.sharding, params)
    return eng.init(params=jax.device_put(_INITIAL_PARAMS[key], shardings))


def train_steps(c, steps: int):
    """Runs `steps` steps from `initial_state`; returns (per-step losses, final params on the
    host)."""
    eng, batches = engine_for(c)
    state = initial_state(eng, c)
    losses = []
    for i in range(steps):
        state, m = eng.train_step(state, batches.get(i))
        losses.append(float(m["loss"]))
    return np.array(losses), jax.device_get(eng.to_user(state)["params"])  # in [L] order


def compile_step(c):
    """(engine, compiled train step) for inspecting the compiled module; never executed."""
    eng, batches = engine_for(c)
    return eng, compile_for(eng, batches)


def compile_for(eng, batches):
    """`eng`'s train step compiled for `batches`' global shapes; a later `eng.train_step` call
    on such a batch runs this executable (jit's cache) instead of compiling again."""
    shapes = batches.global_shapes()
    dtypes = {"inputs": np.int32, "targets": np.int32}
    return eng.train_step.lower(eng.abstract_state, eng.abstract_batch(shapes, dtypes)).compile()


ROOT = pathlib.Path(__file__).resolve().parents[1]


def python() -> str:
    """The interpreter tests start scripts with: the session's forked one (tests/prefork.py,
    started by tests/conftest.py) where there is one, else this one. Not for a test that needs
    the process it starts to be the script itself (its pid, its process group, its own session)."""
    return os.environ.get("JAXDIST_TEST_PYTHON", sys.executable)  # prefork.PYTHON_ENV


# Variables that would make a script join the test runner's own cluster (a scheduler's, launch.py's).
CLUSTER_PREFIXES = ("SLURM_", "OMPI_", "PMIX_", "JAXDIST_", "JOB_COMPLETION_INDEX", "JOBSET_")


def env_without_cluster() -> dict[str, str]:
    """This process's environment without `CLUSTER_PREFIXES`' variables; the suite's own
    `JAXDIST_TEST_*` (the forked interpreter's socket among them) stay."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k.startswith("JAXDIST_TEST_") or not k.startswith(CLUSTER_PREFIXES)
    }
    env.pop("REPLICATED_JOB_NAME", None)
    return env


def run_script(script: str, *flags: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python SCRIPT FLAGS` from the repository root on CPU; fails the test unless it exits 0."""
    proc = subprocess.run(
        [python(), script, *flags],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def largest_data_file(step_dir: pathlib.Path) -> pathlib.Path:
    """The biggest data file of a saved step (where a flipped bit lands in an array's chunks)."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    return max(files, key=lambda p: p.stat().st_size)


def flip_a_bit_that_still_decodes(ckpt_dir: pathlib.Path, step: int) -> str:
    """Flips one bit of the largest data file where the step still reads, with other values.

    The chunks are zstd-compressed, so most flips break decoding (which restore always caught);
    the search, over fixed positions of a deterministic file, finds one that decodes to different
    numbers: the silent kind. Returns the path of the array it changed. Reads without the CRC
    check (`read_arrays` itself refuses such a step).
    """
    before = offline.read_arrays_unchecked(ckpt_dir, step)
    data_file = largest_data_file(ckpt_dir / str(step))
    original = data_file.read_bytes()
    for at in range(len(original) // 3, len(original), 7):
        raw = bytearray(original)
        raw[at] ^= 0x10
        data_file.write_bytes(bytes(raw))
        try:
            after = offline.read_arrays_unchecked(ckpt_dir, step)
        except Exception:
            continue
        changed = [p for p in before if not np.array_equal(before[p], after[p], equal_nan=True)]
        if changed and all(np.isfinite(after[p]).all() for p in changed):
            return changed[0]
    data_file.write_bytes(original)
    raise AssertionError(f"no flip in {data_file} decodes silently")


# The XLA:CPU code-generation flags tests/conftest.py puts in XLA_FLAGS for the session.
SUITE_CODEGEN_FLAGS = (
    "--xla_backend_optimization_level",
    "--xla_cpu_parallel_codegen_split_count",
    "--xla_cpu_use_fusion_emitters",
    "--xla_disable_hlo_passes",  # only the verifier's (tests/conftest.py)
)


def suite_xla_flags() -> str:
    """XLA_FLAGS for a script run whose environment must not carry the caller's XLA flags (a
    device count, say): only the suite's code-generation flags, which change how fast a program
    compiles and, with the fusion-emitter flag, its last bits (tests/conftest.py), never what
    it computes or how it is laid out."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    return " ".join(f for f in flags if f.split("=")[0] in SUITE_CODEGEN_FLAGS)


# A one-layer, 32-wide GPT on one CPU device, logging every step: the scripts' flags for the
# tests that run whole jobs (kill, resume, restart) and compare their metrics.
ONE_DEVICE_GPT_FLAGS = (
    "--config=configs/default.py",
    "--config.runtime.cpu_devices=1",
    "--config.mesh.data=1",
    "--config.mesh.fsdp=1",
    "--config.mesh.tensor=1",
    "--config.model.num_layers=1",
    "--config.model.d_model=32",
    "--config.model.num_heads=4",
    "--config.model.seq_len=16",
    "--config.train.batch_size=16",
    "--config.train.log_every=1",
    "--config.train.eval_every=0",
)

# Reading a damaged checkpoint leaves orbax's other reads in flight when the first one fails; they
# end as unraisable "Event loop is closed" / never-awaited read coroutines, reported whenever they
# are garbage-collected (often during a later test). Harmless; only those are ignored.
ORBAX_ABANDONED_READS = [
    pytest.mark.filterwarnings(
        "ignore:(?s)Exception ignored in. <coroutine object _read_array_index_and_device_put"
        ":pytest.PytestUnraisableExceptionWarning"
    ),
    pytest.mark.filterwarnings(
        "ignore:(?s)Exception ignored in. None.*Event loop is closed"
        ":pytest.PytestUnraisableExceptionWarning"
    ),
]
