"""What the emulated-network tests run inside each host (started by `scripts/launch.py --network`).

    python tests/netem_job.py allreduce BYTES REPS OUT.json   # psum of BYTES per device, REPS times
    python tests/netem_job.py idle SECONDS OUT.json            # joined, no collective: heartbeats only
    python tests/netem_job.py collectives BYTES OUT.json       # each collective kind's time

Process 0 writes OUT.json: the wall time of each all-reduce (after one warm-up) and of 20 4-byte
ones (`small_times_s`: one message's latency, 2(N-1) per ring all-reduce), the HLO's bytes
per device per all-reduce (jaxdist.hlo_cost, as the layout record counts them) and every host's
link bytes and frames (sent, received, frames sent, frames received) over each timed all-reduce (or over the idle seconds) from `jaxdist.network.counters`.
"""

from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxdist import distributed  # noqa: E402

SMALL_REPS = 20


def _counters():
    from jaxdist.network import counters

    return counters.read(os.environ[counters.ENV_COUNTERS])


def _delta(before, after):
    return {h: [a - b for a, b in zip(after[h], before[h])] for h in after}


def allreduce(nbytes: int, reps: int, out: str) -> None:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxdist import hlo_cost

    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    n = nbytes // 4
    sharding = NamedSharding(mesh, PartitionSpec("d"))
    local = np.ones((jax.local_device_count(), n), np.float32)
    x = jax.make_array_from_process_local_data(sharding, local)

    @jax.jit
    def f(x):
        return jax.shard_map(
            lambda b: jax.lax.psum(b, "d"), mesh=mesh, in_specs=PartitionSpec("d"),
            out_specs=PartitionSpec("d"),
        )(x)  # fmt: skip

    compiled = f.lower(x).compile()
    hlo = hlo_cost.collective_bytes(compiled.as_text())
    y = compiled(x)
    jax.block_until_ready(y)  # warm-up: gloo's connections are made on first use
    times, per_rep = [], []
    for _ in range(reps):
        before = _counters()
        t0 = time.perf_counter()
        y = compiled(x)
        jax.block_until_ready(y)
        times.append(time.perf_counter() - t0)
        per_rep.append(_delta(before, _counters()))
    assert float(np.asarray(y.addressable_shards[0].data)[0, 0]) == jax.device_count()
    # One message's latency: a 4-byte all-reduce (gloo's ring: 2(N-1) messages of ~nothing)
    tiny = jax.make_array_from_process_local_data(
        sharding, np.ones((jax.local_device_count(), 1), np.float32)
    )
    small = f.lower(tiny).compile()
    jax.block_until_ready(small(tiny))
    small_times = []
    for _ in range(SMALL_REPS):
        t0 = time.perf_counter()
        jax.block_until_ready(small(tiny))
        small_times.append(time.perf_counter() - t0)
    if jax.process_index() == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "times_s": times,
                    "small_times_s": small_times,
                    "hlo_bytes_per_device": hlo,
                    "devices": jax.device_count(),
                    "processes": jax.process_count(),
                    "link_bytes_per_rep": per_rep,
                },
                f,
            )


def idle(seconds: float, out: str) -> None:
    import jax

    jax.devices()
    time.sleep(2)  # past the join's own messages
    before = _counters()
    time.sleep(seconds)
    after = _counters()
    if jax.process_index() == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"seconds": seconds, "link_bytes": _delta(before, after)}, f)


def collectives(nbytes: int, out: str, reps: int = 8) -> None:
    """Median seconds of each collective XLA:CPU runs over gloo, BYTES per device: a psum
    (gloo's ring all-reduce), an all-to-all, an all-gather of BYTES / R, a ring shift
    (collective-permute i -> i+1, a swap of pairs on 2 hosts) and a pairwise swap (i <-> i xor 1)
    of BYTES / 2: what each host sends is in `sent_bytes_per_host` (docs/AGGREGATION.md)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    r = jax.device_count()
    sharding = NamedSharding(mesh, PartitionSpec("d"))

    def array(n: int, dtype) -> jax.Array:
        local = np.ones((jax.local_device_count(), n), dtype)
        return jax.make_array_from_process_local_data(sharding, local)

    def timed(body, x) -> float:
        spec = PartitionSpec("d")
        fn = jax.jit(lambda x: jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)(x))
        compiled = fn.lower(x).compile()
        jax.block_until_ready(compiled(x))  # warm-up: gloo's connections are made on first use
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(x))
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    to_all = lambda b: jax.lax.all_to_all(b.reshape(r, -1), "d", 0, 0).reshape(1, -1)
    gather = lambda b: jax.lax.all_gather(b, "d", tiled=True)[:, : b.shape[1]]
    shift = lambda b: jax.lax.ppermute(b, "d", [(i, (i + 1) % r) for i in range(r)])
    swap = lambda b: jax.lax.ppermute(b, "d", [(i, i ^ 1) for i in range(r)])
    rows = {
        "psum": (timed(lambda b: jax.lax.psum(b, "d"), array(nbytes // 4, np.float32)),
                 2 * (r - 1) / r * nbytes),
        "all_to_all": (timed(to_all, array(nbytes, np.uint8)), (r - 1) / r * nbytes),
        "all_gather": (timed(gather, array(nbytes // r, np.uint8)), (r - 1) / r * nbytes),
        "ring_shift": (timed(shift, array(nbytes // 2, np.uint8)), nbytes / 2),
        "pair_swap": (timed(swap, array(nbytes // 2, np.uint8)), nbytes / 2),
    }  # fmt: skip
    if jax.process_index() == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "bytes_per_device": nbytes,
                    "processes": jax.process_count(),
                    "median_s": {k: t for k, (t, _) in rows.items()},
                    "sent_bytes_per_host": {k: b for k, (_, b) in rows.items()},
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    distributed.initialize()
    mode, *rest = sys.argv[1:]
    if mode == "allreduce":
        allreduce(int(rest[0]), int(rest[1]), rest[2])
    elif mode == "collectives":
        collectives(int(rest[0]), rest[1])
    else:
        idle(float(rest[0]), rest[1])
