"""Pipeline parallelism against the single-device model, its schedule tables, memory and errors."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from jaxdist import config as config_lib
from jaxdist import loop, metrics, pipeline, sharding, train
from jaxdist.errors import ConfigError
from tests.helpers import compile_step, engine_for, initial_state, tiny_gpt_config

# Every registered schedule (`pipeline.SCHEDULES`): a new one runs the equivalence and table tests.
SCHEDULES = tuple(pipeline.SCHEDULES)


def _config(layers: int, mesh: dict, schedule: str = "gpipe", m: int = 1, **train_fields):
    c = tiny_gpt_config(**mesh)
    c.model.num_layers = layers
    c.pipeline.schedule = schedule
    c.pipeline.microbatches = m
    c.pipeline.virtual_stages = 2 if pipeline.schedule_spec(schedule).virtual else 1
    for k, v in train_fields.items():
        c.train[k] = v
    return c


@functools.cache
def _reference(layers: int):
    """Loss, gradients, params and batch of the plain model on one device, all on the host."""
    c = _config(layers, dict(data=1))
    eng, batches = engine_for(c)
    params, batch = eng.init()["params"], batches.get(0)

    def grads(params, batch):
        with sharding.activation_rules(eng.mesh):
            loss_fn = lambda p: eng.merge(p).loss(batch)[0]
            return jax.value_and_grad(loss_fn)(params)

    loss, g = jax.jit(grads)(params, batch)
    return float(loss), jax.device_get(g), jax.device_get(params), jax.device_get(batch)


def _pipelined_gradients(c):
    eng, batches = engine_for(c)
    assert eng.schedule is not None  # train.build took the pipelined path
    _, _, host_params, _ = _reference(c.model.num_layers)
    shardings = eng.state_shardings["params"]
    # The steps run on the stored layer order (interleaved: looped), the reference is in [L] order.
    params = eng.to_storage(jax.device_put(host_params, shardings), shardings)
    fn, sched = pipeline.make_gradients(c, eng.mesh, eng.stages, eng.param_axes, eng.batch_axes)
    loss, _, grads = jax.jit(fn)(params, batches.get(0))
    return float(loss), jax.device_get(eng.to_user(grads, shardings)), sched


def _assert_matches_reference(c):
    ref_loss, ref_grads, _, _ = _reference(c.model.num_layers)
    loss, grads, _ = _pipelined_gradients(c)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    flat = jax.tree_util.tree_leaves_with_path(grads)
    assert len(flat) == len(jax.tree.leaves(ref_grads))
    for (path, g), r in zip(flat, jax.tree.leaves(ref_grads)):
        assert g.shape == r.shape, jax.tree_util.keystr(path)
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-5, err_msg=jax.tree_util.keystr(path))


# p = 2 alone, every schedule, m in {p, 2p, 4p}; 4 layers = 2 stages x 2 virtual stages.
@pytest.mark.parametrize("m", [2, 4, 8])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline2_matches_single_device(schedule, m):
    _assert_matches_reference(_config(4, dict(pipeline=2), schedule, m))


@pytest.mark.parametrize("schedule, m", [("1f1b", 16), ("interleaved", 4), ("zb", 8)])
def test_pipeline4_matches_single_device(schedule, m):
    _assert_matches_reference(_config(8, dict(pipeline=4), schedule, m))


# Composed with the other axes, gradient accumulation and remat.
@pytest.mark.parametrize(
    "schedule, mesh, m, fields",
    [
        ("gpipe", dict(pipeline=2, fsdp=4), 4, dict(remat="full")),
        ("1f1b", dict(pipeline=2, data=2, tensor=2), 4, dict(grad_accum=2)),
        ("interleaved", dict(pipeline=2, data=2, fsdp=2), 2, dict(grad_accum=2, remat="dots")),
        ("zb", dict(pipeline=2, data=2, tensor=2), 4, dict(grad_accum=2)),
        ("zb", dict(pipeline=2, fsdp=4), 4, dict(remat="full")),
        ("zb", dict(pipeline=2, data=2, fsdp=2), 2, dict(remat="dots")),
    ],
)
def test_pipeline_composed_matches_single_device(schedule, mesh, m, fields):
    _assert_matches_reference(_config(4, mesh, schedule, m, **fields))


@pytest.mark.parametrize(
    "schedule, mesh",
    [
        ("1f1b", dict(pipeline=2, fsdp=4)),
        ("gpipe", dict(pipeline=2, data=2, fsdp=2)),
        ("zb", dict(pipeline=2, fsdp=2, tensor=2)),
    ],
)
def test_fsdp_gather_once_matches_single_device(schedule, mesh):
    c = _config(4, mesh, schedule, 4)
    c.pipeline.fsdp_gather_once = True
    _assert_matches_reference(c)


def test_fsdp_gather_once_collectives_run_once():
    """pipeline.fsdp_gather_once (1f1b, pipeline=2 × fsdp=4): every all-gather and all-reduce runs
    once per step, none per tick, and the step sends under a third of the bytes it sends with
    per-tick gathers and gradient reductions."""
    ops, total = {}, {}
    for once in (False, True):
        c = _config(4, dict(pipeline=2, fsdp=4), "1f1b", 4)
        c.pipeline.fsdp_gather_once = once
        _, compiled = compile_step(c)
        ops[once] = metrics.collective_ops(compiled.as_text())
        total[once] = sum(o.wire_bytes for o in ops[once])
    per_tick = [o for o in ops[True] if o.kind in ("all-gather", "all-reduce") and o.count > 1]
    assert not per_tick, per_tick
    assert any(o.kind == "all-reduce" and o.count > 1 for o in ops[False])  # the test can fail
    assert total[True] <= 0.3 * total[False], total


def test_pipeline_data_fsdp_tensor_mixed_precision():
    """bfloat16 compute: the same loss and gradients as float32, to bfloat16's precision."""
    ref_loss, ref_grads, _, _ = _reference(4)
    c = _config(4, dict(pipeline=2, fsdp=2, tensor=2), "1f1b", m=4, compute_dtype="bfloat16")
    loss, grads, _ = _pipelined_gradients(c)
    assert abs(loss - ref_loss) < 2e-2 * ref_loss
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert g.dtype == np.float32
        assert np.linalg.norm(g - r) <= 5e-2 * np.linalg.norm(r) + 1e-6


