"""Shared builders for tests: tiny configs, meshes over a subset of the 8 simulated devices."""

from __future__ import annotations

import math
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np

from jaxdist import config as config_lib
from jaxdist import data, mesh, train


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


def train_steps(c, steps: int):
    """Runs `steps` steps; returns (per-step losses, final params on the host)."""
    eng, batches = engine_for(c)
    state = eng.init()
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


def run_script(script: str, *flags: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python SCRIPT FLAGS` from the repository root on CPU; fails the test unless it exits 0."""
    proc = subprocess.run(
        [sys.executable, script, *flags],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc
