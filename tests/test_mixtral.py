"""The Mixtral family checked by `transformers` itself: one tiny random `MixtralForCausalLM` (torch,
CPU, float32; 8 experts of width 48, top-2, on d_model 32) imported with `scripts/hf.py import`
gives jaxdist's logits, greedy continuations and Hugging Face's pooled load-balancing loss (and its
gradient); trained 2 steps on fsdp × tensor × expert from it and exported, transformers loads it
with jaxdist's logits; pipelined like one device; Mixtral-8x7B's shape planned."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

transformers = pytest.importorskip(
    "transformers", reason="needs the hf extra: pip install -e '.[hf]' (transformers, torch)"
)
torch = pytest.importorskip("torch", reason="needs the hf extra: pip install -e '.[hf]'")

import models  # noqa: E402
from jaxdist import config as config_lib  # noqa: E402
from jaxdist import plan, weights  # noqa: E402
from jaxdist.errors import ConfigError  # noqa: E402
from models import api  # noqa: E402
from tests.helpers import compile_step, python, train_steps  # noqa: E402
from tests.test_hf import REPO, TOKENS, VOCAB, hf_logits, jaxdist_logits, run_script  # noqa: E402
from tests.test_sample import hf_greedy  # noqa: E402

PROMPTS = [[5, 17, 3], [40, 20, 9, 9, 11, 60, 7], [88], [10, 30, 31, 32, 50]]
E, K = 8, 2
# Mixtral-8x7B's parameter count (mistralai/Mixtral-8x7B-v0.1: "46.7B total parameters"):
# 2 × 32000 × 4096 (embedding, head) + 32 × (attention 41,943,040 + router 32,768 + 8 experts ×
# 176,160,768 + 2 norms × 4096) + 4096 (final norm).
MIXTRAL_8X7B_PARAMS = 46_702_792_704


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """(model, folder, jaxdist run imported from it): a random MixtralForCausalLM, 2 layers, d 32,
    4 heads of 8 sharing 2 key/value heads, 8 SwiGLU experts of 48, top-2, vocabulary 96,
    `output_router_logits` with coefficient 0.02; every norm away from 1, so a swapped or
    missing norm weight shows. Imported once (in process: `scripts/hf.py import`'s function)."""
    tmp = tmp_path_factory.mktemp("mixtral")
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_local_experts=E,
        num_experts_per_tok=K,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        output_router_logits=True,
        router_aux_loss_coef=0.02,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = transformers.MixtralForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(tmp / "hf")
    weights.import_hf(str(tmp / "hf"), str(tmp / "run"))  # what `scripts/hf.py import` runs
    return model, tmp / "hf", tmp / "run"


def test_saved_layout_is_one_tensor_per_expert(hf_model):
    """What transformers 5 writes (and the published checkpoints hold): `block_sparse_moe`'s
    router and w1/w2/w3 per expert, not its in-memory fused `gate_up_proj`; jaxdist's map names
    exactly those tensors."""
    from safetensors import safe_open

    from jaxdist import hf

    _, hf_dir, run = hf_model
    with safe_open(str(hf_dir / "model.safetensors"), "np") as f:
        names = set(f.keys())
    assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in names
    assert not any("gate_up_proj" in n for n in names)
    m = weights.resolve(str(run)).config.model
    assert (m.name, m.num_experts, m.experts_per_token, m.moe_aux_loss_weight) == (
        "mixtral",
        E,
        K,
        0.02,
    )
    assert set(hf.hf_names(m)) == names


def test_import_logits_and_greedy_generation_equal_transformers(hf_model, tmp_path):
    """Imported logits within 1e-4 of transformers' (fp32); `sample.py --prompt_ids` on data=2 ×
    tensor=2 continues each prompt as `generate(do_sample=False)` does, token for token."""
    model, _, run = hf_model
    check_import_and_greedy(model, run, tmp_path, "mixtral")


def check_import_and_greedy(model, run, tmp_path, label: str) -> None:
    """`model`'s logits and greedy continuations of `PROMPTS` against the imported `run`'s."""
    ref = hf_logits(model, TOKENS)
    ours = jaxdist_logits(run, TOKENS)
    print(f"{label} imported logits max |Δ| = {np.abs(ours - ref).max():.3g}")
    assert np.abs(ours - ref).max() <= 1e-4, np.abs(ours - ref).max()
    assert np.abs(ref).max() > 1  # logits of a few units, so 1e-4 is a tight bound

    expected = [hf_greedy(model, ids) for ids in PROMPTS]
    assert all(len(set(e)) > 1 for e in expected)  # not one repeated token
    out = tmp_path / "out.jsonl"
    cmd = [python(), "scripts/sample.py", f"--checkpoint={run}"]
    cmd += [f"--prompt_ids={json.dumps(ids)}" for ids in PROMPTS]
    cmd += ["--max_new_tokens=32", "--temperature=0", f"--out={out}", "--data=2", "--tensor=2"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    agree = sum(r["tokens"] == e for r, e in zip(records, expected, strict=True))
    print(f"{label} greedy generation: {agree} of {len(PROMPTS)} prompts equal token for token")
    assert [r["tokens"] for r in records] == expected


def test_router_aux_loss_and_its_gradient_equal_transformers(hf_model):
    """jaxdist's `moe_lb_loss` on the imported weights is HF's `aux_loss` (all layers' router
    logits pooled, `load_balancing_loss_func`) within 1e-6, and its gradient is HF's (the
    routers' and, through them, the attention's) within 1e-6; the per-layer mean the Llama
    family's MoE uses would differ."""
    model, _, run = hf_model
    check_aux_loss(model, run, "mixtral")


def imported(run) -> tuple[api.AbstractModel, dict]:
    """(abstract model, params on one device) of the imported `run`."""
    src = weights.resolve(str(run))
    m = src.config.model
    abstract_model = api.abstract_model(models.get(m.name).make(m, None))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params = weights.load_params(
        src,
        jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
            abstract_model.params,
        ),
    )
    return abstract_model, params


def check_aux_loss(model, run, label: str) -> None:
    """The imported `run`'s `moe_lb_loss` and its gradient against `model`'s `aux_loss`."""
    abstract_model, params = imported(run)
    batch = {"inputs": TOKENS, "targets": TOKENS}
    lb = lambda p: abstract_model.merge(p).loss(batch)[1]["moe_lb_loss"]
    value, grads = jax.jit(jax.value_and_grad(lb))(params)

    model.zero_grad()
    out = model(torch.from_numpy(TOKENS.astype(np.int64)), output_router_logits=True)
    out.aux_loss.backward()
    delta = abs(float(value) - out.aux_loss.item())
    print(f"{label} router aux loss |Δ| = {delta:.3g} (HF {out.aux_loss.item():.6f})")
    assert delta <= 1e-6, (float(value), out.aux_loss.item())
    for i, layer in enumerate(model.model.layers):
        want = layer.mlp.gate.weight.grad.numpy().T  # [D, E]
        np.testing.assert_allclose(grads["layers"]["router"][i], want, rtol=0, atol=1e-6)
        assert np.abs(want).max() > 1e-3
    shape = grads["layers"]["wq"].shape[1:]  # [D, N, H]
    want_wq = model.model.layers[0].self_attn.q_proj.weight.grad.numpy().T.reshape(shape)
    np.testing.assert_allclose(grads["layers"]["wq"][0], want_wq, rtol=0, atol=1e-7)
    assert np.abs(want_wq).max() > 1e-4

    # What pooling changes: the mean over layers of each layer's E · Σ_e k·f_e·P_e differs.
    with torch.no_grad():
        logits = model(torch.from_numpy(TOKENS.astype(np.int64)), output_router_logits=True)
    pooled_loss = sys.modules[type(model).__module__].load_balancing_loss_func
    per_layer = [float(pooled_loss((g,), E, K)) for g in logits.router_logits]
    assert abs(np.mean(per_layer) - out.aux_loss.item()) > 1e-4


def check_masked_aux_loss(model, run, label: str) -> None:
    """Packed rows' padding (`data.packing=documents`: segment id 0) left out of the router
    statistics: rows of 24, 8 and 4 real tokens, right-padded, give the `moe_lb_loss` that
    transformers computes with the same `attention_mask` (within 1e-6); with the padding counted
    HF's differs by more than 1e-3 (the check can fail)."""
    abstract_model, params = imported(run)
    mask = (np.arange(TOKENS.shape[1])[None, :] < np.array([[24], [8], [4]])).astype(np.int32)
    positions = np.broadcast_to(np.arange(TOKENS.shape[1], dtype=np.int32), TOKENS.shape)
    batch = {"inputs": TOKENS, "targets": TOKENS, "segment_ids": mask, "positions": positions}
    lb = lambda p: abstract_model.merge(p).loss(batch)[1]["moe_lb_loss"]
    value = float(jax.jit(lb)(params))
    tokens = torch.from_numpy(TOKENS.astype(np.int64))
    with torch.no_grad():
        masked = model(tokens, attention_mask=torch.from_numpy(mask), output_router_logits=True)
        counted = model(tokens, output_router_logits=True)
    want, all_tokens = masked.aux_loss.item(), counted.aux_loss.item()
    delta = abs(value - want)
    print(
        f"{label} router aux loss, padding masked: |Δ| = {delta:.3g} (HF {want:.6f}; "
        f"padding counted {all_tokens:.6f})"
    )
    assert delta <= 1e-6, (value, want)
    assert abs(all_tokens - want) > 1e-3


def test_router_aux_loss_skips_padding_as_transformers(hf_model):
    """`check_masked_aux_loss` on the imported Mixtral."""
    model, _, run = hf_model
    check_masked_aux_loss(model, run, "mixtral")


def test_init_from_trains_sharded_then_exports_to_transformers(hf_model, tmp_path):
    """`train.py --config=configs/mixtral_tiny.py --config.train.init_from=RUN`, 2 steps on
    fsdp=2 × tensor=2 × expert=2 (4 experts per device) → export → transformers loads it with no
    missing or unexpected keys, and its logits are jaxdist's within 1e-4."""
    _, _, run = hf_model
    check_train_export(run, tmp_path, "configs/mixtral_tiny.py", "MixtralForCausalLM", "mixtral")


def check_train_export(run, tmp_path, config: str, arch: str, label: str) -> None:
    """2 steps of `config` (fsdp × tensor × expert) from `run`, exported, loaded by transformers
    as `arch` with no missing or unexpected keys and jaxdist's logits."""
    np.random.default_rng(1).integers(0, VOCAB, 20_000).astype(np.uint16).tofile(tmp_path / "t.bin")
    work = tmp_path / "ft"
    cmd = [python(), "scripts/train.py", f"--config={config}"]
    cmd += [f"--workdir={work}", f"--config.train.init_from={run}"]
    cmd += [f"--config.data.source={tmp_path / 't.bin'}", "--config.model.seq_len=32"]
    cmd += ["--config.train.steps=2", "--config.checkpoint.every=2", "--config.train.batch_size=8"]
    cmd += ["--config.train.eval_batches=1", "--config.train.warmup_steps=0"]
    cmd += ["--config.train.learning_rate=0.01"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "initialised from" in proc.stdout
    records = [json.loads(x) for x in (work / "metrics.jsonl").read_text().splitlines()]
    mesh = {k: v for k, v in records[0]["mesh"].items() if v > 1}
    assert mesh == {"fsdp": 2, "tensor": 2, "expert": 2}, records[0]["mesh"]
    lb = [r["moe_lb_loss"] for r in records if "moe_lb_loss" in r]
    assert lb and all(v > 1 for v in lb), records  # HF's loss: k when balanced
    run_script("export", work, "--out", tmp_path / "out")
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True
    )
    assert type(loaded).__name__ == arch
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ours = jaxdist_logits(work, TOKENS)
    delta = np.abs(hf_logits(loaded.float().eval(), TOKENS) - ours).max()
    print(f"{label} trained, exported, reloaded logits max |Δ| = {delta:.3g}")
    assert delta <= 1e-4, delta
    assert np.abs(ours - jaxdist_logits(run, TOKENS)).max() > 1e-3  # it trained


def tiny(config_module, *, router_loss: bool = False, **mesh_sizes):
    """A tiny MoE config on a subset of the 8 devices, SGD (as tests/test_llama.py, why); the
    load-balancing loss at the config's weight with `router_loss`, else none."""
    c = config_module.get_config()
    c.unlock()
    for axis in config_lib.MESH_AXES:
        c.mesh[axis] = mesh_sizes.get(axis, 1)
    c.model.seq_len, c.train.batch_size, c.train.warmup_steps = 32, 8, 0
    if not router_loss:
        c.model.moe_aux_loss_weight = 0.0
    c.train.optimizer, c.train.learning_rate = "sgd", 0.5
    c.data.max_bytes = 400_000
    return c


def _tiny(**mesh_sizes):
    import configs.mixtral_tiny

    return tiny(configs.mixtral_tiny, **mesh_sizes)


def check_pipeline(config_module, schedule: str = "1f1b") -> None:
    """`schedule` over 2 stages × expert=2 × data=2, 2 microbatches, with the family's pooled
    load-balancing loss: 3 float32 steps' losses (rtol 1e-5) and parameters (router and experts
    included, atol 1e-5) equal one device's. The pooled loss is not linear in the stages'
    statistics: 1f1b adds its linearization at the batch's, from a forward pass first
    (`pipeline.gradients._linearized_aux`); without that pass the losses differ by 0.02."""
    ref_losses, ref_params = train_steps(tiny(config_module, router_loss=True), 3)
    c = tiny(config_module, router_loss=True, pipeline=2, expert=2, data=2)
    assert c.model.moe_aux_loss_weight > 0
    c.pipeline.schedule, c.pipeline.microbatches = schedule, 2
    losses, params = train_steps(c, 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < losses[0]
    assert {"router", "e_gate", "e_up", "e_down"} <= set(params["layers"])
    flat = jax.tree_util.tree_leaves_with_path(params)
    for (path, a), b in zip(flat, jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_matches_single_device(schedule):
    """`check_pipeline` on configs/mixtral_tiny.py: 1f1b (the linearized router loss) and gpipe
    (the autodiff of the batch's pooled loss)."""
    import configs.mixtral_tiny

    check_pipeline(configs.mixtral_tiny, schedule)


def test_planner_prices_the_forward_pass_the_router_loss_adds():
    """With the pooled router loss, a 1f1b step runs the forward ticks once more: the compiled
    program's lock-step FLOPs grow by 33%, and the planner's prediction by the same share within
    1% (the planner's MoE FLOPs themselves are about half the compiled program's, which also
    counts the dispatch einsums as dots: the ratio is compared, not the totals). gpipe
    differentiates the pooled loss directly and runs no extra pass, unless it sits inside
    grad_sync's shard_map over `data` (here `grad_sync.algorithm=ring`), where it runs the pass
    as 1f1b does: +33% compiled, and the planner's share within 1% too."""
    from jaxdist import pipeline

    def lockstep(schedule, router_loss, **grad_sync):
        import configs.mixtral_tiny

        c = tiny(configs.mixtral_tiny, router_loss=router_loss, pipeline=4, data=2)
        c.model.num_layers = 4
        c.pipeline.schedule, c.pipeline.microbatches = schedule, 4
        c.grad_sync.update(grad_sync)
        eng, compiled = compile_step(c)
        # the layout record's `pipeline.lockstep_flops`, without the rest of the record
        compiled_flops = pipeline.lockstep_flops(compiled.as_text(), eng.schedule)["lockstep_flops"]
        return compiled_flops, plan.predict(c, hw="cpu_here", num_devices=8).lockstep_flops

    for schedule, grad_sync in (("1f1b", {}), ("gpipe", {"algorithm": "ring"})):
        (with_loss, pred_with) = lockstep(schedule, True, **grad_sync)
        (without, pred_without) = lockstep(schedule, False, **grad_sync)
        assert with_loss / without > 1.25, (schedule, with_loss, without)
        assert pred_with / pred_without == pytest.approx(with_loss / without, rel=0.01), schedule
    assert lockstep("gpipe", True) == lockstep("gpipe", False)


def test_mixtral_8x7b_is_validated_and_planned():
    """configs/mixtral_8x7b.py: Mixtral-8x7B's parameter count, valid on 8 devices, and planned
    through the family's `plan_cost` for 64 H100s (a layout that fits, experts idle as counted;
    pipelined layouts among those priced, the pooled loss included)."""
    import configs.mixtral_8x7b

    c = configs.mixtral_8x7b.get_config()
    config_lib.validate(c, 8)
    family = models.get("mixtral")
    model = api.abstract_model(family.make(c.model, None))
    assert sum(int(np.prod(p.shape)) for p in jax.tree.leaves(model.params)) == MIXTRAL_8X7B_PARAMS
    cost = family.plan_cost(c.model, model.params)
    assert cost.label == "Mixtral (2 of 8 experts)"
    assert cost.idle_params == 32 * 6 * 3 * 4096 * 14336  # 6 of 8 experts' weights per layer
    result = plan.plan(c, 64, "h100_nvlink_ib", remats=["dots_no_batch"])
    best = result.recommended
    assert result.model["label"] == "Mixtral (2 of 8 experts)"
    assert best is not None and best.fits, best
    assert any(p.layout.pipeline > 1 for p in result.predictions)
    print(
        f"mixtral_8x7b on 64 H100s: {best.layout}, {best.memory['total'] / 2**30:.1f} GiB, {best.step_s:.2f} s"
    )


def test_bad_mixtral_config_is_one_line(hf_model, tmp_path):
    """A sliding-window or jittered Mixtral folder, top-1 routing, and context parallelism: one
    ConfigError line each, before anything is built."""
    _, hf_dir, _ = hf_model
    cfg = json.loads((hf_dir / "config.json").read_text())
    for field, value, want in (
        ("sliding_window", 4096, "sliding_window=4096 is not supported"),
        ("router_jitter_noise", 0.1, "router_jitter_noise=0.1 is not supported"),
    ):
        folder = tmp_path / field
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(cfg | {field: value}))
        with pytest.raises(ConfigError, match=want) as e:
            weights.resolve(str(folder))
        assert "\n" not in str(e.value)
    c = _tiny()
    c.model.experts_per_token = 1
    with pytest.raises(ConfigError, match=r"model.experts_per_token=1 must be an integer in \[2"):
        config_lib.validate(c, 1)
    c = _tiny(context=2)
    with pytest.raises(ConfigError, match="mesh.context=2 needs a model that runs over it"):
        config_lib.validate(c, 2)
