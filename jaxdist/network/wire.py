"""A switch in user space that delays, jitters and drops frames: netem for kernels built without it.

Some kernels (this machine's among them) have no netem qdisc, nor any classifier or action that
could delay or drop a packet; they do have `tbf` and raw packet sockets. Where a link asks for a
delay, jitter or loss and the kernel has no netem, `namespaces.Cluster` leaves the switch ports
out of the bridge and runs this process in the switch namespace instead. It is a learning Ethernet
switch: it reads every frame a host sends from that host's port (`h<i>`, an `AF_PACKET` socket),
decides its fate, and writes it to the destination's port (every other port for a broadcast or an
unknown destination), where the port's `tbf` still shapes the rate as it does with the bridge.

A frame host A sends to host B:
- is dropped with probability `loss_A` (the sender's link, as with netem on the sending side);
- else leaves after `delay_A/2 + delay_B/2` plus a normal jitter of standard deviation
  `jitter_A/2` and `jitter_B/2` (one draw per half), as netem's halves on each direction would;
- never overtakes an earlier frame of the same path (A to B): a real link does not reorder, and
  netem with jitter does, which would add duplicate ACKs of its own.

Its cost, measured by tests/test_netem.py and docs/MULTIHOST.md: a few tens of microseconds per
frame, which is the floor of what it can delay and of its timing error. It waits with `select`,
whose timeout has microsecond resolution (epoll's is a millisecond), with the process's timer slack
at one microsecond, and asks for a higher scheduling priority where it may (nice -10, as root): the
link it stands for shares no CPU with the hosts, and a training step's threads must not hold a
frame back. It counts how late it released each frame against the time it drew
(`late_p50_us`, `late_p99_us`, `late_max_us` in its counters), so a study can tell a slow wire
from a slow link. One Python process's CPU limits it to slow links: `MAX_RATE_BPS`. The hosts'
links are made with `gso_max_segs 1`, so every frame it reads fits the MTU, and their transmit
checksum offload is turned off (`no_checksum_offload`): a veth otherwise hands over TCP and UDP
frames whose checksum is left for a NIC to fill in, and the receiving host would drop them as
corrupt.

Run as `python wire.py SPEC.json` inside the switch namespace: SPEC holds the
ports' links and the seed; the process ends when its standard input closes (the launcher gone)
and writes its counters to `SPEC.json`'s `stats` path when it ends.
"""

from __future__ import annotations

import ctypes
import fcntl
import heapq
import json
import os
import random
import select
import signal
import socket
import struct
import sys
import time

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
SIOCETHTOOL = 0x8946
ETHTOOL_STXCSUM = 0x17
MAX_RATE_BPS = 200e6  # what one Python process forwards with a core shared with training
PR_SET_TIMERSLACK = 29
NICE = -10  # the wire's priority where the process may raise it (root)
SPIN_S = 300e-6  # the last stretch before a frame is due is polled, not slept: a wakeup costs more
LATE_BIN_US = 10  # the lateness histogram's resolution; the last bin holds everything later
LATE_BINS = 2000


def no_checksum_offload(dev: str) -> None:
    """Turns off `dev`'s transmit checksum offload (`ethtool -K DEV tx off`, as an ioctl: ethtool
    is not always installed), and with it TSO, in the calling process's network namespace."""
    value = ctypes.create_string_buffer(struct.pack("II", ETHTOOL_STXCSUM, 0), 8)
    request = struct.pack("16sP", dev.encode(), ctypes.addressof(value)) + bytes(16)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s.fileno(), SIOCETHTOOL, request)


