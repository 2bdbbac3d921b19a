"""Tests for jaxdist.compression and jaxdist.collectives on the 8 simulated CPU devices.

Each compressor is checked against a numpy replay of its algorithm on the host from the same
per-replica gradients, against error bounds derived from its number format, for the error-feedback
bookkeeping, for bytes on the wire read from the compiled HLO, and for convergence on a small
least-squares problem.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist import compression as C
from jaxdist import metrics
from jaxdist.collectives import diloco_outer, local_sgd, sync_grads
from jaxdist.errors import ConfigError

R = len(jax.devices())
F32 = np.float32
MESH = jax.make_mesh((R,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
# Shapes chosen so that nothing divides evenly: padding and short last chunks are exercised.
SHAPES = {"w": (13, 7), "b": (5,)}
PARAMS = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}


def _grads(seed, common=0.0, shapes=None):
    """Per-replica gradients {name: [R, *shape]}; `common` scales a part shared by all replicas."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, s in (shapes or SHAPES).items():
        shared = rng.normal(size=s).astype(F32)
        out[k] = (common * shared + rng.normal(size=(R, *s))).astype(F32)
    return out


def _identity_grad_fn(params, batch):
    """Each replica's 'gradient' is its [1, ...] slice of the stacked per-replica gradients."""
    del params
    return jnp.zeros((), jnp.float32), jax.tree.map(lambda x: x[0], batch)


def _run(tx, grads_per_step, params=PARAMS, mesh=MESH, axes="data"):
    """Syncs each step's stacked gradients: [(mean grads, state before, state after)] in numpy."""
    step = jax.jit(sync_grads(_identity_grad_fn, tx, mesh, axes))
    state = C.init_global(tx, params, mesh, axes)
    out = []
    for g in grads_per_step:
        _, mean, new = step(params, g, state)
        out.append((jax.tree.map(np.asarray, mean), jax.tree.map(np.asarray, state), new))
        state = new
    return [(m, s, jax.tree.map(np.asarray, n)) for m, s, n in out]


# --------------------------------------------------------------------------------------------------
# none, fp16, bf16


def _linear_loss(params, batch):
    x, y = batch
    return jnp.mean(jnp.sum((x @ params["w"] + params["b"] - y) ** 2, axis=-1))


def test_none_equals_implicit_jit_reduction():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4 * R, 13)).astype(F32)
    y = rng.normal(size=(4 * R, 7)).astype(F32)
    params = {"w": jnp.asarray(rng.normal(size=(13, 7)), jnp.float32), "b": jnp.ones((7,))}
    batch = jax.device_put((x, y), NamedSharding(MESH, P("data")))
    ref_loss, ref = jax.jit(jax.value_and_grad(_linear_loss))(params, batch)  # compiler's reduction

    tx = C.none("data")
    fn = jax.jit(sync_grads(jax.value_and_grad(_linear_loss), tx, MESH, "data"))
    loss, grads, _ = fn(params, batch, C.init_global(tx, params, MESH, "data"))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for k in ref:
        np.testing.assert_allclose(grads[k], ref[k], rtol=0, atol=1e-6 * np.abs(ref[k]).max())


@pytest.mark.parametrize(
    "per_replica,shape", [("vmap", (2, 2, 2)), ("shard_map", (4, 1, 2))], ids=["vmap", "shard_map"]
)
def test_sharded_sync_equals_implicit_reduction(per_replica, shape):
    """Per-replica gradients (a vmap over replicas, or a shard_map manual over `data`), then `none`
    on each device's shard in a shard_map manual over every axis, reassembled: the compiler's own
    reduction within float rounding. (The shard_map form runs on data x tensor: with two more
    axes automatic XLA's SPMD partitioner aborts in jax 0.10.2.)"""
    mesh = jax.make_mesh(
        shape, ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3
    )
    shard_axes = tuple(a for a, n in zip(("fsdp", "tensor"), shape[1:]) if n > 1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4 * R, 16)).astype(F32)
    y = rng.normal(size=(4 * R, 8)).astype(F32)
    params = {"w": rng.normal(size=(16, 8)).astype(F32), "b": np.ones((8,), F32)}
    param_specs = {"w": P("fsdp", "tensor"), "b": P("tensor")}
    params = jax.device_put(params, jax.tree.map(lambda sp: NamedSharding(mesh, sp), param_specs))
    batch = jax.device_put((x, y), NamedSharding(mesh, P(("data", "fsdp"))))
    ref_loss, ref = jax.jit(jax.value_and_grad(_linear_loss))(params, batch)

    tx = C.none("data")
    init, specs = C.sharded_state(tx, params, param_specs, mesh, "data", shard_axes)
    step = sync_grads(
        jax.value_and_grad(_linear_loss), tx, mesh, "data", shard_axes=shard_axes,
        param_specs=param_specs, state_specs=specs, per_replica=per_replica,
    )  # fmt: skip
    loss, grads, _ = jax.jit(step)(params, batch, jax.jit(init)(params))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for k in ref:
        np.testing.assert_allclose(grads[k], ref[k], rtol=0, atol=1e-6 * np.abs(ref[k]).max())


def test_bf16_error_is_two_roundings():
    g = _grads(1, common=1.0)
    [(out, _, _)] = _run(C.bf16("data"), [g])
    u = 2.0**-8  # bf16 unit roundoff (8 significant bits, round to nearest)
    for k in g:
        exact = g[k].astype(np.float64).mean(0)
        # Each input cast errs by <= u |g_i|, the f32 sum adds ~R 2^-24, the final cast <= u |out|.
        bound = u * np.abs(g[k]).mean(0) + u * np.abs(out[k]) + R * 2.0**-24 * np.abs(g[k]).sum(0)
        assert np.all(np.abs(out[k] - exact) <= bound), k
        rel = np.linalg.norm(out[k] - exact) / np.linalg.norm(exact)
        assert rel <= u, (k, rel)


