"""Builds and tears down the emulated cluster: one network namespace per host, a switch, shaped links.

Layout of a cluster tagged `jdn<PID>` (PID = the launcher's process id):

    namespace jdn<PID>-sw          bridge br0 with ports h0 .. h<H-1>   (the switch)
    namespace jdn<PID>-h<i>        eth0 = 198.18.0.<i+1>/24, lo          (host i, hostname host<i>)
    /etc/netns/jdn<PID>-h<i>/hosts every host's name and address (`ip netns exec` mounts it)

Each host's link is a veth pair created directly inside the two namespaces (nothing is ever added
to the machine's own namespace), shaped on both ends by `tc`: on eth0 for what the host sends, on
h<i> for what it receives. A delay, jitter or loss is a netem qdisc where the kernel has one; where
it has none, the ports leave the bridge and the user-space wire (`jaxdist.network.wire`, its files
in /etc/netns/jdn<PID>-wire) forwards every frame between them. 198.18.0.0/15 is the range RFC 2544 sets aside for benchmarking
networks; each cluster's namespaces are their own world, so two clusters may both use it.

Teardown (`Cluster.down`) deletes the namespaces (their veths and bridge go with them) and the
/etc/netns folders. It is guaranteed by three layers: `down()` in the launcher's `finally`; a
reaper process, started in its own session inside the switch namespace, that tears the cluster
down when the launcher's end of a pipe closes, which also happens when the launcher is SIGKILLed;
and `remove_stale()` at every start, which removes clusters whose launcher is no longer alive.
The reaper's `/proc/<pid>/net/dev` also lists every host's switch port, which is how the training
process reads all hosts' byte counters (`jaxdist.network.counters`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time

from jaxdist.errors import ConfigError
from jaxdist.network import wire
from jaxdist.network.profiles import LinkSpec

PREFIX = "jdn"
SUBNET = "198.18.0"  # RFC 2544's benchmarking range
NETNS_RUN = "/run/netns"
NETNS_ETC = "/etc/netns"
ENV_NO_PRIVILEGE = "JAXDIST_NETEM_DENY"  # tests: behave as if CAP_NET_ADMIN were missing
ENV_NETEM = "JAXDIST_NETEM"  # "user": the user-space wire even where the kernel has netem
CAP_NET_ADMIN = 12
_TAG = re.compile(rf"^({PREFIX}(\d+))-")
_PORT_LINE = re.compile(r"^\d+:\s+h(\d+)@\S*:\s+<([^>]*)>")  # `ip -o link show` in the switch

# The reaper: waits for EOF on stdin (the launcher gone, however it ended), then deletes every
# namespace and /etc/netns folder of its tag. Self-contained: it runs in a bare interpreter.
_REAPER = r"""
import os, subprocess, sys, shutil
tag = sys.argv[1]
sys.stdin.buffer.read()
for name in sorted(os.listdir("/run/netns") if os.path.isdir("/run/netns") else []):
    if name.startswith(tag + "-"):
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
for name in sorted(os.listdir("/etc/netns") if os.path.isdir("/etc/netns") else []):
    if name.startswith(tag + "-"):
        shutil.rmtree(os.path.join("/etc/netns", name), ignore_errors=True)
