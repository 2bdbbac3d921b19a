"""All-reduce algorithms for the data-parallel gradient, written with `lax.ppermute` and friends.

`ALGORITHMS` is the one registry of `grad_sync.algorithm` names. Each algorithm sums a flat f32
buffer over one mesh axis inside a `shard_map` manual over that axis (every device holds its own
[S] buffer, every device ends with the sum); `reducer` runs one on each device's shard in the
explicit data-parallel step runs (jaxdist/strategies.py `reduced`, through `reducer`), so it
composes with fsdp/tensor exactly as the compressors do: each device reduces its own shard of its
replica's gradient.

  xla               `lax.psum`: whatever the backend's collective library does (NCCL, gloo, ...).
  ring              reduce-scatter then all-gather, N-1 `ppermute` steps of S/N each.
  halving_doubling  recursive halving then doubling with XOR partners, log2 N steps each (N = 2^k).
  tree              binomial-tree reduce to device 0 then broadcast, ceil(log2 N) steps of S each.
  hierarchical      ring reduce-scatter within each host, ring all-reduce of the shard across
                    hosts (`mesh.dcn_data`), ring all-gather within each host.
  ps                parameter server on device 0: N-1 pushes of S into it, N-1 pulls of S out of it.
  sharded_ps        every device serves 1/N of the buffer: push shards (one all-to-all), owners
                    sum, pull the reduced shards (one all-gather). ZeRO's traffic, as a server.

`ring_per_hop` runs a ring with a codec (`CODECS`: bf16, int8, topk) on the wire at every hop and
a residual per chunk (error feedback): `ring` with `grad_sync.compression`, or `hierarchical` with
`grad_sync.compress_over=dcn` (exact within a host, compressed across hosts).

Step counts and bytes are pinned against the compiled HLO in tests/test_allreduce.py and costed by
the planner (jaxdist/plan/algorithms.py `algorithm_cost`); docs/AGGREGATION.md compares them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxdist import compression, sharding
from jaxdist.errors import ConfigError

# (flat [S] buffer, axis name, axis size, hosts) -> its sum over the axis, [S] on every device.
Reduce = Callable[[jax.Array, str, int, int], jax.Array]


def _pos(table: list[int], axis: str) -> jax.Array:
    """A per-device constant: `table[axis_index]`, an int32 scalar."""
    return jnp.asarray(np.asarray(table, np.int32))[jax.lax.axis_index(axis)]


def _groups(n: int, hosts: int, within: bool) -> list[list[int]]:
    """Axis positions in each group: hosts hold consecutive positions (dcn-major meshes)."""
    local = n // hosts
    if within:
        return [[h * local + j for j in range(local)] for h in range(hosts)]
    return [[h * local + j for h in range(hosts)] for j in range(local)]


def _ring_pairs(groups: list[list[int]]) -> list[tuple[int, int]]:
    return [(g[p], g[(p + 1) % len(g)]) for g in groups for p in range(len(g))]


def _rank_in_group(groups: list[list[int]], n: int) -> list[int]:
    rank = [0] * n
    for g in groups:
        for p, d in enumerate(g):
            rank[d] = p
    return rank


def ring_reduce_scatter(x: jax.Array, axis: str, groups: list[list[int]]) -> jax.Array:
    """[S] -> [S/m]: m-1 ppermute steps along each group's ring; position p ends holding the sum
    of chunk (p+1) mod m of the buffer (m = group size)."""
    m, n = len(groups[0]), sum(len(g) for g in groups)
    if m == 1:
        return x
    pairs, p = _ring_pairs(groups), _pos(_rank_in_group(groups, n), axis)
    chunks = x.reshape(m, -1)  # [m, S/m]
    for k in range(m - 1):
        send = jax.lax.dynamic_index_in_dim(chunks, (p - k) % m, keepdims=False)
        recv = jax.lax.ppermute(send, axis, pairs)
        into = (p - k - 1) % m
        mine = jax.lax.dynamic_index_in_dim(chunks, into, keepdims=False)
        chunks = jax.lax.dynamic_update_index_in_dim(chunks, mine + recv, into, 0)
    return jax.lax.dynamic_index_in_dim(chunks, (p + 1) % m, keepdims=False)


def ring_all_gather(shard: jax.Array, axis: str, groups: list[list[int]]) -> jax.Array:
    """The inverse layout of `ring_reduce_scatter`: [S/m] (chunk (p+1) mod m) -> [S]."""
    m, n = len(groups[0]), sum(len(g) for g in groups)
    if m == 1:
        return shard
    pairs, p = _ring_pairs(groups), _pos(_rank_in_group(groups, n), axis)
    chunks = jnp.zeros((m, *shard.shape), shard.dtype)
    chunks = jax.lax.dynamic_update_index_in_dim(chunks, shard, (p + 1) % m, 0)
    send = shard
    for k in range(m - 1):
        send = jax.lax.ppermute(send, axis, pairs)
        chunks = jax.lax.dynamic_update_index_in_dim(chunks, send, (p - k) % m, 0)
    return chunks.reshape(-1)


def ring(x: jax.Array, axis: str, n: int, hosts: int = 1) -> jax.Array:
    groups = [list(range(n))]
    return ring_all_gather(ring_reduce_scatter(x, axis, groups), axis, groups)


def halving_doubling(x: jax.Array, axis: str, n: int, hosts: int = 1) -> jax.Array:
    """Rabenseifner: halve the buffer with partner i XOR d (d = N/2 .. 1), keeping the half named
    by bit d of i and adding the partner's copy of it; then double back in reverse order."""
    i = jax.lax.axis_index(axis)
    dists = [1 << b for b in reversed(range(n.bit_length() - 1))]  # N/2, ..., 1
    buf = x
    for d in dists:
        half = buf.shape[0] // 2
        lower, upper = buf[:half], buf[half:]
        high = (i & d) != 0  # this device keeps the upper half
        send = jnp.where(high, lower, upper)
        recv = jax.lax.ppermute(send, axis, [(j, j ^ d) for j in range(n)])
        buf = jnp.where(high, upper, lower) + recv
    for d in reversed(dists):
        recv = jax.lax.ppermute(buf, axis, [(j, j ^ d) for j in range(n)])
        high = (i & d) != 0
        buf = jnp.where(high, jnp.concatenate([recv, buf]), jnp.concatenate([buf, recv]))
    return buf


