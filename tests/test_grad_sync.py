"""Gradient compression inside the real train step on data=8: bytes on the wire, the config rules.

Convergence is a study, not a test: `scripts/bench.py --study=compression` (docs/COMPRESSION.md),
whose `--table=small` run is tests/test_bench.py's.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxdist import metrics
from tests.helpers import compile_step, tiny_gpt_config, train_steps


def default_gpt(**mesh_sizes):
    """The default job's GPT (2 layers, d_model 128, 4 heads, seq 64) on the given mesh."""
    c = tiny_gpt_config(**mesh_sizes)
    c.model.d_model, c.model.seq_len, c.train.batch_size = 128, 64, 32
    return c


def wire_bytes(c) -> float:
    _, compiled = compile_step(c)
    return sum(metrics.collective_bytes(compiled.as_text()).values())


@pytest.fixture(scope="module")
def uncompressed_bytes():
    return wire_bytes(default_gpt(data=8))


@pytest.mark.parametrize(
    "compression,field,value,min_ratio",
    [
        ("bf16", None, None, 1.9),
        ("int8", None, None, 3.5),
        ("topk", "topk_ratio", 0.01, 10.0),
        ("powersgd", "rank", 2, 10.0),
        ("ef_sign", None, None, 15.0),
    ],
)
def test_train_step_bytes_on_the_wire(compression, field, value, min_ratio, uncompressed_bytes):
    c = default_gpt(data=8)
    c.grad_sync.compression = compression
    if field:
        c.grad_sync[field] = value
    ratio = uncompressed_bytes / wire_bytes(c)
    assert ratio >= min_ratio, (compression, ratio)


# ef_sign is 1-bit compressed momentum SGD: the SGD momentum moves into the compressor.
EF_SIGN = {"train.optimizer": "sgd", "grad_sync.momentum_correction": True}
SGD = {"train.optimizer": "sgd", "train.learning_rate": 0.3, "train.momentum": 0.9}


def convergence_config(compression: str, **overrides):
    """A 1-layer GPT on the built-in stdlib bytes, data=8, error feedback on: the job of
    `scripts/bench.py --study=compression --table=small` (docs/COMPRESSION.md, where each method's
    150-step convergence beside the uncompressed run with its optimizer is measured)."""
    c = tiny_gpt_config(data=8)
    c.model.num_layers = 1
    c.train.steps = 150
    c.train.warmup_steps = 10
    c.train.learning_rate = 3e-3
    c.grad_sync.compression = compression
    c.grad_sync.error_feedback = True
    c.grad_sync.topk_ratio = 0.01
    c.grad_sync.rank = 2
    if overrides.get("train.optimizer") == "sgd":
        overrides = {**SGD, **overrides}
    for path, value in overrides.items():
        section, field = path.split(".")
        c[section][field] = value
    return c


def test_momentum_correction_is_validated():
    from jaxdist import config as config_lib
    from jaxdist.errors import ConfigError

    c = convergence_config("topk", **{"grad_sync.momentum_correction": True})  # adamw
    with pytest.raises(ConfigError, match="train.optimizer='sgd'"):
        config_lib.validate(c, 8)
    c = convergence_config(
        "powersgd", **{"train.optimizer": "sgd", "grad_sync.momentum_correction": True}
    )
    with pytest.raises(ConfigError, match="'topk' .DGC. or 'ef_sign'"):
        config_lib.validate(c, 8)
    c = convergence_config(
        "none", **{"train.optimizer": "sgd", "grad_sync.momentum_correction": True}
    )
    with pytest.raises(ConfigError, match="'topk' .DGC. or 'ef_sign'"):
        config_lib.validate(c, 8)  # without a compressor it would be silently ignored


def test_sign_is_the_deprecated_name_of_ef_sign(caplog):
    from jaxdist import config as config_lib

    c = convergence_config("sign", **EF_SIGN)
    with caplog.at_level("WARNING", logger="jaxdist"):
        config_lib.validate(c, 8)
    [record] = [r for r in caplog.records if "deprecated" in r.getMessage()]
    assert "'ef_sign'" in record.getMessage() and "\n" not in record.getMessage()
    old, new = (
        train_steps(convergence_config(n, **EF_SIGN), steps=3)[0] for n in ("sign", "ef_sign")
    )
    np.testing.assert_array_equal(old, new)
