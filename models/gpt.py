"""Decoder-only transformer (GPT), Flax NNX, annotated only with logical axes.

Layer parameters are stacked along a leading `layers` axis and applied with `jax.lax.scan`, so compile
time does not grow with depth and the pipeline can split the stack into stages. `block` is a pure
function of one layer's parameters so schedules other than a plain scan can call it.

Shapes: B batch, T length, D d_model, N heads, H head dim, F mlp width, V vocab, L layers.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdist.sharding import constrain


def _dots_no_batch_and_fused_attention(prim, *args, **params) -> bool:
    """Matmul outputs without batch dimensions, and the fused (cuDNN flash) attention's outputs
    (its result and softmax statistics), so the backward pass does not run attention again. On
    backends without fused attention this is `dots_with_no_batch_dims_saveable`."""
    return jax.checkpoint_policies.dots_with_no_batch_dims_saveable(
        prim, *args, **params
    ) or prim.name.startswith("dot_product_attention_fwd")


REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": _dots_no_batch_and_fused_attention,
}

# Logical axes of one layer's parameters (without the leading `layers` axis).
BLOCK_AXES = {
    "attn_norm": ("embed",),
    "wqkv": ("embed", None, "heads", "kv"),  # fused [D, 3, N, H]: one input-gradient all-reduce
    "wo": ("heads", "kv", "embed"),
    "mlp_norm": ("embed",),
    "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
}
NORM_BIAS = ("attn_norm_bias", "mlp_norm_bias")


def _param(value: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
    return nnx.Param(value, logical_axes=axes)


class Blocks(nnx.Module):
    """All L transformer layers' parameters, stacked: every array has a leading [L] axis."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        L, D, N = cfg.num_layers, cfg.d_model, cfg.num_heads
        H, F = D // N, cfg.mlp_dim or 4 * D
        normal = lambda shape, std: std * jax.random.normal(rngs.params(), (L, *shape))
        out_std = 0.02 / math.sqrt(2 * L)  # GPT-2: residual projections scaled by depth
        self.attn_norm = _param(jnp.ones((L, D)), ("layers", "embed"))
        self.wqkv = _param(normal((D, 3, N, H), 0.02), ("layers", *BLOCK_AXES["wqkv"]))
        self.wo = _param(normal((N, H, D), out_std), ("layers", *BLOCK_AXES["wo"]))
        self.mlp_norm = _param(jnp.ones((L, D)), ("layers", "embed"))
        self.w_up = _param(normal((D, F), 0.02), ("layers", *BLOCK_AXES["w_up"]))
        self.w_down = _param(normal((F, D), out_std), ("layers", *BLOCK_AXES["w_down"]))
        if cfg.norm == "layernorm":
            self.attn_norm_bias = _param(jnp.zeros((L, D)), ("layers", "embed"))
            self.mlp_norm_bias = _param(jnp.zeros((L, D)), ("layers", "embed"))

    def stacked(self) -> dict[str, jax.Array]:
        names = list(BLOCK_AXES) + [n for n in NORM_BIAS if hasattr(self, n)]
        return {n: getattr(self, n)[...] for n in names}