def test_train_steps_match_single_device():
    """The engine's own compiled step: per-step losses and gradient norms, and the parameters after
    three steps (1f1b on pipeline=2 × data=2 × tensor=2)."""
    ref = _config(4, dict(data=1))
    ref_losses, ref_norms, ref_params = _run_steps(ref, 3)
    c = _config(4, dict(pipeline=2, data=2, tensor=2), "1f1b", 4)
    losses, norms, params = _run_steps(c, 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(ref_params)
    ):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=jax.tree_util.keystr(path))


def _run_steps(c, steps: int):
    eng, batches = engine_for(c)
    state, losses, norms = initial_state(eng, c), [], []
    for i in range(steps):
        state, m = eng.train_step(state, batches.get(i))
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    return np.array(losses), np.array(norms), jax.device_get(eng.to_user(state)["params"])


@pytest.mark.parametrize(
    "p, m, v", [(2, 1, 1), (2, 2, 1), (2, 8, 1), (3, 5, 1), (4, 4, 1), (4, 16, 1), (8, 8, 1),
                (2, 4, 2), (4, 8, 2), (4, 4, 4), (2, 6, 3)],
)  # fmt: skip
def test_bubble_fraction_matches_formula(p, m, v):
    """gpipe and interleaved: the textbook bubble. 1f1b (fused ticks, `one_f_one_b_table`): never
    below gpipe's in lock-step, at most 1.25× gpipe's lock-step time, at most p + 1 microbatches
    in flight. Every stage runs every (microbatch, chunk) forward and backward exactly once."""
    for name in ("gpipe", "1f1b", "interleaved", "zb"):  # (every schedule: test_schedule_table)
        if name == "interleaved" and m % p or name == "zb":  # zb: test_zb_table
            continue
        sched = pipeline.build_schedule(name, p, m, v)
        v_eff = v if name == "interleaved" else 1
        formula = (p - 1) / (v_eff * m + p - 1)
        if name == "1f1b":
            assert sched.bubble_fraction >= formula - 1e-12
            assert sched.lockstep_units() <= 1.25 * 3 * (m + p - 1)
        else:
            assert sched.bubble_fraction == pytest.approx(formula, abs=1e-12)
        for s in range(p):
            cells = [c for t in range(sched.ticks) for c in sched.cells(t, s)]
            for act in (pipeline.FWD, pipeline.BWD):
                pairs = sorted((i, c) for a, i, c in cells if a == act)
                assert pairs == sorted((i, c) for i in range(m) for c in range(v_eff))
        if name == "1f1b":
            assert sched.max_in_flight() <= p + pipeline.ONE_F_ONE_B_EXTRA_IN_FLIGHT
            pipeline.exec_tables(sched)  # no stash slot is overwritten while live


