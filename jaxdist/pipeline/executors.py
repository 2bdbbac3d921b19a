"""The per-stage tick loops, run inside the stages' shard_map: the looped forward, 1f1b and zb.

Each function here runs on one stage (manual over `pipeline`, and `data` / `fsdp` / `context` /
`expert` when the caller makes them manual) and returns that stage's loss and gradients, not yet
summed over the manual axes; `gradients.py` builds the shard_map around them. The looped forward
(gpipe, interleaved) is differentiated by autodiff; 1f1b and zb interleave explicit
per-microbatch backwards, one `aligned_switch.switch` branch per action, reading the numpy tables
of `tick_tables.exec_tables`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxdist import aligned_switch, microbatch
from jaxdist.pipeline.schedules import AXIS
from jaxdist.pipeline.spmd import put, take, varying
from jaxdist.pipeline.vjp import SplitVjp, StashedVjp


def looped_forward(stage_fn, chunks, x0, *, p: int, v: int, valid, micro, virtual, segments=None):
    """Forward ticks of gpipe / interleaved on one stage; returns [m, ...] final activations.

    Args:
      stage_fn: (chunks [v, Lc, ...], virtual stage, x [b, T, D], segments) -> (y, the blocks'
        statistics) (`looped_stage_fn`).
      chunks: this device's chunks, every leaf [v, Lc, ...] (float32: cast per tick, so autodiff
        accumulates their gradients over the ticks in float32).
      x0: [m, b, T, D] embedded microbatches (the same on every stage; stage 0 reads them).
      valid, micro, virtual: the [ticks, p] forward tables (`Schedule.forward_ticks`).
      segments: None, or packed microbatches' (segment_ids, positions) [m, b, T] (the same on
        every stage): each tick hands its microbatch's to `stage_fn`.
    Returns:
      ([m, b, T, D]: on the last stage the outputs of the last layer chunk, zeros elsewhere;
      this device's statistics summed over its layers and microbatches).
    """
    d = jax.lax.axis_index(AXIS)
    ring = [(s, (s + 1) % p) for s in range(p)]
    dtype = x0.dtype
    chunks = jax.tree.map(varying, chunks)  # gradients summed over `data` once, after the loop
    # x0's gradient is summed over the stages once, after the loop, in float32 (XLA:CPU's
    # all-reduce promotion aborts on this bfloat16 psum).
    x0 = varying(x0.astype(jnp.float32))
    zero = varying(jnp.zeros(x0.shape[1:], dtype))
    outs = varying(jnp.zeros(x0.shape, dtype))
    # The statistics' zeros, shaped like a stage call's (traced for its shapes only).
    seg_of = lambda i: None if segments is None else jax.tree.map(lambda a: take(a, i), segments)
    shapes = jax.eval_shape(lambda: stage_fn(chunks, 0, zero, seg_of(0))[1])
    stats = jax.tree.map(lambda a: varying(jnp.zeros(a.shape, a.dtype)), shapes)

    def tick(carry, row):
        recv, outs, stats = carry
        ok, i, s = row[0][d], row[1][d], row[2][d]
        x = jnp.where((d == 0) & (s == 0), take(x0, i).astype(dtype), recv)  # [b, T, D]
        y, new = stage_fn(chunks, s, x, seg_of(i))
        outs = put(outs, i, y, ok & (d == p - 1) & (s == v - 1))
        stats = jax.tree.map(lambda a, b: a + jnp.where(ok, b, 0), stats, new)
        return (jax.lax.ppermute(y, AXIS, ring), outs, stats), None

    rows = (jnp.asarray(valid), jnp.asarray(micro), jnp.asarray(virtual))
    (_, outs, stats), _ = jax.lax.scan(tick, (zero, outs, stats), rows)
    return outs, stats


def _accumulate(acc: Any, grads: Any) -> Any:
    """acc + grads in float32; `grads` is a tree like `acc` or a list of its leaves with None
    where nothing was computed (zb's split backward)."""
    flat, tree = jax.tree.flatten(acc)
    new = grads if isinstance(grads, list) else jax.tree.leaves(grads)
    out = [a if g is None else a + g.astype(jnp.float32) for a, g in zip(flat, new, strict=True)]
    return jax.tree.unflatten(tree, out)


def _convey(buf: jax.Array, recv: jax.Array, value: jax.Array, step: int) -> jax.Array:
    """One conveyor step (`feed_tables`): every stage sends `value` to stage + `step` with one
    collective-permute of fixed pairs, run on every tick by every stage (never in a branch: a
    `lax.switch` whose branches permute over different pairs computed wrong values when XLA:CPU
    loaded the program from the persistent compilation cache); buf[recv] = the arrival where
    `recv` >= 0, the other arrivals (nothing was sent for them) dropped."""
    p = jax.lax.axis_size(AXIS)
    pairs = [(k, k + step) for k in range(p) if 0 <= k + step < p]
    got = jax.lax.ppermute(value, AXIS, pairs)
    return put(buf, jnp.maximum(recv, 0), got, recv >= 0)


def tick_loop(branches, tables, x0, targets, stash, acc):
    """The ticks of an explicit-backward schedule (1f1b, zb) on one stage.

    Every tick each stage takes its `lax.switch` branch from its row of `tables`, given the
    activation it forwards (stage 0: from the embedded input), the gradient it backwards, the
    targets of its forward's microbatch and the stashed residuals the tick reads; then two
    `ppermute`s carry activations up and gradients down, and arrivals go into their slots.

    Args:
      branches: per branch, (x, dy, targets, reads, acc) -> (y, dx, writes, acc); `reads` and
        `writes`: stash name -> one microbatch's residual leaves.
      tables: the executor tables (`tick_tables.exec_tables`) as [ticks, p] arrays.
      x0: the embedded microbatches: [m, b, T, D] on every stage, or, when `tables` has
        `feed_read`, this stage's block [m/p, b, T, D] of them (microbatch i on stage i // (m/p)),
        each carried down to stage 0 by the time it forwards it (`feed_tables`: fixed-pair
        permutes on every tick, no all-gather).
      targets: [m, b, T], or a tree of such arrays (packed batches: with their segments); each
        branch gets its forward's microbatch of every leaf.
      stash: stash name -> residual buffers [slots, ...]; acc: the accumulated (chunk gradients,
        head gradients, loss).
    Returns:
      (d loss / d x0, shaped like x0: with `feed_read` each block on its owner, carried up
      from stage 0; else [m, ...] nonzero on stage 0 only; acc).
    """
    p, ticks = tables["action"].shape[1], tables["action"].shape[0]
    d = jax.lax.axis_index(AXIS)
    first = d == 0
    fwd_pairs = [(s, s + 1) for s in range(p - 1)]
    bwd_pairs = [(s + 1, s) for s in range(p - 1)]
    shape, act_dtype = x0.shape[1:], x0.dtype
    zeros = lambda *lead: varying(jnp.zeros((*lead, *shape), act_dtype))
    slots = tables["slots"]
    blocks = "feed_read" in tables  # x0 / d x0 held in blocks over the stages
    at = lambda k: jnp.maximum(k, 0)
    # With blocks, one buffer holds this stage's block of x0, the conveyors' two transit slots and,
    # as they come back, the block's input gradients, each in the slot its input left
    # (`feed_tables`). d x0 goes up the conveyor: stage 0 sends the fresh gradient, the others
    # their gradient transit slot.
    per, up = x0.shape[0], x0.shape[0] + 1  # the activations' and the gradients' transit slots
    dx_up = lambda feed, r, dx: _convey(feed, r["dx_recv"], jnp.where(first, dx, feed[up]), 1)

    def tick(carry, row):
        xin, gbuf, stash, feed, dx0, acc = carry
        r = {k: v[d] for k, v in row.items()}
        if blocks:  # feed: x0's block and the transit slot
            x_first = take(feed, at(r["feed_read"]))
        else:
            x_first = take(x0, r["mf"])
        x = jnp.where(first, x_first, take(xin, r["x"]))
        dy, tgt = take(gbuf, r["g"]), jax.tree.map(lambda a: take(a, r["mf"]), targets)
        # A stash without tables in `r` holds one value (invariant residuals, `StashedVjp`): slot
        # 0, which every branch returns (the forward computes it, the others pass it on).
        reads = {k: [take(b, r.get("read_" + k, 0)) for b in bufs] for k, bufs in stash.items()}
        y, dx, writes, acc = aligned_switch.switch(r["action"], branches, x, dy, tgt, reads, acc)
        put_at = lambda b, v, k: put(b, at(k), v, k >= 0)
        keep = lambda b, v, k: put_at(b, v, r["write_" + k]) if "write_" + k in r else v[None]
        stash = {k: [keep(b, v, k) for b, v in zip(bufs, writes[k])] for k, bufs in stash.items()}
        if blocks:  # stage 0's next inputs one stage down, its input gradients one stage up
            down = take(feed, at(r["feed_send"]))
            feed = _convey(feed, r["feed_recv"], down, -1)
            feed = dx_up(put_at(feed, dx, r["dx_keep"]), r, dx)
        else:
            dx0 = put(dx0, r["mb"], dx, first & r["dx0"])
        # Every stage sends every tick (all must join a collective); receivers keep only arrivals.
        xin = put_at(xin, jax.lax.ppermute(y, AXIS, fwd_pairs), r["recv_f"])
        gbuf = put_at(gbuf, jax.lax.ppermute(dx, AXIS, bwd_pairs), r["recv_b"])
        return (xin, gbuf, stash, feed, dx0, acc), None

    rows = {k: jnp.asarray(v[:ticks]) for k, v in tables.items() if k != "slots"}
    feed, dx0 = None, zeros(x0.shape[0])
    if blocks:
        feed, dx0 = jnp.concatenate([x0, zeros(2)]), None
    carry = (zeros(slots["x"]), zeros(slots["g"]), stash, feed, dx0, acc)
    (*_, feed, dx0, acc), _ = jax.lax.scan(tick, carry, rows)
    if blocks and len(tables["dx_recv"]) > ticks:  # drain: the last gradients up to their owners
        step = lambda feed, row: (dx_up(feed, {"dx_recv": row[d]}, feed[up]), None)
        feed, _ = jax.lax.scan(step, feed, jnp.asarray(tables["dx_recv"][ticks:]))
    return (feed[:per] if blocks else dx0), acc


def _stage_inputs(chunk, head, x0, dtype):
    """Per-device copies of the stage weights and head in the compute dtype (differentiating with
    respect to them, no vjp inside a tick sums over the manual axes: a collective inside one
    stage's branch would deadlock the others; the sums come once, at the end), the float32
    accumulators, and a zero activation."""
    chunk, head = jax.tree.map(varying, microbatch.cast_floating((chunk, head), dtype))
    f32_zeros = lambda tree: jax.tree.map(lambda a: varying(jnp.zeros(a.shape, jnp.float32)), tree)
    acc = (f32_zeros(chunk), f32_zeros(head), varying(jnp.zeros((), jnp.float32)))
    zero = lambda: varying(jnp.zeros(x0.shape[1:], x0.dtype))
    return chunk, head, acc, zero


def _stage_args(chunk, segments, scale, head_scale):
    """(args(x, a microbatch's segments, chunk=chunk): a stage call's arguments, the segments
    only when the batch is packed (traced as an argument of the stashed vjp, so what is computed
    from them is stashed per microbatch); the segments, varying over the manual axes as the
    ticks' reads of them are (the stash layout traced on microbatch 0 is then the ticks'); their
    microbatch 0 (None when not packed); the head's scale: `head_scale`, default `scale`)."""

    def args(x, seg, ck=chunk):
        return (ck, x) if seg is None else (ck, x, seg)

    segments = jax.tree.map(varying, segments)
    seg0 = jax.tree.map(lambda a: take(a, 0), segments)
    return args, segments, seg0, scale if head_scale is None else head_scale


def _buffers(slots: int, leaves: list) -> list:
    """Zero stash buffers [slots, ...] shaped like one microbatch's residual `leaves`."""
    return [varying(jnp.zeros((slots, *a.shape), a.dtype)) for a in leaves]


def _statistics_terms(example, acc, scale, aux_term):
    """The blocks' statistics (MoE router statistics) in a tick loop's loss accumulator.

    Returns the accumulator with zeroed statistics beside the loss, d loss / d statistics (a
    constant: the aux term is linear in them), and `add(loss, stats)` that adds one microbatch's
    statistics and their aux term to the loss.
    """
    stats0 = jax.tree.map(lambda a: varying(jnp.zeros_like(a, jnp.float32)), example)
    d_stats = jax.tree.map(varying, jax.grad(lambda st: scale * aux_term(st))(stats0))

    def add(loss, stats):
        return loss[0] + scale * aux_term(stats), jax.tree.map(jnp.add, loss[1], stats)

    return (acc[0], acc[1], (acc[2], stats0)), d_stats, add


def _last_stage_tick(stage_fn, head_loss, chunk, head, args, hs, d_stats, add, zero, dx_dtype):
    """1f1b's last-stage tick (`F1B1_LAST`): forward, head, loss and backward of one microbatch
    in one vjp, so the last stage stashes nothing."""

    def last(x, dy, tgt, reads, acc):
        g_c, g_h, loss = acc

        def fn(ck, hp, x):
            y, stats = stage_fn(*args(x, tgt[1], ck))
            return head_loss(hp, y, tgt[0]), stats

        (mb_loss, stats), vjp = jax.vjp(fn, chunk, head, x)
        dc, dh, dx = vjp((varying(jnp.asarray(hs, jnp.float32)), d_stats))
        loss = add((loss[0] + mb_loss * hs, loss[1]), stats)
        acc = (_accumulate(g_c, dc), _accumulate(g_h, dh), loss)
        return zero(), dx.astype(dx_dtype), reads, acc

    return last


def one_f_one_b(
    stage_fn,
    head_loss,
    chunk,
    head,
    x0,
    targets,
    *,
    scale,
    dtype,
    tables,
    aux_term,
    segments=None,
    head_scale=None,
):
    """The 1f1b ticks on one stage: loss, gradients and the gradient of the stage-0 input.

    A forward runs the stage under `jax.vjp` and stashes its residuals (at most p + 1 microbatches
    in flight, `one_f_one_b_table`); a backward applies the stashed vjp to the arriving gradient,
    so it costs about two forwards and recomputes nothing (unless `train.remat` says so). A fused
    tick (`F1B1`) runs one backward and one forward. The last stage runs forward, head, loss and
    backward of a microbatch in one tick (`F1B1_LAST`), so it stashes nothing.

    Args:
      stage_fn: (layer params [Lc, ...] in the compute dtype, x [b, T, D]) -> (y, the blocks'
        statistics); their `aux_term` (linear) joins the loss, its gradient the backward.
      head_loss: (head params, y, targets [b, T]) -> mean cross-entropy of the microbatch.
      chunk: this stage's layer params, every leaf [Lc, ...], float32.
      head: the head's params (final norm, projection), float32, the same on every stage.
      x0: [m, b, T, D] embedded microbatches; targets: [m, b, T].
      scale: d loss / d (one microbatch's head_loss) = 1 / (m · data replicas).
      dtype: the compute dtype.
      tables: `tick_tables.exec_tables(schedule)`.
      segments: None, or packed microbatches' (segment_ids, positions) [m, b, T]: a forward
        hands its microbatch's to `stage_fn(chunk, x, segments)`, and residuals computed from
        them are stashed per microbatch like the activations.
      head_scale: d loss / d (one microbatch's head_loss), default `scale` (packed batches: 1 /
        the batch's target count, `head_loss` then summing over the microbatch's targets).
    Returns:
      (loss, chunk gradients, head gradients, d loss / d x0, statistics summed over microbatches),
      not yet summed over the manual axes: head gradients are nonzero on the last stage only,
      d x0 on stage 0 only; float32 gradients.
    """
    chunk, head, acc, zero = _stage_inputs(chunk, head, x0, dtype)
    leaves, stage_vjp = jax.tree.leaves, StashedVjp()
    args, segments, seg0, hs = _stage_args(chunk, segments, scale, head_scale)
    # The stash's shapes come from tracing one forward on zeros, which compiles to nothing.
    (_, stats0), r0, c0 = stage_vjp.forward(stage_fn, leaves(chunk), *args(zero(), seg0))
    stash = {"r": _buffers(tables["slots"]["r"], r0), "c": _buffers(1, c0)}
    acc, d_stats, add = _statistics_terms(stats0, acc, scale, aux_term)

    def idle(x, dy, tgt, reads, acc):
        return zero(), zero(), reads, acc

    def forward(x, dy, tgt, reads, acc):
        (y, stats), r, c = stage_vjp.forward(stage_fn, leaves(chunk), *args(x, tgt[1]))
        return y, zero(), {"r": r, "c": c}, (acc[0], acc[1], add(acc[2], stats))

    def backward(x, dy, tgt, reads, acc):
        g_c, g_h, loss = acc
        dc, dx, *_ = stage_vjp.backward(leaves(chunk) + reads["c"], reads["r"], (dy, d_stats))
        return zero(), dx.astype(x0.dtype), reads, (_accumulate(g_c, dc), g_h, loss)

    def fused(x, dy, tgt, reads, acc):
        _, dx, _, acc = backward(x, dy, tgt, reads, acc)
        y, _, writes, acc = forward(x, dy, tgt, reads, acc)
        return y, dx, writes, acc

    last = _last_stage_tick(
        stage_fn, head_loss, chunk, head, args, hs, d_stats, add, zero, x0.dtype
    )
    branches = (idle, forward, backward, fused, last)
    dx0, (g_c, g_h, (loss, stats)) = tick_loop(
        branches, tables, x0, (targets, segments), stash, acc
    )
    return loss, g_c, g_h, dx0, stats


def zero_bubble(
    stage_fn,
    head_loss,
    chunk,
    head,
    x0,
    targets,
    *,
    scale,
    dtype,
    tables,
    aux_term,
    segments=None,
    head_scale=None,
):
    """The zb ticks on one stage: the 1f1b executor with the backward cut in two (`SplitVjp`).

    A forward tick stashes the residuals of the stage's vjp in two stashes: those the input pass
    reads (`b`, freed at B) and those only the weight pass reads (`w`, kept until W). The B tick
    computes the input gradient (sent to the previous stage at once) and stashes what the weight
    gradient needs from the cotangent path (`r`); the W tick, which no other stage waits for,
    computes the weight gradient. The head and loss run on the last stage's F, their residuals
    (`h`) stashed for its B on the next tick. The blocks' statistics (MoE router statistics)
    join the loss at F; their constant cotangent joins B's, as in 1f1b. Args and returns: as
    `one_f_one_b`.
    """
    chunk, head, acc, zero = _stage_inputs(chunk, head, x0, dtype)
    leaves, stage_vjp, head_vjp = jax.tree.leaves, SplitVjp(), StashedVjp()
    head_fn = lambda hp, y, tgt: head_loss(hp, y, tgt)
    args, segments, seg0, hs = _stage_args(chunk, segments, scale, head_scale)
    out0, rb0, rw0, c0 = stage_vjp.forward(stage_fn, leaves(chunk), *args(zero(), seg0))
    _, _, rr0 = stage_vjp.backward_input(leaves(chunk) + c0, rb0, out0)
    _, rh0, hc0 = head_vjp.forward(head_fn, leaves(head), head, zero(), targets[0])
    n = {**tables["slots"], "c": 1, "hc": 1}
    stashes = dict(b=rb0, w=rw0, r=rr0, h=rh0, c=c0, hc=hc0)
    stash = {k: _buffers(n[k], r) for k, r in stashes.items()}
    acc, d_stats, add = _statistics_terms(out0[1], acc, scale, aux_term)

    def idle(x, dy, tgt, reads, acc):
        return zero(), zero(), reads, acc

    def forward(x, dy, tgt, reads, acc):
        (y, stats), rb, rw, c = stage_vjp.forward(stage_fn, leaves(chunk), *args(x, tgt[1]))
        writes = {**reads, "b": rb, "w": rw, "c": c}
        return y, zero(), writes, (acc[0], acc[1], add(acc[2], stats))

    def backward(x, dy, tgt, reads, acc):
        g_c, g_h, loss = acc
        fixed = leaves(chunk) + reads["c"]
        (dx, *_), dw, rr = stage_vjp.backward_input(fixed, reads["b"], (dy, d_stats))
        return zero(), dx.astype(x0.dtype), {**reads, "r": rr}, (_accumulate(g_c, dw), g_h, loss)

    def weight(x, dy, tgt, reads, acc):
        g_c, g_h, loss = acc
        dw = stage_vjp.backward_weight(leaves(chunk) + reads["c"], reads["w"], reads["r"])
        return zero(), zero(), reads, (_accumulate(g_c, dw), g_h, loss)

    def forward_last(x, dy, tgt, reads, acc):
        y, _, writes, (g_c, g_h, loss) = forward(x, dy, tgt, reads, acc)
        mb_loss, rh, hc = head_vjp.forward(head_fn, leaves(head), head, y, tgt[0])
        loss = (loss[0] + mb_loss * hs, loss[1])
        return zero(), zero(), {**writes, "h": rh, "hc": hc}, (g_c, g_h, loss)

    def backward_last(x, dy, tgt, reads, acc):
        g_c, g_h, loss = acc
        fixed = leaves(head) + reads["hc"]
        dh, dy, _ = head_vjp.backward(fixed, reads["h"], varying(jnp.asarray(hs, jnp.float32)))
        acc = (g_c, _accumulate(g_h, dh), loss)
        return backward(x, dy.astype(x0.dtype), tgt, reads, acc)

    branches = (idle, forward, backward, weight, forward_last, backward_last)
    tgt = (targets, segments)
    dx0, (g_c, g_h, (loss, stats)) = tick_loop(branches, tables, x0, tgt, stash, acc)
    return loss, g_c, g_h, dx0, stats


def looped_gradients(
    stage_fn,
    head_loss,
    aux_term,
    chunks,
    head,
    x0,
    targets,
    *,
    p: int,
    v: int,
    scale: float,
    valid,
    micro,
    virtual,
    segments=None,
    head_scale=None,
):
    """gpipe / interleaved with the backward inside the stages' shard_map (see `make_gradients`).

    The forward ticks of `looped_forward`, the head and mean loss on the last stage, and their
    autodiff (the ticks in reverse), all on one stage. Same contract as `one_f_one_b`: returns
    (loss, chunk gradients [v, Lc, ...], head gradients, d loss / d x0, statistics), per device
    and not yet summed over the manual axes; `chunks` is this device's [v, Lc, ...], float32.
    The loss is the mean over this replica's rows times `scale` (1 / the replicas the caller
    sums over), plus `aux_term` of this device's statistics averaged over the microbatches.
    `segments`, `head_scale`: as `one_f_one_b` (`head_scale` then multiplies the head's loss of
    all microbatches at once).
    """
    d = jax.lax.axis_index(AXIS)
    # Differentiate with respect to per-device copies: the sums over the stages come after.
    chunks, head = jax.tree.map(varying, (chunks, head))
    x0 = varying(x0.astype(jnp.float32))
    tgt = targets.reshape(-1, *targets.shape[2:])  # [m·b, T]: microbatch-major, as outs
    hs = scale if head_scale is None else head_scale

    def loss_fn(chunks, head, x0):
        outs, stats = looped_forward(
            stage_fn, chunks, x0, p=p, v=v, valid=valid, micro=micro, virtual=virtual,
            segments=segments,
        )  # fmt: skip
        y = outs.reshape(-1, *outs.shape[2:])  # [m·b, T, D]
        zero = lambda: varying(jnp.zeros((), jnp.float32))
        loss = jax.lax.cond(d == p - 1, lambda: hs * head_loss(head, y, tgt), zero)
        return loss + scale * aux_term(stats) / x0.shape[0], stats

    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1, 2), has_aux=True)
    (loss, stats), (g_c, g_h, dx0) = grad_fn(chunks, head, x0)
    return loss, g_c, g_h, dx0, stats
