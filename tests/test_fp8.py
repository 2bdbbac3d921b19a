"""FP8 block matmuls (jaxdist/fp8.py): torchao's emulation as the reference, sharding, refusals.

The reference is torchao's `Float8LinearConfig(emulate=True, round_scales_to_power_of_2=True)`
tensorwise recipe on one nn.Linear with the same weights, inputs and output gradient. Both sides
quantize to the same FP8 values (the scale max/amax is one correctly rounded float32 division
rounded down to a power of two, the casts round to nearest even, saturated), and with power-of-two
scales the dequantized values are exact, so the two can differ only by the float32 rounding of the
dot's products and sums. Higham's bound for a K-term float32 dot, |ŷ − y| <= γ_K·Σ|a||b| with
γ_K = K·u/(1 − K·u) < (K + 2)·u, u = 2⁻²⁴; the test holds both to the float64 product of the FP8
values computed with ml_dtypes at (K + 2)·u·Σ|a||b|. That is ~1e-5 relative, far below e4m3's
half-ulp 2⁻⁴ and e5m2's 2⁻³: the unquantized float32 matmul and a gradient cast to e4m3 instead of
e5m2 are checked to fall outside it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxdist import fp8
from jaxdist.errors import ConfigError
from models import api
from tests import helpers

M, K, N = 64, 64, 48  # tokens, in features, out features (multiples of 16)
U = 2.0**-24


def _inputs():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((M, K)).astype(np.float32)
    x[3, 5] = 40.0  # an outlier sets x's scale, as activations' outliers do
    w = (0.05 * rng.standard_normal((K, N))).astype(np.float32)
    g = (1e-4 * rng.standard_normal((M, N))).astype(np.float32)  # small, as loss gradients are
    return x, w, g


def _q(a: np.ndarray, dtype) -> np.ndarray:
    """ml_dtypes' exact cast of the tensorwise-scaled `a`, dequantized, in float64."""
    fmax = float(ml_dtypes.finfo(dtype).max)
    s = np.float32(np.float64(fmax) / max(float(np.abs(a).max()), fp8.EPS))
    s = np.float32(2.0 ** (np.frexp(s)[1] - 1))  # rounded down to a power of two
    q = np.clip(a.astype(np.float32) * s, -fmax, fmax).astype(dtype)
    return q.astype(np.float64) / np.float64(s)


def _bound(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a.shape[-1] + 2) * U * (np.abs(a) @ np.abs(b))


def _exact(x, w, g, grad_dtype=ml_dtypes.float8_e5m2):
    """(y, dx, dw) in float64 from the FP8 values, and each one's float32 error bound."""
    xq, wq, gq = _q(x, ml_dtypes.float8_e4m3fn), _q(w, ml_dtypes.float8_e4m3fn), _q(g, grad_dtype)
    pairs = ((xq, wq), (gq, wq.T), (xq.T, gq))
    return [a @ b for a, b in pairs], [_bound(a, b) for a, b in pairs]


def _jaxdist(x, w, g):
    def f(x, w):
        with fp8.precision("fp8_all"):
            return fp8.einsum("md,df->mf", x, w)

    y, vjp = jax.vjp(f, jnp.asarray(x), jnp.asarray(w))
    return [np.asarray(a, np.float64) for a in (y, *vjp(jnp.asarray(g)))]


def _torchao(x, w, g):
    torch = pytest.importorskip("torch")
    float8 = pytest.importorskip("torchao.float8", reason="torchao (the hf extra) is the reference")
    lin = torch.nn.Sequential(torch.nn.Linear(K, N, bias=False))
    with torch.no_grad():
        lin[0].weight.copy_(torch.from_numpy(w.T.copy()))
    config = float8.Float8LinearConfig(emulate=True, round_scales_to_power_of_2=True)
    float8.convert_to_float8_training(lin, config=config)
    assert type(lin[0]).__name__ == "Float8Linear"
    xt = torch.from_numpy(x.copy()).requires_grad_(True)
    y = lin(xt)
    y.backward(torch.from_numpy(g.copy()))
    return [t.detach().double().numpy() for t in (y, xt.grad, lin[0].weight.grad.T)]


@pytest.fixture(params=fp8.LOWERINGS)
def lowering(request):
    fp8.set_lowering(request.param)
    yield request.param
    fp8.set_lowering("direct")