def tree(x: jax.Array, axis: str, n: int, hosts: int = 1) -> jax.Array:
    """Binomial tree: at distance d = 1, 2, 4, ... device i (i mod 2d = d) sends its partial sum to
    i - d; then device 0's total goes back down the same tree (d = .., 2, 1)."""
    i = jax.lax.axis_index(axis)
    dists = [1 << b for b in range(max(1, math.ceil(math.log2(n))))] if n > 1 else []
    buf = x
    for d in dists:  # reduce: receivers add, everyone else receives zeros
        pairs = [(j, j - d) for j in range(n) if j % (2 * d) == d]
        buf = buf + jax.lax.ppermute(buf, axis, pairs)
    for d in reversed(dists):  # broadcast
        pairs = [(j, j + d) for j in range(n) if j % (2 * d) == 0 and j + d < n]
        recv = jax.lax.ppermute(buf, axis, pairs)
        buf = jnp.where(i % (2 * d) == d, recv, buf)
    return buf


def hierarchical(x: jax.Array, axis: str, n: int, hosts: int = 1) -> jax.Array:
    """Exact within a host (ring reduce-scatter / all-gather over its devices), and only the
    1/local shard crosses hosts (a ring all-reduce over the devices with the same local index)."""
    within, across = _groups(n, hosts, True), _groups(n, hosts, False)
    shard = ring_reduce_scatter(x, axis, within)
    shard = ring_all_gather(ring_reduce_scatter(shard, axis, across), axis, across)
    return ring_all_gather(shard, axis, within)


