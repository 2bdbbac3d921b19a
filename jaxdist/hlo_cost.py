"""Bytes on the wire, read from the compiled HLO rather than predicted.

Every collective the compiler actually emitted, with its group size, payload and how many times it
runs per step (ops inside ``while`` loops from ``lax.scan`` / ``fori_loop`` run trip-count times),
costed as a bandwidth-optimal ring algorithm. ``collective_bytes(compiled.as_text())`` is what goes
into the layout record (jaxdist/loop.py) and the planner's cross-check (jaxdist/plan/).

Why text and not jaxlib's structured ``HloModule``: in jax 0.10.2,
``compiled.runtime_executable().hlo_modules()`` gives ``jaxlib._hlo.HloModule`` objects whose
instructions expose only ``name``, ``opcode``, ``operands``, ``users`` and ``to_string()``: no
shapes, no ``replica_groups``, no called computations (``body=``, ``to_apply=``) and no
``backend_config`` trip counts, which are exactly what costing a collective needs. The serialized
proto (``as_serialized_hlo_module_proto``) would need XLA's ``hlo_pb2``, which jaxlib does not
ship. So this module parses the text, and only as much of it as it needs: shapes, attributes and the
call graph.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Sequence

import numpy as np

COLLECTIVE_KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)

# Opcodes that *are* a collective (the sync op, or the start half of an async pair). The matching
# ``*-done`` / ``*-update`` opcodes only wait for the transfer, so they are never counted.
_COLLECTIVE_OPCODES = {kind: kind for kind in COLLECTIVE_KINDS} | {
    f"{kind}-start": kind for kind in COLLECTIVE_KINDS
}

# Bytes per element. Sub-byte types are packed on every backend we target, hence fractions.
_DTYPE_BYTES: dict[str, float] = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25, "s1": 0.125, "u1": 0.125,
    "f4e2m1fn": 0.5, "f6e2m3fn": 0.75, "f6e3m2fn": 0.75,
    "token": 0, "opaque": 0,
}  # fmt: skip

# Attributes whose value names computations this instruction runs. ``*-done`` / ``*-update`` halves
# of async pairs may repeat their start's ``calls=``; following those would count the op twice.
_CALL_ATTRS = (
    "to_apply",
    "calls",
    "body",
    "condition",
    "branch_computations",
    "true_computation",
    "false_computation",
    "called_computations",
)
_CALL_KEYS = tuple(f"{attr}=" for attr in _CALL_ATTRS)  # a cheap first look at the raw attributes


# --------------------------------------------------------------------------------------------------
# Ring costs
# --------------------------------------------------------------------------------------------------


def ring_wire_bytes(kind: str, nbytes: float, group_size: int) -> float:
    """Bytes one device sends for one collective, costed as the bandwidth-optimal ring algorithm.

    Args:
      kind: one of ``COLLECTIVE_KINDS``.
      nbytes: the payload S in bytes: the per-device buffer for all-reduce, all-to-all and
        collective-permute; the gathered output for all-gather; the unscattered input for
        reduce-scatter.
      group_size: N, the number of devices in one replica group.

    Returns:
      all-reduce 2(N-1)/N*S, all-gather / reduce-scatter / all-to-all (N-1)/N*S,
      collective-permute S; 0 for a group of one device.
    """
    if group_size <= 1:
        return 0.0
    n = group_size
    if kind == "all-reduce":
        return 2.0 * (n - 1) / n * nbytes
    if kind in ("all-gather", "reduce-scatter", "all-to-all"):
        return (n - 1) / n * nbytes
    if kind == "collective-permute":
        return float(nbytes)
    raise ValueError(f"unknown collective kind {kind!r}; valid: {', '.join(COLLECTIVE_KINDS)}")


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction of a compiled module and what it costs one device per step.

    Attributes:
      kind: one of ``COLLECTIVE_KINDS`` (async ``*-start`` forms are reported under the plain kind).
      group_size: N, devices per replica group (for collective-permute: devices named in its pairs).
      bytes_per_exec: S in bytes, the payload the ring cost is computed from (``ring_wire_bytes``).
      count: how many times the op runs per execution of the module (product of the trip counts
        of the loops around it).
      wire_bytes: bytes one device sends for this op per execution of the module, all ``count``
        runs together.
      name: the instruction's name in the HLO text, for finding it again.
      conditional: inside a ``conditional`` branch (charged as if it ran every execution), e.g.
        local SGD's every-H-steps parameter average.
      buffers: arrays in the op's result (a variadic all-reduce, which XLA's combiner makes of
        the per-tensor all-reduces, has one per tensor). XLA:CPU runs each as its own gloo
        collective, one after another (its `AllReduceThunk` loops over them), so each pays the
        algorithm's messages: `cross_host_traffic` counts them.
    """

    kind: str
    group_size: int
    bytes_per_exec: float
    count: int
    wire_bytes: float
    name: str = ""
    conditional: bool = False
    # Which devices talk: (source, target) partition ids of a collective-permute, else the replica
    # groups as partition ids; None where every device is in one group or the form is unread.
    pairs: tuple[tuple[int, int], ...] | None = None
    groups: tuple[tuple[int, ...], ...] | None = None
    buffers: int = 1


