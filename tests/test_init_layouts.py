"""A random init is the same weights on every layout, to the bit.

A jax random draw is a function of the key and the shape, not of how the output is sharded, so an
init program compiled for a layout must give one device's weights unless jaxdist's own code
departs from that: a draw that depends on the mesh, a parameter padded or split per layout, the
pipeline's stored layer order not undone (`to_user`). The layout tests lean on this: they start
every compared layout from the weights the first one drew (tests/helpers.initial_state) and compare
training from there. Here each layout's own init program runs: its `eng.init()`, in the user's [L]
layer order, equals one device's, bit for bit (the interleaved case fails if the stored order is
compared instead).
"""

from __future__ import annotations

import jax
import pytest

from tests.helpers import engine_for, tiny_gpt_config
from tests.test_llama import llama_config


def _gpt(**sizes):
    return tiny_gpt_config(**sizes)


def _llama(**sizes):
    return llama_config(**sizes)


def _moe(**sizes):
    c = llama_config(**sizes)
    c.model.num_experts, c.model.experts_per_token, c.model.mlp_dim = 8, 2, 64
    return c


def _interleaved(**sizes):
    c = llama_config(**sizes)
    c.model.num_layers = 4
    c.pipeline.schedule, c.pipeline.virtual_stages, c.pipeline.microbatches = "interleaved", 2, 2
    return c


def _init_params(c) -> dict:
    eng, _ = engine_for(c)
    return jax.device_get(eng.to_user(eng.init())["params"])


@pytest.mark.parametrize(
    "make, sizes",
    [
        (_gpt, dict(fsdp=2, tensor=2, data=2)),
        (_llama, dict(fsdp=4, tensor=2)),
        (_llama, dict(context=2, data=4)),
        (_moe, dict(expert=2, data=4)),
        (_moe, dict(expert=4, tensor=2)),
        (_interleaved, dict(pipeline=2, data=2)),
    ],
    ids=["gpt-fsdp-tensor", "llama-fsdp-tensor", "llama-context", "moe-expert", "moe-expert-tensor",
         "llama-interleaved-pipeline"],
)  # fmt: skip
def test_a_sharded_init_draws_one_devices_weights(make, sizes):
    want = _init_params(make())
    got = _init_params(make(**sizes))
    flat = jax.tree_util.tree_leaves_with_path(got)
    assert len(flat) == len(jax.tree.leaves(want)) > 0
    for (path, a), b in zip(flat, jax.tree.leaves(want), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, jax.tree_util.keystr(path)
        assert a.tobytes() == b.tobytes(), jax.tree_util.keystr(path)
