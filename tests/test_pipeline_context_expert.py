"""`mesh.pipeline` with `mesh.context` and `mesh.expert`: the stages' shard_map is manual over
`context` and `expert` too, so attention runs its per-device ring / all-gather body on the block's
T/c slots (models/attention.py) and the MoE layer its all-to-alls on the device's tokens
(models/moe.py) instead of nesting a shard_map; the router losses leave the stages as the blocks'
statistics (`Stages.aux_zero` / `aux_loss`). Four float32 steps equal one device within 1e-5.
"""

from __future__ import annotations

import functools
import json
import re

import jax
import numpy as np
import pytest

from jaxdist import config as config_lib
from tests.helpers import compile_for, compile_step, engine_for, initial_state, train_steps
from tests.test_llama import llama_config

STEPS = 4
_ENGINES: dict[str, tuple] = {}


def _engine(c) -> tuple:
    """(engine, batches, compiled train step) of config `c`, built and compiled once per module:
    the planner and checkpoint tests read the programs the training tests ran."""
    key = json.dumps(config_lib.to_json_dict(c), sort_keys=True)
    if key not in _ENGINES:
        eng, batches = engine_for(c)
        _ENGINES[key] = eng, batches, compile_for(eng, batches)
    return _ENGINES[key]


def _run(c, metrics: tuple[str, ...] = ("loss",)) -> tuple[np.ndarray, dict]:
    """4 steps of `c`: [steps, len(metrics)] of those metrics per step; the final params."""
    eng, batches, _ = _engine(c)
    state, rows = initial_state(eng, c), []
    for i in range(STEPS):
        state, m = eng.train_step(state, batches.get(i))
        rows.append([float(m[k]) for k in metrics])
    return np.array(rows), jax.device_get(eng.to_user(state)["params"])


def _config(mode: str, schedule: str = "gpipe", **mesh_sizes):
    c = llama_config(**mesh_sizes)
    c.model.context_attention = mode
    c.pipeline.schedule, c.pipeline.microbatches = schedule, 2
    return c


def _assert_params_equal(params, ref_params) -> None:
    flat = jax.tree_util.tree_leaves_with_path(params)
    for (path, a), b in zip(flat, jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=jax.tree_util.keystr(path))


@functools.cache
def _reference(num_layers: int = 2) -> tuple[np.ndarray, dict]:
    """One device, 4 steps: (losses, final params), once per module for each layer count."""
    c = llama_config()
    c.model.num_layers = num_layers
    losses, params = _run(c)
    return losses[:, 0], params


@pytest.mark.parametrize(
    "mode, schedule, other",
    [
        ("ring", "gpipe", "data"),
        ("all_gather", "gpipe", "data"),
        ("all_gather", "1f1b", "data"),
        ("all_gather", "zb", "data"),
        ("ring", "interleaved", "data"),
        ("ring", "gpipe", "fsdp"),
        ("all_gather", "1f1b", "tensor"),
        ("ring", "1f1b", "data"),
        ("ring", "zb", "data"),
    ],
)
def test_pipeline_context_matches_one_device(mode, schedule, other):
    """pipeline=2 × context=2 × `other`=2: the same 4 losses and final parameters as one device
    within 1e-5."""
    c = _config(mode, schedule, pipeline=2, context=2, **{other: 2})
    if schedule == "interleaved":
        c.model.num_layers, c.pipeline.virtual_stages = 4, 2
    ref, ref_params = _reference(c.model.num_layers)
    losses, params = _run(c)
    losses = losses[:, 0]
    np.testing.assert_allclose(losses, ref, rtol=0, atol=1e-5)
    assert losses[-1] < losses[0]
    _assert_params_equal(params, ref_params)


def _groups(mesh, axis: str) -> np.ndarray:
    """[groups, size]: the device ids along `axis`, one row per group."""
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    return np.moveaxis(ids, mesh.axis_names.index(axis), -1).reshape(-1, mesh.shape[axis])


def _context_permutes(c: int, mode: str) -> tuple[int, int]:
    """(forward, backward) collective-permutes over the `context` ring of the compiled gpipe
    step with pipeline=2 × context=c, layers unrolled: those whose pairs are exactly every
    device's next (previous) neighbour on the `context` axis."""
    cfg = _config(mode, pipeline=2, context=c)
    cfg.model.scan_unroll = cfg.model.num_layers
    eng, compiled = compile_step(cfg)
    ids = _groups(eng.mesh, "context")
    ring = lambda step: {(int(g[j]), int(g[(j + step) % c])) for g in ids for j in range(c)}
    found = re.findall(
        r"collective-permute(?:-start)?\(.*source_target_pairs=\{(\{.*?\})\}", compiled.as_text()
    )
    sets = [
        set(map(tuple, np.array(re.findall(r"\d+", f), int).reshape(-1, 2).tolist())) for f in found
    ]
    return sum(s == ring(1) for s in sets), sum(s == ring(-1) for s in sets)