def collective_ops(hlo_text: str, branch: str = "costliest") -> list[CollectiveOp]:
    """Every collective reachable from the ENTRY computation, with group size, payload and count.

    Ops in a ``while`` body count trip-count times (nested loops multiply); ops in a ``conditional``
    count for the one branch that sends the most bytes (``branch="cheapest"``: the fewest), since
    exactly one branch runs. Ops inside
    fusions, calls and async wrappers (``async-start`` with ``calls=``) are found through the call
    graph.

    Args:
      hlo_text: a compiled module, ``jax.jit(f).lower(...).compile().as_text()``. Unoptimized text
        (``lower(...).as_text(dialect="hlo")``) parses too, but its header has no
        ``num_partitions``, so ``replica_groups={}`` there reads as one device.

    Returns:
      One entry per collective instruction, in program order. Groups of one device are kept with
      ``wire_bytes == 0``; ops that never run (trip count 0) are dropped.

    Raises:
      ValueError: the text has no ENTRY computation, a shape has an unknown dtype, or a ``while``
        loop containing collectives has a trip count that is neither in its backend_config nor
        readable from an ``i < constant`` loop condition.
    """
    if branch not in BRANCHES:
        raise ValueError(f"branch={branch!r}: one of {', '.join(BRANCHES)}")
    return list(_collective_ops(hlo_text, branch))


# Which branch of a ``conditional`` is charged: the one sending the most bytes (what a step can
# cost), or the fewest (e.g. 1-bit Adam after its warm-up branch stops being taken).
BRANCHES = ("costliest", "cheapest")


@functools.lru_cache(maxsize=4)
def _collective_ops(hlo_text: str, branch: str = "costliest") -> tuple[CollectiveOp, ...]:
    """`collective_ops`, read once per module text: a layout record asks three questions
    (bytes, phases, bytes across hosts) of the same compiled step."""
    return tuple(_Analysis(_parse_module(hlo_text), branch).run())


def conditional_ops(hlo_text: str) -> list[list[CollectiveOp]]:
    """Per ``conditional`` instruction anywhere in the module, the collectives of its costliest
    branch (the one that sends the most bytes), each counted once per run of the branch.

    E.g. local SGD's every-H-steps parameter average is one conditional; the most one sync
    sends is the largest sum of ``wire_bytes`` here (jaxdist/streaming.py `peak_sync_bytes`).
    """
    module = _parse_module(hlo_text)
    analysis = _Analysis(module)
    return [
        [op for _, op in analysis._conditional(inst)]
        for comp in module.computations.values()
        for inst in comp.instructions.values()
        if inst.opcode == "conditional"
    ]


def collective_bytes(hlo_text: str, conditional_period: int = 1) -> dict[str, float]:
    """Bytes one device sends per execution of a compiled module, per collective kind.

    Args:
      hlo_text: a compiled module, ``jax.jit(f).lower(...).compile().as_text()``.
      conditional_period: ops inside a ``conditional`` run once every this many executions (local
        SGD's parameter average every H steps): their bytes are divided by it.

    Returns:
      ``{kind: bytes}`` over ``COLLECTIVE_KINDS``, only kinds that send something; ``{}`` when
      nothing crosses a device boundary. See ``collective_ops`` for the costing rules.
    """
    totals: dict[str, float] = {}
    for op in collective_ops(hlo_text):
        if op.wire_bytes > 0:
            share = op.wire_bytes / (conditional_period if op.conditional else 1)
            totals[op.kind] = totals.get(op.kind, 0.0) + share
    return {kind: totals[kind] for kind in COLLECTIVE_KINDS if kind in totals}


def _traffic(op: CollectiveOp, num_devices: int) -> tuple[np.ndarray, np.ndarray]:
    """(sent, received) bytes per device (partition id) for all `op.count` runs of `op`.

    collective-permute: exactly its pairs (a parameter server's hot spot shows); the others: every
    member of a group of N > 1 sends and receives the op's ring cost (symmetric algorithms)."""
    sent, received = np.zeros(num_devices), np.zeros(num_devices)
    if op.pairs is not None:
        for src, dst in op.pairs:
            if src != dst:
                sent[src] += op.bytes_per_exec * op.count
                received[dst] += op.bytes_per_exec * op.count
        return sent, received
    groups = op.groups or (tuple(range(num_devices)),)
    for g in groups:
        if len(g) > 1:
            sent[list(g)] += op.wire_bytes
            received[list(g)] += op.wire_bytes
    return sent, received


def _axes_and_tier(
    op: CollectiveOp, mesh_shape: dict[str, int] | None, processes: Sequence[int] | None
) -> tuple[str, str]:
    """('data' / 'fsdp+tensor' / ..., 'ici' | 'dcn'): the mesh axes the op's groups span and
    whether any group spans two processes (hosts). '?' where the groups are not readable."""
    sets = op.pairs if op.pairs is not None else op.groups
    if sets is None or mesh_shape is None:
        axes = "?" if mesh_shape is not None else "-"
        return axes, "dcn" if processes is not None and len(set(processes)) > 1 else "ici"
    names, shape = list(mesh_shape), tuple(mesh_shape.values())
    varying, dcn = set(), False
    for ids in sets:
        ids = [i for i in ids if i < math.prod(shape)]
        coords = np.array(np.unravel_index(ids, shape))  # [axes, members]
        varying |= {names[a] for a in range(len(names)) if len(set(coords[a])) > 1}
        dcn |= processes is not None and len({processes[i] for i in ids}) > 1
    ordered = [a for a in names if a in varying]
    return "+".join(ordered) or "-", "dcn" if dcn else "ici"


