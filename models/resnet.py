"""A small ResNet for image classification, Flax NNX, annotated only with logical axes.

Residual stages of two 3×3 convolutions with RMS-style channel normalisation (stateless, so data
parallel runs match one device exactly without synchronised batch statistics), stride-2 downsampling
between stages, global average pooling and a linear head. Channels are `embed` on the way in and `mlp`
on the way out of each convolution, so `tensor` splits output channels then input channels.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdist.errors import ConfigError
from jaxdist.sharding import constrain
from models.api import ModelFamily
from models.mlp import batch_axes, check_image_data, classification_loss

_DN = ("NHWC", "HWIO", "NHWC")


def _conv_param(rngs, cin, cout, axes):
    w = jax.random.normal(rngs.params(), (3, 3, cin, cout)) * (2.0 / (9 * cin)) ** 0.5
    return nnx.Param(w, logical_axes=(None, None, *axes))


def _conv(x, w, stride=1):
    return jax.lax.conv_general_dilated(x, w, (stride, stride), "SAME", dimension_numbers=_DN)


def _chan_norm(x, scale):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)
    return (y * scale).astype(x.dtype)


class ResNet(nnx.Module):
    def __init__(self, cfg, *, in_channels: int, rngs: nnx.Rngs):
        widths = tuple(cfg.widths)
        # Image channels (1 or 3) are too few to split: the stem's input axis has no logical name.
        self.stem = _conv_param(rngs, in_channels, widths[0], (None, "mlp"))
        self.convs_a, self.convs_b, self.norms_a, self.norms_b = (nnx.List() for _ in range(4))
        self.proj = nnx.List()
        cin = widths[0]
        for w in widths:
            self.convs_a.append(_conv_param(rngs, cin, w, ("embed", "mlp")))
            self.convs_b.append(_conv_param(rngs, w, w, ("mlp", "embed")))
            self.norms_a.append(nnx.Param(jnp.ones((cin,)), logical_axes=("embed",)))
            self.norms_b.append(nnx.Param(jnp.ones((w,)), logical_axes=("mlp",)))
            self.proj.append(
                nnx.Param(
                    jax.random.normal(rngs.params(), (cin, w)) * cin**-0.5,
                    logical_axes=("embed", "mlp"),
                )
            )
            cin = w
        self.head = nnx.Param(
            jax.random.normal(rngs.params(), (cin, cfg.num_classes)) * cin**-0.5,
            logical_axes=("embed", None),
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        if x.ndim == 3:  # [B, H, W] grayscale
            x = x[..., None]
        act = ("batch", None, None, "embed")
        x = constrain(_conv(x, constrain(self.stem[...], (None, None, None, "mlp"))), act)
        for i in range(len(self.convs_a)):
            stride = 1 if i == 0 else 2
            h = jax.nn.relu(_chan_norm(x, self.norms_a[i][...]))
            h = _conv(h, constrain(self.convs_a[i][...], (None, None, "embed", "mlp")), stride)
            h = constrain(h, ("batch", None, None, "mlp"))
            h = jax.nn.relu(_chan_norm(h, self.norms_b[i][...]))
            h = _conv(h, constrain(self.convs_b[i][...], (None, None, "mlp", "embed")))
            skip = x[:, ::stride, ::stride, :] @ constrain(self.proj[i][...], ("embed", "mlp"))
            x = constrain(h + skip, act)
        x = jnp.mean(x, axis=(1, 2))  # [B, C]
        return x @ constrain(self.head[...], ("embed", None))

    def loss(self, batch, *, remat: str = "none"):
        del remat
        return classification_loss(self(batch["inputs"]), batch["targets"])


def check(m, mesh: Mapping[str, int]) -> None:
    t = mesh["tensor"]
    for w in m.widths:
        if w % t:
            raise ConfigError(
                f"model.widths={tuple(m.widths)} must be divisible by mesh.tensor={t}"
            )


def _make(cfg, ds):
    shape = ds.example_shape
    in_channels = shape[-1] if len(shape) == 3 else 1
    return lambda rngs: ResNet(cfg, in_channels=in_channels, rngs=rngs)


FAMILY = ModelFamily(
    name="resnet",
    make=_make,
    batch_axes=lambda cfg, ds: batch_axes(len(ds.example_shape)),
    check=check,
    check_data=check_image_data,
)
