"""FP8 matmuls for the transformer blocks (`train.matmul_precision`), dynamic per-tensor scaling.

The recipe is torchao's "tensorwise" Float8 training with power-of-two scales
(`Float8LinearConfig(round_scales_to_power_of_2=True)`). The FP8 operands go to the dot itself
(`preferred_element_type` the compute dtype) and its output is rescaled: XLA's GPU GEMM rewriter
turns each such dot into one cuBLASLt FP8 GEMM with the scales folded in (measured with
`scripts/fp8_probe.py` on jax 0.11.2 / H100: 3 FP8 GEMMs for a linear layer's forward and two
gradients). The quantize-dequantize form Flax's `linen.fp8_ops` writes is kept as a study
lowering (`set_lowering("qdq")`): on that XLA it compiles to bf16 GEMMs, and the FP8 rounding
itself is gone from the compiled program (no convert into FP8 survives), docs/FP8.md.
For y = x·w,

  forward   s_x = 2^⌊log2(448 / amax(|x|))⌋, s_w likewise    (float32; e4m3's max is 448)
            x8 = e4m3(clip(x·s_x, ±448)), w8 = e4m3(clip(w·s_w, ±448))   (round to nearest even)
            y  = (x8 / s_x) · (w8 / s_w)                          (a dot in the compute dtype)
  backward  s_g = 2^⌊log2(57344 / amax(|g|))⌋, g8 = e5m2(clip(g·s_g, ±57344))
            dx = (g8 / s_g) · (w8 / s_w)ᵀ,  dw = (x8 / s_x)ᵀ · (g8 / s_g)

Power-of-two scales make the dequantize q / s exact in bf16 as in float32 (a bf16 copy of
448 / amax would be off by up to 2⁻⁹, the same way for every element of the tensor), at the cost of
up to one bit of the FP8 range. Scales are "current" (computed from the tensor being cast, every
step): there is no state to checkpoint, reshard or resume. The backward keeps x8 and w8 (one byte an element) and reuses them,
as torchao's tensorwise recipe does. Under sharding the amax is a global max (XLA adds the
all-reduce), so the result does not depend on the layout; inside a pipeline stage it is the stage's
microbatch's, as under `train.grad_accum`.

What runs in FP8 is decided per matmul from its global shapes, K the contracted size and N the
weight's output size: `fp8` follows torchao's `_auto_filter_for_tensorwise` (skip when K or N is not
a multiple of 16, or K <= 4096 and N <= 1024, where on an H100 the casts cost more than the faster
GEMM saves); `fp8_all` casts every block matmul whose K and N are multiples of 16 (for studies of
the numerics on small models). The embedding, the vocabulary head, norms, the MoE router and
experts, and attention's own products never call `einsum` here and stay in the compute dtype.

The mode is read at trace time from `precision(...)`, which the train and eval steps enter
(jaxdist/train.py); outside it every call is a plain `jnp.einsum`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

MODES = ("default", "fp8", "fp8_all")
E4M3 = jnp.float8_e4m3fn  # inputs and weights
E5M2 = jnp.float8_e5m2  # output gradients
EPS = 1e-12  # amax floor (torchao's `EPS`): an all-zero tensor gets a finite scale
MIN_K, MIN_N = 4096, 1024  # `fp8` skips a matmul with K <= MIN_K and N <= MIN_N
ALIGN = 16  # FP8 GEMMs need K and N multiples of 16
# The forward's scales, named for `jax.checkpoint`: every `train.remat` policy keeps them
# (models/api.py), so a backward that recomputes a layer casts again with the forward's scales
# instead of reading each operand once more for its amax (4 bytes each).
SCALE_NAME = "fp8_scale"

# How the FP8 GEMM reaches XLA (`set_lowering`): "direct" (the default) feeds the FP8 operands to
# the dot itself (`preferred_element_type` the compute dtype) and scales its output; "qdq"
# dequantizes each FP8 operand (convert, then divide by its scale) right before a dot in the
# compute dtype, the pattern openxla's GPU GEMM rewriter was written to fold (on jax 0.11.2's XLA
# it does not, and the FP8 rounding is simplified away). Both compute the same values
# (power-of-two scales: every dequantize and rescale is exact).
LOWERINGS = ("direct", "qdq")
_lowering = "direct"

_state = threading.local()


def set_lowering(name: str) -> None:
    """Selects `LOWERINGS`' form for the FP8 matmuls traced from now on (a study knob: only
    "direct" gives FP8 GEMMs on jax 0.11.2 / H100, `scripts/fp8_probe.py`)."""
    global _lowering
    if name not in LOWERINGS:
        raise ValueError(f"FP8 lowering {name!r} is not one of {LOWERINGS}")
    _lowering = name


@contextlib.contextmanager
def precision(mode: str) -> Iterator[None]:
    """Runs the block matmuls traced inside it at `mode` (one of `MODES`)."""
    if mode not in MODES:
        raise ValueError(f"matmul precision {mode!r} is not one of {MODES}")
    old = getattr(_state, "mode", "default")
    _state.mode = mode
    try:
        yield
    finally:
        _state.mode = old


def current() -> str:
    """The mode of the innermost `precision` block ("default" outside any)."""
    return getattr(_state, "mode", "default")


@contextlib.contextmanager
def traced() -> Iterator[list[tuple[str, bool]]]:
    """Collects (spec, in FP8?) for every block matmul `einsum` traces inside it: what the
    compiled program should hold (3 FP8 GEMMs per FP8 matmul, forward and both gradients)."""
    old, _state.calls = getattr(_state, "calls", None), []
    try:
        yield _state.calls
    finally:
        _state.calls = old


def _sizes(spec: str, x_shape, w_shape) -> tuple[int, int]:
    """(K, N) of `spec` "x,w->y": K the product of the contracted dims, N of w's kept dims."""
    ins, out = spec.replace(" ", "").split("->")
    xs, ws = ins.split(",")
    dim = dict(zip(xs, x_shape, strict=True)) | dict(zip(ws, w_shape, strict=True))
    k = n = 1
    for c in ws:
        if c in xs and c not in out:
            k *= dim[c]
        elif c in out:
            n *= dim[c]
    return k, n


