"""configs/llama3_8b.py: Llama-3.1-8B's shape, validated and built abstractly on 8 devices (no
array of it is ever made), its rope frequencies equal to transformers' Llama 3 rule, and planned."""

from __future__ import annotations

import json
import os
import subprocess

import jax
import numpy as np
import pytest

from jaxdist import config as config_lib
from jaxdist import data, mesh, train
from tests.helpers import python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Llama-3.1-8B's parameter count as transformers reports it for meta-llama/Llama-3.1-8B:
# 2 × 128256 × 4096 (embedding, untied head) + 32 × 218,112,000 (a block) + 4096 (final norm).
LLAMA31_8B_PARAMS = 8_030_261_248


def load():
    import configs.llama3_8b

    return configs.llama3_8b.get_config()


def test_shape_is_llama_3_1_8b():
    m = load().model
    assert (m.name, m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.head_dim) == (
        "llama", 32, 4096, 32, 8, 128
    )  # fmt: skip
    assert (m.mlp_dim, m.vocab_size, m.seq_len, m.tie_embeddings) == (14336, 128256, 8192, False)
    assert m.rope_theta == 500000.0 and m.rope_scaling.type == "llama3"
    assert load().train.compute_dtype == "bfloat16"


def test_abstract_state_on_8_devices_has_8b_parameters_sharded_8_ways():
    c = load()
    assert len(jax.devices()) == 8
    config_lib.validate(c, 8)
    c.data.max_bytes = 200_000  # the model is what is checked; the data only has to exist
    ds = data.load(c.data, seq_len=c.model.seq_len, vocab_size=c.model.vocab_size)
    engine = train.build(c, mesh.make_mesh(c.mesh), ds)  # abstract: eval_shape, no arrays
    assert mesh.mesh_shape(engine.mesh) == {"data": 1, "fsdp": 8, "tensor": 1, "pipeline": 1}
    assert engine.num_params == LLAMA31_8B_PARAMS
    params = jax.tree.leaves(engine.abstract_state["params"])
    assert all(isinstance(p, jax.ShapeDtypeStruct) for p in params)
    per_device = sum(
        int(np.prod(p.sharding.shard_shape(p.shape))) * p.dtype.itemsize for p in params
    )
    total = sum(int(np.prod(p.shape)) * p.dtype.itemsize for p in params)
    # FSDP over 8: every large weight is split 8 ways (the norms, 0.0004%, are replicated).
    assert per_device == pytest.approx(total / 8, rel=1e-4)


def test_rope_frequencies_equal_transformers_llama3_rule():
    transformers = pytest.importorskip("transformers", reason="needs the hf extra")
    pytest.importorskip("torch", reason="needs the hf extra")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    import models.llama as llama

    m = load().model
    hf = transformers.LlamaConfig(
        hidden_size=m.d_model,
        num_attention_heads=m.num_heads,
        head_dim=m.head_dim,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": m.rope_theta, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    )  # fmt: skip
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    np.testing.assert_allclose(llama.inverse_frequencies(m), theirs.numpy(), rtol=1e-6)


def test_planner_recommends_fsdp_within_the_node_and_data_across_nodes(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    plans = {}
    for devices, batch in ((8, 8), (32, 32)):
        out = tmp_path / f"plan{devices}.json"
        cmd = [python(), "scripts/plan.py", "--config=configs/llama3_8b.py"]
        cmd += [f"--devices={devices}", "--hardware=h100_nvlink_ib", f"--out={out}"]
        cmd += [f"--config.train.batch_size={batch}"]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        plans[devices] = (json.loads(out.read_text())["recommended"], proc.stdout)
    one_node, stdout = plans[8]
    assert one_node["name"] == "fsdp8" and one_node["fits"], one_node
    four_nodes, stdout = plans[32]
    assert four_nodes["name"] == "data4×fsdp8" and four_nodes["fits"], four_nodes
    assert "--config.mesh.dcn_data=4" in stdout  # the data axis is the one across the 4 hosts


def test_docstring_quotes_the_planners_bf16_and_fp8_predictions():
    """configs/llama3_8b.py's predicted tokens/s per GPU on 8 H100s, bf16 and FP8, are what the
    planner gives for its layout today (so the docstring cannot go stale), FP8 the faster."""
    import re

    import configs.llama3_8b
    from jaxdist import plan

    per_gpu = {}
    for mode in ("default", "fp8"):
        c = load()
        c.train.matmul_precision = mode
        p = plan.predict(c, num_devices=8, hw="h100_nvlink_ib")
        per_gpu[mode] = c.train.batch_size * c.model.seq_len / p.step_s / 8
    doc = " ".join(configs.llama3_8b.__doc__.split())
    quoted = {
        mode: float(
            re.search(rf"([\d,]+) tokens/s per GPU in {word}", doc).group(1).replace(",", "")
        )
        for mode, word in (("default", "bf16"), ("fp8", "FP8"))
    }
    for mode in per_gpu:
        assert quoted[mode] == pytest.approx(per_gpu[mode], abs=10), (mode, per_gpu)
    assert per_gpu["fp8"] > 1.2 * per_gpu["default"]


def test_cluster_files_carry_the_planners_layout():
    """scripts/k8s/llama3_8b.yaml and docs/CLUSTER.md's sbatch line: 4 processes of 8 GPUs, the
    flags `plan.py --devices=32` prints, processes = parallelism = completions = mesh.dcn_data."""
    import re

    import yaml

    with open(os.path.join(ROOT, "scripts/k8s/llama3_8b.yaml")) as f:
        jobset = yaml.safe_load(f)
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    (container,) = job["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    flags = ["--config.mesh.data=4", "--config.mesh.fsdp=8", "--config.mesh.dcn_data=4"]
    assert job["parallelism"] == job["completions"] == int(env["JAXDIST_NUM_PROCESSES"]) == 4
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container["args"][0] == "--config=configs/llama3_8b.py"
    assert set(flags) <= set(container["args"])
    with open(os.path.join(ROOT, "docs/CLUSTER.md")) as f:
        (sbatch,) = re.findall(r"^sbatch .*$", f.read(), re.M)
    assert "--nodes=4 --ntasks-per-node=1 --gpus-per-task=8" in sbatch
    assert all(flag in sbatch.split() for flag in flags)