def _norm(x: jax.Array, scale: jax.Array, bias: jax.Array | None, eps: float = 1e-6) -> jax.Array:
    xf = x.astype(jnp.float32)
    if bias is None:  # RMSNorm
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
        return (y * scale.astype(jnp.float32)).astype(x.dtype)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def _rope(x: jax.Array, positions: jax.Array, base: float = 10000.0) -> jax.Array:
    """Rotary position embedding on [B, T, N, H]."""
    h = x.shape[-1]
    freqs = base ** (-jnp.arange(0, h // 2, dtype=jnp.float32) * 2 / h)
    angles = positions[:, None].astype(jnp.float32) * freqs[None, :]  # [T, H/2]
    sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def block(lp: dict[str, jax.Array], x: jax.Array, *, attention: str = "xla") -> jax.Array:
    """One pre-norm transformer layer. `lp` holds one layer's parameters; x is [B, T, D]."""
    c = lambda name: constrain(lp[name], BLOCK_AXES[name])  # gathered over fsdp for compute
    T = x.shape[1]
    positions = jnp.arange(T)
    with jax.named_scope("attention"):
        h = _norm(x, c("attn_norm"), lp.get("attn_norm_bias"))
        qkv = jnp.einsum("btd,dcnh->cbtnh", h, c("wqkv"))  # [3, B, T, N, H]
        q, k, v = qkv[0], qkv[1], qkv[2]
        q = constrain(_rope(q, positions), ("batch", "length", "heads", "kv"))
        k = constrain(_rope(k, positions), ("batch", "length", "heads", "kv"))
        v = constrain(v, ("batch", "length", "heads", "kv"))
        impl = None if attention == "auto" else attention
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
        o = constrain(o, ("batch", "length", "heads", "kv"))
        x = x + constrain(jnp.einsum("btnh,nhd->btd", o, c("wo")), ("batch", "length", "embed"))
    with jax.named_scope("mlp"):
        h = _norm(x, c("mlp_norm"), lp.get("mlp_norm_bias"))
        u = constrain(jnp.einsum("btd,df->btf", h, c("w_up")), ("batch", "length", "mlp"))
        u = jax.nn.gelu(u)
        x = x + constrain(jnp.einsum("btf,fd->btd", u, c("w_down")), ("batch", "length", "embed"))
    return x


def scan_blocks(
    stacked: dict[str, jax.Array],
    x: jax.Array,
    *,
    remat: str = "none",
    attention: str = "xla",
    unroll: int = 1,
) -> jax.Array:
    """Applies the stacked layers in order with lax.scan; x is [B, T, D].

    `unroll` layers run per loop iteration. A rolled scan keeps compile time flat in depth, but
    on GPUs each iteration copies its slice of the stacked weights and its saved activations in
    and out of [L, ...] buffers (memcpy kernels); unrolled, those become separate buffers."""
    fn = lambda lp, h: block(lp, h, attention=attention)
    if remat != "none":
        fn = jax.checkpoint(fn, policy=REMAT_POLICIES[remat])

    def body(h, lp):
        return fn(lp, h), None

    x, _ = jax.lax.scan(body, x, stacked, unroll=min(unroll, len(jax.tree.leaves(stacked)[0])))
    return x


def _lookup(emb: jax.Array, tokens: jax.Array) -> jax.Array:
    return jnp.take(emb, tokens, axis=0)


@jax.custom_vjp
def _lookup_matmul_grad(emb: jax.Array, tokens: jax.Array) -> jax.Array:
    """`jnp.take(emb, tokens, axis=0)` whose gradient is a one-hot matmul, not a scatter-add.

    The scatter's atomic adds serialise on repeated tokens (a byte-level corpus has ~100 distinct
    ids): on an H100 it took 23 ms of gpt_1b's step and 37 of gpt_small's. The matmul costs
    2·B·T·V·D FLOPs at tensor-core speed and accumulates in float32."""
    return jnp.take(emb, tokens, axis=0)


def _lookup_fwd(emb, tokens):
    return jnp.take(emb, tokens, axis=0), (tokens, emb)  # emb is live anyway: no extra memory


def _lookup_bwd(res, g):  # g: [B, T, D]
    tokens, emb = res
    one_hot = jax.nn.one_hot(tokens, emb.shape[0], dtype=g.dtype)  # [B, T, V]
    d_emb = jnp.einsum("btv,btd->vd", one_hot, g, preferred_element_type=jnp.float32)
    d_tokens = np.zeros(tokens.shape, jax.dtypes.float0)
    return d_emb.astype(emb.dtype), d_tokens


_lookup_matmul_grad.defvjp(_lookup_fwd, _lookup_bwd)


class GPT(nnx.Module):
    """Token embedding → L scanned layers → final norm → untied vocabulary projection."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.cfg = cfg
        D, V = cfg.d_model, cfg.vocab_size
        self.embed = _param(0.02 * jax.random.normal(rngs.params(), (V, D)), ("vocab", "embed"))
        self.blocks = Blocks(cfg, rngs)
        self.final_norm = _param(jnp.ones((D,)), ("embed",))
        if cfg.norm == "layernorm":
            self.final_norm_bias = _param(jnp.zeros((D,)), ("embed",))
        self.head = _param(0.02 * jax.random.normal(rngs.params(), (D, V)), ("embed", "vocab"))

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        emb = constrain(self.embed[...], ("vocab", "embed"))
        lookup = _lookup_matmul_grad if self.cfg.get("embed_grad") == "matmul" else _lookup
        x = lookup(emb, tokens)  # [B, T, D]
        return constrain(x, ("batch", "length", "embed"))

    def logits(self, x: jax.Array) -> jax.Array:
        bias = self.final_norm_bias[...] if hasattr(self, "final_norm_bias") else None
        x = _norm(x, constrain(self.final_norm[...], ("embed",)), bias)
        logits = jnp.einsum("btd,dv->btv", x, constrain(self.head[...], ("embed", "vocab")))
        return constrain(logits, ("batch", "length", "vocab"))

    def __call__(self, tokens: jax.Array, *, remat: str = "none") -> jax.Array:
        x = self.embed_tokens(tokens)
        x = scan_blocks(
            self.blocks.stacked(),
            x,
            remat=remat,
            attention=self.cfg.attention,
            unroll=self.cfg.get("scan_unroll", 1),
        )
        return self.logits(x)

    def loss(self, batch: dict[str, jax.Array], *, remat: str = "none") -> tuple[jax.Array, dict]:
        """Mean next-token cross-entropy (computed in float32) over the batch."""
        logits = self(batch["inputs"], remat=remat).astype(jnp.float32)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
        return loss, {}


def batch_axes() -> dict[str, tuple[str, ...]]:
    return {"inputs": ("batch", "length"), "targets": ("batch", "length")}


def flops_per_token(cfg, num_params: int) -> float:
    """Training FLOPs per token: 6·N for the matmuls plus 12·L·D·T for attention scores."""
    return 6.0 * num_params + 12.0 * cfg.num_layers * cfg.d_model * cfg.seq_len


def describe(cfg) -> dict[str, Any]:
    return {
        "layers": cfg.num_layers,
        "d_model": cfg.d_model,
        "heads": cfg.num_heads,
        "vocab": cfg.vocab_size,
        "seq_len": cfg.seq_len,
    }
