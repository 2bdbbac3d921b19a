"""`jax.vjp` split across ticks: a forward tick keeps the residuals, later ticks run the backward.

`StashedVjp` runs a function's backward from residuals stashed at its forward (1f1b);
`SplitVjp` cuts that backward into an input-gradient and a weight-gradient pass (zb). Both are
traced once per step and know nothing of schedules.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.extend.core

# JAX has no public partial evaluation / dead-code elimination of jaxprs (jax.extend.core has
# neither in 0.10): the residual split below needs both.
from jax._src.interpreters import partial_eval as pe

from jaxdist.pipeline.spmd import varying


class StashedVjp:
    """`jax.vjp` split across ticks: the forward tick keeps the residuals, a later tick applies
    the backward to them, without running the forward again.

    The residuals are the leaves of the vjp function (`jax.vjp` returns a pytree). Those that are
    one of the `fixed` arrays (the stage weights, which every tick has anyway) are not stashed but
    passed again to the backward; those computed from the `fixed` arrays alone (the per-layer
    weight slices a scan over the layers stacks back, the causal mask) are the same for every
    microbatch, so they are kept once (`invariant`), not per microbatch. What else a residual
    holds is decided by the remat policy of the function (`train.remat`): activations for
    `none`, the layer inputs for `full`.
    """

    def __init__(self):
        self.tree = None
        # per vjp leaf: index into `fixed` + `invariant`, or -1 = stashed per microbatch
        self.where: list[int] | None = None

    def forward(self, fn, fixed: list, *args):
        """(fn(*args), residual leaves stashed per microbatch, invariant residual leaves)."""
        out, vjp = jax.vjp(fn, *args)
        leaves, tree = jax.tree.flatten(vjp)
        ids = {id(f): k for k, f in enumerate(fixed)}
        if self.where is None:
            invariant = _fixed_only(fn, fixed, args)
        else:
            invariant = [w >= len(fixed) for w in self.where]
        where, n_inv = [], len(fixed)
        for leaf, inv in zip(leaves, invariant):
            if id(leaf) in ids:
                where.append(ids[id(leaf)])
            elif inv:
                where.append(n_inv)
                n_inv += 1
            else:
                where.append(-1)
        if self.where is not None and where != self.where:
            raise AssertionError("stashed vjp: residual layout differs between traces")
        self.tree, self.where = tree, where
        # Varying over every manual axis, as the stash buffers: a residual such as the context
        # shard's index varies over `context` only.
        pick = lambda keep: [varying(leaf) for leaf, w in zip(leaves, where) if keep(w)]
        return out, pick(lambda w: w < 0), pick(lambda w: w >= len(fixed))

    def backward(self, fixed: list, stashed: list, cotangent):
        """The input cotangents of `forward`'s args, from its stashed residuals; `fixed`: the
        forward's `fixed` followed by its invariant residuals."""
        rest = iter(stashed)
        leaves = [fixed[w] if w >= 0 else next(rest) for w in self.where]
        return jax.tree.unflatten(self.tree, leaves)(cotangent)


def _fixed_only(fn, fixed: list, args: tuple) -> list[bool]:
    """Per leaf of `jax.vjp(fn, *args)`'s residuals: whether it is computed from the `fixed`
    leaves of `args` alone (JAX's partial evaluation with the other leaves unknown: a scan's
    outputs are told apart per output)."""
    flat, in_tree = jax.tree.flatten(args)
    residuals = lambda *flat: jax.tree.leaves(jax.vjp(fn, *jax.tree.unflatten(in_tree, flat))[1])
    closed = jax.make_jaxpr(residuals)(*flat)
    ids = {id(f) for f in fixed}
    _, _, unknown, _ = pe.partial_eval_jaxpr_nounits(
        closed, [id(a) not in ids for a in flat], False
    )
    return [not u for u in unknown]


