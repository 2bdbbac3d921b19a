"""Each emulated host's link bytes as the kernel counts them, per step window (`kind: "net"`).

`scripts/launch.py --network` sets `JAXDIST_NET_COUNTERS` to `/proc/<pid>/net/dev` of a process in
the cluster's switch namespace, where host i's link ends in the port `h<i>`: what the port
receives is what host i sent, what it transmits is what host i received. Bytes are whole frames
(Ethernet, IP and TCP headers included), counted after the host's qdisc, so a dropped packet is
not counted and a retransmitted one is counted again.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

ENV_COUNTERS = "JAXDIST_NET_COUNTERS"
ENV_PROCESSES_PER_HOST = "JAXDIST_NET_PROCESSES_PER_HOST"
_PORT = re.compile(r"^h(\d+)$")


def read(path: str) -> dict[int, tuple[int, int, int, int]]:
    """host index -> (bytes it sent, bytes it received, frames it sent, frames it received), from
    a switch's `/proc/<pid>/net/dev`."""
    out = {}
    with open(path, encoding="ascii") as f:
        for line in f.readlines()[2:]:
            name, _, rest = line.partition(":")
            m = _PORT.match(name.strip())
            if m:
                fields = rest.split()
                # the port's rx is what the host sent, its tx what the host received
                rx, rx_pk, tx, tx_pk = fields[0], fields[1], fields[8], fields[9]
                out[int(m.group(1))] = (int(rx), int(tx), int(rx_pk), int(tx_pk))
    return out


class Window:
    """Bytes per host between calls to `take`; None outside an emulated cluster."""

    def __init__(self, path: str):
        self.path = path
        self.last = read(path)
        self.t_last = time.perf_counter()

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Window | None:
        env = os.environ if env is None else env
        path = env.get(ENV_COUNTERS)
        if not path:
            return None
        try:
            return cls(path)
        except OSError:
            return None  # the counters are a help, never a reason to stop training

    def take(self, steps: int) -> dict[str, Any] | None:
        """The `kind: "net"` record of the window since the last call: `hosts` maps `host<i>` to
        its `tx_bytes`, `rx_bytes`, `tx_frames`, `rx_frames` and bytes per step (`steps` steps in the window)."""
        try:
            now = read(self.path)
        except OSError:
            return None
        t = time.perf_counter()
        hosts = {}
        for h in sorted(now):
            tx, rx, tx_pk, rx_pk = (a - b for a, b in zip(now[h], self.last.get(h, (0,) * 4)))
            hosts[f"host{h}"] = {
                "tx_bytes": tx,
                "rx_bytes": rx,
                "tx_frames": tx_pk,
                "rx_frames": rx_pk,
                "tx_bytes_per_step": tx / max(steps, 1),
                "rx_bytes_per_step": rx / max(steps, 1),
            }
        record = {"kind": "net", "steps": steps, "window_s": t - self.t_last, "hosts": hosts}
        self.last, self.t_last = now, t
        return record
