"""Optimizers and learning-rate schedules: adamw, lamb, lars, sgd with warmup and decay.

Large-batch rules (`train.lr_scaling`): `linear` multiplies the learning rate by
batch_size / base_batch_size (Goyal et al. 2017, with the gradual warmup of `train.warmup_steps`);
`sqrt` by its square root (Krizhevsky 2014; the usual rule for Adam-family optimizers).

Weight decay and LARS/LAMB trust ratios skip parameters with fewer than two non-`layers` dimensions
(norm scales, biases). Trust ratios are computed per layer for stacked parameters: a `[L, ...]` weight
gets L ratios, exactly as if the layers were separate arrays.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxdist import sharding


def scaled_learning_rate(train_cfg) -> float:
    base = train_cfg.base_batch_size or train_cfg.batch_size
    ratio = train_cfg.batch_size / base
    if train_cfg.lr_scaling == "linear":
        return train_cfg.learning_rate * ratio
    if train_cfg.lr_scaling == "sqrt":
        return train_cfg.learning_rate * math.sqrt(ratio)
    return train_cfg.learning_rate


def schedule(train_cfg) -> optax.Schedule:
    """Linear warmup from 0, then cosine or linear decay to min_lr_ratio · peak (or constant)."""
    peak = scaled_learning_rate(train_cfg)
    warmup = min(train_cfg.warmup_steps, train_cfg.steps)
    end = peak * train_cfg.min_lr_ratio
    decay_steps = max(train_cfg.steps - warmup, 1)
    if train_cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(peak, decay_steps, alpha=train_cfg.min_lr_ratio)
    elif train_cfg.schedule == "linear":
        after = optax.linear_schedule(peak, end, decay_steps)
    else:
        after = optax.constant_schedule(peak)
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def _matrix_mask(axes_tree: Any) -> Any:
    """True for weights (≥ 2 dimensions besides `layers`), False for scales and biases."""
    return jax.tree.map(
        lambda axes: sum(a != "layers" for a in axes) >= 2, axes_tree, is_leaf=sharding.is_axes
    )


class _TrustState(NamedTuple):
    pass


def scale_by_layerwise_trust_ratio(
    axes_tree: Any, *, trust_coefficient: float = 1.0, eps: float = 0.0
) -> optax.GradientTransformation:
    """LARS/LAMB trust ratio ‖w‖/‖u‖, per layer for stacked `[L, ...]` parameters.

    Parameters with fewer than two non-`layers` dimensions pass through unscaled.
    """
    mask = _matrix_mask(axes_tree)

    def init_fn(params):
        del params
        return _TrustState()

    def update_fn(updates, state, params):
        def one(u, p, axes, use):
            if not use:
                return u
            keep = tuple(i for i, a in enumerate(axes) if a == "layers")
            red = tuple(i for i in range(u.ndim) if i not in keep)
            pn = jnp.sqrt(jnp.sum(jnp.square(p.astype(jnp.float32)), axis=red, keepdims=True))
            un = jnp.sqrt(jnp.sum(jnp.square(u.astype(jnp.float32)), axis=red, keepdims=True))
            ratio = jnp.where((pn > 0) & (un > 0), trust_coefficient * pn / (un + eps), 1.0)
            return (u * ratio).astype(u.dtype)

        out = jax.tree.map(one, updates, params, axes_tree, mask, is_leaf=lambda x: x is None)
        return out, state

    return optax.GradientTransformation(init_fn, update_fn)


def build(train_cfg, axes_tree: Any) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optimizer named by `train.optimizer`, with clipping, decay mask and schedule."""
    lr = schedule(train_cfg)
    wd_mask = _matrix_mask(axes_tree)
    name = train_cfg.optimizer
    if name == "adamw":
        opt = optax.adamw(
            lr,
            b1=train_cfg.b1,
            b2=train_cfg.b2,
            eps=1e-8,
            weight_decay=train_cfg.weight_decay,
            mask=wd_mask,
        )
    elif name == "lamb":
        opt = optax.chain(
            optax.scale_by_adam(b1=train_cfg.b1, b2=train_cfg.b2, eps=1e-6),
            optax.add_decayed_weights(train_cfg.weight_decay, mask=wd_mask),
            scale_by_layerwise_trust_ratio(axes_tree),
            optax.scale_by_learning_rate(lr),
        )
    elif name == "lars":
        opt = optax.chain(
            optax.add_decayed_weights(train_cfg.weight_decay, mask=wd_mask),
            scale_by_layerwise_trust_ratio(axes_tree, trust_coefficient=0.001, eps=0.0),
            optax.scale_by_learning_rate(lr),
            optax.trace(decay=train_cfg.momentum, nesterov=False),
        )
    else:  # sgd with momentum
        opt = optax.chain(
            optax.add_decayed_weights(train_cfg.weight_decay, mask=wd_mask),
            optax.sgd(lr, momentum=train_cfg.momentum or None),
        )
    if train_cfg.grad_clip > 0:
        opt = optax.chain(optax.clip_by_global_norm(train_cfg.grad_clip), opt)
    return opt, lr
