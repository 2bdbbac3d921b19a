"""grad_sync.overlap: the gradient's reduction beside compute.

`backward`: each layer's gradient reduced inside the backward, as DDP's buckets are. The sums equal
the unoverlapped strategies' (`plain` for xla, `allreduce` for ring, `compressed` for bf16) on 8
devices, and the compiled program puts the layers' reduction inside the backward layer loop, where
the unoverlapped one has it after the loop.
`next_step`: each step's gradient reduced during the next step; the same training as
`grad_sync.staleness=1` with the same reduction.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from jaxdist import config
from jaxdist.errors import ConfigError
from tests.helpers import compile_step, tiny_gpt_config, train_steps

STEPS = 3


def _cfg(overlap: str, layers: int = 2, **grad_sync):
    c = tiny_gpt_config(data=8)
    c.model.num_layers = layers
    for k, v in grad_sync.items():
        c.grad_sync[k] = v
    c.grad_sync.overlap = overlap
    return c


def _max_abs_diff(a, b) -> float:
    return max(
        float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


# Parameters after 3 AdamW steps at lr <= 1e-2. xla and ring: the same f32 sums, reordered (a
# ring's chunks follow each layer's bucket): a few float32 ulps of the gradient, which Adam's
# normalised step turns into ~1e-8; the bound 1e-6 is 100 lr-ulps. bf16: the two strategies'
# per-replica gradients are computed by differently shaped programs (vmap against shard_map), so
# an element rounds to a neighbouring bf16 value on the wire now and then: a relative 2^-8 change
# of that element's gradient moves its Adam step by up to ~2^-8 lr per step, bounded here by
# STEPS * 2^-7 * lr_max = 2.3e-4. fp16: the same, but its sum is rounded too (at each addition),
# so both an input and the sum may land on a neighbouring float16 (2^-10 each): STEPS * 2 *
# 2^-10 * lr_max = 5.9e-5 (measured 3.6e-5). On one process the all-reduce adds in replica order,
# so the bucketing itself does not change a sum.
CASES = [
    ({}, 1e-6),
    ({"algorithm": "ring"}, 1e-6),
    ({"compression": "bf16"}, STEPS * 2.0**-7 * 1e-2),
    ({"compression": "fp16"}, STEPS * 2.0**-9 * 1e-2),
]


@pytest.mark.parametrize(("grad_sync", "atol"), CASES, ids=["xla", "ring", "bf16", "fp16"])
def test_overlapped_sums_equal_the_unoverlapped_strategy(grad_sync, atol):
    """Three layers: the top one's backward, one iteration of the reducing loop, the bottom
    layer's reduction after it."""
    want_losses, want = train_steps(_cfg("none", 3, **grad_sync), STEPS)
    got_losses, got = train_steps(_cfg("backward", 3, **grad_sync), STEPS)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6)
    assert _max_abs_diff(got, want) <= atol


def test_backward_with_remat_and_a_mixture_of_experts():
    """The reducing loop runs any layer: a rematerialized GPT block, and Mixtral's block, whose
    loop carries the router statistics beside the activations, on 8 devices, equal to XLA's own
    reduction (SGD at lr 0.5, as tests/test_mixtral.py: 1e-5). With the load-balancing loss
    (weight 0.01): each replica's loss averages the expert load over the replicas
    (`sharding.per_replica_loss`), so it is the batch's, as the plain strategy's (first loss
    5.572615; per replica, before, 5.572719)."""
    import configs.mixtral_tiny
    from tests.test_mixtral import tiny

    c = _cfg("backward", 3)
    c.train.remat = "full"
    ref = _cfg("none", 3)
    ref.train.remat = "full"
    moe = tiny(configs.mixtral_tiny, data=8)
    moe.model.moe_aux_loss_weight = 0.01
    moe_ov = moe.copy_and_resolve_references()
    moe_ov.grad_sync.overlap = "backward"
    for got_cfg, want_cfg, atol in ((c, ref, 1e-6), (moe_ov, moe, 1e-5)):
        want_losses, want = train_steps(want_cfg, STEPS)
        got_losses, got = train_steps(got_cfg, STEPS)
        np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6)
        assert _max_abs_diff(got, want) <= atol


