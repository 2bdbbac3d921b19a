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
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxdist import sharding

# The one registry of `train.lr_scaling` names: name -> batch_size / base_batch_size -> factor.
LR_SCALINGS: dict[str, Callable[[float], float]] = {
    "none": lambda ratio: 1.0,
    "linear": lambda ratio: ratio,
    "sqrt": math.sqrt,
}

# The one registry of `train.schedule` names (the decay after warmup): name -> (peak learning
# rate, decay steps, min_lr_ratio) -> schedule.
SCHEDULES: dict[str, Callable[[float, int, float], optax.Schedule]] = {
    "cosine": lambda peak, steps, floor: optax.cosine_decay_schedule(peak, steps, alpha=floor),
    "linear": lambda peak, steps, floor: optax.linear_schedule(peak, peak * floor, steps),
    "constant": lambda peak, steps, floor: optax.constant_schedule(peak),
}


def scaled_learning_rate(train_cfg) -> float:
    base = train_cfg.base_batch_size or train_cfg.batch_size
    return train_cfg.learning_rate * LR_SCALINGS[train_cfg.lr_scaling](train_cfg.batch_size / base)


def schedule(train_cfg) -> optax.Schedule:
    """Linear warmup from 0, then cosine or linear decay to min_lr_ratio · peak (or constant)."""
    peak = scaled_learning_rate(train_cfg)
    warmup = min(train_cfg.warmup_steps, train_cfg.steps)
    decay_steps = max(train_cfg.steps - warmup, 1)
    after = SCHEDULES[train_cfg.schedule](peak, decay_steps, train_cfg.min_lr_ratio)
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


def _adamw(c, lr, wd_mask, axes_tree) -> optax.GradientTransformation:
    return optax.adamw(lr, b1=c.b1, b2=c.b2, eps=1e-8, weight_decay=c.weight_decay, mask=wd_mask)


def _lamb(c, lr, wd_mask, axes_tree) -> optax.GradientTransformation:
    return optax.chain(
        optax.scale_by_adam(b1=c.b1, b2=c.b2, eps=1e-6),
        optax.add_decayed_weights(c.weight_decay, mask=wd_mask),
        scale_by_layerwise_trust_ratio(axes_tree),
        optax.scale_by_learning_rate(lr),
    )


def _lars(c, lr, wd_mask, axes_tree) -> optax.GradientTransformation:
    return optax.chain(
        optax.add_decayed_weights(c.weight_decay, mask=wd_mask),
        scale_by_layerwise_trust_ratio(axes_tree, trust_coefficient=0.001, eps=0.0),
        optax.scale_by_learning_rate(lr),
        optax.trace(decay=c.momentum, nesterov=False),
    )


def _sgd(c, lr, wd_mask, axes_tree) -> optax.GradientTransformation:
    """SGD with momentum (none when `train.momentum` is 0; Nesterov with `train.nesterov`)."""
    return optax.chain(
        optax.add_decayed_weights(c.weight_decay, mask=wd_mask),
        optax.sgd(lr, momentum=c.momentum or None, nesterov=bool(c.get("nesterov", False))),
    )


# The one registry of `train.optimizer` names: name -> (train config, learning-rate schedule,
# weight-decay mask, logical axes of the params) -> optimizer (before clipping).
OPTIMIZERS: dict[str, Callable[..., optax.GradientTransformation]] = {
    "adamw": _adamw,
    "lamb": _lamb,
    "lars": _lars,
    "sgd": _sgd,
}


def build(train_cfg, axes_tree: Any) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optimizer named by `train.optimizer`, with clipping, decay mask and schedule."""
    lr = schedule(train_cfg)
    opt = OPTIMIZERS[train_cfg.optimizer](train_cfg, lr, _matrix_mask(axes_tree), axes_tree)
    if train_cfg.grad_clip > 0:
        opt = optax.chain(optax.clip_by_global_norm(train_cfg.grad_clip), opt)
    return opt, lr
