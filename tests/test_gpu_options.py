"""GPU speed options that must not change what is computed: an unrolled layer loop, the embedding
gradient as a one-hot matmul, and the remat policy that saves fused attention's outputs. Each is
compared on a sharded mesh with the plain path on one device (float32, 3 steps)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from models import api, gpt
from tests.helpers import tiny_gpt_config, train_steps

STEPS = 3


@pytest.fixture(scope="module")
def reference():
    return train_steps(tiny_gpt_config(), STEPS)


@pytest.mark.parametrize(
    "fields",
    [
        {"model.scan_unroll": 2},
        {"model.embed_grad": "matmul"},
        {"model.scan_unroll": 2, "model.embed_grad": "matmul", "train.remat": "dots_no_batch"},
    ],
    ids=["unrolled", "embed_grad_matmul", "all"],
)
def test_same_training_on_a_sharded_mesh(reference, fields):
    c = tiny_gpt_config(data=2, fsdp=2, tensor=2)
    for dotted, value in fields.items():
        section, key = dotted.split(".")
        c[section][key] = value
    losses, params = train_steps(c, STEPS)
    ref_losses, ref_params = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_embedding_gradient_matmul_equals_scatter():
    emb = jax.random.normal(jax.random.key(0), (50, 8))
    tokens = jax.random.randint(jax.random.key(1), (3, 7), 0, 50).at[0, :4].set(3)  # repeats
    w = jax.random.normal(jax.random.key(2), (3, 7, 8))
    grad = lambda lookup: jax.grad(lambda e: (lookup(e, tokens) * w).sum())(emb)
    np.testing.assert_allclose(grad(gpt._take_matmul_grad), grad(gpt._take), atol=1e-6)


def test_unrolled_scan_has_no_layer_loop():
    def loops(unroll):
        c = tiny_gpt_config()
        c.model.scan_unroll = unroll
        from tests.helpers import compile_step

        return compile_step(c)[1].as_text().count(" while(")

    assert loops(1) >= 1 and loops(2) < loops(1)  # 2 layers, unroll 2: the layer loops are gone


def test_dots_no_batch_saves_fused_attention_outputs():
    policy = api.REMAT_POLICIES["dots_no_batch"]

    class Prim:
        def __init__(self, name):
            self.name = name

    assert policy(Prim("dot_product_attention_fwd"))
    assert not policy(Prim("exp")) and not policy(Prim("dot_product_attention_bwd"))


def test_auto_attention_is_cudnn_only_where_it_can_run():
    import jax.numpy as jnp

    # This machine has no GPU: auto is XLA; explicit choices pass through unchanged.
    assert gpt.attention_implementation("auto", jnp.bfloat16, 128) == "xla"
    assert gpt.attention_implementation("cudnn", jnp.float32, 128) == "cudnn"
    assert gpt.attention_implementation("xla", jnp.bfloat16, 128) == "xla"
