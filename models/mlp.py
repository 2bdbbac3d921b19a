"""Multi-layer perceptron classifier, Flax NNX, annotated only with logical axes.

Hidden layers alternate column- and row-parallel splits over `tensor` (Megatron style for an MLP):
the first projection splits its outputs (`mlp`), the next its inputs, with one all-reduce between.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxdist.errors import ConfigError
from jaxdist.sharding import constrain
from models.api import ModelFamily


class MLP(nnx.Module):
    def __init__(self, cfg, *, input_dim: int, rngs: nnx.Rngs):
        dims = (input_dim, *cfg.hidden_dims, cfg.num_classes)
        self.weights = nnx.List()
        self.biases = nnx.List()
        self.axes = []
        for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
            # even layers: [embed, mlp] (column-parallel); odd layers: [mlp, embed] (row-parallel)
            axes = ("embed", "mlp") if i % 2 == 0 else ("mlp", "embed")
            if i == len(dims) - 2:  # the classifier head keeps its classes whole
                axes = (axes[0], None)
            w = jax.random.normal(rngs.params(), (a, b)) * (2.0 / a) ** 0.5
            self.weights.append(nnx.Param(w, logical_axes=axes))
            self.biases.append(nnx.Param(jnp.zeros((b,)), logical_axes=(axes[1],)))
            self.axes.append(axes)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.reshape(x.shape[0], -1)  # [B, features]
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            axes = self.axes[i]
            x = x @ constrain(w[...], axes) + constrain(b[...], (axes[1],))
            x = constrain(x, ("batch", axes[1]))
            if i < len(self.weights) - 1:
                x = jax.nn.relu(x)
        return x

    def loss(self, batch, *, remat: str = "none"):
        del remat
        return classification_loss(self(batch["inputs"]), batch["targets"])


def classification_loss(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, dict]:
    """Mean softmax cross-entropy in float32, and accuracy: the classifiers' `loss`."""
    logits = logits.astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == targets)}


def batch_axes(image_ndim: int = 3) -> dict[str, tuple]:
    return {"inputs": ("batch",) + (None,) * image_ndim, "targets": ("batch",)}


def check(m, mesh: Mapping[str, int]) -> None:
    t = mesh["tensor"]
    for h in m.hidden_dims:
        if h % t:
            raise ConfigError(
                f"model.hidden_dims={tuple(m.hidden_dims)} must be divisible by mesh.tensor={t}"
            )


def check_image_data(config, ds) -> None:
    """Image data whose labels fit `model.num_classes` (the classifiers' `check_data`)."""
    m = config.model
    if ds.kind != "images":
        raise ConfigError(
            f"model.name={m.name!r} needs image data (an .npz or 'digits'), not {config.data.source!r}"
        )
    if ds.num_classes > m.num_classes:
        raise ConfigError(
            f"model.num_classes={m.num_classes} but the labels go up to {ds.num_classes - 1}"
        )


FAMILY = ModelFamily(
    name="mlp",
    make=lambda cfg, ds: lambda rngs: MLP(cfg, input_dim=math.prod(ds.example_shape), rngs=rngs),
    batch_axes=lambda cfg, ds: batch_axes(len(ds.example_shape)),
    check=check,
    check_data=check_image_data,
)
