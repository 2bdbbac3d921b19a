"""Tests for jaxdist.metrics: collective bytes from compiled HLO, FLOPs/MFU, and the metrics file.

Collective tests compile real shard_map programs on the 8 simulated CPU devices and compare against
ring costs worked out by hand; the async forms and group syntaxes that the CPU backend never prints
(``all-reduce-start``, ``async-start`` wrappers, iota and mesh replica groups) are checked on small
hand-written modules in the syntax XLA's own tests use.
"""

import glob
import json
import math
import os
import re
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxdist import hlo_cost, metrics
from jaxdist.hlo_cost import cross_host_bytes, cross_host_traffic
from jaxdist.metrics import MetricsWriter, collective_bytes, collective_ops

NDEV = len(jax.devices())
LOCAL = 1024  # f32 elements per device: S = 4096 bytes
S = 4 * LOCAL


def _auto_mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


@pytest.fixture(scope="module")
def mesh():
    return _auto_mesh((NDEV,), ("d",))


def _hlo(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


def _sharded(mesh, body, spec=None):
    spec = P("d") if spec is None else spec
    return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)


def _ring(n):
    return [(i, (i + 1) % n) for i in range(n)]


# --------------------------------------------------------------------------------------------------
# Real compiled programs
# --------------------------------------------------------------------------------------------------

# Expected bytes for one device, N = 8, S = 4096 (the per-device f32[1024] block), worked by hand.
OP_CASES = {
    "psum": ("all-reduce", lambda a: jax.lax.psum(a, "d"), 2 * 7 / 8 * S),
    # all-gather: S_out = 8 * 4096 = 32768 bytes gathered.
    "all_gather": ("all-gather", lambda a: jax.lax.all_gather(a, "d", tiled=True), 7 / 8 * 8 * S),
    # reduce-scatter: S_in is the 4096-byte input; each device keeps 512 bytes.
    "psum_scatter": (
        "reduce-scatter",
        lambda a: jax.lax.psum_scatter(a, "d", tiled=True),
        7 / 8 * S,
    ),
    "ppermute": ("collective-permute", lambda a: jax.lax.ppermute(a, "d", _ring(NDEV)), S),
    # CPU lowers this to a variadic all-to-all of 8 f32[128] pieces, printed with /*index=5*/.
    "all_to_all": ("all-to-all", lambda a: jax.lax.all_to_all(a, "d", 0, 0, tiled=True), 7 / 8 * S),
}


@pytest.mark.parametrize("case", sorted(OP_CASES))
def test_each_collective_kind_costs_its_ring_bytes(mesh, case):
    kind, body, expected = OP_CASES[case]
    hlo = _hlo(_sharded(mesh, body), jnp.ones((NDEV * LOCAL,), jnp.float32))
    assert collective_bytes(hlo) == {kind: expected}
    (op,) = collective_ops(hlo)
    assert (op.kind, op.group_size, op.count) == (kind, NDEV, 1)
    assert isinstance(op.bytes_per_exec, float)


@pytest.mark.parametrize(("dtype", "itemsize"), [(jnp.int8, 1), (jnp.float16, 2), (jnp.int32, 4)])
def test_element_size_follows_dtype(mesh, dtype, itemsize):
    body = lambda a: jax.lax.ppermute(a, "d", _ring(NDEV))
    hlo = _hlo(_sharded(mesh, body), jnp.ones((NDEV * 64,), dtype))
    assert collective_bytes(hlo) == {"collective-permute": 64.0 * itemsize}


def test_variadic_psum_sums_tuple_elements(mesh):
    # psum of two arrays becomes one all-reduce with a tuple result: S = 4096 + 256 bytes.
    body = lambda a, b: jax.lax.psum((a, b), "d")
    fn = jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P("d")), out_specs=(P("d"), P("d")))
    hlo = _hlo(fn, jnp.ones((NDEV * LOCAL,)), jnp.ones((NDEV * 64,)))
    assert collective_bytes(hlo) == {"all-reduce": 2 * 7 / 8 * (S + 256)}


