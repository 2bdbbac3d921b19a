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

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdist import fp8

Params = dict[str, Any]
Batch = dict[str, jax.Array]


def _dots_no_batch_and_fused_attention(prim, *args, **params) -> bool:
    """Matmul outputs without batch dimensions, and the fused (cuDNN flash) attention's outputs
    (its result and softmax statistics), so the backward pass does not run attention again. On
    backends without fused attention this is `dots_with_no_batch_dims_saveable`."""
    return jax.checkpoint_policies.dots_with_no_batch_dims_saveable(
        prim, *args, **params
    ) or prim.name.startswith("dot_product_attention_fwd")


# What a layer's activations are, for the planner (`RematPolicy.keeps` names these kinds):
#   input:       the layer's input (the scan's carry), kept by every policy;
#   dot:         a matmul output without batch dimensions (projections against the weights);
#   batch_dot:   a matmul output with batch dimensions (attention scores, their weighted sum);
#   elementwise: everything else the forward computes and autodiff keeps (norms, activations,
#                residual sums, softmax probabilities);
#   transient:   computed, kept by no policy (the backward recomputes it), so it counts in the
#                working set of a layer's backward only.
ACTIVATION_KINDS = ("input", "dot", "batch_dot", "elementwise", "transient")


@dataclasses.dataclass(frozen=True)
class RematPolicy:
    """One `train.remat` choice: what `jax.checkpoint` keeps of a layer, and what that costs.

    Attributes:
      name: its `train.remat` value.
      policy: the `jax.checkpoint` policy, or None for no checkpoint at all (the backward keeps
        every activation, and the layer's weights as the scan's residuals).
      keeps: the `ACTIVATION_KINDS` of a layer's activations the backward keeps (the planner's
        saved bytes; what it drops it recomputes: FLOPs and, for dots, their collectives).
      working_set: the working set of one layer's backward (cotangents, slices of the saved
        stacks, what the policy recomputes) as a multiple of the layer's full activation set, read
        from XLA:CPU's buffer assignment (`--xla_dump_to`, memory-usage report) of the GPT at
        d_model 128-256, T 64-128, F 512-1024 from the change in temp between 2 and 4 rows: none
        0.70-0.83, dots 0.65-0.97, dots_no_batch 0.65-0.90; with `full` that marginal figure is
        1.24-1.33 but the whole working set at 1-2 rows per device is 0.9 of the layer's
        activations (the peak moves). Since the GPT's GELU keeps only its input, none and dots
        take the ends of their ranges (docs/PLANNER.md).
      keeps_fused_attention: whether fused (flash) attention's outputs are kept, so its backward
        does not run attention again even though batch dots are dropped.
    """

    name: str
    policy: Callable[..., bool] | None
    keeps: frozenset[str]
    working_set: float
    keeps_fused_attention: bool = False

    @property
    def recomputes(self) -> bool:
        """Whether the backward runs the layer's forward again (any checkpoint policy)."""
        return self.policy is not None


# `train.remat` names → what a layer keeps for its backward; "none" keeps everything. The one
# registry of remat policies: scan_layers, config validation and the planner read it.
REMAT: dict[str, RematPolicy] = {
    p.name: p
    for p in (
        RematPolicy("none", None, frozenset(ACTIVATION_KINDS[:-1]), 0.83),
        RematPolicy("full", jax.checkpoint_policies.nothing_saveable, frozenset({"input"}), 0.9),
        RematPolicy(
            "dots",
            jax.checkpoint_policies.checkpoint_dots,
            frozenset({"input", "dot", "batch_dot"}),
            0.65,
        ),
        RematPolicy(
            "dots_no_batch",
            _dots_no_batch_and_fused_attention,
            frozenset({"input", "dot"}),
            0.7,
            keeps_fused_attention=True,
        ),
    )
}
# name → jax.checkpoint policy, for the policies that checkpoint; each also keeps the FP8 scales
# (`fp8.SCALE_NAME`: one float32 per cast operand), so a recomputed layer does not take the
# amax of its operands again.
REMAT_POLICIES = {
    name: jax.checkpoint_policies.save_from_both_policies(
        p.policy, jax.checkpoint_policies.save_only_these_names(fp8.SCALE_NAME)
    )
    for name, p in REMAT.items()
    if p.policy is not None
}


def remat_names() -> tuple[str, ...]:
    """Every valid `train.remat`."""
    return tuple(REMAT)


LayerLoop = Callable[[Callable[[Params, Any], Any], Params, Any, int], Any]
_LAYER_LOOP: contextvars.ContextVar[LayerLoop | None] = contextvars.ContextVar(
    "layer_loop", default=None
)