def test_bf16_with_the_load_balancing_loss_is_the_batchs_gradient_rounded():
    """Mixtral's load-balancing loss (weight 0.01) under `compressed` bf16 on data=8: each
    replica's loss averages the expert load over `data` (`sharding.per_replica_loss`), so the first
    loss equals the plain strategy's (rtol 1e-6) and the first reduced gradient is plain's to bf16's
    two roundings (`test_bf16_error_is_two_roundings`' relative bound u per tensor; measured
    <= 2.1e-3). Per replica, before, the router's was 0.10 away."""
    from tests.test_allreduce import first_step, mixtral_with_load_balancing

    want_loss, want = first_step(mixtral_with_load_balancing())
    loss, got = first_step(mixtral_with_load_balancing(compression="bf16"))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    u = 2.0**-8
    for (path, g), r in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
    ):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        rel = np.linalg.norm(g - r) / np.linalg.norm(r)
        assert rel <= u, (jax.tree_util.keystr(path), rel)


def _np_ddp_fp16(g):
    """DDP's fp16_compress_hook replayed in numpy: cast to float16, divide by R in float16, sum
    the replicas in float16 one addition at a time in replica order, cast back."""
    with np.errstate(over="ignore"):
        halves = g.astype(np.float16) / np.float16(R)
    total = halves[0]
    for h in halves[1:]:
        total = total + h  # float16 + float16: rounded to float16
    return total.astype(F32)


def test_fp16_is_ddps_fp16_hook_bit_for_bit_and_one_float16_all_reduce():
    """On the 8 devices of one process the all-reduce adds in replica order: the mean is the
    numpy replay's to the bit. The compiled sync is one float16 all-reduce of every tensor (13*7
    + 5 values, 2 bytes each), nothing widened to float32."""
    g = _grads(3, common=1.0)
    g["w"][:, 0, 0] = 70000.0  # over float16's 65504: inf once cast, as in DDP's hook
    [(out, _, _)] = _run(C.fp16("data"), [g])
    for k in g:
        np.testing.assert_array_equal(out[k], _np_ddp_fp16(g[k]), err_msg=k)
    assert np.isinf(out["w"][0, 0])
    exact = g["b"].astype(np.float64).mean(0)
    assert np.linalg.norm(out["b"] - exact) / np.linalg.norm(exact) <= R * 2.0**-11
    step = jax.jit(sync_grads(_identity_grad_fn, C.fp16("data"), MESH, "data"))
    state = C.init_global(C.fp16("data"), PARAMS, MESH, "data")
    hlo = step.lower(PARAMS, _grads(4), state).compile().as_text()
    reduces = [ln for ln in hlo.splitlines() if " all-reduce(" in ln and "f16[" in ln]
    assert len(reduces) == 1 and "f16[96]" in reduces[0], reduces


def test_bf16_single_cast_round_trip():
    x = np.random.default_rng(2).normal(size=1000).astype(F32)
    back = np.asarray(C.from_bf16_bits(C.bf16_bits(jnp.asarray(x))))
    assert np.all(np.abs(back - x) <= 2.0**-8 * np.abs(x))


# --------------------------------------------------------------------------------------------------
# int8


def _np_quantize(x):
    scale = (np.max(np.abs(x), axis=-1) / F32(127)).astype(F32)
    y = x / np.where(scale > 0, scale, F32(1))[..., None]
    return np.clip(np.round(y), -127, 127).astype(np.int8), scale


def _np_dequantize(q, scale):
    return q.astype(F32) * scale[..., None]


