"""Causal attention over a sequence split along the `context` mesh axis (context parallelism).

Each device holds T/c of the sequence (c = mesh.context). Two ways to read the keys and values the
local queries need, chosen by `model.context_attention`:

* `ring`: the K/V block is passed around the `context` axis with `ppermute` (c − 1 hops, one
  stacked K/V array per hop); each hop's transfer does not depend on the previous block's
  computation, so the two can overlap. Scores are folded in with an online softmax (running max
  and sum, flash-style), so no device holds more than a [T/c, T/c] score block. Causal masking
  would leave the device holding the sequence's start idle, so the sequence is stored zig-zag:
  2c chunks, device i holds chunks i and 2c−1−i (`sequence_order`): every device has the same
  number of unmasked scores, and every hop after the first computes half a block
  (`_zigzag_hop`), so each device does (c + 1)/2c of the full-block work.
* `all_gather`: K/V gathered over `context` in one collective; local queries against all keys
  ([T/c, T] scores per device). Simpler, fine for moderate lengths.

Both run inside a `jax.shard_map` manual over `context` and the batch axes (data, fsdp, expert);
heads stay automatic (split over `tensor` by the enclosing sharding). Inside the pipeline's
stages, already manual over `context` (`is_manual`), the per-device body runs directly: the
arrays hold the device's T/c slots and `local_positions` gives their rotary positions. The
backward is autodiff (the transpose of a `ppermute` is the reverse `ppermute`). Masks come from
positions, never from block indices, so the same code serves any storage order.

Packed documents (`data.packing=documents`): with `segment_ids` [B, T] a query also needs its
key in the same segment. The key's segment ids travel with its K/V block (one more `ppermute`
per hop, or one more all-gather), and the mask is causal-by-position AND same-segment. A query
always sees itself in its own block (the first fold), so no row is fully masked.

Shapes: B batch, T length, K key/value heads, G query heads per K/V head, H head dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxdist import sharding

AXIS = "context"
BATCH_AXES = ("data", "fsdp", "expert")  # the mesh axes of logical `batch` (jaxdist/sharding.py)
_MASKED = -1e30  # finite: a fully masked row (never the case causally) stays NaN-free


def sequence_order(length: int, context: int, mode: str) -> np.ndarray | None:
    """Storage order of the T positions (positions[i] = the token at storage slot i), or None
    for the natural order. `ring` with context > 1: zig-zag, device i's T/c slots hold chunk i
    then chunk 2c−1−i of 2c equal chunks."""
    if context <= 1 or mode != "ring":
        return None
    chunks = np.arange(length).reshape(2 * context, length // (2 * context))
    return np.concatenate([np.concatenate([chunks[i], chunks[-1 - i]]) for i in range(context)])


def _fold(carry, q, k, v, q_pos, k_pos, scale, q_seg=None, k_seg=None):
    """Online-softmax update of (o [B,Tq,K,G,H], m, l [B,K,G,Tq]) with one K/V block [B,Tk,K,H];
    `q_seg` [B,Tq], `k_seg` [B,Tk]: segment ids, a query sees keys of its own segment only."""
    s = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    mask = q_pos[:, None] >= k_pos[None, :]  # [Tq, Tk]
    if q_seg is not None:
        mask = (mask[None] & (q_seg[:, :, None] == k_seg[:, None, :]))[:, None, None]
    s = jnp.where(mask, s, _MASKED)
    m_blk = jnp.max(s, axis=-1)
    if carry is None:
        m = m_blk
        p = jnp.exp(s - m[..., None])
        o = jnp.einsum("bkgts,bskh->btkgh", p, v.astype(jnp.float32))
        return o, m, jnp.sum(p, axis=-1)
    o, m_old, l_old = carry
    m = jnp.maximum(m_old, m_blk)
    p = jnp.exp(s - m[..., None])
    corr = jnp.exp(m_old - m)  # [B, K, G, Tq]
    o = o * jnp.moveaxis(corr, -1, 1)[..., None] + jnp.einsum(
        "bkgts,bskh->btkgh", p, v.astype(jnp.float32)
    )
    return o, m, l_old * corr + jnp.sum(p, axis=-1)


def _finish(carry, shape, dtype):
    o, _, l_sum = carry
    return (o / jnp.moveaxis(l_sum, -1, 1)[..., None]).reshape(shape).astype(dtype)


def _local_ring(q, k, v, seg=None, *, table: np.ndarray, c: int):
    """One device's causal attention: its q [B,T/c,N,H] against every device's k, v [B,T/c,K,H],
    which arrive one ring hop at a time. `table` [c, T/c]: the positions each device holds;
    `seg` [B,T/c]: segment ids (None: one sequence per row), passed around with K/V."""
    B, Tl, N, H = q.shape
    K = k.shape[2]
    me = jax.lax.axis_index(AXIS)
    table = jnp.asarray(table)
    qg = q.reshape(B, Tl, K, N // K, H)
    kv = jnp.stack([k, v])  # [2, B, T/c, K, H]: one permute per hop
    ring = [(j, (j + 1) % c) for j in range(c)]
    scale = 1 / math.sqrt(H)
    carry = _fold(None, qg, k, v, table[me], table[me], scale, seg, seg)  # own block: diagonal
    k_seg = seg
    for step in range(1, c):
        kv = jax.lax.ppermute(kv, AXIS, ring)  # issued before this hop's block runs
        if seg is not None:
            k_seg = jax.lax.ppermute(k_seg, AXIS, ring)
        src = (me - step) % c  # the device this K/V block started on
        carry = _zigzag_hop(carry, qg, kv, table[me], table[src], src < me, scale, seg, k_seg)
    return _finish(carry, q.shape, q.dtype)


def _zigzag_hop(carry, qg, kv, q_pos, k_pos, earlier, scale, q_seg=None, k_seg=None):
    """One ring hop under the zig-zag layout, half the block's work. Device i holds chunks
    (i, 2c−1−i); the block from device j holds (j, 2c−1−j). j < i: every local query sees chunk j
    and none sees chunk 2c−1−j, so all queries × the first half of the keys. j > i: the early
    local chunk sees nothing and the late one sees both, so the second half of the queries × all
    keys. Masks still come from positions."""
    half = qg.shape[1] // 2
    segs = q_seg is not None

    def early_keys(carry):
        ks = k_seg[:, :half] if segs else None
        return _fold(
            carry, qg, kv[0, :, :half], kv[1, :, :half], q_pos, k_pos[:half], scale, q_seg, ks
        )

    def late_queries(carry):
        o, m, l_sum = carry
        part = (o[:, half:], m[..., half:], l_sum[..., half:])
        qs = q_seg[:, half:] if segs else None
        o2, m2, l2 = _fold(part, qg[:, half:], kv[0], kv[1], q_pos[half:], k_pos, scale, qs, k_seg)
        return (
            jnp.concatenate([o[:, :half], o2], axis=1),
            jnp.concatenate([m[..., :half], m2], axis=-1),
            jnp.concatenate([l_sum[..., :half], l2], axis=-1),
        )

    return jax.lax.cond(earlier, early_keys, late_queries, carry)


def _local_gathered(q, k, v, seg=None, *, table: np.ndarray, c: int):
    """One device's causal attention with K/V (and segment ids) all-gathered over `context`."""
    B, Tl, N, H = q.shape
    K = k.shape[2]
    me = jax.lax.axis_index(AXIS)
    kv = jax.lax.all_gather(jnp.stack([k, v]), AXIS, axis=2, tiled=True)  # [2, B, T, K, H]
    k_seg = None if seg is None else jax.lax.all_gather(seg, AXIS, axis=1, tiled=True)
    qg = q.reshape(B, Tl, K, N // K, H)
    carry = _fold(
        None,
        qg,
        kv[0],
        kv[1],
        jnp.asarray(table)[me],
        table.reshape(-1),
        1 / math.sqrt(H),
        seg,
        k_seg,
    )
    return _finish(carry, q.shape, q.dtype)


def is_manual() -> bool:
    """Whether `context` is already manual where this is traced (the pipeline's stages): arrays
    then hold this device's T/c storage slots, and attention runs its per-device body directly."""
    return AXIS in sharding.manual_axes()


def local_positions(local_length: int, mode: str) -> tuple[np.ndarray, jax.Array]:
    """Where `context` is manual (`is_manual`), for arrays of this device's `local_length` slots:
    (the [T] storage order of the whole sequence, this device's positions [T/c])."""
    c = sharding.axis_size(AXIS)
    length = local_length * c
    order = sequence_order(length, c, mode)
    positions = np.arange(length) if order is None else order
    return positions, jnp.asarray(positions.reshape(c, -1))[jax.lax.axis_index(AXIS)]


def context_attention(
    q, k, v, positions: np.ndarray, mode: str, segment_ids: jax.Array | None = None
) -> jax.Array:
    """Causal grouped-query attention of q [B,T,N,H] over k, v [B,T,K,H], T split over `context`.

    Args:
      positions: [T] the position of each storage slot (`sequence_order`, or arange), of the
        whole sequence also where `context` is manual and q holds T/c slots.
      mode: "ring" or "all_gather".
      segment_ids: [B, T] in the same storage order, or None: packed documents, attention
        within each segment only.

    Returns: [B, T, N, H] in q's dtype, sharded like q.
    """
    local = _local_ring if mode == "ring" else _local_gathered
    args = (q, k, v) if segment_ids is None else (q, k, v, segment_ids)
    if is_manual():  # no nested shard_map: Shardy rejects its residuals under autodiff
        c = sharding.axis_size(AXIS)
        return local(*args, table=np.asarray(positions).reshape(c, -1), c=c)
    # Manual over the batch axes too: left automatic, XLA gathers the batch around all_gather.
    # Inside per-replica gradients (compressors, local SGD) the replica axes are already split.
    mesh, batch, mapped = sharding.nested_mesh(BATCH_AXES)
    c = int(mesh.shape[AXIS])
    table = np.asarray(positions).reshape(c, -1)
    spec = P(batch, AXIS)
    fn = jax.shard_map(
        lambda *a: local(*a, table=table, c=c),
        mesh=mesh,
        in_specs=(spec,) * len(args),
        out_specs=spec,
        axis_names={AXIS, *batch, *mapped},
        check_vma=not mapped,  # vmap's batched values vary over `mapped`, unbatched ones not
    )
    return fn(*args)