def test_matches_torchao_tensorwise_within_float32_rounding(lowering):
    x, w, g = _inputs()
    exact, bounds = _exact(x, w, g)
    ours, theirs = _jaxdist(x, w, g), _torchao(x, w, g)
    for name, o, t, e, b in zip(("y", "dx", "dw"), ours, theirs, exact, bounds, strict=True):
        assert np.all(np.abs(o - e) <= b), f"jaxdist {name} off the FP8 product"
        assert np.all(np.abs(t - e) <= b), f"torchao {name} off the FP8 product"
        assert np.all(np.abs(o - t) <= 2 * b), name
    # The bound tells FP8 from not: unquantized float32 and an e4m3 output gradient break it.
    plain = [x.astype(np.float64) @ w, g @ w.T.astype(np.float64), x.T.astype(np.float64) @ g]
    for name, p, e, b in zip(("y", "dx", "dw"), plain, exact, bounds, strict=True):
        assert np.any(np.abs(p - e) > b), f"{name}: the bound cannot see the FP8 rounding"
    e4m3_grads, _ = _exact(x, w, g, grad_dtype=ml_dtypes.float8_e4m3fn)
    for name, i in (("dx", 1), ("dw", 2)):
        assert np.any(np.abs(e4m3_grads[i] - exact[i]) > bounds[i]), f"{name}: e5m2 unseen"


def test_the_lowering_decides_what_the_dot_sees(lowering):
    """The "direct" lowering hands the FP8 values to the dots themselves (forward e4m3 × e4m3, backward
    e5m2 × e4m3); "qdq" hands them dequantized, for XLA's rewriter to fold."""
    x, w, _ = _inputs()

    def loss(x, w):
        with fp8.precision("fp8_all"):
            return jnp.sum(fp8.einsum("md,df->mf", x, w) ** 2)

    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(jnp.asarray(x), jnp.asarray(w)).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    f8_dots = [d for d in dots if "f8E4M3FN" in d.split(":", 1)[-1].split("->")[0]]
    assert len(dots) == 3, dots
    assert len(f8_dots) == (3 if lowering == "direct" else 0), dots
    if lowering == "direct":
        assert sum("f8E5M2" in d.split("->")[0] for d in dots) == 2  # the two gradients


def test_an_einsum_whose_gradient_is_not_an_einsum_stays_plain():
    assert not fp8._transposable("md,df->f") and fp8._transposable("btnh,nhd->btd")
    x, w, _ = _inputs()
    with fp8.precision("fp8_all"):
        got = fp8.einsum("md,df->f", jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.einsum("md,df->f", x, w)))


def test_eligibility_follows_torchaos_tensorwise_filter():
    assert not fp8.eligible("default", 8192, 8192)
    assert not fp8.eligible("fp8", 4096, 1024)  # K <= 4096 and N <= 1024: too small to gain
    assert fp8.eligible("fp8", 4096, 1040) and fp8.eligible("fp8", 4112, 1024)
    assert not fp8.eligible("fp8", 8200, 8192)  # K not a multiple of 16
    assert fp8.eligible("fp8_all", 64, 48) and not fp8.eligible("fp8_all", 64, 40)
    assert fp8._sizes("btd,dcnh->cbtnh", (2, 8, 64), (64, 3, 4, 16)) == (64, 192)
    assert fp8._sizes("btnh,nhd->btd", (2, 8, 4, 16), (4, 16, 64)) == (64, 64)


def _e4m3_casts(mode: str) -> tuple[int, list[tuple[str, bool]], int]:
    """Conversions to e4m3 in the lowered (not compiled) train step of a tiny GPT, the block
    matmuls `fp8.traced` saw (spec, cast?), and the number of layers."""
    c = helpers.tiny_gpt_config(data=1)
    c.train.matmul_precision = mode
    eng, batches = helpers.engine_for(c)
    shapes, dtypes = batches.global_shapes(), {"inputs": np.int32, "targets": np.int32}
    with fp8.traced() as calls:
        text = eng.train_step.lower(
            eng.abstract_state, eng.abstract_batch(shapes, dtypes)
        ).as_text()
    return text.count("xf8E4M3FN>"), calls, c.model.num_layers


def test_block_matmuls_cast_only_under_the_mode():
    for mode, casts in (("default", False), ("fp8", False), ("fp8_all", True)):
        n, calls, layers = _e4m3_casts(mode)  # "fp8": d_model 32 is below torchao's bar
        assert (n > 0) == casts, (mode, n)
        # a GPT block's four matmuls (qkv, out, up, down): once (the layer scan traces its body
        # once) or once per layer
        assert len(calls) in (4, 4 * layers) and {c for _, c in calls} == {casts}, calls


