"""Gradient all-reduce algorithms (`grad_sync.algorithm`): α-β cost per tier, and the pick for a layout."""

from __future__ import annotations

import dataclasses
import math

from jaxdist import allreduce
from jaxdist.errors import ConfigError
from jaxdist.plan.hardware import Hardware
from jaxdist.plan.layouts import hosts_of
from jaxdist.plan.model import ModelInfo
from jaxdist.plan.predict import Prediction


@dataclasses.dataclass(frozen=True)
class AlgorithmCost:
    """One algorithm reducing S bytes over N devices, as the compiled HLO runs it.

    Attributes:
      steps: sequential collective ops (the latency terms; `hlo_cost.collective_phases` steps).
      busiest_bytes: bytes sent + received by the device that moves the most (the parameter
        server's hot spot), as `hlo_cost.collective_phases` reads it from the HLO.
      time_s: α-β time: per step the latency α of the tier the step crosses plus its payload over
        that tier's bandwidth β (a ring step waits on its slowest hop; a server takes its pushes
        one after another through its own link; an all-to-all / all-gather is N-1 direct
        messages, each paying α).
    """

    algorithm: str
    n: int
    hosts: int
    steps: int
    busiest_bytes: float
    time_s: float


def _tier(hw: Hardware, cross: bool) -> tuple[float, float]:
    """(α seconds, β bytes/s) of one step inside a host (False) or across hosts (True)."""
    return (
        (hw.inter_latency, hw.inter_bandwidth) if cross else (hw.intra_latency, hw.intra_bandwidth)
    )


def algorithm_cost(
    algorithm: str, size_bytes: float, n: int, hw: Hardware, local: int = 0
) -> AlgorithmCost:
    """Predicted steps, hot-spot bytes and time of one all-reduce of `size_bytes` over `n` devices.

    `local` of the `n` share a host (0: as many as fit, `hw.devices_per_host`), consecutive in
    the axis, H = N / local hosts, as `hierarchical` and the mesh lay them out. Raises ConfigError
    where the algorithm cannot run.
    """
    s, local = float(size_bytes), local or min(n, hw.devices_per_host)
    hosts = max(1, n // local)
    log = math.ceil(math.log2(n)) if n > 1 else 0
    a_in, b_in = _tier(hw, False)
    a_x, b_x = _tier(hw, hosts > 1)
    ring_busy = 2 * 2 * (n - 1) / n * s
    if algorithm == "xla":  # NCCL-like: ring inside hosts, tree latency across (term_time)
        t = 2 * (local - 1) / local * s / b_in + 2 * (local - 1) * a_in
        if hosts > 1:
            t += 2 * (hosts - 1) / hosts * s / local / hw.inter_bandwidth
            t += 2 * math.ceil(math.log2(hosts)) * hw.inter_latency
        return AlgorithmCost(algorithm, n, hosts, 1, ring_busy, t)
    if algorithm == "ring":
        return AlgorithmCost(
            algorithm, n, hosts, 2 * (n - 1), ring_busy, 2 * (n - 1) * (a_x + s / n / b_x)
        )
    if algorithm in ("halving_doubling", "tree"):
        if algorithm == "halving_doubling" and n & (n - 1):
            raise ConfigError(f"halving_doubling needs a power-of-two device count, got {n}")
        t = 0.0
        for k in range(log):  # distance 2^k: partners in one host while 2^k < L
            a, b = _tier(hw, 2**k >= local)
            payload = s / 2 ** (log - k) if algorithm == "halving_doubling" else s
            t += 2 * (a + payload / b)
        busy = ring_busy if algorithm == "halving_doubling" else 2 * log * s
        return AlgorithmCost(algorithm, n, hosts, 2 * log, busy, t)
    if algorithm == "hierarchical":
        if hosts < 2:
            raise ConfigError(f"hierarchical needs more than one host; {n} devices fit in one")
        t = 2 * (local - 1) * (a_in + s / local / b_in)
        t += 2 * (hosts - 1) * (hw.inter_latency + s / n / hw.inter_bandwidth)
        busy = 2 * (2 * (local - 1) / local * s + 2 * (hosts - 1) / hosts * s / local)
        return AlgorithmCost(algorithm, n, hosts, 2 * (local - 1) + 2 * (hosts - 1), busy, t)
    if algorithm == "ps":  # the server's link carries every push and every pull
        t = 2 * ((local - 1) * (a_in + s / b_in) + (n - local) * (a_x + s / b_x))
        return AlgorithmCost(algorithm, n, hosts, 2 * (n - 1), 2 * (n - 1) * s, t)
    if algorithm == "sharded_ps":  # all-to-all + all-gather: N-1 direct messages of S/N each
        per_peer = s / n
        t = 2 * ((local - 1) * (a_in + per_peer / b_in) + (n - local) * (a_x + per_peer / b_x))
        return AlgorithmCost(algorithm, n, hosts, 2, ring_busy, t)
    raise ConfigError(f"algorithm={algorithm!r} has no cost model")


def recommend_algorithm(
    size_bytes: float, n: int, hw: Hardware, local: int = 0
) -> list[AlgorithmCost]:
    """Every algorithm that can run on `n` devices, fastest first (the first is the pick)."""
    costs = []
    for name in allreduce.ALGORITHMS:
        try:
            costs.append(algorithm_cost(name, size_bytes, n, hw, local))
        except ConfigError:
            continue
    return sorted(costs, key=lambda c: c.time_s)


def algorithm_table(best: Prediction, model: ModelInfo, hw: Hardware) -> tuple[str, list[dict]]:
    """The data axis's gradient all-reduce for a layout: every algorithm's predicted cost, the pick
    first. The gradient per device is the float32 parameters over fsdp × tensor × pipeline (each
    device reduces its own shard over `data`); those axes keep XLA's own collectives."""
    lay = best.layout
    n = lay.data
    size = model.num_params * 4 / (lay.fsdp * lay.tensor * lay.pipeline)
    if n <= 1:
        return "grad_sync.algorithm: mesh.data = 1, nothing to reduce over data (keep 'xla')", []
    local = hosts_of(lay, hw)[0]["data"]
    costs = recommend_algorithm(size, n, hw, local)
    rows = [dataclasses.asdict(c) for c in costs]
    lines = [
        f"gradient all-reduce over data (N={n}, {local} per host, {size / 2**20:.1f} MiB per "
        f"device, {hw.name}): "
        f"recommended grad_sync.algorithm={costs[0].algorithm} (docs/AGGREGATION.md); "
        "fsdp/tensor/pipeline: xla",
        f"  {'algorithm':<17}{'steps':>7}{'busiest MiB':>13}{'time ms':>10}",
    ]
    for c in costs:
        lines.append(
            f"  {c.algorithm:<17}{c.steps:>7}{c.busiest_bytes / 2**20:>13.1f}{1e3 * c.time_s:>10.3f}"
        )
    return "\n".join(lines), rows
