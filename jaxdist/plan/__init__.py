"""Cost model and mesh planner: per-device memory and step time of every layout, for any modelled family.

`predict(config, layout, hardware)` says what one layout costs; `plan(config, num_devices,
hardware)` enumerates every valid (data, fsdp, tensor, pipeline, expert, context) × grad_accum /
pipeline microbatches × remat for a device count, predicts each, marks the ones that do not fit,
ranks them and recommends one; `scaling(...)` does that from 8 to 4096 devices for a
scaling-efficiency plot.

Nothing here re-states the sharding or the model: parameter and optimizer-state shapes come from
`jax.eval_shape` of the real model and optimizer (`jaxdist.optim`), their per-device shards from
`jaxdist.sharding.logical_to_spec` with the same STORAGE_RULES / COMPUTE_RULES the engine compiles
with (on an `AbstractMesh`, so 4096 devices need no devices), and layout validity from
`jaxdist.config.validate` on a copy of the config. What a layer keeps for its backward and what it
sends over the tensor axis is the model family's own declaration (`models.api.PlanCost`), priced per
remat policy by `models.api.RematPolicy`. The collectives are the ones XLA emits (read off the
compiled HLO of small layouts; docs/PLANNER.md gives each term).

The package, one job per module:

* `hardware`: cluster profiles (`Hardware`, `PROFILES`, `hardware`).
* `model`: the model's leaves and declared accounting (`ModelInfo`, `model_info`).
* `layouts`: `Layout` and every layout a config allows (`enumerate_layouts`).
* `terms`: the step's collective terms (tensor, FSDP, gradient sync, pipeline, context, expert).
* `predict`: memory, compute and step time of one layout (`Prediction`, `predict`).
* `search`: ranking and recommending (`Plan`, `plan`, `scaling`).
* `plot`: the scaling plot; `guard`: the memory refusal and prediction the loop is handed;
  `algorithms`: the gradient all-reduce algorithms' α-β costs.
"""

from __future__ import annotations

from jaxdist.plan.algorithms import (
    AlgorithmCost,
    algorithm_cost,
    algorithm_table,
    recommend_algorithm,
)
from jaxdist.plan.guard import (
    REFUSE_FACTOR,
    device_memory_bytes,
    layout_prediction,
    refuse_if_far_over_memory,
)
from jaxdist.plan.hardware import PROFILES, GiB, Hardware, emulated_link, hardware
from jaxdist.plan.layouts import Layout, enumerate_layouts, factorizations, layout_of
from jaxdist.plan.model import Leaf, ModelInfo, model_info
from jaxdist.plan.plot import plot_scaling
from jaxdist.plan.predict import Prediction, predict
from jaxdist.plan.search import SCALING_DEVICES, Plan, config_flags_for, plan, scaling
from jaxdist.plan.terms import CommTerm, context_expert_terms

# Names tests and docs used before the package split.
_context_expert_terms = context_expert_terms
_factorizations = factorizations

__all__ = [
    "PROFILES",
    "REFUSE_FACTOR",
    "SCALING_DEVICES",
    "AlgorithmCost",
    "CommTerm",
    "GiB",
    "Hardware",
    "Layout",
    "Leaf",
    "ModelInfo",
    "Plan",
    "Prediction",
    "algorithm_cost",
    "algorithm_table",
    "config_flags_for",
    "context_expert_terms",
    "device_memory_bytes",
    "enumerate_layouts",
    "factorizations",
    "hardware",
    "emulated_link",
    "layout_of",
    "layout_prediction",
    "model_info",
    "plan",
    "plot_scaling",
    "predict",
    "recommend_algorithm",
    "refuse_if_far_over_memory",
    "scaling",
]
