"""The one registry of `grad_sync.compression` names (`COMPRESSORS`), and what reads it.

`COMPRESSORS` maps each name to its `CompressorSpec` (declared next to its code, one file per
method family). `check` applies the rules of the fields the chosen spec reads (`FIELD_RULES`) and
of its abilities, `from_config` builds the compressor, `preconditioner` the optimizer half that
replaces Adam's moments. No other module lists compressor names: ask the spec.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optax

from jaxdist.compression.casts import BF16, FP16, INT8, NONE
from jaxdist.compression.onebit import (
    ONEBIT_ADAM,
    TOPK_ADAM,
    TWOBIT_ADAM,
    frozen_variance_adam,
    onebit_adam,
)
from jaxdist.compression.powersgd import POWERSGD
from jaxdist.compression.randk import RANDK
from jaxdist.compression.replica import AxisName
from jaxdist.compression.sign import EF_SIGN, SIGN
from jaxdist.compression.spec import CompressorSpec, TrainFields, field
from jaxdist.compression.topk import TOPK
from jaxdist.compression_fields import COMPRESSION_FIELDS
from jaxdist.errors import ConfigError

# Registration: a new compressor is its file (with its spec) and one entry here.
COMPRESSORS: dict[str, CompressorSpec] = {
    s.name: s
    for s in (
        NONE, FP16, BF16, INT8, TOPK, POWERSGD, EF_SIGN, ONEBIT_ADAM, TWOBIT_ADAM, TOPK_ADAM, SIGN,
        RANDK,
    )
}  # fmt: skip


# The rule of every field a spec may read (one table with the defaults); `check` applies those of
# the chosen spec's fields.
FIELD_RULES = COMPRESSION_FIELDS


def spec_of(grad_sync_cfg: Any) -> CompressorSpec:
    """The spec `grad_sync.compression` names.

    Raises:
      ConfigError: an unknown name.
    """
    name = field(grad_sync_cfg, "compression")
    if name not in COMPRESSORS:
        raise ConfigError(
            f"grad_sync.compression={name!r} is not valid; choose one of {', '.join(COMPRESSORS)}"
        )
    return COMPRESSORS[name]


def _names(ability: Callable[[CompressorSpec], Any]) -> str:
    return " or ".join(
        repr(n) for n, s in COMPRESSORS.items() if ability(s) and not s.deprecated_for
    )


def check(grad_sync_cfg: Any) -> None:
    """The compressor fields' rules, each checked here only (config.validate calls this too).

    Accepts a ConfigDict or a plain dict; missing fields take the schema's defaults. The rules of
    jaxdist/compression_fields.py apply to the fields the chosen spec reads, then the abilities' rules, then the
    spec's own `check`.

    Raises:
      ConfigError: an unknown compressor, a field outside its rule (`rank` <= 0, `topk_ratio`
        outside (0, 1], `warmup_steps` < 0, `min_compression` < 1, `orthogonalization_epsilon`
        < 0, ...), or `momentum_correction` / `freeze_variance` / `momentum_masking=False` with a
        compressor that has no such ability, or momentum correction without error feedback.
    """
    spec = spec_of(grad_sync_cfg)
    if field(grad_sync_cfg, "momentum_correction"):
        if not spec.momentum_corrected:
            which = " or ".join(
                f"{n!r} ({s.momentum_corrected})"
                for n, s in COMPRESSORS.items()
                if s.momentum_corrected and not s.deprecated_for
            )
            raise ConfigError(
                f"grad_sync.momentum_correction applies to compression={which}, not {spec.name!r}"
            )
        if not field(grad_sync_cfg, "error_feedback"):
            raise ConfigError("grad_sync.momentum_correction needs grad_sync.error_feedback=True")
    if not field(grad_sync_cfg, "momentum_masking") and "momentum_masking" not in spec.fields:
        raise ConfigError(
            "grad_sync.momentum_masking=False applies to compression "
            f"{_names(lambda s: 'momentum_masking' in s.fields)} with momentum_correction=True "
            f"and freeze_variance=True, not {spec.name!r}"
        )
    for name in spec.fields:
        value = field(grad_sync_cfg, name)
        rule = FIELD_RULES[name]
        if not rule.ok(value):
            raise ConfigError(f"grad_sync.{name}={value!r} {rule.must}")
    if field(grad_sync_cfg, "freeze_variance") and not spec.freezes_variance:
        raise ConfigError(
            f"grad_sync.freeze_variance applies to compression "
            f"{_names(lambda s: s.freezes_variance)} "
            f"({_names(lambda s: s.preconditioner)} always freeze it), not {spec.name!r}"
        )
    spec.check(grad_sync_cfg)


def from_config(
    grad_sync_cfg: Any,
    axis_name: AxisName,
    *,
    momentum: float = 0.9,
    batch_dims: Any = None,
    betas: tuple[float, float] = (0.9, 0.95),
) -> optax.GradientTransformation:
    """The compressor `config.grad_sync` names, after `check`.

    Reads `compression` (a `COMPRESSORS` name) and the fields its spec lists (`spec.fields`;
    their meaning is in jaxdist/config.py and each method's docstring). `momentum` is the SGD
    momentum a momentum-corrected compressor applies inside; `betas` are Adam's (the 1-bit Adam
    family, and `momentum_correction` with `freeze_variance` under AdamW: each replica's own
    Adam momentum, DGC / 1-bit local Adam). Accepts a ConfigDict or a plain dict. `batch_dims`
    (a tree like the params) marks stacked-layer axes: every compressor treats each layer as a
    tensor of its own.

    Raises:
      ConfigError: see `check`.
    """
    check(grad_sync_cfg)
    spec = spec_of(grad_sync_cfg)
    t = TrainFields(momentum, betas[0], betas[1], batch_dims)
    local_adam = field(grad_sync_cfg, "momentum_correction") and field(
        grad_sync_cfg, "freeze_variance"
    )
    if local_adam and spec.local_adam is not None:  # under AdamW: each replica's own momentum
        return onebit_adam(
            axis_name, int(field(grad_sync_cfg, "warmup_steps")), b1=t.b1,
            batch_dims=t.batch_dims, local_momentum=True, **spec.local_adam(grad_sync_cfg),
        )  # fmt: skip
    return spec.build(axis_name, grad_sync_cfg, t)


def preconditioner(
    grad_sync_cfg: Any, betas: tuple[float, float] = (0.9, 0.95)
) -> optax.GradientTransformation | None:
    """The optimizer half that replaces Adam's moments, else None: the 1-bit Adam family's, or
    with `freeze_variance` (a spec with that ability) Adam whose variance freezes after
    `warmup_steps`."""
    spec = COMPRESSORS.get(field(grad_sync_cfg, "compression"))
    if spec is None:
        return None
    if spec.freezes_variance and field(grad_sync_cfg, "freeze_variance"):
        warmup = int(field(grad_sync_cfg, "warmup_steps"))
        # with momentum_correction each replica's Adam momentum is what is sent
        takes = "momentum" if field(grad_sync_cfg, "momentum_correction") else "gradient"
        return frozen_variance_adam(warmup, b1=betas[0], b2=betas[1], takes=takes)
    if spec.preconditioner is None:
        return None
    return spec.preconditioner(grad_sync_cfg, TrainFields(b1=betas[0], b2=betas[1]))


def residual_fields() -> tuple[str, ...]:
    """Every state field name a registered compressor keeps compression error in."""
    return tuple(dict.fromkeys(f for s in COMPRESSORS.values() for f in s.residual_fields))


def deprecated(grad_sync_cfg: Any) -> str | None:
    """The new name where `grad_sync.compression` is an old one (accepted, with a warning)."""
    spec = COMPRESSORS.get(field(grad_sync_cfg, "compression"))
    return None if spec is None else spec.deprecated_for
