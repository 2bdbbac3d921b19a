"""Every registered compressor through the same checks, parametrized over `compression.COMPRESSORS`.

A new entry in the registry is picked up here without a test edit: error feedback conserves what
came in (or the spec says it keeps no residual), the bytes its compiled exchange sends match its
spec's declared `wire_bytes` at two replica counts, its state survives an elastic resize with what
it owes intact, and validation refuses the fields and abilities it does not accept, in one line.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist import compression as C
from jaxdist import config as config_lib
from jaxdist import metrics
from jaxdist.collectives import sync_grads
from jaxdist.compression.registry import residual_fields
from jaxdist.compression_fields import COMPRESSION_FIELDS
from jaxdist.errors import ConfigError
from tests.helpers import tiny_gpt_config
from tests.test_compression import BIG, MESH, PARAMS, SHAPES, R, _grads, _identity_grad_fn, _run

NAMES = sorted(C.COMPRESSORS)
MESH4 = jax.make_mesh(
    (R // 2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[: R // 2]
)


def _cfg(name: str, **over) -> dict:
    """The spec's example fields, compressing from the first step (no warm-up)."""
    return {"compression": name, **C.COMPRESSORS[name].example, "warmup_steps": 0, **over}


def _paths(state) -> dict[str, np.ndarray]:
    """Global state leaves by '/'-joined path (field/leaf), as `resize_replicas` takes them."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        keys = [str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path]
        out["/".join(keys)] = np.asarray(x)
    return out


def _owed(flat: dict[str, np.ndarray], shapes=SHAPES) -> dict[str, np.ndarray]:
    """Per parameter: what the residual fields owe the mean gradient, [*shape] (f64)."""
    out = {}
    for path, x in flat.items():
        field, _, leaf = path.partition("/")
        if field not in residual_fields():
            continue
        x = x.astype(np.float64)
        n = int(np.prod(shapes[leaf]))
        if field == "server":  # one shard of the tensor per replica, side by side
            part = np.moveaxis(x, 0, -2).reshape(-1)[:n].reshape(shapes[leaf])
        else:
            part = x.mean(0)
        out[leaf] = out.get(leaf, 0) + part
    return out


# --------------------------------------------------------------------------------------------------
# The registry's own consistency


def test_every_spec_reads_fields_with_a_default_and_a_rule():
    schema = config_lib.base_config().grad_sync
    for name, spec in C.COMPRESSORS.items():
        assert spec.name == name
        for f in spec.fields:
            assert f in COMPRESSION_FIELDS and f in schema, (name, f)
        assert set(spec.residual_fields) <= set(residual_fields())
        if spec.deprecated_for:
            assert (
                spec.deprecated_for in C.COMPRESSORS
                and not C.COMPRESSORS[spec.deprecated_for].deprecated_for
            )
    for f, rule in COMPRESSION_FIELDS.items():
        assert rule.ok(rule.default), f
        if rule.must:
            assert not rule.ok(rule.bad), f


# --------------------------------------------------------------------------------------------------
# Error feedback: what is sent plus what is kept equals what came in


@pytest.mark.parametrize("name", NAMES)
def test_error_feedback_conserves_what_came_in(name):
    spec = C.COMPRESSORS[name]
    tx = C.from_config(_cfg(name), "data")
    steps = [_grads(40 + i) for i in range(3)]
    runs = _run(tx, steps)
    if not spec.error_feedback:  # it says it keeps nothing: its state has no residual to keep
        for _, _, new in runs:
            assert not _owed(_paths(new)), name
        return
    b1 = 0.9  # from_config's default Adam beta, for the specs that sync Adam's momentum
    for g, (out, old, new) in zip(steps, runs, strict=True):
        before, after = _owed(_paths(old)), _owed(_paths(new))
        assert after, f"{name} declares error feedback but its state keeps no residual"
        for k in g:
            came_in = g[k].mean(0).astype(np.float64)
            if spec.preconditioner is not None:  # b1 m + (1 - b1) g, m the synced momentum
                came_in = b1 * old.momentum[k][0] + (1 - b1) * came_in
            np.testing.assert_allclose(
                out[k] + after.get(k, 0), came_in + before.get(k, 0), rtol=0, atol=1e-6
            )


# --------------------------------------------------------------------------------------------------
# Bytes on the wire: the compiled HLO against the spec's declared cost (what the planner uses)


def _measured_bytes(tx, shapes, mesh):
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
    r = mesh.devices.size
    stacked = {k: jax.ShapeDtypeStruct((r, *s), jnp.float32) for k, s in shapes.items()}
    state = jax.eval_shape(lambda p: C.init_global(tx, p, mesh, "data"), params)
    fn = jax.jit(sync_grads(_identity_grad_fn, tx, mesh, "data"))
    hlo = fn.lower(params, stacked, state).compile().as_text()
    return sum(metrics.collective_bytes(hlo).values())


@pytest.mark.parametrize("mesh", [MESH, MESH4], ids=[f"R{R}", f"R{R // 2}"])
@pytest.mark.parametrize("name", NAMES)
def test_wire_bytes_match_the_spec(name, mesh):
    spec, cfg = C.COMPRESSORS[name], _cfg(name)
    r = mesh.devices.size
    measured = _measured_bytes(C.from_config(cfg, "data"), BIG, mesh)
    declared = C.total_wire_bytes(spec, list(BIG.values()), r, cfg)
    # abs: the loss's scalar all-reduce and randk's 4-byte step pmax, 7 bytes each at R = 8
    assert measured == pytest.approx(declared, rel=0.01, abs=32), (measured, declared)


# --------------------------------------------------------------------------------------------------
# Elastic resize: R -> R/2 replicas keeps what the error feedback owes


@pytest.mark.parametrize("name", NAMES)
def test_resize_keeps_what_is_owed(name):
    cfg = _cfg(name)
    tx = C.from_config(cfg, "data")
    saved = _paths(_run(tx, [_grads(60), _grads(61)])[-1][2])
    small = jax.eval_shape(lambda p: C.init_global(tx, p, MESH4, "data"), PARAMS)
    shapes = {
        p: x.shape
        for p, x in _paths(jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), small)).items()
    }
    assert shapes.keys() == saved.keys()
    new = C.resize_replicas(saved, shapes)
    assert {p: x.shape for p, x in new.items()} == shapes
    before, after = _owed(saved), _owed(new)
    assert before.keys() == after.keys()
    for k in before:
        np.testing.assert_allclose(after[k], before[k], rtol=0, atol=1e-6)
    for p, x in saved.items():  # counters and keys carry on
        if not np.issubdtype(x.dtype, np.floating):
            np.testing.assert_array_equal(new[p], np.broadcast_to(x[0], shapes[p]))


# --------------------------------------------------------------------------------------------------
# Validation refuses what the spec does not accept, before compiling, in one line


def _refused(cfg: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(match)) as e:
        C.check(cfg)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", NAMES)
def test_validation_refuses_bad_fields_and_missing_abilities(name):
    spec = C.COMPRESSORS[name]
    C.check(_cfg(name))
    for f in spec.fields:
        rule = COMPRESSION_FIELDS[f]
        if rule.must:
            _refused(_cfg(name, **{f: rule.bad}), f"grad_sync.{f}=")
    if not spec.momentum_corrected:
        _refused(_cfg(name, momentum_correction=True), "grad_sync.momentum_correction")
    if not spec.freezes_variance:
        _refused(_cfg(name, freeze_variance=True), "grad_sync.freeze_variance")
    # The whole config: its example validates on a mesh with data replicas; a per-hop ring only
    # where the spec has a codec.
    c = tiny_gpt_config(data=R)
    for k, v in {**spec.example, "compression": name}.items():
        c.grad_sync[k] = v
    config_lib.validate(c, R)
    c.grad_sync.algorithm = "ring"
    if spec.per_hop is None and name != "none":  # 'none' is the exact ring itself
        with pytest.raises(ConfigError, match="does not combine") as e:
            config_lib.validate(c, R)
        assert "\n" not in str(e.value)
    elif not spec.per_hop_unsupported(c.grad_sync):
        config_lib.validate(c, R)


# --------------------------------------------------------------------------------------------------
# randk: the same coordinates on every replica, scaled or fed back


@pytest.mark.parametrize("error_feedback", [True, False])
def test_randk_sends_k_shared_coordinates(error_feedback):
    ratio = 0.25
    tx = C.randk("data", ratio, error_feedback=error_feedback)
    g = _grads(70)
    ((out, old, new),) = _run(tx, [g])
    for k, s in SHAPES.items():
        n = int(np.prod(s))
        kk = C.topk_k(ratio, n)
        sent = out[k].reshape(-1) != 0
        assert sent.sum() == kk, (k, sent.sum(), kk)
        scale = 1.0 if error_feedback else n / kk
        mean = g[k].mean(0).reshape(-1)
        np.testing.assert_allclose(out[k].reshape(-1)[sent], mean[sent] * scale, rtol=1e-6)
        if error_feedback:  # each replica keeps exactly what it did not send
            res = new.residual[k].reshape(R, -1)
            np.testing.assert_array_equal(res[:, sent], 0)
            np.testing.assert_array_equal(res[:, ~sent], g[k].reshape(R, -1)[:, ~sent])
        else:
            assert new.residual is None
    assert int(new.count[0]) == 1


def test_randk_draws_new_coordinates_each_step():
    tx = C.randk("data", 0.25)
    runs = _run(tx, [_grads(80), _grads(81)])
    masks = [out["w"] != 0 for out, _, _ in runs]
    assert (masks[0] != masks[1]).any()


def test_randk_sends_every_tensor_in_one_all_reduce():
    """Every tensor's (and every stacked layer's) k values go in one f32 all-reduce
    (`replica.pmean_flat`), beside the step's 4-byte pmax and the loss's mean, where a pmean per
    tensor runs on XLA:CPU as one gloo call per array; the bytes are the k values'."""
    from jaxdist import hlo_cost

    shapes = {"a": (13, 7), "c": (2, 8, 6), "v": (5,)}
    params = {k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()}
    tx = C.randk("data", 0.25, batch_dims={"a": 0, "c": 1, "v": 0})
    step = jax.jit(sync_grads(_identity_grad_fn, tx, MESH, "data"))
    state = C.init_global(tx, params, MESH, "data")
    text = step.lower(params, _grads(9, shapes=shapes), state).compile().as_text()
    reduces = [op for op in hlo_cost.collective_ops(text) if op.kind == "all-reduce"]
    k = C.topk_k(0.25, 13 * 7) + 2 * C.topk_k(0.25, 8 * 6) + C.topk_k(0.25, 5)
    assert sum(op.buffers for op in reduces) == 3, [
        (op.buffers, op.bytes_per_exec) for op in reduces
    ]
    assert sum(op.bytes_per_exec for op in reduces) == 4 * k + 4 + 4


