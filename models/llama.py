"""Llama-family decoder (Llama 2/3, TinyLlama, SmolLM, ...), Flax NNX, annotated only with logical axes.

Pre-norm layers of RMSNorm → grouped-query attention with rotary embeddings → RMSNorm → SwiGLU MLP,
bias-free projections, a final RMSNorm and a vocabulary head that may be the embedding table itself
(`model.tie_embeddings`). The rotary embedding uses Hugging Face's rotate-half layout (the two halves
of each head are the pairs being rotated), so HF `LlamaForCausalLM` weights map 1:1, with transposes
only (`HF` below; `scripts/hf.py` reads and writes the files).

Like the GPT, the layers are stacked along a leading `layers` axis and applied with
`api.scan_layers`; `embed_tokens`, `block` and `head_loss` are pure functions of their parameters
and `FAMILY.stages` hands them to the pipeline. `forward_cached` is the same network run against a
fixed-size key/value cache, for generation (`scripts/sample.py`).

Shapes: B batch, T length, S cache length, D d_model, N query heads, K key/value heads (N = K·G),
H head dim, F mlp width, V vocab, L layers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdist import fp8, sharding
from jaxdist.errors import ConfigError
from jaxdist.sharding import constrain
from models import api, attention, gpt, moe

# Logical axes of one layer's parameters (without the leading `layers` axis). Key/value heads are
# split over `tensor` like the query heads: query head n reads key/value head n // G, which lands
# on the same tensor shard when K is divisible by mesh.tensor (checked in `check`).
BLOCK_AXES = {
    "attn_norm": ("embed",),
    "wq": ("embed", "heads", "kv"),  # [D, N, H]
    "wk": ("embed", "heads", "kv"),  # [D, K, H]
    "wv": ("embed", "heads", "kv"),  # [D, K, H]
    "wo": ("heads", "kv", "embed"),  # [N, H, D]
    "mlp_norm": ("embed",),
    "w_gate": ("embed", "mlp"),  # [D, F]
    "w_up": ("embed", "mlp"),  # [D, F]
    "w_down": ("mlp", "embed"),  # [F, D]
}
MLP_NAMES = ("w_gate", "w_up", "w_down")  # dense, or the shared expert beside MoE experts
ACT = ("batch", "length", "embed")
HEADS = ("batch", "length", "heads", "kv")


def layer_axes(cfg) -> dict[str, tuple[str | None, ...]]:
    """One layer's parameters and their logical axes: the dense MLP replaced by `moe.AXES` when
    `model.num_experts` > 0 (kept beside them as the shared expert with `moe_shared_expert`)."""
    if not cfg.num_experts:
        return dict(BLOCK_AXES)
    out = {n: a for n, a in BLOCK_AXES.items() if n not in MLP_NAMES or cfg.moe_shared_expert}
    return out | moe.AXES


def dims(cfg) -> dict[str, int]:
    """The model's sizes with defaults resolved: L, D, N, K, H, F, V."""
    N = cfg.num_heads
    return {
        "L": cfg.num_layers,
        "D": cfg.d_model,
        "N": N,
        "K": cfg.num_kv_heads or N,
        "H": cfg.head_dim or cfg.d_model // N,
        "F": cfg.mlp_dim or 4 * cfg.d_model,
        "V": cfg.vocab_size,
    }


_param = api.param


