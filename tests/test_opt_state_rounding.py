"""Stochastic rounding of bfloat16 optimizer moments (`train.opt_state_rounding=stochastic`):
unbiased, one of the two neighbours, a function of the step alone, independent of the sharding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist import config as config_lib
from jaxdist import optim
from jaxdist.errors import ConfigError
from tests.helpers import engine_for, initial_state, tiny_gpt_config


def _neighbours(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The bfloat16 values just below and just above |x| (float32, with x's sign)."""
    down = np.asarray(jnp.asarray(np.abs(x)).astype(jnp.float32))
    lo = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(down), jnp.uint32)) & 0xFFFF0000
    lo = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(lo, jnp.uint32), jnp.float32))
    hi = np.asarray(jnp.nextafter(jnp.asarray(lo, jnp.bfloat16), jnp.bfloat16(jnp.inf)), np.float32)
    return np.sign(x) * lo, np.sign(x) * hi


@pytest.mark.parametrize("frac", [0.1, 0.5, 0.93])
@pytest.mark.parametrize("base", [1.0, -3.7e-6, 2.5e5])
def test_rounding_is_unbiased_and_picks_a_neighbour(frac, base):
    """Many roundings of a value `frac` of the way between two bfloat16 neighbours: each result is
    one of them, and their mean is the value within 5 standard errors of a fair coin."""
    lo, hi = _neighbours(np.array([base], np.float32))
    lo, hi = float(lo[0]), float(hi[0])
    x = np.float32(lo + frac * (hi - lo))
    n = 200_000
    r = optim.stochastic_round_bf16(jnp.full((n,), x), jax.random.key(7))
    assert r.dtype == jnp.bfloat16
    got = np.asarray(r, np.float32)
    assert set(np.unique(got)) <= {np.float32(lo), np.float32(hi)}
    p = (x - lo) / (hi - lo)
    stderr = abs(hi - lo) * np.sqrt(p * (1 - p) / n)
    assert abs(got.astype(np.float64).mean() - x) < 5 * stderr


def test_exact_values_and_non_finite_are_kept():
    x = jnp.array([0.0, 1.0, -2.0, 0.5078125, jnp.inf, -jnp.inf, jnp.nan], jnp.float32)
    r = np.asarray(optim.stochastic_round_bf16(x, jax.random.key(0)), np.float32)
    np.testing.assert_array_equal(r, np.asarray(x))  # nan == nan under assert_array_equal


def test_sharded_rounding_equals_one_device():
    """The same key rounds a sharded array bit-identically to the whole array on one device."""
    x = jax.random.normal(jax.random.key(1), (64, 48), jnp.float32)
    key = jax.random.key(3)
    one = optim.stochastic_round_bf16(x, key)
    mesh = jax.make_mesh((4, 2), ("a", "b"), devices=jax.devices()[:8])
    sh = NamedSharding(mesh, P("a", "b"))
    sharded = jax.jit(optim.stochastic_round_bf16, out_shardings=sh)(jax.device_put(x, sh), key)
    assert sharded.sharding.is_equivalent_to(sh, 2)
    np.testing.assert_array_equal(np.asarray(sharded), np.asarray(one))


def _adam_sr():
    return optim.with_state_dtype(optax.adam(1e-2, b1=0.9, b2=0.95), "bfloat16", "stochastic")


def test_rounding_is_a_function_of_the_step():
    """Same state and gradient: bit-identical moments; the next count: other random bits."""
    tx = _adam_sr()
    params = {"w": jnp.ones((256,)), "b": jnp.zeros((3, 5))}
    grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(2), p.shape) * 1e-3, params)
    state = tx.init(params)
    assert isinstance(state, optim.StochasticRoundState) and int(state.count) == 0
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(state.inner) if x.ndim)
    update = jax.jit(tx.update)
    (_, a), (_, b) = update(grads, state, params), update(grads, state, params)
    assert int(a.count) == 1
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    _, c = update(grads, state._replace(count=jnp.int32(1)), params)
    mu_a, mu_c = (np.asarray(s.inner[0].mu["w"], np.float32) for s in (a, c))
    assert (mu_a != mu_c).any()  # another step, other roundings of the same float32 moment


