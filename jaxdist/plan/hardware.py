"""Hardware profiles: one cluster's peak FLOP/s, memory, links and overlap, as the cost model sees it."""

from __future__ import annotations

import dataclasses

from jaxdist import flops
from jaxdist.errors import ConfigError

GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One kind of cluster, as the cost model sees it.

    Attributes:
      name: profile name.
      peak_flops: dense peak FLOP/s of one device in the compute dtype.
      memory_bytes: memory of one device, bytes.
      intra_bandwidth: bytes/s one device sends (per direction) to devices of its own host / fast
        domain (NVLink, TPU ICI).
      intra_latency: seconds per step of a collective inside a host.
      inter_bandwidth: bytes/s one device sends to other hosts (its share of the host's NICs).
      inter_latency: seconds per step of a collective across hosts.
      devices_per_host: devices sharing the fast interconnect.
      matmul_efficiency: fraction of `peak_flops` a training step's matmuls reach (calibrated).
      overlap: fraction of the compute time under which FSDP gathers and gradient sync can hide
        (XLA's async collectives / latency-hiding scheduler); tensor- and pipeline-parallel
        transfers sit on the critical path and never hide.
      native_reduce_scatter: whether the backend emits reduce-scatter (GPU, TPU) rather than
        all-reduce + dynamic-slice (XLA:CPU) for gradients of FSDP-sharded parameters.
      bf16_collectives: whether bf16 collectives run in bf16 (GPU, TPU); XLA:CPU promotes them to
        float32.
      bf16_activations: whether bf16 compute keeps its activations in bf16 (GPU, TPU); XLA:CPU
        computes bf16 operations in float32, so its activations are float32 (next to the bf16
        copies of the weights).
      usable_fraction: share of `memory_bytes` a step may use (allocator, runtime and fragmentation
        take the rest); a layout fits if its predicted peak is below it.
      attention_efficiency: fraction of `peak_flops` fused (flash) attention reaches, counted in
        model FLOPs (12·L·d·T per token); 0 = `matmul_efficiency`.
      hbm_bandwidth: bytes/s of device memory for the step's elementwise work (norms, RoPE,
        activations, residuals, the loss over the vocabulary, unfused attention scores); 0 = not
        modelled (the CPU profile: there that time is folded into `matmul_efficiency`).
      fused_attention: whether `model.attention=auto` runs fused flash attention (cuDNN on GPUs).
      xla_allreduce: how the backend runs XLA's own all-reduce across hosts: "two_level" (NCCL,
        TPU: a ring inside each host, S/L per device across) or "flat_ring" (XLA:CPU's gloo:
        `gloo::allreduce` with its RING algorithm over all N ranks in the group's order, so a
        host's crossing devices carry 2(N-1)/N·S per step, docs/AGGREGATION.md).
      host_link: whether each host has one link (`devices_per_host` × `inter_bandwidth` bytes/s
        each way) that whichever of its devices crosses uses whole, the devices crossing at the
        same time sharing it (an emulated host's veth; a CPU host's NIC). False: each device has
        its own `inter_bandwidth` (one NIC per GPU).
      fp8_speedup: how many times the bf16 FLOP rate an FP8 GEMM runs at (`train.matmul_precision`,
        jaxdist/fp8.py); 0 = no FP8 GEMMs (the CPU emulates FP8: its FP8 time is not modelled).
      wire_efficiency: payload bytes per byte the cross-host link carries (1: not modelled). TCP
        over Ethernet: (MTU - 52) / (MTU + 14 + 33) for a host that sends and receives as much
        (headers of full segments, one 66-byte ACK per two segments received), 0.936 at 1500.
    """

    name: str
    peak_flops: float
    memory_bytes: float
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    devices_per_host: int
    matmul_efficiency: float
    overlap: float = 0.0
    native_reduce_scatter: bool = True
    bf16_collectives: bool = True
    bf16_activations: bool = True
    usable_fraction: float = 0.9
    attention_efficiency: float = 0.0
    hbm_bandwidth: float = 0.0
    fused_attention: bool = False
    xla_allreduce: str = "two_level"
    host_link: bool = False
    wire_efficiency: float = 1.0
    fp8_speedup: float = 0.0

    def __post_init__(self):
        if self.xla_allreduce not in ("two_level", "flat_ring"):
            raise ConfigError(
                f"hardware {self.name!r}: xla_allreduce={self.xla_allreduce!r} must be "
                "'two_level' or 'flat_ring'"
            )
        if not 0 < self.wire_efficiency <= 1:
            raise ConfigError(
                f"hardware {self.name!r}: wire_efficiency={self.wire_efficiency:g} must be in (0, 1]"
            )

    @property
    def host_bandwidth(self) -> float:
        """Bytes/s of payload one crossing message gets: the whole host link (`host_link`) or the
        device's own share, after the framing (`wire_efficiency`)."""
        per = self.inter_bandwidth * (self.devices_per_host if self.host_link else 1)
        return per * self.wire_efficiency


PROFILES: dict[str, Hardware] = {
    # 8×H100 SXM per node: NVLink 4 at ~450 GB/s per direction per GPU, one 400 Gb/s InfiniBand NIC
    # per GPU (50 GB/s). Compute constants measured on one H100 (docs/PERFORMANCE.md, "GPU"): the
    # profiler's matmul kernels ran gpt_1b's 6·N·tokens at 0.75 of the dense peak, cuDNN flash
    # attention its 12·L·d·T·tokens at 0.65, and the rest of the step moved bytes at ~3.0 TB/s.
    # FP8 GEMMs at twice the bf16 rate (the dense FP8 peak is twice bf16's; gpt_1b's matmul
    # kernels went from 351.4 to 183.2 ms with 92% of their FLOPs in FP8, docs/PERFORMANCE.md,
    # "FP8 GEMMs on an H100": 2.0× predicts 189.6).
    "h100_nvlink_ib": Hardware(
        name="h100_nvlink_ib",
        peak_flops=flops.PEAK_FLOPS["H100"],
        memory_bytes=80e9,
        intra_bandwidth=450e9,
        intra_latency=3e-6,
        inter_bandwidth=50e9,
        inter_latency=8e-6,
        devices_per_host=8,
        matmul_efficiency=0.75,
        overlap=0.8,
        attention_efficiency=0.65,
        hbm_bandwidth=3.0e12,
        fused_attention=True,
        fp8_speedup=2.0,
    ),
    # 8×A100 80GB per node with NVLink (~240 GB/s effective per direction), nodes joined by one
    # 100 Gb/s Ethernet link shared by the 8 GPUs (1.56 GB/s each), TCP latencies.
    "cloud_ethernet": Hardware(
        name="cloud_ethernet",
        peak_flops=flops.PEAK_FLOPS["A100"],
        memory_bytes=80e9,
        intra_bandwidth=240e9,
        intra_latency=5e-6,
        inter_bandwidth=100e9 / 8 / 8,
        inter_latency=30e-6,
        devices_per_host=8,
        matmul_efficiency=0.5,
        overlap=0.5,
    ),
    # A TPU v5p pod: 95 GB HBM, ICI across the whole slice (up to 8960 chips, so every layout here
    # stays on ICI; ~200 GB/s usable per direction along a ring), DCN beyond it.
    "tpu_v5p_pod": Hardware(
        name="tpu_v5p_pod",
        peak_flops=flops.PEAK_FLOPS["TPU v5p"],
        memory_bytes=95e9,
        intra_bandwidth=200e9,
        intra_latency=2e-6,
        inter_bandwidth=6.25e9,
        inter_latency=20e-6,
        devices_per_host=8960,
        matmul_efficiency=0.55,
        overlap=0.8,
    ),
    # This machine: 2 shared AMD EPYC cores simulating 8 devices in one process. Modest numbers;
    # collectives are memory copies. Matches XLA:CPU's lowering (all-reduce for reduce-scatter,
    # float32 collectives).
    "cpu_here": Hardware(
        name="cpu_here",
        peak_flops=50e9,
        memory_bytes=16 * GiB,
        intra_bandwidth=5e9,
        intra_latency=20e-6,
        inter_bandwidth=5e9,
        inter_latency=20e-6,
        devices_per_host=8,
        matmul_efficiency=0.3,
        overlap=0.0,
        native_reduce_scatter=False,
        bf16_collectives=False,
        bf16_activations=False,
        xla_allreduce="flat_ring",
    ),
}


# 8×H200 per node: the H100 profile (its compute constants are the H100's, not re-measured on an
# H200) with 141 GB of memory at ~4.3 TB/s.
PROFILES["h200_nvlink_ib"] = dataclasses.replace(
    PROFILES["h100_nvlink_ib"], name="h200_nvlink_ib", memory_bytes=141e9, hbm_bandwidth=4.3e12
)


def hardware(name: str | Hardware) -> Hardware:
    """A built-in profile by name (or the profile itself)."""
    if isinstance(name, Hardware):
        return name
    if name not in PROFILES:
        raise ConfigError(
            f"hardware={name!r} is not a profile; choose one of {', '.join(PROFILES)}"
        )
    return PROFILES[name]


def tcp_wire_efficiency(mtu: int) -> float:
    """Payload bytes per byte a TCP/IPv4 host link carries at `mtu` when the host receives as much
    as it sends: full segments carry MTU - 52 bytes (IP 20, TCP 32 with timestamps) in MTU + 14
    (Ethernet), and the host sends one 66-byte ACK per two segments it receives."""
    return (mtu - 52) / (mtu + 14 + 33)


def emulated_link(
    rate_bps: float,
    latency_s: float,
    devices_per_host: int,
    mtu: int = 1500,
    base: str | Hardware = "cpu_here",
) -> Hardware:
    """The `Hardware` of hosts joined by one shaped link each (`scripts/launch.py --network`): the
    `base` profile's compute and in-host tier, each host's link of `rate_bps` bits/s each way
    shared by its `devices_per_host` devices (`host_link`), `latency_s` per message across hosts
    (measured: tests/netem_job.py `allreduce` times a 4-byte one), TCP's framing at `mtu`.
    """
    if rate_bps <= 0 or latency_s < 0 or devices_per_host < 1:
        raise ConfigError(
            f"emulated_link: rate_bps={rate_bps:g} must be > 0, latency_s={latency_s:g} >= 0, "
            f"devices_per_host={devices_per_host} >= 1"
        )
    return dataclasses.replace(
        hardware(base),
        name=f"emulated {rate_bps / 1e6:g} Mbit/s",
        inter_bandwidth=rate_bps / 8 / devices_per_host,
        inter_latency=latency_s,
        devices_per_host=devices_per_host,
        host_link=True,
        wire_efficiency=tcp_wire_efficiency(mtu),
    )