"""

# Run inside a host's namespace and fresh UTS namespace (`unshare --uts`): set the hostname, which
# gloo resolves to find the address it listens on, then become the command.
_SET_HOSTNAME = (
    "import os, socket, sys; socket.sethostname(sys.argv[1]); os.execvp(sys.argv[2], sys.argv[2:])"
)


class NoPrivilege(ConfigError):
    """Namespaces cannot be made here (no CAP_NET_ADMIN, or no iproute2)."""


class NoNetem(ConfigError):
    """The links ask for delay, jitter or loss, the kernel has no netem qdisc, and a link is
    faster than the user-space wire can forward."""


def _has_cap_net_admin() -> bool:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_NET_ADMIN & 1)
    except OSError:
        pass
    return False


def check_privilege(env: dict[str, str] | None = None) -> None:
    """Raises `NoPrivilege` with one line saying what is needed, if namespaces cannot be made.

    Checks the `ip` and `unshare` commands, the CAP_NET_ADMIN bit of this process and, for what
    the bit cannot tell (a user namespace grants it without the right to mount /run/netns), a
    probe: a namespace added and deleted.
    """
    env = os.environ if env is None else env
    need = "--network needs root (CAP_NET_ADMIN) and iproute2 to create network namespaces"
    missing = [c for c in ("ip", "tc", "unshare") if shutil.which(c) is None]
    if missing:
        raise NoPrivilege(f"{need}: {', '.join(missing)} not found (apt-get install iproute2)")
    if env.get(ENV_NO_PRIVILEGE) == "1" or not _has_cap_net_admin():
        raise NoPrivilege(f"{need}: this process lacks CAP_NET_ADMIN (run it as root, e.g. sudo)")
    with _probe_namespace() as (made, _):
        if made.returncode != 0:
            why = (made.stderr.strip().splitlines() or ["failed"])[-1]
            raise NoPrivilege(f"{need}: 'ip netns add' failed here: {why}")


@contextlib.contextmanager
def _probe_namespace():
    """A throw-away namespace `jdn<pid>-probe`: yields (`ip netns add`'s result, its name), and
    deletes it after."""
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    try:
        yield made, probe
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def kernel_has_netem(env: dict[str, str] | None = None) -> bool:
    """Whether this kernel has the netem qdisc (CONFIG_NET_SCH_NETEM): a probe namespace's
    loopback is given one. `JAXDIST_NETEM=user` answers False, to use the user-space wire."""
    env = os.environ if env is None else env
    if env.get(ENV_NETEM) == "user":
        return False
    with _probe_namespace() as (made, probe):
        if made.returncode != 0:
            return False
        tc = ["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem"]
        return subprocess.run([*tc, "delay", "1ms"], capture_output=True).returncode == 0


def _check_wire_rates(hosts: list[Host]) -> None:
    """Refuses, in one line, a link the user-space wire cannot forward at its rate."""
    fast = [h for h in hosts if h.link.rate_bps > wire.MAX_RATE_BPS]
    if fast:
        h = fast[0]
        raise NoNetem(
            f"host{h.index}'s link asks for a delay, jitter or loss at {h.link.rate_bps / 1e6:g} "
            f"Mbit/s; this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM) and the user-space "
            f"wire that stands in for it forwards at most {wire.MAX_RATE_BPS / 1e6:g} Mbit/s: "
            f"use rate=... alone at that speed, or a slower link (e.g. --network=wan)"
        )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ours(root: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(root) if _TAG.match(n))
    except OSError:
        return []


def stale() -> list[str]:
    """Namespaces and /etc/netns folders (as `leftovers` names them) of clusters whose launcher is
    gone: a leak once the launcher's `down()` and its reaper have had their turn. A running
    launcher's cluster (another job's, beside this one) is never stale."""
    return [n for n in leftovers() if not _alive(int(_TAG.match(os.path.basename(n)).group(2)))]


def remove_stale() -> list[str]:
    """Deletes the namespaces and /etc/netns folders of clusters whose launcher is gone.

    Returns:
      The names removed.
    """
    removed = []
    for path in stale():
        root, name = os.path.split(path)
        if root == NETNS_RUN:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        else:
            shutil.rmtree(path, ignore_errors=True)
        removed.append(name)
    return removed


def leftovers(tag: str | None = None) -> list[str]:
    """Namespaces and /etc/netns folders of emulated clusters (of `tag` only, if given)."""
    names = [f"{root}/{n}" for root in (NETNS_RUN, NETNS_ETC) for n in _ours(root)]
    return [n for n in names if tag is None or os.path.basename(n).startswith(tag + "-")]


@dataclasses.dataclass(frozen=True)
class Host:
    """One emulated host: its namespace, hostname, address and link."""

    index: int
    netns: str
    hostname: str
    address: str
    link: LinkSpec

    @property
    def port(self) -> str:
        """The host's port on the switch (a veth in the switch namespace)."""
        return f"h{self.index}"