@pytest.mark.parametrize(("axis", "n"), [("a", 4), ("b", 2)])
def test_subgroup_uses_the_axis_size(axis, n):
    mesh = _auto_mesh((4, 2), ("a", "b"))
    spec = P(("a", "b"))
    x = jnp.ones((NDEV * 16,), jnp.float32)  # 64 bytes per device
    psum = _hlo(_sharded(mesh, lambda v: jax.lax.psum(v, axis), spec), x)
    assert collective_bytes(psum) == {"all-reduce": 2 * (n - 1) / n * 64}
    assert [op.group_size for op in collective_ops(psum)] == [n]
    gather = _hlo(_sharded(mesh, lambda v: jax.lax.all_gather(v, axis, tiled=True), spec), x)
    assert collective_bytes(gather) == {"all-gather": (n - 1) / n * (n * 64)}


def _scanned_psum(length):
    def body(a):
        step = lambda c, _: (c + 0.5 * jax.lax.psum(c, "d"), None)
        return jax.lax.scan(step, a, None, length=length)[0]

    return body


def test_psum_in_scan_counts_every_iteration(mesh):
    hlo = _hlo(_sharded(mesh, _scanned_psum(5)), jnp.ones((NDEV * LOCAL,)))
    assert collective_bytes(hlo) == {"all-reduce": 5 * 2 * 7 / 8 * S}
    assert [op.count for op in collective_ops(hlo)] == [5]


def test_fori_loop_counts_every_iteration(mesh):
    body = lambda a: jax.lax.fori_loop(0, 4, lambda i, c: c + 0.5 * jax.lax.psum(c, "d"), a)
    hlo = _hlo(_sharded(mesh, body), jnp.ones((NDEV * LOCAL,)))
    assert collective_bytes(hlo) == {"all-reduce": 4 * 2 * 7 / 8 * S}


def test_nested_scans_multiply(mesh):
    def body(a):
        inner = lambda c, _: (_scanned_psum(3)(c), None)
        return jax.lax.scan(inner, a, None, length=5)[0] + jax.lax.psum(a, "d")

    hlo = _hlo(_sharded(mesh, body), jnp.ones((NDEV * LOCAL,)))
    # 5 * 3 = 15 psums in the loops plus one outside.
    assert collective_bytes(hlo) == {"all-reduce": 16 * 2 * 7 / 8 * S}
    assert sorted(op.count for op in collective_ops(hlo)) == [1, 15]


def test_trip_count_inferred_when_backend_config_is_missing(mesh):
    fn, x = _sharded(mesh, _scanned_psum(5)), jnp.ones((NDEV * LOCAL,))
    compiled = _hlo(fn, x)
    assert '"known_trip_count":{"n":"5"}' in compiled  # where XLA records it on CPU
    stripped = re.sub(r", backend_config=\{.*\}", "", compiled)
    assert "known_trip_count" not in stripped
    # The compiled condition hides `i < 5` inside a fusion; the unoptimized module spells it out.
    unoptimized = jax.jit(fn).lower(x).as_text(dialect="hlo")
    for text in (stripped, unoptimized):
        assert collective_bytes(text) == {"all-reduce": 5 * 2 * 7 / 8 * S}


def test_data_dependent_while_with_collectives_raises(mesh):
    def body(a):
        def step(carry):
            c, _ = carry
            return c * 2.0, jax.lax.psum(jnp.sum(c), "d")

        return jax.lax.while_loop(lambda carry: carry[1] < 1e6, step, (a, jnp.float32(0.0)))[0]

    hlo = _hlo(_sharded(mesh, body), jnp.ones((NDEV * LOCAL,)))
    with pytest.raises(ValueError, match="trip count is unknown"):
        collective_bytes(hlo)