def test_ring_pipeline_hlo_has_c_minus_1_kv_permutes_per_layer():
    """gpipe × ring, pipeline=2 × context=4, one layer per stage: 3 = c − 1 K/V permutes around
    the `context` ring forward and 3 back (their transposes); all_gather has none."""
    assert _context_permutes(4, "ring") == (3, 3)
    assert _context_permutes(4, "all_gather") == (0, 0)


@pytest.mark.parametrize(
    "schedule, c, fwd, bwd",
    [
        ("1f1b", 4, [0, 3, 0, 3, 3], [0, 0, 3, 3, 3]),
        ("zb", 2, [0, 1, 1, 0, 1, 1], [0, 1, 1, 0, 1, 1]),  # c = 2: both directions the same pairs
    ],
)
def test_ring_in_tick_branches_has_aligned_permutes(schedule, c, fwd, bwd):
    """1f1b / zb × ring, pipeline=2 × context=c (× data=2 for c = 2: the training test's program;
    c = 4 also trains like one device within 1e-5, 4 steps), one layer per stage: each branch of the tick switch runs c − 1 K/V permutes around the
    `context` ring per layer and pass, forward (`fwd`) and back (`bwd`), per branch: idle, F, B,
    then 1f1b's FB and the last stage's F+B, or zb's W, F and B of the last stage; and every
    branch runs as many collective-permutes in all (jaxdist/aligned_switch.py), which XLA:CPU
    needs to pair the conveyors' permutes."""
    from jaxdist import hlo_cost, pipeline

    cfg = _config("ring", schedule, pipeline=2, context=c, data=8 // (2 * c))
    eng, _, compiled = _engine(cfg)
    text, sched = compiled.as_text(), pipeline.schedule_for(cfg, eng.mesh)
    ids = _groups(eng.mesh, "context")

    def kv_hops(step: int) -> list[float]:  # K/V blocks (not scalars) around the context ring
        ring = {(int(g[j]), int(g[(j + step) % c])) for g in ids for j in range(c)}

        def hop(inst, comp) -> float:
            if inst.opcode not in ("collective-permute", "collective-permute-start"):
                return 0.0
            pairs = np.array(re.findall(r"\d+", inst.attrs["source_target_pairs"]), int)
            found = set(map(tuple, pairs.reshape(-1, 2).tolist()))
            return float(found == ring and "[]" not in inst.shape)

        walk = pipeline.LockStep(hlo_cost.parse_module(text), pipeline.executed_actions(sched), hop)
        walk.comp(walk.module.entry)
        return walk.branches

    assert (kv_hops(1), kv_hops(-1)) == (fwd, bwd)
    counts = pipeline.branch_counts(text, sched, "collective-permute")
    assert len(set(counts)) == 1 and counts[0] >= max(fwd), counts
    if c > 2:  # c = 2 trains in test_pipeline_context_matches_one_device; c hops here
        (ref, ref_params), (losses, params) = _reference(), _run(cfg)
        np.testing.assert_allclose(losses[:, 0], ref, rtol=0, atol=1e-5)
        _assert_params_equal(params, ref_params)


def _moe_run(c) -> tuple[np.ndarray, dict]:
    """[steps, 3]: loss, load-balancing loss, z-loss per step; the final params."""
    return _run(c, ("loss", "moe_lb_loss", "moe_z_loss"))


def _moe_config(factor: float, m: int, **mesh_sizes):
    """tests/test_moe.py's MoE (8 experts, top-2); `m` pipeline microbatches, or on one device
    `m` accumulation chunks (the same rows: the router losses are each chunk's)."""
    from tests.test_moe import moe_config

    c = moe_config(factor, **mesh_sizes)
    if mesh_sizes.get("pipeline", 1) > 1:
        c.pipeline.microbatches = m
    else:
        c.train.grad_accum = m
    return c


@functools.cache
def _moe_reference(m: int, num_layers: int = 2):
    c = _moe_config(0.0, m)
    c.model.num_layers = num_layers
    return _moe_run(c)


@pytest.mark.parametrize(
    "schedule, factor, m, other",
    [
        ("gpipe", 4.0, 2, "data"),
        ("1f1b", 4.0, 2, "data"),
        ("1f1b", 0.0, 2, "data"),
        ("gpipe", 0.0, 1, "data"),
        ("gpipe", 4.0, 2, "fsdp"),
        ("1f1b", 4.0, 2, "tensor"),
        ("interleaved", 4.0, 2, "data"),
    ],
)
def test_pipeline_expert_matches_one_device(schedule, factor, m, other):
    """pipeline=2 × expert=2 × `other`=2, capacity E/k (every local token fits) or dropless:
    losses, both router losses and parameters within 1e-5 of one device over 4 steps
    (interleaved: 4 layers, 2 virtual stages)."""
    c = _moe_config(factor, m, pipeline=2, expert=2, **{other: 2})
    c.pipeline.schedule = schedule
    if schedule == "interleaved":
        c.model.num_layers, c.pipeline.virtual_stages = 4, 2
    (ref, ref_params), (got, params) = _moe_reference(m, c.model.num_layers), _moe_run(c)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)
    assert got[-1, 0] < got[0, 0] and np.all(got[:, 1] > 0.9)  # lb loss: 1 when balanced
    _assert_params_equal(params, ref_params)