def prompt_wakeups() -> None:
    """One microsecond of timer slack (the kernel's default is 50) and nice -10 where permitted:
    a frame due at t leaves as close to t as the scheduler allows."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(1000), 0, 0, 0)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, NICE)
    except OSError:  # not root: the default priority
        pass


def percentile_us(hist: list[int], q: float) -> float:
    """The `q` quantile (0..1) of a lateness histogram, as the upper edge of its bin, in us."""
    total = sum(hist)
    if not total:
        return 0.0
    seen = 0
    for i, n in enumerate(hist):
        seen += n
        if seen >= q * total:
            return float((i + 1) * LATE_BIN_US)
    return float(len(hist) * LATE_BIN_US)


class Draws:
    """A wire's random fates: which frames are lost, how much jitter a frame gets.

    Each port draws its frames' losses from its own generator and each path (A to B) its jitter
    from its own, all seeded from `seed`: whether the n-th frame a host sends is lost depends on
    the seed, the port and n alone, not on how the other ports' frames and their draws interleave
    with it (with one generator for every draw, the counts of a run depended on that timing).

    Args:
      links: per port (host index order), a dict with `delay_s`, `jitter_s`, `loss`.
      seed: the generators' seed.
    """

    def __init__(self, links: list[dict[str, float]], seed: int = 0):
        self.links = links
        n = len(links)
        # A str seed is hashed with SHA-512 (random.seed, version 2): the same in every process.
        self.loss_rng = [random.Random(f"{seed}:loss:{i}") for i in range(n)]
        self.jitter_rng = {
            (a, b): random.Random(f"{seed}:jitter:{a}:{b}")
            for a in range(n)
            for b in range(n)
            if a != b
        }

    def lost(self, src: int) -> bool:
        """Whether the next frame `src` sends is dropped (probability `loss` of its link)."""
        loss = self.links[src]["loss"]
        return bool(loss) and self.loss_rng[src].random() < loss

    def delay(self, src: int, dst: int) -> float:
        """The next frame from `src` to `dst`: seconds on the wire (its drawn jitter included)."""
        a, b = self.links[src], self.links[dst]
        d = a["delay_s"] / 2 + b["delay_s"] / 2
        rng = self.jitter_rng[(src, dst)]
        for j in (a["jitter_s"], b["jitter_s"]):
            if j:
                d += rng.gauss(0.0, j / 2)
        return max(d, 0.0)


class Wire:
    """The switch: one raw socket per port, a heap of frames in flight, a MAC table.

    Args:
      links: per port (host index order), a dict with `delay_s`, `jitter_s`, `loss`.
      seed: the seed of its loss and jitter draws (`Draws`).
    """

    def __init__(self, links: list[dict[str, float]], seed: int = 0):
        self.links = links
        self.draws = Draws(links, seed)
        self.socks = []
        for i in range(len(links)):
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            s.bind((f"h{i}", 0))
            s.setblocking(False)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            self.socks.append(s)
        self.by_fd = {s.fileno(): i for i, s in enumerate(self.socks)}
        self.macs: dict[bytes, int] = {}
        self.heap: list[tuple[float, int, int, bytes]] = []
        self.last: dict[tuple[int, int], float] = {}
        self.seq = 0
        self.stats = {"frames_in": 0, "frames_out": 0, "lost": 0, "send_errors": 0}
        self.late_hist = [0] * LATE_BINS  # frames by how late they left, LATE_BIN_US per bin
        self.late_max_s = 0.0
        self.stats_per_port = [{"in": 0, "lost": 0} for _ in links]

    def _receive(self, src: int, now: float) -> None:
        sock = self.socks[src]
        while True:
            try:
                frame, addr = sock.recvfrom(65536)
            except BlockingIOError:
                return
            if addr[2] == PACKET_OUTGOING:  # what this process wrote to the port
                continue
            self.stats["frames_in"] += 1
            self.stats_per_port[src]["in"] += 1
            self.macs[frame[6:12]] = src
            if self.draws.lost(src):
                self.stats["lost"] += 1
                self.stats_per_port[src]["lost"] += 1
                continue
            dst = None if frame[0] & 1 else self.macs.get(frame[0:6])
            for d in [dst] if dst is not None else range(len(self.socks)):
                if d == src:
                    continue
                t = max(now + self.draws.delay(src, d), self.last.get((src, d), 0.0))
                self.last[(src, d)] = t
                self.seq += 1
                heapq.heappush(self.heap, (t, self.seq, d, frame))

    def _release(self, now: float) -> None:
        while self.heap and self.heap[0][0] <= now:
            due, _, dst, frame = heapq.heappop(self.heap)
            try:
                self.socks[dst].send(frame)
                self.stats["frames_out"] += 1
            except OSError:  # the port's tbf queue is full (ENOBUFS) or the port is down
                self.stats["send_errors"] += 1
            late = now - due
            self.late_hist[min(int(late * 1e6) // LATE_BIN_US, LATE_BINS - 1)] += 1
            self.late_max_s = max(self.late_max_s, late)

    def lateness(self) -> dict[str, float]:
        """How late frames left against their drawn time: median, 99th percentile, maximum (us)."""
        return {
            "late_p50_us": percentile_us(self.late_hist, 0.5),
            "late_p99_us": percentile_us(self.late_hist, 0.99),
            "late_max_us": round(self.late_max_s * 1e6, 1),
        }

    def run(self, stop_fd: int) -> None:
        """Forwards frames until `stop_fd` reads EOF (or SIGTERM)."""
        fds = [s.fileno() for s in self.socks] + [stop_fd]
        while True:
            self._release(time.monotonic())
            timeout = None if not self.heap else self.heap[0][0] - time.monotonic()
            if timeout is not None:
                timeout = 0.0 if timeout <= SPIN_S else timeout - SPIN_S
            ready, _, _ = select.select(fds, [], [], timeout)
            for fd in ready:
                if fd == stop_fd:
                    if not os.read(stop_fd, 4096):
                        return
                    continue
                self._receive(self.by_fd[fd], time.monotonic())


def main(argv: list[str]) -> int:
    if argv[1] == "--no_checksum_offload":
        no_checksum_offload(argv[2])
        return 0
    with open(argv[1], encoding="utf-8") as f:
        spec = json.load(f)
    prompt_wakeups()
    wire = Wire(spec["links"], seed=spec.get("seed", 0))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        wire.run(sys.stdin.fileno())
    finally:
        if spec.get("stats"):
            stats = {**wire.stats, **wire.lateness(), "cpu_s": time.process_time()}
            stats["ports"] = wire.stats_per_port
            with open(spec["stats"] + ".tmp", "w", encoding="utf-8") as f:
                json.dump(stats, f)
            os.replace(spec["stats"] + ".tmp", spec["stats"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