def test_no_collectives_gives_empty_dict(mesh):
    assert collective_bytes(_hlo(lambda x: x * 2.0 + 1.0, jnp.ones((8,)))) == {}
    sharded = jax.device_put(jnp.ones((NDEV * 4,)), jax.NamedSharding(mesh, P("d")))
    assert collective_bytes(_hlo(lambda x: jnp.sin(x) * 2.0, sharded)) == {}
    # A data-dependent loop is fine as long as nothing inside it communicates.
    loop = lambda x: jax.lax.while_loop(lambda c: jnp.sum(c) < 1e6, lambda c: c * 2.0, x)
    assert collective_bytes(_hlo(loop, jnp.ones((8,)))) == {}


# --------------------------------------------------------------------------------------------------
# Hand-written modules: syntax the CPU backend does not print
# --------------------------------------------------------------------------------------------------


def _module(body: list[str], header: str = "num_partitions=8", extra: str = "") -> str:
    """A module whose ENTRY has %p: f32[1024] (4096 bytes, as in the compiled tests), %i: s32[]."""
    lines = "\n".join("  " + line for line in body)
    return f"""HloModule m, is_scheduled=true, {header}

%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}}
{extra}
ENTRY %main (p: f32[1024], i: s32[]) -> f32[1024] {{
  %p = f32[1024]{{0}} parameter(0)
  %i = s32[] parameter(1)
{lines}
}}
"""


def _computation(name: str, param: str, body: list[str]) -> str:
    lines = "\n".join("  " + line for line in body)
    return f"\n%{name} (x: {param}) -> f32[1024] {{\n  %x = {param} parameter(0)\n{lines}\n}}\n"


# One all-reduce of %x over every device; 2 * 7/8 * 4096 bytes under num_partitions=8.
AR_X_ALL = (
    "ROOT %ar = f32[1024]{0} all-reduce(%x), channel_id=1, replica_groups={}, "
    "use_global_device_ids=true, to_apply=%add"
)


@pytest.mark.parametrize(
    ("groups", "n"),
    [
        ("{{0,1},{2,3},{4,5},{6,7}}", 2),
        ("{}", 8),  # every device: N from num_partitions in the header
        ("[2,4]<=[8]", 4),
        ("[4,2]<=[2,4]T(1,0)", 2),
        ("mesh['a'=4,'b'=2] {'b'}", 2),  # how jax 0.11 prints a shard_map psum over one axis
        ("mesh['a'=4,'b'=2] {'a','b'}", 8),
        ("mesh['axis_0'=1,'axis_1'=2,'axis_2'=4], device_ids=([4,2]T(1,0)) {'axis_1'}", 2),
        ("mesh['x'=8] {'x':(2)4}", 4),  # a sub-axis: 4 devices of the 8-long axis
    ],
)
def test_replica_group_syntaxes(groups, n):
    hlo = _module(
        [
            f"ROOT %ar = f32[1024]{{0}} all-reduce(%p), channel_id=1, replica_groups={groups}, "
            "use_global_device_ids=true, to_apply=%add"
        ]
    )
    assert collective_bytes(hlo) == {"all-reduce": 2 * (n - 1) / n * S}
    assert [op.group_size for op in collective_ops(hlo)] == [n]


def test_singleton_groups_cost_nothing():
    hlo = _module(
        [
            "ROOT %ar = f32[1024]{0} all-reduce(%p), channel_id=1, "
            "replica_groups={{0},{1},{2},{3},{4},{5},{6},{7}}, use_global_device_ids=true, "
            "to_apply=%add"
        ]
    )
    assert collective_bytes(hlo) == {}
    assert [(op.group_size, op.wire_bytes) for op in collective_ops(hlo)] == [(1, 0.0)]


def test_group_modes_without_global_device_ids():
    # No channel_id: cross-replica (pmap style), `{}` means every replica.
    pmap_style = ["ROOT %ar = f32[1024]{0} all-reduce(%p), replica_groups={}, to_apply=%add"]
    assert collective_ops(_module(pmap_style, header="replica_count=4"))[0].group_size == 4
    # channel_id without use_global_device_ids: the ids are replicas, each with all its partitions.
    mixed = [
        "ROOT %ar = f32[1024]{0} all-reduce(%p), channel_id=1, replica_groups={{0,1}}, "
        "to_apply=%add"
    ]
    header = "replica_count=2, num_partitions=4"
    assert collective_ops(_module(mixed, header=header))[0].group_size == 8


