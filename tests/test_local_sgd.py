"""Local SGD / DiLoCo (`grad_sync.local_steps` > 1) inside the real train step."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxdist import config as config_lib
from jaxdist import loop, metrics, plan
from jaxdist.errors import ConfigError
from tests.helpers import compile_step, engine_for, n_devices, tiny_gpt_config, train_steps

R = 4  # replicas


def local_config(local_steps: int, **mesh_sizes):
    c = tiny_gpt_config(data=R, **mesh_sizes)
    c.train.optimizer = "sgd"
    c.train.learning_rate = 0.3
    c.train.momentum = 0.9
    c.grad_sync.local_steps = local_steps
    return c


def test_local_sgd_step_matches_independent_replicas_averaged_every_h_steps():
    """Each replica trains on its own rows of the global batch with its own optimizer state; every
    H-th step the parameters are averaged. Reference: one 1-device engine per replica."""
    h, steps = 3, 5  # ends two steps after a sync: the replicas differ again
    eng, batches = engine_for(local_config(h))
    state = eng.init()
    for i in range(steps):
        state, m = eng.train_step(state, batches.get(i))
        assert np.isfinite(float(m["loss"]))

    ref_cfg = local_config(1)
    ref_cfg.mesh.data = 1
    ref_cfg.train.batch_size //= R
    ref_eng, _ = engine_for(ref_cfg)
    replicas = [ref_eng.init() for _ in range(R)]
    rows = ref_cfg.train.batch_size
    anchor = jax.device_get(replicas[0]["params"])
    for i in range(steps):
        batch = {k: np.asarray(v) for k, v in batches.get(i).items()}
        for j in range(R):
            mine = {k: v[j * rows : (j + 1) * rows] for k, v in batch.items()}
            replicas[j], _ = ref_eng.train_step(replicas[j], mine)
        if (i + 1) % h == 0:
            params = [jax.device_get(r["params"]) for r in replicas]
            anchor = jax.tree.map(lambda *xs: np.mean(np.stack(xs), 0), *params)
            replicas = [
                {**r, "params": jax.device_put(anchor, ref_eng.state_shardings["params"])}
                for r in replicas
            ]

    got_anchor = jax.device_get(state["params"])
    got_local = jax.device_get(state["local"]["params"])
    for want, got in zip(jax.tree.leaves(anchor), jax.tree.leaves(got_anchor), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    for j in range(R):
        want = jax.device_get(replicas[j]["params"])
        got = jax.tree.map(lambda x, j=j: x[j], got_local)
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
            np.testing.assert_allclose(b, a, rtol=0, atol=2e-5)
    assert int(state["step"]) == steps


def test_local_sgd_sends_parameters_once_every_h_steps():
    h = 4
    c = local_config(h)
    eng, compiled = compile_step(c)
    ops = metrics.collective_ops(compiled.as_text())
    param_bytes = sum(
        x.size * x.dtype.itemsize for x in jax.tree.leaves(eng.abstract_state["params"])
    )
    ring = 2 * (R - 1) / R
    averaged = sum(op.wire_bytes for op in ops if op.conditional)
    every_step = sum(op.wire_bytes for op in ops if not op.conditional)
    assert averaged == pytest.approx(ring * param_bytes, rel=1e-3)  # f32 all-reduce of params
    assert every_step <= ring * 8  # the loss and gradient-norm scalars only
    record = loop.layout_record(eng, compiled, c)
    total = sum(record["collective_bytes_per_step"].values())
    assert total == pytest.approx(averaged / h + every_step, rel=1e-6)
    assert record["local_steps"] == h and record["bytes_per_device"]["local_state"] > 0
    assert plan.layout_prediction(c, eng) == {}  # the planner does not model local SGD


def test_diloco_with_fsdp_trains():
    """Nesterov outer steps, replicas' state sharded on fsdp (averaging is checked above)."""
    c = local_config(2, fsdp=2)
    c.grad_sync.outer_optimizer = "nesterov"
    eng, batches = engine_for(c)
    state = eng.init()
    losses = []
    for i in range(6):
        state, m = eng.train_step(state, batches.get(i))
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0], losses
    spec = state["local"]["params"]["embed"].sharding.spec
    assert spec[0] == "data" and "fsdp" in jax.tree.leaves(tuple(spec[1:])), spec


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_local_sgd_with_pipeline_stages_matches_flat(schedule):
    """data=4 x pipeline=2: each stage keeps and averages only its own layers, and the run equals
    the same local SGD on data=4 without stages."""

    def config(**pipe):
        c = local_config(2, **pipe)
        c.model.num_layers = 4
        if pipe:
            c.pipeline.schedule, c.pipeline.microbatches = schedule, 2
        return c

    ref, ref_params = train_steps(config(), steps=3)  # steps 0, 1 local, the average, step 2
    losses, params = train_steps(config(pipeline=2), steps=3)
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)

    def averaged_bytes(c):
        _, compiled = compile_step(c)
        return sum(
            o.wire_bytes for o in metrics.collective_ops(compiled.as_text()) if o.conditional
        )

    eng, _ = engine_for(config(pipeline=2))
    params = eng.abstract_state["params"]
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    # Every stage all-reduces half the layers plus the (unstaged) embedding and head.
    per_stage = nbytes(params) - nbytes(params["blocks"]) / 2
    ring = 2 * (R - 1) / R
    assert averaged_bytes(config(pipeline=2)) == pytest.approx(ring * per_stage, rel=1e-3)


