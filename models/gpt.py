"""Decoder-only transformer (GPT), Flax NNX, annotated only with logical axes.

Layer parameters are stacked along a leading `layers` axis and applied with `jax.lax.scan`, so compile
time does not grow with depth and the pipeline can split the stack into stages. `embed_tokens`,
`block` and `head_loss` are pure functions of their parameters: `FAMILY.stages` hands them to the
pipeline (the `models.api.Stages` protocol), and the module's own forward is built from them.

Shapes: B batch, T length, D d_model, N heads, H head dim, F mlp width, V vocab, L layers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdist import fp8
from jaxdist.errors import ConfigError
from jaxdist.sharding import constrain
from models import api

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


_param = api.param


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
    """Rotary position embedding on [B, T, N, H] at positions [T] (or [B, T])."""
    h = x.shape[-1]
    freqs = base ** (-jnp.arange(0, h // 2, dtype=jnp.float32) * 2 / h)
    angles = positions[..., None].astype(jnp.float32) * freqs  # [(B,) T, H/2]
    angles = angles if angles.ndim == 3 else angles[None]
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


# The tanh GELU with only its input saved for the backward, which recomputes the tanh from it (as
# Megatron's fused bias-GELU does): autodiff of `jax.nn.gelu` keeps four more [B, T, F] pieces.
# Same operations in the same order, so the same gradients (tests/test_gpt.py).
_gelu = jax.checkpoint(jax.nn.gelu)


def block(
    lp: dict[str, jax.Array],
    x: jax.Array,
    *,
    attention: str = "xla",
    segments: api.Segments | None = None,
) -> jax.Array:
    """One pre-norm transformer layer. `lp` holds one layer's parameters; x is [B, T, D].
    `segments`: a packed row's (segment_ids, positions) [B, T]: attention within each document,
    rotary positions per document."""
    c = lambda name: constrain(lp[name], BLOCK_AXES[name])  # gathered over fsdp for compute
    T = x.shape[1]
    positions = jnp.arange(T) if segments is None else segments[1]
    mask = None if segments is None else api.segment_mask(segments[0], segments[0])
    with jax.named_scope("attention"):
        h = _norm(x, c("attn_norm"), lp.get("attn_norm_bias"))
        qkv = fp8.einsum("btd,dcnh->cbtnh", h, c("wqkv"))  # [3, B, T, N, H]
        q, k, v = qkv[0], qkv[1], qkv[2]
        q = constrain(_rope(q, positions), ("batch", "length", "heads", "kv"))
        k = constrain(_rope(k, positions), ("batch", "length", "heads", "kv"))
        v = constrain(v, ("batch", "length", "heads", "kv"))
        impl = attention_implementation(attention, q.dtype, q.shape[-1])
        o = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=impl)
        o = constrain(o, ("batch", "length", "heads", "kv"))
        x = x + constrain(fp8.einsum("btnh,nhd->btd", o, c("wo")), ("batch", "length", "embed"))
    with jax.named_scope("mlp"):
        h = _norm(x, c("mlp_norm"), lp.get("mlp_norm_bias"))
        u = constrain(fp8.einsum("btd,df->btf", h, c("w_up")), ("batch", "length", "mlp"))
        u = _gelu(u)
        x = x + constrain(fp8.einsum("btf,fd->btd", u, c("w_down")), ("batch", "length", "embed"))
    return x


def attention_implementation(attention: str, dtype, head_dim: int) -> str:
    """`model.attention` → `jax.nn.dot_product_attention`'s implementation. "auto" is cuDNN flash
    attention on GPUs where cuDNN takes the inputs (16-bit, head dim a multiple of 8 up to 256),
    else XLA; JAX's own choice (implementation=None) ran XLA attention on an H100 with jax 0.11.2,
    at half the speed (docs/PERFORMANCE.md)."""
    if attention != "auto":
        return attention
    fits = jnp.dtype(dtype).itemsize == 2 and head_dim % 8 == 0 and head_dim <= 256
    return "cudnn" if fits and jax.default_backend() == "gpu" else "xla"


def embed_tokens(
    p: dict[str, jax.Array], tokens: jax.Array, *, embed_grad: str = "scatter"
) -> jax.Array:
    """Token ids [B, T] -> embeddings [B, T, D]; `p` holds the table `embed` [V, D].

    `embed_grad="matmul"` (`model.embed_grad`) computes the table's gradient as a one-hot matmul
    instead of a scatter-add (`_take_matmul_grad`)."""
    emb = constrain(p["embed"], ("vocab", "embed"))
    take = _take_matmul_grad if embed_grad == "matmul" else _take
    x = take(emb, tokens)  # [B, T, D]
    return constrain(x, ("batch", "length", "embed"))


def _take(emb: jax.Array, tokens: jax.Array) -> jax.Array:
    return jnp.take(emb, tokens, axis=0)


@jax.custom_vjp
def _take_matmul_grad(emb: jax.Array, tokens: jax.Array) -> jax.Array:
    """`jnp.take(emb, tokens, axis=0)` whose gradient is a one-hot matmul, not a scatter-add.

    The scatter's atomic adds serialise on repeated tokens (a byte-level corpus has ~100 distinct
    ids): on an H100 they took 23 ms of gpt_1b's step and 37 of gpt_small's. The matmul costs
    2·B·T·V·D FLOPs at tensor-core speed and accumulates in float32."""
    return jnp.take(emb, tokens, axis=0)


def _take_fwd(emb, tokens):
    return jnp.take(emb, tokens, axis=0), (tokens, emb)  # emb is live anyway: no extra memory


def _take_bwd(res, g):  # g: [B, T, D]
    tokens, emb = res
    one_hot = jax.nn.one_hot(tokens, emb.shape[0], dtype=g.dtype)  # [B, T, V]
    d_emb = jnp.einsum("btv,btd->vd", one_hot, g, preferred_element_type=jnp.float32)
    d_tokens = np.zeros(tokens.shape, jax.dtypes.float0)
    return d_emb.astype(emb.dtype), d_tokens


_take_matmul_grad.defvjp(_take_fwd, _take_bwd)


def logits(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """Final norm and vocabulary projection: [B, T, D] -> [B, T, V]; `p` is the head's params."""
    x = _norm(x, constrain(p["final_norm"], ("embed",)), p.get("final_norm_bias"))
    out = jnp.einsum("btd,dv->btv", x, constrain(p["head"], ("embed", "vocab")))
    return constrain(out, ("batch", "length", "vocab"))


