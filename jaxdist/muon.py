"""Muon: the blocks' weight matrices step by their Newton–Schulz-orthogonalised momentum.

Which parameter gets Muon is decided once, from the logical axes (`matrix_dims`): a parameter of
the stacked blocks (`layers`) whose other dimensions are `embed` on one side (first or last) and at
least one hidden dimension (`heads` or `mlp`) on the other — the attention projections and the
(expert) MLP weights. Everything else — embedding and head (`vocab`), norms and biases (one
dimension), the MoE router (`embed` to an unnamed expert dimension) — takes AdamW. The matrix Muon
orthogonalises is [rows, cols] = [fan_in, fan_out]: the dimensions before `embed`'s side and after
it flattened (`wqkv` [L, embed, 3, heads, kv] is L matrices [embed, 3·heads·kv]); `layers` and
`experts` are batch dimensions (one matrix per layer, per expert).

The step for a Muon matrix (Keller Jordan 2024; the `torch.optim.Muon` convention by default):
  m ← β m + (1 − β) g;  u ← (1 − β) g + β m (Nesterov) or m;
  O ← NS₅(u / ‖u‖_F) with X ← aX + (bA + cA²)X, A = XXᵀ, (a, b, c) = (3.4445, −4.7750, 2.0315);
  p ← p − lr·wd·p − lr·√max(1, fan_out/fan_in)·O.
`bias_correction=True` divides m and g by (1 − βᵗ) first, as `optax.contrib.muon` does.

Distribution (`train.muon.distribution`): with `gather` (the default) each matrix's Nesterov
momentum is all-gathered over the mesh axes that split its matrix dimensions (`fsdp` on `embed`,
`tensor` on `heads`/`mlp`), orthogonalised whole and replicated on that group, and each device
keeps its own slice of the result (no second collective). Batch dimensions stay where they are
stored: `layers` on `pipeline` and `experts` on `expert` cost nothing, since their matrices are
independent. With `auto` no layout is imposed and XLA's SPMD partitioner runs the iteration on the
shards, with the collectives it chooses inside each matmul. Both give the one-device result.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist import sharding

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # quintic Newton–Schulz (Keller Jordan's Muon)
NS_STEPS = 5
BATCH_AXES = ("layers", "experts")  # independent matrices stacked along these
HIDDEN_AXES = ("heads", "mlp")  # the side of a block matrix that is not the residual stream
DISTRIBUTIONS = ("gather", "auto")


class MatrixDims(NamedTuple):
    """Dimension indices of a Muon parameter: batch, then rows (fan-in) and cols (fan-out)."""

    batch: tuple[int, ...]
    rows: tuple[int, ...]
    cols: tuple[int, ...]


def matrix_dims(axes: Sequence[str | None]) -> MatrixDims | None:
    """The Muon matrix of a parameter with these logical axes, or None for an AdamW parameter.

    Muon: in the stacked blocks (`layers`), `embed` exactly once as the first or last dimension
    besides the batch ones, and a `heads` or `mlp` dimension on the other side.
    """
    axes = tuple(axes)
    batch = tuple(i for i, a in enumerate(axes) if a in BATCH_AXES)
    rest = tuple(i for i, a in enumerate(axes) if a not in BATCH_AXES)
    names = [axes[i] for i in rest]
    if "layers" not in axes or names.count("embed") != 1 or len(rest) < 2:
        return None
    if not any(a in HIDDEN_AXES for a in names):
        return None
    if names[0] == "embed":
        return MatrixDims(batch, rest[:1], rest[1:])
    if names[-1] == "embed":
        return MatrixDims(batch, rest[:-1], rest[-1:])
    return None


def muon_mask(axes_tree: Any) -> Any:
    """True where a parameter takes Muon (`matrix_dims`), False where it takes AdamW."""
    return jax.tree.map(lambda a: matrix_dims(a) is not None, axes_tree, is_leaf=sharding.is_axes)


def fan_in_out(shape: Sequence[int], dims: MatrixDims) -> tuple[int, int]:
    return math.prod(shape[i] for i in dims.rows), math.prod(shape[i] for i in dims.cols)


def shape_scale(shape: Sequence[int], dims: MatrixDims) -> float:
    """√max(1, fan_out/fan_in): Keller Jordan's scale, `torch.optim.Muon`'s and optax's default."""
    fan_in, fan_out = fan_in_out(shape, dims)
    return math.sqrt(max(1.0, fan_out / fan_in))