def collective_phases(
    hlo_text: str,
    mesh_shape: dict[str, int] | None = None,
    processes: Sequence[int] | None = None,
    conditional_period: int = 1,
) -> tuple[list[dict], float]:
    """Per phase (collective kind × mesh axes × tier), what the busiest device moves, per step.

    Args:
      hlo_text: a compiled module.
      mesh_shape: axis -> size of the mesh the module runs on, in mesh order (partition id i is
        mesh.devices.flat[i], as jit assigns them); None: axes unknown ('-').
      processes: the process index of each partition id (hosts); None: one host.
      conditional_period: as in `collective_bytes`.

    Returns:
      (phases, busiest): phases as dicts with `kind`, `axes`, `tier` (ici | dcn), `steps` (op
      executions per step: the sequential latency terms), `bytes` (what one device sends per step,
      the ring costing of `collective_bytes`) and `busiest_bytes` (sent + received by the device
      that moves the most in this phase); busiest is the per-step sent + received of the device
      that moves the most over all phases (the layout record's `busiest_device_bytes_per_step`).
    """
    ops = [op for op in collective_ops(hlo_text) if op.wire_bytes > 0]
    ids = [i for op in ops for g in (op.pairs or op.groups or ()) for i in g]
    n = math.prod(mesh_shape.values()) if mesh_shape else max(ids, default=0) + 1
    n = max(n, max(ids, default=0) + 1)
    phases: dict[tuple, dict] = {}
    total = np.zeros(n)
    for op in ops:
        share = 1.0 / (conditional_period if op.conditional else 1)
        sent, received = _traffic(op, n)
        axes, tier = _axes_and_tier(op, mesh_shape, processes)
        ph = phases.setdefault(
            (op.kind, axes, tier),
            {"kind": op.kind, "axes": axes, "tier": tier, "steps": 0, "bytes": 0.0,
             "per_device": np.zeros(n)},
        )  # fmt: skip
        ph["steps"] += op.count
        ph["bytes"] += op.wire_bytes * share
        ph["per_device"] = ph["per_device"] + (sent + received) * share
        total += (sent + received) * share
    out = []
    for ph in phases.values():
        per_device = ph.pop("per_device")
        out.append({**ph, "busiest_bytes": float(per_device.max())})
    return out, float(total.max()) if n else 0.0


def cross_host_bytes(
    hlo_text: str,
    processes: Sequence[int],
    conditional_period: int = 1,
    branch: str = "costliest",
) -> list[float]:
    """Bytes each process (host) sends to other processes per execution, as gloo moves them.

    What a host's network link carries, to compare with its NIC's counters. XLA:CPU's gloo
    communicator (one gloo rank per device, in the group's order) runs all-reduce as gloo's ring
    (`AllreduceOptions::Algorithm::RING`: reduce-scatter then all-gather, each rank sending
    2(N-1)/N·S to the next rank) and all-gather as gloo's ring, so a member's bytes cross hosts
    when the next member of its group is on another process; reduce-scatter (gloo's
    halving-doubling) is costed the same way, an approximation; all-to-all sends each other member
    its S/N; collective-permute exactly its pairs.

    Args:
      hlo_text: a compiled module.
      processes: the process index of each partition id (mesh.devices.flat order).
      conditional_period: as in `collective_bytes`.
      branch: which branch of a conditional to charge, as in `collective_ops`.

    Returns:
      Bytes per step, indexed by process.
    """
    return cross_host_traffic(hlo_text, processes, conditional_period, branch)[0]


def cross_host_traffic(
    hlo_text: str,
    processes: Sequence[int],
    conditional_period: int = 1,
    branch: str = "costliest",
) -> tuple[list[float], list[float]]:
    """`cross_host_bytes`, and the messages each process sends to other processes per execution.

    A message is one send of gloo's algorithm from one rank to a rank on another process: a ring
    all-reduce's member sends 2(N-1) times to its next member, for each array of a variadic
    all-reduce (XLA:CPU runs them one by one, `CollectiveOp.buffers`), a ring all-gather or
    reduce-scatter N-1 times, an all-to-all once to each other member, a collective-permute once
    per pair. Each
    message costs the link a latency and the wire gloo's and TCP's per-message bytes, which is
    what separates many small collectives from one large one with the same payload.

    Returns:
      (bytes, messages) per step, each indexed by process.
    """
    out = [0.0] * (max(processes) + 1)
    messages = [0.0] * len(out)
    n = len(processes)
    for op in collective_ops(hlo_text, branch):
        if op.wire_bytes <= 0:
            continue
        share = 1.0 / (conditional_period if op.conditional else 1)
        if op.pairs is not None:
            for src, dst in op.pairs:
                if src < n and dst < n and processes[src] != processes[dst]:
                    out[processes[src]] += op.bytes_per_exec * op.count * share
                    messages[processes[src]] += op.count * share
            continue
        for g in op.groups or (tuple(range(n)),):
            g = [i for i in g if i < n]
            sends = 2 * (len(g) - 1) * op.buffers if op.kind == "all-reduce" else len(g) - 1
            for k, member in enumerate(g):
                if op.kind == "all-to-all":
                    others = [m for m in g if m != member]
                    crossing = sum(processes[m] != processes[member] for m in others)
                    out[processes[member]] += op.wire_bytes * share * crossing / max(len(others), 1)
                    messages[processes[member]] += op.count * share * crossing
                elif processes[g[(k + 1) % len(g)]] != processes[member]:
                    out[processes[member]] += op.wire_bytes * share
                    messages[processes[member]] += op.count * share * sends
    return out, messages


