"""The planner's memory at a realistic width: temp and the peak within 10% of memory_analysis().

`tests/test_plan.py` checks 15 layouts of the tiny GPT (d_model 32). Here the GPT is d_model 256,
8 heads, T 128, 4 layers, batch 32, where activations dominate temp as they do in real runs; the
layouts cover remat none / full / dots, bf16 compute, FSDP with accumulation, tensor parallelism and
gpipe and 1F1B pipelines of two layers per stage, FSDP inside 1F1B. Compiled only, never run.
"""

from __future__ import annotations

import pytest

from jaxdist import plan
from tests.test_plan import LAYOUTS, _compiled_record, _config, _rel

# tests/test_plan.LAYOUTS entries, widened below (4 layers: two per pipeline stage).
NAMES = (
    "data2_tensor4",
    "fsdp8_accum2_remat_full",
    "d2f2t2_bf16_remat_dots",
    "data4_pipeline2_gpipe",
    "data4_pipeline2_1f1b",
    "d2f2p2_1f1b_remat_full",
)


@pytest.mark.parametrize("name", NAMES)
def test_memory_prediction_at_realistic_width(name):
    c = _config(*LAYOUTS[name])
    c.model.d_model, c.model.num_heads, c.model.seq_len, c.model.num_layers = 256, 8, 128, 4
    c.train.batch_size = 32
    want = _compiled_record(c)["bytes_per_device"]
    got = plan.predict(c, hw="cpu_here", num_devices=8).memory
    assert _rel(got["temp"], want["temp"]) <= 0.10, (got, want)
    assert _rel(got["total"], want["arguments"] + want["temp"]) <= 0.10, (got, want)
    assert got["activations"] > got["grads"] + got["other_temp"]  # the regime this file is for
