"""The GPT block: what its backward keeps, and that keeping less changes no number."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist import train
from models import gpt
from tests.helpers import engine_for, tiny_gpt_config


def _mlp_sized_residuals(B: int, T: int, D: int, F: int) -> int:
    """[B, T, F] arrays among the residuals `jax.vjp` of one block saves (shapes only)."""
    k = iter(jax.random.split(jax.random.key(0), 5))
    lp = {
        "attn_norm": jnp.ones((D,)),
        "wqkv": jax.random.normal(next(k), (D, 3, 4, D // 4)),
        "wo": jax.random.normal(next(k), (4, D // 4, D)),
        "mlp_norm": jnp.ones((D,)),
        "w_up": jax.random.normal(next(k), (D, F)),
        "w_down": jax.random.normal(next(k), (F, D)),
    }
    x = jax.random.normal(next(k), (B, T, D))
    residuals = jax.eval_shape(lambda lp, x: jax.vjp(gpt.block, lp, x)[1], lp, x)
    return sum(r.shape == (B, T, F) for r in jax.tree.leaves(residuals))


def test_gelu_keeps_only_its_input():
    """Of the MLP's [B, T, F] activations the backward keeps the GELU's input (its backward
    recomputes the tanh) and its output (w_down's weight gradient needs it); plain autodiff of
    `jax.nn.gelu` keeps four more (tanh pieces)."""
    assert _mlp_sized_residuals(2, 16, 32, 128) == 2


def _loss_and_grads(c):
    eng, batches = engine_for(c)
    params = eng.init()["params"]
    loss_fn = train._loss_fn(c, eng.mesh, eng.family, eng.model)
    grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    (loss, _), grads = grad_fn(params, batches.get(0))
    return jax.device_get((loss, grads))


@pytest.mark.bitwise  # compares compiled programs to the bit (tests/conftest.py)
@pytest.mark.parametrize("mesh", [dict(data=1), dict(data=2, fsdp=2, tensor=2)])
def test_gelu_recompute_changes_no_bit(monkeypatch, mesh):
    """The GPT's loss and every gradient with the GELU's backward recomputed equal, bit for bit,
    those of plain autodiff (the same operations in the same order), on one device and sharded."""
    c = tiny_gpt_config(**mesh)
    loss, grads = _loss_and_grads(c)
    monkeypatch.setattr(gpt, "_gelu", jax.nn.gelu)
    assert _mlp_sized_residuals(2, 16, 32, 128) == 6  # the check above can fail
    ref_loss, ref_grads = _loss_and_grads(c)
    np.testing.assert_array_equal(loss, ref_loss)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads), strict=True
    ):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
