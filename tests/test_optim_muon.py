"""Muon (jaxdist/muon.py) against optax.contrib.muon and torch.optim.Muon, sharded against one device,
its all-gathers in the compiled step; the optimizer specs (jaxdist/optim.py) and bf16 moments.

Convention differences between the references, each tested on both sides:
- momentum: torch (and Keller Jordan's original) keep m ← βm + (1−β)g uncorrected; optax divides
  by (1 − βᵗ) (`train.muon.bias_correction=True`). The Newton–Schulz input is normalised, so the
  first step agrees either way, and so does every step without Nesterov (the correction is then a
  scale of m); with Nesterov they differ from the second step on.
- Newton–Schulz precision: torch runs it in bfloat16; jaxdist in float32. The torch comparisons
  run torch's own step with that one cast made a no-op (`_torch_ns_in_float32`).
- AdamW half: optax's is NAdamW (its `nesterov` flag drives both halves) and decays with
  `adam_weight_decay`; the mixed-tree comparison runs both with nesterov=False and no decay.
- scale and weight decay agree: √max(1, fan_out/fan_in), and p ← p − lr·wd·p − lr·scale·O.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxdist import config as config_lib
from jaxdist import hlo_cost, muon, optim, plan
from jaxdist.errors import ConfigError
from tests.helpers import compile_step, engine_for, tiny_gpt_config, train_steps

LR, WD = 0.02, 0.1

# A tree like a model's: stacked block matrices of three shapes (one [L, heads, kv, embed]) and the
# AdamW parameters (embedding, norm scale, router).
AXES = {
    "blocks": {
        "w_up": ("layers", "embed", "mlp"),
        "w_down": ("layers", "mlp", "embed"),
        "wo": ("layers", "heads", "kv", "embed"),
        "norm": ("layers", "embed"),
        "router": ("layers", "embed", None),
    },
    "embed": ("vocab", "embed"),
}
SHAPES = {
    "blocks": {
        "w_up": (2, 16, 40),
        "w_down": (2, 40, 16),
        "wo": (2, 4, 6, 16),
        "norm": (2, 16),
        "router": (2, 16, 4),
    },
    "embed": (32, 16),
}
MUON_ONLY = ("w_up", "w_down", "wo")


def _tree(shapes, key):
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda s: isinstance(s, tuple))
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(
        treedef, [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, leaves)]
    )


def _only(tree, names):
    return {"blocks": {k: v for k, v in tree["blocks"].items() if k in names}}


def _grads(shapes, steps):
    return [_tree(shapes, jax.random.key(100 + i)) for i in range(steps)]


def _run(tx, params, grads):
    state = tx.init(params)
    step = jax.jit(tx.update)
    for g in grads:
        updates, state = step(g, state, params)
        params = optax.apply_updates(params, updates)
    return params


def _ours(axes, **fields):
    spec = optim.Muon(**{"b1": 0.9, "b2": 0.999, "weight_decay": WD, **fields})
    return spec.build(optax.constant_schedule(LR), axes)


def _max_diff(a, b):
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(*map(jax.tree.leaves, (a, b)))
    )


def _optax_dims(axes):
    def one(ax):
        d = muon.matrix_dims(ax)
        return None if d is None else optax.contrib.MuonDimensionNumbers(d.rows, d.cols)

    return jax.tree.map(one, axes, is_leaf=lambda x: isinstance(x, tuple))


def test_the_parameter_rule_from_logical_axes():
    mask = muon.muon_mask(AXES)
    assert mask == {
        "blocks": {"w_up": True, "w_down": True, "wo": True, "norm": False, "router": False},
        "embed": False,
    }
    assert muon.matrix_dims(("layers", "embed", None, "heads", "kv")) == ((0,), (1,), (2, 3, 4))
    assert muon.matrix_dims(("layers", "experts", "mlp", "embed")) == ((0, 1), (2,), (3,))
    assert muon.matrix_dims(("embed", "vocab")) is None  # the head
    assert muon.matrix_dims(("embed", "mlp")) is None  # outside the stacked blocks


@pytest.mark.parametrize("steps", [1, 10])
def test_equals_optax_contrib_muon(steps):
    """Muon half (three stacked shapes, Nesterov, decoupled decay): bias_correction=True is optax."""
    axes, shapes = _only(AXES, MUON_ONLY), _only(SHAPES, MUON_ONLY)
    params, grads = _tree(shapes, jax.random.key(0)), _grads(shapes, steps)
    ref = optax.contrib.muon(
        LR, beta=0.95, weight_decay=WD, muon_weight_dimension_numbers=_optax_dims(axes)
    )
    want = _run(ref, params, grads)
    got = _run(_ours(axes, bias_correction=True), params, grads)
    assert _max_diff(got, want) < 1e-5
    # The other side of the convention: uncorrected momentum differs from the second step on.
    other = _run(_ours(axes, bias_correction=False), params, grads)
    assert (_max_diff(other, want) > 1e-4) == (steps > 1)


@pytest.mark.parametrize("steps", [1, 10])
def test_equals_optax_on_the_mixed_tree(steps):
    """Muon and AdamW halves split by the logical-axes rule, as optax's partition with the same
    labels; optax's AdamW half is NAdamW unless nesterov=False, so both run without."""
    params, grads = _tree(SHAPES, jax.random.key(1)), _grads(SHAPES, steps)
    ref = optax.contrib.muon(
        LR,
        beta=0.95,
        nesterov=False,
        adam_b1=0.9,
        adam_b2=0.999,
        muon_weight_dimension_numbers=_optax_dims(AXES),
    )
    ours = _ours(AXES, nesterov=False, bias_correction=True, weight_decay=0.0)
    assert _max_diff(_run(ours, params, grads), _run(ref, params, grads)) < 1e-5


