"""A test-only model family written to the protocol in `models/api.py`: not the GPT.

Token embeddings → `model.num_layers` residual MLP layers (x + W2·gelu(W1·x), no attention, no norm)
→ a vocabulary projection and the mean next-token cross-entropy. Its parameter names (`tok`,
`stack`, `proj`, `out`) share nothing with the GPT's, so a pipeline that drives it knows the model
only through `Stages`. Register it with `models.register(FAMILY)`; it reads the GPT's config fields
(`num_layers`, `d_model`, `mlp_dim`, `vocab_size`, `seq_len`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdist.sharding import constrain
from models import api

NAME = "toy_residual_mlp"
ACT = ("batch", "length", "embed")


def embed(p, tokens):
    """[B, T] token ids -> [B, T, D]."""
    x = jnp.take(constrain(p["tok"], ("vocab", "embed")), tokens, axis=0)
    return constrain(x, ACT)


def block(lp, x):
    """One residual MLP layer on [B, T, D]."""
    h = jnp.einsum("btd,df->btf", x, constrain(lp["w_in"], ("embed", "mlp")))
    h = constrain(jax.nn.gelu(h), ("batch", "length", "mlp"))
    return x + constrain(
        jnp.einsum("btf,fd->btd", h, constrain(lp["w_out"], ("mlp", "embed"))), ACT
    )


def head_loss(p, x, targets):
    logits = jnp.einsum("btd,dv->btv", x, constrain(p["out"], ("embed", "vocab")))
    return api.token_cross_entropy(constrain(logits, ("batch", "length", "vocab")), targets)


class ResidualMLP(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        L, D, V = cfg.num_layers, cfg.d_model, cfg.vocab_size
        F = cfg.mlp_dim or 2 * D
        normal = lambda shape, std: std * jax.random.normal(rngs.params(), shape)
        self.tok = nnx.Param(normal((V, D), 0.5), logical_axes=("vocab", "embed"))
        self.stack = nnx.Dict(
            w_in=nnx.Param(normal((L, D, F), D**-0.5), logical_axes=("layers", "embed", "mlp")),
            w_out=nnx.Param(
                normal((L, F, D), 0.5 * F**-0.5), logical_axes=("layers", "mlp", "embed")
            ),
        )
        self.proj = nnx.Dict(
            out=nnx.Param(normal((D, V), D**-0.5), logical_axes=("embed", "vocab"))
        )

    def loss(self, batch, *, remat: str = "none"):
        x = embed({"tok": self.tok[...]}, batch["inputs"])
        stacked = {k: v[...] for k, v in self.stack.items()}
        x = api.scan_layers(block, stacked, x, remat=remat)
        return head_loss({"out": self.proj["out"][...]}, x, batch["targets"]), {}


def flops_per_token(cfg, params) -> float:
    """6·N: every parameter but the embedding table is a matmul weight; no attention."""
    n = sum(x.size for x in jax.tree.leaves(params)) - params["tok"].size
    return api.decoder_flops_per_token(n, cfg.num_layers, 0, cfg.seq_len)


def plan_cost(cfg, params) -> api.PlanCost:
    """The planner's accounting. Per token, a layer computes h = x·W1 (F, split over tensor),
    gelu(h) and the pieces autodiff of the tanh GELU keeps, and gelu(h)·W2 (D), added to x as the
    next layer's input. What is kept was fitted to the compiled temp (tests/test_plan_families.py
    at T = 64): five F-wide GELU pieces, and W2's output under `dots`. One all-reduce forward (the
    row-parallel W2's output), one backward (the column-parallel W1's input gradient), none
    re-run by a policy that drops the dots (nothing downstream of W2 is recomputed)."""
    D, F = cfg.d_model, cfg.mlp_dim or 2 * cfg.d_model
    A = api.Activation
    return api.PlanCost(
        label="toy residual MLP",
        num_layers=cfg.num_layers,
        width=D,
        seq_len=cfg.seq_len,
        vocab_size=cfg.vocab_size,
        activations=(
            A("layer input x", D, "input"),
            A("up-projection h", F, "dot", split=True),
            A("GELU output", F, "elementwise", split=True),
            A("GELU's tanh pieces", 5 * F, "elementwise", split=True),
            A("down-projection output", D, "dot"),
        ),
        tensor_all_reduces=(1, 1, 0),
    )


def stages(cfg) -> api.Stages:
    split = lambda p: ({"tok": p["tok"]}, p["stack"], p["proj"])
    join = lambda e, stacked, head: {**e, "stack": stacked, "proj": head}
    return api.Stages(split, join, embed=embed, block=block, head_loss=head_loss)


FAMILY = api.ModelFamily(
    name=NAME,
    make=lambda cfg, ds: lambda rngs: ResidualMLP(cfg, rngs=rngs),
    batch_axes=lambda cfg, ds: {"inputs": ("batch", "length"), "targets": ("batch", "length")},
    tokens_per_example=lambda cfg: cfg.seq_len,
    flops_per_token=flops_per_token,
    stages=stages,
    plan_cost=plan_cost,
)
