"""Mixture of experts in the Llama family (models/moe.py) and the `expert` mesh axis: expert
parallel training equals one device, dropless equals capacity when nothing drops, the router
losses and the all-to-all bytes are what the formulas say."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist import config as config_lib
from jaxdist import hlo_cost
from jaxdist.errors import ConfigError
from models import llama, moe
from tests.helpers import compile_step, engine_for, train_steps
from tests.test_llama import llama_config

E, K = 8, 2


def moe_config(capacity_factor: float = 0.0, **mesh_sizes):
    c = llama_config(**mesh_sizes)
    c.model.num_experts, c.model.experts_per_token = E, K
    c.model.moe_capacity_factor = capacity_factor
    c.model.mlp_dim = 64
    return c


@functools.cache
def _one_device():
    return train_steps(moe_config(), 4)


def _assert_same_training(c, steps: int = 4):
    ref_losses, ref_params = _one_device()
    losses, params = train_steps(c, steps)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    assert losses[-1] < losses[0]
    flat = jax.tree_util.tree_leaves_with_path(params)
    for (path, a), b in zip(flat, jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize(
    "mesh, factor",
    [
        (dict(expert=4, data=2), E / K),  # capacity = every local token: nothing can drop
        (dict(expert=4, data=2), 0.0),  # dropless over expert parallelism: padded to n
        (dict(expert=1), E / K),  # one device, capacity path vs the dropless ragged_dot path
    ],
)
def test_matches_one_device_dropless(mesh, factor):
    """Four SGD steps: losses and parameters within 1e-5 of the one-device dropless run."""
    _assert_same_training(moe_config(factor, **mesh))


def test_composes_with_fsdp_tensor_context():
    """expert=2 × fsdp=2 × tensor=2, and expert=2 × context=2 × data=2, train like one device."""
    _assert_same_training(moe_config(E / K, expert=2, fsdp=2, tensor=2))
    _assert_same_training(moe_config(0.0, expert=2, context=2, data=2))


def test_load_balancing_and_z_loss_by_hand():
    """route()'s losses against numpy: E·Σ f_e·P_e and mean(logsumexp²)."""
    rng = np.random.default_rng(0)
    h = rng.normal(size=(2, 5, 6)).astype(np.float32)
    router = rng.normal(size=(6, 4)).astype(np.float32)
    w, idx, stats = moe.route(jnp.asarray(h), jnp.asarray(router), 2)
    logits = h.reshape(-1, 6) @ router
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.argsort(-p, axis=-1)[:, :2]
    f = np.array([np.sum(top == e) for e in range(4)]) / top.size
    lb = 4 * np.sum(f * p.mean(0))
    z = np.mean(np.log(np.exp(logits).sum(-1)) ** 2)
    np.testing.assert_allclose(stats["moe_lb_loss"], lb, rtol=1e-6)
    np.testing.assert_allclose(stats["moe_z_loss"], z, rtol=1e-6)
    np.testing.assert_allclose(stats["moe_load"], f, rtol=0, atol=1e-7)
    np.testing.assert_array_equal(np.sort(np.asarray(idx).reshape(-1, 2), -1), np.sort(top, -1))
    top_p = np.take_along_axis(p, top, -1)
    np.testing.assert_allclose(
        np.asarray(w).reshape(-1, 2), top_p / top_p.sum(-1, keepdims=True), rtol=1e-6
    )