def _tc_commands(
    ns: str, dev: str, link: LinkSpec, send_side: bool, netem_qdisc: bool = True
) -> list[list[str]]:
    """`tc` for one direction of a link: netem (delay/jitter, loss on the host's sending side)
    with tbf (rate) as its child, or tbf alone (also where the user-space wire does netem's part,
    `netem_qdisc=False`)."""
    rate = f"{link.rate_bps:.0f}bit"
    # tbf's bucket must hold a frame and ~4 ms at the rate (a 250 Hz timer's tick); its queue
    # ~50 ms at the rate (and at least 4 buckets), so TCP fills the link without tail drops.
    burst = max(2 * (link.mtu + 14), int(link.bytes_per_s * 4e-3), 16_000)
    limit = max(4 * burst, int(link.bytes_per_s * 50e-3))
    tbf = ["tbf", "rate", rate, "burst", str(burst), "limit", str(limit)]
    netem = []
    if link.delay_s:
        netem += ["delay", f"{link.delay_s / 2 * 1e6:.0f}us"]
        if link.jitter_s:
            netem += [f"{link.jitter_s / 2 * 1e6:.0f}us", "distribution", "normal"]
    if link.loss and send_side:
        netem += ["loss", f"{link.loss * 100:g}%"]
    base = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev]
    if not netem or not netem_qdisc:
        return [[*base, "root", "handle", "1:", *tbf]]
    return [
        [*base, "root", "handle", "1:", "netem", "limit", "100000", *netem],
        [*base, "parent", "1:1", "handle", "10:", *tbf],
    ]


