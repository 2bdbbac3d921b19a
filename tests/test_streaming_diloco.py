"""Streaming DiLoCo (jaxdist/streaming.py): fragments, overlapped outer steps, int8 outer gradients."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from jaxdist import checkpoint, streaming
from jaxdist import config as config_lib
from jaxdist.errors import ConfigError
from tests.helpers import compile_step, engine_for, n_devices, tiny_gpt_config

R, H = 4, 4  # replicas, inner steps per outer step


def _cfg(fragments=1, overlap=0, quantization="none", **mesh_sizes):
    c = tiny_gpt_config(data=R, **mesh_sizes)
    c.model.num_layers, c.model.d_model = 4, 64  # the layers dominate: fragments near 1/F
    c.train.optimizer, c.train.learning_rate, c.train.momentum = "sgd", 0.3, 0.9
    c.train.warmup_steps = 0  # every step moves the replicas apart
    c.grad_sync.local_steps, c.grad_sync.outer_optimizer = H, "nesterov"
    c.grad_sync.fragments, c.grad_sync.outer_overlap = fragments, overlap
    c.grad_sync.outer_quantization = quantization
    return c


def _run(c, steps, state=None, start=0):
    eng, batches = engine_for(c)
    state = eng.init() if state is None else state
    for i in range(start, start + steps):
        state, _ = eng.train_step(state, batches.get(i))
    return eng, jax.device_get(state)


def test_one_fragment_without_overlap_is_plain_diloco_bit_for_bit(monkeypatch):
    """F = 1, tau = 0, no quantization through the streaming code path (forced) equals
    `collectives.local_sgd`'s DiLoCo exactly, over two outer steps and one more inner step."""
    _, plain = _run(_cfg(), 2 * H + 1)
    monkeypatch.setattr(streaming, "active", lambda g: True)
    eng, streamed = _run(_cfg(), 2 * H + 1)
    assert eng.strategy == "local_sgd"
    for a, b in zip(jax.tree.leaves(streamed), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(a, b)
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), plain["params"],
                                         jax.device_get(eng.init()["params"])))  # fmt: skip
    assert min(moved) > 0  # two outer steps moved every tensor: the comparison is not vacuous


def _replicas_agree(local, frags, f):
    """Whether every replica holds the same values in fragment f's parts."""
    out = []
    for x, s in zip(jax.tree.leaves(local), frags.sel[f], strict=True):
        if s is None:
            continue
        x = np.asarray(x if s == streaming.ALL else x[:, list(s)])
        out.append(all(np.array_equal(x[0], x[j]) for j in range(1, R)))
    return all(out), any(out)


def test_fragments_sync_on_a_staggered_schedule():
    """F = 2, H = 4: fragment 1 (offset 2) is averaged after inner steps 2 and 6, fragment 0 after
    step 4; in between each replica's copy of a fragment drifts on its own."""
    c = _cfg(fragments=2)
    eng, _ = engine_for(c)
    frags = streaming.partition(eng.abstract_state["params"], eng.param_axes, c.grad_sync.fragments)
    state = None
    expect = {1: (False, False), 2: (False, True), 3: (False, False), 4: (True, False)}
    for done in range(1, 5):
        eng, state = _run(c, 1, state=state, start=done - 1)
        agree = [_replicas_agree(state["local"]["params"], frags, f)[0] for f in (0, 1)]
        assert tuple(agree) == expect[done], (done, agree)


def test_peak_bytes_per_step_are_the_largest_fragment():
    """The costliest single sync in the compiled program: plain DiLoCo all-reduces every parameter,
    F fragments only the largest fragment (ring-costed f32 all-reduce: 2(R-1)/R * 4 bytes per
    element), and int8 outer gradients a quarter of that plus one f32 scale per 256 values."""
    ring = 2 * (R - 1) / R
    eng, plain = compile_step(_cfg())
    total = eng.num_params
    assert streaming.peak_sync_bytes(plain.as_text()) == pytest.approx(ring * 4 * total, rel=1e-3)
    for f in (2, 4):
        eng, compiled = compile_step(_cfg(fragments=f))
        frags = streaming.partition(eng.abstract_state["params"], eng.param_axes, f)
        assert sum(frags.sizes) == total
        peak = streaming.peak_sync_bytes(compiled.as_text())
        assert peak == pytest.approx(ring * 4 * max(frags.sizes), rel=1e-3)
        assert peak <= 1.3 / f * ring * 4 * total  # within 30% of 1/F (units are whole layers)
    _, q = compile_step(_cfg(fragments=2, quantization="int8"))
    _, f32 = compile_step(_cfg(fragments=2))
    ratio = streaming.peak_sync_bytes(q.as_text()) / streaming.peak_sync_bytes(f32.as_text())
    assert 0.25 < ratio < 0.27, ratio  # (1 + 4/256) / 4 = 0.254, plus chunk padding
    _, q4 = compile_step(_cfg(fragments=2, quantization="int4"))
    ratio = streaming.peak_sync_bytes(q4.as_text()) / streaming.peak_sync_bytes(f32.as_text())
    assert 0.125 < ratio < 0.135, ratio  # (1/2 + 4/256) / 4 = 0.129, plus padding to R * 256


def test_int4_blocks_round_to_the_nearest_of_15_levels():
    x = np.random.RandomState(0).randn(8, 256).astype(np.float32)
    x[3] = 0.0  # an all-zero block stays zero
    y = np.asarray(streaming._int4_decode(streaming._int4_encode(x)))
    step = np.abs(x).max(axis=1, keepdims=True) / 7
    assert np.all(np.abs(y - x) <= step / 2 + 1e-7) and (y[3] == 0).all()
    assert len(np.unique(y[0])) > 8  # really 4-bit levels, not a coarser code


