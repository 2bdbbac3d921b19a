"""Pipeline parallelism for any model with `Stages`: stages over the `pipeline` mesh axis.

The pipeline knows a model only through its `models.api.Stages`: an embedding (inputs →
activations), stacked layers applied by a pure `block(layer_params, x)`, and a head with its loss;
it never imports a model family or reads a parameter name. The stacked layer parameters (leading
`layers` axis, stored split over `pipeline` by the logical-axis table) are cut into `p · v` chunks
of `L / (p · v)` layers; chunk `j` runs on device `j mod p` (`v = pipeline.virtual_stages` for a
schedule with virtual stages, 1 otherwise). Activations move between neighbouring stages with
`jax.lax.ppermute` inside one `jax.shard_map` that is manual over `pipeline` (and `data` when it
is > 1, so each replica accumulates its own gradients over the microbatches and they are
all-reduced once per step, not once per tick; `context` and `expert` when > 1, so attention and
MoE layers run their per-device bodies, models/attention.py and models/moe.py); `fsdp` and
`tensor` stay automatic inside the stage body, so the same `block` code runs with its FSDP and
Megatron shardings. A block may also return statistics (`Stages.aux_zero`, the MoE router's): the
executors sum them over layers and microbatches and add their `Stages.aux_loss` term to the loss.
A packed batch (`data.packing=documents`) brings each microbatch's segment ids and positions to
the stage that runs it (the blocks' `segments=`; 1f1b and zb stash what is computed from them per
microbatch); its head sums the cross-entropy over the targets >= 0 (`Stages.head_logits`) and
scales it by 1 / the batch's target count, so the loss is the batch's masked mean.

Every schedule is a `ScheduleSpec` in `SCHEDULES` (`spec.py`, the one registry of
`pipeline.schedule` names) whose table is built in numpy before tracing: for each tick and stage,
which microbatch (and virtual stage) it works on, or nothing. The executors read the table row of
their stage at every tick, and `Schedule.bubble_fraction` counts the idle entries of the same
tables.

* `gpipe`: all forwards, then all backwards; the backward is JAX's autodiff of the scanned forward
  ticks, so a stage keeps the activations of every microbatch (remat at the stage boundary with
  `train.remat` keeps only each tick's stage input). Bubble (p-1)/(m+p-1).
* `1f1b`: PipeDream-Flush for a lock-step program. Each tick is a `lax.switch` branch per stage,
  so all stages run one SPMD program while doing different work; in the steady state a tick runs
  one backward and one forward (a tick lasts as long as its busiest stage, so separate F and B
  ticks would cost two backward-long ticks per microbatch). A forward runs the stage under
  `jax.vjp` and stashes the residuals (what `train.remat` lets a layer keep) of at most p + 1
  microbatches; the backward applies the stashed vjp, so it recomputes nothing and activation
  memory does not grow with `m`. The last stage runs forward, head, loss and backward of a
  microbatch in one tick. Lock-step cost 3(m + p - 1) units at best (gpipe's).
* `interleaved`: the looped (circular) schedule over `v` chunks per device: microbatches enter in
  groups of `p`, each loops `v` times around the ring. Backward by autodiff as for gpipe. Bubble
  (p-1)/(v·m+p-1); needs `m` to be a multiple of `p`. Its stacked layers are stored in looped order
  (`layer_order`), so no layer crosses devices per step; checkpoints keep the [L] order.
* `zb`: ZB-H1 (Qi et al. 2023): 1F1B's executor with the backward cut into the input-gradient
  pass B and the weight-gradient pass W (`SplitVjp`), the W passes deferred into what would be
  bubble ticks and run by all stages together (W ticks), at most p microbatches between a
  stage's F and W.

The embedding (all schedules) and, for the autodiff schedules, the head and loss stay outside the
stage loop: they are computed SPMD over the whole batch, with the batch additionally split over
the `pipeline` axis when it divides, so every device does 1/(data·fsdp·pipeline) of them and no
stage carries extra work. The price is moving the activations ([B, T, D]) into the pipeline once
and out once per step. The explicit-backward schedules (1f1b, zb) compute head and loss inside the
schedule on the last stage instead: the backward must start as soon as a microbatch leaves, and
collecting all `m` outputs first would bring back the memory that grows with `m`. They keep the
embedded batch in blocks of m/p microbatches over the stages (when p divides m); two conveyors of
fixed-pair permutes, run on every tick, bring each to stage 0 as it is needed and its gradient
back (`feed_tables`).

The table bubble counts idle entries as if every tick cost the same; `cost` reads what the compiled
step executes instead: the lock-step FLOPs (per tick, the slowest stage's branch) against the ideal.
Evaluation (`make_loss`) runs the looped forward ticks, so no device gathers the layer stack.

The modules, one job each: `schedules` (tables in numpy), `zb_search` (zb's searched table),
`spec` (the registry: abilities, config checks, planner cost), `tick_tables` (what the explicit
executor indexes per tick), `spmd` and `vjp` (helpers of the traced program), `executors` (the
per-stage tick loops), `gradients` (the shard_map and the train step's gradient function),
`layout` (the stored layer order), `cost` (the lock-step cost from the compiled HLO). Everything
users call is re-exported here.
"""

from jaxdist.pipeline.cost import (
    LockStep,
    branch_counts,
    branch_lockstep,
    cost,
    executed_actions,
    lockstep_flops,
    step_cost,
    useful_flops,
)
from jaxdist.pipeline.executors import looped_forward, one_f_one_b, tick_loop, zero_bubble
from jaxdist.pipeline.gradients import make_gradients, make_loss
from jaxdist.pipeline.layout import layer_order, reorder_layers
from jaxdist.pipeline.schedules import (
    AXIS,
    BWD,
    FWD,
    FWD_BWD,
    IDLE,
    ONE_F_ONE_B_EXTRA_IN_FLIGHT,
    WGT,
    Schedule,
    looped_forward_table,
    one_f_one_b_table,
)
from jaxdist.pipeline.spec import (
    SCHEDULES,
    ScheduleSpec,
    TickCost,
    bubble_fraction,
    build_schedule,
    check,
    schedule_for,
    schedule_spec,
)
from jaxdist.pipeline.tick_tables import exec_tables, feed_tables
from jaxdist.pipeline.vjp import SplitVjp, StashedVjp
from jaxdist.pipeline.zb_search import ZB_EXTRA_IN_FLIGHT, ZB_TICK_COSTS, zero_bubble_table

__all__ = [
    "AXIS",
    "BWD",
    "FWD",
    "FWD_BWD",
    "IDLE",
    "ONE_F_ONE_B_EXTRA_IN_FLIGHT",
    "SCHEDULES",
    "WGT",
    "ZB_EXTRA_IN_FLIGHT",
    "ZB_TICK_COSTS",
    "LockStep",
    "Schedule",
    "ScheduleSpec",
    "SplitVjp",
    "StashedVjp",
    "TickCost",
    "branch_counts",
    "branch_lockstep",
    "bubble_fraction",
    "build_schedule",
    "check",
    "cost",
    "exec_tables",
    "executed_actions",
    "feed_tables",
    "layer_order",
    "lockstep_flops",
    "looped_forward",
    "looped_forward_table",
    "make_gradients",
    "make_loss",
    "one_f_one_b",
    "one_f_one_b_table",
    "reorder_layers",
    "schedule_for",
    "schedule_spec",
    "step_cost",
    "tick_loop",
    "useful_flops",
    "zero_bubble",
    "zero_bubble_table",
]
