"""The model protocol: what a model family declares so jaxdist can build, train, pipeline and cost it.

A family is one `ModelFamily` value (one per file in `models/`, registered by `model.name` in
`models/__init__.py`). The library never imports a family or reads its parameter names: the engine
asks it for a constructor, the logical axes of a batch and a loss; the layout record for FLOPs per
token; and the pipeline, if the family can be pipelined, for its `Stages`:

    batch["inputs"] --embed--> x [B, ...] --block × L (stacked layers)--> x --head_loss(targets)--> loss

Parameters are pure dicts (as `nnx.to_pure_dict` gives them); `Stages.split` cuts one into the
embedding's, the stacked layers' (every leaf with a leading `layers` axis of `model.num_layers`) and
the head's parts, and works on any tree with the same structure (the logical axes, the gradients).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

Params = dict[str, Any]
Batch = dict[str, jax.Array]


def _dots_no_batch_and_fused_attention(prim, *args, **params) -> bool:
    """Matmul outputs without batch dimensions, and the fused (cuDNN flash) attention's outputs
    (its result and softmax statistics), so the backward pass does not run attention again. On
    backends without fused attention this is `dots_with_no_batch_dims_saveable`."""
    return jax.checkpoint_policies.dots_with_no_batch_dims_saveable(
        prim, *args, **params
    ) or prim.name.startswith("dot_product_attention_fwd")


# `train.remat` names → what a layer keeps for its backward; "none" keeps everything.
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": _dots_no_batch_and_fused_attention,
}


def remat_names() -> tuple[str, ...]:
    """Every valid `train.remat`."""
    return ("none", *REMAT_POLICIES)


def scan_layers(
    block: Callable[[Params, jax.Array], jax.Array],
    stacked: Params,
    x: jax.Array,
    *,
    remat: str = "none",
    unroll: int = 1,
) -> jax.Array:
    """Applies stacked layers in order with `lax.scan` (compile time flat in depth).

    Args:
      block: one layer, pure: (one layer's params, x) -> x.
      stacked: every layer's params, each leaf with a leading [L] axis.
      x: the activations, e.g. [B, T, D].
      remat: a `train.remat` name: what each layer keeps for its backward.
      unroll: layers per loop iteration (`model.scan_unroll`). A rolled scan keeps compile time
        flat in depth, but on GPUs each iteration copies its slice of the stacked weights and its
        saved activations in and out of [L, ...] buffers (memcpy kernels: ~57 ms of gpt_1b's
        610 ms step on an H100); unrolled, those are separate buffers.
    """
    fn = block if remat == "none" else jax.checkpoint(block, policy=REMAT_POLICIES[remat])

    def body(h, lp):
        return fn(lp, h), None

    x, _ = jax.lax.scan(body, x, stacked, unroll=min(unroll, len(jax.tree.leaves(stacked)[0])))
    return x


def token_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy over [B, T] tokens, in float32, written without a gather.

    A `head_loss` runs inside the pipeline's shard_map, manual over `pipeline`; XLA's SPMD
    partitioner aborts on the integer-label gather there when two other mesh axes shard the logits,
    so the label's logit is picked with a one-hot product instead.
    """
    logits = logits.astype(jnp.float32)
    label = jnp.sum(jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype) * logits, -1)
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - label)


