"""`lax.switch` whose branches all run the same number of collective-permutes.

XLA:CPU pairs collective-permutes by arrival order, not by instruction: its rendezvous key is
(run, participating devices, op id), a permute's participants are every device of the program
(its replica groups are empty) and every `ppermute` inside a `shard_map` is lowered with the same
channel id (1). So the k-th permute a device runs meets the k-th permute of every other device,
whatever instruction each is in. Where stages take different branches of a tick's switch (1f1b,
zb) and the branches run different numbers of permutes (ring attention's K/V hops over `context`
in the forward, their transposes in the backward), a permute that should pair stage s with s + 1
afterwards (the pipeline's conveyors) meets a ring hop of the other stage instead, and the values
are wrong (`tests/test_aligned_switch.py` has the smallest program that shows it).

`switch` pads every branch with scalar permutes over the pairs of the branches' own permutes until
each runs as many as the branch that runs most: the k-th permute of every device is then again one
whose sources run the same instruction (a stage's devices take the same branch), and the permutes
after the switch meet their partners. The padding is `max − count` scalar transfers per tick on a
branch that runs fewer; branches without permutes, or all with the same count, are left as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp


def _subjaxprs(params: dict) -> list:
    """The jaxprs in an equation's params (a call's body, a remat's, custom_vjp's primal)."""
    out = []
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                out.append(v.jaxpr)
            elif isinstance(v, jax.extend.core.Jaxpr):
                out.append(v)
    return out


def permutes(jaxpr) -> tuple[int, tuple | None]:
    """(how many `ppermute`s one run of `jaxpr` executes, scans' trip counts included; the
    (axis_name, perm) of one of them, or None)."""
    count, spec = 0, None
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "ppermute":
            n, s = 1, (eqn.params["axis_name"], tuple(map(tuple, eqn.params["perm"])))
        elif name == "scan":
            n, s = permutes(eqn.params["jaxpr"].jaxpr)
            n *= eqn.params["length"]
        elif name == "cond":
            found = [permutes(b.jaxpr) for b in eqn.params["branches"]]
            if len({n for n, _ in found}) > 1:
                raise NotImplementedError("collective-permutes in a nested cond's branches differ")
            n, s = found[0][0], next((s for _, s in found if s), None)
        elif name == "while":
            n, s = sum(permutes(j)[0] for j in _subjaxprs(eqn.params)), None
            if n:
                raise NotImplementedError("collective-permutes in a while loop: unknown count")
        else:
            n, s = 0, None
            for sub in _subjaxprs(eqn.params):
                k, t = permutes(sub)
                n, s = n + k, s or t
        count, spec = count + n, spec or s
    return count, spec


def _padded(branch: Callable, extra: int, spec: tuple) -> Callable:
    """`branch` followed by `extra` scalar permutes over `spec`'s pairs of a zero computed from
    its smallest floating output, added back to it (+ 0), so that XLA keeps them."""
    axis, perm = spec

    def run(*operands):
        out = branch(*operands)
        leaves, tree = jax.tree.flatten(out)
        floats = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.floating)]
        i = min(floats, key=lambda i: leaves[i].size)
        first = jnp.ravel(leaves[i])[0].astype(jnp.float32)
        dummy = jnp.where(jnp.isfinite(first), first, 0) * 0  # 0, not foldable by XLA

        def hop(d, _):
            return jax.lax.ppermute(d, axis, perm), None

        dummy, _ = jax.lax.scan(hop, dummy, None, length=extra)
        leaves[i] = leaves[i] + (dummy * 0).astype(leaves[i].dtype)
        return jax.tree.unflatten(tree, leaves)

    return run


def switch(index: jax.Array, branches: Sequence[Callable], *operands: Any) -> Any:
    """`jax.lax.switch(index, branches, *operands)` with every branch running as many
    collective-permutes as the one that runs most (module docstring). Each branch is traced once:
    the switch runs the traced jaxprs."""
    traced = [jax.make_jaxpr(b, return_shape=True)(*operands) for b in branches]
    found = [permutes(closed.jaxpr) for closed, _ in traced]
    most = max(n for n, _ in found)
    spec = next((s for _, s in found if s), None)

    def replay(closed, shape):
        tree = jax.tree.structure(shape)
        run = jax.extend.core.jaxpr_as_fun(closed)
        return lambda *ops: jax.tree.unflatten(tree, run(*jax.tree.leaves(ops)))

    out = []
    for (closed, shape), (n, _) in zip(traced, found):
        b = replay(closed, shape)
        out.append(b if spec is None or n == most else _padded(b, most - n, spec))
    return jax.lax.switch(index, out, *operands)