def ps(x: jax.Array, axis: str, n: int, hosts: int = 1) -> jax.Array:
    """A parameter server on device 0: each worker pushes its S bytes to it in turn (N-1 steps),
    then it sends the sum back to each worker in turn (N-1 steps): its link carries 2(N-1)S."""
    i = jax.lax.axis_index(axis)
    total = x
    for j in range(1, n):
        total = total + jax.lax.ppermute(x, axis, [(j, 0)])  # zeros everywhere but the server
    out = total
    for j in range(1, n):
        out = jnp.where(i == j, jax.lax.ppermute(total, axis, [(0, j)]), out)
    return out


def sharded_ps(x: jax.Array, axis: str, n: int, hosts: int = 1) -> jax.Array:
    """Device j serves chunk j: one all-to-all pushes every chunk to its server, the server sums
    its N copies, one all-gather pulls the reduced chunks back."""
    rows = jax.lax.all_to_all(x.reshape(n, -1), axis, 0, 0, tiled=True)  # [N, S/N]: chunk i
    return jax.lax.all_gather(jnp.sum(rows, axis=0), axis, tiled=True)


def xla(x: jax.Array, axis: str, n: int, hosts: int = 1) -> jax.Array:
    return jax.lax.psum(x, axis)


# name -> (reduce, padding multiple of the flat buffer as a function of (N, hosts)).
ALGORITHMS: dict[str, tuple[Reduce, Callable[[int, int], int]]] = {
    "xla": (xla, lambda n, h: 1),
    "ring": (ring, lambda n, h: n),
    "halving_doubling": (halving_doubling, lambda n, h: n),
    "tree": (tree, lambda n, h: 1),
    "hierarchical": (hierarchical, lambda n, h: n),
    "ps": (ps, lambda n, h: 1),
    "sharded_ps": (sharded_ps, lambda n, h: n),
}


def all_reduce(x: jax.Array, axis: str, n: int, algorithm: str, hosts: int = 1) -> jax.Array:
    """The sum over `axis` of a flat buffer of any length (zero-padded for the algorithm)."""
    reduce, multiple = ALGORITHMS[algorithm]
    size = x.shape[0]
    pad = -size % multiple(n, hosts)
    if pad:
        x = jnp.concatenate([x, jnp.zeros((pad,), x.dtype)])
    return reduce(x, axis, n, hosts)[:size]


def mean_tree(tree: Any, axis: str, algorithm: str, hosts: int = 1) -> Any:
    """Every float leaf's mean over `axis`, all leaves reduced as one flat f32 buffer."""
    leaves, treedef = jax.tree.flatten(tree)
    n = jax.lax.axis_size(axis)
    flat = jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves])
    summed = all_reduce(flat, axis, n, algorithm, hosts) / n
    out, start = [], 0
    for x in leaves:
        out.append(summed[start : start + x.size].reshape(x.shape).astype(x.dtype))
        start += x.size
    return jax.tree.unflatten(treedef, out)


def _bits(x: jax.Array) -> jax.Array:
    """f32 -> bf16 bits (uint16): XLA:CPU would widen a bf16 collective back to f32."""
    return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)


def _unbits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16).astype(jnp.float32)


INT8_BLOCK = 256  # values per f32 scale of the int8 per-hop codec (compression.int8's chunk)


class Codec(NamedTuple):
    """What one hop of a compressed ring puts on the wire."""

    encode: Callable[[jax.Array], jax.Array]  # f32 [k] -> the payload
    decode: Callable[[jax.Array, int], jax.Array]  # (the payload, k) -> f32 [k]
    block: int  # k is a multiple of this: the buffer is padded to N * block


def _int8_encode(x: jax.Array) -> jax.Array:
    """f32 [k] -> int8 [k/256, 260]: each block's values and its f32 scale's 4 bytes, one
    buffer so that a hop is one collective-permute."""
    q, scale = compression.quantize_int8(x.reshape(-1, INT8_BLOCK))  # [k/256, 256], [k/256]
    return jnp.concatenate([q, jax.lax.bitcast_convert_type(scale, jnp.int8)], axis=1)


