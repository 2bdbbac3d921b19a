"""The image classifiers shard like the GPT: same losses as one device, on a real data set."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxdist import config as config_lib
from tests.helpers import train_steps


def classifier_config(name: str, **mesh_sizes):
    c = config_lib.base_config()
    for axis in config_lib.MESH_AXES:
        c.mesh[axis] = mesh_sizes.get(axis, 1)
    c.model.name = name
    c.model.hidden_dims = (64, 32)
    c.model.widths = (8, 16)
    c.data.source = "digits"
    c.train.batch_size = 32
    c.train.learning_rate = 3e-3
    c.train.warmup_steps = 0
    return c


@pytest.mark.parametrize(
    "name,mesh_sizes",
    [("mlp", dict(data=4, tensor=2)), ("resnet", dict(data=2, tensor=2, fsdp=2))],
)
def test_classifier_sharded_matches_single_device(name, mesh_sizes):
    ref_losses, ref_params = train_steps(classifier_config(name, data=1), steps=4)
    losses, params = train_steps(classifier_config(name, **mesh_sizes), steps=4)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < losses[0]
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, atol=1e-5)