ASYNC_CASES = {
    "all-reduce-start": (
        [
            "%ars = f32[1024]{0} all-reduce-start(%p), channel_id=1, "
            "replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add",
            "ROOT %ard = f32[1024]{0} all-reduce-done(%ars)",
        ],
        "",
        {"all-reduce": 2 * 7 / 8 * S},
    ),
    "all-gather-start": (  # (operand, result): the result is the gathered 8 * 4096 bytes
        [
            "%ags = (f32[1024]{0}, f32[8192]{0}) all-gather-start(%p), channel_id=1, "
            "replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true",
            "%agd = f32[8192]{0} all-gather-done(%ags)",
            "ROOT %s = f32[1024]{0} slice(%agd), slice={[0:1024]}",
        ],
        "",
        {"all-gather": 7 / 8 * 8 * S},
    ),
    "collective-permute-start": (  # (operand, result, context, context)
        [
            "%cps = (f32[1024]{0}, f32[1024]{0}, u32[], u32[]) collective-permute-start(%p), "
            "channel_id=1, source_target_pairs={{0,1},{1,0}}",
            "ROOT %cpd = f32[1024]{0} collective-permute-done(%cps)",
        ],
        "",
        {"collective-permute": S},
    ),
    "reduce-scatter-start": (  # the sugared print of an async reduce-scatter: ((operand), result)
        [
            "%rss = ((f32[1024]{0}), f32[128]{0}) reduce-scatter-start(%p), channel_id=1, "
            "replica_groups={}, use_global_device_ids=true, dimensions={0}, to_apply=%add",
            "%rsd = f32[128]{0} reduce-scatter-done(%rss)",
            "ROOT %b = f32[1024]{0} broadcast(%rsd), dimensions={}",
        ],
        "",
        {"reduce-scatter": 7 / 8 * S},
    ),
    "async-start wrapper": (  # the unsugared print: the op lives in the called computation
        [
            "%rss = ((f32[1024]{0}), f32[128]{0}, s32[]) async-start(%p), calls=%wrapped_rs",
            "%rsd = f32[128]{0} async-done(%rss), calls=%wrapped_rs",
            "ROOT %b = f32[1024]{0} broadcast(%rsd), dimensions={}",
        ],
        _computation(
            "wrapped_rs",
            "f32[1024]{0}",
            [
                "ROOT %rs = f32[128]{0} reduce-scatter(%x), channel_id=1, "
                "replica_groups=[1,8]<=[8], use_global_device_ids=true, dimensions={0}, "
                "to_apply=%add"
            ],
        ),
        {"reduce-scatter": 7 / 8 * S},
    ),
    "wrapped over lines": (  # how XLA's C++ tests write modules: one instruction, several lines
        [
            "%ags = (f32[1024], f32[8192]) all-gather-start(",
            "    f32[1024] %p), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0},",
            "    channel_id=3, use_global_device_ids=true",
            "ROOT %agd = f32[8192] all-gather-done(",
            "    (f32[1024], f32[8192]) %ags)",
        ],
        "",
        {"all-gather": 7 / 8 * 8 * S},
    ),
}


@pytest.mark.parametrize("case", sorted(ASYNC_CASES))
def test_async_forms_count_once_with_the_result_size(case):
    body, extra, expected = ASYNC_CASES[case]
    hlo = _module(body, extra=extra)
    assert collective_bytes(hlo) == expected
    assert [op.count for op in collective_ops(hlo)] == [1]


DTYPE_BYTES = [
    ("pred", 1), ("s8", 1), ("u8", 1), ("s16", 2), ("u16", 2), ("f16", 2), ("bf16", 2),
    ("s32", 4), ("u32", 4), ("f32", 4), ("s64", 8), ("u64", 8), ("f64", 8), ("c64", 8),
    ("c128", 16), ("f8e4m3fn", 1), ("f8e5m2", 1), ("f8e4m3fnuz", 1), ("s4", 0.5),
]  # fmt: skip