def _int8_decode(payload: jax.Array, k: int) -> jax.Array:
    scale = jax.lax.bitcast_convert_type(payload[:, INT8_BLOCK:], jnp.float32)  # [k/256]
    return compression.dequantize_int8(payload[:, :INT8_BLOCK], scale).reshape(-1)


def _topk_codec(ratio: float) -> Codec:
    """Top-k per hop (cf. gTop-k, Shi et al. 2019): the ceil(ratio * k) largest-magnitude values
    of the chunk, sent as one int32 buffer [2 kk] (the f32 values' bits, then their indices);
    the receiver scatters them into zeros (densifies) before adding its own chunk."""

    def encode(x: jax.Array) -> jax.Array:
        _, idx = jax.lax.top_k(jnp.abs(x), compression._topk_k(ratio, x.shape[0]))
        return jnp.concatenate([jax.lax.bitcast_convert_type(x[idx], jnp.int32), idx])

    def decode(payload: jax.Array, k: int) -> jax.Array:
        kk = payload.shape[0] // 2
        values = jax.lax.bitcast_convert_type(payload[:kk], jnp.float32)
        return jnp.zeros((k,), jnp.float32).at[payload[kk:]].set(values)

    return Codec(encode, decode, 1)


# grad_sync.compression names that `ring` (and `hierarchical` across hosts) run at every hop:
# name -> (grad_sync.topk_ratio -> Codec).
CODECS: dict[str, Callable[[float], Codec]] = {
    "bf16": lambda ratio: Codec(_bits, lambda q, k: _unbits(q), 1),
    "int8": lambda ratio: Codec(_int8_encode, _int8_decode, INT8_BLOCK),  # absmax per 256 values
    "topk": _topk_codec,
}


def codec(name: str, topk_ratio: float = 1.0) -> Codec:
    """The per-hop codec `grad_sync.compression` = `name` names (`topk_ratio`: topk's only)."""
    return CODECS[name](topk_ratio)


def ring_per_hop(
    x: jax.Array, err: jax.Array, axis: str, groups: list[list[int]], wire: Codec
) -> tuple[jax.Array, jax.Array]:
    """`ring` along each group with the codec `wire` at every hop and error feedback:
    ([S] sum over the group, [S + S/m] residual), m the group size.

    Reduce-scatter: the partial sum a device forwards is encoded and what the encoding lost stays
    in its residual for that chunk (added the next time it forwards the chunk, the next step).
    All-gather: the owner encodes its reduced chunk once (with its own residual) and the payload
    travels unchanged, so every device, the owner too, ends with the same sum.
    """
    enc, dec, _ = wire
    size, m, n = x.shape[0], len(groups[0]), sum(len(g) for g in groups)
    width = size // m  # elements per chunk
    p = _pos(_rank_in_group(groups, n), axis)
    pairs = _ring_pairs(groups)
    chunks, res = x.reshape(m, -1), err[:size].reshape(m, -1)  # [m, S/m] each
    for k in range(m - 1):
        i = (p - k) % m
        c = jax.lax.dynamic_index_in_dim(chunks, i, keepdims=False)
        c = c + jax.lax.dynamic_index_in_dim(res, i, keepdims=False)
        q = enc(c)
        res = jax.lax.dynamic_update_index_in_dim(res, c - dec(q, width), i, 0)
        recv = dec(jax.lax.ppermute(q, axis, pairs), width)
        into = (p - k - 1) % m
        mine = jax.lax.dynamic_index_in_dim(chunks, into, keepdims=False)
        chunks = jax.lax.dynamic_update_index_in_dim(chunks, mine + recv, into, 0)
    own = jax.lax.dynamic_index_in_dim(chunks, (p + 1) % m, keepdims=False) + err[size:]
    q = q_own = enc(own)
    gathered = jnp.zeros((m, width), jnp.float32)
    gathered = jax.lax.dynamic_update_index_in_dim(gathered, dec(q, width), (p + 1) % m, 0)
    for j in range(m - 1):
        q = jax.lax.ppermute(q, axis, pairs)
        gathered = jax.lax.dynamic_update_index_in_dim(gathered, dec(q, width), (p - j) % m, 0)
    new_err = jnp.concatenate([res.reshape(-1), own - dec(q_own, width)])
    return gathered.reshape(-1), new_err