def decoder_flops_per_token(n_params: int, num_layers: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) of a decoder transformer: 6N + 12·L·d·T.

    6N counts the matmuls against the parameters (2 forward, 4 backward per parameter); 12·L·d·T
    the attention scores and weighted sum, which grow with context length rather than with N.

    Args:
      n_params: parameter count N (non-embedding, or total if that is what you report).
      num_layers: L.
      d_model: d, the residual width.
      seq_len: T, tokens per sequence.
    """
    return 6.0 * n_params + 12.0 * num_layers * d_model * seq_len


@dataclasses.dataclass(frozen=True)
class Stages:
    """The three pieces a pipeline needs, as pure functions of parameter sub-trees.

    Attributes:
      split: params -> (embed part, stacked layers, head part); also splits any tree shaped like
        the params (logical axes, gradients).
      join: the inverse of `split`.
      embed: (embed part, batch["inputs"]) -> activations x, logical axes `activation_axes`.
      block: (one layer's params, x) -> x, shape-preserving; the layers are `split(params)[1]`
        with their leading [L] axis taken off.
      head_loss: (head part, x, batch["targets"]) -> mean loss over the rows of x, float32, with
        no gather over a sharded axis (see `token_cross_entropy`).
      activation_axes: logical axes of x.
      aux_zero: None, or `like -> zero statistics` (a dict of float32 arrays, `like`'s manual
        axis types): `block` then returns (x, statistics of its layer), each a mean over the
        block's tokens, so that the mean over token shards (and microbatches) is the whole
        batch's; they are summed over the layers (`stage_layers`).
      aux_loss: (statistics summed over layers, averaged over microbatches) -> (the term added
        to the loss, linear in the statistics; metrics). Used when `aux_zero` is set.
      order: sequence length -> the storage order of the length axis the blocks expect (e.g.
        ring attention's zig-zag over `mesh.context`, read from the active mesh), or None for
        the natural order; the pipeline permutes inputs and targets by it before the embedding.
    """

    split: Callable[[Any], tuple[Any, Any, Any]]
    join: Callable[[Any, Any, Any], Any]
    embed: Callable[[Params, jax.Array], jax.Array]
    block: Callable[[Params, jax.Array], jax.Array]
    head_loss: Callable[[Params, jax.Array, jax.Array], jax.Array]
    activation_axes: tuple[str | None, ...] = ("batch", "length", "embed")
    order: Callable[[int], Any] = lambda length: None
    aux_zero: Callable[[jax.Array], dict[str, jax.Array]] | None = None
    aux_loss: Callable[[dict[str, jax.Array]], tuple[jax.Array, dict]] | None = None


def stage_layers(
    stages: Stages, stacked: Params, x: jax.Array, *, remat: str = "none"
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`stages.block` over stacked layers (`scan_layers`): (x, the blocks' statistics summed over
    the layers, {} for a family without `aux_zero`)."""
    if stages.aux_zero is None:
        return scan_layers(stages.block, stacked, x, remat=remat), {}

    def block(lp, carry):
        y, stats = stages.block(lp, carry[0])
        return y, jax.tree.map(jnp.add, carry[1], stats)

    return scan_layers(block, stacked, (x, stages.aux_zero(x)), remat=remat)


def split_by_keys(
    embed: tuple[str, ...], layers: str
) -> tuple[Callable[[Any], tuple[Any, Any, Any]], Callable[[Any, Any, Any], Any]]:
    """(split, join) for params whose top-level keys `embed` form the embedding, `layers` holds
    the stacked layers, and every other key belongs to the head."""

    def split(tree):
        head = {k: v for k, v in tree.items() if k not in embed and k != layers}
        return {k: tree[k] for k in embed}, tree[layers], head

    def join(e, stacked, head):
        return {**e, layers: stacked, **head}

    return split, join


def _no_check(*_: Any) -> None:
    return None


def param(value: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
    """A parameter that names its logical axes (`sharding.py` maps them onto the mesh)."""
    return nnx.Param(value, logical_axes=axes)


def module_loss(model: nnx.Module, batch: Batch, *, remat: str = "none") -> tuple[jax.Array, dict]:
    """The default `ModelFamily.loss`: the module's own `loss(batch, remat=)`."""
    return model.loss(batch, remat=remat)


@dataclasses.dataclass(frozen=True)
class Decoder:
    """What generation needs from a decoder family: the network against a fixed-size key/value
    cache, the same function for a prompt's prefill and for one-token decode steps.

    Attributes:
      init_cache: (batch, length, dtype) -> zeroed cache (a pytree).
      cache_axes: logical axes of each cache leaf (a pytree like the cache).
      forward: (params, tokens [B, T], start [B], cache) -> (logits [B, T, V] float32, cache):
        the tokens placed at positions start[b] + t, each attending to cached positions <= its own.
    """

    init_cache: Callable[[int, int, Any], Any]
    cache_axes: Any
    forward: Callable[[Params, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One parameter and its Hugging Face tensor (one layer's, for stacked parameters).

    Attributes:
      path: the parameter's keys in the params dict; a stacked one (leading [L] axis) starts
        with the family's layers key and its `hf_name` has "{i}" for the layer index.
      hf_name: the tensor's name in the safetensors files.
      hf_shape: the tensor's shape there.
      to_jax: HF array -> the parameter's array (one layer's).
      to_hf: the parameter's array (one layer's) -> HF array.
      stacked: whether the parameter has a leading [L] axis.
    """

    path: tuple[str, ...]
    hf_name: str
    hf_shape: tuple[int, ...]
    to_jax: Callable[[Any], Any]
    to_hf: Callable[[Any], Any]
    stacked: bool = False


@dataclasses.dataclass(frozen=True)
class HFFormat:
    """How a family reads and writes Hugging Face checkpoints (`scripts/hf.py`, jaxdist/hf.py).

    Attributes:
      architectures: the `architectures` entries of config.json this family imports.
      config_from_hf: (config.json dict, config.model to fill in, where) -> None; raises a
        one-line ConfigError naming `where` and the field it cannot take.
      config_to_hf: (config.model, dtype name) -> config.json dict.
      tensors: config.model -> every parameter's `HFTensor`, in the params' tree order.
      ignored: config.model -> suffixes of HF tensor names that are read past (buffers such as
        `rotary_emb.inv_freq`, a tied head stored twice).
    """

    architectures: tuple[str, ...]
    config_from_hf: Callable[[Mapping[str, Any], Any, str], None]
    config_to_hf: Callable[[Any, str], dict[str, Any]]
    tensors: Callable[[Any], list[HFTensor]]
    ignored: Callable[[Any], tuple[str, ...]] = lambda cfg: ()


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One model family, as the engine, the config check, the layout record and the pipeline see it.

    Attributes:
      name: its `model.name`.
      make: (config.model, dataset) -> constructor `rngs -> nnx.Module` whose `nnx.Param`s carry
        `logical_axes` metadata. The dataset (`jaxdist.data.Dataset`: `kind`, `vocab_size`,
        `example_shape`, `num_classes`) may be None where the family needs no fact from it.
      batch_axes: (config.model, dataset) -> logical axes of each batch entry.
      check: (config.model, resolved mesh shape) -> None; raises a one-line ConfigError for a
        model field the mesh cannot split (run by `config.validate`).
      check_data: (config, dataset) -> None; raises a one-line ConfigError when the data does not
        fit the model (run by `train.build`).
      loss: (module, batch, remat=) -> (mean loss, aux metrics).
      flops_per_token: (config.model, params or their shapes) -> training FLOPs per token, or None
        where the family has no token count (the layout record then reports no MFU).
      tokens_per_example: config.model -> tokens in one example, or None (throughput in examples).
      stages: config.model -> `Stages`, or None for a family that cannot be pipelined.
      decoder: config.model -> `Decoder`, or None for a family that cannot generate.
      hf: its Hugging Face form (`HFFormat`), or None.
    """

    name: str
    make: Callable[[Any, Any], Callable[[nnx.Rngs], nnx.Module]]
    batch_axes: Callable[[Any, Any], dict[str, tuple[str | None, ...]]]
    check: Callable[[Any, Mapping[str, int]], None] = _no_check
    check_data: Callable[[Any, Any], None] = _no_check
    loss: Callable[..., tuple[jax.Array, dict]] = module_loss
    flops_per_token: Callable[[Any, Params], float] | None = None
    tokens_per_example: Callable[[Any], int] | None = None
    stages: Callable[[Any], Stages] | None = None
    decoder: Callable[[Any], Decoder] | None = None
    hf: HFFormat | None = None


@dataclasses.dataclass(frozen=True)
class AbstractModel:
    """A model's structure without its values: what `jax.eval_shape` of its constructor gives.

    Attributes:
      graphdef, template: `nnx.split(module, nnx.Param)`, to rebuild the module from a pure dict.
      params: pure dict of `jax.ShapeDtypeStruct`s.
      axes: pure dict like `params`, each leaf the parameter's logical axes tuple.
    """

    graphdef: Any
    template: Any
    params: Params
    axes: Params

    def merge(self, params: Params) -> nnx.Module:
        """The module with these parameter values (a pure dict shaped like `self.params`)."""
        state = jax.tree.map(lambda v: v, self.template)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)


def abstract_model(make: Callable[[nnx.Rngs], nnx.Module]) -> AbstractModel:
    """Shapes, structure and logical axes of the module `make` builds; nothing is materialised."""
    module = jax.eval_shape(lambda: make(nnx.Rngs(0)))
    graphdef, template = nnx.split(module, nnx.Param)
    params = nnx.to_pure_dict(template)
    variables = jax.tree.leaves(template, is_leaf=lambda x: isinstance(x, nnx.Variable))
    axes = [tuple(v.get_metadata()["logical_axes"]) for v in variables]
    return AbstractModel(
        graphdef, template, params, jax.tree.unflatten(jax.tree.structure(params), axes)
    )
