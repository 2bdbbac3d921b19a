"""Link profiles of the emulated cluster: one `LinkSpec` per named profile, or one parsed inline.

A `LinkSpec` is the shape of one host's link to the cluster's switch, applied in both directions
(`scripts/launch.py --network=PROFILE`, `--link=HOST:field=value,...` per host):

- `rate`: bits/s each way (a full-duplex NIC): `tc tbf` on the host's side for what it sends and on
  the switch's side for what it receives;
- `delay`, `jitter`: seconds of one-way latency added between the host and the switch, split half
  on each direction of the link (`tc netem delay`), so host-to-host one-way latency is
  `delay_A/2 + delay_B/2`: `delay` when both hosts have the same profile;
- `loss`: fraction of the packets the host sends that are dropped (`tc netem loss`, on its sending
  side only, so a host-to-host path loses `loss` of its packets);
- `mtu`: bytes per frame on the link (1500 for Ethernet, 9000 for datacenter jumbo frames).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from jaxdist.errors import ConfigError

_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
INLINE_HELP = "rate=50mbit,delay=1ms[,jitter=0.2ms][,loss=0.1%][,mtu=1500]"


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """One host's link: what `tc` shapes on both of its directions.

    Attributes:
      name: the profile's name ("inline" for one given as fields).
      rate_bps: bits per second in each direction.
      delay_s: one-way host-to-host latency added by two hosts of this profile, seconds (half of
        it on each direction of each host's link).
      jitter_s: standard deviation of that delay, seconds (likewise split).
      loss: fraction of the packets this host sends that are dropped, 0 <= loss < 1.
      mtu: bytes per frame.
      about: one line on what the profile stands for.
    """

    name: str
    rate_bps: float
    delay_s: float = 0.0
    jitter_s: float = 0.0
    loss: float = 0.0
    mtu: int = 1500
    about: str = ""

    def __post_init__(self):
        if not self.rate_bps > 0:
            raise ConfigError(f"link {self.name!r}: rate={self.rate_bps:g} bit/s must be > 0")
        if self.delay_s < 0 or self.jitter_s < 0:
            raise ConfigError(f"link {self.name!r}: delay and jitter must be >= 0")
        if self.jitter_s > 0 and self.delay_s == 0:
            raise ConfigError(f"link {self.name!r}: jitter needs a delay > 0 to vary around")
        if not 0 <= self.loss < 1:
            raise ConfigError(f"link {self.name!r}: loss={self.loss:g} must be in [0, 1)")
        if not 576 <= self.mtu <= 65535:
            raise ConfigError(f"link {self.name!r}: mtu={self.mtu} must be in 576..65535")

    @property
    def bytes_per_s(self) -> float:
        """The rate in bytes per second, each way."""
        return self.rate_bps / 8

    @property
    def needs_netem(self) -> bool:
        """Whether shaping it needs the netem qdisc (delay, jitter or loss), not just tbf."""
        return bool(self.delay_s or self.jitter_s or self.loss)

    def with_fields(self, text: str) -> LinkSpec:
        """A copy with the fields of an inline spec ("rate=100mbit,loss=1%") replaced."""
        return dataclasses.replace(self, name=self.name, **_fields(text, self.name))

    def describe(self) -> str:
        """One line: "50 Mbit/s, delay 1 ms, jitter 0.2 ms, loss 0.1%, mtu 1500"."""
        parts = [format_rate(self.rate_bps)]
        if self.delay_s:
            parts.append(f"delay {format_time(self.delay_s)}")
        if self.jitter_s:
            parts.append(f"jitter {format_time(self.jitter_s)}")
        if self.loss:
            parts.append(f"loss {self.loss * 100:g}%")
        parts.append(f"mtu {self.mtu}")
        return ", ".join(parts)

    def to_json(self) -> dict[str, object]:
        """The fields as a JSON object (rates in bit/s, times in s)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "about"}