def _per_hop_sum(
    x: jax.Array, err: jax.Array, axis: str, n: int, hosts: int, wire: Codec
) -> tuple[jax.Array, jax.Array]:
    """hosts = 1: `ring_per_hop` over the axis (compressed at every hop). hosts > 1:
    `hierarchical`, exact within each host and compressed (error feedback) only across hosts
    (compress_over=dcn)."""
    if hosts == 1:
        return ring_per_hop(x, err, axis, [list(range(n))], wire)
    within, across = _groups(n, hosts, True), _groups(n, hosts, False)
    shard, err = ring_per_hop(ring_reduce_scatter(x, axis, within), err, axis, across, wire)
    return ring_all_gather(shard, axis, within), err


def per_hop_size(num_elements: int, n: int, hosts: int, wire: Codec) -> int:
    """Elements of one device's per-hop residual: what it forwards (the padded buffer S, or its
    S/L shard across hosts) plus the chunk it owns."""
    padded = num_elements + (-num_elements % (n * wire.block))
    forwarded = padded if hosts == 1 else padded // (n // hosts)
    return forwarded + padded // n


def mean_tree_per_hop(
    tree: Any, err: jax.Array, axis: str, hosts: int, wire: Codec
) -> tuple[Any, jax.Array]:
    """`mean_tree` compressed per hop (`_per_hop_sum`); `err` [per_hop_size] this device's."""
    leaves, treedef = jax.tree.flatten(tree)
    n = jax.lax.axis_size(axis)
    flat = jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves])
    size = flat.shape[0]
    flat = jnp.concatenate([flat, jnp.zeros((-size % (n * wire.block),), jnp.float32)])
    summed, err = _per_hop_sum(flat, err, axis, n, hosts, wire)
    summed = summed[:size] / n
    out, start = [], 0
    for x in leaves:
        out.append(summed[start : start + x.size].reshape(x.shape).astype(x.dtype))
        start += x.size
    return jax.tree.unflatten(treedef, out), err


def per_hop_reducer(
    mesh: Mesh,
    axis: str,
    shard_axes: tuple[str, ...],
    param_specs: Any,
    hosts: int,
    wire: Codec,
) -> Callable[[Any, jax.Array], tuple[Any, jax.Array]]:
    """`(grads [R, ...], residual [R * D, E]) -> (mean grads, residual)`: `wire` per hop (`ring`),
    or across hosts only (`hierarchical` with hosts > 1). As `reducer`, manual over `axis` and
    `shard_axes` (D devices per replica): each device reduces its own shard of its replica's
    gradient and keeps its own residual row (E: `per_hop_size` of its shard)."""
    manual = {axis, *shard_axes}
    g_specs = jax.tree.map(lambda sp: sharding.spec_only(P(axis, *sp), manual), param_specs)
    mean_specs = jax.tree.map(lambda sp: sharding.spec_only(sp, manual), param_specs)
    err_spec = P((axis, *shard_axes))

    def reduce(grads, err):
        local = jax.tree.map(lambda g: g[0], grads)  # this device's [1, ...] block
        mean, err = mean_tree_per_hop(local, err[0], axis, hosts, wire)
        return mean, err[None]

    return jax.shard_map(
        reduce,
        mesh=mesh,
        in_specs=(g_specs, err_spec),
        out_specs=(mean_specs, err_spec),
        axis_names=manual,
        check_vma=False,
    )


