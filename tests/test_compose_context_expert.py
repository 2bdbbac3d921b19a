"""`mesh.context` and `mesh.expert` with the explicit data-parallel strategies: compressors.

A data replica is a group of context / expert devices: inside it, every gradient is summed exactly
(f32) over the axes that split its tokens, and the compressor then reduces over `data` on each
device's own shard (`strategies._shard_axes`). So a context=2 × data=4 (expert=2 × data=4) run
must equal the same compressor on data=4 alone: same replicas, same per-replica gradients.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from tests.helpers import train_steps
from tests.test_llama import llama_config

STEPS = 3


def config(compression: str, moe: bool, **mesh_sizes):
    """The tiny Llama (with 8 experts, top-2, dropless when `moe`), SGD as in llama_config."""
    c = llama_config(**mesh_sizes)
    c.grad_sync.compression = compression
    if moe:
        c.model.num_experts, c.model.experts_per_token, c.model.mlp_dim = 8, 2, 64
    return c


@functools.cache
def _run(compression: str, moe: bool, sizes: tuple) -> tuple:
    return train_steps(config(compression, moe, **dict(sizes)), STEPS)


@pytest.mark.parametrize("compression", ["bf16", "int8", "powersgd", "topk"])
@pytest.mark.parametrize("axis", ["context", "expert"])
def test_compressor_with_context_or_expert(compression, axis):
    """Losses within 1e-5 of the same compressor on data=4 (parameters too for PowerSGD, which is
    continuous in the gradient: bf16 / int8 rounding may flip a level on a 1e-7 difference), and
    within the 5% of one device that tests/test_compression_layouts.py allows a compressor."""
    moe = axis == "expert"
    ref, _ = _run("none", moe, ())
    flat, flat_params = _run(compression, moe, (("data", 4),))
    losses, params = _run(compression, moe, (("data", 4), (axis, 2)))
    np.testing.assert_allclose(losses, flat, rtol=0, atol=1e-5)
    if compression == "powersgd":
        for (path, p), r in zip(
            jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(flat_params), strict=True
        ):
            np.testing.assert_allclose(p, r, rtol=0, atol=1e-5, err_msg=jax.tree_util.keystr(path))
    assert losses[-1] < losses[0]
    assert np.all(np.abs(losses - ref) / ref < 0.05), (losses, ref)


@pytest.mark.parametrize("compression", ["ef_sign", "onebit_adam"])
@pytest.mark.parametrize("axis", ["context", "expert"])
def test_one_bit_compressors_with_context_or_expert(compression, axis):
    """The 1-bit methods on data=4 × `axis`=2 equal the same method on data=4 within 1e-5 (losses).

    Only the composition is checked here: how far 3 steps of 1-bit SGD / Adam drift from the
    uncompressed run is the method's own matter (the compression study, docs/COMPRESSION.md).
    """
    moe = axis == "expert"

    def cfg(**sizes):
        c = config(compression, moe, **sizes)
        if compression == "onebit_adam":
            c.train.optimizer, c.train.learning_rate, c.grad_sync.warmup_steps = "adamw", 1e-4, 2
        return c

    flat, _ = train_steps(cfg(data=4), STEPS)
    losses, _ = train_steps(cfg(data=4, **{axis: 2}), STEPS)
    np.testing.assert_allclose(losses, flat, rtol=0, atol=1e-5)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("axis", ["context", "expert"])
def test_local_sgd_with_context_or_expert(axis):
    """DiLoCo (2 inner steps, Nesterov outer step) on data=4 × `axis`=2: each replica is a group
    of two devices; 4 steps equal the data=4 run of the same 4 replicas within 1e-5 (losses and
    parameters)."""
    moe = axis == "expert"

    def local_sgd(**sizes):
        c = config("none", moe, **sizes)
        c.grad_sync.local_steps, c.grad_sync.outer_optimizer = 2, "nesterov"
        c.model.moe_aux_loss_weight = 0.0  # local SGD refuses it (strategies.check)
        return c

    flat, flat_params = train_steps(local_sgd(data=4), 4)
    losses, params = train_steps(local_sgd(data=4, **{axis: 2}), 4)
    np.testing.assert_allclose(losses, flat, rtol=0, atol=1e-5)
    for (path, p), r in zip(
        jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(flat_params), strict=True
    ):
        np.testing.assert_allclose(p, r, rtol=0, atol=1e-5, err_msg=jax.tree_util.keystr(path))
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("axis", ["context", "expert"])
def test_exact_ring_algorithm_with_context_or_expert(axis):
    """grad_sync.algorithm='ring' (jaxdist/allreduce.py) on data=4 × `axis`=2 equals it on data=4
    within 1e-5 (losses and parameters). Both run the replicas under a vmap, where MoE's
    dropless layer takes the padded path (C = n); before, MoE failed to compile there."""
    moe = axis == "expert"

    def ring(**sizes):
        c = config("none", moe, **sizes)
        c.grad_sync.algorithm = "ring"
        return c

    flat, flat_params = train_steps(ring(data=4), STEPS)
    losses, params = train_steps(ring(data=4, **{axis: 2}), STEPS)
    np.testing.assert_allclose(losses, flat, rtol=0, atol=1e-5)
    for (path, p), r in zip(
        jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(flat_params), strict=True
    ):
        np.testing.assert_allclose(p, r, rtol=0, atol=1e-5, err_msg=jax.tree_util.keystr(path))


@functools.cache
def _data_parallel_bytes(compression: str, axis: str) -> float:
    """Bytes per step of the compiled step's reductions whose groups span 4 or more devices: over
    `data` (groups of 4, or 8 where XLA sums over data × `axis` at once). The exact sums inside a
    replica's group and the expert all-to-alls are groups of 2; the ring's K/V collective-permutes
    (the same with and without compression) are left out, as in test_compression_layouts.py."""
    from jaxdist import metrics
    from tests.helpers import compile_step

    _, compiled = compile_step(config(compression, axis == "expert", data=4, **{axis: 2}))
    ops = metrics.collective_ops(compiled.as_text())
    assert any(o.group_size == 2 and o.wire_bytes > 0 for o in ops)  # the axis is used
    return sum(o.wire_bytes for o in ops if o.kind != "collective-permute" and o.group_size >= 4)


@pytest.mark.parametrize("axis", ["context", "expert"])
@pytest.mark.parametrize("compression, min_ratio", [("bf16", 1.9), ("int8", 3.5)])
def test_each_group_compresses_its_own_part(compression, min_ratio, axis):
    """The data-parallel bytes shrink by the bars tests/test_compression_layouts.py sets on
    pipeline / tensor meshes: no device gathers the rest of its group's gradient to compress."""
    ratio = _data_parallel_bytes("none", axis) / _data_parallel_bytes(compression, axis)
    assert ratio >= min_ratio, (compression, axis, ratio)
