"""Every model family through the planner's protocol (`models.api.PlanCost`).

The families are the registry's (`models.names()`) plus the test-only toy model (tests/toy_model.py,
residual MLP layers, no attention, nothing named like the GPT), so a family added to the registry
is picked up here. A family that declares its accounting is predicted, through the same code path
for all, within the tolerances `tests/test_plan.py::test_prediction_matches_compiled_step` holds
the GPT to, at T = 64 (the toy's activations then weigh as a real run's do); one that declares
none gets one line saying it is not modelled, from `model_info` and in the `layout` record.
"""

from __future__ import annotations

import types

import pytest

import models
from jaxdist import plan
from jaxdist.errors import ConfigError
from tests import toy_model
from tests.test_plan import LAYOUTS, _compiled_record, _config, assert_prediction_matches

FAMILIES = tuple(dict.fromkeys((*models.names(), toy_model.NAME)))
# tests/test_plan.LAYOUTS entries: replicated, FSDP, tensor parallel, remat full with accumulation,
# bf16 with remat dots, a 1F1B pipeline.
NAMES = (
    "data8",
    "fsdp8",
    "data4_tensor2",
    "fsdp8_accum2_remat_full",
    "d2f2t2_bf16_remat_dots",
    "data4_pipeline2_1f1b",
)


def _family(name: str):
    return toy_model.FAMILY if name == toy_model.NAME else models.get(name)


MODELLED = tuple(n for n in FAMILIES if _family(n).plan_cost is not None)
# The MoE families run with 8 experts, top-2, on the capacity path (`model.moe_capacity_factor`
# 1.25: dense [E, C, D] buffers on every backend), on the data and FSDP layouts. Not yet modelled
# for them: tensor parallelism (the experts' all-reduces: 20% more bytes than the dense MLP's on
# data4_tensor2), and the temp of accumulation, bf16 remat and pipeline layouts (10-20% off).
# Their dropless path is planned the same way, but on a CPU the compiled temp is about twice the
# prediction: XLA's CPU backend expands each `ragged_dot` densely ([E, n·k, F] masks and selects,
# 57 such buffers in a 2-layer step), which GPUs and TPUs lower natively.
MOE = ("mixtral", "qwen3_moe")
MOE_LAYOUTS = ("data8", "fsdp8")
PAIRS = [(f, n) for f in MODELLED for n in NAMES if f not in MOE or n in MOE_LAYOUTS]


@pytest.fixture(autouse=True)
def _toy_registered():
    models.register(toy_model.FAMILY)
    yield
    models.unregister(toy_model.NAME)


def _family_config(family: str, layout: str):
    c = _config(*LAYOUTS[layout])
    c.model.name, c.model.seq_len = family, 64
    if family in MOE:
        c.model.num_experts, c.model.experts_per_token = 8, 2
        c.model.moe_capacity_factor = 1.25
    return c


def test_the_registry_has_modelled_and_unmodelled_families():
    """Both branches below run: GPT, Llama and the toy declare `plan_cost`, the classifiers not."""
    assert {"gpt", "llama", toy_model.NAME} <= set(MODELLED)
    assert {"mlp", "resnet"} <= set(FAMILIES) - set(MODELLED)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_is_modelled_or_says_so_in_one_line(family):
    c = _config(*LAYOUTS["data8"])
    c.model.name = family
    if family in MODELLED:
        info = plan.model_info(c)
        assert info.family == family and info.cost.label and info.num_params > 0
        return
    with pytest.raises(ConfigError, match=f"model.name='{family}' is not modelled") as e:
        plan.model_info(c)
    assert "\n" not in str(e.value)
    line = plan.layout_prediction(c, types.SimpleNamespace(abstract_state={}))["planner"]
    assert line == str(e.value)
    assert plan.refuse_if_far_over_memory(c, 8) is None  # not modelled: no refusal either


@pytest.mark.parametrize(("family", "layout"), PAIRS)
def test_prediction_matches_compiled_step_for_every_family(family, layout):
    c = _family_config(family, layout)
    record = _compiled_record(c)
    pred = plan.predict(c, hw="cpu_here", num_devices=8)

    assert_prediction_matches(c, pred, record)