def test_dropless_layer_equals_capacity_layer_and_small_capacity_drops():
    """The expert layer alone: ragged_dot dropless == capacity buffers when C = n; a small
    capacity drops assignments and says how many."""
    rng = np.random.default_rng(1)
    n, D, F = 24, 8, 16
    x = jnp.asarray(rng.normal(size=(2, n // 2, D)), jnp.float32)
    ws = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((E, D, F), (E, D, F), (E, F, D))]
    w, idx, _ = moe.route(x, jnp.asarray(rng.normal(size=(D, E)), jnp.float32), K)
    dropless, d0 = moe.experts(x, w, idx, *ws, factor=0.0)
    padded, d1 = moe.experts(x, w, idx, *ws, factor=E / K)
    np.testing.assert_allclose(dropless, padded, rtol=0, atol=1e-5)
    assert int(d0) == int(d1) == 0
    _, dropped = moe.experts(x, w, idx, *ws, factor=0.5)
    counts = np.bincount(np.asarray(idx).reshape(-1), minlength=E)
    C = moe.capacity(n, K, E, 0.5)
    assert int(dropped) == int(np.sum(np.maximum(counts - C, 0))) > 0


def test_all_to_all_bytes_equal_the_formula():
    """Per layer 2 all-to-alls forward and 2 backward of the [E, C, D] buffer, each costed
    (ep − 1)/ep · E·C·D·4 bytes (the layout record's all-to-all rule)."""
    factor = 1.0
    c = moe_config(factor, expert=4, data=2)
    c.model.scan_unroll = c.model.num_layers
    _, compiled = compile_step(c)
    got = hlo_cost.collective_bytes(compiled.as_text()).get("all-to-all", 0.0)
    n = c.train.batch_size // 8 * c.model.seq_len  # tokens per device
    C = moe.capacity(n, K, E, factor)
    ep, D, L = 4, c.model.d_model, c.model.num_layers
    want = 4 * L * (ep - 1) / ep * E * C * D * 4
    assert got == pytest.approx(want, rel=1e-9), (got, want)


def test_metrics_report_load_and_drops():
    """The step's metrics hold each expert's share (summing to 1) and the dropped fraction."""
    c = moe_config(0.5, expert=4, data=2)
    eng, batches = engine_for(c)
    _, m = eng.train_step(eng.init(), batches.get(0))
    loads = [float(m[f"moe_load_{e}"]) for e in range(E)]
    assert sum(loads) == pytest.approx(1.0, abs=1e-5)
    assert 0.0 < float(m["moe_dropped"]) < 1.0
    assert float(m["moe_lb_loss"]) > 0 and float(m["moe_z_loss"]) > 0


def test_flops_count_active_parameters():
    c = moe_config()
    eng, _ = engine_for(c)
    params = eng.abstract_state["params"]
    full = llama.flops_per_token(c.model, params)
    expert_params = sum(math.prod(params["layers"][w].shape) for w in ("e_gate", "e_up", "e_down"))
    c.unlock()
    c.model.experts_per_token = E  # every expert active
    assert llama.flops_per_token(c.model, params) - full == pytest.approx(
        6 * expert_params * (1 - K / E)
    )


@pytest.mark.parametrize(
    "fields, mesh, want",
    [
        (
            dict(num_experts=6),
            dict(expert=4, data=2),
            "model.num_experts=6 must be divisible by mesh.expert=4",
        ),
        (
            dict(experts_per_token=9),
            dict(expert=4, data=2),
            "model.experts_per_token=9 must be an integer in [1, model.num_experts=8]",
        ),
        (dict(num_experts=0), dict(expert=4, data=2), "mesh.expert=4 needs model.num_experts > 0"),
    ],
)
def test_bad_input_is_one_line(fields, mesh, want):
    c = moe_config(**mesh)
    for k, v in fields.items():
        c.model[k] = v
    with pytest.raises(ConfigError) as e:
        config_lib.validate(c, 8)
    assert str(e.value).startswith(want) and "\n" not in str(e.value)


@pytest.mark.slow
def test_checkpoint_restores_across_expert_sizes(tmp_path):
    """Steps 1–4 on expert=4 × data=2, then 5–6 on expert=2 × data=4 (resharded restore of the
    expert weights): the losses equal an uninterrupted expert=4 run within 1e-5."""
    from tests.test_context import train_llama as train
    from tests.test_reshard import losses, mesh_flags

    moe_flags = (
        "--config.model.num_experts=4",
        "--config.model.mlp_dim=32",
        "--config.model.num_kv_heads=2",
    )
    ref, run = tmp_path / "ref", tmp_path / "run"
    train(ref, 6, *moe_flags, *mesh_flags(8, data=2), "--config.mesh.expert=4")
    train(run, 4, *moe_flags, *mesh_flags(8, data=2), "--config.mesh.expert=4")
    proc = train(run, 6, *moe_flags, *mesh_flags(8, data=4), "--config.mesh.expert=2")
    assert "at step 4" in proc.stdout
    want, got = losses(ref), losses(run)
    np.testing.assert_allclose([got[5], got[6]], [want[5], want[6]], rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "fields, kind",
    [
        (dict(mesh=dict(expert=4, data=2), moe=1.0), "all-to-all"),
        (dict(mesh=dict(expert=4, data=2), moe=0.0), "all-to-all"),
        (dict(mesh=dict(context=4, data=2), ring="ring"), "collective-permute"),
        (dict(mesh=dict(context=2, data=4), ring="all_gather"), "all-gather"),
    ],
)
def test_planner_costs_equal_the_compiled_step(fields, kind):
    """The planner's context / expert terms (`plan._context_expert_terms`: ring hops, K/V
    gathers, all-to-all bytes) equal the compiled step's bytes (the layout record's).
    `plan.predict` itself models the GPT only, so the terms are checked directly."""
    from jaxdist import hlo_cost, loop, plan

    if "moe" in fields:
        c = moe_config(fields["moe"], **fields["mesh"])
    else:
        c = llama_config(**fields["mesh"])
        c.model.context_attention = fields["ring"]
    eng, compiled = compile_step(c)
    record = loop.layout_record(eng, compiled, c)["collective_bytes_per_step"]
    sizes = config_lib.resolve_mesh_shape(c.mesh, 8)
    terms = []
    add = lambda name, k, axes, payload, count, hidden: terms.append(
        (k, hlo_cost.ring_wire_bytes(k, payload, math.prod(sizes[a] for a in axes)) * count)
    )
    rows = c.train.batch_size // (sizes["data"] * sizes["fsdp"] * sizes["expert"])
    plan._context_expert_terms(add, c, sizes, rows * c.model.seq_len, 4, c.model.num_layers)
    assert record[kind] > 0
    assert sum(b for k, b in terms if k == kind) == pytest.approx(record[kind], rel=1e-9)


def test_kv_cache_forward_matches_the_model():
    """Generation's cached forward (prefill) gives the training forward's logits for an MoE
    model with a shared expert."""
    from flax import nnx

    c = moe_config()
    c.model.moe_shared_expert = True
    model = llama.Llama(c.model, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 16)), jnp.int32)
    cache = llama.init_cache(c.model, 2, 16)
    got, _ = llama.forward_cached(params, tokens, jnp.zeros((2,), jnp.int32), cache, cfg=c.model)
    np.testing.assert_allclose(got, model(tokens), rtol=0, atol=1e-5)


@pytest.mark.parametrize("mesh", [dict(data=8), dict(expert=4, data=2)])
def test_bf16_over_several_devices_compiles_with_float32_gradient_sums(mesh):
    """In bf16 the experts' weight gradients are summed over the token axes in float32: no bf16
    all-reduce in the compiled step (XLA's CPU backend aborted compiling the bf16 sum: "Invalid
    binary instruction opcode copy"), and two steps train to a finite, falling loss."""
    c = moe_config(0.0, **mesh)
    c.train.compute_dtype = "bfloat16"
    _, compiled = compile_step(c)
    reduces = [line for line in compiled.as_text().splitlines() if "all-reduce(" in line]
    assert reduces and not [r for r in reduces if "= bf16[" in r], reduces
    losses, _ = train_steps(c, 2)
    assert np.all(np.isfinite(losses)) and losses[1] < losses[0]
