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

`ring_per_hop` runs a ring with a codec (a compressor spec's `per_hop`: bf16, int8, topk) at every hop and
a residual per chunk (error feedback): `ring` with `grad_sync.compression`, or `hierarchical` with
`grad_sync.compress_over=dcn` (exact within a host, compressed across hosts).

Step counts and bytes are pinned against the compiled HLO in tests/test_allreduce.py and costed by
the planner (jaxdist/plan/algorithms.py `algorithm_cost`); docs/AGGREGATION.md compares them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxdist import compression, sharding
from jaxdist.compression import Codec
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
    """The backend's own all-reduce. As `xla_flat` it gets the whole gradient as one flat buffer
    (`mean_tree`): one collective, where the partitioner's per-tensor all-reduces, combined into a
    variadic one, run on XLA:CPU as one gloo all-reduce per tensor, each paying the link's latency
    2(N-1) times (docs/AGGREGATION.md, "Latency and loss")."""
    return jax.lax.psum(x, axis)


@dataclasses.dataclass(frozen=True)
class AlgorithmSpec:
    """One `grad_sync.algorithm`: its reduce, its buffer padding and what it can do.

    Attributes:
      reduce: `(flat [S] buffer, axis, N, hosts) -> its sum on every device`.
      multiple: `(N, hosts) -> the multiple the flat buffer is zero-padded to`.
      native: the backend's own collective (`lax.psum`): no rules of its own.
      per_hop: runs a compressor's per-hop codec (its spec's `per_hop`) at every hop.
      power_of_two: needs a power-of-two number of replicas.
      across_hosts: reduces within each host, then across hosts (`mesh.dcn_data`): needs
        1 < hosts < N, and is the one `grad_sync.compress_over='dcn'` compresses.
    """

    reduce: Reduce
    multiple: Callable[[int, int], int]
    native: bool = False
    per_hop: bool = False
    power_of_two: bool = False
    across_hosts: bool = False


# The one registry of `grad_sync.algorithm` names.
ALGORITHMS: dict[str, AlgorithmSpec] = {
    "xla": AlgorithmSpec(xla, lambda n, h: 1, native=True),
    "ring": AlgorithmSpec(ring, lambda n, h: n, per_hop=True),
    "halving_doubling": AlgorithmSpec(halving_doubling, lambda n, h: n, power_of_two=True),
    "tree": AlgorithmSpec(tree, lambda n, h: 1),
    "hierarchical": AlgorithmSpec(hierarchical, lambda n, h: n, per_hop=True, across_hosts=True),
    "ps": AlgorithmSpec(ps, lambda n, h: 1),
    "sharded_ps": AlgorithmSpec(sharded_ps, lambda n, h: n),
    "xla_flat": AlgorithmSpec(xla, lambda n, h: 1),
}


def all_reduce(x: jax.Array, axis: str, n: int, algorithm: str, hosts: int = 1) -> jax.Array:
    """The sum over `axis` of a flat buffer of any length (zero-padded for the algorithm)."""
    spec = ALGORITHMS[algorithm]
    size = x.shape[0]
    pad = -size % spec.multiple(n, hosts)
    if pad:
        x = jnp.concatenate([x, jnp.zeros((pad,), x.dtype)])
    return spec.reduce(x, axis, n, hosts)[:size]


def as_one_buffer(tree: Any, reduce_flat: Callable[[jax.Array], jax.Array]) -> Any:
    """`reduce_flat` applied to every leaf of `tree` at once, as one flat f32 buffer (one
    exchange, not one per tensor); each leaf gets its part back in its own shape and dtype."""
    leaves, treedef = jax.tree.flatten(tree)
    out = reduce_flat(jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves]))
    parts, start = [], 0
    for x in leaves:
        parts.append(out[start : start + x.size].reshape(x.shape).astype(x.dtype))
        start += x.size
    return jax.tree.unflatten(treedef, parts)


def mean_tree(tree: Any, axis: str, algorithm: str, hosts: int = 1) -> Any:
    """Every float leaf's mean over `axis`, all leaves reduced as one flat f32 buffer."""
    n = jax.lax.axis_size(axis)
    return as_one_buffer(tree, lambda flat: all_reduce(flat, axis, n, algorithm, hosts) / n)


