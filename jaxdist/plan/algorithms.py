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
    """(α seconds, β bytes/s) of one message inside a host (False) or across hosts (True; the
    payload rate one crossing message gets alone, `Hardware.host_bandwidth`)."""
    return (
        (hw.inter_latency, hw.host_bandwidth) if cross else (hw.intra_latency, hw.intra_bandwidth)
    )


def _cross(hw: Hardware, payload: float, concurrent: int) -> float:
    """Seconds for `concurrent` devices of one host to each send `payload` bytes across at once:
    with one link per host (`host_link`) they share it, else each has its own share."""
    return payload * (concurrent if hw.host_link else 1) / hw.host_bandwidth


def algorithm_cost(
    algorithm: str, size_bytes: float, n: int, hw: Hardware, local: int = 0, arrays: int = 1
) -> AlgorithmCost:
    """Predicted steps, hot-spot bytes and time of one all-reduce of `size_bytes` over `n` devices.

    `local` of the `n` share a host (0: as many as fit, `hw.devices_per_host`), consecutive in
    the axis, H = N / local hosts, as `hierarchical` and the mesh lay them out. A ring step
    crosses with one device per host (consecutive devices), a halving-doubling or tree step at
    distance >= `local` and the hierarchical and sharded-PS exchanges with all `local` at once, a
    tree's step with one (`_cross`). `xla` is the backend's all-reduce (`Hardware.xla_allreduce`):
    two-level (NCCL) or gloo's flat ring (XLA:CPU); `xla_flat` the same of one flat buffer.
    `arrays`: the gradient's arrays, in one variadic all-reduce that NCCL runs as one grouped
    call but XLA:CPU as one gloo ring per array (`hlo_cost.CollectiveOp.buffers`): on `flat_ring`
    hardware `xla` pays each array's 2(N-1) latencies; the others reduce one flat buffer
    (`allreduce.mean_tree`). Raises ConfigError where the algorithm cannot run.
    """
    s, local = float(size_bytes), local or min(n, hw.devices_per_host)
    hosts = max(1, n // local)
    log = math.ceil(math.log2(n)) if n > 1 else 0
    a_in, b_in = _tier(hw, False)
    a_x, _ = _tier(hw, hosts > 1)
    ring_busy = 2 * 2 * (n - 1) / n * s

    def ring_step(payload: float) -> float:  # one device per host crosses, the rest stay inside
        if hosts > 1:
            return max(a_x + _cross(hw, payload, 1), a_in + payload / b_in)
        return a_in + payload / b_in

    if algorithm in ("xla", "xla_flat") and hw.xla_allreduce == "flat_ring":
        calls = max(1, arrays) if algorithm == "xla" else 1  # one gloo ring per array
        extra = (calls - 1) * 2 * (n - 1) * (a_x if hosts > 1 else a_in)
        t = 2 * (n - 1) * ring_step(s / n) + extra
        return AlgorithmCost(algorithm, n, hosts, calls, ring_busy, t)
    if algorithm in (
        "xla",
        "xla_flat",
    ):  # NCCL-like: ring in hosts, tree latency across (term_time)
        t = 2 * (local - 1) / local * s / b_in + 2 * (local - 1) * a_in
        if hosts > 1:
            t += _cross(hw, 2 * (hosts - 1) / hosts * s / local, local)
            t += 2 * math.ceil(math.log2(hosts)) * hw.inter_latency
        return AlgorithmCost(algorithm, n, hosts, 1, ring_busy, t)
    if algorithm == "ring":
        return AlgorithmCost(
            algorithm, n, hosts, 2 * (n - 1), ring_busy, 2 * (n - 1) * ring_step(s / n)
        )
    if algorithm in ("halving_doubling", "tree"):
        if algorithm == "halving_doubling" and n & (n - 1):
            raise ConfigError(f"halving_doubling needs a power-of-two device count, got {n}")
        t = 0.0
        for k in range(log):  # distance 2^k: partners in one host while 2^k < L
            payload = s / 2 ** (log - k) if algorithm == "halving_doubling" else s
            if 2**k >= local and hosts > 1:  # halving-doubling: a host's devices all cross at
                # once; tree: one sender per host (device i mod 2d = d, d >= local)
                senders = 1 if algorithm == "tree" else local
                t += 2 * (a_x + _cross(hw, payload, senders))
            else:
                t += 2 * (a_in + payload / b_in)
        busy = ring_busy if algorithm == "halving_doubling" else 2 * log * s
        return AlgorithmCost(algorithm, n, hosts, 2 * log, busy, t)
    if algorithm == "hierarchical":
        if hosts < 2:
            raise ConfigError(f"hierarchical needs more than one host; {n} devices fit in one")
        t = 2 * (local - 1) * (a_in + s / local / b_in)
        t += 2 * (hosts - 1) * (hw.inter_latency + _cross(hw, s / n, local))
        busy = 2 * (2 * (local - 1) / local * s + 2 * (hosts - 1) / hosts * s / local)
        return AlgorithmCost(algorithm, n, hosts, 2 * (local - 1) + 2 * (hosts - 1), busy, t)
    if algorithm == "ps":  # the server's link carries every push and every pull, one at a time
        t = 2 * ((local - 1) * (a_in + s / b_in) + (n - local) * (a_x + _cross(hw, s, 1)))
        return AlgorithmCost(algorithm, n, hosts, 2 * (n - 1), 2 * (n - 1) * s, t)
    if algorithm == "sharded_ps":  # all-to-all + all-gather: N-1 direct messages of S/N each
        per_peer = s / n
        push = (local - 1) * (a_in + per_peer / b_in) + (n - local) * a_x
        push += _cross(hw, (n - local) * per_peer, local)
        if hw.xla_allreduce == "flat_ring":  # gloo's all-gather is a ring too: N-1 steps of S/N
            return AlgorithmCost(
                algorithm, n, hosts, 2, ring_busy, push + (n - 1) * ring_step(per_peer)
            )
        return AlgorithmCost(algorithm, n, hosts, 2, ring_busy, 2 * push)
    raise ConfigError(f"algorithm={algorithm!r} has no cost model")


def recommend_algorithm(
    size_bytes: float, n: int, hw: Hardware, local: int = 0, arrays: int = 1
) -> list[AlgorithmCost]:
    """Every algorithm that can run on `n` devices, fastest first (the first is the pick; a tie
    keeps `allreduce.ALGORITHMS`' order, `xla` first)."""
    costs = []
    for name in allreduce.ALGORITHMS:
        try:
            costs.append(algorithm_cost(name, size_bytes, n, hw, local, arrays))
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
    costs = recommend_algorithm(size, n, hw, local, arrays=len(model.params))
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