@pytest.mark.parametrize(("dtype", "itemsize"), DTYPE_BYTES)
def test_dtype_sizes(dtype, itemsize):
    body = [
        f"%x = {dtype}[4,8]{{1,0}} parameter(2)",
        f"%cp = {dtype}[4,8]{{1,0}} collective-permute(%x), channel_id=1, "
        "source_target_pairs={{0,1},{1,2},{2,0}}",
        "ROOT %r = f32[1024]{0} copy(%p)",
    ]
    assert collective_bytes(_module(body)) == {"collective-permute": 32 * itemsize}


def _loop_module(trip_config: str) -> str:
    extra = """
%body (t: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %t = (s32[], f32[1024]{0}) parameter(0)
  %k = s32[] get-tuple-element(%t), index=0
  %x = f32[1024]{0} get-tuple-element(%t), index=1
  %ar = f32[1024]{0} all-reduce(%x), channel_id=1, replica_groups={}, to_apply=%add
  ROOT %out = (s32[], f32[1024]{0}) tuple(%k, %ar)
}

%cond (t: (s32[], f32[1024])) -> pred[] {
  %t = (s32[], f32[1024]{0}) parameter(0)
  %k = s32[] get-tuple-element(%t), index=0
  %limit = s32[] constant(7)
  ROOT %lt = pred[] compare(%k, %limit), direction=LT
}
"""
    body = [
        "%init = (s32[], f32[1024]{0}) tuple(%i, %p)",
        f"%w = (s32[], f32[1024]{{0}}) while(%init), condition=%cond, body=%body{trip_config}",
        "ROOT %r = f32[1024]{0} get-tuple-element(%w), index=1",
    ]
    # replica_count x num_partitions = 8 devices (the op has a channel_id but no global ids).
    return _module(body, header="replica_count=8, num_partitions=1", extra=extra)


def test_while_trip_count_sources():
    per_trip = 2 * 7 / 8 * S
    config = ', backend_config={"known_trip_count":{"n":"3"}}'
    assert collective_bytes(_loop_module(config)) == {"all-reduce": 3 * per_trip}
    # Start and step known, bound read from `k < 7` in the condition.
    config = ', backend_config={"known_init_step":{"init":"2","step":"1"}}'
    assert collective_bytes(_loop_module(config)) == {"all-reduce": 5 * per_trip}
    # The counter starts from a parameter and never steps: refuse rather than count once.
    with pytest.raises(ValueError, match="'w'.*trip count is unknown"):
        collective_bytes(_loop_module(""))


def test_conditional_charges_the_most_expensive_branch():
    permute = [
        "ROOT %cp = f32[1024]{0} collective-permute(%x), channel_id=2, "
        "source_target_pairs={{0,1},{1,0}}"
    ]
    extra = _computation("b0", "f32[1024]{0}", [AR_X_ALL]) + _computation(
        "b1", "f32[1024]{0}", permute
    )
    body = ["ROOT %c = f32[1024]{0} conditional(%i, %p, %p), branch_computations={%b0, %b1}"]
    assert collective_bytes(_module(body, extra=extra)) == {"all-reduce": 2 * 7 / 8 * S}
    # Asked for, the cheapest branch instead: the permute (S, one pair), as 1-bit Adam's
    # compressed branch after its warm-up; across 2 processes of 4 devices each, device 0's
    # permute to device 1 stays inside process 0, so nothing crosses.
    (op,) = collective_ops(_module(body, extra=extra), branch="cheapest")
    assert (op.kind, op.wire_bytes, op.conditional) == ("collective-permute", S, True)
    hosts = [0] * 4 + [1] * 4
    text = _module(body, extra=extra)
    assert cross_host_bytes(text, hosts)[0] == 2 * 7 / 8 * S  # the ring's hop from device 3 to 4
    assert cross_host_bytes(text, hosts, branch="cheapest") == [0.0, 0.0]
    # ... in gloo's messages: device 3 sends its ring step 2(N-1) = 14 times to device 4
    assert cross_host_traffic(text, hosts) == ([2 * 7 / 8 * S] * 2, [14.0, 14.0])
    assert cross_host_traffic(text, hosts, branch="cheapest") == ([0.0, 0.0], [0.0, 0.0])
    with pytest.raises(ValueError, match="branch='newest'"):
        collective_ops(text, branch="newest")


