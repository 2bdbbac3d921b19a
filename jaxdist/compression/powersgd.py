"""PowerSGD (Vogels et al., 2019): rank-r power iteration with a warm-started Q, and its spec.

Each compressed tensor, viewed as a batch of matrices [n, m], is sent as two all-reduced factors
P [n, r] and Q [m, r] instead of n m values; the residual keeps what the rank-r approximation
missed (error feedback). Tensors too small to gain are sent as an f32 all-reduce.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxdist.compression.replica as replica
import jaxdist.compression.tensors as tensors
from jaxdist.compression.replica import AxisName
from jaxdist.compression.spec import CompressorSpec, TrainFields, field, ring


class PowerSGDState(NamedTuple):
    count: jax.Array  # [1] int32
    q: Any  # per leaf f32 [1, b, m, rank] warm start, the same on all replicas; None: uncompressed
    residual: Any  # per leaf f32 [1, ...]; None if uncompressed or without error feedback


def powersgd_shape(
    shape: Sequence[int], rank: int, min_compression: float, batch_dims: int = 0
) -> tuple[int, int, int] | None:
    """The (b, n, m) batch of matrices a tensor is compressed as, or None to send it uncompressed.

    The first `batch_dims` axes (stacked layers) index b separate matrices; the rest are split
    into rows and columns at the most nearly square cut (smallest n + m), e.g. a stacked QKV
    kernel [L, D, 3, N, H] becomes L matrices [D, 3 N H]. Rank-r factors of a square-ish matrix
    capture more and cost less. Compressed when n * m > min_compression * rank * (n + m).
    """
    core = [int(d) for d in shape[batch_dims:]]
    if len(core) < 2:
        return None
    b = int(np.prod(shape[:batch_dims], dtype=np.int64))
    splits = [(int(np.prod(core[:k])), int(np.prod(core[k:]))) for k in range(1, len(core))]
    n, m = min(splits, key=lambda nm: nm[0] + nm[1])
    return (b, n, m) if n * m > min_compression * rank * (n + m) else None


def powersgd(
    axis_name: AxisName,
    rank: int,
    start_iter: int = 0,
    error_feedback: bool = True,
    min_compression: float = 1.0,
    seed: int = 0,
    batch_dims: Any = None,
    warm_start: bool = True,
    orthogonalization_epsilon: float = 0.0,
) -> optax.GradientTransformation:
    """PowerSGD (Vogels et al., 2019): rank-`rank` power iteration with a warm-started Q.

    Knobs as in PyTorch's `PowerSGDState`: `start_iter` (dense f32 steps first),
    `min_compression` (compress a matrix only if n m > min_compression r (n + m)), `warm_start`
    (False: a fresh Gaussian Q every step, the same on all replicas), `orthogonalization_epsilon`
    (0: Householder QR; > 0: Gram-Schmidt dividing each column by its norm + epsilon, PyTorch's
    `_orthogonalize_gram_schmidt`).

    Per compressed tensor viewed as matrices M [n, m] (after adding this replica's residual):
      P = pmean(M Q); P = orthonormal basis of P (QR); Q_i = M^T P; Q = pmean(Q_i); out = P Q^T.
    The residual is M - P Q_i^T, the part of this replica's M outside span(P); its mean over
    replicas is mean(M) - out. Q starts as the same Gaussian on every replica and stays identical
    (it is a pmean). Other tensors, and all tensors for the first `start_iter` steps, are plain f32
    pmean (with error feedback, the residual is then zero). `batch_dims` (an int, or a tree of
    ints like the params) marks leading stacked-layer axes: each layer gets its own factors.
    Wire: b r (n + m) f32 all-reduced per tensor instead of b n m (see `powersgd_shape`).
    """
    if rank <= 0:
        raise ValueError(f"powersgd: rank={rank} must be > 0")
    if min_compression < 1:
        raise ValueError(f"powersgd: min_compression={min_compression} must be >= 1")

    matrices = functools.partial(
        _powersgd_matrices, rank=rank, min_compression=min_compression, batch_dims=batch_dims
    )

    def init(params):
        return _powersgd_init(params, matrices(params), rank, seed, error_feedback)

    sync = functools.partial(
        _dense_then_compressed,
        start_iter=start_iter,
        axis_name=axis_name,
        epsilon=orthogonalization_epsilon,
    )

    def update(grads, state, params=None):
        del params
        count = state.count[0]
        shapes = matrices(grads)
        leaves, treedef = jax.tree.flatten(grads)
        qs, res = (
            [None] * len(leaves) if t is None else treedef.flatten_up_to(t)
            for t in (state.q, state.residual)
        )
        dense = [i for i, g in enumerate(leaves) if tensors.is_float(g) and shapes[i] is None]
        packed = [i for i, bnm in enumerate(shapes) if bnm is not None]
        out, new_q, new_res = list(leaves), list(qs), list(res)
        ms, q0 = [], []
        for i in packed:
            m_i = leaves[i].reshape(shapes[i]).astype(jnp.float32)
            if res[i] is not None:
                m_i = m_i + res[i][0].reshape(shapes[i]).astype(jnp.float32)
            ms.append(m_i)
            q0.append(qs[i][0] if warm_start else _fresh_q(qs[i][0], seed, count, i))
        means, lefts, q_news, dense_means = sync(ms, q0, count, [leaves[i] for i in dense])
        for i, mean in zip(dense, dense_means, strict=True):
            out[i] = mean
        for i, mean, left, q in zip(packed, means, lefts, q_news, strict=True):
            out[i] = mean.reshape(leaves[i].shape).astype(leaves[i].dtype)
            new_q[i] = q[None]
            if res[i] is not None:
                new_res[i] = left.reshape(res[i].shape).astype(res[i].dtype)
        return treedef.unflatten(out), PowerSGDState(
            state.count + 1, treedef.unflatten(new_q), treedef.unflatten(new_res)
        )

    return optax.GradientTransformation(init, update)


def _powersgd_matrices(
    tree: Any, *, rank: int, min_compression: float, batch_dims: Any
) -> list[tuple[int, int, int] | None]:
    """Per leaf of `tree`, the (b, n, m) it is compressed as, or None (see `powersgd_shape`)."""
    leaves, treedef = jax.tree.flatten(tree)
    dims = tensors.leaf_batch_dims(batch_dims, treedef, len(leaves))
    return [
        powersgd_shape(p.shape, rank, min_compression, d) if tensors.is_float(p) else None
        for p, d in zip(leaves, dims, strict=True)
    ]


def _fresh_q(q: jax.Array, seed: int, count: jax.Array, i: int) -> jax.Array:
    """A fresh Gaussian Q like q [b, m, r] for leaf `i` at step `count`, drawn alike on every
    replica (`warm_start=False`); one draw shared by the leaf's layers."""
    key = jax.random.fold_in(jax.random.PRNGKey(seed + 1), count)
    fresh = jax.random.normal(jax.random.fold_in(key, i), q.shape[1:], jnp.float32)
    return replica.varying_like(jnp.broadcast_to(fresh, q.shape), q)


def _dense_then_compressed(ms, qs, count, dense, *, start_iter: int, axis_name, epsilon):
    """(means, this replica's residuals, new Qs) of the matrices ms [b, n, m], and the means of
    the `dense` tensors (sent with the P's): an f32 pmean of all (residuals zero, Qs kept) for
    the first `start_iter` steps, then `_powersgd_compress`."""
    compress = functools.partial(_powersgd_compress, axis_name=axis_name, epsilon=epsilon)
    if start_iter <= 0:
        return compress(ms, qs, dense)

    def warm(ms, qs, dense):
        means = replica.pmean_flat(ms + dense, axis_name)
        zeros = [jnp.zeros_like(m) for m in ms]
        return means[: len(ms)], zeros, [replica.varying_like(q, q) for q in qs], means[len(ms) :]

    def compressed(ms, qs, dense):
        means, lefts, q_news, dense_means = compress(ms, qs, dense)
        return means, lefts, [replica.varying_like(a, q) for a, q in zip(q_news, qs)], dense_means

    return jax.lax.cond(count < start_iter, warm, compressed, ms, qs, dense)


def _powersgd_init(params, shapes, rank: int, seed: int, error_feedback: bool) -> PowerSGDState:
    """Per compressed leaf (`shapes[i]` = (b, n, m), else None): Q [1, b, m, rank] and a residual."""
    leaves, treedef = jax.tree.flatten(params)
    key = jax.random.PRNGKey(seed)
    qs, res = [], []
    for i, (p, bnm) in enumerate(zip(leaves, shapes, strict=True)):
        if bnm is None:
            qs.append(None)
            res.append(None)
            continue
        # One draw per tensor, shared by its layers: a stage holding some of the layers (a
        # pipeline shard) starts from the same Q as the whole stack would.
        b, _, m = bnm
        q = jax.random.normal(jax.random.fold_in(key, i), (m, rank), jnp.float32)
        qs.append(jnp.broadcast_to(q, (1, b, m, rank)))
        res.append(jnp.zeros((1, *p.shape), jnp.float32) if error_feedback else None)
    return PowerSGDState(jnp.zeros((1,), jnp.int32), treedef.unflatten(qs), treedef.unflatten(res))


def _orthogonalize(p: jax.Array, epsilon: float) -> jax.Array:
    """Orthonormal columns spanning p [b, n, r]: Householder QR (`epsilon` 0) or PyTorch's
    Gram-Schmidt dividing each column by its norm + `epsilon`."""
    if epsilon <= 0:
        return jnp.linalg.qr(p)[0]
    cols = []
    for i in range(p.shape[-1]):
        col = p[..., i]
        for prev in cols:
            col = col - jnp.sum(prev * col, axis=-1, keepdims=True) * prev
        norm = jnp.linalg.norm(col, axis=-1, keepdims=True)
        cols.append(col / (norm + epsilon))
    return jnp.stack(cols, axis=-1)


def _powersgd_compress(ms, qs, dense, *, axis_name: AxisName, epsilon: float):
    """(mean approximations, this replica's residuals, new Qs, means of `dense`); ms [b, n, m],
    qs [b, m, r].

    Every matrix's P and every dense tensor are all-reduced in one flat buffer, then every Q
    (PyTorch's `powerSGD_hook` packs them alike): two collectives a step, not two per tensor."""
    sent = replica.pmean_flat([m @ q for m, q in zip(ms, qs, strict=True)] + dense, axis_name)
    ps = [_orthogonalize(p, epsilon) for p in sent[: len(ms)]]  # [b, n, r]
    q_is = [jnp.swapaxes(m, 1, 2) @ p for m, p in zip(ms, ps, strict=True)]  # [b, m, r]
    q_news = replica.pmean_flat(q_is, axis_name)
    means = [p @ jnp.swapaxes(q, 1, 2) for p, q in zip(ps, q_news, strict=True)]
    lefts = [m - p @ jnp.swapaxes(q_i, 1, 2) for m, p, q_i in zip(ms, ps, q_is, strict=True)]
    return means, lefts, q_news, sent[len(ms) :]


# --------------------------------------------------------------------------------------------------
# Spec


def _matrix(grad_bytes: float, cfg: Any, shape) -> tuple[int, int, int] | None:
    """(b, n, m) of a tensor of `shape` (else a square matrix of grad_bytes / 4 elements)."""
    if shape is None:
        side = max(1, math.isqrt(int(grad_bytes // 4)))
        shape = (side, side)
    rank, min_c = int(field(cfg, "rank")), float(field(cfg, "min_compression"))
    return powersgd_shape(shape, rank, min_c)


def _powersgd_wire(grad_bytes: float, replicas: int, cfg: Any, shape=None) -> float:
    bnm = _matrix(grad_bytes, cfg, shape)
    if bnm is None:
        return ring("all-reduce", grad_bytes, replicas)
    b, n, m = bnm
    rank = int(field(cfg, "rank"))
    return ring("all-reduce", 4 * b * n * rank, replicas) + ring(
        "all-reduce", 4 * b * m * rank, replicas
    )


def _powersgd_state(grad_bytes: float, replicas: int, cfg: Any) -> float:
    bnm = _matrix(grad_bytes, cfg, None)
    if bnm is None:
        return 0.0
    q = 4 * bnm[0] * bnm[2] * int(field(cfg, "rank"))
    return q + (grad_bytes if field(cfg, "error_feedback") else 0.0)


def _powersgd_from(axis_name: AxisName, cfg: Any, t: TrainFields) -> optax.GradientTransformation:
    return powersgd(
        axis_name, int(field(cfg, "rank")), start_iter=int(field(cfg, "warmup_steps")),
        error_feedback=bool(field(cfg, "error_feedback")),
        min_compression=float(field(cfg, "min_compression")),
        warm_start=bool(field(cfg, "warm_start")),
        orthogonalization_epsilon=float(field(cfg, "orthogonalization_epsilon")),
        batch_dims=t.batch_dims,
    )  # fmt: skip


POWERSGD = CompressorSpec(
    name="powersgd",
    build=_powersgd_from,
    summary="rank-r factors P, Q of each matrix, all-reduced (PowerSGD)",
    wire_bytes=_powersgd_wire,
    fields=(
        "rank",
        "error_feedback",
        "warmup_steps",
        "min_compression",
        "warm_start",
        "orthogonalization_epsilon",
        "freeze_variance",
    ),  # fmt: skip
    error_feedback=True,
    residual_fields=("residual",),
    freezes_variance=True,
    state_bytes=_powersgd_state,
    # M Q and M^T P: two matmuls of the [n, m] matrix with r columns
    extra_flops=lambda grad_bytes, replicas, cfg: 4 * grad_bytes / 4 * int(field(cfg, "rank")),
    example={"rank": 1},
)