def _transposable(spec: str) -> bool:
    """Whether both gradients of `spec` are einsums of the other two terms: no index of an operand
    is summed away on its own (as in "ij,jk->k")."""
    xs, ws, ys = _terms(spec)
    return all(c in ys or c in ws for c in xs) and all(c in ys or c in xs for c in ws)


def eligible(mode: str, k: int, n: int) -> bool:
    """Whether a matmul of contracted size `k` and output size `n` runs in FP8 at `mode`."""
    if mode == "default" or k % ALIGN or n % ALIGN:
        return False
    return mode == "fp8_all" or not (k <= MIN_K and n <= MIN_N)


def scale(x: jax.Array, dtype) -> jax.Array:
    """float32 s = max(dtype) / max(amax(|x|), EPS) rounded down to a power of two: x·s spans
    the upper half of the FP8 range or more, and q / s is exact in any float dtype."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    s = jnp.float32(jnp.finfo(dtype).max) / jnp.maximum(amax, EPS)
    _, e = jnp.frexp(s)  # s = m·2^e, m in [0.5, 1): the power of two at or below s is 2^(e-1)
    return jnp.ldexp(jnp.float32(1), e - 1)


def quantize(x: jax.Array, dtype, s: jax.Array) -> jax.Array:
    """x·s in float32, saturated to ±max(dtype), rounded to `dtype` (nearest even)."""
    fmax = jnp.float32(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) * s, -fmax, fmax).astype(dtype)


def dequantize(q: jax.Array, s: jax.Array, dtype) -> jax.Array:
    """q / s in `dtype`: the form XLA folds into the FP8 GEMM's scale operands."""
    return q.astype(dtype) / s.astype(dtype)


def _scaled_einsum(spec: str, a: jax.Array, sa: jax.Array, b: jax.Array, sb: jax.Array, dtype):
    """einsum of the FP8 operands `a` (scale `sa`) and `b` (scale `sb`), in `dtype`: the values of
    (a / sa)·(b / sb), lowered as `_lowering` says."""
    if _lowering == "direct":
        y = jnp.einsum(spec, a, b, preferred_element_type=dtype)  # accumulated in float32
        return y * (1 / (sa * sb)).astype(dtype)
    return jnp.einsum(spec, dequantize(a, sa, dtype), dequantize(b, sb, dtype))


def _terms(spec: str) -> tuple[str, str, str]:
    ins, out = spec.replace(" ", "").split("->")
    xs, ws = ins.split(",")
    return xs, ws, out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_einsum(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    return _fp8_fwd(spec, x, w)[0]


def _fp8_fwd(spec, x, w):
    sx, sw = (checkpoint_name(scale(t, E4M3), SCALE_NAME) for t in (x, w))
    x8, w8 = quantize(x, E4M3, sx), quantize(w, E4M3, sw)
    y = _scaled_einsum(spec, x8, sx, w8, sw, x.dtype)
    # Zero-size markers carry the operands' dtypes (residuals must be arrays).
    return y, (x8, sx, w8, sw, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _fp8_bwd(spec, res, g):
    x8, sx, w8, sw, xdt, wdt = res
    sg = scale(g, E5M2)
    g8 = quantize(g, E5M2, sg)
    xs, ws, ys = _terms(spec)
    # The einsum's two transposes (every index of x and of w appears in y or in the other
    # operand: `eligible_spec`), each an e5m2 × e4m3 GEMM.
    dx = _scaled_einsum(f"{ys},{ws}->{xs}", g8, sg, w8, sw, xdt.dtype)
    dw = _scaled_einsum(f"{xs},{ys}->{ws}", x8, sx, g8, sg, wdt.dtype)
    return dx, dw


_fp8_einsum.defvjp(_fp8_fwd, _fp8_bwd)


def einsum(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`jnp.einsum(spec, x, w)` for a block's activation `x` and weight `w`, in FP8 when the
    current `precision` mode and the matmul's sizes (`eligible`) say so.

    Args:
      spec: a two-operand einsum, activation first, e.g. "btd,df->btf".
      x: the activations (e4m3 forward, cast per tensor).
      w: the weight (e4m3, cast per tensor).
    """
    mode = current()
    cast = (
        mode != "default"
        and _transposable(spec)
        and eligible(mode, *_sizes(spec, x.shape, w.shape))
    )
    if getattr(_state, "calls", None) is not None:
        _state.calls.append((spec, cast))
    return _fp8_einsum(spec, x, w) if cast else jnp.einsum(spec, x, w)