class Layers(nnx.Module):
    """All L layers' parameters, stacked: every array has a leading [L] axis."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        d = dims(cfg)
        L, D, N, K, H, F = d["L"], d["D"], d["N"], d["K"], d["H"], d["F"]
        normal = lambda shape, std: std * jax.random.normal(rngs.params(), (L, *shape))
        out_std = 0.02 / math.sqrt(2 * L)  # residual projections scaled by depth (GPT-2)
        self._names = layer_axes(cfg)
        axes = lambda name: ("layers", *self._names[name])
        self.attn_norm = _param(jnp.ones((L, D)), axes("attn_norm"))
        self.wq = _param(normal((D, N, H), 0.02), axes("wq"))
        self.wk = _param(normal((D, K, H), 0.02), axes("wk"))
        self.wv = _param(normal((D, K, H), 0.02), axes("wv"))
        self.wo = _param(normal((N, H, D), out_std), axes("wo"))
        self.mlp_norm = _param(jnp.ones((L, D)), axes("mlp_norm"))
        if "w_gate" in self._names:
            self.w_gate = _param(normal((D, F), 0.02), axes("w_gate"))
            self.w_up = _param(normal((D, F), 0.02), axes("w_up"))
            self.w_down = _param(normal((F, D), out_std), axes("w_down"))
        if cfg.num_experts:
            E = cfg.num_experts
            self.router = _param(normal((D, E), 0.02), axes("router"))
            self.e_gate = _param(normal((E, D, F), 0.02), axes("e_gate"))
            self.e_up = _param(normal((E, D, F), 0.02), axes("e_up"))
            self.e_down = _param(normal((E, F, D), out_std), axes("e_down"))

    def stacked(self) -> dict[str, jax.Array]:
        return {n: getattr(self, n)[...] for n in self._names}


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm as Hugging Face computes it: normalised in float32, cast back, then scaled."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return scale.astype(x.dtype) * y.astype(x.dtype)


def inverse_frequencies(cfg) -> np.ndarray:
    """Rotary inverse frequencies [H/2], float32, with `model.rope_scaling` applied.

    "llama3" is Llama 3.1's long-context rule: wavelengths longer than original_max_len /
    low_freq_factor are stretched by `factor`, shorter than original_max_len / high_freq_factor
    kept, and those between interpolated smoothly (as transformers' `_compute_llama3_parameters`).
    """
    h = dims(cfg)["H"]
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, h, 2, dtype=np.float32) / h))
    inv = inv.astype(np.float32)
    rs = cfg.rope_scaling
    if rs.type == "llama3":
        low_wavelen = rs.original_max_len / rs.low_freq_factor
        high_wavelen = rs.original_max_len / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
        smooth = (rs.original_max_len / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


def rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotary embedding on x [B, T, N, H] at positions [B, T] (or [T]), rotate-half layout:
    out = x·cos + rotate_half(x)·sin, cos/sin computed in float32 and cast to x's dtype."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)  # [.., T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [.., T, H]
    if angles.ndim == 2:
        angles = angles[None]
    cos = jnp.cos(angles)[:, :, None, :].astype(x.dtype)
    sin = jnp.sin(angles)[:, :, None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def project_qkv(x, cfg, c) -> tuple[jax.Array, jax.Array, jax.Array]:
    """RMSNorm(x) [B, T, D] → q [B, T, N, H] and k, v [B, T, K, H], not yet rotated."""
    h = rms_norm(x, c("attn_norm"), cfg.norm_eps)
    q = fp8.einsum("btd,dnh->btnh", h, c("wq"))
    k = fp8.einsum("btd,dkh->btkh", h, c("wk"))
    return q, k, fp8.einsum("btd,dkh->btkh", h, c("wv"))


def rotate_qk(q, k, v, positions, cfg) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q and k rotated to their positions (`rope`), each of q, k, v constrained to `HEADS`."""
    inv = inverse_frequencies(cfg)
    q, k = rope(q, positions, inv), rope(k, positions, inv)
    return constrain(q, HEADS), constrain(k, HEADS), constrain(v, HEADS)


def qkv(lp, x, positions, cfg, c) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Llama's attention input: x [B, T, D] → rotated q [B, T, N, H] and k, v [B, T, K, H].

    A family built on these layers passes its own (same signature) as `qkv=` to `block`,
    `forward_cached`, `stages` and `decoder` (models/qwen3.py norms q and k before the rotation).
    """
    return rotate_qk(*project_qkv(x, cfg, c), positions, cfg)


def _mlp(lp, x, cfg, c, normed=None):
    """x + SwiGLU(RMSNorm(x)) on [B, T, D] (`normed`: RMSNorm(x) already computed)."""
    h = rms_norm(x, c("mlp_norm"), cfg.norm_eps) if normed is None else normed
    g = constrain(fp8.einsum("btd,df->btf", h, c("w_gate")), ("batch", "length", "mlp"))
    u = constrain(fp8.einsum("btd,df->btf", h, c("w_up")), ("batch", "length", "mlp"))
    out = fp8.einsum("btf,fd->btd", jax.nn.silu(g) * u, c("w_down"))
    return x + constrain(out, ACT)


def _attend(q, k, v, positions: np.ndarray | None, cfg, segment_ids=None) -> jax.Array:
    """Causal grouped-query attention [B, T, N, H]; over `mesh.context` when it is > 1. With
    `segment_ids` [B, T] (packed documents) a query sees only keys of its own segment."""
    if sharding.axis_size(attention.AXIS) > 1:
        pos = np.arange(q.shape[1]) if positions is None else positions
        return attention.context_attention(q, k, v, pos, cfg.context_attention, segment_ids)
    impl = gpt.attention_implementation(cfg.attention, q.dtype, q.shape[-1])
    # Grouped-query attention: K < N key/value heads, query head n reads head n // (N / K).
    # The segment mask is a [B, 1, T, T] mask for both implementations (cuDNN takes it as a bias).
    mask = None if segment_ids is None else api.segment_mask(segment_ids, segment_ids)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=impl)


def attention_part(lp, x, cfg, positions, c, qkv=qkv, segments=None) -> jax.Array:
    """x + attention(RMSNorm(x)) on [B, T, D]; `segments`: a packed row's (segment_ids,
    positions) [B, T], in storage order: attention per segment, rotary per-document positions."""
    with jax.named_scope("attention"):
        if attention.is_manual():  # the pipeline's stages: x holds this device's T/c slots
            positions, pos = attention.local_positions(x.shape[1], cfg.context_attention)
        else:
            pos = jnp.arange(x.shape[1]) if positions is None else jnp.asarray(positions)
        seg = None
        if segments is not None:
            seg, pos = segments
        q, k, v = qkv(lp, x, pos, cfg, c)
        o = constrain(_attend(q, k, v, positions, cfg, seg), HEADS)
        return x + constrain(fp8.einsum("btnh,nhd->btd", o, c("wo")), ACT)


def block(
    lp: dict[str, jax.Array],
    x: jax.Array,
    *,
    cfg,
    positions: np.ndarray | None = None,
    qkv: Any = qkv,
    segments: api.Segments | None = None,
) -> jax.Array:
    """One pre-norm Llama layer on x [B, T, D]; `lp` holds one layer's parameters. `positions`
    [T]: each storage slot's position (the zig-zag order of ring attention), default arange.
    `qkv`: the attention's input projections (`qkv`'s signature). `segments`: packed documents
    (`attention_part`)."""
    c = lambda name: constrain(lp[name], BLOCK_AXES[name])  # gathered over fsdp for compute
    x = attention_part(lp, x, cfg, positions, c, qkv, segments)
    with jax.named_scope("mlp"):
        return _mlp(lp, x, cfg, c)


def moe_mlp(lp, x, cfg, c, segments: api.Segments | None = None) -> tuple[jax.Array, dict]:
    """x + experts(RMSNorm(x)) (+ the shared expert) on [B, T, D], and the layer's router stats.
    `segments`: a packed row's; its padding (segment id 0) counts in no router statistic and
    takes no expert capacity (models/moe.py)."""
    h = rms_norm(x, c("mlp_norm"), cfg.norm_eps)
    valid = None if segments is None else segments[0] > 0
    w, idx, stats = moe.route(h, c("router"), cfg.experts_per_token, valid)
    y, dropped = moe.experts(
        h, w, idx, c("e_gate"), c("e_up"), c("e_down"), factor=cfg.moe_capacity_factor, valid=valid
    )
    k = cfg.experts_per_token
    stats["moe_dropped"] = dropped.astype(jnp.float32) / (k * moe.token_count(valid, idx))
    if cfg.moe_shared_expert:
        y = y + _mlp(lp, jnp.zeros_like(x), cfg, c, normed=h)
    return x + constrain(y, ACT), stats


def moe_block(
    lp: dict[str, jax.Array],
    carry,
    *,
    cfg,
    positions: np.ndarray | None = None,
    qkv: Any = qkv,
    segments: api.Segments | None = None,
):
    """One MoE layer on carry = (x [B, T, D], router stats summed over the layers so far)."""
    x, acc = carry
    c = lambda name: constrain(lp[name], {**BLOCK_AXES, **moe.AXES}[name])
    x = attention_part(lp, x, cfg, positions, c, qkv, segments)
    with jax.named_scope("moe"):
        x, stats = moe_mlp(lp, x, cfg, c, segments)
    return x, jax.tree.map(jnp.add, acc, stats)


def moe_layer(
    lp: dict[str, jax.Array],
    x: jax.Array,
    *,
    cfg,
    qkv: Any = qkv,
    segments: api.Segments | None = None,
) -> tuple[jax.Array, dict]:
    """One MoE layer as the pipeline's block: (x, this layer's router stats)."""
    return moe_block(lp, (x, moe_stats_zero(cfg, x)), cfg=cfg, qkv=qkv, segments=segments)


def moe_aux_loss(stats: dict, cfg) -> tuple[jax.Array, dict]:
    """The weighted router losses (linear in the stats) and the metrics of stats summed over the
    layers: the pipeline's `Stages.aux_loss`, as `moe_loss` adds them without a pipeline."""
    mean = {k: v / cfg.num_layers for k, v in stats.items()}
    return moe_loss(jnp.zeros((), jnp.float32), mean, cfg)


