"""1-bit Adam (`onebit_adam` + `frozen_variance_adam`), int8 with error feedback, PowerSGD's knobs.

Each is checked against a straightforward host (numpy) reimplementation of the algorithm that
simulates the R workers one by one, from the same per-replica gradients, at fixed tolerances; the
wire formats are read from the compiled HLO.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxdist import compression as C
from jaxdist import metrics
from jaxdist.collectives import sync_grads
from jaxdist.errors import ConfigError
from tests.test_compression import (
    BIG,
    F32,
    MESH,
    PARAMS,
    SHAPES,
    R,
    _grads,
    _identity_grad_fn,
    _none_wire_bytes,
    _np_rows,
    _np_sign_compress,
    _run,
    _wire_bytes,
)


def _np_onebit_compress(x, valid):
    """Signs and DeepSpeed's scale ||x||_2 / sqrt(d) per chunk (padding: no bits counted, 0)."""
    d = np.maximum(valid.sum(-1), 1).astype(F32)
    scale = np.sqrt(np.where(valid, x * x, F32(0)).sum(-1) / d).astype(F32)
    return np.where(valid, np.where(x >= 0, scale[..., None], -scale[..., None]), F32(0))


def _np_twobit_compress(x, valid):
    """The 4-level Lloyd-Max code of a unit Gaussian, in units of the chunk's RMS: |x| below
    0.9816 rms -> +-0.4528 rms, else +-1.5104 rms (padding: not counted, 0)."""
    d = np.maximum(valid.sum(-1), 1).astype(F32)
    scale = np.sqrt(np.where(valid, x * x, F32(0)).sum(-1) / d).astype(F32)[..., None]
    mag = np.where(np.abs(x) >= F32(0.9816) * scale, F32(1.5104) * scale, F32(0.4528) * scale)
    return np.where(valid, np.where(x >= 0, mag, -mag), F32(0))


NP_CODES = {1: _np_onebit_compress, 2: _np_twobit_compress}


def _np_l1_compress(x, valid):
    """ef_sign's code: signs and the scale ||x||_1 / d per chunk."""
    return _np_sign_compress(x, valid)[2]


