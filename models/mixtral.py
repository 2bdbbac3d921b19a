"""Mixtral decoder (Mixtral-8x7B, 8x22B): the Llama layers with top-2 of 8 SwiGLU experts, HF's router loss.

Mixtral is models/llama.py's network with every MLP a sparse mixture of experts (models/moe.py):
the router's logits over all E experts, softmax, the top k (2) taken and their weights
renormalised to sum to 1, each token through its k SwiGLU experts, no shared expert, nothing
dropped (`model.moe_capacity_factor=0`, as Hugging Face's `MixtralSparseMoeBlock`). Expert
parallelism runs over `mesh.expert` (models/moe.py).

What is Mixtral's own is the load-balancing loss as Hugging Face computes it
(`load_balancing_loss_func`, added with `router_aux_loss_coef` when `output_router_logits`):
the router logits of all L layers are pooled before the product,

    aux = E · Σ_e (k · f̄_e) · P̄_e,  f̄_e = mean over layers of the fraction of the n·k
    assignments expert e got (no gradient), P̄_e = mean over layers and tokens of e's probability,

where the Llama family's MoE averages the per-layer products E · Σ_e f_e · P_e instead. The
pooled product is not linear in the layers' statistics, which the pipeline's stages hold apart
(`stages`): gpipe and interleaved differentiate it on the batch's statistics, 1f1b and zb add
its linearization at them, found by one more forward pass a step (`api.Stages.aux_linear`).
Hugging Face `MixtralForCausalLM` weights map 1:1, one tensor per expert (`HF` below).

Shapes: B batch, T length, D d_model, E experts, k experts per token, F expert width, L layers.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from jaxdist.errors import ConfigError
from jaxdist.sharding import constrain
from models import api, gpt, llama, moe

AXES = {**llama.BLOCK_AXES, **moe.AXES}


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def block(
    lp: dict[str, jax.Array], carry, *, cfg, positions=None, qkv: Any = llama.qkv, segments=None
):
    """One Mixtral layer on carry = (x [B, T, D], router stats summed over the layers so far):
    Llama's MoE layer (`llama.moe_block`), whose stats also sum `moe_prob` [E], the layer's mean
    router probability per expert (what Hugging Face pools over the layers). `qkv`: the
    attention's input projections (`llama.qkv`'s signature)."""
    x, acc = carry
    c = lambda name: constrain(lp[name], AXES[name])
    x = llama.attention_part(lp, x, cfg, positions, c, qkv, segments)
    with jax.named_scope("moe"):
        h = llama.rms_norm(x, c("mlp_norm"), cfg.norm_eps)  # the MoE's input, again (CSE'd)
        logits = jnp.einsum("btd,de->bte", h.astype(jnp.float32), c("router").astype(jnp.float32))
        x, stats = llama.moe_mlp(lp, x, cfg, c, segments)
    valid = None if segments is None else segments[0] > 0  # a packed row's padding: left out
    stats["moe_prob"] = moe.token_mean(jax.nn.softmax(logits, axis=-1), valid)
    return x, jax.tree.map(jnp.add, acc, stats)


def stats_zero(cfg, like: jax.Array) -> dict[str, jax.Array]:
    """Llama's router stats' zeros plus `moe_prob` [E]."""
    return llama.moe_stats_zero(cfg, like) | {
        "moe_prob": jnp.zeros_like(like, shape=(cfg.num_experts,), dtype=jnp.float32)
    }


def pooled_stats(stats: dict[str, jax.Array], cfg) -> dict[str, jax.Array]:
    """Stats summed over the layers → their means, with `moe_lb_loss` Hugging Face's pooled
    load-balancing loss E · Σ_e (k · f̄_e) · P̄_e (f̄ = the mean `moe_load`, no gradient)."""
    mean = {k: v / cfg.num_layers for k, v in stats.items()}
    prob = mean.pop("moe_prob")
    k, E = cfg.experts_per_token, cfg.num_experts
    mean["moe_lb_loss"] = E * jnp.sum(k * mean["moe_load"] * prob)
    return mean


class Mixtral(llama.Llama):
    """Token embedding → L scanned Mixtral layers → final RMSNorm → head; Llama's `loss` adds
    `model.moe_aux_loss_weight` × the pooled load-balancing loss (`pooled_stats`)."""

    def _hidden(
        self, tokens: jax.Array, positions, remat: str, segments=None
    ) -> tuple[jax.Array, dict]:
        x = llama.embed_tokens({"embed": self.embed[...]}, tokens, embed_grad=self.cfg.embed_grad)
        layer = functools.partial(
            block, cfg=self.cfg, positions=positions, qkv=self.qkv, segments=segments
        )
        x, stats = api.scan_layers(
            layer,
            self.layers.stacked(),
            (x, stats_zero(self.cfg, x)),
            remat=remat,
            unroll=self.cfg.scan_unroll,
        )
        return x, pooled_stats(stats, self.cfg)


def layer(lp: dict[str, jax.Array], x: jax.Array, *, cfg, qkv: Any = llama.qkv, segments=None):
    """One Mixtral layer as the pipeline's block: (x, this layer's router stats with
    `moe_prob`)."""
    return block(lp, (x, stats_zero(cfg, x)), cfg=cfg, qkv=qkv, segments=segments)


def aux_loss(stats: dict, cfg) -> tuple[jax.Array, dict]:
    """The router losses of stats summed over the layers (`pooled_stats`; the pooled product is
    not linear in them) and their metrics: the pipeline's `Stages.aux_loss`, as `Mixtral.loss`
    adds them without a pipeline."""
    return llama.moe_loss(jnp.zeros((), jnp.float32), pooled_stats(stats, cfg), cfg)


def stages(cfg, qkv: Any = llama.qkv) -> api.Stages:
    """Llama's stages with Mixtral's layer and pooled router loss; the loss is linear in the
    statistics only when `model.moe_aux_loss_weight` is 0 (the z-loss alone). `qkv`: the
    attention's input projections (Qwen3-MoE's own)."""
    return dataclasses.replace(
        llama.stages(cfg, qkv=qkv),
        block=functools.partial(layer, cfg=cfg, qkv=qkv),
        aux_zero=functools.partial(stats_zero, cfg),
        aux_loss=functools.partial(aux_loss, cfg=cfg),
        aux_linear=not cfg.moe_aux_loss_weight,
    )


def check(m, mesh: Mapping[str, int]) -> None:
    """Llama's shape rules with experts (k ≥ 2 of E, no shared expert)."""
    _need(
        isinstance(m.num_experts, int) and m.num_experts >= 2,
        f"model.num_experts={m.num_experts!r}: model.name={m.name!r} needs >= 2 experts; "
        "use model.name='llama' for a dense model",
    )
    k = m.experts_per_token
    _need(
        isinstance(k, int) and 2 <= k <= m.num_experts,
        f"model.experts_per_token={k!r} must be an integer in [2, model.num_experts="
        f"{m.num_experts}] (the router renormalises its top-k weights: with k = 1 the weight is "
        "1 and the router learns nothing from the loss)",
    )
    _need(
        not m.moe_shared_expert,
        f"model.moe_shared_expert=True: model.name={m.name!r} has no shared expert; set it to "
        "False, or use model.name='llama' for jaxdist's MoE with one",
    )
    llama.check(m, mesh)