def _np_rows(g, shard, c):
    """[R, *shape] -> [R (source), R (destination), shard / c, c], zero-padded."""
    n = g[0].size
    x = np.zeros((R, R * shard), F32)
    x[:, :n] = g.reshape(R, n)
    return x.reshape(R, R, shard // c, c)


def _np_int8(g, chunk):
    """Host replay of the two-phase int8 reduction; also returns the per-element error bound."""
    n = g[0].size
    shard, c = C.shard_layout(n, R, chunk)
    q, scale = _np_quantize(_np_rows(g, shard, c))
    mean = np.sum(_np_dequantize(q, scale), axis=0) / F32(R)  # [dst, a, c]: replica dst's shard
    q2, scale2 = _np_quantize(mean)
    out = _np_dequantize(q2, scale2).reshape(-1)[:n].reshape(g.shape[1:])
    # Round to nearest errs by <= scale / 2 per element, in each phase.
    bound = (scale.mean(0) / 2 + scale2 / 2)[..., None] * np.ones_like(mean)
    return out, bound.reshape(-1)[:n].reshape(g.shape[1:])


def test_int8_two_phase_matches_host_replay_and_bound():
    g = _grads(3)
    [(out, _, _)] = _run(C.int8("data", chunk=8), [g])
    for k in g:
        ref, bound = _np_int8(g[k], chunk=8)
        np.testing.assert_allclose(out[k], ref, rtol=0, atol=1e-6)
        assert np.all(np.abs(out[k] - g[k].mean(0)) <= bound * (1 + 1e-5) + 1e-7), k


def test_int8_quantizer_round_trip_bounds():
    x = jnp.asarray(np.random.default_rng(4).normal(size=(16, 32)), jnp.float32)
    absmax = np.abs(np.asarray(x)).max(-1, keepdims=True)
    q, scale = C.quantize_int8(x)
    err = np.abs(np.asarray(C.dequantize_int8(q, scale)) - np.asarray(x))
    assert np.all(err <= absmax / 254 * (1 + 1e-6))
    # Stochastic rounding: error below one step and unbiased on average.
    keys = jax.random.split(jax.random.key(0), 512)
    deq = jax.jit(jax.vmap(lambda k: C.dequantize_int8(*C.quantize_int8(x, k))))(keys)
    err = np.abs(np.asarray(deq) - np.asarray(x)[None])
    assert np.all(err < absmax[None] / 127 * (1 + 1e-6))
    bias = np.abs(np.asarray(deq).mean(0) - np.asarray(x))
    assert np.all(bias <= 5 * (absmax / 127 / 2) / math.sqrt(512))


def test_int8_stochastic_rounding_within_one_step_per_phase():
    g = _grads(5)
    (out1, _, _), (out2, _, _) = _run(C.int8("data", chunk=8, stochastic_rounding=True), [g, g])
    for k in g:
        _, half_bound = _np_int8(g[k], chunk=8)
        assert np.all(np.abs(out1[k] - g[k].mean(0)) < 2 * half_bound * (1 + 1e-5) + 1e-7)
    assert any(not np.array_equal(out1[k], out2[k]) for k in g), "the key must advance"


# --------------------------------------------------------------------------------------------------
# top-k


def _np_topk(acc, ratio):
    """Per replica: (sent, unsent) of acc [R, n]."""
    k = min(acc.shape[1], max(1, math.ceil(ratio * acc.shape[1])))
    sent = np.zeros_like(acc)
    for i in range(R):
        idx = np.argsort(-np.abs(acc[i]), kind="stable")[:k]
        sent[i, idx] = acc[i, idx]
    return sent, np.where(sent != 0, F32(0), acc)


def test_topk_matches_host_and_residual_is_exactly_the_unsent_part():
    steps = [_grads(6), _grads(7)]
    results = _run(C.topk("data", 0.2), steps)
    residual = {k: np.zeros((R, *s), F32) for k, s in SHAPES.items()}
    for g, (out, old, new) in zip(steps, results, strict=True):
        for k in g:
            np.testing.assert_array_equal(old.residual[k], residual[k])
            acc = (g[k] + residual[k]).reshape(R, -1)
            sent, unsent = _np_topk(acc, 0.2)
            np.testing.assert_allclose(out[k].reshape(-1), sent.mean(0), rtol=0, atol=1e-6)
            # Bitwise: the new residual is the accumulator with the sent entries zeroed.
            np.testing.assert_array_equal(new.residual[k].reshape(R, -1), unsent)
            np.testing.assert_array_equal(sent + unsent, acc)
            residual[k] = new.residual[k]


def test_topk_warmup_starts_dense_and_momentum_correction_matches_host():
    assert C.topk_densities(0.01, 100) == [1.0, 0.25, 0.0625, 0.015625, 0.01]
    assert C.topk_densities(0.01, 0) == [0.01]
    g = _grads(8)
    [(out, _, new)] = _run(C.topk("data", 0.1, warmup_steps=8), [g])
    for k in g:  # step 0 of the warm-up is a dense mean with nothing left over
        np.testing.assert_allclose(out[k], g[k].mean(0), rtol=0, atol=1e-6)
        assert not new.residual[k].any()

    m = 0.9
    steps = [_grads(9), _grads(10)]
    results = _run(C.topk("data", 0.2, momentum_correction=True, momentum=m), steps)
    u = {k: np.zeros((R, int(np.prod(s))), F32) for k, s in SHAPES.items()}
    v = {k: np.zeros((R, int(np.prod(s))), F32) for k, s in SHAPES.items()}
    for g, (out, _, new) in zip(steps, results, strict=True):
        for k in g:
            u[k] = F32(m) * u[k] + g[k].reshape(R, -1)
            v[k] = v[k] + u[k]
            sent, v[k] = _np_topk(v[k], 0.2)
            u[k] = np.where(sent != 0, F32(0), u[k])
            np.testing.assert_allclose(out[k].reshape(-1), sent.mean(0), rtol=0, atol=1e-6)
            np.testing.assert_allclose(new.residual[k].reshape(R, -1), v[k], rtol=0, atol=1e-6)
            np.testing.assert_allclose(new.velocity[k].reshape(R, -1), u[k], rtol=0, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# PowerSGD


def test_powersgd_factors_give_rank_r_approximation_of_mean():
    assert C.powersgd_shape((13, 7), 2, 1.0) == (1, 13, 7)
    assert C.powersgd_shape((5,), 2, 1.0) is None
    assert C.powersgd_shape((4, 3), 2, 1.0) is None  # 2 * (4 + 3) >= 12
    # Stacked layers are a batch; the rest is cut where it is most nearly square: 24 + 20 < 8 + 60.
    assert C.powersgd_shape((2, 8, 3, 4, 5), 2, 1.0, batch_dims=1) == (2, 24, 20)
    assert C.powersgd_shape((2, 7), 2, 1.0, batch_dims=1) is None
    steps = [_grads(11), _grads(12)]
    results = _run(C.powersgd("data", rank=2), steps)
    residual = np.zeros((R, 13, 7), F32)
    for g, (out, old, new) in zip(steps, results, strict=True):
        np.testing.assert_allclose(out["b"], g["b"].mean(0), rtol=0, atol=1e-6)  # 1-D: plain mean
        m = (g["w"] + residual).astype(np.float64)  # [R, n, m]
        q0 = old.q["w"][0, 0].astype(np.float64)
        assert all(np.array_equal(old.q["w"][i], old.q["w"][0]) for i in range(R))
        mbar = m.mean(0)
        p, _ = np.linalg.qr(mbar @ q0)  # P = orthonormal(pmean(M_i Q))
        approx = p @ p.T @ mbar  # = P pmean(M_i^T P)^T
        np.testing.assert_allclose(out["w"], approx, rtol=0, atol=1e-5)
        assert np.linalg.matrix_rank(out["w"], tol=1e-4) <= 2
        q_new = mbar.T @ p  # equal to the stored Q up to the sign of each column (QR convention)
        signs = np.sign(np.sum(q_new * new.q["w"][0, 0], axis=0))
        np.testing.assert_allclose(new.q["w"][0, 0] * signs, q_new, rtol=0, atol=1e-5)
        expect_residual = m - np.einsum("nr,imr->inm", p, np.einsum("inm,nr->imr", m, p))
        np.testing.assert_allclose(new.residual["w"], expect_residual, rtol=0, atol=1e-5)
        residual = new.residual["w"]


def test_powersgd_compresses_each_stacked_layer_separately():
    shapes = {"w": (3, 9, 6)}
    params = {"w": jnp.zeros(shapes["w"])}
    steps = [_grads(40, shapes=shapes), _grads(41, shapes=shapes)]
    results = _run(C.powersgd("data", rank=2, batch_dims={"w": 1}), steps, params=params)
    residual = np.zeros((R, *shapes["w"]), F32)
    for g, (out, old, new) in zip(steps, results, strict=True):
        assert old.q["w"].shape == (R, 3, 6, 2)
        m = (g["w"] + residual).astype(np.float64)
        for layer in range(3):
            mbar = m[:, layer].mean(0)
            p, _ = np.linalg.qr(mbar @ old.q["w"][0, layer].astype(np.float64))
            np.testing.assert_allclose(out["w"][layer], p @ p.T @ mbar, rtol=0, atol=1e-5)
            assert np.linalg.matrix_rank(out["w"][layer], tol=1e-4) <= 2
        residual = new.residual["w"]


def test_powersgd_sends_all_factors_in_one_buffer_each():
    """The compiled sync all-reduces every matrix's P and the uncompressed tensors in one flat
    buffer, then every Q in another (as PyTorch's powerSGD_hook packs them): two arrays a step
    (and the loss) however many tensors, where XLA:CPU runs each array of an all-reduce as one
    gloo call (hlo_cost.CollectiveOp.buffers; docs/AGGREGATION.md, "Every other method at 5 ms")."""
    from jaxdist import hlo_cost

    shapes = {"a": (13, 7), "b": (9, 11), "c": (2, 8, 6), "v": (5,), "u": (3,)}
    params = {k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()}
    tx = C.powersgd("data", rank=2, batch_dims={"a": 0, "b": 0, "c": 1, "v": 0, "u": 0})
    step = jax.jit(sync_grads(_identity_grad_fn, tx, MESH, "data"))
    g = _grads(7, shapes=shapes)
    state = C.init_global(tx, params, MESH, "data")
    text = step.lower(params, g, state).compile().as_text()
    reduces = [op for op in hlo_cost.collective_ops(text) if op.kind == "all-reduce"]
    # P's of a, b, c (76 floats) with the two vectors (8), Q's (60) and the 4-byte loss: three
    # arrays (XLA's combiner pairs Q's and the loss), against nine one tensor at a time.
    assert sorted(op.buffers for op in reduces) == [1, 2], [
        (op.buffers, op.bytes_per_exec) for op in reduces
    ]
    assert sum(op.bytes_per_exec for op in reduces) == 4 * (76 + 8 + 60 + 1)
    # The same means as one tensor at a time: P = mean(M Q), orthonormalised, times mean(M^T P).
    ((out, old, _),) = _run(tx, [g], params=params)
    for k in ("a", "b"):
        mbar = g[k].astype(np.float64).mean(0)
        p, _ = np.linalg.qr(mbar @ old.q[k][0, 0].astype(np.float64))
        np.testing.assert_allclose(out[k], p @ p.T @ mbar, rtol=0, atol=1e-5)
    np.testing.assert_allclose(out["v"], g["v"].mean(0), rtol=0, atol=1e-6)


TWO = ["all-gather", "all-to-all"]


@pytest.mark.parametrize(
    "make, kinds",
    [
        (lambda bd: C.bf16("data", batch_dims=bd), TWO),
        (
            lambda bd: C.int8("data", batch_dims=bd, error_feedback=True, stochastic_rounding=True),
            TWO,
        ),
        (lambda bd: C.ef_sign("data", batch_dims=bd, start_step=1), TWO),
        (lambda bd: C.onebit_adam("data", freeze_step=1, batch_dims=bd), TWO),
        (lambda bd: C.topk("data", 0.05, batch_dims=bd, momentum_correction=True), ["all-gather"]),
        (lambda bd: C.topk("data", 0.25, batch_dims=bd, two_phase=True, warmup_steps=4), TWO),
    ],
    ids=["bf16", "int8", "ef_sign", "onebit_adam", "topk", "topk_two_phase"],
)
def test_two_phase_compressors_send_every_tensor_in_one_buffer_per_phase(make, kinds):
    """Every tensor's all-to-all travels in one byte buffer, and every all-gather in another
    (`tensors.two_phase`): two gloo calls a step, not two or four per tensor (on XLA:CPU each
    array pays its messages' latency: docs/AGGREGATION.md, "One buffer per phase"). Top-k's
    dense routes (a tensor whose pairs would outweigh it) share one all-reduce."""
    from jaxdist import hlo_cost

    shapes = {"a": (13, 7), "b": (9, 11), "c": (2, 8, 6), "v": (5,), "u": (3,)}
    params = {k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()}
    tx = make({"a": 0, "b": 0, "c": 1, "v": 0, "u": 0})
    step = jax.jit(sync_grads(_identity_grad_fn, tx, MESH, "data"))
    text = step.lower(params, _grads(7, shapes=shapes), C.init_global(tx, params, MESH, "data"))
    # (The cheapest branch: with a dense warm-up the costliest is its f32 pmean.)
    ops = hlo_cost.collective_ops(text.compile().as_text(), branch="cheapest")
    got = [op.kind for op in ops]
    assert sorted(k for k in got if k != "all-reduce") == kinds, got
    assert got.count("all-reduce") <= 2, got  # the loss (and residual norm); top-k's dense union


def test_many_array_exchanges_move_the_same_bits_as_one_array_at_a_time():
    """`replica.all_to_all_many` / `gather_many` (one byte buffer) against one `all_to_all` /
    `gather` per array, bit for bit, for every dtype the compressors send."""
    from jaxdist.compression import replica

    rng = np.random.default_rng(0)
    xs = [
        rng.normal(size=(R, R, 3, 5)).astype(np.float32),
        rng.integers(-127, 128, size=(R, R, 7)).astype(np.int8),
        rng.integers(0, 2**16, size=(R, R, 2)).astype(np.uint16),
        rng.integers(0, 256, size=(R, R, 1)).astype(np.uint8),
        rng.integers(0, 2**31, size=(R, R, 4)).astype(np.int32),
    ]

    def body(*xs):
        xs = [x[0] for x in xs]  # this replica's [R, ...] rows
        many = replica.all_to_all_many(xs, "data") + replica.gather_many(xs, "data")
        one = [replica.all_to_all(x, "data") for x in xs] + [replica.gather(x, "data") for x in xs]
        return tuple(y[None] for y in many + one)

    spec = P("data")
    out = jax.jit(
        jax.shard_map(body, mesh=MESH, in_specs=(spec,) * len(xs), out_specs=(spec,) * 20)
    )(*xs)
    for many, one in zip(out[:10], out[10:], strict=True):
        assert many.dtype == one.dtype and many.shape == one.shape
        np.testing.assert_array_equal(np.asarray(many), np.asarray(one))


def test_powersgd_start_iter_is_dense():
    g = _grads(13)
    (out0, _, s0), (out1, _, _) = _run(C.powersgd("data", rank=1, start_iter=1), [g, g])
    np.testing.assert_allclose(out0["w"], g["w"].mean(0), rtol=0, atol=1e-6)
    assert not s0.residual["w"].any()
    assert np.linalg.matrix_rank(out1["w"], tol=1e-4) == 1


# --------------------------------------------------------------------------------------------------
# sign


def _np_sign_compress(x, valid):
    d = np.maximum(valid.sum(-1), 1).astype(F32)
    scale = np.where(valid, np.abs(x), F32(0)).sum(-1) / d
    bits = x >= 0
    approx = np.where(valid, np.where(bits, scale[..., None], -scale[..., None]), F32(0))
    return np.packbits(bits, axis=-1), scale, approx


def _np_sign_decompress(packed, scale, c):
    bits = np.unpackbits(packed, axis=-1, count=c).astype(bool)
    return np.where(bits, scale[..., None], -scale[..., None])


def _np_sign(g, worker, server, chunk):
    """Host replay of the two-phase sign reduction. g, worker [R, *shape]; server [R, shard]."""
    n = g[0].size
    shard, c = C.shard_layout(n, R, chunk, 8)
    acc = g + worker
    x = _np_rows(acc, shard, c)  # [src, dst, a, c]
    valid = (np.arange(R * shard) < n).reshape(R, shard // c, c)  # [dst, a, c]
    packed, scale, approx = _np_sign_compress(x, valid[None])
    new_worker = acc - approx.reshape(R, -1)[:, :n].reshape(g.shape)
    mean = np.where(valid, _np_sign_decompress(packed, scale, c).mean(0), F32(0))
    mean = mean + server.reshape(mean.shape)
    packed2, scale2, approx2 = _np_sign_compress(mean, valid)
    new_server = (mean - approx2).reshape(R, shard)
    out = _np_sign_decompress(packed2, scale2, c).reshape(-1)[:n].reshape(g.shape[1:])
    return out, new_worker, new_server


def test_sign_two_phase_matches_host_replay():
    steps = [_grads(14), _grads(15), _grads(16)]
    results = _run(C.sign("data", chunk=16), steps)
    for k in SHAPES:
        worker, server = results[0][1].worker[k], results[0][1].server[k]
        assert not worker.any() and not server.any()
        for g, (out, _, new) in zip(steps, results, strict=True):
            ref, worker, server = _np_sign(g[k], worker, server, chunk=16)
            np.testing.assert_allclose(out[k], ref, rtol=0, atol=1e-6)
            np.testing.assert_allclose(new.worker[k], worker, rtol=0, atol=1e-6)
            np.testing.assert_allclose(new.server[k], server, rtol=0, atol=1e-6)


def test_sign_momentum_correction_compresses_the_synchronized_momentum():
    """1-bit Adam: replica i compresses beta * m + g_i (+ its residual); the result is the new m."""
    beta = 0.9
    steps = [_grads(50), _grads(51), _grads(52)]
    results = _run(C.sign("data", chunk=16, momentum_correction=True, momentum=beta), steps)
    for k in SHAPES:
        worker, server = results[0][1].worker[k], results[0][1].server[k]
        m = np.zeros(SHAPES[k], F32)
        for g, (out, _, new) in zip(steps, results, strict=True):
            ref, worker, server = _np_sign(beta * m + g[k], worker, server, chunk=16)
            np.testing.assert_allclose(out[k], ref, rtol=0, atol=1e-5)
            np.testing.assert_allclose(
                new.momentum[k], np.broadcast_to(ref, (R, *ref.shape)), rtol=0, atol=1e-5
            )
            m = ref


def test_sign_start_step_is_dense_then_compressed():
    steps = [_grads(53), _grads(54)]
    (out0, _, s0), (out1, _, s1) = _run(C.sign("data", chunk=16, start_step=1), steps)
    for k in SHAPES:
        np.testing.assert_allclose(out0[k], steps[0][k].mean(0), rtol=0, atol=1e-6)
        assert not s0.worker[k].any() and not s0.server[k].any()
        zeros = np.zeros((R, C.shard_layout(int(np.prod(SHAPES[k])), R, 16, 8)[0]), F32)
        ref, _, _ = _np_sign(steps[1][k], np.zeros_like(steps[1][k]), zeros, 16)
        np.testing.assert_allclose(out1[k], ref, rtol=0, atol=1e-6)
    assert s1.count.tolist() == [2] * R


def test_sign_without_error_feedback_is_plain_scaled_sign():
    g = _grads(17)
    [(out, _, new)] = _run(C.sign("data", error_feedback=False, chunk=16), [g])
    assert new.worker is None and new.server is None
    for k in g:
        zeros = np.zeros_like(g[k])
        ref, _, _ = _np_sign(
            g[k], zeros, np.zeros((R, C.shard_layout(g[k][0].size, R, 16, 8)[0])), 16
        )
        np.testing.assert_allclose(out[k], ref, rtol=0, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# error feedback: what is sent plus what is kept equals what came in


def _carried(name, state):
    """The compression error a state carries, summed over replicas into gradient space."""
    if name in ("topk", "powersgd"):
        return {k: (v.mean(0) if v is not None else 0) for k, v in state.residual.items()}
    out = {}
    for k, s in SHAPES.items():
        server = state.server[k].reshape(-1)[: int(np.prod(s))].reshape(s)  # one shard per replica
        out[k] = state.worker[k].mean(0) + server
    return out


@pytest.mark.parametrize(
    "name,tx",
    [
        ("topk", C.topk("data", 0.1)),
        ("powersgd", C.powersgd("data", rank=1)),
        ("sign", C.sign("data", chunk=16)),
    ],
)
def test_error_feedback_conserves_the_gradient(name, tx):
    steps = [_grads(20 + i) for i in range(3)]
    for g, (out, old, new) in zip(steps, _run(tx, steps), strict=True):
        before, after = _carried(name, old), _carried(name, new)
        for k in g:
            np.testing.assert_allclose(
                out[k] + after[k], g[k].mean(0) + before[k], rtol=0, atol=1e-6
            )


# --------------------------------------------------------------------------------------------------
# Bytes on the wire, from the compiled HLO


@functools.cache
def _none_wire_bytes():
    return _wire_bytes(C.none("data"), BIG)


def _wire_bytes(tx, shapes):
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
    stacked = {k: jax.ShapeDtypeStruct((R, *s), jnp.float32) for k, s in shapes.items()}
    state = jax.eval_shape(lambda p: C.init_global(tx, p, MESH, "data"), params)
    fn = jax.jit(sync_grads(_identity_grad_fn, tx, MESH, "data"))
    return sum(
        metrics.collective_bytes(fn.lower(params, stacked, state).compile().as_text()).values()
    )


BIG = {"w": (1024, 1024), "b": (1024,)}  # ~1M parameters


@pytest.mark.parametrize(
    "tx,min_ratio",
    [
        (C.fp16("data"), 1.99),  # 2 less the f32 bytes of the loss's scalar mean
        (C.bf16("data"), 1.9),
        (C.int8("data"), 3.5),
        (C.topk("data", 0.01), 10.0),
        (C.powersgd("data", rank=2), 10.0),
        (C.sign("data"), 15.0),
    ],
    ids=["fp16", "bf16", "int8", "topk", "powersgd", "sign"],
)
def test_wire_bytes_vs_none(tx, min_ratio):
    ratio = _none_wire_bytes() / _wire_bytes(tx, BIG)
    assert ratio >= min_ratio, ratio


def test_model_gradient_is_local_before_compression():
    """Differentiating inside sync_grads must not add an f32 all-reduce of the whole gradient."""
    x = jax.ShapeDtypeStruct((4 * R, 256), jnp.float32)
    y = jax.ShapeDtypeStruct((4 * R, 256), jnp.float32)
    params = {"w": jax.ShapeDtypeStruct((256, 256), jnp.float32)}
    params["b"] = jax.ShapeDtypeStruct((256,), jnp.float32)
    tx = C.sign("data")
    state = jax.eval_shape(lambda p: C.init_global(tx, p, MESH, "data"), params)
    fn = jax.jit(sync_grads(jax.value_and_grad(_linear_loss), tx, MESH, "data"))
    got = metrics.collective_bytes(fn.lower(params, (x, y), state).compile().as_text())
    assert got.get("all-reduce", 0) <= 8, got  # only the scalar loss is all-reduced


# --------------------------------------------------------------------------------------------------
# Convergence


def _least_squares():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32 * R, 16)).astype(F32)
    w = rng.normal(size=(16, 8)).astype(F32)
    y = (x @ w + 0.5 * rng.normal(size=(32 * R, 8))).astype(F32)
    return jax.device_put((x, y), NamedSharding(MESH, P("data")))


def _final_loss(tx, batch, steps=150, lr=0.05):
    params = {"w": jnp.zeros((16, 8)), "b": jnp.zeros((8,))}
    sync = sync_grads(jax.value_and_grad(_linear_loss), tx, MESH, "data")
    opt = optax.sgd(lr)

    @jax.jit
    def train(params, batch):
        def body(_, carry):
            p, o, s = carry
            _, g, s = sync(p, batch, s)
            updates, o = opt.update(g, o, p)
            return optax.apply_updates(p, updates), o, s

        carry = (params, opt.init(params), C.init_global(tx, params, MESH, "data"))
        p, _, _ = jax.lax.fori_loop(0, steps, body, carry)
        return _linear_loss(p, batch)

    return float(train(params, batch))


def test_compressors_converge_like_none():
    batch = _least_squares()
    base = _final_loss(C.none("data"), batch)
    for name, tx in [
        ("bf16", C.bf16("data")),
        ("int8", C.int8("data")),
        ("topk", C.topk("data", 0.1)),
        ("powersgd", C.powersgd("data", rank=2)),
        ("sign", C.sign("data")),
    ]:
        loss = _final_loss(tx, batch)
        assert abs(loss - base) <= 0.05 * base, (name, loss, base)


# --------------------------------------------------------------------------------------------------
# Config, state layout, multi-axis meshes


def test_from_config_and_errors():
    import ml_collections

    cfg = ml_collections.ConfigDict(
        {"compression": "powersgd", "rank": 4, "topk_ratio": 0.01, "error_feedback": False}
    )
    state = jax.eval_shape(
        lambda p: C.init_global(C.from_config(cfg, "data"), p, MESH, "data"), PARAMS
    )
    assert state.q["w"].shape == (R, 1, 7, 4) and state.residual["w"] is None
    for name in C.COMPRESSORS:
        cfg.compression = name
        assert isinstance(C.from_config(cfg, "data"), optax.GradientTransformation)
    bad = [
        ({"compression": "fp8"}, "grad_sync.compression"),
        ({"compression": "powersgd", "rank": 0}, "grad_sync.rank"),
        ({"compression": "topk", "topk_ratio": 0.0}, "grad_sync.topk_ratio"),
        ({"compression": "topk", "topk_ratio": 1.5}, "grad_sync.topk_ratio"),
        ({"compression": "sign", "warmup_steps": -1}, "grad_sync.warmup_steps"),
        ({"compression": "powersgd", "momentum_correction": True}, "grad_sync.momentum_correction"),
    ]
    for fields, field in bad:
        with pytest.raises(ConfigError, match=field) as e:
            C.from_config(fields, "data")
        assert "\n" not in str(e.value)


def test_state_layout_and_partition_specs():
    mesh = jax.make_mesh(
        (R // 2, 2), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2
    )
    tx = C.topk("data", 0.1)
    param_specs = {"w": P(None, "fsdp"), "b": P()}
    params = {"w": jnp.zeros((8, 6)), "b": jnp.zeros((5,))}
    abstract = jax.eval_shape(lambda p: C.init_global(tx, p, mesh, "data"), params)
    specs = C.state_partition_spec(abstract, "data", params, param_specs)
    assert specs.count == P("data") and specs.residual["w"] == P("data", None, "fsdp")
    assert specs.residual["b"] == P("data", None)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    state = jax.jit(lambda p: C.init_global(tx, p, mesh, "data"), out_shardings=shardings)(params)
    assert state.residual["w"].shape == (R // 2, 8, 6)
    assert state.residual["w"].sharding.spec == P("data", None, "fsdp")
    assert C.state_partition_spec(abstract, "data").residual["w"] == P("data", None, None)
    # PowerSGD: residuals exist only for compressed leaves; Q is not parameter-shaped.
    tx = C.powersgd("data", rank=2)
    abstract = jax.eval_shape(lambda p: C.init_global(tx, p, mesh, "data"), params)
    specs = C.state_partition_spec(abstract, "data", params, param_specs)
    assert specs.residual == {"w": P("data", None, "fsdp"), "b": None}
    assert specs.q == {"w": P("data", None, None, None), "b": None} and specs.count == P("data")


@pytest.mark.parametrize(
    "make",
    [
        C.bf16,
        lambda a: C.int8(a, chunk=8),
        lambda a: C.topk(a, 0.2),
        lambda a: C.powersgd(a, 2),
        lambda a: C.sign(a, chunk=16),
    ],
    ids=["bf16", "int8", "topk", "powersgd", "sign"],
)
def test_partial_manual_and_two_data_axes_match_one_axis(make):
    """data manual with fsdp automatic (parameters sharded on fsdp), and (data, fsdp) both manual,
    give the result of a plain 1-axis data mesh with the same number of replicas."""
    half = R // 2
    auto = jax.sharding.AxisType.Auto
    mesh1 = jax.make_mesh((half,), ("data",), axis_types=(auto,), devices=jax.devices()[:half])
    mesh2 = jax.make_mesh((half, 2), ("data", "fsdp"), axis_types=(auto, auto))
    rng = np.random.default_rng(30)
    params = {"w": rng.normal(size=(12, 8)).astype(F32), "b": np.zeros((8,), F32)}
    x = rng.normal(size=(4 * half, 12)).astype(F32)
    y = rng.normal(size=(4 * half, 8)).astype(F32)
    grad_fn = jax.value_and_grad(_linear_loss)

    def run(mesh, params):
        tx = make("data")
        batch = jax.device_put((x, y), NamedSharding(mesh, P("data")))
        sync = sync_grads(grad_fn, tx, mesh, "data")
        fn = jax.jit(lambda p, b: sync(p, b, C.init_global(tx, p, mesh, "data"))[1])
        return jax.tree.map(np.asarray, fn(params, batch))

    ref = run(mesh1, params)
    sharded = jax.device_put(
        params, {"w": NamedSharding(mesh2, P(None, "fsdp")), "b": NamedSharding(mesh2, P())}
    )
    got = run(mesh2, sharded)
    for k in ref:  # f32 sums in another order where fsdp splits the matmuls: 1e-6 of the scale
        np.testing.assert_allclose(got[k], ref[k], rtol=0, atol=1e-6 * np.abs(ref[k]).max())
    # Both axes manual: R replicas over (data, fsdp), data-major like P(("data", "fsdp")).
    g = _grads(31)
    ref2 = _run_n(make("data"), g, MESH, "data")
    got2 = _run_n(make(("data", "fsdp")), g, mesh2, ("data", "fsdp"))
    for k in g:
        np.testing.assert_allclose(got2[k], ref2[k], rtol=0, atol=1e-6)


def _run_n(tx, g, mesh, axes, params=PARAMS):
    """One sync step from a fresh state, init and step in one compiled program."""
    sync = sync_grads(_identity_grad_fn, tx, mesh, axes)
    fn = jax.jit(lambda p, g: sync(p, g, C.init_global(tx, p, mesh, axes))[1])
    return jax.tree.map(np.asarray, fn(params, g))


# --------------------------------------------------------------------------------------------------
# Local SGD / DiLoCo


def _replica_batches(batch):
    """Replica i's contiguous slice of dim 0, as P("data") places it."""
    x, y = (np.asarray(a).reshape(R, -1, a.shape[-1]) for a in batch)
    return [(x[i], y[i]) for i in range(R)]


def _reference_local_sgd(params, batch, lr, local_steps, steps, outer, sync_steps=0):
    """Single-device reference: each replica's SGD on its batch slice, synced every H steps
    (and after each of the first `sync_steps` steps)."""
    shards = _replica_batches(batch)
    grad = jax.jit(jax.grad(_linear_loss))
    anchor = jax.tree.map(np.asarray, params)
    outer_state = outer.init(anchor)
    local = [anchor] * R
    for t in range(steps):
        local = [
            jax.tree.map(lambda p, d: p - lr * d, p, grad(p, b))
            for p, b in zip(local, shards, strict=True)
        ]
        if (t + 1) % local_steps == 0 or t < sync_steps:
            mean = jax.tree.map(lambda *xs: np.mean(np.stack(xs), 0), *local)
            delta = jax.tree.map(lambda a, m: a - m, anchor, mean)
            upd, outer_state = outer.update(delta, outer_state, anchor)
            anchor = optax.apply_updates(anchor, upd)
            local = [anchor] * R
    return anchor, local


@pytest.mark.parametrize(
    "local_steps,outer,sync_steps,per_replica",
    [
        (1, None, 0, "shard_map"),
        (3, None, 0, "shard_map"),
        (2, "diloco", 0, "shard_map"),
        (3, "diloco", 2, "shard_map"),
        (3, "diloco", 2, "vmap"),
    ],
)
def test_local_sgd_matches_reference(local_steps, outer, sync_steps, per_replica):
    batch = _least_squares()
    params = {"w": jnp.zeros((16, 8)), "b": jnp.zeros((8,))}
    # 5 steps end between syncs for H = 2, 3: replicas hold different params; with sync_steps=2
    # H = 3 syncs after steps 1, 2 and 3 (post-local SGD's synchronous start), then not at 4, 5.
    lr, steps = 0.05, 5
    outer_tx = diloco_outer() if outer else None
    algo = local_sgd(
        jax.value_and_grad(_linear_loss), optax.sgd(lr), MESH, "data", local_steps, outer_tx,
        per_replica=per_replica, sync_steps=sync_steps,
    )  # fmt: skip
    state = jax.jit(algo.init)(params)
    step = jax.jit(algo.step)
    for _ in range(steps):
        state, _ = step(state, batch)
    anchor, local = _reference_local_sgd(
        params, batch, lr, local_steps, steps, outer_tx or optax.sgd(1.0), sync_steps
    )
    for k in anchor:
        np.testing.assert_allclose(state.params[k], anchor[k], rtol=0, atol=1e-5)
        np.testing.assert_allclose(
            state.local_params[k], np.stack([p[k] for p in local]), rtol=0, atol=1e-5
        )
    if local_steps == 1 and outer is None:  # equals synchronous data-parallel SGD
        sync = sync_grads(jax.value_and_grad(_linear_loss), C.none("data"), MESH, "data")
        p = params
        for _ in range(steps):
            _, g, _ = jax.jit(sync)(p, batch, optax.EmptyState())
            p = jax.tree.map(lambda a, b: a - lr * b, p, g)
        for k in p:
            np.testing.assert_allclose(state.params[k], p[k], rtol=0, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# Stacked layers (batch_dims): each layer compressed as a tensor of its own


@pytest.mark.parametrize(
    "make",
    [
        lambda bd: C.bf16("data", batch_dims=bd),
        lambda bd: C.int8("data", batch_dims=bd),
        lambda bd: C.topk("data", 0.1, momentum_correction=True, batch_dims=bd),
        lambda bd: C.powersgd("data", rank=2, batch_dims=bd),
        lambda bd: C.sign("data", chunk=16, batch_dims=bd),
    ],
    ids=["bf16", "int8", "topk", "powersgd", "sign"],
)
def test_stacked_layers_compress_like_separate_tensors(make):
    """A [3, 13, 7] leaf with batch_dims=1 gives, for 3 steps (state included), exactly what three
    [13, 7] leaves give: the layer axis is a batch of independent tensors (per-layer top-k, scales
    and shards)."""
    L = 3
    stacked = {"w": jnp.zeros((L, 13, 7), jnp.float32)}
    separate = {f"w{i}": jnp.zeros((13, 7), jnp.float32) for i in range(L)}
    steps = [_grads(s, shapes={"w": (L, 13, 7)}) for s in range(3)]
    got = _run(make({"w": 1}), steps, params=stacked)
    # PowerSGD's initial Q is drawn per leaf: give the separate run the stacked run's Q.
    tx = make(None)
    if got[0][1].__class__ is C.PowerSGDState:
        q0 = got[0][1].q["w"]  # [R, L, m, r]
        init = tx.init
        tx = tx._replace(
            init=lambda p: init(p)._replace(
                q={f"w{i}": jnp.asarray(q0[:1, i : i + 1]) for i in range(L)}
            )
        )
    split = [{f"w{i}": g["w"][:, i] for i in range(L)} for g in steps]
    want = _run(tx, split, params=separate)
    # f32 throughout; a batched QR (PowerSGD) rounds differently from one matrix at a time.
    for (m_got, _, _), (m_want, _, _) in zip(got, want, strict=True):
        for i in range(L):
            np.testing.assert_allclose(m_got["w"][i], m_want[f"w{i}"], rtol=1e-5, atol=1e-6)


def test_sharded_state_follows_the_shards():
    """The train step's compressor state (`sharded_state`): parameter-shaped leaves are sharded like
    their parameters; per-shard leaves (PowerSGD's Q, sign's server residual) hold each shard's own
    copy side by side over the axes that split that parameter, and nothing for replicated ones."""
    for axis in ("pipeline", "tensor"):
        mesh = jax.make_mesh(
            (R // 2, 2), ("data", axis), axis_types=(jax.sharding.AxisType.Auto,) * 2
        )
        params = {"blocks": jnp.zeros((2, 16, 8)), "norm": jnp.zeros((2, 8))}
        param_specs = {"blocks": P(axis, None, None), "norm": P(None, None)}
        if axis == "tensor":
            param_specs["blocks"] = P(None, None, axis)
        batch_dims = {"blocks": 1, "norm": 1}
        for tx, field in [
            (C.powersgd("data", rank=2, batch_dims=batch_dims), "q"),
            (C.sign("data", chunk=8, batch_dims=batch_dims), "server"),
        ]:
            init, specs = C.sharded_state(tx, params, param_specs, mesh, "data", (axis,))
            abstract = jax.eval_shape(init, params)
            got = getattr(specs, field)["blocks"]
            assert got == P("data", axis, *(None,) * (len(got) - 2)), (axis, field, got)
            # Two shards' copies side by side: 2 layers on a pipeline, 2 x 2 layers over tensor.
            want_rows = 2 if axis == "pipeline" else 4
            assert getattr(abstract, field)["blocks"].shape[:2] == (R // 2, want_rows)
            residual = specs.residual if field == "q" else specs.worker
            assert residual["blocks"] == P("data", *param_specs["blocks"])
            if field == "server":  # the norms are replicated: one copy, not split
                assert specs.server["norm"] == P("data", None, None)
            shardings = jax.tree.map(lambda sp, mesh=mesh: NamedSharding(mesh, sp), specs)
            state = jax.jit(init, out_shardings=shardings)(params)
            assert jax.tree.structure(state) == jax.tree.structure(abstract)