@pytest.mark.parametrize("p, m, v", [(2, 1, 1), (2, 4, 2), (3, 5, 1), (4, 4, 1), (4, 8, 2)])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedule_table(schedule, p, m, v):
    """Every registered schedule's table, at the sizes its config rules accept: each stage runs
    every (microbatch, chunk) forward and backward (and a split backward's weight pass) once,
    forwards go up the chunks and backwards down in order; an explicit backward gets its
    executor's slots (none overwritten while live) and a cost for every switch branch it takes;
    the planner's `tick_cost` is the table's."""
    spec = pipeline.schedule_spec(schedule)
    try:
        spec.check(p, m, v)
    except ConfigError:
        pytest.skip(f"{schedule} refuses p={p}, m={m}, v={v}")
    sched = spec.build(p, m, v)
    v_eff = v if spec.virtual else 1
    assert (sched.name, sched.stages, sched.microbatches) == (schedule, p, m)
    assert sched.virtual_stages == v_eff
    F, B, W = pipeline.FWD, pipeline.BWD, pipeline.WGT
    when = {}
    for t in range(sched.ticks):
        for s in range(p):
            for a, i, c in sched.cells(t, s):
                assert (a, s, i, c) not in when, (a, s, i, c)
                when[a, s, i, c] = t
    acts = (F, B, W) if spec.split_backward else (F, B)
    assert set(when) == {(a, s, i, c) for a in acts for s in range(p) for i in range(m)
                         for c in range(v_eff)}  # fmt: skip
    for i in range(m):
        for g in range(p * v_eff):  # chunk g runs on stage g mod p, lap g // p
            s, c = g % p, g // p
            assert when[B, s, i, c] >= when[F, s, i, c]
            if g:
                prev = ((g - 1) % p, i, (g - 1) // p)
                assert when[(F, s, i, c)] > when[(F, *prev)]
                assert when[(B, s, i, c)] < when[(B, *prev)]
            if spec.split_backward:
                assert when[W, s, i, c] > when[B, s, i, c]
    tick = spec.tick_cost(p, m, v)
    assert (tick.ticks, tick.bubble_fraction) == (sched.ticks, sched.bubble_fraction)
    assert 0 <= tick.bubble_fraction < 1
    assert tick.switch_per_tick == (pipeline.executed_actions(sched) is not None)
    if tick.switch_per_tick:
        tables = pipeline.exec_tables(sched)  # raises if a slot is overwritten while live
        costs = spec.branch_costs(1.0, 2.0, 1.0, 1.0, 0.1)
        assert int(tables["action"].max()) < len(costs), (tables["action"].max(), costs)
        assert tick.slots == (tables["slots"]["x"], tables["slots"]["g"], max(
            tables["slots"][k] for k in spec.residual_stashes))  # fmt: skip


def test_1f1b_dependencies_respected():
    """Forwards go up and backwards down one tick apart at least; the last stage runs a
    microbatch's forward and backward in one tick, in that order."""
    sched = pipeline.build_schedule("1f1b", 4, 8)
    when = {}
    for t in range(sched.ticks):
        for s in range(4):
            for a, i, _ in sched.cells(t, s):
                when[(a, s, i)] = t
    F, B = pipeline.FWD, pipeline.BWD
    for i in range(8):
        for s in range(1, 4):
            assert when[(F, s, i)] > when[(F, s - 1, i)]
        assert when[(B, 3, i)] == when[(F, 3, i)]
        assert sched.cells(when[(F, 3, i)], 3) == [(F, i, 0), (B, i, 0)]
        for s in range(3):
            assert when[(B, s, i)] > when[(B, s + 1, i)]
    # Lock-step: fused ticks bring 1f1b's time from 40 units (F and B on separate ticks) to 36,
    # gpipe's 33.
    assert (
        sched.lockstep_units() == 36
        and pipeline.build_schedule("gpipe", 4, 8).lockstep_units() == 33
    )


@pytest.mark.parametrize("p, m", [(2, 1), (2, 4), (3, 5), (4, 4), (4, 8), (4, 32), (8, 8)])
def test_zb_table(p, m):
    """zb: every stage runs each microbatch's F, B and W once, in dependency order; no more than
    p microbatches between F and W on any stage (1F1B's stage 0 holds p; one SPMD program sizes
    its buffers for the fullest stage); a smaller lock-step idle share than 1F1B; the executor's
    slots never overwrite a live one."""
    sched = pipeline.build_schedule("zb", p, m)
    F, B, W = pipeline.FWD, pipeline.BWD, pipeline.WGT
    when = {}
    for t in range(sched.ticks):
        for s in range(p):
            a = int(sched.action[t, s])
            if a != pipeline.IDLE:
                key = (a, s, int(sched.micro[t, s]))
                assert key not in when, key
                when[key] = t
    assert len(when) == 3 * p * m
    for i in range(m):
        for s in range(p):
            assert when[(W, s, i)] > when[(B, s, i)] > when[(F, s, i)]
            if s:
                assert when[(F, s, i)] > when[(F, s - 1, i)]
            if s < p - 1:
                assert when[(B, s, i)] > when[(B, s + 1, i)]
    for s in range(p):
        for t in range(sched.ticks):
            live = [i for i in range(m) if when[(F, s, i)] <= t < when[(W, s, i)]]
            assert len(live) <= p + pipeline.ZB_EXTRA_IN_FLIGHT
    if p > 1 and m > 1:  # less idle time than 1F1B's (every zb tick costs one unit)
        assert sched.bubble_fraction < pipeline.build_schedule("1f1b", p, m).bubble_fraction
    pipeline.exec_tables(sched)


def test_zb_table_with_the_measured_branch_costs():
    """zb's W ticks pay off in lock-step: with the branch costs the benchmark's compiled step
    measures (docs/PIPELINE.md, `branch_flops` in units of F = 117.4 M: B 134.2 M, W 100.7 M, the
    head 8.4 M forward), its table costs at most 0.91× gpipe's at p = 4, m = 8 (the greedy table
    alone: 0.94×) and 0.85× at m = 4 (gpipe: its ticks, plus the head it runs outside them on 1/p
    of the batch)."""
    F, B, W, head = 117.4, 134.2, 100.7, 8.4
    for m, bound in ((8, 0.91), (4, 0.85)):
        gpipe, _ = pipeline.branch_lockstep(
            pipeline.build_schedule("gpipe", 4, m), F, B + W, B, W, head
        )
        gpipe += 3 * head * m / 4
        zb, _ = pipeline.branch_lockstep(pipeline.build_schedule("zb", 4, m), F, B + W, B, W, head)
        assert zb <= bound * gpipe, (m, zb / gpipe)


def _temp_bytes(schedule: str, p: int, m: int, per_microbatch: int = 2) -> int:
    """Temp bytes per device of the compiled pipelined gradient computation."""
    c = _config(4, dict(pipeline=p), schedule, m)
    c.train.batch_size = m * per_microbatch  # fixed microbatch size: the batch grows with m
    eng, batches = engine_for(c)
    fn, _ = pipeline.make_gradients(c, eng.mesh, eng.stages, eng.param_axes, eng.batch_axes)
    shapes = batches.global_shapes()
    batch = eng.abstract_batch(shapes, {k: np.int32 for k in shapes})
    params = eng.abstract_state["params"]
    return jax.jit(fn).lower(params, batch).compile().memory_analysis().temp_size_in_bytes


def test_1f1b_memory_flat_in_microbatches_gpipe_grows():
    p = 2
    mem = {(s, m): _temp_bytes(s, p, m) for s in ("1f1b", "gpipe") for m in (p, 4 * p)}
    assert mem["1f1b", 4 * p] <= 1.25 * mem["1f1b", p], mem
    assert mem["gpipe", 4 * p] >= 1.5 * mem["gpipe", p], mem
    assert mem["1f1b", 4 * p] < mem["gpipe", 4 * p], mem


def test_data_parallel_gradients_reduced_once_and_bubble_reported():
    """`data` is manual in the pipeline: stage gradients cross the data axis once, not per tick.
    The layout record reports the bubble of the schedule the step runs."""
    c = _config(4, dict(pipeline=2, data=4), "1f1b", m=4)
    eng, compiled = compile_step(c)
    ops = metrics.collective_ops(compiled.as_text())
    data_reduces = [o for o in ops if o.kind == "all-reduce" and o.group_size == 4]
    assert data_reduces and all(o.count == 1 for o in data_reduces), data_reduces
    permutes = [o for o in ops if o.kind == "collective-permute" and o.count > 1]
    ticks = pipeline.build_schedule("1f1b", 2, 4).ticks
    # Per tick: an activation up and a gradient down, and the conveyors moving stage 0's next
    # inputs one stage down and its input gradients one stage up: fixed pairs, on every tick,
    # never in a branch (a switch over sends to different stages went wrong when loaded from
    # the persistent compilation cache).
    assert not [o for o in permutes if o.conditional], permutes
    assert len(permutes) == 4 and all(o.count == ticks for o in permutes), permutes
    record = loop.layout_record(eng, compiled, c)
    assert record["bubble_fraction"] == pytest.approx(1 / 5) == eng.schedule.bubble_fraction
    assert record["pipeline"]["schedule"] == "1f1b"


@pytest.mark.parametrize(
    "mesh, fields, match",
    [
        (dict(pipeline=2), dict(num_layers=3), "model.num_layers=3 must be divisible"),
        (dict(pipeline=2), dict(schedule="interleaved", virtual_stages=2, num_layers=6),
         "model.num_layers=6 must be divisible by mesh.pipeline×pipeline.virtual_stages = 2×2"),
        (dict(pipeline=2, data=2), dict(microbatches=3), "pipeline.microbatches=3 must divide"),
        (dict(pipeline=4), dict(schedule="interleaved", virtual_stages=2, microbatches=2,
                                num_layers=8), "must be a multiple of mesh.pipeline=4"),
        (dict(pipeline=2), dict(schedule="zigzag"), "pipeline.schedule='zigzag' is not valid"),
    ],
)  # fmt: skip
def test_errors_are_one_line_config_errors(mesh, fields, match):
    c = tiny_gpt_config(**mesh)
    for k, v in fields.items():
        (c.model if k == "num_layers" else c.pipeline)[k] = v
    n = int(np.prod(list(mesh.values())))
    for check in (
        lambda: config_lib.validate(c, n),
        lambda: pipeline.check(c, config_lib.resolve_mesh_shape(c.mesh, n)),
    ):
        with pytest.raises(ConfigError, match=match) as e:
            check()
        assert "\n" not in str(e.value)
    # train.build raises the same before compiling anything, even without validate().
    from jaxdist import mesh as mesh_lib
    from tests.helpers import dataset

    m = mesh_lib.make_mesh(c.mesh, devices=jax.devices()[:n])
    with pytest.raises(ConfigError) as e:  # 3 layers over 2 stages: caught by the storage split
        train.build(c, m, dataset(c))
    assert "\n" not in str(e.value)


@pytest.fixture
def fresh_persistent_cache(tmp_path):
    """The session's persistent compilation cache swapped for an empty folder, every program
    written to it (no minimum compile time); the session's cache back afterwards."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    saved = (
        jax.config.jax_compilation_cache_dir,
        jax.config.jax_persistent_cache_min_compile_time_secs,
    )
    cc.set_cache_dir(str(tmp_path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    cc.reset_cache()
    events = []
    listener = lambda name, **kw: events.append(name.rsplit("/", 1)[-1])
    jax.monitoring.register_event_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_listener(listener)
        cc.set_cache_dir(saved[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])
        cc.reset_cache()


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_step_loaded_from_persistent_cache_is_bit_identical(schedule, fresh_persistent_cache):
    """The pipelined gradients compiled fresh and loaded back from the persistent compilation
    cache give bit-identical loss and gradients (with stage 0's inputs sent by a `lax.switch`
    whose branches permuted over different pairs, the loaded program aborted the process)."""
    c = _config(4, dict(pipeline=2), schedule, 8)
    eng, batches = engine_for(c)
    _, _, host_params, _ = _reference(c.model.num_layers)
    params = jax.device_put(host_params, eng.state_shardings["params"])
    fn, _ = pipeline.make_gradients(c, eng.mesh, eng.stages, eng.param_axes, eng.batch_axes)
    batch, events = batches.get(0), fresh_persistent_cache
    runs = []
    for want in ("cache_misses", "cache_hits"):  # compiled and written, then loaded
        jax.clear_caches()
        events.clear()
        loss, _, grads = jax.jit(fn).lower(params, batch).compile()(params, batch)
        assert want in events, events
        runs.append(jax.device_get((loss, grads)))
    (loss0, grads0), (loss1, grads1) = runs
    assert loss0 == loss1, (loss0, loss1)
    for g0, g1 in zip(jax.tree.leaves(grads0), jax.tree.leaves(grads1), strict=True):
        np.testing.assert_array_equal(g0, g1)