def moe_stats_zero(cfg, like: jax.Array) -> dict[str, jax.Array]:
    """The router stats' zeros, varying over the manual axes `like` varies over (inside a
    per-replica shard_map the layers' scan carry must keep one type)."""
    z = jnp.zeros_like(like, shape=(), dtype=jnp.float32)
    E = cfg.num_experts
    load = jnp.zeros_like(like, shape=(E,), dtype=jnp.float32)
    return {"moe_lb_loss": z, "moe_z_loss": z, "moe_load": load, "moe_dropped": z}


def sequence_order(cfg, length: int) -> np.ndarray | None:
    """The storage order of the sequence under context parallelism (None: natural)."""
    c = sharding.axis_size(attention.AXIS)
    return attention.sequence_order(length, c, cfg.context_attention)


def embed_tokens(p: dict[str, jax.Array], tokens: jax.Array, *, embed_grad: str = "scatter"):
    """Token ids [B, T] -> [B, T, D] from the table `embed` [V, D] (as the GPT's)."""
    return gpt.embed_tokens(p, tokens, embed_grad=embed_grad)


def logits(p: dict[str, jax.Array], x: jax.Array, *, eps: float) -> jax.Array:
    """Final RMSNorm and vocabulary projection [B, T, D] -> [B, T, V]; with tied embeddings the
    projection is the embedding table `embed` [V, D], else `head` [D, V]."""
    x = rms_norm(x, constrain(p["final_norm"], ("embed",)), eps)
    if "head" in p:
        out = jnp.einsum("btd,dv->btv", x, constrain(p["head"], ("embed", "vocab")))
    else:
        out = jnp.einsum("btd,vd->btv", x, constrain(p["embed"], ("vocab", "embed")))
    return constrain(out, ("batch", "length", "vocab"))


def head_loss(p: dict[str, jax.Array], x: jax.Array, targets: jax.Array, *, eps: float):
    """Mean next-token cross-entropy of the head's logits, gather-free (the pipeline's head)."""
    return api.token_cross_entropy(logits(p, x, eps=eps), targets)