def test_local_sgd_on_data_fsdp_tensor_matches_data_only():
    """data=2 x fsdp=2 x tensor=2 (replica steps vmapped over `data`, nothing manual) runs the same
    local SGD as data=2 on two devices: parameters sharded differently, same numbers."""

    def config(**sizes):
        c = tiny_gpt_config(**sizes)
        c.train.optimizer, c.train.learning_rate, c.train.momentum = "sgd", 0.3, 0.9
        c.grad_sync.local_steps = 2
        c.grad_sync.outer_optimizer = "nesterov"
        return c

    ref, ref_params = train_steps(config(data=2), steps=3)  # two local steps, the sync, one more
    losses, params = train_steps(config(data=2, fsdp=2, tensor=2), steps=3)
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    assert losses[-1] < losses[0]
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "field,value,mesh_sizes,match",
    [
        ("grad_sync.compression", "int8", {}, "compression='none'"),
        ("grad_sync.outer_optimizer", "adam", {}, "grad_sync.outer_optimizer"),
        ("grad_sync.outer_momentum", 1.0, {}, "outer_momentum"),
        ("grad_sync.warmup_steps", -1, {}, "warmup_steps=-1 must be an integer >= 0"),
        (None, None, {"tensor": 2, "pipeline": 2}, "needs fsdp = tensor = 1"),
    ],
)
def test_local_sgd_bad_config_is_one_line(field, value, mesh_sizes, match):
    c = local_config(2, **mesh_sizes)
    if field:
        section, name = field.split(".")
        c[section][name] = value
    with pytest.raises(ConfigError, match=match) as e:
        config_lib.validate(c, n_devices(c))
    assert "\n" not in str(e.value)
    c = tiny_gpt_config(fsdp=8)
    c.grad_sync.local_steps = 2
    with pytest.raises(ConfigError, match="mesh.data=1"):
        config_lib.validate(c, 8)
    c = local_config(2)  # post-local SGD's synchronous start is plain local SGD's only
    c.grad_sync.warmup_steps, c.grad_sync.fragments = 4, 2
    with pytest.raises(ConfigError, match="warmup_steps=0") as e:
        config_lib.validate(c, n_devices(c))
    assert "\n" not in str(e.value)


def test_local_sgd_refuses_the_load_balancing_loss():
    """Local SGD's replicas step apart, so a mixture of experts' load-balancing loss could only
    see each replica's own router statistics, not the batch's as every other strategy's does
    (`sharding.per_replica_loss`): refused in one line; without the loss the config is valid."""
    import configs.mixtral_tiny

    c = configs.mixtral_tiny.get_config()
    c.unlock()
    for axis in config_lib.MESH_AXES:
        c.mesh[axis] = R if axis == "data" else 1
    c.grad_sync.local_steps = 2
    with pytest.raises(
        ConfigError,
        match=r"^grad_sync.local_steps=2 with model.moe_aux_loss_weight=0.02: .*"
        r"set model.moe_aux_loss_weight=0 or grad_sync.local_steps=1$",
    ) as e:
        config_lib.validate(c, R)
    assert "\n" not in str(e.value)
    c.model.moe_aux_loss_weight = 0.0
    config_lib.validate(c, R)