def newton_schulz(x: jax.Array, steps: int = NS_STEPS, eps: float = 1e-8) -> jax.Array:
    """≈ U Vᵀ of x = U S Vᵀ for a stack of matrices `[..., m, n]`, by the quintic iteration.

    The iteration runs on the wide orientation (m ≤ n) and in float32; x is first divided by its
    Frobenius norm (+ eps), so every singular value starts at most 1.
    """
    dtype = x.dtype
    x = x.astype(jnp.float32)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = jnp.swapaxes(x, -1, -2)
    x = x / (jnp.linalg.norm(x, axis=(-2, -1), keepdims=True) + eps)
    a, b, c = NS_COEFFS
    for _ in range(steps):
        gram = x @ jnp.swapaxes(x, -1, -2)  # [..., m, m]
        x = a * x + (b * gram + c * gram @ gram) @ x
    if tall:
        x = jnp.swapaxes(x, -1, -2)
    return x.astype(dtype)


def to_matrices(x: jax.Array, dims: MatrixDims) -> jax.Array:
    """[..., batch..., rows..., cols...] -> [B, fan_in, fan_out]."""
    order = dims.batch + dims.rows + dims.cols
    fan_in, fan_out = fan_in_out(x.shape, dims)
    return jnp.transpose(x, order).reshape(-1, fan_in, fan_out)


def from_matrices(m: jax.Array, dims: MatrixDims, shape: Sequence[int]) -> jax.Array:
    order = dims.batch + dims.rows + dims.cols
    x = m.reshape(tuple(shape[i] for i in order))
    return jnp.transpose(x, tuple(order.index(i) for i in range(len(shape))))


def gathered_spec(axes: Sequence[str | None], mesh: Mesh, shape: Sequence[int]) -> PartitionSpec:
    """Storage layout of a Muon parameter with its matrix dimensions whole (`gather`): only the
    batch dimensions (`layers`, `experts`) keep their mesh axes."""
    spec = sharding.logical_to_spec(axes, sharding.STORAGE_RULES, mesh, shape)
    return PartitionSpec(*(e if a in BATCH_AXES else None for a, e in zip(axes, spec)))


def orthogonalize(
    u: jax.Array,
    axes: Sequence[str | None],
    *,
    steps: int = NS_STEPS,
    eps: float = 1e-8,
    mesh: Mesh | None = None,
    distribution: str = "gather",
) -> jax.Array:
    """NS(u) per matrix of a Muon parameter, times its shape scale, laid out per `distribution`."""
    dims = matrix_dims(axes)
    assert dims is not None, axes
    gather = mesh is not None and distribution == "gather"
    if gather:  # the all-gather: matrix dimensions whole, batch dimensions stay split
        whole = NamedSharding(mesh, gathered_spec(axes, mesh, u.shape))
        u = sharding.constrain_to(u, whole)
    o = from_matrices(newton_schulz(to_matrices(u, dims), steps, eps), dims, u.shape)
    o = o * shape_scale(u.shape, dims)
    if gather:  # whole here too, or XLA splits the iteration back over the slice's axes
        o = sharding.constrain_to(o, whole)
        # each device keeps its slice: no collective, the layout of the parameter
        spec = sharding.logical_to_spec(axes, sharding.STORAGE_RULES, mesh, u.shape)
        o = sharding.constrain_to(o, NamedSharding(mesh, spec))
    return o


class MuonState(NamedTuple):
    count: jax.Array  # int32[] steps taken
    mu: Any  # momentum, a tree like the Muon params