@contextlib.contextmanager
def layer_loop(loop: LayerLoop) -> Iterator[None]:
    """While tracing inside this block, `scan_layers` runs its layers with
    `loop(block, stacked, x, unroll)` (the block already rematerialized as `train.remat` says)
    instead of its own `lax.scan`: jaxdist/overlap.py's loop reduces each layer's gradient inside
    the backward."""
    token = _LAYER_LOOP.set(loop)
    try:
        yield
    finally:
        _LAYER_LOOP.reset(token)


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
    if (loop := _LAYER_LOOP.get()) is not None:
        return loop(fn, stacked, x, unroll)

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


def masked_token_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy over the [B, T] tokens whose target is >= 0, gather-free, in float32.

    `data.packing=documents` marks a target that would cross a document boundary, and padding,
    with -1 (`jaxdist.data.NO_TARGET`): its one-hot row is zero and it is left out of the mean.
    """
    valid = targets >= 0
    total = summed_token_cross_entropy(logits, targets)
    return total / jnp.maximum(jnp.sum(valid), 1).astype(jnp.float32)


def summed_token_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Summed cross-entropy over the [B, T] tokens whose target is >= 0, gather-free, float32
    (the pipeline divides it by the whole batch's target count: `masked_token_cross_entropy`'s
    mean however the batch is cut into microbatches)."""
    logits = logits.astype(jnp.float32)
    valid = targets >= 0
    label = jnp.sum(jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype) * logits, -1)
    return jnp.sum(jnp.where(valid, jax.nn.logsumexp(logits, axis=-1) - label, 0.0))


Segments = tuple[jax.Array, jax.Array]  # (segment_ids [B, T], positions [B, T]) of packed rows


def segments_of(batch: Batch) -> Segments | None:
    """A packed batch's (segment_ids, positions) (`data.packing=documents`), else None."""
    if "segment_ids" not in batch:
        return None
    return batch["segment_ids"], batch["positions"]


def segment_mask(q_seg: jax.Array, k_seg: jax.Array) -> jax.Array:
    """[B, 1, Tq, Tk] bool: query and key in the same segment (document), for
    `jax.nn.dot_product_attention(mask=...)`; combined there with the causal mask."""
    return (q_seg[:, :, None] == k_seg[:, None, :])[:, None]


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
class Activation:
    """One activation of a layer's forward, per token: what the planner prices as kept or recomputed.

    Attributes:
      name: what it is (docs and debugging only).
      width: elements per token.
      kind: one of `ACTIVATION_KINDS`; `RematPolicy.keeps` says which kinds each policy keeps.
      split: divided over the tensor axis (heads, MLP units) rather than replicated on it.
      float32: always float32 (attention scores) rather than in the activation dtype.
    """

    name: str
    width: float
    kind: str
    split: bool = False
    float32: bool = False