def test_randk_converges_like_none():
    """The least-squares problem of test_compressors_converge_like_none, 150 SGD steps: unbiased
    random-k at 10% and error-feedback random-k at 25% end within 5% of `none` (docs/COMPRESSION.md;
    error feedback at 10% lags: each coordinate is sent every ~10 steps, 5.3 against 1.87)."""
    from tests.test_compression import _final_loss, _least_squares

    batch = _least_squares()
    base = _final_loss(C.none("data"), batch)
    for tx in (C.randk("data", 0.1, error_feedback=False), C.randk("data", 0.25)):
        loss = _final_loss(tx, batch)
        assert abs(loss - base) <= 0.05 * base, (loss, base)


# --------------------------------------------------------------------------------------------------
# The planner prices every registered compressor through its spec, and the price is what compiles


def _planner_config(name: str):
    c = tiny_gpt_config(data=8, fsdp=1, tensor=1)
    for k, v in _cfg(name).items():
        c.grad_sync[k] = v
    return c


def _needs_warmup(name: str) -> bool:
    """Refused without a dense warm-up: its compiled step holds the warm-up branch too, which the
    HLO reader charges at its dense cost, so the steady-state price is checked against the
    compressor's own compiled exchange (`test_wire_bytes_match_the_spec`) instead."""
    try:
        config_lib.validate(_planner_config(name), 8)
    except ConfigError as e:
        assert "warmup_steps" in str(e), (name, str(e))  # no other refusal hides a compressor
        return True
    return False


