"""Each emulated host's link bytes as the kernel counts them, per step window (`kind: "net"`).

`scripts/launch.py --network` sets `JAXDIST_NET_COUNTERS` to `/proc/<pid>/net/dev` of a process in
the cluster's switch namespace, where host i's link ends in the port `h<i>`: what the port
receives is what host i sent, what it transmits is what host i received. Bytes are whole frames
(Ethernet, IP and TCP headers included), counted after the host's qdisc, so a dropped packet is
not counted and a retransmitted one is counted again.

With each host's link rate (`JAXDIST_NET_RATES`, bits/s per host, set by the launcher), each
window also gives a `kind: "straggler"` record: per host, the seconds its link was busy (the
bytes it sent or received, whichever is more, at its rate) against the rest of the window, and
the host whose link was busiest when it was busy for 1.5x the others' median, else none.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

ENV_COUNTERS = "JAXDIST_NET_COUNTERS"
ENV_PROCESSES_PER_HOST = "JAXDIST_NET_PROCESSES_PER_HOST"
ENV_RATES = "JAXDIST_NET_RATES"
STRAGGLER_FACTOR = 1.5  # busiest link over the others' median that names a straggler
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

    def __init__(self, path: str, rates_bps: list[float] | None = None):
        self.path = path
        self.rates_bps = rates_bps
        self.last = read(path)
        self.t_last = time.perf_counter()

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Window | None:
        env = os.environ if env is None else env
        path = env.get(ENV_COUNTERS)
        if not path:
            return None
        rates = env.get(ENV_RATES)
        try:
            return cls(path, [float(r) for r in rates.split(",")] if rates else None)
        except (OSError, ValueError):
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

    def straggler(self, net: dict[str, Any]) -> dict[str, Any] | None:
        """The `kind: "straggler"` record of a `net` record's window (None without the rates).

        Per host: `link_busy_s`, its link's busy time (max of sent and received bytes, frames
        included, at its rate: how long the collectives waited on that link at the least) and
        `rest_s`, the rest of the window (computing, or waiting on other hosts); `straggler` names
        the host whose link was busy longest when that is over `STRAGGLER_FACTOR` × the median
        of the others' (a host with a slow link), else None."""
        if not self.rates_bps:
            return None
        hosts, busy = {}, {}
        for name, h in net["hosts"].items():
            i = int(name.removeprefix("host"))
            if i >= len(self.rates_bps):
                return None
            b = max(h["tx_bytes"], h["rx_bytes"]) * 8 / self.rates_bps[i]
            busy[name] = b
            hosts[name] = {"link_busy_s": b, "rest_s": max(net["window_s"] - b, 0.0)}
        worst = max(busy, key=busy.get) if busy else None
        others = sorted(v for k, v in busy.items() if k != worst)
        named = None
        if worst is not None and others:
            median = (
                others[len(others) // 2]
                if len(others) % 2
                else ((others[len(others) // 2 - 1] + others[len(others) // 2]) / 2)
            )
            if busy[worst] > STRAGGLER_FACTOR * median:
                named = worst
        return {"kind": "straggler", "steps": net["steps"], "window_s": net["window_s"],
                "hosts": hosts, "straggler": named}  # fmt: skip