@dataclasses.dataclass(frozen=True)
class PlanCost:
    """What the planner (jaxdist/plan/) needs of a family beyond its parameter and optimizer-state
    shapes (which it reads from `jax.eval_shape`) and its `flops_per_token`: one layer's
    activations and collectives, per token. A decoder's stacked layers run on [b, T, D] streams.

    Attributes:
      label: the model in words for the planner's summary, e.g. "GPT", "Llama (MoE)".
      num_layers: L, the stacked layers.
      width: D, the residual stream's width: what crosses pipeline stages and what a tensor-
        parallel all-reduce carries, per token.
      seq_len: T, tokens per example.
      vocab_size: V, the head's logits per token (float32 in the loss).
      activations: every activation of one layer's forward (`Activation`); the kept ones per
        policy are its saved bytes, all of them the unit of its backward's working set.
      attention_flops: model FLOPs per token of one layer's attention (12·D·T forward and
        backward), the part of `flops_per_token` that is no matmul against weights; 0: none.
      scores: float32 attention scores per token of one layer when attention is not fused
        (heads × T): the bytes unfused attention moves.
      attention: `model.attention` ("xla", "cudnn", "auto"), whether attention runs fused.
      tensor_all_reduces: [b, T, D] all-reduces one layer runs over `mesh.tensor`, as
        (forward, backward, re-run in the backward by a policy that drops the dots).
      context_parallel: whether the family runs attention over `mesh.context`
        (models/attention.py, reading `model.num_kv_heads`, `model.head_dim`,
        `model.context_attention`); the planner searches `mesh.context` only then.
      idle_params: parameters a token does not pass through (an MoE's unchosen experts).
      block_matmuls: (K, N) of each matmul of one layer that goes through `fp8.einsum` (K the
        contracted size, N the weight's output size, global): what `train.matmul_precision`
        may run in FP8 (`fp8.eligible`); empty: none.
    """

    label: str
    num_layers: int
    width: int
    seq_len: int
    vocab_size: int
    activations: tuple[Activation, ...]
    attention_flops: float = 0.0
    scores: int = 0
    attention: str = "xla"
    tensor_all_reduces: tuple[int, int, int] = (0, 0, 0)
    context_parallel: bool = False
    idle_params: int = 0
    block_matmuls: tuple[tuple[int, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class Stages:
    """The three pieces a pipeline needs, as pure functions of parameter sub-trees.

    Attributes:
      split: params -> (embed part, stacked layers, head part); also splits any tree shaped like
        the params (logical axes, gradients).
      join: the inverse of `split`.
      embed: (embed part, batch["inputs"]) -> activations x, logical axes `activation_axes`.
      block: (one layer's params, x) -> x, shape-preserving; the layers are `split(params)[1]`
        with their leading [L] axis taken off. A family with `ModelFamily.packing` also takes
        `segments=` (a packed microbatch's `Segments`): attention per document, rotary positions
        per document (`data.packing=documents` through the pipeline).
      head_loss: (head part, x, batch["targets"]) -> mean loss over the rows of x, float32, with
        no gather over a sharded axis (see `token_cross_entropy`).
      head_logits: None, or (head part, x) -> logits [b, T, V]: the pipeline's head for packed
        batches, whose loss skips the -1 targets and is weighted by the whole batch's target
        count (`summed_token_cross_entropy`); needed to pipeline `data.packing=documents`.
      activation_axes: logical axes of x.
      aux_zero: None, or `like -> zero statistics` (a dict of float32 arrays, `like`'s manual
        axis types): `block` then returns (x, statistics of its layer), each a mean over the
        block's tokens, so that the mean over token shards (and microbatches) is the whole
        batch's; they are summed over the layers (`stage_layers`).
      aux_loss: (statistics summed over layers, averaged over microbatches) -> (the term added
        to the loss; metrics). Used when `aux_zero` is set.
      aux_linear: `aux_loss`'s term is linear in the statistics (the Llama family's per-layer
        router losses), so the schedules that add it per microbatch and per device (1f1b, zb,
        any schedule inside grad_sync's shard_map) get the batch's term by summing. False for a
        term that is not (Mixtral's pooled product of two means): those schedules first run the
        forward ticks once without gradient for the batch's statistics and add the term's
        linearization there (`pipeline.gradients`): the same loss and gradient, one more
        forward pass a step. gpipe and interleaved differentiate the term of the batch's
        statistics directly either way.
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
    aux_linear: bool = True
    head_logits: Callable[[Params, jax.Array], jax.Array] | None = None


def stage_layers(
    stages: Stages,
    stacked: Params,
    x: jax.Array,
    *,
    remat: str = "none",
    segments: Segments | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`stages.block` over stacked layers (`scan_layers`): (x, the blocks' statistics summed over
    the layers, {} for a family without `aux_zero`); `segments`: a packed microbatch's, handed
    to every block."""
    one = stages.block if segments is None else functools.partial(stages.block, segments=segments)
    if stages.aux_zero is None:
        return scan_layers(one, stacked, x, remat=remat), {}

    def block(lp, carry):
        y, stats = one(lp, carry[0])
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
      experts: E > 0 when each expert is its own tensor (Mixtral's `experts.{e}.w1`): the
        parameter's axis after [L] (its first, unstacked) is [E], `hf_name` has "{e}" for the
        expert index, and `to_jax`/`to_hf` convert one expert's array.
    """

    path: tuple[str, ...]
    hf_name: str
    hf_shape: tuple[int, ...]
    to_jax: Callable[[Any], Any]
    to_hf: Callable[[Any], Any]
    stacked: bool = False
    experts: int = 0


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
      plan_cost: (config.model, params or their shapes) -> `PlanCost`, or None for a family the
        planner does not model (it then says so, and predicts and guards nothing).
      packing: whether its `loss` takes packed batches (`data.packing=documents`): attention
        within each `segment_ids` document, rotary `positions`, -1 targets skipped; through the
        pipeline its `Stages.block` takes `segments=` and `Stages.head_logits` is set.
      mesh_axes: the optional mesh axes ("context", "expert") its layers run over; config
        validation refuses `mesh.context`/`mesh.expert` > 1 for a family without them.
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
    plan_cost: Callable[[Any, Params], PlanCost] | None = None
    packing: bool = False
    mesh_axes: frozenset[str] = frozenset()


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