def head_loss(p: dict[str, jax.Array], x: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy of the head's logits, gather-free (the pipeline's head)."""
    return api.token_cross_entropy(logits(p, x), targets)


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
        return embed_tokens({"embed": self.embed[...]}, tokens, embed_grad=self.cfg.embed_grad)

    def logits(self, x: jax.Array) -> jax.Array:
        head = {"final_norm": self.final_norm[...], "head": self.head[...]}
        if hasattr(self, "final_norm_bias"):
            head["final_norm_bias"] = self.final_norm_bias[...]
        return logits(head, x)

    def __call__(
        self, tokens: jax.Array, *, remat: str = "none", segments: api.Segments | None = None
    ) -> jax.Array:
        """Logits [B, T, V]; `segments`: packed documents' (segment_ids, positions) [B, T]."""
        x = self.embed_tokens(tokens)
        layer = functools.partial(block, attention=self.cfg.attention, segments=segments)
        x = api.scan_layers(
            layer, self.blocks.stacked(), x, remat=remat, unroll=self.cfg.scan_unroll
        )
        return self.logits(x)

    def loss(self, batch: dict[str, jax.Array], *, remat: str = "none") -> tuple[jax.Array, dict]:
        """Mean next-token cross-entropy (computed in float32) over the batch; a packed batch
        (`segment_ids`, `positions`) attends per document and skips its -1 targets."""
        segments = api.segments_of(batch)
        logits = self(batch["inputs"], remat=remat, segments=segments).astype(jnp.float32)
        if segments is not None:
            return api.masked_token_cross_entropy(logits, batch["targets"]), {}
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
        return loss, {}


def batch_axes() -> dict[str, tuple[str, ...]]:
    return {"inputs": ("batch", "length"), "targets": ("batch", "length")}


def flops_per_token(cfg, params: dict[str, Any]) -> float:
    """6·N (N without the embedding table, whose lookup is no matmul) + 12·L·D·T attention."""
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(params)) - math.prod(params["embed"].shape)
    return api.decoder_flops_per_token(n, cfg.num_layers, cfg.d_model, cfg.seq_len)


def layer_activations(D: int, F: float, NT: int) -> tuple[api.Activation, ...]:
    """One pre-norm decoder layer's activations per token (D wide, F MLP units, NT float32
    attention scores, 0 when attention is fused), as XLA:CPU's buffer assignment shows them for
    this model; they agree with what `jax.vjp` of the layer scan saves. The GELU's backward
    recomputes its tanh from its input (`_gelu`), so no policy keeps its four tanh pieces."""
    A = api.Activation
    return (
        A("layer input x", D, "input"),
        A("attention block output", D, "dot"),
        A("norms, residual sums", 4 * D, "elementwise"),
        A("q, k, v", 3 * D, "dot", split=True),
        A("attention output o", D, "batch_dot", split=True),
        A("MLP up-projection", F, "dot", split=True),
        A("GELU output", F, "elementwise", split=True),
        A("GELU's tanh pieces", 4 * F, "transient", split=True),
        A("attention scores", NT, "batch_dot", split=True, float32=True),
        A("softmax probabilities", NT, "elementwise", split=True, float32=True),
    )