def format_rate(bps: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit/s"


def format_time(s: float) -> str:
    return f"{s * 1e3:g} ms" if s >= 1e-3 else f"{s * 1e6:g} us"


# Named after the planner's hardware tiers (jaxdist/plan.py PROFILES). This machine's 2 cores push
# at most a few Gbit/s through a veth and tbf, so the tiers are scaled to what they can feed: a
# link faster than the cores (compute dominates), one around 1 Gbit/s, slow ones with latency.
PROFILES: dict[str, LinkSpec] = {
    p.name: p
    for p in (
        LinkSpec(
            "datacenter_10g",
            rate_bps=10e9,
            delay_s=50e-6,
            mtu=9000,
            about="10 Gbit/s, jumbo frames, 50 us: faster than 2 cores can feed (compute dominates)",
        ),
        LinkSpec(
            "cloud_ethernet",
            rate_bps=1e9,
            delay_s=100e-6,
            jitter_s=20e-6,
            about="plan.py's cloud_ethernet tier scaled to 2 cores: 1 Gbit/s, 100 us, TCP's MTU",
        ),
        LinkSpec(
            "ethernet_100m",
            rate_bps=100e6,
            delay_s=200e-6,
            about="100 Mbit/s office Ethernet: communication-bound for a 5-20 M parameter GPT",
        ),
        LinkSpec(
            "wan",
            rate_bps=50e6,
            delay_s=20e-3,
            jitter_s=2e-3,
            about="50 Mbit/s across sites, 20 ms one way, 2 ms jitter (slow with latency)",
        ),
        LinkSpec(
            "wan_lossy",
            rate_bps=50e6,
            delay_s=20e-3,
            jitter_s=2e-3,
            loss=0.01,
            about="wan with 1% of the packets each host sends lost (TCP retransmits them)",
        ),
    )
}


def _number(text: str, units: Mapping[str, float], what: str, name: str) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if not m or m.group(2) not in units:
        raise ConfigError(
            f"link {name!r}: {what}={text!r} is not a number with a unit "
            f"({', '.join(u for u in units if u)})"
        )
    return float(m.group(1)) * units[m.group(2)]


def _fields(text: str, name: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not value.strip():
            raise ConfigError(f"link {name!r}: {item!r} is not field=value; e.g. {INLINE_HELP}")
        if key == "rate":
            out["rate_bps"] = _number(value, _RATE_UNITS, key, name)
        elif key in ("delay", "jitter"):
            out[f"{key}_s"] = _number(value, _TIME_UNITS, key, name)
        elif key == "loss":
            pct = value.strip().endswith("%")
            loss = _number(value.strip().rstrip("%"), {"": 1.0}, key, name)
            out["loss"] = loss / 100 if pct else loss
        elif key == "mtu":
            out["mtu"] = int(_number(value, {"": 1.0}, key, name))
        else:
            raise ConfigError(
                f"link {name!r}: unknown field {key!r}; fields are rate, delay, jitter, loss, mtu"
            )
    return out


def link(text: str) -> LinkSpec:
    """The `LinkSpec` of a `--network` value: a profile name, or inline fields.

    Args:
      text: "wan", or "rate=50mbit,delay=1ms[,jitter=0.2ms][,loss=0.1%][,mtu=1500]" (rate
        required; units bit/kbit/mbit/gbit, s/ms/us; loss as a fraction or with "%").

    Raises:
      ConfigError: neither a profile nor a valid inline spec.
    """
    text = text.strip()
    if text in PROFILES:
        return PROFILES[text]
    if "=" not in text:
        raise ConfigError(
            f"--network={text!r} is not a profile ({', '.join(PROFILES)}) nor inline fields "
            f"({INLINE_HELP})"
        )
    fields = _fields(text, "inline")
    if "rate_bps" not in fields:
        raise ConfigError(f"--network={text!r}: an inline link needs rate=..., e.g. {INLINE_HELP}")
    return LinkSpec("inline", **fields)  # type: ignore[arg-type]


def group_links(tokens: list[str]) -> list[str]:
    """`--network` values from a comma-split list (absl's list flags split on commas): a token that
    is a profile name or starts with `rate=` begins a link, and the other fields join the one
    before, so "rate=50mbit,rate=50mbit,delay=5ms" is two links.

    Raises:
      ConfigError: a field comes before any link.
    """
    links: list[str] = []
    for token in (t.strip() for t in tokens):
        if token in PROFILES or token.startswith("rate=") or "=" not in token:
            links.append(token)
        elif not links:
            raise ConfigError(f"--links: {token!r} comes before any rate=... or profile name")
        else:
            links[-1] += "," + token
    return links


def host_links(base: LinkSpec, hosts: int, overrides: list[str]) -> list[LinkSpec]:
    """Each host's link: `base`, with `--link=HOST:field=value,...` overrides applied.

    Raises:
      ConfigError: an override names no host in range or has a bad field.
    """
    links = [base] * hosts
    for item in overrides:
        host, sep, fields = item.partition(":")
        if not sep or not host.strip().isdigit():
            raise ConfigError(f"--link={item!r}: expected HOST:field=value,..., e.g. 1:rate=10mbit")
        h = int(host)
        if not 0 <= h < hosts:
            raise ConfigError(f"--link={item!r}: host {h} is not one of 0..{hosts - 1}")
        links[h] = links[h].with_fields(fields)
    return links


def listing() -> str:
    """The named profiles, one per line, for `--network=list`."""
    width = max(len(n) for n in PROFILES)
    lines = [f"{n:<{width}}  {p.describe()}\n{'':<{width}}  {p.about}" for n, p in PROFILES.items()]
    lines.append(f"{'inline':<{width}}  {INLINE_HELP}")
    return "\n".join(lines)