@pytest.mark.bitwise  # compares compiled programs to the bit (tests/conftest.py)
def test_overlapped_outer_step_lands_tau_steps_later_and_mixes():
    """tau = 1, F = 2: fragment 1 is sent after inner step 2 and its outer step lands after step 3,
    where every replica's copy becomes outer_mix * its own + (1 - outer_mix) * the new anchor."""
    c = _cfg(fragments=2, overlap=1)
    eng, s2 = _run(c, 2)
    frags = streaming.partition(eng.abstract_state["params"], eng.param_axes, 2)
    init = jax.device_get(eng.init()["params"])
    for x, y in zip(jax.tree.leaves(s2["params"]), jax.tree.leaves(init), strict=True):
        np.testing.assert_array_equal(x, y)  # sent, not applied: the anchor has not moved
    _, s3 = _run(c, 1, state=s2, start=2)
    # What the replicas held after inner step 3 without the arrival: the same run with tau = 3.
    _, held = _run(_cfg(fragments=2, overlap=3), 3)
    mix = c.grad_sync.outer_mix
    leaves = zip(
        jax.tree.leaves(s3["params"]),
        jax.tree.leaves(init),
        jax.tree.leaves(s3["local"]["params"]),
        jax.tree.leaves(held["local"]["params"]),
        frags.sel[1],
        strict=True,
    )
    moved = 0
    for anchor, start, local, own, s in leaves:
        if s is None:
            np.testing.assert_array_equal(anchor, start)
            np.testing.assert_array_equal(local, own)
            continue

        def pick(x, ax, s=s):
            return x if s == streaming.ALL else np.take(x, s, ax)

        moved += np.abs(pick(anchor, 0) - pick(start, 0)).max() > 1e-4
        want = mix * pick(own, 1) + (1 - mix) * pick(anchor, 0)[None]
        np.testing.assert_allclose(pick(local, 1), want, rtol=1e-6, atol=1e-7)
    assert moved  # the outer step landed


def test_streaming_state_is_checkpointed_and_resumes_bit_exact(tmp_path):
    """tau = 2 with int8 outer gradients: the in-flight outer gradients, the replicas and the
    outer momentum are all in the checkpoint; resuming after step 3 (fragment 1 in flight)
    continues bit-exactly."""
    c = _cfg(fragments=2, overlap=2, quantization="int8")
    _, straight = _run(c, 7)
    eng, half = _run(c, 3)
    assert np.abs(np.concatenate([np.ravel(x) for x in jax.tree.leaves(half["outer_pending"])])).max() > 0  # fmt: skip
    with checkpoint.Checkpointer(tmp_path / "ckpt", every=1, keep=1, config_json="{}") as ckpt:
        ckpt.save(3, jax.device_put(half, eng.state_shardings), data_position=3)
        ckpt.wait()
        restored, _ = ckpt.restore(eng.abstract_state)
    assert streaming.PENDING in restored
    _, resumed = _run(c, 4, state=restored, start=3)
    for x, y in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize(
    "fields,mesh_sizes,match",
    [
        ({"fragments": 5}, {}, "grad_sync.fragments=5 must be in"),
        ({"fragments": 2, "local_steps": 1}, {}, "need grad_sync.local_steps > 1"),
        ({"outer_overlap": 4}, {}, "grad_sync.outer_overlap=4 must be in"),
        ({"outer_quantization": "fp4"}, {}, "grad_sync.outer_quantization='fp4' is not valid"),
        ({"fragments": 2, "outer_mix": 1.5}, {}, "grad_sync.outer_mix"),
        ({"fragments": 2}, {"pipeline": 2}, "needs mesh.pipeline=1"),
    ],
)
def test_bad_streaming_config_is_one_line(fields, mesh_sizes, match):
    c = _cfg(**mesh_sizes)
    for k, v in fields.items():
        c.grad_sync[k] = v
    with pytest.raises(ConfigError, match=match) as e:
        config_lib.validate(c, n_devices(c))
    assert "\n" not in str(e.value)


@functools.cache
def _data_fsdp_tensor_run(quantization: str):
    """(initial, trained) parameters of H steps with two fragments on data=2 × fsdp=2 × tensor=2
    (the f32 run once for both quantizations)."""
    c = _cfg(fragments=2, quantization=quantization)
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 2, 2, 2
    eng, state = _run(c, H)
    return jax.device_get(eng.init()["params"]), state["params"]


@pytest.mark.parametrize("quantization,tol", [("int8", 0.02), ("int4", 0.3)])
def test_quantized_outer_steps_on_data_fsdp_tensor(quantization, tol):
    """data=2 × fsdp=2 × tensor=2: after both fragments' first syncs, the anchor's move with
    quantized outer gradients stays close to the f32 run's: every tensor within `tol` of its
    largest move. Loose on purpose: each replica's outer gradient is rounded on its own block
    maximum, which cancellation between replicas can make far larger than the mean's. Measured:
    0.007 (int8) and 0.14 (int4) of the largest move."""

    init, exact = _data_fsdp_tensor_run("none")
    _, got = _data_fsdp_tensor_run(quantization)
    worst = max(
        np.abs(g - e).max() / np.abs(e - i).max()
        for i, e, g in zip(*map(jax.tree.leaves, (init, exact, got)), strict=True)
    )
    assert 0 < worst <= tol, worst  # 0: quantization really changed the result