class Llama(nnx.Module):
    """Token embedding → L scanned layers → final RMSNorm → head (or the tied embedding).

    A family built on it (models/qwen3.py) subclasses it with its own `layers_type` (the stacked
    parameters) and `qkv` (the attention's input projections)."""

    layers_type = Layers
    qkv = staticmethod(qkv)

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.cfg = cfg
        D, V = cfg.d_model, cfg.vocab_size
        self.embed = _param(0.02 * jax.random.normal(rngs.params(), (V, D)), ("vocab", "embed"))
        self.layers = self.layers_type(cfg, rngs)
        self.final_norm = _param(jnp.ones((D,)), ("embed",))
        if not cfg.tie_embeddings:
            self.head = _param(0.02 * jax.random.normal(rngs.params(), (D, V)), ("embed", "vocab"))

    def head_params(self) -> dict[str, jax.Array]:
        p = {"final_norm": self.final_norm[...]}
        if self.cfg.tie_embeddings:
            p["embed"] = self.embed[...]
        else:
            p["head"] = self.head[...]
        return p

    def _hidden(
        self, tokens: jax.Array, positions, remat: str, segments: api.Segments | None = None
    ) -> tuple[jax.Array, dict]:
        """Final hidden states [B, T, D] and the MoE router stats averaged over layers ({})."""
        x = embed_tokens({"embed": self.embed[...]}, tokens, embed_grad=self.cfg.embed_grad)
        moe_layers = bool(self.cfg.num_experts)
        fn = moe_block if moe_layers else block
        layer = functools.partial(
            fn, cfg=self.cfg, positions=positions, qkv=self.qkv, segments=segments
        )
        carry = (x, moe_stats_zero(self.cfg, x)) if moe_layers else x
        out = api.scan_layers(
            layer, self.layers.stacked(), carry, remat=remat, unroll=self.cfg.scan_unroll
        )
        if not moe_layers:
            return out, {}
        x, stats = out
        return x, jax.tree.map(lambda s: s / self.cfg.num_layers, stats)

    def _order(self, length: int) -> np.ndarray | None:
        return sequence_order(self.cfg, length)

    def __call__(
        self, tokens: jax.Array, *, remat: str = "none", segments: api.Segments | None = None
    ) -> jax.Array:
        """Logits [B, T, V] of tokens [B, T]; `segments` (segment_ids, positions) [B, T] of
        packed documents: each attends within its own segment, at its own positions."""
        order = self._order(tokens.shape[1])
        if order is None:
            x, _ = self._hidden(tokens, None, remat, segments)
            return logits(self.head_params(), x, eps=self.cfg.norm_eps)
        put = lambda a: constrain(a[:, order], ("batch", "length"))
        segs = None if segments is None else tuple(put(a) for a in segments)
        x, _ = self._hidden(put(tokens), order, remat, segs)
        out = logits(self.head_params(), x, eps=self.cfg.norm_eps)
        return constrain(out[:, np.argsort(order)], ("batch", "length", "vocab"))

    def loss(self, batch: dict[str, jax.Array], *, remat: str = "none") -> tuple[jax.Array, dict]:
        """Mean next-token cross-entropy (float32) over the batch. Under ring context attention
        the tokens and targets are stored zig-zag (a permutation: the mean is unchanged). A
        packed batch (`segment_ids`, `positions`) attends per document and skips -1 targets."""
        inputs, targets = batch["inputs"], batch["targets"]
        segments = api.segments_of(batch)
        order = self._order(inputs.shape[1])
        if order is not None:
            put = lambda a: constrain(a[:, order], ("batch", "length"))
            inputs, targets = put(inputs), put(targets)
            segments = None if segments is None else tuple(put(a) for a in segments)
        x, stats = self._hidden(inputs, order, remat, segments)
        xent = api.token_cross_entropy if segments is None else api.masked_token_cross_entropy
        loss = xent(logits(self.head_params(), x, eps=self.cfg.norm_eps), targets)
        if not stats:
            return loss, {}
        return moe_loss(loss, stats, self.cfg)


def moe_loss(loss: jax.Array, stats: dict, m) -> tuple[jax.Array, dict]:
    """Cross-entropy plus the weighted router losses; the metrics: those losses, the dropped
    fraction and each expert's share of the assignments (`moe_load_<e>`), averaged over layers."""
    loss = loss + m.moe_aux_loss_weight * stats["moe_lb_loss"]
    loss = loss + m.moe_z_loss_weight * stats["moe_z_loss"]
    load = stats.pop("moe_load")
    return loss, stats | {f"moe_load_{e}": load[e] for e in range(m.num_experts)}


# ------------------------------------------------------------------------------------------------
# Generation: the same layers against a fixed-size key/value cache.


CACHE_AXES = ("layers", "batch", "length", "heads", "kv")  # [L, B, S, K, H]


