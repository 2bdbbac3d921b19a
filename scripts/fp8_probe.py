"""Which FP8 matmul forms this GPU's XLA turns into cuBLASLt FP8 GEMMs, and how fast each runs.

One linear layer at a 1B model's shape (x [16, 2048, 2048] bf16, w [2048, 8192]), forward and
both gradients, compiled in several forms: plain bf16, `jaxdist.fp8.einsum` under each lowering
(3-D and 2-D activations), and XLA's own test pattern (operands already FP8, dequantized by a
multiply right before the dot). For each: the GEMMs in the compiled HLO (`benchlib.gemm_counts`:
FP8 cuBLASLt calls and Triton FP8 fusions, the other GEMMs) and the median time of a call. With --dump_dir, XLA writes
each module before and after its GEMM rewriter passes there, to read why a dot was not rewritten.

  python scripts/fp8_probe.py [--out=FILE.json] [--dump_dir=DIR] [--iters=20]

On a CPU it runs the same forms at a tiny size (no FP8 GEMMs exist there) as a dry run.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

from absl import app, flags

_OUT = flags.DEFINE_string("out", "", "write the rows as JSON here")
_DUMP = flags.DEFINE_string("dump_dir", "", "XLA dumps of the GEMM rewriter passes, here")
_ITERS = flags.DEFINE_integer("iters", 20, "timed calls per form")


def forms(jnp, fp8, on_gpu: bool):
    """name -> (function of (x, w, g), its inputs' maker)."""
    import jax

    b, t, d, f = (16, 2048, 2048, 8192) if on_gpu else (2, 16, 32, 64)

    def fwd_bwd(matmul):
        def step(x, w, g):
            y, vjp = jax.vjp(matmul, x, w)
            return y, *vjp(g)

        return step

    def jaxdist_form(spec, mode="fp8_all"):
        def matmul(x, w):
            with fp8.precision(mode):
                return fp8.einsum(spec, x, w)

        return matmul

    def canonical(a8, sa, b8, sb):  # XLA's gemm_rewriter_fp8_test pattern, forward only
        return jnp.dot(
            a8.astype(jnp.bfloat16) * sa.astype(jnp.bfloat16),
            b8.astype(jnp.bfloat16) * sb.astype(jnp.bfloat16),
        )

    key = jax.random.key(0)
    kx, kw, kg = jax.random.split(key, 3)
    x3 = jax.random.normal(kx, (b, t, d), jnp.bfloat16)
    w = (jax.random.normal(kw, (d, f), jnp.float32) * d**-0.5).astype(jnp.bfloat16)
    g3 = jax.random.normal(kg, (b, t, f), jnp.bfloat16)
    x2, g2 = x3.reshape(b * t, d), g3.reshape(b * t, f)
    one = jnp.float32(1.0)
    return {
        "bf16_3d": (fwd_bwd(lambda x, w: jnp.einsum("btd,df->btf", x, w)), (x3, w, g3), None),
        "qdq_3d": (fwd_bwd(jaxdist_form("btd,df->btf")), (x3, w, g3), "qdq"),
        "qdq_2d": (fwd_bwd(jaxdist_form("md,df->mf")), (x2, w, g2), "qdq"),
        "direct_3d": (fwd_bwd(jaxdist_form("btd,df->btf")), (x3, w, g3), "direct"),
        "direct_2d": (fwd_bwd(jaxdist_form("md,df->mf")), (x2, w, g2), "direct"),
        "xla_pattern_fwd": (
            canonical,
            (x2.astype(jnp.float8_e4m3fn), one, w.astype(jnp.float8_e4m3fn), one),
            None,
        ),
    }


def main(argv):
    del argv
    if _DUMP.value:
        os.makedirs(_DUMP.value, exist_ok=True)
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_dump_to={_DUMP.value} --xla_dump_hlo_pass_re=.*gemm.*"
            + " --xla_dump_hlo_module_re=.*probe.*"
        )
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import benchlib  # scripts/, beside this file

    from jaxdist import fp8

    on_gpu = jax.default_backend() == "gpu"
    print(
        f"backend {jax.default_backend()} {jax.devices()[0].device_kind} jax {jax.__version__}"
        + ("" if on_gpu else " (dry run: tiny sizes, no FP8 GEMMs on a CPU)"),
        flush=True,
    )
    rows = []
    for name, (fn, args, lowering) in forms(jnp, fp8, on_gpu).items():
        fp8.set_lowering(lowering or "direct")
        fn.__name__ = f"probe_{name}"
        jitted = jax.jit(fn)
        t0 = time.perf_counter()
        compiled = jitted.lower(*args).compile()
        compile_s = time.perf_counter() - t0
        row = {"form": name, "lowering": lowering, "compile_s": round(compile_s, 2)}
        hlo = compiled.as_text()
        row |= benchlib.gemm_counts(hlo)
        # roundings to FP8 left in the compiled program (none: XLA simplified the cast away)
        row["f8_converts"] = len(re.findall(r"f8e(?:4m3fn|5m2)\[[^\]]*\][^ ]* convert\(", hlo))
        jax.block_until_ready(compiled(*args))
        times = []
        for _ in range(_ITERS.value):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times.append(time.perf_counter() - t0)
        row["median_ms"] = round(sorted(times)[len(times) // 2] * 1e3, 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    fp8.set_lowering("direct")
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    app.run(main)