def plan_cost(cfg, params: dict[str, Any]) -> api.PlanCost:
    """The planner's accounting (`api.PlanCost`): per layer, 2 tensor-parallel all-reduces
    forward (attention and MLP outputs), 2 backward (QKV and up-projection input grads) and the
    attention output's again when the dots are not kept (its norm needs it)."""
    D, T, F = cfg.d_model, cfg.seq_len, cfg.mlp_dim or 4 * cfg.d_model
    NT = cfg.num_heads * T if cfg.attention != "cudnn" else 0
    return api.PlanCost(
        label="GPT",
        num_layers=cfg.num_layers,
        width=D,
        seq_len=T,
        vocab_size=cfg.vocab_size,
        activations=layer_activations(D, F, NT),
        attention_flops=12.0 * D * T,
        scores=cfg.num_heads * T,
        attention=cfg.attention,
        tensor_all_reduces=(2, 2, 1),
        block_matmuls=((D, 3 * D), (D, D), (D, F), (F, D)),  # wqkv, wo, w_up, w_down
    )


def describe(cfg) -> dict[str, Any]:
    return {
        "layers": cfg.num_layers,
        "d_model": cfg.d_model,
        "heads": cfg.num_heads,
        "vocab": cfg.vocab_size,
        "seq_len": cfg.seq_len,
    }


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def check(m, mesh: Mapping[str, int]) -> None:
    """Shape fields the mesh must split evenly: heads and MLP over `tensor`, `embed` over `fsdp`."""
    t = mesh["tensor"]
    check_sizes(m)
    _need(
        m.d_model % m.num_heads == 0,
        f"model.d_model={m.d_model} must be divisible by model.num_heads={m.num_heads}",
    )
    _need(
        m.num_heads % t == 0, f"model.num_heads={m.num_heads} must be divisible by mesh.tensor={t}"
    )
    mlp_dim = m.mlp_dim or 4 * m.d_model
    _need(mlp_dim % t == 0, f"model.mlp_dim={mlp_dim} must be divisible by mesh.tensor={t}")
    check_embed_split(m, mesh)
    check_lowering(m)


def check_sizes(m) -> None:
    """The shape fields every decoder has (layers, width, heads, length, vocabulary): positive."""
    for name in ("num_layers", "d_model", "num_heads", "seq_len", "vocab_size"):
        value = m[name]
        _need(
            isinstance(value, int) and value > 0,
            f"model.{name}={value!r} must be a positive integer",
        )


def check_embed_split(m, mesh: Mapping[str, int]) -> None:
    """The vocabulary over `tensor` and `embed` over `fsdp`: the embedding's and head's splits."""
    t = mesh["tensor"]
    _need(
        m.vocab_size % t == 0,
        f"model.vocab_size={m.vocab_size} must be divisible by mesh.tensor={t}",
    )
    _need(
        m.d_model % mesh["fsdp"] == 0,
        f"model.d_model={m.d_model} must be divisible by mesh.fsdp={mesh['fsdp']} "
        "(parameters are sharded over fsdp along embed)",
    )


def check_lowering(m) -> None:
    """How the embedding's gradient (`embed_grad`) and the layer loop (`scan_unroll`) lower."""
    _need(
        m.embed_grad in ("scatter", "matmul"),
        f"model.embed_grad={m.embed_grad!r} must be 'scatter' or 'matmul'",
    )
    _need(
        isinstance(m.scan_unroll, int) and m.scan_unroll >= 1,
        f"model.scan_unroll={m.scan_unroll!r} must be an integer >= 1 (1 = a rolled layer loop; "
        f"model.num_layers={m.num_layers}: no loop)",
    )


def check_data(config, ds) -> None:
    """Token data whose ids fit the vocabulary."""
    m = config.model
    _need(
        ds.kind == "tokens",
        f"model.name={m.name!r} needs token data, but data.source={config.data.source!r} holds images",
    )
    _need(
        ds.vocab_size <= m.vocab_size,
        f"model.vocab_size={m.vocab_size} is smaller than the data's {ds.vocab_size} token ids",
    )


def stages(cfg) -> api.Stages:
    """Embedding / stacked `blocks` / final norm + head, for the pipeline."""
    split, join = api.split_by_keys(embed=("embed",), layers="blocks")
    return api.Stages(
        split=split,
        join=join,
        embed=functools.partial(embed_tokens, embed_grad=cfg.embed_grad),
        block=functools.partial(block, attention=cfg.attention),
        head_loss=head_loss,
        head_logits=logits,
    )


FAMILY = api.ModelFamily(
    name="gpt",
    make=lambda cfg, ds: lambda rngs: GPT(cfg, rngs=rngs),
    batch_axes=lambda cfg, ds: batch_axes(),
    check=check,
    check_data=check_data,
    flops_per_token=flops_per_token,
    tokens_per_example=lambda cfg: cfg.seq_len,
    stages=stages,
    plan_cost=plan_cost,
    packing=True,
)