@contextlib.contextmanager
def _torch_ns_in_float32():
    """torch.optim.Muon casts the Newton–Schulz input to bfloat16; keep it float32 instead."""
    import torch

    with mock.patch.object(torch.Tensor, "bfloat16", lambda self: self.clone()):
        yield


def _torch_muon(params, grads, axes, *, nesterov, float32=True):
    """torch.optim.Muon on each [fan_out, fan_in] matrix (torch's Linear layout) of each layer."""
    import torch

    mats = {}
    for name, p in params["blocks"].items():
        d = muon.matrix_dims(axes["blocks"][name])
        for layer in range(p.shape[0]):
            w = muon.to_matrices(p, d)[layer].T  # [fan_out, fan_in]
            mats[(name, layer)] = torch.nn.Parameter(torch.tensor(np.array(w)))
    opt = torch.optim.Muon(
        list(mats.values()), lr=LR, weight_decay=WD, momentum=0.95, nesterov=nesterov
    )
    ctx = _torch_ns_in_float32 if float32 else contextlib.nullcontext
    for g in grads:
        for (name, layer), w in mats.items():
            d = muon.matrix_dims(axes["blocks"][name])
            w.grad = torch.tensor(np.array(muon.to_matrices(g["blocks"][name], d)[layer].T))
        with ctx():
            opt.step()
    out = {}
    for name, p in params["blocks"].items():
        d = muon.matrix_dims(axes["blocks"][name])
        m = np.stack([mats[(name, layer)].detach().numpy().T for layer in range(p.shape[0])])
        out[name] = muon.from_matrices(jnp.asarray(m), d, p.shape)
    return {"blocks": out}


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("steps", [1, 10])
def test_equals_torch_optim_muon(steps, nesterov):
    axes, shapes = _only(AXES, MUON_ONLY), _only(SHAPES, MUON_ONLY)
    params, grads = _tree(shapes, jax.random.key(2)), _grads(shapes, steps)
    want = _torch_muon(params, grads, axes, nesterov=nesterov)
    got = _run(_ours(axes, nesterov=nesterov), params, grads)
    assert _max_diff(got, want) < 1e-5
    # optax's side of the momentum convention differs from torch from the second step on, with
    # Nesterov; without, the correction is a scale of m that the normalisation removes.
    other = _run(_ours(axes, nesterov=nesterov, bias_correction=True), params, grads)
    assert (_max_diff(other, want) > 1e-4) == (steps > 1 and nesterov)


def test_torch_default_runs_newton_schulz_in_bfloat16():
    """The precision convention is real: torch's unpatched bf16 iteration is further off."""
    axes, shapes = _only(AXES, MUON_ONLY), _only(SHAPES, MUON_ONLY)
    params, grads = _tree(shapes, jax.random.key(2)), _grads(shapes, 1)
    got = _run(_ours(axes), params, grads)
    assert _max_diff(got, _torch_muon(params, grads, axes, nesterov=True, float32=False)) > 1e-4


# --------------------------------------------------------------------------------------------------
# Sharded training equals one device (4 steps, float32).