def plan_cost(cfg, params: dict[str, Any]) -> api.PlanCost:
    """Llama's MoE accounting (`llama.plan_cost`: k experts' activations, the unchosen experts'
    weights idle), without context parallelism (`FAMILY.mesh_axes`)."""
    base = llama.plan_cost(cfg, params)
    label = f"Mixtral ({cfg.experts_per_token} of {cfg.num_experts} experts)"
    return dataclasses.replace(base, label=label, context_parallel=False)


# ------------------------------------------------------------------------------------------------
# Hugging Face `MixtralForCausalLM` (jaxdist/hf.py reads and writes the files): Llama's table
# (models/llama.py) for the embedding, attention, norms and head, and per layer i, expert e
#
# | jaxdist (`params/...`) | shape  | Hugging Face                                   | shape  |
# |------------------------|--------|------------------------------------------------|--------|
# | layers/router[i]       | [D, E] | model.layers.i.block_sparse_moe.gate.weight    | [E, D] |
# | layers/e_gate[i, e]    | [D, F] | model.layers.i.block_sparse_moe.experts.e.w1.weight | [F, D] |
# | layers/e_up[i, e]      | [D, F] | model.layers.i.block_sparse_moe.experts.e.w3.weight | [F, D] |
# | layers/e_down[i, e]    | [F, D] | model.layers.i.block_sparse_moe.experts.e.w2.weight | [D, F] |
#
# That is the layout of the published checkpoints and of what transformers 5 writes: in memory it
# fuses each layer's experts (`mlp.experts.gate_up_proj` [E, 2F, D], `down_proj` [E, D, F]), but
# `save_pretrained` converts back to one tensor per expert, and `from_pretrained` fuses them again.