def reducer(
    mesh: Mesh, axis: str, shard_axes: tuple[str, ...], param_specs: Any, algorithm: str, hosts: int
) -> Callable[[Any], Any]:
    """`grads [R, ...] -> mean grads`: every device reduces its own shard over `axis` by `algorithm`.

    Manual over `axis` and the axes that shard the parameters (`shard_axes`), as the compressors
    are (collectives._sharded_reduce): with those automatic, XLA's partitioner would gather the
    whole gradient around each collective. `check_vma=False`: a ppermute result is typed varying
    even where the algorithm makes every device hold the same sum, and jax has no cast back.
    """
    manual = {axis, *shard_axes}
    g_specs = jax.tree.map(lambda sp: sharding.spec_only(P(axis, *sp), manual), param_specs)
    mean_specs = jax.tree.map(lambda sp: sharding.spec_only(sp, manual), param_specs)

    def reduce(grads):
        local = jax.tree.map(lambda g: g[0], grads)  # this device's [1, ...] block
        return mean_tree(local, axis, algorithm, hosts)

    return jax.shard_map(
        reduce,
        mesh=mesh,
        in_specs=(g_specs,),
        out_specs=mean_specs,
        axis_names=manual,
        check_vma=False,
    )


def check(config, mesh_shape: dict[str, int]) -> None:
    """`grad_sync.algorithm`'s rules on this mesh; one-line ConfigErrors before compiling."""
    g, n = config.grad_sync, mesh_shape["data"]
    name = g.algorithm
    if name not in ALGORITHMS:
        raise ConfigError(
            f"grad_sync.algorithm={name!r} is not valid; choose one of {', '.join(ALGORITHMS)}"
        )
    over = g.compress_over
    if over not in ("all", "dcn"):
        raise ConfigError(f"grad_sync.compress_over={over!r} is not valid; choose one of all, dcn")
    if over == "dcn" and (name != "hierarchical" or g.compression not in CODECS):
        raise ConfigError(
            "grad_sync.compress_over='dcn' compresses the cross-host stage of "
            f"algorithm='hierarchical' with compression in {', '.join(CODECS)}, got algorithm="
            f"{name!r}, compression={g.compression!r}"
        )
    if name == "xla":
        return
    if n <= 1:
        raise ConfigError(
            f"grad_sync.algorithm={name!r} reduces over the data-parallel replicas, but "
            f"mesh.data={n}; set mesh.data > 1 or grad_sync.algorithm='xla'"
        )
    if name in ("ring", "hierarchical") and g.compression in CODECS:  # per hop
        if name == "hierarchical" and over != "dcn":
            raise ConfigError(
                f"grad_sync.algorithm='hierarchical' with compression={g.compression!r} "
                "compresses only across hosts: set grad_sync.compress_over='dcn'"
            )
        dgc = [f for f in ("momentum_correction", "freeze_variance", "warmup_steps") if g[f]]
        if g.compression == "topk" and (dgc or g.topk_exchange != "all_gather"):
            raise ConfigError(
                f"grad_sync.algorithm={name!r} with compression='topk' sends each hop's top-k "
                "with its residual only; unset grad_sync."
                f"{', '.join(dgc or ['topk_exchange'])} (DGC's, for algorithm='xla')"
            )
        if mesh_shape["pipeline"] > 1:
            raise ConfigError(
                f"grad_sync.algorithm={name!r} with compression={g.compression!r} (per hop) "
                f"needs mesh.pipeline = 1, got {mesh_shape['pipeline']}"
            )
    elif g.compression != "none" or g.local_steps > 1:
        raise ConfigError(
            f"grad_sync.algorithm={name!r} runs the exact reduction; it does not combine with "
            f"grad_sync.compression={g.compression!r} / local_steps={g.local_steps} (use 'xla'; "
            f"'ring' takes compression in {', '.join(CODECS)} per hop)"
        )
    if name == "halving_doubling" and n & (n - 1):
        raise ConfigError(
            f"grad_sync.algorithm='halving_doubling' needs a power-of-two mesh.data, got {n}; "
            "use 'ring' or 'tree' for other sizes"
        )
    hosts = int(config.mesh.dcn_data)
    if name == "hierarchical" and not (1 < hosts < n):
        raise ConfigError(
            f"grad_sync.algorithm='hierarchical' needs the data axis split over hosts: "
            f"1 < mesh.dcn_data < mesh.data={n}, got mesh.dcn_data={hosts}"
        )
