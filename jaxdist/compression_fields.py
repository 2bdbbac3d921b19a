"""The `grad_sync` fields compressors read: each one's default, meaning and rule, in one table.

The one place these are written down: jaxdist/config.py builds its `grad_sync` defaults from
`COMPRESSION_FIELDS`, a compressor's spec (jaxdist/compression/spec.py) names the fields it reads
and `compression.check` applies their rules. A leaf (no imports) so the schema can read it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

TOPK_EXCHANGES = ("all_gather", "two_phase")  # grad_sync.topk_exchange


class Field(NamedTuple):
    """One `grad_sync` field: its default, what it means, its rule and a value the rule refuses."""

    default: Any
    doc: str
    ok: Callable[[Any], bool] = lambda x: True
    must: str = ""  # completes "grad_sync.<field>=<value> ..." when `ok` is False
    bad: Any = None  # an invalid value (the registry-driven refusal tests use it)


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) or type(x).__name__.startswith("int")


def _flag(x: Any) -> bool:
    return isinstance(x, bool) or type(x).__name__ == "bool_"


def _flag_field(default: bool, doc: str) -> Field:
    return Field(default, doc, _flag, "must be True or False", 2)


COMPRESSION_FIELDS: dict[str, Field] = {
    "compression": Field("none", "the compressor: a `compression.COMPRESSORS` name"),
    "rank": Field(
        2, "powersgd: rank of the factors", lambda x: _int(x) and x > 0,
        "must be a positive integer, e.g. 2", 0,
    ),
    "topk_ratio": Field(
        0.01, "topk, topk_adam, randk: fraction of each tensor's entries sent",
        lambda x: 0 < x <= 1, "must be in (0, 1], e.g. 0.01", 0.0,
    ),
    "error_feedback": _flag_field(True, "keep what was not sent and add it next step"),
    "warmup_steps": Field(
        0, "topk: density warm-up; powersgd/ef_sign: dense first steps; onebit_adam / "
        "twobit_adam: Adam steps before the variance freezes; local SGD: synced steps",
        lambda x: _int(x) and x >= 0, "must be an integer >= 0", -1,
    ),
    "momentum_correction": _flag_field(False, "topk (DGC) / ef_sign: the SGD momentum inside"),
    "momentum_masking": _flag_field(
        True, "DGC under AdamW: zero a replica's momentum where sent"
    ),
    "min_compression": Field(
        1.0, "powersgd: compress only where n m > this * rank (n + m)", lambda x: x >= 1,
        "must be >= 1", 0.5,
    ),
    "warm_start": _flag_field(True, "powersgd: reuse last step's Q (False: a fresh Gaussian Q)"),
    "orthogonalization_epsilon": Field(
        0.0, "powersgd: 0 = QR; > 0 = Gram-Schmidt + eps", lambda x: x >= 0,
        "must be >= 0, e.g. 0 or 1e-8", -1.0,
    ),
    "stochastic_rounding": _flag_field(
        False, "int8: unbiased random rounding instead of nearest"
    ),
    "freeze_variance": _flag_field(
        False, "topk/powersgd/ef_sign + adamw: variance frozen after warm-up"
    ),
    "topk_exchange": Field(
        "all_gather", "topk: all_gather | two_phase (bytes flat in R)",
        lambda x: x in TOPK_EXCHANGES, f"is not valid; choose one of {', '.join(TOPK_EXCHANGES)}",
        "ring",
    ),
}  # fmt: skip