def config_from_hf(hf: Mapping[str, Any], m, where: str) -> None:
    """Fills config.model `m` from a `MixtralForCausalLM` config.json: Llama's fields, the experts,
    and `moe_aux_loss_weight` = `router_aux_loss_coef` when `output_router_logits` (Hugging Face
    adds the loss then only), else 0. Sliding-window attention and router jitter are refused."""
    sw = hf.get("sliding_window")
    _need(
        sw is None,
        f"{where}: sliding_window={sw!r} is not supported (jaxdist's Mixtral attends over the "
        "whole sequence); it must be null",
    )
    jitter = hf.get("router_jitter_noise", 0.0)
    _need(
        not jitter,
        f"{where}: router_jitter_noise={jitter!r} is not supported (jaxdist's router takes no "
        "noise); it must be 0",
    )
    # transformers writes head_dim: null for the default d_model / num_heads
    llama.config_from_hf({k: v for k, v in hf.items() if v is not None}, m, where)
    experts_from_hf(hf, m, where, "num_local_experts")


def experts_from_hf(hf: Mapping[str, Any], m, where: str, num_key: str) -> None:
    """The MoE fields of config.model `m` from an HF MoE config.json (the experts' count under
    `num_key`): k, HF's load-balancing coefficient when `output_router_logits` (else 0), no
    z-loss, dropless, no shared expert."""
    m.num_experts = llama.hf_field(hf, num_key, where, int)
    m.experts_per_token = llama.hf_field(hf, "num_experts_per_tok", where, int)
    coef = llama.hf_field(hf, "router_aux_loss_coef", where, float, 0.0)
    m.moe_aux_loss_weight = coef if hf.get("output_router_logits") else 0.0
    m.moe_z_loss_weight = 0.0  # HF's Mixtral and Qwen3-MoE have no router z-loss
    m.moe_capacity_factor = 0.0  # dropless, as HF
    m.moe_shared_expert = False


def dense_view(m) -> ml_collections.ConfigDict:
    """A copy of config.model `m` without experts, for the dense families' `config_to_hf`."""
    dense = ml_collections.ConfigDict(m.to_dict())
    dense.num_experts = 0
    return dense


def experts_to_hf(m) -> dict[str, Any]:
    """The router loss's fields of an HF MoE config.json."""
    return {
        "num_experts_per_tok": int(m.experts_per_token),
        "router_aux_loss_coef": float(m.moe_aux_loss_weight),
        "output_router_logits": bool(m.moe_aux_loss_weight),
    }


def config_to_hf(m, dtype: str) -> dict[str, Any]:
    """A `MixtralForCausalLM` config.json for config.model `m`: Llama's fields (read from
    `dense_view(m)`: llama.config_to_hf exports dense models only), then the experts'."""
    out = llama.config_to_hf(dense_view(m), dtype)
    for key in ("mlp_bias", "attention_bias"):
        out.pop(key)
    return (
        out
        | experts_to_hf(m)
        | {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "num_local_experts": int(m.num_experts),
            "router_jitter_noise": 0.0,
            "sliding_window": None,
        }
    )


def expert_tensors(m, router: str, gate: str, up: str, down: str) -> list[api.HFTensor]:
    """The router's and the experts' `HFTensor`s: HF names with {i} (layer) and {e} (expert),
    each an `nn.Linear` weight [out, in]."""
    d = llama.dims(m)
    D, E, F = d["D"], m.num_experts, d["F"]
    T = lambda a: a.T
    return [
        api.HFTensor(("layers", "router"), router, (E, D), T, T, True),
        api.HFTensor(("layers", "e_gate"), gate, (F, D), T, T, True, E),
        api.HFTensor(("layers", "e_up"), up, (F, D), T, T, True, E),
        api.HFTensor(("layers", "e_down"), down, (D, F), T, T, True, E),
    ]


def without_dense_mlp(tensors: list[api.HFTensor]) -> list[api.HFTensor]:
    """A dense family's `HFTensor`s less its MLP's (`llama.MLP_NAMES`)."""
    return [t for t in tensors if t.path[-1] not in llama.MLP_NAMES]


def hf_tensors(m) -> list[api.HFTensor]:
    """Llama's tensors but the dense MLP, then the router and the experts (the table above)."""
    at = "model.layers.{i}.block_sparse_moe."
    return without_dense_mlp(llama.hf_tensors(m)) + expert_tensors(
        m,
        at + "gate.weight",
        at + "experts.{e}.w1.weight",
        at + "experts.{e}.w3.weight",
        at + "experts.{e}.w2.weight",
    )


HF = api.HFFormat(
    architectures=("MixtralForCausalLM",),
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    tensors=hf_tensors,
    ignored=llama.HF.ignored,
)


FAMILY = api.ModelFamily(
    name="mixtral",
    make=lambda cfg, ds: lambda rngs: Mixtral(cfg, rngs=rngs),
    batch_axes=lambda cfg, ds: gpt.batch_axes(),
    check=check,
    check_data=gpt.check_data,
    flops_per_token=llama.flops_per_token,
    tokens_per_example=lambda cfg: cfg.seq_len,
    stages=stages,
    decoder=llama.decoder,
    hf=HF,
    plan_cost=plan_cost,
    packing=True,
    mesh_axes=frozenset({"expert"}),
)