def test_called_twice_counts_twice():
    extra = _computation("sync", "f32[1024]{0}", [AR_X_ALL])
    body = [
        "%c1 = f32[1024]{0} call(%p), to_apply=%sync",
        "ROOT %c2 = f32[1024]{0} call(%c1), to_apply=%sync",
    ]
    (op,) = collective_ops(_module(body, extra=extra))
    assert (op.count, op.wire_bytes) == (2, 2 * 2 * 7 / 8 * S)


def test_strings_with_brackets_commas_and_escaped_quotes_stay_one_attribute():
    # metadata and backend_config strings carry source text: brackets, commas, \" and \\ inside a
    # string neither split the attributes nor close a bracket.
    meta = r'metadata={op_name="jit(f)/psum[axes=(\'data\',), x=\"}, {\" \\]" source_line=3}'
    body = [
        "%one = f32[] constant(1)",
        f"%ar = f32[1024]{{0}} all-reduce(%p), channel_id=1, replica_groups={{{{0,1,2,3}},"
        f"{{4,5,6,7}}}}, use_global_device_ids=true, to_apply=%add, {meta}, "
        'backend_config={"note":"a, b}]"}',
        "ROOT %out = f32[1024]{0} multiply(%ar, %ar)",
    ]
    module = hlo_cost.parse_module(_module(body))
    ar = module.computations["main"].instructions["ar"]
    assert ar.operands == ["p"] and ar.attrs["to_apply"] == "%add"
    assert ar.attrs["metadata"].endswith('\\]" source_line=3}')
    assert ar.attrs["backend_config"] == '{"note":"a, b}]"}'
    assert [op.group_size for op in collective_ops(_module(body))] == [4]


def test_text_without_entry_is_rejected():
    with pytest.raises(ValueError, match="no ENTRY"):
        collective_bytes("HloModule m\n")


# --------------------------------------------------------------------------------------------------
# FLOPs and MFU
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-40GB", 312e12),
        ("TPU v4", 275e12),
        ("TPU v5 lite", 197e12),
        ("TPU v5", 459e12),
        ("TPU v5p", 459e12),
        ("TPU v6 lite", 918e12),
        ("Quadro RTX 9000", None),
    ],
)
def test_peak_flops_by_device_kind(kind, peak):
    assert metrics.peak_flops(kind) == peak


def test_peak_flops_is_none_on_cpu():
    assert metrics.peak_flops(jax.devices()[0]) is None


def test_model_flops_and_mfu():
    # 6 * 1e6 + 12 * 2 * 64 * 128 = 6_000_000 + 196_608
    fpt = metrics.model_flops_per_token(1_000_000, num_layers=2, d_model=64, seq_len=128)
    assert fpt == 6_196_608.0
    # 1000 tokens/s * 6_196_608 FLOP/token / (2 devices * 1e12 FLOP/s)
    assert metrics.mfu(1000.0, fpt, num_devices=2, peak=1e12) == pytest.approx(3.098304e-3)
    with pytest.raises(ValueError):
        metrics.mfu(1.0, 1.0, num_devices=0, peak=1e12)


# --------------------------------------------------------------------------------------------------
# MetricsWriter
# --------------------------------------------------------------------------------------------------


def _event_scalars(workdir):
    """(step, tag, value) from TensorBoard event files: TFRecord frames around Event protos."""
    from tensorboardX.proto import event_pb2

    out = []
    for path in glob.glob(os.path.join(workdir, "events.out.tfevents.*")):
        data = open(path, "rb").read()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            out += [(event.step, v.tag, v.simple_value) for v in event.summary.value]
    return sorted(out)