def _muon(c, **fields):
    c.train.optimizer = "muon"
    for k, v in fields.items():
        c.train.muon[k] = v
    return c


def _assert_same(c, ref, steps: int = 4, adamw_atol: float = 1e-5):
    """Losses and every Muon parameter within 1e-5 of one device; the AdamW half's within
    `adamw_atol` (see test_expert_equals_one_device)."""
    ref_losses, ref_params = ref
    losses, params = train_steps(c, steps)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    assert losses[-1] < losses[0]
    eng, _ = engine_for(c)
    mask = jax.tree.leaves(muon.muon_mask(eng.param_axes))
    flat = jax.tree_util.tree_leaves_with_path(params)
    assert any(mask)
    for (path, a), b, use in zip(flat, jax.tree.leaves(ref_params), mask, strict=True):
        atol = 1e-5 if use else adamw_atol
        np.testing.assert_allclose(a, b, rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path))


@functools.cache
def _gpt_one_device(layers: int = 2):
    c = _muon(tiny_gpt_config(data=1))
    c.model.num_layers = layers
    return train_steps(c, 4)


@pytest.mark.parametrize("distribution", muon.DISTRIBUTIONS)
def test_data_fsdp_tensor_equals_one_device(distribution):
    _assert_same(
        _muon(tiny_gpt_config(data=2, fsdp=2, tensor=2), distribution=distribution),
        _gpt_one_device(),
    )


def test_pipeline_1f1b_equals_one_device():
    c = _muon(tiny_gpt_config(pipeline=2, data=2, fsdp=2))
    c.pipeline.schedule, c.pipeline.microbatches = "1f1b", 2
    _assert_same(c, _gpt_one_device())


def _moe(**mesh):
    from tests.test_moe import moe_config

    c = _muon(moe_config(0.0, **mesh))
    c.train.learning_rate = 0.02  # moe_config's 0.5 is for its SGD
    return c


def test_expert_equals_one_device():
    """The expert matrices (Muon) within 1e-5. The embedding and head are AdamW's: its first update
    lr·g/(|g| + 1e-8) turns the ~1e-9 layout differences of near-zero gradients (rare tokens) into
    ~1e-5 (tests/test_llama.py trains with SGD for that reason), so they are held to 1e-4."""
    _assert_same(_moe(expert=2, fsdp=2, tensor=2), train_steps(_moe(), 4), adamw_atol=1e-4)


def test_grad_accum_equals_one_batch():
    c = _muon(tiny_gpt_config(data=2, fsdp=2))
    c.train.grad_accum = 2
    _assert_same(c, _gpt_one_device())


@pytest.mark.parametrize("compression", ["bf16", "int8", "powersgd"])
def test_composes_with_full_gradient_compressors(compression):
    c = _muon(tiny_gpt_config(data=4))
    c.grad_sync.compression = compression
    losses, params = train_steps(c, 4)
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


@pytest.mark.parametrize("compression", ["topk", "ef_sign"])
def test_partial_gradient_compressors_are_refused_in_one_line(compression):
    c = _muon(tiny_gpt_config(data=4))
    c.grad_sync.compression = compression
    with pytest.raises(ConfigError, match=f"compression='{compression}' sends only part") as e:
        config_lib.validate(c, 4)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "field, value, want",
    [
        ("distribution", "shards", "train.muon.distribution='shards' is not valid"),
        ("ns_steps", 0, "train.muon.ns_steps=0 must be a positive integer"),
        ("momentum", 1.0, r"train.muon.momentum=1.0 must be in \[0, 1\)"),
    ],
)
def test_bad_muon_fields_are_one_line(field, value, want):
    c = _muon(tiny_gpt_config(data=1), **{field: value})
    with pytest.raises(ConfigError, match=want):
        config_lib.validate(c, 1)


# --------------------------------------------------------------------------------------------------
# The distribution in the compiled step: the all-gathers it adds and their bytes.


def _all_gather_bytes(c) -> float:
    _, compiled = compile_step(c)
    return hlo_cost.collective_bytes(compiled.as_text()).get("all-gather", 0.0)


