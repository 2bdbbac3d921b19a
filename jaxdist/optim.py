"""Optimizers and learning-rate schedules: adamw, lamb, lars, sgd with warmup and decay.

Large-batch rules (`train.lr_scaling`): `linear` multiplies the learning rate by
batch_size / base_batch_size (Goyal et al. 2017, with the gradual warmup of `train.warmup_steps`);
`sqrt` by its square root (Krizhevsky 2014; the usual rule for Adam-family optimizers).

Weight decay and LARS/LAMB trust ratios skip parameters with fewer than two non-`layers` dimensions
(norm scales, biases). Trust ratios are computed per layer for stacked parameters: a `[L, ...]` weight
gets L ratios, exactly as if the layers were separate arrays.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxdist import compression, muon, sharding
from jaxdist.errors import ConfigError

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


# --------------------------------------------------------------------------------------------------
# Optimizer state in a narrower dtype (`train.opt_state_dtype`).

STATE_DTYPES = ("float32", "bfloat16")
# `train.opt_state_rounding`: how float32 moments are written back into bfloat16.
STATE_ROUNDINGS = ("nearest", "stochastic")
# The stochastic rounding's key is jax.random.key(ROUNDING_SEED) folded with the update count and
# the leaf's index: a function of the step alone, so runs and resumed runs round identically.
ROUNDING_SEED = 0x5EED


def _is_moment(x: Any) -> bool:
    """A floating state leaf with at least one dimension: a moment (counts and scalars are not)."""
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and jnp.ndim(x) >= 1


def stochastic_round_bf16(x: jax.Array, key: jax.Array) -> jax.Array:
    """`x` rounded to one of its two bfloat16 neighbours, up with probability equal to its distance
    from the lower one in units of their gap: unbiased, E[round(x)] = x.

    The float32 bits plus 16 uniform random bits, truncated to the upper 16 (the bfloat16 bits), as
    in "Revisiting BFloat16 Training" (Zamirai et al. 2020) and torchao's bf16 stochastic
    rounding. Works on the magnitude, so negative values round symmetrically; inf and nan are
    rounded to nearest (they stay inf and nan). The random bits come from `jax.random.bits`, whose
    values do not depend on how `x` is sharded.

    Args:
      x: float32 (or narrower) array.
      key: a jax.random key.

    Returns:
      The bfloat16 array of `x`'s shape.
    """
    x = x.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    noise = jax.random.bits(key, x.shape, jnp.uint16).astype(jnp.uint32)
    upper = ((bits + noise) >> 16).astype(jnp.uint16)
    rounded = jax.lax.bitcast_convert_type(upper, jnp.bfloat16)
    return jnp.where(jnp.isfinite(x), rounded, x.astype(jnp.bfloat16))


class StochasticRoundState(NamedTuple):
    """The state of `with_state_dtype(..., rounding="stochastic")`."""

    count: jax.Array  # int32[]: updates written; the rounding key is derived from it
    inner: Any  # the wrapped optimizer's state, moments in bfloat16


def with_state_dtype(
    tx: optax.GradientTransformation, dtype: str, rounding: str = "nearest"
) -> optax.GradientTransformation:
    """`tx` with its moments stored in `dtype`: read up to float32 for the update, written back
    rounded to nearest (`rounding="nearest"`) or stochastically (`"stochastic"`, bfloat16 only:
    `stochastic_round_bf16` with a key derived from the update count, which the state then keeps
    beside `tx`'s). The identity for float32; the moments keep `tx`'s tree structure, so they are
    sharded like the parameters exactly as before."""
    if jnp.dtype(dtype) == jnp.float32:
        return tx

    def cast(tree: Any, to: Any) -> Any:
        return jax.tree.map(lambda x: x.astype(to) if _is_moment(x) else x, tree)

    if rounding == "nearest":

        def init_fn(params):
            return cast(tx.init(params), dtype)

        def update_fn(updates, state, params=None):
            out, new = tx.update(updates, cast(state, jnp.float32), params)
            return out, cast(new, dtype)

        return optax.GradientTransformation(init_fn, update_fn)

    if rounding != "stochastic" or jnp.dtype(dtype) != jnp.bfloat16:
        raise ValueError(f"no {rounding!r} rounding into {dtype}")

    def sr_init(params):
        return StochasticRoundState(jnp.zeros((), jnp.int32), cast(tx.init(params), dtype))

    def sr_update(updates, state, params=None):
        out, new = tx.update(updates, cast(state.inner, jnp.float32), params)
        key = jax.random.fold_in(jax.random.key(ROUNDING_SEED), state.count)
        leaves, treedef = jax.tree.flatten(new)
        leaves = [
            stochastic_round_bf16(x, jax.random.fold_in(key, i)) if _is_moment(x) else x
            for i, x in enumerate(leaves)
        ]
        count = optax.safe_int32_increment(state.count)
        return out, StochasticRoundState(count, jax.tree.unflatten(treedef, leaves))

    return optax.GradientTransformation(sr_init, sr_update)


# --------------------------------------------------------------------------------------------------
# Optimizer specs: one frozen dataclass per `train.optimizer` name, registered below.

# Spec fields read from a `train` key of another name.
CONFIG_KEYS = {"state_dtype": "opt_state_dtype", "state_rounding": "opt_state_rounding"}


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """What jaxdist knows of one optimizer: its fields, abilities, checks and costs.

    A spec is built from the `train` config (`from_config`): each dataclass field is read from
    `train.<field>`, or from `train.<section>.<field>` for the fields in `own` (its sub-config,
    whose schema is `config.base_config().train.<section>`; tests pin the two defaults equal).
    Abilities are class attributes; `moments(axes)` says how many arrays like a parameter it
    keeps, from which the planner's state bytes follow.
    """

    name: ClassVar[str] = ""
    section: ClassVar[str] = ""  # its own sub-config `train.<section>` ("" = none)
    own: ClassVar[tuple[str, ...]] = ()  # fields read from that sub-config
    needs_full_gradient: ClassVar[bool] = False  # refuses compressors that send part of it

    weight_decay: float = 0.01
    state_dtype: str = "float32"  # train.opt_state_dtype
    state_rounding: str = "nearest"  # train.opt_state_rounding

    @classmethod
    def from_config(cls, train_cfg: Any) -> OptimizerSpec:
        """The spec with every field from `train_cfg` (absent ones keep the default)."""
        values = {}
        for f in dataclasses.fields(cls):
            key = CONFIG_KEYS.get(f.name, f.name)
            node = train_cfg.get(cls.section) if f.name in cls.own else train_cfg
            if node is not None and key in node:
                values[f.name] = node[key]
        return cls(**values)

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """The defaults of its own sub-config's fields (`own`)."""
        return {f.name: f.default for f in dataclasses.fields(cls) if f.name in cls.own}

    def transform(self, lr: optax.Schedule, wd_mask: Any, axes_tree: Any, mesh: Any):
        """The optimizer in float32 state, before clipping (each spec defines it)."""
        raise NotImplementedError

    def build(
        self, lr: optax.Schedule, axes_tree: Any, mesh: Any = None
    ) -> optax.GradientTransformation:
        """The optimizer (before clipping) with its moments in `state_dtype`.

        Args:
          lr: the learning-rate schedule.
          axes_tree: logical axes of the parameters (tree of tuples).
          mesh: the device mesh, for optimizers that lay their work out on it (Muon's
            `distribution`); None leaves the layout to XLA.
        """
        tx = self.transform(lr, _matrix_mask(axes_tree), axes_tree, mesh)
        return with_state_dtype(tx, self.state_dtype, self.state_rounding)

    # Abilities and costs, per parameter with logical axes `axes` (the planner's hooks).
    def moments(self, axes: tuple) -> int:
        """Arrays the size of a parameter with these axes that the state keeps."""
        return 0

    def state_bytes_per_param(self, axes: tuple) -> int:
        """Optimizer-state bytes per element of a parameter with these axes."""
        return self.moments(axes) * jnp.dtype(self.state_dtype).itemsize

    def extra_flops(self, shape: tuple[int, ...], axes: tuple) -> float:
        """Matmul FLOPs per step the update adds for one parameter (elementwise work: 0)."""
        return 0.0

    def wire_bytes(self, shape: tuple[int, ...], axes: tuple, mesh_shape: dict) -> float:
        """Bytes one device sends per step for the update of one parameter (its own collectives)."""
        return 0.0

    def check(self, config: Any) -> None:
        """Raises ConfigError (one line) for fields out of range or combinations it refuses."""
        t = config.train
        _need(
            t.get("opt_state_dtype", "float32") in STATE_DTYPES,
            f"train.opt_state_dtype={t.get('opt_state_dtype')!r} is not valid; choose one of "
            + ", ".join(STATE_DTYPES),
        )
        _need(
            self.state_rounding in STATE_ROUNDINGS,
            f"train.opt_state_rounding={self.state_rounding!r} is not valid; choose one of "
            + ", ".join(STATE_ROUNDINGS),
        )
        _need(
            self.state_rounding == "nearest" or self.state_dtype == "bfloat16",
            f"train.opt_state_rounding={self.state_rounding!r} rounds bfloat16 moments; "
            f"train.opt_state_dtype={self.state_dtype!r} keeps them unrounded (set "
            "train.opt_state_dtype=bfloat16, or train.opt_state_rounding=nearest)",
        )
        _need(self.weight_decay >= 0, f"train.weight_decay={self.weight_decay} must be >= 0")
        if self.needs_full_gradient:
            g = config.grad_sync
            partial = not compression.spec_of(g).dense_estimate or g.get(
                "momentum_correction", False
            )
            _need(
                not partial,
                f"train.optimizer={self.name!r} orthogonalises the whole gradient; "
                f"grad_sync.compression={g.compression!r} sends only part of it (choose one of "
                + ", ".join(
                    n
                    for n, c in compression.COMPRESSORS.items()
                    if c.dense_estimate and not c.deprecated_for
                )
                + ")",
            )


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _unit_interval(value: float, field: str) -> None:
    _need(0.0 <= value < 1.0, f"{field}={value} must be in [0, 1)")


# The one registry of `train.optimizer` names: name -> spec class.
OPTIMIZERS: dict[str, type[OptimizerSpec]] = {}


def register(cls: type[OptimizerSpec]) -> type[OptimizerSpec]:
    """Class decorator: adds a spec to `OPTIMIZERS` under its `name`."""
    OPTIMIZERS[cls.name] = cls
    return cls


def spec(train_cfg: Any) -> OptimizerSpec:
    """The spec of `train.optimizer`, its fields read from `train_cfg`."""
    return OPTIMIZERS[train_cfg.optimizer].from_config(train_cfg)


@register
@dataclasses.dataclass(frozen=True)
class AdamW(OptimizerSpec):
    """AdamW (Loshchilov & Hutter 2019), eps 1e-8; decay on matrices only."""

    name: ClassVar[str] = "adamw"
    b1: float = 0.9
    b2: float = 0.95

    def transform(self, lr, wd_mask, axes_tree, mesh):
        return optax.adamw(
            lr, b1=self.b1, b2=self.b2, eps=1e-8, weight_decay=self.weight_decay, mask=wd_mask
        )

    def moments(self, axes):
        return 2

    def check(self, config):
        super().check(config)
        _unit_interval(self.b1, "train.b1")
        _unit_interval(self.b2, "train.b2")


@register
@dataclasses.dataclass(frozen=True)
class Lamb(AdamW):
    """LAMB (You et al. 2020): Adam's direction, eps 1e-6, scaled by the per-layer trust ratio."""

    name: ClassVar[str] = "lamb"

    def transform(self, lr, wd_mask, axes_tree, mesh):
        return optax.chain(
            optax.scale_by_adam(b1=self.b1, b2=self.b2, eps=1e-6),
            optax.add_decayed_weights(self.weight_decay, mask=wd_mask),
            scale_by_layerwise_trust_ratio(axes_tree),
            optax.scale_by_learning_rate(lr),
        )


@register
@dataclasses.dataclass(frozen=True)
class Lars(OptimizerSpec):
    """LARS (You et al. 2017): decayed gradient, trust ratio 0.001·‖w‖/‖u‖, then momentum."""

    name: ClassVar[str] = "lars"
    momentum: float = 0.9

    def transform(self, lr, wd_mask, axes_tree, mesh):
        return optax.chain(
            optax.add_decayed_weights(self.weight_decay, mask=wd_mask),
            scale_by_layerwise_trust_ratio(axes_tree, trust_coefficient=0.001, eps=0.0),
            optax.scale_by_learning_rate(lr),
            optax.trace(decay=self.momentum, nesterov=False),
        )

    def moments(self, axes):
        return 1

    def check(self, config):
        super().check(config)
        _unit_interval(self.momentum, "train.momentum")


@register
@dataclasses.dataclass(frozen=True)
class Sgd(OptimizerSpec):
    """SGD with momentum (none when `train.momentum` is 0; Nesterov with `train.nesterov`)."""

    name: ClassVar[str] = "sgd"
    momentum: float = 0.9
    nesterov: bool = False

    def transform(self, lr, wd_mask, axes_tree, mesh):
        return optax.chain(
            optax.add_decayed_weights(self.weight_decay, mask=wd_mask),
            optax.sgd(lr, momentum=self.momentum or None, nesterov=bool(self.nesterov)),
        )

    def moments(self, axes):
        return 1 if self.momentum else 0

    def check(self, config):
        super().check(config)
        _unit_interval(self.momentum, "train.momentum")


@register
@dataclasses.dataclass(frozen=True)
class Muon(AdamW):
    """Muon for the blocks' matrices, AdamW (b1, b2, weight_decay) for the rest (jaxdist/muon.py).

    Its own fields live in `train.muon`: momentum β, nesterov, ns_steps, bias_correction (optax's
    convention; torch's and Keller Jordan's is without) and distribution (`gather` | `auto`).
    """

    name: ClassVar[str] = "muon"
    section: ClassVar[str] = "muon"
    own: ClassVar[tuple[str, ...]] = (
        "momentum",
        "nesterov",
        "ns_steps",
        "bias_correction",
        "distribution",
    )
    needs_full_gradient: ClassVar[bool] = True
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = muon.NS_STEPS
    bias_correction: bool = False
    distribution: str = "gather"

    def transform(self, lr, wd_mask, axes_tree, mesh):
        labels = jax.tree.map(lambda use: "muon" if use else "adamw", muon.muon_mask(axes_tree))
        matrices = optax.chain(
            muon.scale_by_muon(
                axes_tree,
                beta=self.momentum,
                nesterov=self.nesterov,
                bias_correction=self.bias_correction,
                steps=self.ns_steps,
                mesh=mesh,
                distribution=self.distribution,
            ),
            optax.add_decayed_weights(self.weight_decay, mask=wd_mask),
            optax.scale_by_learning_rate(lr),
        )
        rest = super().transform(lr, wd_mask, axes_tree, mesh)
        return muon.partition({"muon": matrices, "adamw": rest}, labels)

    def moments(self, axes):
        return 1 if muon.matrix_dims(axes) is not None else 2

    def extra_flops(self, shape, axes):
        return muon.extra_flops(shape, axes, self.ns_steps)

    def wire_bytes(self, shape, axes, mesh_shape):
        if self.distribution != "gather":
            return 0.0  # XLA's choice: read it from the compiled step
        return muon.gather_bytes(shape, axes, mesh_shape)

    def check(self, config):
        super().check(config)
        _unit_interval(self.momentum, "train.muon.momentum")
        _need(
            isinstance(self.ns_steps, int) and self.ns_steps >= 1,
            f"train.muon.ns_steps={self.ns_steps!r} must be a positive integer (5 is standard)",
        )
        _need(
            self.distribution in muon.DISTRIBUTIONS,
            f"train.muon.distribution={self.distribution!r} is not valid; choose one of "
            + ", ".join(muon.DISTRIBUTIONS),
        )


def check(config: Any) -> None:
    """`train.optimizer`, `train.schedule`, `train.lr_scaling` and the optimizer's own rules;
    config.validate calls this.

    Raises:
      ConfigError: one line naming the field and what would be valid.
    """
    t = config.train
    for field, names in (
        ("optimizer", OPTIMIZERS),
        ("schedule", SCHEDULES),
        ("lr_scaling", LR_SCALINGS),
    ):
        _need(
            t[field] in names,
            f"train.{field}={t[field]!r} is not valid; choose one of {', '.join(names)}",
        )
    spec(t).check(config)


def build(
    train_cfg, axes_tree: Any, mesh: Any = None
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optimizer named by `train.optimizer`, with clipping, decay mask and schedule.

    Args:
      train_cfg: the `train` config.
      axes_tree: logical axes of the parameters.
      mesh: the device mesh (Muon's `distribution` lays its work out on it); None: XLA decides.
    """
    lr = schedule(train_cfg)
    opt = spec(train_cfg).build(lr, axes_tree, mesh)
    if train_cfg.grad_clip > 0:
        opt = optax.chain(optax.clip_by_global_norm(train_cfg.grad_clip), opt)
    return opt, lr