class SplitVjp(StashedVjp):
    """A stashed vjp whose backward is cut in two (zb): `backward_input` computes the input
    cotangent and what the weight gradient needs from the cotangent path (the cotangents at the
    outputs of the weight-using ops); `backward_weight`, on any later tick, the weight gradient.

    The cut is made on the backward's jaxpr, traced once: the residuals that the input cotangent
    does not need (the inputs of the weight matmuls) are marked unknown, and JAX's partial
    evaluation moves the equations that depend on them, and only those, into the second part
    (scans, the stacked layers, are split per iteration). Nothing is computed twice. With a remat
    policy that keeps only the layer inputs (`full`) no residual is weight-only: the weight
    gradient then stays in the first part and the second is empty.
    """

    def __init__(self):
        super().__init__()
        self.cut: dict[str, Any] | None = None

    def forward(self, fn, fixed: list, *args):
        """(fn(*args), residuals for the input pass, residuals only the weight pass reads,
        invariant residuals (`StashedVjp`; the passes take `fixed` followed by them))."""
        out, stashed, invariant = super().forward(fn, fixed, *args)
        if self.cut is None:
            self._make_cut(fixed + invariant, stashed, out)
        only = self.cut["weight_only"][len(fixed) + len(invariant) :]
        return (
            out,
            [r for r, w in zip(stashed, only) if not w],
            [r for r, w in zip(stashed, only) if w],
            invariant,
        )

    def _make_cut(self, fixed: list, stashed: list, out) -> None:
        def bwd(fixed, stashed, dy):
            return StashedVjp.backward(self, fixed, stashed, dy)

        closed, shape = jax.make_jaxpr(bwd, return_shape=True)(fixed, stashed, out)
        n_in, n_dy = len(fixed) + len(stashed), len(jax.tree.leaves(out))
        assert len(closed.jaxpr.invars) == n_in + n_dy, "split vjp: unexpected backward inputs"
        n_out = len(closed.jaxpr.outvars)
        n_dx = len(jax.tree.leaves(shape[1:]))
        used_for_dx = [False] * (n_out - n_dx) + [True] * n_dx
        _, used_in = pe.dce_jaxpr(closed.jaxpr, used_for_dx)
        weight_only = [not u for u in used_in[:n_in]]
        known, unknown, out_unknown, res = pe.partial_eval_jaxpr_nounits(
            closed, weight_only + [False] * n_dy, False
        )
        assert not any(out_unknown[n_out - n_dx :]), "split vjp: the input cotangent was cut"
        self.cut = dict(
            known=known,
            unknown=unknown,
            weight_only=weight_only,
            out_unknown=out_unknown[: n_out - n_dx],
            dx_tree=jax.tree.structure(shape[1:]),
            n_res=len(res),
        )

    def backward_input(self, fixed: list, for_input: list, cotangent):
        """(the input cotangents (a tuple, one per `forward` arg after the first), the weight
        gradient's leaves computed here (None where the weight pass computes them), residuals
        for the weight pass)."""
        cut = self.cut
        known_fixed = [f for f, w in zip(fixed, cut["weight_only"]) if not w]
        outs = jax.extend.core.jaxpr_as_fun(cut["known"])(
            *known_fixed, *for_input, *jax.tree.leaves(cotangent)
        )
        outs, res = outs[: len(outs) - cut["n_res"]], outs[len(outs) - cut["n_res"] :]
        n_dw = len(cut["out_unknown"])
        n_known_dw = n_dw - sum(cut["out_unknown"])
        it = iter(outs[:n_known_dw])
        dw = [None if u else next(it) for u in cut["out_unknown"]]
        dx = jax.tree.unflatten(cut["dx_tree"], outs[n_known_dw:])
        return dx, dw, list(res)

    def backward_weight(self, fixed: list, weight_only: list, res: list) -> list:
        """The weight gradient's leaves that `backward_input` left out (None for the others)."""
        cut = self.cut
        only_fixed = [f for f, w in zip(fixed, cut["weight_only"]) if w]
        outs = iter(jax.extend.core.jaxpr_as_fun(cut["unknown"])(*res, *only_fixed, *weight_only))
        return [next(outs) if u else None for u in cut["out_unknown"]]
