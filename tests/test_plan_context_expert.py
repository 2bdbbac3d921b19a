"""The planner's layout search over `mesh.context` and `mesh.expert` (jaxdist/plan/layouts.py
`mesh_shapes`): a long sequence whose context=1 layouts do not fit gets context > 1, an MoE model
whose experts do not fit on expert=1 gets expert > 1."""

from __future__ import annotations

import dataclasses

from jaxdist import plan
from tests.test_compose_context_expert import config as moe_or_dense
from tests.test_llama import llama_config

HW = plan.hardware("h100_nvlink_ib")


def _smallest(pl: plan.Plan, axis: str) -> dict[int, float]:
    """The least predicted bytes per device over the layouts with each size of `axis`."""
    best: dict[int, float] = {}
    for p in pl.predictions:
        size = getattr(p.layout, axis)
        best[size] = min(best.get(size, float("inf")), p.memory["total"])
    return best


def _between(best: dict[int, float]) -> plan.Hardware:
    """HW with a budget between the best size-1 layout and the best layout with the axis > 1."""
    split = min(v for k, v in best.items() if k > 1)
    assert split < best[1], best  # the axis must cut memory for the question to arise
    return dataclasses.replace(HW, memory_bytes=(split + best[1]) / 2 / HW.usable_fraction)


def long_sequence(seq_len: int):
    """One 8-head Llama sequence per step on 8 devices (flash attention: no score matrix)."""
    c = llama_config(data=8)
    c.model.seq_len, c.model.num_layers = seq_len, 2
    c.model.num_heads = c.model.num_kv_heads = 8
    c.model.d_model, c.model.mlp_dim = 512, 1024
    c.model.attention = "cudnn"
    c.train.batch_size = 1
    return c


def test_planner_picks_context_when_the_sequence_does_not_fit():
    c = long_sequence(32768)
    pl = plan.plan(c, 8, HW, remats=["none"], max_grad_accum=1)
    best = _smallest(pl, "context")
    assert set(best) == {1, 2, 4, 8}, best  # context is searched
    assert best[8] < 0.5 * best[1], best  # a device holds T/c of every activation
    tight = plan.plan(c, 8, _between(best), remats=["none"], max_grad_accum=1)
    assert not any(p.fits for p in tight.predictions if p.layout.context == 1)
    assert tight.recommended is not None and tight.recommended.layout.context > 1


def test_planner_picks_expert_parallelism_when_the_experts_do_not_fit():
    c = moe_or_dense("none", True, data=8)
    c.model.num_experts, c.model.d_model, c.model.mlp_dim = 16, 256, 1024
    pl = plan.plan(c, 8, HW, remats=["none"], max_grad_accum=1)
    best = _smallest(pl, "expert")
    assert set(best) == {1, 2, 4, 8}, best  # divisors of 16 that divide 8 devices
    tight = plan.plan(c, 8, _between(best), remats=["none"], max_grad_accum=1)
    assert not any(p.fits for p in tight.predictions if p.layout.expert == 1)
    assert tight.recommended is not None and tight.recommended.layout.expert > 1


def test_moe_compute_counts_active_parameters():
    """The predicted compute of an MoE model falls with top-k at equal total parameters."""
    c = moe_or_dense("none", True, data=8)
    lay = plan.Layout(data=8)
    c.model.experts_per_token = 1
    one = plan.predict(c, lay, HW).compute_s
    c.model.experts_per_token = 4
    four = plan.predict(c, lay, HW).compute_s
    assert one < four, (one, four)