def test_bad_rounding_is_refused_in_one_line():
    c = tiny_gpt_config(data=1)
    c.train.opt_state_rounding = "stochastic"  # with float32 moments: nothing to round
    with pytest.raises(ConfigError, match="opt_state_dtype=bfloat16"):
        config_lib.validate(c, 1)
    c.train.opt_state_dtype, c.train.opt_state_rounding = "bfloat16", "up"
    with pytest.raises(ConfigError, match="choose one of nearest, stochastic"):
        config_lib.validate(c, 1)


def _run(c, steps: int = 4):
    eng, batches = engine_for(c)
    state, losses = initial_state(eng, c), []
    for i in range(steps):
        state, m = eng.train_step(state, batches.get(i))
        losses.append(float(m["loss"]))
    return np.array(losses), jax.device_get(eng.to_user(state))


def _sr_config(**mesh):
    c = tiny_gpt_config(**mesh)
    c.train.opt_state_dtype, c.train.opt_state_rounding = "bfloat16", "stochastic"
    return c


def _ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """How many bfloat16 values apart a and b (bfloat16 values held as float32) are."""

    def ordered(x):
        bits = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.bfloat16), jnp.uint16))
        mag = (bits & 0x7FFF).astype(np.int64)
        return np.where(bits & 0x8000, -mag, mag)

    return np.abs(ordered(a) - ordered(b))


def test_sharded_training_equals_one_device():
    """AdamW with stochastically rounded bf16 moments, data 2 × fsdp 2 × tensor 2 against one
    device over 4 steps. The float32 moments agree to ~1e-7 before each rounding and the random
    bits are the same, so a moment element ends up equal, or, where the two straddled a threshold
    of the shared bits (few elements: at most 1%), a bfloat16 gap apart: one value apart for the
    second moment (a sum of squares), but where its gradient cancels to ~2^-20 of the leaf's
    largest: there the two float32 gradients, which agree to float32 rounding of the summed terms,
    not of the small result, may differ by more than a bfloat16 gap of their squares (on an AMD EPYC
    machine with AVX2, one embedding element of nu ended two values apart, the gap 2^-38.8 of the
    leaf's largest); for the first, whose gap may be carried and grow by one per
    step, within 4 steps × 2^-8 of the leaf's largest value (near zero, where g's cancel, that is
    many bfloat16 values). Such a moment moves its parameter's Adam step (at most ~lr) by about
    2^-8 of it per step, so the parameters agree within 1e-5 but for those few elements, which
    stay within 4 × lr × 2^-8 = lr · 2^-6. (Rounding to nearest has the same kind of gaps.)"""
    c = _sr_config(data=1)
    ref_losses, ref = _run(c)
    losses, got = _run(_sr_config(data=2, fsdp=2, tensor=2))
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    assert losses[-1] < losses[0]
    assert int(got["opt_state"][1].count) == int(ref["opt_state"][1].count) == 4

    def compare(pairs, close, differs):
        differ = total = 0
        for a, b in pairs:
            assert close(a, b).all()
            differ, total = differ + int(differs(a, b).sum()), total + a.size
        assert differ <= 0.01 * total, (differ, total)

    adam = (got["opt_state"][1].inner[0], ref["opt_state"][1].inner[0])
    mu, nu = (
        [(np.asarray(a, np.float32), np.asarray(b, np.float32)) for a, b in zip(*trees)]
        for trees in zip(*((jax.tree.leaves(s.mu), jax.tree.leaves(s.nu)) for s in adam))
    )
    assert len(mu) == len(nu) == len(jax.tree.leaves(ref["params"]))
    assert all(b.dtype == jnp.bfloat16 for b in jax.tree.leaves(adam[0]) if b.ndim)
    compare(
        nu,
        lambda a, b: (_ulps(a, b) <= 1) | (np.abs(a - b) <= 2**-20 * np.abs(b).max()),
        lambda a, b: a != b,
    )
    compare(mu, lambda a, b: np.abs(a - b) <= 2**-6 * np.abs(b).max(), lambda a, b: a != b)
    lr = c.train.learning_rate
    params = zip(jax.tree.leaves(got["params"]), jax.tree.leaves(ref["params"]), strict=True)
    compare(params, lambda a, b: np.abs(a - b) <= lr * 2**-6, lambda a, b: np.abs(a - b) > 1e-5)
