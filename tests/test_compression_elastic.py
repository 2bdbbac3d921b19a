"""Elastic compressor state: a checkpoint with compression or local SGD resumes on 8 -> 4 -> 8 replicas.

What the error feedback owes the model (the mean over replicas of the worker residuals plus the
server residuals put back together) is preserved exactly across each resize; counters carry on;
training continues with finite losses.
"""

import jax
import numpy as np
import pytest

from jaxdist import checkpoint
from jaxdist import compression as C
from jaxdist.errors import ConfigError
from tests.helpers import engine_for, tiny_gpt_config


def _config(data, compression, **fields):
    c = tiny_gpt_config(data=data)
    c.model.num_layers = 1
    c.grad_sync.compression = compression
    for k, v in fields.items():
        c.grad_sync[k] = v
    return c


def _owed(state):
    """Per parameter leaf: what the compressor's error feedback owes the mean gradient, [*shape]."""
    gs = state["grad_sync"]
    flat = checkpoint.flatten(gs)
    out = {}
    for path, x in flat.items():
        x = np.asarray(x, np.float64)
        if "worker/" in path or "residual/" in path:
            out[path] = out.get(path, 0) + x.mean(0)
    for path, x in flat.items():
        if "server/" in path:
            worker = path.replace("server/", "worker/", 1)
            n = out[worker].size // max(int(np.prod(x.shape[1:-1])), 1)
            whole = np.moveaxis(np.asarray(x, np.float64), 0, -2).reshape(*x.shape[1:-1], -1)
            out[worker] = out[worker] + whole[..., :n].reshape(out[worker].shape)
    return out


def _steps(eng, batches, state, first, n):
    losses = []
    for i in range(first, first + n):
        state, m = eng.train_step(state, batches.get(i))
        losses.append(float(m["loss"]))
    return state, losses


@pytest.mark.parametrize(
    "compression,fields",
    [
        ("onebit_adam", {"warmup_steps": 2}),
        ("twobit_adam", {"warmup_steps": 2}),
        ("topk_adam", {"warmup_steps": 2, "topk_ratio": 0.05}),
        ("topk", {"topk_ratio": 0.05}),
        ("none", {"local_steps": 2, "outer_optimizer": "nesterov"}),
    ],
    ids=["onebit_adam", "twobit_adam", "topk_adam", "topk", "diloco"],
)
def test_resume_on_8_then_4_then_8_replicas_keeps_what_is_owed(tmp_path, compression, fields):
    state, step, losses = None, 0, []
    for data in (8, 4, 8):
        eng, batches = engine_for(_config(data, compression, **fields))
        if state is None:
            state = eng.init()
        else:
            with checkpoint.Checkpointer(tmp_path, every=1, keep=3, config_json=None) as ckpt:
                restored, meta = ckpt.restore(eng.abstract_state)
            assert meta["step"] == step
            key = "grad_sync" if "grad_sync" in restored else "local"
            r = jax.tree.leaves(restored[key])[0].shape[0]
            assert r == data
            if key == "grad_sync":
                before, after = _owed(state), _owed(restored)
                assert before.keys() == after.keys() and before
                for path in before:
                    np.testing.assert_allclose(after[path], before[path], rtol=0, atol=1e-6)
                np.testing.assert_array_equal(
                    np.asarray(restored["grad_sync"].count), np.full(data, step)
                )
            else:  # local SGD: every replica restarts from the average of the saved ones
                for a, b in zip(
                    jax.tree.leaves(state["local"]["params"]),
                    jax.tree.leaves(restored["local"]["params"]),
                    strict=True,
                ):
                    np.testing.assert_allclose(
                        np.asarray(b), np.broadcast_to(np.asarray(a).mean(0), b.shape),
                        rtol=0, atol=1e-6,
                    )  # fmt: skip
            for a, b in zip(
                jax.tree.leaves(state["params"]), jax.tree.leaves(restored["params"]), strict=True
            ):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            state = restored
        state, more = _steps(eng, batches, state, step, 3)
        step += 3
        losses += more
        with checkpoint.Checkpointer(tmp_path, every=1, keep=3, config_json=None) as ckpt:
            ckpt.save(step, state, data_position=step)
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    if compression.endswith("_adam"):  # the resumed runs were compressing (past the warm-up)
        assert np.abs(np.asarray(jax.tree.leaves(state["grad_sync"].worker)[0])).max() > 0


def test_resize_replicas_rules():
    rng = np.random.default_rng(0)
    worker = rng.normal(size=(4, 2, 5)).astype(np.float32)  # [R, L, 5]: two stacked layers
    server = rng.normal(size=(4, 2, 8)).astype(np.float32)  # [R, L, s]: 4 * 8 >= 5
    count = np.full((4,), 7, np.int32)
    saved = {"g/worker/w": worker, "g/server/w": server, "g/count": count}
    shapes = {"g/worker/w": (2, 2, 5), "g/server/w": (2, 2, 8), "g/count": (2,)}
    new = C.resize_replicas(saved, shapes)
    whole = np.moveaxis(server, 0, -2).reshape(2, -1)[:, :5]
    np.testing.assert_allclose(new["g/worker/w"][1], worker.mean(0) + whole, atol=1e-6)
    assert not new["g/server/w"].any() and new["g/count"].tolist() == [7, 7]
    # top-k's two-phase server residual pairs with `residual`
    paired = C.resize_replicas(
        {"g/residual/w": worker, "g/server/w": server},
        {"g/residual/w": (2, 2, 5), "g/server/w": (2, 2, 3)},
    )
    np.testing.assert_allclose(paired["g/residual/w"][0], worker.mean(0) + whole, atol=1e-6)
    with pytest.raises(ConfigError, match="cannot be redistributed"):
        C.resize_replicas({"g/residual/w": worker}, {"g/residual/w": (2, 3, 5)})
