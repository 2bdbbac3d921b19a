"""`grad_sync.overlap`: the gradient's exchange placed beside compute, in one XLA program.

PyTorch DDP puts gradients in buckets in the order the backward makes them and starts each bucket's
all-reduce while the backward of the earlier layers still computes. jaxdist's other data-parallel
strategies reduce the whole gradient after the whole backward (`collectives.sync_grads`,
`allreduce.reducer`). The per-replica gradient runs here in a `shard_map` over `data` (its loss
under `sharding.per_replica_loss`: the MoE router's load is the batch's), in one of two ways (the
`overlapped` strategy, jaxdist/strategies.py):

- `backward`: buckets inside the backward. One per layer: `models.api.scan_layers` hands its layers
  to `ReducingLoop` (`api.layer_loop`), whose backward loop reduces layer l+1's gradient in the
  iteration that computes layer l's, two pieces of work with no dependency between them; and one
  per other parameter (embedding, head, norms), reduced when its gradient is complete (the
  backward of an identity, `reduce_in_backward`). The layers' reductions sit in one loop, so XLA
  cannot merge them: an unrolled backward with a `psum` per layer compiles to one all-reduce
  after the whole backward (XLA's all-reduce combiner).
- `next_step`: `local_grads` reduces the previous step's per-replica gradient (held in the train
  state) beside this step's forward and backward; the update applies it, as staleness 1 does.

Each bucket is one flat f32 buffer reduced by `grad_sync.algorithm` (`allreduce.mean_tree`) or,
with `grad_sync.compression=bf16`, by `compression.casts.bf16`'s two-phase exchange: elementwise
the same sums as the unoverlapped strategies (a ring's chunks follow the bucket, so its float sums
are reordered; tests/test_overlap.py gives the tolerances). Pure data parallelism only: every
other mesh axis 1, no gradient accumulation, no stateful compressor.

On XLA:CPU with gloo neither mode hides any of the transfer (docs/AGGREGATION.md, "Overlapping
the exchange with compute"): the placement is what a backend with asynchronous collectives needs,
not measured here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxdist import allreduce, sharding
from jaxdist.compression import casts
from jaxdist.errors import ConfigError
from models import api

Reduce = Callable[[Any], Any]  # a tree of one replica's gradients -> their mean over replicas
COMPRESSIONS = ("none", "bf16", "fp16")  # stateless per bucket
MODES = {
    "none": "the whole gradient reduced after the backward",
    "backward": "each layer reduced inside the backward",
    "next_step": "each step's gradient reduced during the next step's compute, staleness 1",
}
OTHER_AXES = ("fsdp", "expert", "context", "tensor", "pipeline")
LAYERS_AXIS = "layers"
KEY = "held_grads"  # next_step: the train state entry holding each replica's unreduced gradient


def reduce_in_backward(reduce: Reduce) -> Callable[[Any], Any]:
    """The identity on a tree whose backward returns `reduce(cotangent)`."""

    @jax.custom_vjp
    def ident(tree):
        return tree

    def fwd(tree):
        return tree, None

    def bwd(_, ct):
        return (reduce(ct),)

    ident.defvjp(fwd, bwd)
    return ident


def bucket_reducer(grad_sync, axis: str, hosts: int) -> Reduce:
    """One bucket's mean over `axis`, as `grad_sync` (compression, algorithm) says, the bucket's
    tensors sent as one buffer. bf16's two-phase mean is elementwise (each element rounded to
    bf16, summed over replicas in replica order in f32, the mean rounded), so cutting the buffer
    differently leaves every element's value as the per-tensor `compressed` strategy's. fp16's
    float16 sum is rounded at each addition in the order the all-reduce adds (gloo's ring starts
    each chunk at another host), so its last bits may move with the bucketing."""
    if grad_sync.compression in ("fp16", "bf16"):
        tx = getattr(casts, grad_sync.compression)(axis)
        return lambda tree: allreduce.as_one_buffer(tree, lambda flat: tx.update(flat, None)[0])
    return lambda tree: allreduce.mean_tree(tree, axis, grad_sync.algorithm, hosts)


def is_layer_leaf(axes: tuple) -> bool:
    """A stacked-layer parameter: its logical axes start with `layers` (reduced per layer)."""
    return len(axes) > 0 and axes[0] == LAYERS_AXIS


class ReducingLoop:
    """A layer loop (`models.api.layer_loop`) whose backward reduces layer l+1's gradient while it
    computes layer l's.

    Forward: a scan keeping each layer's vjp residuals (`jax.vjp`'s function is a pytree; the
    leaves that are the layer's own parameters are not stacked again, as in
    `pipeline.vjp.StashedVjp`). Backward: the top layer's vjp, then a reversed scan whose iteration
    for layer l runs layer l's vjp and `reduce` of the gradient the previous iteration made (layer
    l+1's), which do not depend on each other, then `reduce` of layer 0's after the loop. Every
    layer is reduced once; the loop is one while loop, so XLA cannot merge the reductions into one
    after the backward (it does merge independent all-reduces).
    """

    def __init__(self, reduce: Reduce):
        self.reduce = reduce
        self.calls = 0

    def __call__(self, block, stacked, x, unroll: int):
        self.calls += 1
        layout = {}
        n = len(jax.tree.leaves(stacked)[0])

        def forward(stacked, x):
            def body(h, lp):
                y, vjp = jax.vjp(block, lp, h)
                leaves, layout["tree"] = jax.tree.flatten(vjp)
                ids = {id(leaf): k for k, leaf in enumerate(jax.tree.leaves(lp))}
                layout["where"] = [ids.get(id(leaf), -1) for leaf in leaves]
                return y, [leaf for leaf, w in zip(leaves, layout["where"]) if w < 0]

            y, stash = jax.lax.scan(body, x, stacked, unroll=min(unroll, n))
            return y, (stacked, stash)

        def layer_vjp(lp, stash, dy):
            own, rest = jax.tree.leaves(lp), iter(stash)
            leaves = [own[w] if w >= 0 else next(rest) for w in layout["where"]]
            return jax.tree.unflatten(layout["tree"], leaves)(dy)

        def backward(res, dy):
            stacked, stash = res
            top = jax.tree.map(lambda a: a[-1], (stacked, stash))
            pending, dh = layer_vjp(*top, dy)

            def body(carry, inputs):
                dh, pending = carry
                reduced = self.reduce(pending)  # layer l+1's, beside layer l's backward
                grads, dh = layer_vjp(*inputs, dh)
                return (dh, grads), reduced

            rest = jax.tree.map(lambda a: a[:-1], (stacked, stash))
            (dx, first), upper = jax.lax.scan(
                body, (dh, pending), rest, reverse=True, unroll=min(unroll, max(n - 1, 1))
            )
            first = self.reduce(first)
            grads = jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), first, upper)
            return grads, dx

        @jax.custom_vjp
        def run(stacked, x):
            return forward(stacked, x)[0]

        run.defvjp(forward, backward)
        return run(stacked, x)


def overlapped_grads(
    loss_fn: Callable[[Any, Any], tuple[jax.Array, dict]],
    param_axes: Any,
    reduce: Reduce,
    mesh: Mesh,
    axis: str = "data",
) -> Callable[[Any, Any], tuple[jax.Array, Any]]:
    """`(params, batch) -> (mean loss, mean grads)`, every bucket reduced inside the backward.

    `loss_fn(params, local_batch) -> (loss, aux)` runs per replica on its rows (batch split on dim
    0 over `axis`); `param_axes` (a tree like the params of logical-axes tuples) says which leaves
    are stacked layers: those are reduced by the layer loop (`ReducingLoop`), every other leaf
    when its gradient is complete (`reduce_in_backward`). `check_vma=False`: a collective-permute
    ring's sum is typed varying where every replica holds the same value, as in
    `allreduce.reducer`.
    """
    per_leaf = reduce_in_backward(reduce)
    layered = jax.tree.map(is_layer_leaf, param_axes, is_leaf=sharding.is_axes)

    def loss_of(params, batch):
        loop = ReducingLoop(reduce)
        wrapped = jax.tree.map(lambda p, lay: p if lay else per_leaf(p), params, layered)
        with api.layer_loop(loop):
            loss, _ = loss_fn(wrapped, batch)
        if any(jax.tree.leaves(layered)) and loop.calls != 1:
            raise ConfigError(
                "grad_sync.overlap='backward' needs a model whose stacked layers run through one "
                f"models.api.scan_layers (this one ran {loop.calls}); set grad_sync.overlap='none'"
            )
        return loss

    def body(params, batch):
        with sharding.per_replica_loss((axis,)):
            loss, grads = jax.value_and_grad(loss_of)(params, batch)
        return jax.lax.pmean(loss, axis), grads

    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(), P(axis)),
        out_specs=(P(), P()),
        axis_names={axis},
        check_vma=False,
    )


def local_grads(
    loss_fn: Callable[[Any, Any], tuple[jax.Array, dict]], reduce: Reduce, mesh: Mesh, axis: str
) -> Callable[[Any, Any, Any], tuple[jax.Array, Any, Any]]:
    """`(params, batch, held) -> (mean loss, reduce(held), this step's local grads)`.

    `held` is the previous step's per-replica gradient, `[R, ...]` per leaf sharded over `axis`
    (each device its own replica's). Its reduction and this step's forward and backward do not
    depend on each other, so XLA:CPU runs the exchange on one thread while the other computes.
    """

    def body(params, batch, held):
        reduced = reduce(jax.tree.map(lambda h: h[0], held))
        with sharding.per_replica_loss((axis,)):
            (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        # The replicas' mean loss from an all-gather: XLA merges independent all-reduces, and a
        # pmean here would join the gradient's all-reduce, which would then wait for the forward.
        loss = jnp.mean(jax.lax.all_gather(loss, axis))
        # held in float32, as the state entry is, whatever the parameters' dtype
        return loss, reduced, jax.tree.map(lambda g: g[None].astype(jnp.float32), grads)

    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(), P(axis), P(axis)),
        out_specs=(P(), P(), P(axis)),
        axis_names={axis},
        check_vma=False,
    )


def check(config, mesh_shape) -> None:
    """`grad_sync.overlap`'s rules; one-line ConfigErrors before compiling."""
    g = config.grad_sync
    mode = g.get("overlap", "none")
    if mode not in MODES:
        raise ConfigError(
            f"grad_sync.overlap={mode!r} is not valid; choose one of {', '.join(MODES)}"
        )
    if mode == "none":
        return
    why = None
    if mesh_shape["data"] <= 1:
        why = f"mesh.data > 1 (it is {mesh_shape['data']})"
    elif others := [f"mesh.{a}={mesh_shape[a]}" for a in OTHER_AXES if mesh_shape[a] > 1]:
        why = f"pure data parallelism, every other mesh axis 1 (not {', '.join(others)})"
    elif g.compression not in COMPRESSIONS:
        why = f"grad_sync.compression in {', '.join(COMPRESSIONS)} (not {g.compression!r})"
    elif g.compression != "none" and g.algorithm != "xla":
        why = f"grad_sync.algorithm='xla' with compression={g.compression!r}"
    elif g.local_steps > 1 or g.staleness > 0:
        why = "grad_sync.local_steps=1 and grad_sync.staleness=0"
    elif config.train.grad_accum > 1:
        why = f"train.grad_accum=1 (not {config.train.grad_accum})"
    elif g.compress_over != "all":
        why = "grad_sync.compress_over='all'"
    if why is not None:
        raise ConfigError(f"grad_sync.overlap={mode!r} ({MODES[mode]}) needs {why}")
