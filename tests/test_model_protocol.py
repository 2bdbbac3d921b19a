"""The model protocol: a family registered from outside `models/` trains, pipelined, like one device;
families without pipeline stages are refused in one line."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import models
from jaxdist import config as config_lib
from jaxdist import mesh as mesh_lib
from jaxdist import train
from jaxdist.errors import ConfigError
from tests import toy_model
from tests.helpers import dataset, engine_for, initial_state, tiny_gpt_config
from tests.test_models import classifier_config


@pytest.fixture
def toy():
    models.register(toy_model.FAMILY)
    yield toy_model.NAME
    models.unregister(toy_model.NAME)


def _toy_config(name: str, **mesh):
    c = tiny_gpt_config(**mesh)
    c.model.name = name
    c.model.num_layers = 4  # 2 per stage
    c.pipeline.microbatches = 4
    return c


def _run(c, steps: int = 4):
    eng, batches = engine_for(c)
    state, losses, norms = initial_state(eng, c), [], []
    for i in range(steps):
        state, m = eng.train_step(state, batches.get(i))
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    return eng, np.array(losses), np.array(norms), jax.device_get(state["params"])


def test_registry_takes_a_family_from_outside_models(toy):
    assert toy in models.names() and models.get(toy) is toy_model.FAMILY
    models.unregister(toy)
    with pytest.raises(ConfigError, match=f"model.name='{toy}' is not valid; choose one of gpt"):
        config_lib.validate(_toy_config(toy, pipeline=2), 2)
    models.register(toy_model.FAMILY)
    assert config_lib.validate(_toy_config(toy, pipeline=2), 2)["pipeline"] == 2


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb"])
def test_toy_model_pipelined_matches_single_device(toy, schedule):
    """A model that is not the GPT, its parameters named nothing like the GPT's, through the
    pipeline (p = 2, 4 microbatches) for 4 float32 steps: the same losses, gradient norms and
    parameters as its 1-device run, within 1e-5."""
    _, ref_losses, ref_norms, ref_params = _run(_toy_config(toy, data=1))
    c = _toy_config(toy, pipeline=2)
    c.pipeline.schedule = schedule
    eng, losses, norms, params = _run(c)
    assert eng.schedule is not None and eng.schedule.name == schedule  # the pipelined path ran
    assert eng.schedule.stages == 2 and eng.train_step is not None
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
    assert losses[-1] < losses[0]  # it trains
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(ref_params), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("name", ["mlp", "resnet"])
def test_family_without_stages_refused_for_pipeline(name):
    c = classifier_config(name, pipeline=2)
    with pytest.raises(ConfigError, match=r"mesh\.pipeline=2 .*model\.name='" + name) as e:
        config_lib.validate(c, 2)
    assert "\n" not in str(e.value)
    # train.build refuses the same way, without validate().
    m = mesh_lib.make_mesh(c.mesh, devices=jax.devices()[:2])
    with pytest.raises(ConfigError, match=r"mesh\.pipeline=2 ") as e:
        train.build(c, m, dataset(c))
    assert "\n" not in str(e.value)
