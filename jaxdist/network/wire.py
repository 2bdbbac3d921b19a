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
frame (the floor of what it can delay, and of its timing error besides `epoll`'s 1 ms timer, which
it corrects by releasing a frame up to half a millisecond early), and one Python process's CPU,
which limits it to slow links: `MAX_RATE_BPS`. The hosts' links are made with `gso_max_segs 1`,
so every frame it reads fits the MTU, and their transmit checksum offload is turned off
(`no_checksum_offload`): a veth otherwise hands over TCP and UDP frames whose checksum is left for
a NIC to fill in, and the receiving host would drop them as corrupt.

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
_EARLY_S = 0.5e-3  # epoll's timer is 1 ms: release up to half of it early, on average on time


def no_checksum_offload(dev: str) -> None:
    """Turns off `dev`'s transmit checksum offload (`ethtool -K DEV tx off`, as an ioctl: ethtool
    is not always installed), and with it TSO, in the calling process's network namespace."""
    value = ctypes.create_string_buffer(struct.pack("II", ETHTOOL_STXCSUM, 0), 8)
    request = struct.pack("16sP", dev.encode(), ctypes.addressof(value)) + bytes(16)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s.fileno(), SIOCETHTOOL, request)


class Wire:
    """The switch: one raw socket per port, a heap of frames in flight, a MAC table.

    Args:
      links: per port (host index order), a dict with `delay_s`, `jitter_s`, `loss`.
      seed: the random generator's seed (loss and jitter draws).
    """

    def __init__(self, links: list[dict[str, float]], seed: int = 0):
        self.links = links
        self.rng = random.Random(seed)
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
        self.stats_per_port = [{"in": 0, "lost": 0} for _ in links]

    def _delay(self, src: int, dst: int) -> float:
        a, b = self.links[src], self.links[dst]
        d = a["delay_s"] / 2 + b["delay_s"] / 2
        for j in (a["jitter_s"], b["jitter_s"]):
            if j:
                d += self.rng.gauss(0.0, j / 2)
        return max(d, 0.0)

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
            if self.links[src]["loss"] and self.rng.random() < self.links[src]["loss"]:
                self.stats["lost"] += 1
                self.stats_per_port[src]["lost"] += 1
                continue
            dst = None if frame[0] & 1 else self.macs.get(frame[0:6])
            for d in [dst] if dst is not None else range(len(self.socks)):
                if d == src:
                    continue
                t = max(now + self._delay(src, d), self.last.get((src, d), 0.0))
                self.last[(src, d)] = t
                self.seq += 1
                heapq.heappush(self.heap, (t, self.seq, d, frame))

    def _release(self, now: float) -> None:
        while self.heap and self.heap[0][0] <= now + _EARLY_S:
            _, _, dst, frame = heapq.heappop(self.heap)
            try:
                self.socks[dst].send(frame)
                self.stats["frames_out"] += 1
            except OSError:  # the port's tbf queue is full (ENOBUFS) or the port is down
                self.stats["send_errors"] += 1

    def run(self, stop_fd: int) -> None:
        """Forwards frames until `stop_fd` reads EOF (or SIGTERM)."""
        poll = select.epoll()
        for s in self.socks:
            poll.register(s.fileno(), select.EPOLLIN)
        poll.register(stop_fd, select.EPOLLIN | select.EPOLLHUP)
        while True:
            now = time.monotonic()
            self._release(now)
            timeout = -1.0 if not self.heap else max(self.heap[0][0] - _EARLY_S - now, 0.0)
            for fd, _ in poll.poll(timeout):
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
    wire = Wire(spec["links"], seed=spec.get("seed", 0))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        wire.run(sys.stdin.fileno())
    finally:
        if spec.get("stats"):
            stats = {**wire.stats, "cpu_s": time.process_time(), "ports": wire.stats_per_port}
            with open(spec["stats"] + ".tmp", "w", encoding="utf-8") as f:
                json.dump(stats, f)
            os.replace(spec["stats"] + ".tmp", spec["stats"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