def codec(name: str, topk_ratio: float = 1.0) -> Codec:
    """The per-hop codec of the compressor `name` (its spec's `per_hop`; `topk_ratio`: topk's).

    Raises:
      KeyError: `name` has no per-hop form.
    """
    spec = compression.COMPRESSORS[name]
    if spec.per_hop is None:
        raise KeyError(f"compression {name!r} has no per-hop codec")
    return spec.per_hop({"compression": name, "topk_ratio": topk_ratio})


def _per_hop_names() -> str:
    return ", ".join(n for n, s in compression.COMPRESSORS.items() if s.per_hop is not None)


def per_hop(grad_sync_cfg) -> bool:
    """Whether this config compresses at every hop of its algorithm (`ring`, or `hierarchical`
    across hosts) rather than running an exact reduction."""
    spec = compression.COMPRESSORS.get(grad_sync_cfg.compression)
    algo = ALGORITHMS.get(grad_sync_cfg.algorithm)
    return bool(spec and algo and spec.per_hop is not None and algo.per_hop)


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
    algo = ALGORITHMS[name]
    spec = compression.COMPRESSORS.get(g.compression)  # compression.check names a bad one
    codec = spec is not None and spec.per_hop is not None
    over = g.compress_over
    if over not in ("all", "dcn"):
        raise ConfigError(f"grad_sync.compress_over={over!r} is not valid; choose one of all, dcn")
    if over == "dcn" and not (algo.across_hosts and codec):
        across = ", ".join(a for a, s in ALGORITHMS.items() if s.across_hosts)
        raise ConfigError(
            "grad_sync.compress_over='dcn' compresses the cross-host stage of "
            f"algorithm={across!r} with compression in {_per_hop_names()}, got algorithm="
            f"{name!r}, compression={g.compression!r}"
        )
    if algo.native:
        return
    if n <= 1:
        raise ConfigError(
            f"grad_sync.algorithm={name!r} reduces over the data-parallel replicas, but "
            f"mesh.data={n}; set mesh.data > 1 or grad_sync.algorithm='xla'"
        )
    if algo.per_hop and codec:
        if algo.across_hosts and over != "dcn":
            raise ConfigError(
                f"grad_sync.algorithm={name!r} with compression={g.compression!r} "
                "compresses only across hosts: set grad_sync.compress_over='dcn'"
            )
        if unsupported := spec.per_hop_unsupported(g):
            raise ConfigError(
                f"grad_sync.algorithm={name!r} with compression={g.compression!r} sends each "
                "hop's codec with its residual only; unset grad_sync."
                f"{', '.join(unsupported)} (for algorithm='xla')"
            )
        if mesh_shape["pipeline"] > 1:
            raise ConfigError(
                f"grad_sync.algorithm={name!r} with compression={g.compression!r} (per hop) "
                f"needs mesh.pipeline = 1, got {mesh_shape['pipeline']}"
            )
    elif g.compression != "none" or g.local_steps > 1:
        per_hop_algos = " or ".join(repr(a) for a, s in ALGORITHMS.items() if s.per_hop)
        raise ConfigError(
            f"grad_sync.algorithm={name!r} runs the exact reduction; it does not combine with "
            f"grad_sync.compression={g.compression!r} / local_steps={g.local_steps} (use 'xla'; "
            f"{per_hop_algos} take compression in {_per_hop_names()} per hop)"
        )
    if algo.power_of_two and n & (n - 1):
        raise ConfigError(
            f"grad_sync.algorithm={name!r} needs a power-of-two mesh.data, got {n}; "
            "use 'ring' or 'tree' for other sizes"
        )
    hosts = int(config.mesh.dcn_data)
    if algo.across_hosts and not (1 < hosts < n):
        raise ConfigError(
            f"grad_sync.algorithm={name!r} needs the data axis split over hosts: "
            f"1 < mesh.dcn_data < mesh.data={n}, got mesh.dcn_data={hosts}"
        )