def scale_by_muon(
    axes_tree: Any,
    *,
    beta: float = 0.95,
    nesterov: bool = True,
    bias_correction: bool = False,
    steps: int = NS_STEPS,
    eps: float = 1e-8,
    mesh: Mesh | None = None,
    distribution: str = "gather",
) -> optax.GradientTransformation:
    """Muon's direction (momentum, Nesterov, Newton–Schulz, shape scale) for Muon params only.

    Args:
      axes_tree: logical axes of the parameters it sees (a tree like them).
      beta: momentum decay β.
      nesterov: the Nesterov form (1 − β) g + β m instead of m.
      bias_correction: divide by (1 − βᵗ) as `optax.contrib.muon` does (torch does not).
      steps: Newton–Schulz iterations.
      eps: added to the Frobenius norm before dividing by it.
      mesh: the device mesh, for `distribution`'s layout (None: no layout imposed).
      distribution: `gather` or `auto` (module docstring).
    """

    def init_fn(params):
        return MuonState(jnp.zeros((), jnp.int32), optax.tree.zeros_like(params))

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        mu = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g, state.mu, updates)
        if bias_correction:
            t = count.astype(jnp.float32)
            m_hat = jax.tree.map(lambda m: m / (1 - beta ** (t + nesterov)), mu)
            g_hat = jax.tree.map(lambda g: g / (1 - beta**t), updates)
        else:
            m_hat, g_hat = mu, updates
        if nesterov:
            u = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g, m_hat, g_hat)
        else:
            u = m_hat
        # The axes lead; under `partition` the other half's parameters are scalars, passed through.
        out = jax.tree.map(
            lambda axes, x: (
                x
                if x.ndim == 0
                else orthogonalize(
                    x, axes, steps=steps, eps=eps, mesh=mesh, distribution=distribution
                )
            ),
            axes_tree,
            u,
            is_leaf=sharding.is_axes,
        )
        return out, MuonState(count, mu)

    return optax.GradientTransformation(init_fn, update_fn)


def partition(
    transforms: dict[str, optax.GradientTransformation], labels: Any
) -> optax.GradientTransformation:
    """Each parameter through the transform its label names (`labels`: a tree like the params).

    Unlike `optax.partition`, every transform's state is a whole parameter tree: it holds a float32
    scalar where the other transforms' parameters are (optax's `MaskedNode`s have no leaves, so
    `optax.tree_map_params` could not pair them with a tree of parameter shardings).
    """

    def only(tree: Any, label: str) -> Any:
        return jax.tree.map(
            lambda x, lab: x if lab == label else jnp.zeros((), jnp.float32), tree, labels
        )

    def init_fn(params):
        if not jax.tree.leaves(params):  # optax.tree_map_params' placeholder for the params
            return {k: tx.init(params) for k, tx in transforms.items()}
        return {k: tx.init(only(params, k)) for k, tx in transforms.items()}

    def update_fn(updates, state, params=None):
        outs, new = {}, {}
        for k, tx in transforms.items():
            p = None if params is None else only(params, k)
            outs[k], new[k] = tx.update(only(updates, k), state[k], p)
        names = tuple(transforms)
        merged = jax.tree.map(
            lambda lab, *xs: xs[names.index(lab)], labels, *(outs[k] for k in names)
        )
        return merged, new

    return optax.GradientTransformation(init_fn, update_fn)


def extra_flops(shape: Sequence[int], axes: Sequence[str | None], steps: int = NS_STEPS) -> float:
    """Newton–Schulz FLOPs of one step for one Muon parameter, all its matrices (0 for AdamW ones):
    per iteration XXᵀ 2m²n, A² 2m³, (bA + cA²)X 2m²n, with m ≤ n the matrix's sides."""
    dims = matrix_dims(axes)
    if dims is None:
        return 0.0
    m, n = sorted(fan_in_out(shape, dims))
    batch = math.prod(shape[i] for i in dims.batch)
    return float(batch * steps * (4 * m * m * n + 2 * m**3))


def gather_bytes(
    shape: Sequence[int],
    axes: Sequence[str | None],
    mesh_shape: dict[str, int],
    itemsize: int = 4,
) -> float:
    """Bytes one device receives per step for `gather`'s all-gather of one Muon parameter (the
    ring cost (N−1)/N · S_out of `jaxdist.hlo_cost`, S_out its gathered local block); 0 when
    its matrix dimensions are not split."""
    dims = matrix_dims(axes)
    if dims is None:
        return 0.0
    split, whole = 1, 1
    for d, a in enumerate(axes):
        n = _split(a, mesh_shape)
        if d in dims.batch:
            whole *= shape[d] // n
        else:
            split *= n
            whole *= shape[d]
    return (split - 1) / split * whole * itemsize if split > 1 else 0.0


def _split(name: str | None, mesh_shape: dict[str, int]) -> int:
    """How many ways the storage rules split one dimension named `name` (first rule's axes)."""
    for rule, target in sharding.STORAGE_RULES:
        if rule == name and target is not None:
            targets = (target,) if isinstance(target, str) else target
            return math.prod(mesh_shape.get(t, 1) for t in targets)
    return 1
