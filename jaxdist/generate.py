"""Autoregressive generation with a fixed-size key/value cache: one jitted prefill of the (padded)
prompts, then one jitted `lax.fori_loop` of single-token decode steps.

Prompts of different lengths are right-padded into one [B, P] batch. Row b's prompt fills cache
positions [0, len_b); its first new token is sampled from the logits at len_b - 1, and decode step
i writes position len_b + i - 1 and attends to positions <= it, so the padding a row's prefill
wrote past its prompt is overwritten before it could be read. The cache holds P + max_new_tokens
positions, so nothing is reallocated or recompiled while decoding.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxdist import sharding
from jaxdist.errors import ConfigError
from models.api import Decoder


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy (argmax); else softmax(logits / temperature) restricted to the
    `top_k` most likely tokens (0 = all) and to the smallest set whose probability reaches
    `top_p` (1 = all)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def check(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"--temperature={self.temperature} must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ConfigError(f"--top_k={self.top_k} must be >= 0 (0 = no limit)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top_p={self.top_p} must be in (0, 1]")


def sample_token(logits: jax.Array, key: jax.Array, s: Sampling) -> jax.Array:
    """One token id per row of logits [B, V] (float32)."""
    if s.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / s.temperature
    if s.top_k:
        kth = jax.lax.top_k(logits, min(s.top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if s.top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability of the more likely tokens
        sorted_logits = jnp.where(before >= s.top_p, -jnp.inf, sorted_logits)
        logits = (
            jnp.full_like(logits, -jnp.inf)
            .at[jnp.arange(logits.shape[0])[:, None], order]
            .set(sorted_logits)
        )
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@dataclasses.dataclass
class Result:
    tokens: list[list[int]]  # new tokens per prompt, cut after the first EOS
    prefill_s: float
    decode_s: float
    decode_tokens: int  # rows × decode steps timed

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")


def generate(
    decoder: Decoder,
    params: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    seed: int = 0,
    **options: Any,
) -> Result:
    """New tokens for each prompt (lists of ids), batched; `params` already on `mesh`'s devices.

    `options`: `prepare`'s (sampling, eos_id, mesh, cache_dtype). On `mesh`, rows are split over
    `data` and attention heads over `tensor` (the same logical rules as training); the prompts'
    count must then divide by mesh.data.
    """
    return prepare(decoder, params, prompts, max_new_tokens, **options)(seed)


def prepare(
    decoder: Decoder,
    params: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    sampling: Sampling = Sampling(),
    eos_id: int | None = None,
    mesh: Mesh | None = None,
    cache_dtype=jnp.float32,
) -> Callable[[int], Result]:
    """`generate`'s prefill and decode loop compiled once for these prompts (the compile is paid
    here, with one untimed prefill); returns `run(seed) -> Result`, which times each call's prefill
    and decode apart and can be called again, for repeated timings, without recompiling."""
    sampling.check()
    if max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens={max_new_tokens} must be >= 1")
    padded, lengths = _pad(prompts)
    B, P = padded.shape
    prefill, decode = _steps(
        decoder, B, P + max_new_tokens, max_new_tokens, sampling, mesh, cache_dtype
    )
    key = jax.random.key(0)
    put = lambda x: x
    if mesh is not None:
        axes = {2: ("batch", "length"), 1: ("batch",)}
        put = lambda x: jax.device_put(
            x,
            NamedSharding(
                mesh, sharding.logical_to_spec(axes[x.ndim], sharding.COMPUTE_RULES, mesh)
            ),
        )
    tokens, lens = put(padded), put(lengths)
    prefill_c = prefill.lower(params, tokens, lens, key).compile()
    first, cache = prefill_c(params, tokens, lens, key)  # untimed: decode is lowered on its output
    decode_c = decode.lower(params, first, cache, lens, key).compile()
    del first, cache

    def run(seed: int) -> Result:
        key = jax.random.key(seed)
        t0 = time.perf_counter()
        first, cache = jax.block_until_ready(prefill_c(params, tokens, lens, key))
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = np.asarray(jax.block_until_ready(decode_c(params, first, cache, lens, key)))
        decode_s = time.perf_counter() - t0
        rows = [r[: r.index(eos_id) + 1] if eos_id in r else r for r in out.tolist()]
        return Result(rows, prefill_s, decode_s, B * (max_new_tokens - 1))

    return run


def _pad(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """The prompts right-padded with 0 into [B, P] int32, and their lengths [B]."""
    if min(len(p) for p in prompts) == 0:
        raise ConfigError("a prompt encodes to no tokens; give a non-empty --prompt")
    padded = np.zeros((len(prompts), max(len(p) for p in prompts)), np.int32)
    for b, p in enumerate(prompts):
        padded[b, : len(p)] = p
    return padded, np.array([len(p) for p in prompts], np.int32)


def _steps(decoder, B: int, cache_len: int, max_new_tokens: int, sampling, mesh, cache_dtype):
    """The jitted prefill (prompts → first token, cache) and decode loop (→ [B, max_new_tokens])."""
    rules = sharding.COMPUTE_RULES

    def under_mesh(fn):
        @functools.wraps(fn)
        def wrapped(*args):
            if mesh is None:
                return fn(*args)
            with sharding.activation_rules(mesh, rules):
                return fn(*args)

        return wrapped

    @jax.jit
    @under_mesh
    def prefill(params, tokens, lengths, key):
        cache = decoder.init_cache(B, cache_len, cache_dtype)
        if mesh is not None:
            cache = jax.tree.map(
                lambda c, axes: sharding.constrain(c, axes),
                cache,
                decoder.cache_axes,
                is_leaf=lambda x: isinstance(x, jax.Array),
            )
        logits, cache = decoder.forward(params, tokens, jnp.zeros((B,), jnp.int32), cache)
        last = logits[jnp.arange(B), lengths - 1]  # [B, V]
        return sample_token(last, key, sampling), cache

    @jax.jit
    @under_mesh
    def decode(params, first, cache, lengths, key):
        out = jnp.zeros((B, max_new_tokens), jnp.int32).at[:, 0].set(first)

        def step(i, carry):
            out, cache = carry
            prev = jax.lax.dynamic_slice_in_dim(out, i - 1, 1, axis=1)  # [B, 1]
            logits, cache = decoder.forward(params, prev, lengths + i - 1, cache)
            tok = sample_token(logits[:, 0], jax.random.fold_in(key, i), sampling)
            return out.at[:, i].set(tok), cache

        out, _ = jax.lax.fori_loop(1, max_new_tokens, step, (out, cache))
        return out

    return prefill, decode
