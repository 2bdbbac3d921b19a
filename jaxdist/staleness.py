"""Bounded staleness: the update at step t applies the reduced gradient of step t - tau.

`grad_sync.staleness = tau` (0 = synchronous) keeps the last tau reduced gradients in the train
state (`state["in_flight"]`, [tau, ...] per parameter, sharded like it, so checkpoints carry them
and a resumed run continues bit-exactly). Each step computes and reduces its gradient, pushes it
onto the queue and applies the oldest one: inside one program the reduction of step t has tau
steps of compute to hide behind (tau = 1 is the "delayed gradient" / overlap case, larger tau
emulates stale-synchronous parallel with a fixed delay).

The first tau steps have no gradient old enough to apply: the optimizer is held (no update, its
state and schedule count unchanged) while the queue fills, so a run with staleness tau is a run
with staleness 0 shifted by tau steps in its first updates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxdist.errors import ConfigError
from jaxdist.state import Entry

KEY = "in_flight"  # the train state entry holding the queue


class HeldState(NamedTuple):
    count: jax.Array  # int32[] updates asked for so far (capped at tau)
    inner: Any  # the optimizer's own state, unchanged while the queue fills


def hold_while_filling(tx: optax.GradientTransformation, tau: int) -> optax.GradientTransformation:
    """`tx`, with its first `tau` updates replaced by zero updates that leave its state alone."""

    def init(params):
        return HeldState(jnp.zeros((), jnp.int32), tx.init(params))

    def update(grads, state, params=None):
        updates, inner = tx.update(grads, state.inner, params)
        filling = state.count < tau
        updates = jax.tree.map(lambda u: jnp.where(filling, jnp.zeros_like(u), u), updates)
        inner = jax.tree.map(lambda new, old: jnp.where(filling, old, new), inner, state.inner)
        return updates, HeldState(jnp.minimum(state.count + 1, tau), inner)

    return optax.GradientTransformation(init, update)


@dataclasses.dataclass(frozen=True)
class Delay:
    """What a gradient strategy needs to run with staleness tau > 0."""

    tau: int
    entry: Entry  # state[KEY]: the queue, oldest gradient first

    def wrap(self, gradients: Callable) -> Callable:
        """GradFn `(params, batch, extra) -> (loss, aux, grads, extra)` returning the gradient of
        step t - tau instead of this step's, which joins the queue."""

        def delayed(params, batch, extra):
            queue = extra[KEY]
            loss, aux, grads, extra = gradients(params, batch, extra)
            oldest = jax.tree.map(lambda q: q[0], queue)
            queue = jax.tree.map(
                lambda q, g: jnp.concatenate([q[1:], g[None].astype(q.dtype)]), queue, grads
            )
            return loss, aux, oldest, {**extra, KEY: queue}

        return delayed

    def tx(self, tx: optax.GradientTransformation) -> optax.GradientTransformation:
        return hold_while_filling(tx, self.tau)


def build(tau: int, abstract_params: Any, param_shardings: Any, mesh: Mesh) -> Delay | None:
    """The queue entry for staleness `tau`, None for tau = 0 (synchronous)."""
    if tau == 0:
        return None
    abstract = jax.tree.map(
        lambda p: jax.ShapeDtypeStruct((tau, *p.shape), p.dtype), abstract_params
    )
    specs = jax.tree.map(lambda s: P(None, *s.spec), param_shardings)

    def init(params):
        return jax.tree.map(lambda p: jnp.zeros((tau, *p.shape), p.dtype), params)

    return Delay(tau, Entry.from_specs(abstract, specs, mesh, init))


def check(config, mesh_shape: dict[str, int]) -> None:
    """`grad_sync.staleness`'s rules; one-line ConfigErrors before compiling."""
    tau, g = config.grad_sync.staleness, config.grad_sync
    if not (isinstance(tau, int) and tau >= 0):
        raise ConfigError(f"grad_sync.staleness={tau!r} must be an integer >= 0 (0 = synchronous)")
    if tau and g.local_steps > 1:
        raise ConfigError(
            f"grad_sync.staleness={tau} delays gradients, but grad_sync.local_steps="
            f"{g.local_steps} sends parameters (local SGD); set one of them back (0 / 1)"
        )
