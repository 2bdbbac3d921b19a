"""What the emulated-network tests run inside each host (started by `scripts/launch.py --network`).

    python tests/netem_job.py allreduce BYTES REPS OUT.json   # psum of BYTES per device, REPS times
    python tests/netem_job.py idle SECONDS OUT.json            # joined, no collective: heartbeats only

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


if __name__ == "__main__":
    distributed.initialize()
    mode, *rest = sys.argv[1:]
    if mode == "allreduce":
        allreduce(int(rest[0]), int(rest[1]), rest[2])
    else:
        idle(float(rest[0]), rest[1])