@pytest.mark.parametrize(("grad_sync", "atol"), CASES, ids=["xla", "ring", "bf16", "fp16"])
def test_next_step_is_staleness_1(grad_sync, atol):
    """The update of step t applies step t-1's reduced gradient, the first step's is held: what
    `grad_sync.staleness=1` does (jaxdist/staleness.py), to the same tolerances."""
    want_losses, want = train_steps(_cfg("none", 3, staleness=1, **grad_sync), STEPS + 1)
    got_losses, got = train_steps(_cfg("next_step", 3, **grad_sync), STEPS + 1)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6)
    assert _max_abs_diff(got, want) <= atol


def _computations(hlo: str) -> dict[str, str]:
    """Computation name -> its text, from a compiled module's HLO."""
    out, name, lines = {}, None, []
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            name, lines = head.group(1), []
        elif line.startswith("}") and name is not None:
            out[name] = "\n".join(lines)
            name = None
        elif name is not None:
            lines.append(line)
    return out


def _collectives_in_loops(hlo: str, op: str) -> tuple[int, int]:
    """(count of `op` in while-loop bodies, count elsewhere) in the compiled module."""
    comps = _computations(hlo)
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    inside = sum(len(re.findall(rf" {op}(?:-start)?\(", comps[b])) for b in bodies if b in comps)
    total = len(re.findall(rf" {op}(?:-start)?\(", hlo))
    return inside, total - inside


@pytest.mark.parametrize(
    ("grad_sync", "op"),
    [
        ({"algorithm": "ring"}, "collective-permute"),
        ({"compression": "bf16"}, "all-to-all"),
        ({"compression": "fp16"}, "all-reduce"),
    ],
    ids=["ring", "bf16", "fp16"],
)
def test_the_layers_are_reduced_inside_the_backward_loop(grad_sync, op):
    """The unoverlapped program reduces every gradient after the layer loops; the overlapped one
    reduces the layers' inside a loop body (the backward's: the forward has no gradient). Four
    layers: the backward loop runs the three below the top one (a one-trip loop is inlined)."""
    _, plain = compile_step(_cfg("none", 4, **grad_sync))
    _, ov = compile_step(_cfg("backward", 4, **grad_sync))
    inside, outside = _collectives_in_loops(plain.as_text(), op)
    assert inside == 0 and outside > 0, (inside, outside)
    inside, outside = _collectives_in_loops(ov.as_text(), op)
    assert inside > 0 and outside > 0, (inside, outside)  # outside: embedding, head, norm


@pytest.mark.parametrize(
    ("mesh", "fields", "match"),
    [
        ({"data": 4, "fsdp": 2}, {}, "every other mesh axis 1 .not mesh.fsdp=2"),
        ({"data": 8}, {"grad_sync.compression": "powersgd"}, "compression in none, bf16"),
        ({"data": 8}, {"grad_sync.staleness": 1}, "staleness=0"),
        ({"data": 8}, {"train.grad_accum": 2}, "train.grad_accum=1"),
        ({"data": 8}, {"grad_sync.compression": "bf16", "grad_sync.algorithm": "ring"}, "'xla'"),
        ({"data": 1}, {}, "mesh.data > 1"),
        ({"data": 8}, {"grad_sync.overlap": "forward"}, "choose one of none, backward, next_step"),
    ],
)
def test_refused_in_one_line_before_compiling(mesh, fields, match):
    c = tiny_gpt_config(**mesh)
    c.grad_sync.overlap = "backward"  # unless `fields` says another
    for path, value in fields.items():
        group, name = path.split(".")
        c[group][name] = value
    with pytest.raises(ConfigError, match=match) as err:
        config.validate(c, sum(mesh.values()) if len(mesh) == 1 else 8)
    assert "\n" not in str(err.value)