def test_only_warmup_compressors_are_left_to_the_exchange_test():
    assert {n for n in NAMES if _needs_warmup(n)} <= {
        n for n in NAMES if C.COMPRESSORS[n].preconditioner or C.COMPRESSORS[n].freezes_variance
    } | {n for n in NAMES if C.COMPRESSORS[n].deprecated_for}


@pytest.mark.parametrize("name", [n for n in NAMES if not _needs_warmup(n)])
def test_planner_prices_it_as_the_compiled_step_sends(name):
    """data=8 on the tiny GPT: the planner's gradient-sync bytes (its spec's `wire_bytes`, no
    planner edit per compressor) within 5% of what the compiled train step's HLO sends."""
    from jaxdist import loop, plan
    from tests.helpers import engine_for

    c = _planner_config(name)
    eng, batches = engine_for(c)
    dtypes = {"inputs": np.int32, "targets": np.int32}
    compiled = eng.train_step.lower(
        eng.abstract_state, eng.abstract_batch(batches.global_shapes(), dtypes)
    ).compile()
    hlo = sum(loop.layout_record(eng, compiled, c)["collective_bytes_per_step"].values())
    predicted = sum(plan.predict(c, hw="cpu_here", num_devices=8).collective_bytes.values())
    assert abs(predicted - hlo) <= 0.05 * hlo, (name, predicted, hlo)