def _amax_reductions(remat: str) -> int:
    """Max-reductions in the lowered train step of a tiny GPT at `fp8_all` and `remat` (the
    amaxes of the FP8 operands, and the softmax's and the loss's own maxima)."""
    c = helpers.tiny_gpt_config(data=1)
    c.train.matmul_precision, c.train.remat = "fp8_all", remat
    eng, batches = helpers.engine_for(c)
    shapes, dtypes = batches.global_shapes(), {"inputs": np.int32, "targets": np.int32}
    text = eng.train_step.lower(eng.abstract_state, eng.abstract_batch(shapes, dtypes)).as_text()
    return text.count("applies stablehlo.maximum")


def test_a_recomputed_layer_casts_with_the_forwards_scales(monkeypatch):
    """Every remat policy keeps the FP8 scales (`fp8.SCALE_NAME`): the backward's recomputation
    casts again but takes no amax again. Without them it takes all 8 (x and w of the GPT block's 4
    matmuls, in the scanned layer body) once more."""
    kept = _amax_reductions("dots_no_batch")
    plain = {n: p.policy for n, p in api.REMAT.items() if p.policy is not None}
    monkeypatch.setattr(api, "REMAT_POLICIES", plain)
    assert _amax_reductions("dots_no_batch") == kept + 8


def _losses(mode: str, **mesh):
    c = helpers.tiny_gpt_config(**mesh)
    c.model.name = "llama"
    c.model.num_kv_heads = 2
    c.train.matmul_precision = mode
    return helpers.train_steps(c, 2)


def test_fp8_sharded_data_fsdp_tensor_equals_one_device():
    one, p1 = _losses("fp8_all", data=1)
    eight, p8 = _losses("fp8_all", data=2, fsdp=2, tensor=2)
    # Same global amax on every layout (XLA all-reduces the max), so the same FP8 values; what
    # remains is float32 reduction order, which the next step's casts can move by one FP8 ulp.
    np.testing.assert_allclose(eight, one, rtol=2e-3)
    for a, b in zip(jax.tree.leaves(p8), jax.tree.leaves(p1), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-3)
    assert np.all(np.isfinite(one))


def test_refusals_name_the_field():
    c = helpers.tiny_gpt_config(data=1)
    c.train.matmul_precision = "fp16"
    with pytest.raises(ConfigError, match=r"train.matmul_precision='fp16' is not valid.*fp8"):
        helpers.engine_for(c)
    c = helpers.tiny_gpt_config(data=1)
    c.model.name = "mlp"
    c.data.source = "digits"
    c.train.matmul_precision = "fp8"
    with pytest.raises(ConfigError, match=r"model.name='mlp' has none"):
        helpers.engine_for(c)


@pytest.mark.parametrize("axis", ["context", "expert"])
def test_composes_with_pipeline_context_expert_and_a_compressor(axis):
    """pipeline=2 × `axis`=2 × data=2 with bf16 gradient compression at fp8_all: the stages'
    shard_map is manual over `axis`, where each device's amax is its own slice's (jaxdist/fp8.py).
    The step's program casts to e4m3, and two steps train: finite, the first loss within 1% of an
    untrained model's ln(vocab)."""
    from tests.test_pipeline_context_expert import _config, _moe_config

    sizes = dict(pipeline=2, data=2, **{axis: 2})
    c = _moe_config(4.0, 2, **sizes) if axis == "expert" else _config("all_gather", **sizes)
    c.grad_sync.compression = "bf16"
    c.train.matmul_precision = "fp8_all"
    eng, batches = helpers.engine_for(c)
    shapes, dtypes = batches.global_shapes(), {"inputs": np.int32, "targets": np.int32}
    lowered = eng.train_step.lower(eng.abstract_state, eng.abstract_batch(shapes, dtypes))
    assert "xf8E4M3FN>" in lowered.as_text()
    step, state, losses = lowered.compile(), eng.init(), []
    for i in range(2):
        state, m = step(state, batches.get(i))
        losses.append(float(m["loss"]))
    assert np.all(np.isfinite(losses)), losses
    np.testing.assert_allclose(losses[0], np.log(c.model.vocab_size), rtol=1e-2)