def init_cache(cfg, batch: int, length: int, dtype=jnp.float32) -> dict[str, jax.Array]:
    """Zeroed key/value cache {"k", "v"}: [L, B, S, K, H] each, S = `length` positions."""
    d = dims(cfg)
    shape = (d["L"], batch, length, d["K"], d["H"])
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def _write_rows(cache: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """cache [B, S, K, H] with new [B, T, K, H] written at row b's position start[b]."""
    put = lambda c, n, s: jax.lax.dynamic_update_slice(c, n, (s, 0, 0))
    return jax.vmap(put)(cache, new.astype(cache.dtype), start)


def forward_cached(
    params: dict[str, Any],
    tokens: jax.Array,
    start: jax.Array,
    cache: dict[str, jax.Array],
    *,
    cfg,
    qkv: Any = qkv,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Logits of tokens [B, T] placed at positions start[b] + t, and the cache with their keys and
    values written there. Each query attends to every cached key at a position <= its own, so
    a prompt's prefill (start = 0) and one-token decode steps (start = tokens so far) are the same
    function; positions past a row's own tokens are never read before they are overwritten.

    Returns: (logits [B, T, V] float32, the updated cache).
    """
    B, T = tokens.shape
    S = cache["k"].shape[2]
    d = dims(cfg)
    G = d["N"] // d["K"]
    positions = start[:, None] + jnp.arange(T)[None, :]  # [B, T]
    visible = jnp.arange(S)[None, None, :] <= positions[:, :, None]  # [B, T, S]
    x = embed_tokens({"embed": params["embed"]}, tokens)

    def layer(x, lp_and_cache):
        lp, ck, cv = lp_and_cache
        c = lambda name: constrain(lp[name], {**BLOCK_AXES, **moe.AXES}[name])
        q, k, v = qkv(lp, x, positions, cfg, c)
        ck = constrain(_write_rows(ck, k, start), CACHE_AXES[1:])
        cv = constrain(_write_rows(cv, v, start), CACHE_AXES[1:])
        qg = q.reshape(B, T, d["K"], G, d["H"]).astype(jnp.float32)  # [B, T, K, G, H]
        s = jnp.einsum("btkgh,bskh->bkgts", qg, ck.astype(jnp.float32)) / math.sqrt(d["H"])
        s = jnp.where(visible[:, None, None], s, -jnp.inf)
        w = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bkgts,bskh->btkgh", w, cv.astype(jnp.float32))
        o = o.reshape(B, T, d["N"], d["H"]).astype(x.dtype)
        x = x + constrain(jnp.einsum("btnh,nhd->btd", o, c("wo")), ACT)
        x = moe_mlp(lp, x, cfg, c)[0] if cfg.num_experts else _mlp(lp, x, cfg, c)
        return x, (ck, cv)

    x, (k, v) = jax.lax.scan(layer, x, (params["layers"], cache["k"], cache["v"]))
    head = {k_: params[k_] for k_ in ("final_norm", "head", "embed") if k_ in params}
    if "head" in head:
        head.pop("embed")
    out = logits(head, x, eps=cfg.norm_eps).astype(jnp.float32)
    return out, {"k": k, "v": v}


# ------------------------------------------------------------------------------------------------
# The protocol.


def flops_per_token(cfg, params: dict[str, Any]) -> float:
    """6·N (N without the embedding lookup; a tied table still counts once, for the head) +
    12·L·(N·H)·T for attention. With experts N counts the active parameters only: k of the E
    experts' weights (the router and a shared expert in full)."""
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    if not cfg.tie_embeddings:
        n -= math.prod(params["embed"].shape)
    if cfg.num_experts:
        idle = 1 - cfg.experts_per_token / cfg.num_experts
        n -= idle * sum(math.prod(params["layers"][w].shape) for w in ("e_gate", "e_up", "e_down"))
    d = dims(cfg)
    return api.decoder_flops_per_token(n, d["L"], d["N"] * d["H"], cfg.seq_len)


def layer_activations(D: int, F: float, NT: int) -> tuple[api.Activation, ...]:
    """One Llama layer's activations per token (D wide, F MLP units, NT float32 attention scores,
    0 when attention is fused): the GPT's (`gpt.layer_activations`) with SwiGLU's MLP, two
    F-wide projections (gate, up) and three F-wide elementwise pieces (SiLU, its sigmoid, the
    gated product). Checked against the compiled temp by tests/test_plan_families.py: within 6%
    at remat none, dots and full, L 2 and 4, D 32, T 64 (docs/PLANNER.md)."""
    A = api.Activation
    return (
        A("layer input x", D, "input"),
        A("attention block output", D, "dot"),
        A("RMSNorms, residual sums", 4 * D, "elementwise"),
        A("q, k, v", 3 * D, "dot", split=True),
        A("attention output o", D, "batch_dot", split=True),
        A("MLP gate and up projections", 2 * F, "dot", split=True),
        A("SiLU, sigmoid, gated product", 3 * F, "elementwise", split=True),
        A("recomputed in the backward", 4 * F, "transient", split=True),
        A("attention scores", NT, "batch_dot", split=True, float32=True),
        A("softmax probabilities", NT, "elementwise", split=True, float32=True),
    )


def moe_activations(cfg) -> tuple[api.Activation, ...]:
    """What an MoE layer adds per token (models/moe.py), not split over `tensor`: the router's
    float32 logits and probabilities, and the token rows routed to the experts and gathered back,
    k per token (dropless) or up to capacity factor × k (the [E, C, D] buffers)."""
    A = api.Activation
    rows = cfg.experts_per_token * max(1.0, cfg.moe_capacity_factor) * cfg.d_model
    return (
        A("router logits, probabilities", 2 * cfg.num_experts, "elementwise", float32=True),
        A("token rows to the experts", rows, "elementwise"),
        A("expert outputs gathered back", rows, "elementwise"),
    )


def plan_cost(cfg, params: dict[str, Any]) -> api.PlanCost:
    """The planner's accounting (`api.PlanCost`): `layer_activations`, with the MLP's width k + 1
    experts' (k without a shared expert) under MoE, whose unchosen experts' weights are idle.
    Tensor-parallel all-reduces per layer: the attention and MLP outputs forward; backward, the
    input gradients of the five column-parallel projections (q, k, v, gate, up: XLA reduces each
    before summing them, as the compiled step shows); the attention output again without dots."""
    D, T = cfg.d_model, cfg.seq_len
    F, idle, label = cfg.mlp_dim or 4 * D, 0, "Llama"
    d = dims(cfg)
    q, kv = d["N"] * d["H"], d["K"] * d["H"]
    matmuls = ((D, q), (D, kv), (D, kv), (q, D))  # wq, wk, wv, wo
    if not cfg.num_experts or cfg.moe_shared_expert:  # the dense (or shared expert's) SwiGLU
        matmuls += ((D, F), (D, F), (F, D))
    if cfg.num_experts:  # a token's MLP activations: k experts' (+ the shared one's)
        k, E = cfg.experts_per_token, cfg.num_experts
        experts = sum(math.prod(params["layers"][w].shape) for w in ("e_gate", "e_up", "e_down"))
        idle = round(experts * (1 - k / E))
        F, label = F * (k + bool(cfg.moe_shared_expert)), f"Llama (MoE, {k} of {E} experts)"
    NT = cfg.num_heads * T if cfg.attention != "cudnn" else 0
    activations = layer_activations(D, F, NT)
    if cfg.num_experts:
        activations += moe_activations(cfg)
    return api.PlanCost(
        label=label,
        num_layers=cfg.num_layers,
        width=D,
        seq_len=T,
        vocab_size=cfg.vocab_size,
        activations=activations,
        attention_flops=12.0 * D * T,
        scores=cfg.num_heads * T,
        attention=cfg.attention,
        tensor_all_reduces=(2, 5, 1),
        context_parallel=True,
        idle_params=idle,
        block_matmuls=matmuls,
    )


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def check(m, mesh: Mapping[str, int]) -> None:
    """The GPT's shape rules, plus grouped-query heads and the rotary settings."""
    gpt.check_sizes(m)
    for name in ("num_kv_heads", "head_dim", "mlp_dim"):
        _need(
            isinstance(m[name], int) and m[name] >= 0,
            f"model.{name}={m[name]!r} must be an integer >= 0 (0 = the default)",
        )
    d, t = dims(m), mesh["tensor"]
    _need(
        m.head_dim or m.d_model % m.num_heads == 0,
        f"model.d_model={m.d_model} must be divisible by model.num_heads={m.num_heads} "
        "(or set model.head_dim)",
    )
    _need(d["H"] % 2 == 0, f"head dim {d['H']} must be even for rotary embeddings")
    _need(
        d["N"] % d["K"] == 0,
        f"model.num_heads={d['N']} must be divisible by model.num_kv_heads={d['K']}",
    )
    for name, value in (("num_heads", d["N"]), ("num_kv_heads", d["K"])):
        _need(value % t == 0, f"model.{name}={value} must be divisible by mesh.tensor={t}")
    _need(d["F"] % t == 0, f"model.mlp_dim={d['F']} must be divisible by mesh.tensor={t}")
    gpt.check_embed_split(m, mesh)
    _check_context(m, mesh)
    _check_experts(m, mesh)
    _need(m.rope_theta > 0, f"model.rope_theta={m.rope_theta} must be > 0")
    _need(m.norm_eps > 0, f"model.norm_eps={m.norm_eps} must be > 0")
    _need(
        m.rope_scaling.type in ("none", "llama3"),
        f"model.rope_scaling.type={m.rope_scaling.type!r} is not valid; choose one of none, llama3",
    )
    gpt.check_lowering(m)


def _check_context(m, mesh: Mapping[str, int]) -> None:
    """Sequence split over `mesh.context`: into c slices, or 2c zig-zag chunks for `ring`."""
    c = mesh.get("context", 1)
    if c <= 1:
        return
    parts = 2 * c if m.context_attention == "ring" else c
    why = "2·mesh.context zig-zag chunks" if m.context_attention == "ring" else "mesh.context"
    _need(
        m.seq_len % parts == 0,
        f"model.seq_len={m.seq_len} must be divisible by {parts} ({why}, "
        f"model.context_attention={m.context_attention!r})",
    )


def _check_experts(m, mesh: Mapping[str, int]) -> None:
    """MoE fields and `mesh.expert`: experts split evenly, top-k within the experts."""
    E, k, ep = m.num_experts, m.experts_per_token, mesh.get("expert", 1)
    _need(isinstance(E, int) and E >= 0, f"model.num_experts={E!r} must be an integer >= 0")
    if not E:
        _need(ep == 1, f"mesh.expert={ep} needs model.num_experts > 0 (a dense model has none)")
        return
    _need(
        isinstance(k, int) and 1 <= k <= E,
        f"model.experts_per_token={k!r} must be an integer in [1, model.num_experts={E}]",
    )
    _need(E % ep == 0, f"model.num_experts={E} must be divisible by mesh.expert={ep}")
    cf = m.moe_capacity_factor
    _need(cf >= 0, f"model.moe_capacity_factor={cf} must be >= 0 (0 = dropless)")


def stages(cfg, qkv: Any = qkv) -> api.Stages:
    """Embedding / stacked `layers` / final norm + head, for the pipeline. With tied embeddings
    the head's part holds the embedding table too, and `join` sums its two gradients."""
    eps = cfg.norm_eps

    def split(tree):
        head = {"final_norm": tree["final_norm"]}
        head["embed" if cfg.tie_embeddings else "head"] = tree[
            "embed" if cfg.tie_embeddings else "head"
        ]
        return {"embed": tree["embed"]}, tree["layers"], head

    def join(e, stacked, head):
        out = {"embed": e["embed"], "layers": stacked, "final_norm": head["final_norm"]}
        if cfg.tie_embeddings:
            out["embed"] = jax.tree.map(jnp.add, e["embed"], head["embed"])
        else:
            out["head"] = head["head"]
        return out

    moe_layers = bool(cfg.num_experts)
    return api.Stages(
        split=split,
        join=join,
        embed=functools.partial(embed_tokens, embed_grad=cfg.embed_grad),
        block=functools.partial(moe_layer if moe_layers else block, cfg=cfg, qkv=qkv),
        head_loss=functools.partial(head_loss, eps=eps),
        head_logits=functools.partial(logits, eps=eps),
        order=functools.partial(sequence_order, cfg),
        aux_zero=functools.partial(moe_stats_zero, cfg) if moe_layers else None,
        aux_loss=functools.partial(moe_aux_loss, cfg=cfg) if moe_layers else None,
    )


# ------------------------------------------------------------------------------------------------
# Hugging Face `LlamaForCausalLM` (jaxdist/hf.py reads and writes the files).
#
# | jaxdist (`params/...`) | shape     | Hugging Face                                   | shape    |
# |------------------------|-----------|------------------------------------------------|----------|
# | embed                  | [V, D]    | model.embed_tokens.weight                      | [V, D]   |
# | layers/attn_norm[i]    | [D]       | model.layers.i.input_layernorm.weight          | [D]      |
# | layers/wq[i]           | [D, N, H] | model.layers.i.self_attn.q_proj.weight         | [N·H, D] |
# | layers/wk[i], wv[i]    | [D, K, H] | model.layers.i.self_attn.{k,v}_proj.weight     | [K·H, D] |
# | layers/wo[i]           | [N, H, D] | model.layers.i.self_attn.o_proj.weight         | [D, N·H] |
# | layers/mlp_norm[i]     | [D]       | model.layers.i.post_attention_layernorm.weight | [D]      |
# | layers/w_gate[i], w_up | [D, F]    | model.layers.i.mlp.{gate,up}_proj.weight       | [F, D]   |
# | layers/w_down[i]       | [F, D]    | model.layers.i.mlp.down_proj.weight            | [D, F]   |
# | final_norm             | [D]       | model.norm.weight                              | [D]      |
# | head (untied only)     | [D, V]    | lm_head.weight                                 | [V, D]   |
#
# HF stores `nn.Linear` weights as [out, in]. Both sides use the rotate-half rotary layout, so no
# row permutation is needed (Meta's original checkpoints interleave the rotated pairs; transformers'
# converter permutes q/k once, and HF checkpoints are already in this layout).


def hf_field(hf: Mapping[str, Any], key: str, where: str, kind: type, default: Any = None):
    """hf[key] (or `default`), checked to be an integer, or a number when `kind` is float."""
    value = hf.get(key, default)
    _need(value is not None, f"{where}: missing field {key!r}")
    ok = not isinstance(value, bool) and isinstance(value, int | float if kind is float else int)
    _need(ok, f"{where}: {key}={value!r} must be {'a number' if kind is float else 'an integer'}")
    return kind(value)


def config_from_hf(hf: Mapping[str, Any], m, where: str) -> None:
    """Fills config.model `m` from a `LlamaForCausalLM` config.json (transformers 4.x: top-level
    `rope_theta`/`rope_scaling`; 5.x: `rope_parameters`). Llama variants jaxdist does not
    implement (biases, an activation other than SiLU, other RoPE types) are refused."""
    for key in ("attention_bias", "mlp_bias"):
        _need(not hf.get(key, False), f"{where}: {key}=true is not supported (bias-free only)")
    act = hf.get("hidden_act", "silu")
    _need(act == "silu", f"{where}: hidden_act={act!r} is not supported; Llama uses 'silu'")
    m.vocab_size = hf_field(hf, "vocab_size", where, int)
    m.d_model = hf_field(hf, "hidden_size", where, int)
    m.mlp_dim = hf_field(hf, "intermediate_size", where, int)
    m.num_layers = hf_field(hf, "num_hidden_layers", where, int)
    m.num_heads = hf_field(hf, "num_attention_heads", where, int)
    m.num_kv_heads = hf_field(hf, "num_key_value_heads", where, int, m.num_heads)
    m.head_dim = hf_field(hf, "head_dim", where, int, m.d_model // max(m.num_heads, 1))
    m.seq_len = hf_field(hf, "max_position_embeddings", where, int)
    m.norm_eps = hf_field(hf, "rms_norm_eps", where, float, 1e-6)
    m.tie_embeddings = bool(hf.get("tie_word_embeddings", False))
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    _need(isinstance(rope, dict), f"{where}: rope_parameters/rope_scaling must be an object")
    m.rope_theta = hf_field(rope, "rope_theta", where, float, hf.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    _need(
        kind in ("default", "llama3"),
        f"{where}: rope type {kind!r} is not supported; jaxdist implements default, llama3",
    )
    if kind == "llama3":
        rs, at = m.rope_scaling, f"{where} rope_scaling"
        rs.type = "llama3"
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            rs[key] = hf_field(rope, key, at, float)
        rs.original_max_len = hf_field(rope, "original_max_position_embeddings", at, int)
    eos = hf.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    m.eos_token_id = eos if isinstance(eos, int) and not isinstance(eos, bool) else -1


def config_to_hf(m, dtype: str) -> dict[str, Any]:
    """A `LlamaForCausalLM` config.json for config.model `m`, read by transformers 4.x and 5."""
    _need(not m.num_experts, f"model.num_experts={m.num_experts}: no Hugging Face Llama export")
    d = dims(m)
    out = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": d["V"],
        "hidden_size": d["D"],
        "intermediate_size": d["F"],
        "num_hidden_layers": d["L"],
        "num_attention_heads": d["N"],
        "num_key_value_heads": d["K"],
        "head_dim": d["H"],
        "max_position_embeddings": int(m.seq_len),
        "rms_norm_eps": float(m.norm_eps),
        "rope_theta": float(m.rope_theta),
        "rope_scaling": None,
        "tie_word_embeddings": bool(m.tie_embeddings),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
    }
    if m.rope_scaling.type == "llama3":
        rs = m.rope_scaling
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": float(rs.factor),
            "low_freq_factor": float(rs.low_freq_factor),
            "high_freq_factor": float(rs.high_freq_factor),
            "original_max_position_embeddings": int(rs.original_max_len),
        }
    if m.eos_token_id >= 0:
        out["eos_token_id"] = int(m.eos_token_id)
    return out


def hf_tensors(m) -> list[api.HFTensor]:
    """Every parameter's Hugging Face tensor, in the params' tree order (the table above)."""
    d = dims(m)
    D, N, K, H, F, V = d["D"], d["N"], d["K"], d["H"], d["F"], d["V"]
    same = (lambda a: a, lambda a: a)
    # [out, in] <-> [in, *out split]: the transpose, then the heads axis split out (or merged).
    linear = lambda shape: (lambda w: w.T.reshape(shape), lambda w: w.reshape(w.shape[0], -1).T)
    out_proj = (lambda w: w.T.reshape(N, H, D), lambda w: w.reshape(N * H, D).T)
    at = "model.layers.{i}."
    rows = [
        ("embed", "model.embed_tokens.weight", (V, D), same),
        ("attn_norm", at + "input_layernorm.weight", (D,), same),
        ("wq", at + "self_attn.q_proj.weight", (N * H, D), linear((D, N, H))),
        ("wk", at + "self_attn.k_proj.weight", (K * H, D), linear((D, K, H))),
        ("wv", at + "self_attn.v_proj.weight", (K * H, D), linear((D, K, H))),
        ("wo", at + "self_attn.o_proj.weight", (D, N * H), out_proj),
        ("mlp_norm", at + "post_attention_layernorm.weight", (D,), same),
        ("w_gate", at + "mlp.gate_proj.weight", (F, D), linear((D, F))),
        ("w_up", at + "mlp.up_proj.weight", (F, D), linear((D, F))),
        ("w_down", at + "mlp.down_proj.weight", (D, F), linear((F, D))),
        ("final_norm", "model.norm.weight", (D,), same),
    ]
    if not m.tie_embeddings:
        rows.append(("head", "lm_head.weight", (V, D), linear((D, V))))
    return [
        api.HFTensor(
            ("layers", name) if name in BLOCK_AXES else (name,),
            hf_name,
            shape,
            *fns,
            stacked=name in BLOCK_AXES,
        )
        for name, hf_name, shape, fns in rows
    ]


HF = api.HFFormat(
    architectures=("LlamaForCausalLM",),
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    tensors=hf_tensors,
    # Old checkpoints carry the rotary buffer; some tied ones store the table twice.
    ignored=lambda m: ("rotary_emb.inv_freq",) + (("lm_head.weight",) if m.tie_embeddings else ()),
)


def decoder(cfg, qkv: Any = qkv) -> api.Decoder:
    """The KV-cache forward for generation (`scripts/sample.py`)."""
    return api.Decoder(
        init_cache=functools.partial(init_cache, cfg),
        cache_axes={"k": CACHE_AXES, "v": CACHE_AXES},
        forward=functools.partial(forward_cached, cfg=cfg, qkv=qkv),
    )


FAMILY = api.ModelFamily(
    name="llama",
    make=lambda cfg, ds: lambda rngs: Llama(cfg, rngs=rngs),
    batch_axes=lambda cfg, ds: gpt.batch_axes(),
    check=check,
    check_data=gpt.check_data,
    flops_per_token=flops_per_token,
    tokens_per_example=lambda cfg: cfg.seq_len,
    stages=stages,
    decoder=decoder,
    hf=HF,
    plan_cost=plan_cost,
    packing=True,
    mesh_axes=frozenset({"context", "expert"}),
)