def test_metrics_writer_jsonl_and_tensorboard(tmp_path):
    workdir = str(tmp_path / "run")
    with MetricsWriter(workdir) as writer:
        layout = {"mesh": {"data": 8}, "collective_bytes_per_step": {"all-reduce": 7168.0}}
        writer.write_layout(layout)
        writer.write_step(1, {"loss": jnp.float32(0.5), "grad_norm": np.float64(2.0), "lr": 0.25})
        step2 = {"loss": jnp.array(0.25), "tokens": np.int64(4096), "note": "warm"}
        step2 |= {"bytes": {"temp": 3}, "bad": float("nan"), "hist": np.arange(3)}
        writer.write_step(2, step2)
    lines = open(os.path.join(workdir, "metrics.jsonl")).read().splitlines()
    records = [json.loads(line) for line in lines]
    assert records[0] == {
        "kind": "layout",
        "mesh": {"data": 8},
        "collective_bytes_per_step": {"all-reduce": 7168.0},
    }
    assert records[1] == {"step": 1, "loss": 0.5, "grad_norm": 2.0, "lr": 0.25}
    assert records[2]["tokens"] == 4096 and type(records[2]["tokens"]) is int
    assert records[2]["bad"] is None and records[2]["hist"] == [0, 1, 2]
    assert "NaN" not in lines[2]  # strict JSON
    assert _event_scalars(workdir) == [
        (1, "grad_norm", 2.0),
        (1, "loss", 0.5),
        (1, "lr", 0.25),
        (2, "bytes/temp", 3.0),
        (2, "loss", 0.25),
        (2, "tokens", 4096.0),
    ]


def test_metrics_writer_does_not_import_torch(tmp_path):
    """TensorBoard scalars without torch's ~2 s import (tensorboardX imports it when installed,
    for type hints); torch stays importable afterwards, and the scalars are in the event file."""
    code = (
        "import sys\n"
        "from jaxdist.metrics import MetricsWriter\n"
        f"with MetricsWriter({str(tmp_path)!r}) as w:\n"
        "    w.write_step(1, {'loss': 0.5})\n"
        "assert 'tensorboardX' in sys.modules and 'torch' not in sys.modules, 'torch imported'\n"
        "import importlib.util\n"
        "assert importlib.util.find_spec('torch') is None or __import__('torch')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _event_scalars(str(tmp_path)) == [(1, "loss", 0.5)]


def test_metrics_writer_appends_and_flushes_each_line(tmp_path):
    writer = MetricsWriter(str(tmp_path))
    writer.write_step(1, {"loss": 1.0})
    # Readable before close: a crashed run keeps what it logged.
    assert json.loads(open(tmp_path / "metrics.jsonl").read()) == {"step": 1, "loss": 1.0}
    writer.close()
    writer.close()
    with MetricsWriter(str(tmp_path)) as again:
        again.write_step(2, {"loss": 0.5})
    assert len(open(tmp_path / "metrics.jsonl").read().splitlines()) == 2


def test_disabled_writer_writes_nothing(tmp_path):
    workdir = tmp_path / "quiet"
    with MetricsWriter(str(workdir), enabled=False) as writer:
        writer.write_layout({"mesh": {"data": 8}})
        writer.write_step(1, {"loss": 1.0})
    assert not workdir.exists()


def test_ring_wire_bytes_formulae():
    assert metrics.ring_wire_bytes("all-reduce", 800.0, 4) == 1200.0
    assert metrics.ring_wire_bytes("all-gather", 800.0, 4) == 600.0
    assert metrics.ring_wire_bytes("collective-permute", 800.0, 2) == 800.0
    assert metrics.ring_wire_bytes("all-to-all", 800.0, 1) == 0.0
    with pytest.raises(ValueError, match="unknown collective kind"):
        metrics.ring_wire_bytes("broadcast", 1.0, 2)
    assert math.isclose(metrics.ring_wire_bytes("reduce-scatter", 3.0, 3), 2.0)