# --------------------------------------------------------------------------------------------------
# HLO text parsing: just enough structure for shapes, attributes and the call graph.
# --------------------------------------------------------------------------------------------------

_COMMENT = re.compile(r"/\*.*?\*/")
# An instruction starts with `[ROOT] [%]name = <shape>`, and a shape starts with `(` or `dtype[`.
# Checking the shape keeps continuation lines of hand-wrapped text (`channel_id=5, ...`) out.
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([^\s=]+)\s*=\s*(?=\(|[a-z][a-z0-9]*\[)")
_LEAF_SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_BRACKETS = {"(": ")", "[": "]", "{": "}"}


class _Instruction:
    """One instruction: name, shape and opcode read with the line; its operands and attributes
    when first asked for (most of a compiled module's instructions are inside fusions, whose
    attributes only the question of what they call reads, and `rest` answers that first)."""

    __slots__ = ("name", "shape", "opcode", "args", "rest", "_operands", "_attrs", "_calls")

    def __init__(self, name: str, shape: str, opcode: str, args: str, rest: str):
        self.name, self.shape, self.opcode = name, shape, opcode
        self.args = args  # the raw text inside the operand parentheses, e.g. `5` for `constant(5)`
        self.rest = rest  # the raw text after them: the attributes
        self._operands: list[str] | None = None
        self._attrs: dict[str, str] | None = None
        self._calls: tuple[str, ...] | None = None

    @property
    def operands(self) -> list[str]:
        if self._operands is None:
            self._operands = []
            for part in _split_top_level(self.args):
                token = part.split()[-1] if part.split() else ""
                if token.startswith("%") or self.opcode not in ("constant", "parameter", "iota"):
                    self._operands.append(token.lstrip("%"))
        return self._operands

    @property
    def attrs(self) -> dict[str, str]:
        if self._attrs is None:
            self._attrs = _parse_attrs(self.rest)
        return self._attrs

    @property
    def calls(self) -> tuple[str, ...]:
        """The computations it runs (loop body and condition, branches, fused computation, ...)."""
        if self._calls is None:
            if not any(key in self.rest for key in _CALL_KEYS):  # its attributes stay unread
                self._calls = ()
            else:
                self._calls = tuple(
                    n.lstrip("%")
                    for attr in _CALL_ATTRS
                    if attr in self.attrs
                    for n in re.findall(r"%?[\w.\-]+", self.attrs[attr])
                )
        return self._calls


@dataclasses.dataclass
class _Computation:
    name: str
    instructions: dict[str, _Instruction]
    root: _Instruction | None


@dataclasses.dataclass
class _Module:
    computations: dict[str, _Computation]
    entry: str
    num_partitions: int
    replica_count: int


# The characters the bracket matcher and the comma splitter stop at; everything between them is
# skipped by the regex engine rather than one Python step per character (a compiled step's text is
# megabytes, read on every run's `layout` record).
_CLOSE_STOPS = re.compile(r'[()\[\]{}"]')
_SPLIT_STOPS = re.compile(r'[,()\[\]{}"]')
_STRING_REST = re.compile(r'(?:[^"\\]|\\.)*"', re.S)  # after an opening quote: to its closing one


def _match_close(text: str, start: int) -> int:
    """Index just past the bracket closing ``text[start]``, skipping nested brackets and strings
    (honouring \\" escapes: metadata and configs have them)."""
    stack = []
    pos = start
    while (m := _CLOSE_STOPS.search(text, pos)) is not None:
        ch, i = m.group(), m.start()
        if ch == '"':
            if (rest := _STRING_REST.match(text, i + 1)) is None:
                break
            pos = rest.end()
            continue
        if ch in _BRACKETS:
            stack.append(_BRACKETS[ch])
        elif stack and ch == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
        pos = i + 1
    raise ValueError(f"unbalanced brackets in HLO text: {text[start : start + 80]!r}")


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets or quotes (a trailing empty part dropped)."""
    parts, depth, begin, pos = [], 0, 0, 0
    while (m := _SPLIT_STOPS.search(text, pos)) is not None:
        ch, i = m.group(), m.start()
        if ch == '"':
            if (rest := _STRING_REST.match(text, i + 1)) is None:
                break  # an unterminated string runs to the end: no comma after it splits
            pos = rest.end()
            continue
        if ch == ",":
            if depth == 0:
                parts.append(text[begin:i].strip())
                begin = i + 1
        elif ch in "([{":
            depth += 1
        else:
            depth -= 1
        pos = i + 1
    if last := text[begin:].strip():
        parts.append(last)
    return parts


def _parse_attrs(text: str) -> dict[str, str]:
    attrs: dict[str, str] = {}
    last = None
    for part in _split_top_level(text):
        key, eq, value = part.partition("=")
        key = key.strip()
        # Mesh-form replica groups print a top-level comma of their own:
        # `replica_groups=mesh['a'=4,'b'=2], device_ids=([4,2]T(1,0)) {'b'}`.
        if key == "device_ids" and last == "replica_groups":
            attrs["replica_groups"] += ", " + part
            continue
        if eq:
            attrs[key] = value.strip()
            last = key
    return attrs


def _parse_instruction(text: str) -> _Instruction:
    m = _INSTRUCTION.match(text)
    assert m is not None
    name, pos = m.group(2), m.end()
    if text[pos] == "(":
        end = _match_close(text, pos)
    else:
        leaf = _LEAF_SHAPE.match(text, pos)
        end = leaf.end() if leaf else pos
        if end < len(text) and text[end] == "{":  # layout, e.g. {1,0:T(8,128)}
            end = _match_close(text, end)
    shape = text[pos:end]
    op = _OPCODE.match(text, end)
    if op is None:
        raise ValueError(f"cannot parse HLO instruction: {text[:120]!r}")
    args_end = _match_close(text, op.end() - 1)
    rest = text[args_end:].lstrip().lstrip(",")
    return _Instruction(name, shape, op.group(1), text[op.end() : args_end - 1], rest)


@functools.lru_cache(maxsize=2)
def _parse_module(hlo_text: str) -> _Module:
    """The module's computations, parsed once per text: a `layout` record reads the compiled step
    four times (bytes, phases, bytes across hosts with each branch rule, the pipeline's lock-step
    cost). Shared, so read-only."""
    num_partitions = replica_count = 1  # HLO omits both from the header when they are 1.
    computations: dict[str, _Computation] = {}
    entry = None
    current: tuple[str, list[tuple[bool, str]]] | None = None

    def finish() -> None:
        name, lines = current
        instructions: dict[str, _Instruction] = {}
        root = None
        for is_root, line in lines:
            inst = _parse_instruction(line)
            instructions[inst.name] = inst
            if is_root:
                root = inst
        if root is None and instructions:
            root = list(instructions.values())[-1]
        computations[name] = _Computation(name, instructions, root)

    for raw_line in hlo_text.splitlines():
        line = _COMMENT.sub("", raw_line).strip()
        if not line:
            continue
        if current is None:
            if line.startswith("HloModule"):
                if m := re.search(r"\bnum_partitions=(\d+)", line):
                    num_partitions = int(m.group(1))
                if m := re.search(r"\breplica_count=(\d+)", line):
                    replica_count = int(m.group(1))
            elif line.endswith("{"):
                is_entry = line.startswith("ENTRY")
                name = re.match(r"(?:ENTRY\s+)?%?([^\s(]+)", line).group(1)
                if is_entry:
                    entry = name
                current = (name, [])
            # Anything else outside a computation (FileNames, StackFrames, ...) is debug info.
            continue
        if line.startswith("}"):
            finish()
            current = None
        elif m := _INSTRUCTION.match(line):
            current[1].append((m.group(1) is not None, line))
        elif current[1]:  # a wrapped instruction continues on this line
            is_root, previous = current[1][-1]
            current[1][-1] = (is_root, previous + " " + line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text; pass a module's compiled.as_text()")
    return _Module(computations, entry, num_partitions, replica_count)


# --------------------------------------------------------------------------------------------------
# Shapes and replica groups
# --------------------------------------------------------------------------------------------------

# A leaf (dtype, dims), or a list of Shapes for a tuple shape.
Shape = tuple[str, tuple[int, ...]] | list


def _parse_shape(text: str) -> Shape:
    shape, _ = _parse_shape_at(_COMMENT.sub("", text), 0)
    return shape


def _parse_shape_at(text: str, pos: int) -> tuple[Shape, int]:
    while pos < len(text) and text[pos] == " ":
        pos += 1
    if text[pos] == "(":
        elements: list = []
        pos += 1
        while True:
            while text[pos] in " ,":
                pos += 1
            if text[pos] == ")":
                return elements, pos + 1
            element, pos = _parse_shape_at(text, pos)
            elements.append(element)
    m = _LEAF_SHAPE.match(text, pos)
    if m is None:
        raise ValueError(f"cannot parse HLO shape {text!r}")
    pos = m.end()
    if pos < len(text) and text[pos] == "{":
        pos = _match_close(text, pos)
    # Bounded dynamic dimensions print as `<=N`: the buffer is sized for N.
    dims = tuple(int(d.strip().lstrip("<=")) for d in m.group(2).split(",") if d.strip())
    return (m.group(1), dims), pos


def _shape_bytes(shape: Shape) -> float:
    if isinstance(shape, list):
        return sum(_shape_bytes(element) for element in shape)
    dtype, dims = shape
    if dtype in _DTYPE_BYTES:
        per_element = _DTYPE_BYTES[dtype]
    elif dtype.startswith("f8"):  # f8e4m3fn, f8e5m2, f8e4m3fnuz, f8e8m0fnu, ...
        per_element = 1
    else:
        raise ValueError(f"unknown HLO element type {dtype!r} in a collective's shape")
    return float(per_element * math.prod(dims))


def _payload_bytes(inst: _Instruction) -> float:
    """Bytes of the op's result; for async starts, of the result element of the start's tuple."""
    shape = _parse_shape(inst.shape)
    # all-reduce-start returns its result directly (a tuple only when variadic). The other *-start
    # ops return (operands, result, context...): the result is element 1.
    if inst.opcode.endswith("-start") and inst.opcode != "all-reduce-start":
        if isinstance(shape, list) and len(shape) >= 2:
            shape = shape[1]
    return _shape_bytes(shape)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", text)]


def _first_group_size(replica_groups: str) -> int | None:
    """Devices in one group, or None for `{}` (every device). Reads list, iota and mesh forms."""
    rg = replica_groups.strip()
    if rg.startswith("maximal_mesh"):
        return 1
    if rg.startswith("mesh["):
        # mesh['a'=4,'b'=2][, device_ids=(...)] {'b'}: the group spans the listed axes; a sub-axis
        # prints as 'a':(pre_size)size.
        axes_text = rg[rg.index("[") + 1 : rg.index("]")]
        sizes = {
            name.strip().strip("'\""): int(size)
            for name, size in (item.rsplit("=", 1) for item in _split_top_level(axes_text))
        }
        group_text = rg[rg.rindex("{") + 1 : rg.rindex("}")]
        total = 1
        for axis in _split_top_level(group_text):
            if m := re.fullmatch(r"(.*?):\((\d+)\)(\d+)", axis):
                total *= int(m.group(3))
            else:
                total *= sizes[axis.strip().strip("'\"")]
        return total
    if rg.startswith("["):  # iota form [num_groups,group_size]<=[...]T(...)
        return _int_list(rg[: rg.index("]")])[-1]
    inner = rg[1:-1].strip()
    if not inner:
        return None
    first = inner[: inner.index("}") + 1] if inner.startswith("{") else inner
    return len(_int_list(first))


def _explicit_groups(replica_groups: str) -> tuple[tuple[int, ...], ...] | None:
    """The replica groups as tuples of ids (list, iota and mesh forms); None for `{}`."""
    rg = replica_groups.strip()
    try:
        if rg.startswith("mesh["):
            axes_text = rg[rg.index("[") + 1 : rg.index("]")]
            names, sizes = [], []
            for item in _split_top_level(axes_text):
                name, size = item.rsplit("=", 1)
                names.append(name.strip().strip("'\""))
                sizes.append(int(size))
            group_text = rg[rg.rindex("{") + 1 : rg.rindex("}")]
            in_group = [a.strip().strip("'\"") for a in _split_top_level(group_text)]
            if any(a not in names for a in in_group):
                return None  # a sub-axis form ('a':(2)4): not needed by jaxdist's programs
            ids = np.arange(math.prod(sizes))
            if "device_ids=" in rg:
                ids = _iota(rg[rg.index("device_ids=") : rg.rindex("{")])
            ids = ids.reshape(sizes)
            moved = [names.index(a) for a in in_group]
            rest = [i for i in range(len(names)) if i not in moved]
            size = math.prod(sizes[i] for i in moved)
            return tuple(map(tuple, ids.transpose(rest + moved).reshape(-1, size).tolist()))
        if rg.startswith("["):  # iota form [num_groups,group_size]<=[dims]T(perm)
            shape = _int_list(rg[: rg.index("]")])
            return tuple(map(tuple, _iota(rg[rg.index("<=") :]).reshape(shape).tolist()))
        inner = rg[1:-1].strip()
        if not inner:
            return None
        return tuple(tuple(_int_list(g)) for g in re.findall(r"\{([^{}]*)\}", inner))
    except (ValueError, IndexError):
        return None


def _iota(text: str) -> np.ndarray:
    """`<=[dims]T(perm)` / `device_ids=([dims]T(perm))`: arange(prod dims) reshaped, transposed."""
    dims = _int_list(text[text.index("[") : text.index("]")])
    ids = np.arange(math.prod(dims)).reshape(dims)
    if "T(" in text:
        ids = ids.transpose(_int_list(text[text.index("T(") : text.index(")", text.index("T("))]))
    return ids.reshape(-1)


def _group_size(inst: _Instruction, kind: str, module: _Module) -> int:
    """N for one op, following XLA's collective group modes (channel_id / use_global_device_ids)."""
    attrs = inst.attrs
    if kind == "collective-permute":
        pairs = _int_list(attrs.get("source_target_pairs", ""))
        sources, targets = pairs[0::2], pairs[1::2]
        if all(s == t for s, t in zip(sources, targets, strict=True)):
            return 1  # nothing leaves the device
        return len(set(pairs))
    explicit = _first_group_size(attrs.get("replica_groups", "{}"))
    has_channel = "channel_id" in attrs
    if not has_channel:  # cross-replica: ids are replicas
        universe, per_id = module.replica_count, 1
    elif attrs.get("use_global_device_ids") == "true":  # flattened ids over replicas x partitions
        universe, per_id = module.replica_count * module.num_partitions, 1
    elif kind == "all-to-all":  # cross-partition: all-to-all has no use_global_device_ids flag
        universe, per_id = module.num_partitions, 1
    else:  # cross-replica-and-partition: ids are replicas, each bringing all its partitions
        universe, per_id = module.replica_count, module.num_partitions
    return (explicit if explicit is not None else universe) * per_id


# --------------------------------------------------------------------------------------------------
# The call graph walk
# --------------------------------------------------------------------------------------------------


class _Analysis:
    def __init__(self, module: _Module, branch: str = "costliest"):
        self.module = module
        self.pick = max if branch == "costliest" else min
        self._memo: dict[str, list[tuple[str, CollectiveOp]]] = {}

    def run(self) -> list[CollectiveOp]:
        merged: dict[str, CollectiveOp] = {}
        for key, op in self._collect(self.module.entry):
            if op.count == 0:
                continue
            if key in merged:  # one computation called from several sites
                prev = merged[key]
                op = dataclasses.replace(
                    prev, count=prev.count + op.count, wire_bytes=prev.wire_bytes + op.wire_bytes
                )
            merged[key] = op
        return list(merged.values())

    def _computation(self, name: str) -> _Computation:
        try:
            return self.module.computations[name]
        except KeyError:
            raise ValueError(f"HLO text calls computation {name!r} but never defines it") from None

    def _collect(self, comp_name: str) -> list[tuple[str, CollectiveOp]]:
        """(key, op with count per one run of ``comp_name``), keyed by computation/instruction."""
        if comp_name in self._memo:
            return self._memo[comp_name]
        comp = self._computation(comp_name)
        found: list[tuple[str, CollectiveOp]] = []
        for inst in comp.instructions.values():
            kind = _COLLECTIVE_OPCODES.get(inst.opcode)
            if kind is not None:
                found.append((f"{comp_name}/{inst.name}", self._op(inst, kind)))
                continue  # a sugared async op's own `calls=` would be the same transfer again
            if inst.opcode.endswith("-done") or inst.opcode.endswith("-update"):
                continue
            if inst.opcode == "while":
                found.extend(self._while(inst, comp))
            elif inst.opcode == "conditional":
                found.extend(self._conditional(inst))
            else:
                for callee in inst.calls:
                    found.extend(self._collect(callee))
        self._memo[comp_name] = found
        return found

    def _op(self, inst: _Instruction, kind: str) -> CollectiveOp:
        n = _group_size(inst, kind, self.module)
        payload = _payload_bytes(inst)
        if kind == "reduce-scatter":
            payload *= n  # the ring is costed on the unscattered input, S_in = N * S_out
        pairs = groups = None
        if kind == "collective-permute":
            ids = _int_list(inst.attrs.get("source_target_pairs", ""))
            pairs = tuple(zip(ids[0::2], ids[1::2], strict=True))
        else:
            groups = _explicit_groups(inst.attrs.get("replica_groups", "{}"))
        wire = ring_wire_bytes(kind, payload, n)
        shape = _parse_shape(inst.shape)
        buffers = len(shape) if kind == "all-reduce" and isinstance(shape, list) else 1
        return CollectiveOp(
            kind, n, payload, 1, wire, inst.name, pairs=pairs, groups=groups, buffers=buffers
        )

    def _while(self, inst: _Instruction, comp: _Computation) -> list[tuple[str, CollectiveOp]]:
        body = self._collect(inst.attrs["body"].lstrip("%"))
        cond = self._collect(inst.attrs["condition"].lstrip("%"))
        if not body and not cond:
            return []  # loops without collectives need no trip count, even data-dependent ones
        trips = self._trip_count(inst, comp)
        return _scaled(body, trips) + _scaled(cond, trips + 1)

    def _conditional(self, inst: _Instruction) -> list[tuple[str, CollectiveOp]]:
        # One branch runs per execution; which one is data-dependent, so charge the most expensive
        # (or, asked for, the cheapest).
        branches = [self._collect(callee) for callee in inst.calls]
        ops = self.pick(branches, key=lambda ops: sum(op.wire_bytes for _, op in ops), default=[])
        return [(key, dataclasses.replace(op, conditional=True)) for key, op in ops]

    # -- trip counts ------------------------------------------------------------------------------

    def _trip_count(self, inst: _Instruction, comp: _Computation) -> int:
        config = inst.attrs.get("backend_config", "")
        if m := re.search(r'known_trip_count"?\s*:\s*\{\s*"?n"?\s*:\s*"?(\d+)', config):
            return int(m.group(1))
        trips = self._infer_trip_count(inst, comp)
        if trips is None:
            raise ValueError(
                f"while loop {inst.name!r} in computation {comp.name!r} contains collectives "
                "but its trip count is unknown (no known_trip_count in backend_config and the "
                "condition is not `counter <op> constant` with a constant start and step); a "
                "data-dependent lax.while_loop cannot be costed statically"
            )
        return trips

    def _infer_trip_count(self, inst: _Instruction, parent: _Computation) -> int | None:
        """Trip count from the loop itself: `i < K` in the condition, start and step in the code."""
        cond = self._computation(inst.attrs["condition"].lstrip("%"))
        body = self._computation(inst.attrs["body"].lstrip("%"))
        compare = self._resolve(cond, cond.root.name, None)
        if compare is None or compare[1].opcode != "compare" or len(compare[1].operands) != 2:
            return None
        c_comp, c_inst, c_ctx = compare
        direction = c_inst.attrs.get("direction", "")
        lhs, rhs = (self._resolve(c_comp, name, c_ctx) for name in c_inst.operands)
        bound, index = _constant(rhs), _loop_index(lhs, cond)
        if bound is None or index is None:  # `K > i` rather than `i < K`
            bound, index = _constant(lhs), _loop_index(rhs, cond)
            direction = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}.get(direction, direction)
        if bound is None or index is None:
            return None

        config = inst.attrs.get("backend_config", "")
        if m := re.search(r'known_init_step"?\s*:\s*\{\s*"?init"?\s*:\s*"?(-?\d+)"?\s*,'
                          r'\s*"?step"?\s*:\s*"?(-?\d+)', config):  # fmt: skip
            start, step = int(m.group(1)), int(m.group(2))
        else:
            start, step = self._loop_start(inst, parent, index), self._loop_step(body, index)
        if start is None or not step:
            return None
        return _count_iterations(direction, start, bound, step)

    def _loop_start(self, inst: _Instruction, parent: _Computation, index: int) -> int | None:
        init = self._resolve(parent, inst.operands[0], None)
        if init is None or init[1].opcode != "tuple" or index >= len(init[1].operands):
            return None
        return _constant(self._resolve(init[0], init[1].operands[index], init[2]))

    def _loop_step(self, body: _Computation, index: int) -> int | None:
        root = self._resolve(body, body.root.name, None)
        if root is None or root[1].opcode != "tuple" or index >= len(root[1].operands):
            return None
        update = self._resolve(root[0], root[1].operands[index], root[2])
        if update is None or update[1].opcode not in ("add", "subtract"):
            return None
        a, b = (self._resolve(update[0], name, update[2]) for name in update[1].operands)
        sign = -1 if update[1].opcode == "subtract" else 1
        if _loop_index(a, body) == index and (step := _constant(b)) is not None:
            return sign * step
        if sign == 1 and _loop_index(b, body) == index and (step := _constant(a)) is not None:
            return step
        return None

    def _resolve(self, comp: _Computation, name: str, ctx: list | None) -> tuple | None:
        """Follow value-preserving ops and fusion boundaries to the instruction that makes a value.

        Returns (computation, instruction, ctx) where ctx maps a fused computation's parameter
        numbers to (computation, operand name, ctx) in its caller; None for an unknown name.
        """
        for _ in range(64):  # chains are short; the bound only guards against malformed text
            inst = comp.instructions.get(name)
            if inst is None:
                return None
            if inst.opcode in ("copy", "convert", "bitcast", "reshape") and inst.operands:
                name = inst.operands[0]
            elif inst.opcode == "parameter" and ctx is not None:
                comp, name, ctx = ctx[int(inst.args.strip())]
            elif inst.opcode == "fusion" and "calls" in inst.attrs:
                fused = self._computation(inst.attrs["calls"].lstrip("%"))
                ctx = [(comp, operand, ctx) for operand in inst.operands]
                comp, name = fused, fused.root.name
            else:
                return comp, inst, ctx
        return None


def _scaled(ops: list[tuple[str, CollectiveOp]], factor: int) -> list[tuple[str, CollectiveOp]]:
    return [
        (key, dataclasses.replace(op, count=op.count * factor, wire_bytes=op.wire_bytes * factor))
        for key, op in ops
    ]


def _constant(resolved: tuple | None) -> int | None:
    if resolved is None or resolved[1].opcode != "constant":
        return None
    try:
        return int(resolved[1].args.strip())
    except ValueError:
        return None


def _loop_index(resolved: tuple | None, loop_comp: _Computation) -> int | None:
    """The tuple index if the value is `get-tuple-element(loop parameter), index=i`."""
    if resolved is None:
        return None
    comp, inst, ctx = resolved
    if comp is not loop_comp or inst.opcode != "get-tuple-element" or not inst.operands:
        return None
    source = comp.instructions.get(inst.operands[0])
    if source is None or source.opcode != "parameter":
        return None
    return int(inst.attrs.get("index", "-1"))


def _count_iterations(direction: str, start: int, bound: int, step: int) -> int | None:
    if direction in ("LT", "LE") and step > 0:
        stop = bound if direction == "LT" else bound + 1
        return max(0, -(-(stop - start) // step))
    if direction in ("GT", "GE") and step < 0:
        stop = bound if direction == "GT" else bound - 1
        return max(0, -(-(start - stop) // -step))
    if direction == "NE" and (bound - start) % step == 0 and (bound - start) // step >= 0:
        return (bound - start) // step
    return None


# --------------------------------------------------------------------------------------------------
# The same reader for other per-instruction counts (jaxdist/pipeline/cost.py's lock-step FLOPs)
# --------------------------------------------------------------------------------------------------


def parse_module(hlo_text: str) -> _Module:
    """The HLO text's computations (`.computations`: name → computation with `.instructions`,
    name → instruction with `.opcode`, `.shape`, `.operands`, `.attrs`) and `.entry`'s name.
    Parsed once per text and shared between callers: read it, never modify it."""
    return _parse_module(hlo_text)


def callees(inst: _Instruction) -> list[str]:
    """Names of the computations an instruction runs (loop body and condition, branches, ...)."""
    return list(inst.calls)


def trip_count(module: _Module, inst: _Instruction, parent: _Computation) -> int:
    """How many times a `while` instruction of `parent` runs its body (ValueError if unknown)."""
    return _Analysis(module)._trip_count(inst, parent)


def dot_flops(inst: _Instruction, comp: _Computation) -> float:
    """2 · |output| · |contracted| of one `dot` of `comp` (its operand shape looked up by name)."""
    _, out_dims = _parse_shape(inst.shape)
    lhs = comp.instructions.get(inst.operands[0])
    if lhs is None:
        raise ValueError(f"dot {inst.name!r}: operand {inst.operands[0]!r} not in {comp.name!r}")
    _, lhs_dims = _parse_shape(lhs.shape)
    contracted = _int_list(inst.attrs.get("lhs_contracting_dims", "{}"))
    return 2.0 * float(math.prod(out_dims)) * float(math.prod(lhs_dims[i] for i in contracted))