@pytest.mark.parametrize("axis", ["expert", "context"])
def test_checkpoint_restores_without_the_axis(axis, tmp_path):
    """A pipeline=2 × `axis`=2 × data=2 state (gpipe; ring attention for context), saved, restores
    onto pipeline=2 × data=4 and onto one device (`axis`=1) with bit-equal arrays, each on the
    new layout's shardings."""
    from jaxdist import checkpoint

    def make(**sizes):
        if axis == "expert":
            return _moe_config(4.0, 2, **sizes)
        return _config("ring", **sizes) if sizes.get("pipeline", 1) > 1 else llama_config()

    eng = _engine(make(pipeline=2, data=2, **{axis: 2}))[0]
    state = eng.to_user(eng.init())
    if axis == "expert":  # the experts' weights are split over `expert` when saved
        specs = [x.sharding.spec for x in jax.tree.leaves(state["params"])]
        assert any("expert" in jax.tree.leaves(tuple(s)) for s in specs)
    with checkpoint.Checkpointer(tmp_path, every=1, keep=1, config_json=None) as ckpt:
        ckpt.save(1, state, data_position=1, force=True)
    saved = jax.device_get(state)
    for sizes in (dict(pipeline=2, data=4), {}):
        other, _ = engine_for(make(**sizes))
        with checkpoint.Checkpointer(tmp_path, every=1, keep=1, config_json=None) as ckpt:
            restored, _ = ckpt.restore(other.abstract_state)
        got = jax.tree_util.tree_leaves_with_path(restored)
        want = jax.tree.leaves(other.abstract_state)
        for (path, a), b, ref in zip(got, want, jax.tree.leaves(saved), strict=True):
            assert a.sharding.is_equivalent_to(b.sharding, a.ndim), jax.tree_util.keystr(path)
            np.testing.assert_array_equal(a, ref, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("axis", ["context", "expert"])
def test_compressor_with_pipeline_and_context_or_expert(axis):
    """bf16 gradient compression (the stages nested in the per-replica shard_map over `data`,
    `make_gradients(data_manual=True)`) on pipeline=2 × `axis`=2 × data=2 equals it on
    pipeline=2 × data=2 within 1e-5: the same replicas, each split over `axis` exactly."""
    sizes = dict(pipeline=2, data=2)
    if axis == "expert":
        make = lambda **extra: _moe_config(4.0, 2, **sizes, **extra)
    else:
        make = lambda **extra: _config("all_gather", **sizes, **extra)
    runs = []
    for extra in ({}, {axis: 2}):
        c = make(**extra)
        c.grad_sync.compression = "bf16"
        runs.append(train_steps(c, STEPS)[0])
    np.testing.assert_allclose(runs[1], runs[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "schedule, axis, kind",
    [("gpipe", "context", "all-gather"), ("1f1b", "context", "all-gather"),
     ("gpipe", "expert", "all-to-all"), ("1f1b", "expert", "all-to-all")],
)  # fmt: skip
def test_planner_terms_equal_the_compiled_pipeline_step(schedule, axis, kind):
    """The planner's K/V-gather and all-to-all bytes for pipeline=2 × `axis`=2 × data=2 (one
    pipeline microbatch's tokens per layer run, at every tick; 1f1b: its costliest branch)
    equal the compiled step's (the layout record's)."""
    from jaxdist import hlo_cost, plan

    if axis == "expert":
        c = _moe_config(4.0, 2, pipeline=2, expert=2, data=2)
    else:
        c = _config("all_gather", pipeline=2, context=2, data=2)
    c.pipeline.schedule = schedule
    eng, _, compiled = _engine(c)  # the training tests' program
    text = compiled.as_text()
    groups = {frozenset(map(int, g)) for g in _groups(eng.mesh, axis)}

    def over_axis(op) -> bool:  # the op's replica groups are `axis`'s (not the pipeline's)
        line = re.search(rf"%{re.escape(op.name)} = .*replica_groups=\{{(.*?)\}}\}}", text)
        found = line and re.findall(r"\{([\d,]+)", line.group(1) + "}")
        return bool(found) and {frozenset(map(int, f.split(","))) for f in found} == groups

    ops = [op for op in hlo_cost.collective_ops(text) if op.kind == kind and over_axis(op)]
    layout = plan.Layout(data=2, pipeline=2, microbatches=2, **{axis: 2})
    terms = plan.predict(c, layout, plan.hardware("h100_nvlink_ib")).terms
    mine = [t for t in terms if t.name.startswith(("cp:", "ep:")) and t.kind == kind]
    want = sum(hlo_cost.ring_wire_bytes(t.kind, t.payload, t.group) * t.count for t in mine)
    assert ops and want == pytest.approx(sum(op.wire_bytes for op in ops), rel=1e-9)


def test_zb_expert_data_matches_one_device():
    """zb with experts: the router statistics join the loss at F and their cotangent B's (the
    split backward), so pipeline=2 × expert=2 × data=2, dropless, equals one device within 1e-5
    as gpipe and 1f1b do (it was refused in one line before)."""
    test_pipeline_expert_matches_one_device("zb", 0.0, 2, "data")