class Cluster:
    """H emulated hosts on one switch; build with `up()`, always end with `down()`.

    Args:
      links: one `LinkSpec` per host (host i gets links[i]).
      tag: the name prefix, `jdn<launcher pid>` by default.
    """

    def __init__(self, links: list[LinkSpec], tag: str | None = None):
        if not links:
            raise ConfigError("an emulated cluster needs at least one host")
        if len(links) > 250:
            raise ConfigError(f"{len(links)} hosts: at most 250 fit the emulated /24")
        self.tag = tag or f"{PREFIX}{os.getpid()}"
        if not _TAG.match(self.tag + "-"):
            raise ConfigError(f"cluster tag {self.tag!r} must be {PREFIX}<launcher pid>")
        self.switch = f"{self.tag}-sw"
        self.hosts = [
            Host(i, f"{self.tag}-h{i}", f"host{i}", f"{SUBNET}.{i + 1}", link)
            for i, link in enumerate(links)
        ]
        self.reaper: subprocess.Popen | None = None
        self.wire: subprocess.Popen | None = None
        self.wire_dir: str | None = None
        self.wire_stats: dict | None = None  # the user-space wire's counters, once it has ended

    # -- building -------------------------------------------------------------------------------
    def _run(self, cmd: list[str]) -> None:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")

    def up(self) -> Cluster:
        """Creates the switch, the hosts, their links and hosts files, and starts the reaper.

        Raises:
          NoPrivilege: namespaces cannot be made here.
          RuntimeError: a step failed (what was built is torn down first).
        """
        check_privilege()
        needs_netem = any(h.link.needs_netem for h in self.hosts)
        user_wire = needs_netem and not kernel_has_netem()
        if user_wire:
            _check_wire_rates(self.hosts)
        remove_stale()
        try:
            self._run(["ip", "netns", "add", self.switch])
            self._start_reaper()
            self._no_ipv6(self.switch)
            sw = ["ip", "-n", self.switch]
            self._run([*sw, "link", "add", "br0", "type", "bridge"])
            self._run([*sw, "link", "set", "br0", "up"])
            self._run([*sw, "link", "set", "lo", "up"])
            hosts_file = "127.0.0.1\tlocalhost\n" + "".join(
                f"{h.address}\t{h.hostname}\n" for h in self.hosts
            )
            # With the user-space wire, TCP must hand the link one frame at a time (no GSO
            # super-frames), so that every frame the wire reads fits the port's MTU.
            gso = ["gso_max_segs", "1"] if user_wire else []
            for h in self.hosts:
                self._run(["ip", "netns", "add", h.netns])
                self._no_ipv6(h.netns)
                etc = os.path.join(NETNS_ETC, h.netns)
                os.makedirs(etc, exist_ok=True)
                with open(os.path.join(etc, "hosts"), "w", encoding="ascii") as f:
                    f.write(hosts_file)
                with open(os.path.join(etc, "hostname"), "w", encoding="ascii") as f:
                    f.write(h.hostname + "\n")
                mtu = str(h.link.mtu)
                self._run(
                    [*sw, "link", "add", h.port, "mtu", mtu, *gso, "type", "veth",
                     "peer", "name", "eth0", "mtu", mtu, *gso, "netns", h.netns]
                )  # fmt: skip
                if user_wire:
                    self._run([*sw, "link", "set", h.port, "up"])
                else:
                    self._run([*sw, "link", "set", h.port, "master", "br0", "up"])
                hn = ["ip", "-n", h.netns]
                self._run([*hn, "addr", "add", f"{h.address}/24", "dev", "eth0"])
                self._run([*hn, "link", "set", "eth0", "up"])
                self._run([*hn, "link", "set", "lo", "up"])
                if user_wire:
                    self._run(
                        ["ip", "netns", "exec", h.netns, sys.executable, wire.__file__,
                         "--no_checksum_offload", "eth0"]
                    )  # fmt: skip
                for ns, dev, send in ((h.netns, "eth0", True), (self.switch, h.port, False)):
                    for cmd in _tc_commands(ns, dev, h.link, send, netem_qdisc=not user_wire):
                        self._run(cmd)
            if user_wire:
                self._start_wire()
        except BaseException:
            self.down()
            raise
        return self

    def _no_ipv6(self, ns: str) -> None:
        """IPv6 off in a namespace before its links exist: its neighbour discovery and router
        solicitations would add bytes to the links' counters that no collective sent."""
        for scope in ("all", "default"):
            self._run(
                ["ip", "netns", "exec", ns, "sysctl", "-q", "-w",
                 f"net.ipv6.conf.{scope}.disable_ipv6=1"]
            )  # fmt: skip

    def _start_reaper(self) -> None:
        self.reaper = subprocess.Popen(
            ["ip", "netns", "exec", self.switch, sys.executable, "-c", _REAPER, self.tag],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C to the launcher's group must not stop it
        )

    def _start_wire(self) -> None:
        """Starts `jaxdist.network.wire` in the switch namespace on every host's port."""
        # Under /etc/netns with the cluster's tag: the reaper, remove_stale and leftovers see it
        # as they see the hosts' folders (no namespace has its name, so no host mounts it).
        self.wire_dir = os.path.join(NETNS_ETC, f"{self.tag}-wire")
        os.makedirs(self.wire_dir, exist_ok=True)
        spec = os.path.join(self.wire_dir, "spec.json")
        links = [
            {"delay_s": h.link.delay_s, "jitter_s": h.link.jitter_s, "loss": h.link.loss}
            for h in self.hosts
        ]
        with open(spec, "w", encoding="utf-8") as f:
            json.dump({"links": links, "seed": 0, "stats": self._wire_stats_path}, f)
        with open(os.path.join(self.wire_dir, "wire.log"), "wb") as log:
            self.wire = subprocess.Popen(
                ["ip", "netns", "exec", self.switch, sys.executable, wire.__file__, spec],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=log,
                start_new_session=True,  # as the reaper: it ends when the launcher's pipe closes
            )

    @property
    def _wire_stats_path(self) -> str:
        return os.path.join(self.wire_dir or "", "stats.json")

    @property
    def user_wire(self) -> bool:
        """Whether the user-space wire (not netem) delays and drops this cluster's frames."""
        return self.wire is not None or self.wire_stats is not None

    def _stop_wire(self) -> None:
        if self.wire is None:
            return
        try:
            self.wire.stdin.close()
            self.wire.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.wire.kill()
            self.wire.wait()
        self.wire = None
        try:
            with open(self._wire_stats_path, encoding="utf-8") as f:
                self.wire_stats = json.load(f)
        except (OSError, ValueError):
            with open(os.path.join(self.wire_dir, "wire.log"), encoding="utf-8") as f:
                self.wire_stats = {"error": f.read()[-2000:]}
        shutil.rmtree(self.wire_dir, ignore_errors=True)

    # -- using ----------------------------------------------------------------------------------
    def wrap(self, host: int, command: list[str]) -> list[str]:
        """`command` run inside host `host`: its namespace (and /etc/netns hosts file), its own
        UTS namespace with hostname `host<i>`. Every step execs the next, so the process started
        is the command's (signals and PR_SET_PDEATHSIG reach it)."""
        h = self.hosts[host]
        return [
            "ip", "netns", "exec", h.netns, "unshare", "--uts", "--",
            sys.executable, "-c", _SET_HOSTNAME, h.hostname, *command,
        ]  # fmt: skip

    def set_link(self, host: int, up: bool) -> None:
        """Takes host `host`'s link down (or up again): `ip link set eth0 down` in its namespace,
        as a pulled cable or a failed NIC would; its switch port then loses its carrier."""
        self._run(
            ["ip", "-n", self.hosts[host].netns, "link", "set", "eth0", "up" if up else "down"]
        )

    def hosts_without_carrier(self) -> list[int]:
        """Hosts whose switch port has no carrier (their link is down), as the switch sees them."""
        out = subprocess.run(
            ["ip", "-n", self.switch, "-o", "link", "show"], capture_output=True, text=True
        ).stdout
        down = []
        for line in out.splitlines():
            m = _PORT_LINE.match(line)
            if m and ("NO-CARRIER" in m.group(2).split(",") or "LOWER_UP" not in m.group(2)):
                down.append(int(m.group(1)))
        return sorted(down)

    @property
    def counters_path(self) -> str:
        """`/proc/<pid>/net/dev` of a process in the switch namespace: every host port's bytes."""
        if self.reaper is None:
            raise RuntimeError("the cluster is not up")
        return f"/proc/{self.reaper.pid}/net/dev"

    def describe(self) -> str:
        links = {h.link.describe() for h in self.hosts}
        per = (
            links.pop()
            if len(links) == 1
            else "; ".join(f"host{h.index}: {h.link.describe()}" for h in self.hosts)
        )
        wire_note = (
            "; delay, jitter and loss by the user-space wire (this kernel has no netem)"
            if self.user_wire
            else ""
        )
        return f"{len(self.hosts)} emulated host(s) {SUBNET}.1-{len(self.hosts)}, links {per}{wire_note}"

    def wire_summary(self) -> str | None:
        """One line of the user-space wire's counters once the cluster is down, else None."""
        st = self.wire_stats
        if st is None:
            return None
        if "error" in st:
            return f"the user-space wire failed: {st['error'].strip().splitlines()[-1:]}"
        lost = ", ".join(f"host{i} {p['lost']} of {p['in']}" for i, p in enumerate(st["ports"]))
        return (
            f"user-space wire: {st['frames_in']} frames in, {st['frames_out']} out, "
            f"lost {lost}; {st['send_errors']} refused by a full port queue; "
            f"released late by {st['late_p50_us']:.0f} us (median), {st['late_p99_us']:.0f} us "
            f"(99th percentile); {st['cpu_s']:.1f} s of CPU"
        )

    # -- tearing down ---------------------------------------------------------------------------
    def down(self) -> None:
        """Deletes every namespace and /etc/netns folder of this cluster; safe to call twice."""
        self._stop_wire()
        for name in [h.netns for h in self.hosts] + [self.switch]:
            if os.path.exists(os.path.join(NETNS_RUN, name)):
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
            shutil.rmtree(os.path.join(NETNS_ETC, name), ignore_errors=True)
        if self.reaper is not None:
            try:
                self.reaper.stdin.close()  # the reaper finds nothing left and exits
                self.reaper.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.reaper.kill()
            self.reaper = None
        deadline = time.monotonic() + 5
        while leftovers(self.tag) and time.monotonic() < deadline:
            time.sleep(0.05)

    def __enter__(self) -> Cluster:
        return self.up()

    def __exit__(self, *exc_info: object) -> None:
        self.down()
