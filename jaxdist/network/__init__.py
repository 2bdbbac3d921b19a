"""The emulated cluster: hosts in network namespaces joined by shaped links (`scripts/launch.py --network`).

- `profiles`: `LinkSpec`, the shape of one host's link (rate, delay, jitter, loss, MTU), the named
  profiles and the inline `rate=...,delay=...` form.
- `namespaces`: `Cluster`, which builds the namespaces, bridge, veths and `tc` qdiscs, runs a
  command inside a host, and tears everything down (also after the launcher is SIGKILLed).
- `counters`: each host's link byte counters as the kernel sees them, for `kind: "net"` records, and each link's busy time for `kind: "straggler"` ones.

Nothing here is imported by the default job; it needs only iproute2 and root (CAP_NET_ADMIN).
"""
