"""The Llama family: every mesh layout and pipeline schedule trains like one device (float32)."""

from __future__ import annotations

import functools
import importlib.util

import jax
import numpy as np
import pytest

from jaxdist import config as config_lib
from jaxdist.errors import ConfigError
from tests.helpers import train_steps


def llama_config(tie: bool = False, **mesh_sizes):
    """configs/llama_tiny.py on a subset of the 8 devices, with less text read."""
    spec = importlib.util.spec_from_file_location("llama_tiny", "configs/llama_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    c.unlock()
    for axis in config_lib.MESH_AXES:
        c.mesh[axis] = mesh_sizes.get(axis, 1)
    c.model.tie_embeddings = tie
    c.model.seq_len = 32
    c.train.batch_size = 8
    c.train.warmup_steps = 0
    # SGD, not Adam: Adam's first update is lr·g/(|g| + 1e-8), so a weight whose gradient is near
    # 1e-8 (w_down has one at 4.9e-9 with this seed, equal to 1e-9 on every layout) moves by a
    # layout-dependent fraction of lr. SGD's update is linear in the gradient: a parameter
    # difference after 3 steps bounds the gradient difference, |Δp| <= lr·Σ|Δg|.
    c.train.optimizer, c.train.learning_rate = "sgd", 0.5
    c.data.max_bytes = 400_000
    return c


@functools.cache
def _reference(tie: bool):
    return train_steps(llama_config(tie), 3)


def _assert_matches(c, tie: bool):
    ref_losses, ref_params = _reference(tie)
    losses, params = train_steps(c, 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < losses[0]
    flat = jax.tree_util.tree_leaves_with_path(params)
    for (path, a), b in zip(flat, jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize(
    "tie, mesh, fields",
    [
        (False, dict(data=2, fsdp=2, tensor=2), dict(remat="dots_no_batch")),
        (True, dict(fsdp=4, tensor=2), dict(scan_unroll=2)),
    ],
)
def test_llama_sharded_matches_single_device(tie, mesh, fields):
    """Three float32 steps on data×fsdp×tensor meshes (grouped-query heads split over tensor):
    losses within rtol 1e-5, parameters within 1e-5 of one device."""
    c = llama_config(tie, **mesh)
    for k, v in fields.items():
        (c.model if k == "scan_unroll" else c.train)[k] = v
    _assert_matches(c, tie)


@pytest.mark.parametrize(
    "schedule, tie, mesh", [("1f1b", True, dict(data=2)), ("gpipe", False, dict(tensor=2))]
)
def test_llama_pipelined_matches_single_device(schedule, tie, mesh):
    """2 stages of one layer, 4 microbatches; with tied embeddings the table's gradient is the sum
    of the embedding's and the head's."""
    c = llama_config(tie, pipeline=2, **mesh)
    c.pipeline.schedule, c.pipeline.microbatches = schedule, 4
    _assert_matches(c, tie)


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(num_kv_heads=3), r"model.num_heads=4 must be divisible by model.num_kv_heads=3"),
        (dict(num_kv_heads=1), r"model.num_kv_heads=1 must be divisible by mesh.tensor=2"),
        (dict(rope_scaling_type="yarn"), r"model.rope_scaling.type='yarn' is not valid"),
    ],
)
def test_llama_config_errors_are_one_line(fields, match):
    c = llama_config(tensor=2)
    for k, v in fields.items():
        if k == "rope_scaling_type":
            c.model.rope_scaling.type = v
        else:
            c.model[k] = v
    with pytest.raises(ConfigError, match=match) as e:
        config_lib.validate(c, 2)
    assert "\n" not in str(e.value)
