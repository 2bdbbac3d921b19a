"""jaxdist/aligned_switch.py: stages taking different branches that run different numbers of
collective-permutes, followed by a permute between the stages (a pipeline conveyor).

The smallest program that shows why it exists: on a 2 (stages `x`) × 2 (`c`) × 2 mesh, stage
x takes branch (x + t) % 2 at tick t: branch 0 permutes over `c` once, branch 1 twice; then every
device sends to the other stage. XLA:CPU pairs the permutes by arrival order, so with
`jax.lax.switch` the conveyor of one stage meets the second `c` permute of the other and the values
are wrong; `aligned_switch.switch` equals the same computation with both branches run on every
device and the result selected (no collective in a branch).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxdist import aligned_switch

RING = [(0, 1), (1, 0)]


def _once(v):
    return jax.lax.ppermute(v, "c", RING) * 2.0


def _twice(v):
    return jax.lax.ppermute(jnp.sin(jax.lax.ppermute(v, "c", RING)) + 1.0, "c", RING)


@functools.cache
def _run(how: str) -> np.ndarray:
    mesh = jax.make_mesh((2, 2, 2), ("x", "c", "d"), axis_types=(jax.sharding.AxisType.Auto,) * 3)

    def body(v):
        def tick(v, t):
            k = (jax.lax.axis_index("x") + t) % 2
            if how == "select":
                y = jnp.where(k == 0, _once(v), _twice(v))
            else:
                switch = aligned_switch.switch if how == "aligned" else jax.lax.switch
                y = switch(k, [_once, _twice], v)
            y = y + jax.lax.ppermute(y * 0.3, "x", RING)  # the conveyor between the stages
            return y * 0.5 + v * 0.1, None

        return jax.lax.scan(tick, v, jnp.arange(6))[0]

    spec = P(("x", "c", "d"))
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    return np.asarray(fn(jnp.arange(32, dtype=jnp.float32).reshape(8, 4) / 10))


def test_aligned_switch_equals_the_unconditional_program():
    """Padded to two permutes in both branches: the values of the select program (exact: the same
    operations on the same values)."""
    np.testing.assert_array_equal(_run("aligned"), _run("select"))


@pytest.mark.xfail(
    strict=True,
    reason="XLA:CPU pairs collective-permutes by arrival order: with 1 and 2 permutes in the "
    "branches, one stage's conveyor meets the other's second permute (jaxdist/aligned_switch.py)",
)
def test_plain_switch_with_unequal_permutes_is_wrong_on_cpu():
    np.testing.assert_allclose(_run("switch"), _run("select"), rtol=0, atol=1e-5)


def test_permutes_counts_scans_and_calls():
    """`permutes`: one per ppermute, times a scan's length, through jit calls and remat."""
    mesh = jax.make_mesh((2, 4), ("c", "d"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def body(v):
        hop = jax.checkpoint(lambda v: jax.lax.ppermute(v, "c", RING))
        v = jax.jit(_twice)(v)
        return jax.lax.scan(lambda v, _: (hop(v), None), v, None, length=3)[0]

    fn = jax.shard_map(body, mesh=mesh, in_specs=P("c"), out_specs=P("c"))
    jaxpr = jax.make_jaxpr(fn)(jnp.zeros((8, 2))).jaxpr
    count, (_, pairs) = aligned_switch.permutes(jaxpr)
    assert (count, pairs) == (2 + 3, tuple(RING))