def _np_compressed_allreduce(acc, worker, server, chunk, bits=1, rms=True):
    """DeepSpeed's compressed_allreduce on the host, worker by worker.

    acc, worker: [R, *shape] (each worker's tensor and residual); server: [R, shard].
    `rms=False`: ef_sign's L1 scale. Returns (the all-reduced tensor, new worker residuals, new
    server residuals).
    """
    code = NP_CODES[bits] if rms else _np_l1_compress
    n = acc[0].size
    shard, c = C.shard_layout(n, R, chunk, 8)
    buf = acc + worker
    rows = _np_rows(buf, shard, c)  # [src, dst, a, c]
    valid = (np.arange(R * shard) < n).reshape(R, shard // c, c)  # [dst, a, c]
    sent = np.stack([code(rows[i], valid) for i in range(R)])
    new_worker = buf - sent.reshape(R, -1)[:, :n].reshape(buf.shape)
    out, new_server = np.zeros(R * shard, F32), np.zeros_like(server)
    for j in range(R):  # server j averages what every worker sent for shard j
        comp = sent[:, j].mean(0) + server[j].reshape(shard // c, c)
        back = code(comp, valid[j])
        new_server[j] = (comp - back).reshape(-1)
        out[j * shard : (j + 1) * shard] = back.reshape(-1)
    return out[:n].reshape(acc.shape[1:]), new_worker, new_server


def _np_topk_allreduce(acc, worker, server, ratio):
    """topk_adam's exchange on the host: top-k's two-phase replay of acc + worker residual."""
    n = acc[0].size
    buf = (acc + worker).reshape(R, n)
    out, left, server = _np_topk_two_phase(buf, server, math.ceil(ratio * n))
    return out.reshape(acc.shape[1:]), left.reshape(acc.shape), server


def _np_onebit_adam(
    grads_per_step, freeze, b1, b2, eps, chunk, bits=1, topk_ratio=None, local_momentum=False,
    masking=True, rms=True,
):  # fmt: skip
    """1-bit Adam's direction per step for one tensor: Adam for `freeze` steps, then frozen v
    (momenta exchanged with `bits`-bit codes, or top-k at `topk_ratio`; `local_momentum`: each
    worker's own momentum (DGC: zeroed where it sent; signs: kept whole))."""
    g0 = grads_per_step[0]
    n = g0[0].size
    shard = C.shard_layout(n, R, chunk, 8)[0] if topk_ratio is None else -(-n // R)
    m, v = np.zeros(g0.shape[1:], F32), np.zeros(g0.shape[1:], F32)
    worker, server = np.zeros_like(g0), np.zeros((R, shard), F32)
    out = []
    for t, g in enumerate(grads_per_step, start=1):
        if t <= freeze:
            gbar = g.mean(0)
            m = b1 * m + (1 - b1) * gbar
            v = b2 * v + (1 - b2) * gbar * gbar
            u = np.broadcast_to(m, g.shape)  # DGC: every worker's momentum starts as Adam's m
        else:
            local = b1 * (u if local_momentum else m) + (1 - b1) * g  # [R, ...]: own momentum
            if topk_ratio is None:
                m, worker, server = _np_compressed_allreduce(
                    local, worker, server, chunk, bits, rms
                )
                u = local  # signs send every coordinate: nothing masked
            else:
                acc = local + worker
                m, worker, server = _np_topk_allreduce(local, worker, server, topk_ratio)
                u = np.where(worker == acc, local, 0) if masking else local  # 0 where sent
        m_hat = m / (1 - b1**t)
        v_hat = v / (1 - b2 ** min(t, freeze))
        out.append(m_hat / (np.sqrt(v_hat) + eps))
    return out


def _run_onebit(freeze, steps, b1=0.9, b2=0.95, chunk=16, **code):
    sync = C.onebit_adam("data", freeze, b1=b1, chunk=chunk, **code)
    opt = C.frozen_variance_adam(freeze, b1=b1, b2=b2)
    results = _run(sync, steps)
    opt_state = opt.init(PARAMS)
    outs = []
    for mean, _, _ in results:
        d, opt_state = opt.update(jax.tree.map(jnp.asarray, mean), opt_state)
        outs.append(jax.tree.map(np.asarray, d))
    return outs, results


# The momentum codes after the freeze: onebit_adam, twobit_adam, topk_adam (at a density where
# "w" takes the two-phase sparse path and "b" the dense reduce of the union).
CODES = {
    "onebit_adam": {"bits": 1},
    "twobit_adam": {"bits": 2},
    "topk_adam": {"topk_ratio": 0.2},
    "dgc_adam": {"topk_ratio": 0.2, "local_momentum": True},  # topk momentum_correction + AdamW
    "dgc_adam_unmasked": {"topk_ratio": 0.2, "local_momentum": True, "masking": False},
    # ef_sign momentum_correction + AdamW: own momenta, 1-bit with ef_sign's L1 scale
    "ef_sign_adam": {"local_momentum": True, "rms": False},
}


@pytest.mark.parametrize("code", list(CODES))
def test_onebit_adam_matches_host_reimplementation(code):
    freeze, b1, b2 = 2, 0.9, 0.95
    steps = [_grads(70 + i, common=1.0) for i in range(6)]
    outs, results = _run_onebit(freeze, steps, b1, b2, **CODES[code])
    for k in SHAPES:
        ref = _np_onebit_adam([s[k] for s in steps], freeze, b1, b2, 1e-8, 16, **CODES[code])
        for t, (out, r) in enumerate(zip(outs, ref, strict=True)):
            np.testing.assert_allclose(out[k], r, rtol=2e-5, atol=2e-5, err_msg=f"step {t + 1}")
    # Warm-up: no residuals yet; afterwards both error feedbacks hold something.
    assert not results[freeze - 1][2].worker["w"].any()
    assert results[-1][2].worker["w"].any() and results[-1][2].server["w"].any()


@pytest.mark.parametrize("code", [c for c in CODES if c != "dgc_adam_unmasked"])  # same warm-up
def test_onebit_adam_warmup_is_adamw_exactly(code):
    """The first `freeze` steps are optax's Adam on the exact mean gradient."""
    freeze = 4
    steps = [_grads(80 + i) for i in range(freeze)]
    outs, _ = _run_onebit(freeze, steps, **CODES[code])
    adam = optax.scale_by_adam(b1=0.9, b2=0.95, eps=1e-8)
    state = adam.init(PARAMS)
    for g, out in zip(steps, outs, strict=True):
        ref, state = adam.update({k: jnp.asarray(v.mean(0)) for k, v in g.items()}, state)
        for k in SHAPES:
            np.testing.assert_allclose(out[k], np.asarray(ref[k]), rtol=1e-5, atol=1e-6)


def _compiled_sync(tx) -> str:
    """HLO text of `sync_grads` with `tx` on BIG's shapes, R replicas (compiled, not run)."""
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in BIG.items()}
    stacked = {k: jax.ShapeDtypeStruct((R, *s), jnp.float32) for k, s in BIG.items()}
    state = jax.eval_shape(lambda p: C.init_global(tx, p, MESH, "data"), params)
    step = jax.jit(sync_grads(_identity_grad_fn, tx, MESH, "data"))
    return step.lower(params, stacked, state).compile().as_text()


@pytest.mark.parametrize("bits,min_ratio", [(1, 30), (2, 15)], ids=["onebit_adam", "twobit_adam"])
def test_onebit_adam_wire_is_one_bit_after_the_freeze(bits, min_ratio):
    """Steady state (freeze_step=0, bytes only): packed uint8 bits and f32 scales, no f32 sum."""
    tx = C.onebit_adam("data", 0, bits=bits)
    hlo = _compiled_sync(tx)
    # (The one all-reduce left is the loss's pmean: 4 bytes.)
    kinds = {op.kind for op in metrics.collective_ops(hlo) if op.bytes_per_exec > 64}
    assert kinds == {"all-to-all", "all-gather"}, kinds
    # The packed bits and their scales travel as bytes, one buffer per phase (tensors.two_phase).
    big = [op.name for op in metrics.collective_ops(hlo) if op.bytes_per_exec > 64]
    lines = [ln for ln in hlo.splitlines() if ln.strip().split(" = ")[0].lstrip("%") in big]
    assert len(lines) == len(big) == 2, big
    for ln in lines:
        result = ln.split(" = ", 1)[1].split(" all-")[0]
        assert "u8[" in result and "f32" not in result, ln
    ratio = _none_wire_bytes() / _wire_bytes(tx, BIG)
    assert min_ratio <= ratio < 2 * min_ratio, ratio


def test_onebit_adam_config_rules():
    import ml_collections

    from jaxdist import config as config_lib

    def cfg(**fields):
        c = config_lib.base_config()
        c.mesh.data, c.runtime.cpu_devices = R, R
        c.model.name = "mlp"
        for k, v in fields.items():
            section, name = k.split("__")
            c[section][name] = v
        return c

    for fields, match in [
        ({"grad_sync__compression": "onebit_adam"}, "warmup_steps >= 1"),
        ({"grad_sync__compression": "twobit_adam"}, "warmup_steps >= 1"),
        ({"grad_sync__compression": "topk_adam"}, "warmup_steps >= 1"),
        (
            {
                "grad_sync__compression": "topk_adam",
                "grad_sync__warmup_steps": 5,
                "grad_sync__topk_ratio": 0.0,
            },
            "grad_sync.topk_ratio",
        ),
        (
            {
                "grad_sync__compression": "twobit_adam",
                "grad_sync__warmup_steps": 5,
                "train__optimizer": "sgd",
            },
            "train.optimizer='adamw'",
        ),
        (
            {
                "grad_sync__compression": "onebit_adam",
                "grad_sync__warmup_steps": 5,
                "train__optimizer": "sgd",
            },
            "train.optimizer='adamw'",
        ),
        (
            {"grad_sync__compression": "powersgd", "grad_sync__min_compression": 0.5},
            "grad_sync.min_compression",
        ),
        (
            {"grad_sync__compression": "powersgd", "grad_sync__orthogonalization_epsilon": -1.0},
            "grad_sync.orthogonalization_epsilon",
        ),
        (
            {"grad_sync__compression": "topk", "grad_sync__momentum_masking": False},
            "grad_sync.momentum_masking=False applies to",
        ),
        (
            {
                "grad_sync__compression": "ef_sign",
                "grad_sync__momentum_correction": True,
                "grad_sync__freeze_variance": True,
                "grad_sync__warmup_steps": 5,
                "train__optimizer": "sgd",
            },
            "train.optimizer='adamw'",
        ),
    ]:
        with pytest.raises(ConfigError, match=re.escape(match)) as e:
            config_lib.validate(cfg(**fields), R)
        assert "\n" not in str(e.value)
    assert isinstance(ml_collections.ConfigDict, type)
    # DGC under AdamW: topk's momentum correction with the variance frozen is accepted and is
    # 1-bit Adam's scheme with each replica's own momentum (dgc_adam in CODES); ef_sign's is too.
    for name in ("topk", "ef_sign"):
        dgc = {"compression": name, "momentum_correction": True, "freeze_variance": True}
        c = cfg(**{f"grad_sync__{k}": v for k, v in dgc.items()}, grad_sync__warmup_steps=5)
        config_lib.validate(c, R)
        tx = C.from_config(c.grad_sync, "data")
        state = jax.eval_shape(lambda p, tx=tx: C.init_global(tx, p, MESH, "data"), PARAMS)
        assert isinstance(state, C.OneBitAdamState)
    # ... and its optimizer half takes the synchronized momentum as m after the freeze (step 2)
    c.grad_sync.warmup_steps = 1
    pre = C.preconditioner(c.grad_sync)
    opt_state = pre.init(PARAMS)
    sent = [{k: jnp.full(v.shape, x, jnp.float32) for k, v in PARAMS.items()} for x in (1.0, 3.0)]
    for u in sent:
        _, opt_state = pre.update(u, opt_state)
    np.testing.assert_array_equal(opt_state.mu["w"], sent[1]["w"])


# --------------------------------------------------------------------------------------------------
# int8 with error feedback; PowerSGD knobs


def test_int8_error_feedback_conserves_the_gradient():
    steps = [_grads(90 + i) for i in range(3)]
    tx = C.int8("data", chunk=8, error_feedback=True)
    for g, (out, old, new) in zip(steps, _run(tx, steps), strict=True):
        for k, s in SHAPES.items():
            n = int(np.prod(s))
            before = old.worker[k].mean(0) + old.server[k].reshape(-1)[:n].reshape(s)
            after = new.worker[k].mean(0) + new.server[k].reshape(-1)[:n].reshape(s)
            np.testing.assert_allclose(out[k] + after, g[k].mean(0) + before, rtol=0, atol=1e-5)
    assert np.abs(new.worker["w"]).max() > 0


def test_int8_stochastic_rounding_from_config_is_unbiased():
    cfg = {"compression": "int8", "stochastic_rounding": True, "error_feedback": False}
    tx = C.from_config(cfg, "data")
    g = _grads(95)
    means = np.stack([r[0]["w"] for r in _run(tx, [g] * 200)])
    # Each run rounds differently; their average approaches the exact mean (unbiased rounding).
    assert np.unique(means[:, 0, 0]).size > 1
    np.testing.assert_allclose(means.mean(0), g["w"].mean(0), rtol=0, atol=2e-3)


def test_powersgd_gram_schmidt_epsilon_and_cold_start():
    g = _grads(96, common=2.0)
    qr = _run(C.powersgd("data", rank=2), [g])[0][0]["w"]
    gs = _run(C.powersgd("data", rank=2, orthogonalization_epsilon=1e-8), [g])[0][0]["w"]
    np.testing.assert_allclose(gs, qr, rtol=0, atol=1e-4)  # the same subspace
    # Warm start is a power iteration across steps: on a repeated gradient it converges to the
    # best rank-1 approximation (SVD); a cold start redraws Q every step and does not.
    steps = [g] * 8
    cold = _run(C.powersgd("data", rank=1, warm_start=False, error_feedback=False), steps)
    warm = _run(C.powersgd("data", rank=1, error_feedback=False), steps)
    exact = g["w"].mean(0)
    best = np.linalg.svd(exact, compute_uv=False)[1:]  # the rank-1 error's singular values
    best = float(np.sqrt(np.sum(best**2)))
    err = lambda r: float(np.linalg.norm(r[-1][0]["w"] - exact))  # noqa: E731
    assert err(warm) <= best * 1.01, (err(warm), best)
    assert err(cold) > best * 1.05, (err(cold), best)
    assert not np.allclose(cold[0][0]["w"], cold[1][0]["w"], atol=1e-5)


def test_powersgd_min_compression_sends_small_matrices_dense():
    tx = C.powersgd("data", rank=2, min_compression=10.0)  # [13, 7]: 91 < 10 * 2 * 20
    g = _grads(97)
    [(out, _, new)] = _run(tx, [g])
    assert new.q["w"] is None
    np.testing.assert_allclose(out["w"], g["w"].mean(0), rtol=0, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# top-k: DGC's velocity through the dense warm-up, the dense reduce of the union at large R k


def test_topk_dense_warmup_keeps_the_dgc_velocity():
    """At density 1 nothing is masked: the warm-up is momentum SGD (u <- m u + g, all sent)."""
    m = 0.9
    steps = [_grads(100 + i) for i in range(3)]
    tx = C.topk("data", 0.1, momentum_correction=True, momentum=m, warmup_steps=30)
    u = {k: np.zeros((R, *s), F32) for k, s in SHAPES.items()}
    for g, (out, _, new) in zip(steps, _run(tx, steps), strict=True):
        for k in SHAPES:
            u[k] = F32(m) * u[k] + g[k]
            np.testing.assert_allclose(out[k], u[k].mean(0), rtol=0, atol=1e-5)
            np.testing.assert_allclose(new.velocity[k], u[k], rtol=0, atol=1e-5)
            assert not new.residual[k].any()


def test_topk_switches_to_a_dense_reduce_where_pairs_outweigh_the_tensor():
    """R k >= size: one f32 all-reduce of the sparse union (never more bytes than `none`)."""
    shapes = {"w": (64, 64)}
    params = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32)}
    stacked = {"w": jax.ShapeDtypeStruct((R, 64, 64), jnp.float32)}

    def kinds(ratio):
        tx = C.topk("data", ratio)
        state = jax.eval_shape(lambda p: C.init_global(tx, p, MESH, "data"), params)
        hlo = jax.jit(sync_grads(_identity_grad_fn, tx, MESH, "data"))
        text = hlo.lower(params, stacked, state).compile().as_text()
        return {op.kind for op in metrics.collective_ops(text) if op.bytes_per_exec > 64}

    assert kinds(0.01) == {"all-gather"}  # 8 * 41 pairs < 4096 elements
    assert kinds(0.2) == {"all-reduce"}  # 8 * 820 >= 4096
    none = _wire_bytes(C.none("data"), shapes)
    assert _wire_bytes(C.topk("data", 0.2), shapes) <= none * 1.01
    g = _grads(110, shapes=shapes)
    [(out, _, new)] = _run(C.topk("data", 0.2), [g], params={"w": jnp.zeros((64, 64))})
    acc = g["w"].reshape(R, -1)
    k = math.ceil(0.2 * acc.shape[1])
    idx = np.argsort(-np.abs(acc), axis=1, kind="stable")[:, :k]
    sent = np.zeros_like(acc)
    np.put_along_axis(sent, idx, np.take_along_axis(acc, idx, 1), 1)
    np.testing.assert_allclose(out["w"].reshape(-1), sent.mean(0), rtol=0, atol=1e-6)


def test_frozen_variance_adam_on_gradients_is_adam_then_a_fixed_linear_filter():
    freeze, b1, b2, eps = 2, 0.9, 0.95, 1e-8
    opt = C.frozen_variance_adam(freeze, b1, b2, eps, takes="gradient")
    state = opt.init(PARAMS)
    rng = np.random.default_rng(0)
    m = {k: np.zeros(s) for k, s in SHAPES.items()}
    v = {k: np.zeros(s) for k, s in SHAPES.items()}
    for t in range(1, 6):
        g = {k: rng.normal(size=s).astype(F32) for k, s in SHAPES.items()}
        out, state = opt.update(jax.tree.map(jnp.asarray, g), state)
        for k in SHAPES:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            if t <= freeze:
                v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            ref = (m[k] / (1 - b1**t)) / (np.sqrt(v[k] / (1 - b2 ** min(t, freeze))) + eps)
            np.testing.assert_allclose(np.asarray(out[k]), ref, rtol=2e-5, atol=1e-6)


def test_compression_statistics_in_the_metrics_and_layout():
    from jaxdist import loop
    from tests.helpers import engine_for, tiny_gpt_config

    c = tiny_gpt_config(data=8)
    c.model.num_layers = 1
    c.grad_sync.compression = "topk"
    eng, batches = engine_for(c)
    state = eng.init()
    norms = []
    for i in range(2):
        state, m = eng.train_step(state, batches.get(i))
        norms.append(float(m["grad_sync_residual_norm"]))
    residual = np.concatenate(
        [np.asarray(x).reshape(8, -1) for x in jax.tree.leaves(state["grad_sync"].residual)], axis=1
    )
    np.testing.assert_allclose(norms[-1], np.sqrt((residual**2).sum() / 8), rtol=1e-4)
    compiled = eng.train_step.lower(eng.abstract_state, batches.get(0)).compile()
    rec = loop.layout_record(eng, compiled, c)["grad_sync"]
    dense = 2 * 7 / 8 * 4 * eng.num_params
    np.testing.assert_allclose(rec["f32_all_reduce_bytes_per_step"], dense, rtol=1e-6)
    sent = sum(loop.layout_record(eng, compiled, c)["collective_bytes_per_step"].values())
    assert rec["bytes_saved_per_step"] == pytest.approx(dense - sent)
    assert rec["bytes_saved_per_step"] > 0.8 * dense


def _np_topk_two_phase(acc, server, k):
    """Host replay of top-k's two-phase exchange: acc [R, n], server [R, s]. Where its pairs
    would outweigh the tensor (2 R kr >= n) it is the dense reduce of each replica's top-k."""
    n = acc.shape[1]
    shard = -(-n // R)
    kr = min(shard, max(1, -(-k // R)))
    if 2 * R * kr >= n:
        sent = np.zeros_like(acc)
        for i in range(R):
            top = np.argsort(-np.abs(acc[i]), kind="stable")[:k]
            sent[i, top] = acc[i, top]
        return sent.sum(0) / F32(R), acc - sent, server
    rows = np.zeros((R, R * shard), F32)
    rows[:, :n] = acc
    rows = rows.reshape(R, R, shard)  # [src, dst, s]
    sent = np.zeros_like(rows)
    for i in range(R):
        for j in range(R):
            top = np.argsort(-np.abs(rows[i, j]), kind="stable")[:kr]
            sent[i, j, top] = rows[i, j, top]
    left = (rows - sent).reshape(R, -1)[:, :n]
    out, new_server = np.zeros((R, shard), F32), np.zeros_like(server)
    for j in range(R):
        mine = sent[:, j].sum(0) / F32(R) + server[j]
        top = np.argsort(-np.abs(mine), kind="stable")[:kr]
        out[j, top] = mine[top]
        new_server[j] = mine
        new_server[j, top] = 0
    return out.reshape(-1)[:n], left, new_server


def test_topk_two_phase_matches_host_replay_and_bytes_do_not_grow_with_r():
    steps = [_grads(120 + i, common=1.0) for i in range(3)]
    ratio = 0.2
    results = _run(C.topk("data", ratio, two_phase=True), steps)
    for key, shape in SHAPES.items():
        n = int(np.prod(shape))
        k = math.ceil(ratio * n)
        res, srv = np.zeros((R, n), F32), np.zeros((R, -(-n // R)), F32)
        for g, (out, _, new) in zip(steps, results, strict=True):
            ref, left, srv = _np_topk_two_phase(g[key].reshape(R, n) + res, srv, k)
            res = left
            np.testing.assert_allclose(out[key].reshape(-1), ref, rtol=0, atol=1e-5)
            np.testing.assert_allclose(new.residual[key].reshape(R, -1), res, rtol=0, atol=1e-5)
            np.testing.assert_allclose(new.server[key].reshape(R, -1), srv, rtol=0, atol=1e-5)
    # ~8 k bytes per phase against ~8 size for f32: ~1 / (2 ratio), whatever R is.
    ratio_bytes = _none_wire_bytes() / _wire_bytes(C.topk("data", 0.01, two_phase=True), BIG)
    assert ratio_bytes >= 40, ratio_bytes


def test_topk_wire_ratio_model_matches_the_hlo_and_holds_at_many_replicas():
    n = BIG["w"][0] * BIG["w"][1]
    for two_phase in (False, True):
        tx = C.topk("data", 0.01, two_phase=two_phase)
        measured = _wire_bytes(C.none("data"), {"w": BIG["w"]}) / _wire_bytes(tx, {"w": BIG["w"]})
        model = C.topk_wire_ratio(n, R, 0.01, two_phase)
        assert abs(measured / model - 1) < 0.02, (two_phase, measured, model)
    # docs/COMPRESSION.md "Top-k at many replicas": all_gather 12.5x at R=8, gone by R=128;
    # two_phase ~50x at every R.
    assert [round(C.topk_wire_ratio(n, r, 0.01), 2) for r in (8, 64, 256, 1024)] == [
        12.5,
        1.56,
        1.0,
        1.0,
    ]
    got = [round(C.topk_wire_ratio(n, r, 0.01, True), 1) for r in (8, 64, 256, 1024)]
    assert got == [50.0, 50.0, 50.0, 46.5], got  # ceil(k / R) rounds up at R = 1024


@pytest.mark.parametrize(
    "exchange, cuts",
    [("all_gather", [12.48, 1.56, 1.0, 1.0]), ("two_phase", [49.42, 43.24, 38.59, 21.75])],
)
def test_planner_prices_topk_as_the_compiled_step_and_by_replica_count(exchange, cuts):
    """The default GPT with top-k 1%: plan.predict's bytes at R = 8 are the compiled step's (HLO),
    and its cuts at R = 8, 64, 256, 1024 are the ones docs/COMPRESSION.md shows ("Top-k at many
    replicas"): the all-gather's saving is gone by R = 256, the two-phase exchange's stays
    (ceil(k / R) >= 1 entry per row: its bytes grow once R passes a tensor's k)."""
    from configs import default
    from jaxdist import loop, plan
    from tests.helpers import engine_for

    c = default.get_config()
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = R, 1, 1
    c.grad_sync.compression, c.grad_sync.topk_exchange = "topk", exchange
    eng, batches = engine_for(c)
    compiled = eng.train_step.lower(eng.abstract_state, batches.get(0)).compile()
    hlo = sum(loop.layout_record(eng, compiled, c)["collective_bytes_per_step"].values())
    predicted = sum(plan.predict(c, hw="cpu_here", num_devices=R).collective_bytes.values())
    assert abs(predicted / hlo - 1) < 0.005, (predicted, hlo)

    def cut(replicas):
        c.train.batch_size = max(replicas, 32)
        layout = plan.Layout(data=replicas)
        none = c.copy_and_resolve_references()
        none.grad_sync.compression = "none"
        dense = sum(plan.predict(none, layout, "cpu_here").collective_bytes.values())
        return dense / sum(plan.predict(c, layout, "cpu_here").collective_bytes.values())

    assert [round(cut(r), 2) for r in (8, 64, 256, 1024)] == cuts


def test_two_phase_topk_sends_the_dense_union_where_its_pairs_would_cost_more():
    """A 12-element tensor at R = 8: 2 R ceil(k / R) = 16 pairs >= 12 elements, so the two-phase
    exchange all-reduces the union instead (the bytes of `none`), as topk_wire_ratio prices it;
    the mean is that of each replica's top-k."""
    shapes = {"b": (12,)}
    tx = C.topk("data", 0.05, two_phase=True, error_feedback=False)
    assert C.topk_wire_ratio(12, R, 0.05, two_phase=True) == 1.0
    assert _wire_bytes(tx, shapes) == _wire_bytes(C.none("data"), shapes)
    g = np.random.default_rng(0).normal(size=(R, 12)).astype(F32)
    params = {"b": jnp.zeros((12,), jnp.float32)}
    out = _run(tx, [{"b": jnp.asarray(g)}], params=params)[0][0]
    top = np.zeros_like(g)
    for i in range(R):  # k = ceil(0.05 * 12) = 1: each replica's largest |g|
        j = np.argmax(np.abs(g[i]))
        top[i, j] = g[i, j]
    np.testing.assert_allclose(np.asarray(out["b"]), top.mean(0), rtol=1e-6, atol=1e-7)


def test_topk_adam_wire_is_two_phase_topk_after_the_freeze():
    """topk_adam's steady state sends what two-phase top-k sends: the same bytes, no f32 sum."""
    tx = C.onebit_adam("data", 0, topk_ratio=0.01)
    hlo = _compiled_sync(tx)
    kinds = {op.kind for op in metrics.collective_ops(hlo) if op.bytes_per_exec > 64}
    assert kinds == {"all-to-all", "all-gather"}, kinds
    sent = _wire_bytes(tx, BIG)
    assert sent == _wire_bytes(C.topk("data", 0.01, two_phase=True), BIG)
    assert _none_wire_bytes() / sent >= 40


def test_ef_sign_under_adamw_from_config_is_local_momentum_with_the_l1_scale():
    """`ef_sign momentum_correction freeze_variance` builds `ef_sign_adam` of CODES (replayed in
    test_onebit_adam_matches_host_reimplementation): the same means, step by step."""
    cfg = {"compression": "ef_sign", "momentum_correction": True, "freeze_variance": True}
    steps = [_grads(95 + i, common=1.0) for i in range(3)]
    got = _run(C.from_config({**cfg, "warmup_steps": 1}, "data", betas=(0.9, 0.95)), steps)
    want = _run(C.onebit_adam("data", 1, b1=0.9, local_momentum=True, rms=False), steps)
    for (a, _, _), (b, _, _) in zip(got, want, strict=True):
        for k in SHAPES:
            np.testing.assert_array_equal(a[k], b[k])
    assert not np.allclose(got[-1][0]["w"], got[-2][0]["w"])  # the compressed steps moved


def test_sgd_nesterov_from_config_and_refused_with_momentum_correction():
    """`train.nesterov` (the momentum-SGD baseline's tuning): v <- mu v + g, step -lr (g + mu v)."""
    from jaxdist import config as config_lib
    from jaxdist import optim

    c = config_lib.base_config()
    with c.unlocked():
        c.train.update(optimizer="sgd", nesterov=True, schedule="constant", warmup_steps=0)
        c.train.update(weight_decay=0.0, grad_clip=0.0, learning_rate=0.1, momentum=0.9)
    tx, _ = optim.build(c.train, {"w": ("embed", "mlp")})
    grads = [np.random.default_rng(i).normal(size=(3, 2)).astype(F32) for i in range(3)]
    params = {"w": jnp.zeros((3, 2))}
    state, v = tx.init(params), np.zeros((3, 2), F32)
    for g in grads:
        out, state = tx.update({"w": jnp.asarray(g)}, state, params)
        v = 0.9 * v + g
        np.testing.assert_allclose(out["w"], -0.1 * (g + 0.9 * v), rtol=1e-6, atol=1e-7)
    c.mesh.data, c.runtime.cpu_devices, c.model.name = R, R, "mlp"
    c.grad_sync.update(compression="ef_sign", momentum_correction=True)
    with pytest.raises(ConfigError, match=re.escape("train.nesterov=False")):
        config_lib.validate(c, R)