def test_gather_adds_one_all_gather_per_matrix_of_the_declared_bytes():
    """fsdp=2 × tensor=2 × data=2: the all-gather bytes of Muon (gather) minus AdamW's equal the
    spec's `wire_bytes` hook summed over the parameters: the momentum of every block matrix,
    gathered whole over fsdp × tensor."""
    mesh = dict(data=2, fsdp=2, tensor=2)
    base = tiny_gpt_config(**mesh)
    extra = _all_gather_bytes(_muon(tiny_gpt_config(**mesh))) - _all_gather_bytes(base)
    eng, _ = engine_for(_muon(tiny_gpt_config(**mesh)))
    spec = optim.spec(eng.config.train)
    sizes = {k: int(v) for k, v in eng.mesh.shape.items()}
    declared = sum(
        spec.wire_bytes(x.shape, a, sizes)
        for x, a in zip(
            jax.tree.leaves(eng.abstract_state["params"]),
            jax.tree.leaves(eng.param_axes, is_leaf=lambda x: isinstance(x, tuple)),
        )
    )
    assert declared > 0
    assert extra == pytest.approx(declared, rel=1e-6)


def test_planner_prices_muons_gathers_as_the_compiled_step_sends():
    """The planner reads the optimizer spec's `wire_bytes` (plan/terms.optimizer_terms, no
    optimizer named there): its all-gather bytes for Muon at data=2 × fsdp=2 × tensor=2 equal the
    compiled step's."""
    c = _muon(tiny_gpt_config(data=2, fsdp=2, tensor=2))
    predicted = plan.predict(c, hw="cpu_here", num_devices=8).collective_bytes["all-gather"]
    assert predicted == pytest.approx(_all_gather_bytes(c), rel=0.01)


# --------------------------------------------------------------------------------------------------
# Specs and bf16 moments.


def test_spec_defaults_are_the_schema():
    train = config_lib.base_config().train
    for name, cls in optim.OPTIMIZERS.items():
        if cls.section:
            assert dict(train[cls.section]) == cls.defaults(), name
        for f in (f.name for f in dataclasses.fields(cls)):
            key = optim.CONFIG_KEYS.get(f, f)
            assert key in (train[cls.section] if f in cls.own else train), (name, f)


def _opt_bytes(eng) -> int:
    return sum(
        int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
        for x in jax.tree.leaves(eng.abstract_state["opt_state"])
    )


@pytest.mark.parametrize("optimizer", sorted(optim.OPTIMIZERS))
@pytest.mark.parametrize("dtype", optim.STATE_DTYPES)
def test_state_bytes_hook_is_the_state(optimizer, dtype):
    """The planner's hook (moments × itemsize per parameter) = the state the step carries, less
    its scalar counters."""
    c = tiny_gpt_config(data=1)
    c.train.optimizer, c.train.opt_state_dtype = optimizer, dtype
    eng, _ = engine_for(c)
    spec = optim.spec(c.train)
    params = jax.tree.leaves(eng.abstract_state["params"])
    axes = jax.tree.leaves(eng.param_axes, is_leaf=lambda x: isinstance(x, tuple))
    hook = sum(x.size * spec.state_bytes_per_param(a) for x, a in zip(params, axes))
    scalars = sum(
        x.dtype.itemsize for x in jax.tree.leaves(eng.abstract_state["opt_state"]) if x.ndim == 0
    )
    assert _opt_bytes(eng) - scalars == hook


def test_bf16_moments_halve_adamw_state_in_the_compiled_step():
    """memory_analysis of the compiled step: arguments shrink by 4 bytes per parameter (AdamW's two
    moments, 8 -> 4 bytes), per device at fsdp=2 as on one."""
    for mesh in (dict(data=1), dict(fsdp=2)):
        sizes = {}
        for dtype in optim.STATE_DTYPES:
            c = tiny_gpt_config(**mesh)
            c.train.opt_state_dtype = dtype
            eng, compiled = compile_step(c)
            sizes[dtype] = (compiled.memory_analysis().argument_size_in_bytes, _opt_bytes(eng))
        n_local = sum(
            int(np.prod(x.sharding.shard_shape(x.shape)))
            for x in jax.tree.leaves(eng.abstract_state["params"])
        )
        (arg32, opt32), (arg16, opt16) = sizes["float32"], sizes["bfloat16"]
        assert arg32 - arg16 == 4 * n_local
        assert opt32 - opt16 == 4 * n_local


def test_bf16_moments_train_close_to_float32():
    c32 = _muon(tiny_gpt_config(data=1))
    c16 = _muon(tiny_gpt_config(data=1))
    c16.train.opt_state_dtype = "bfloat16"
    (l32, _), (l16, _) = train_steps(c32, 4), train_steps(c16, 4)
    assert l16[-1] < l16[0]
    np.testing.assert_allclose(l16, l32, rtol=1e-2)
