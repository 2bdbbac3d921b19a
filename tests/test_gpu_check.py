"""`bash scripts/gpu_check.sh` on a machine without a GPU: the tiny CPU dry run of every phase.

The figures it prints are CPU timings and are never asserted; what is checked is that every phase
and every row of issue 35 (gpt, llama, the 8B-shape proxy with its layers fitted by the planner,
FP8 twins where the schema has them, attention=auto, decode beside transformers) ran and wrote
what the table is built from, that correctness checks can fail (they did, once, when
the family check ran a step at learning rate 0), and that `model.attention=cudnn` is refused with
one line before compiling.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.helpers import python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _has_fp8() -> bool:
    from jaxdist.schema import base_config

    return "matmul_precision" in base_config().train


HAS_FP8 = _has_fp8()


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "PYTHON": python(), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,  # every row of issue 35 in its own process: minutes on a busy 2-core machine
    )
    return out, proc


def test_dry_run_says_so_and_exits_zero(dry_run):
    out, proc = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "no GPU" in proc.stdout and "dry run only" in proc.stdout
    assert "| point | model | batch |" in proc.stdout  # the table is printed at the end
    assert (out / "gpu_check.md").read_text().startswith("# GPU check")


def test_env_and_correctness_checks(dry_run):
    out, _ = dry_run
    env = json.loads((out / "env.json").read_text())
    assert env["backend"] == "cpu" and env["versions"]["jax"]
    checks = {c["name"]: c for c in json.loads((out / "correct.json").read_text())}
    assert all(c["ok"] for c in checks.values()), checks
    assert "loss" in checks["default job, 6 steps"]["detail"]  # 20 on a GPU
    refusal = checks["attention=cudnn vs xla"]["detail"]
    assert "model.attention='cudnn' needs NVIDIA GPUs" in refusal and "\n" not in refusal
    packed = checks["packed documents: xla segment mask"]["detail"]  # cuDNN's, run through XLA
    assert "vs each document alone" in packed and "the check sees a leak" in packed
    families = [name for name in checks if name.startswith("two train steps")]
    assert len(families) >= 3  # gpt, mlp, resnet (and every family config added later)


def test_sweep_points_have_timings_and_predictions(dry_run):
    out, _ = dry_run
    points = {p.stem: json.loads(p.read_text()) for p in (out / "points").glob("*.json")}
    ok = points["tiny_gpt_bf16"]
    assert ok["ok"] and ok["framework"]["n"] == 3 and ok["framework"]["median_s"] > 0
    assert ok["hand_written"]["n"] == 3 and ok["framework_vs_hand"] > 0
    assert ok["predicted"]["hardware"] == "cpu_here" and ok["predicted"]["step_time_s"] > 0
    assert ok["compiled_bytes"]["temp"] > 0 and "mfu" not in ok  # no peak known on a CPU
    assert points["tiny_b8_full_auto"]["ok"] and points["tiny_b8_full_auto"]["remat"] == "full"
    refused = points["tiny_b8_cudnn"]
    assert not refused["ok"] and refused["error"].startswith("ConfigError: model.attention='cudnn'")
    summary = json.loads((out / "gpu_check.json").read_text())
    fp8 = fp8_rows() if HAS_FP8 else []
    assert [p["label"] for p in summary["points"]] == [
        "tiny_gpt_bf16",
        "tiny_llama_bf16",
        "tiny_8b_proxy_bf16",
        *fp8,
        "tiny_b8_full_auto",
        "tiny_b8_cudnn",
    ]


def test_llama_rows_and_the_8b_proxy(dry_run):
    out, proc = dry_run
    points = {p.stem: json.loads(p.read_text()) for p in (out / "points").glob("*.json")}
    llama, proxy = points["tiny_llama_bf16"], points["tiny_8b_proxy_bf16"]
    assert llama["ok"] and llama["model"] == "llama" and llama["block_matmuls_per_layer"] == 7
    assert points["tiny_gpt_bf16"]["block_matmuls_per_layer"] == 4  # wqkv, wo, w_up, w_down
    # configs/llama3_8b.py's row: layers chosen by the planner (no memory limit on a CPU: the most)
    assert proxy["ok"] and proxy["fit_layers"]["layers"] == proxy["layers"] == 2
    for r in (llama, proxy):
        assert r["predicted"]["step_time_s"] > 0 and r["loss_finite"]
        assert r["gemms"]["fp8_cublaslt"] == 0  # a CPU has no cuBLAS
    md = (out / "gpu_check.md").read_text()
    assert "| precision |" in md and "| FP8 GEMMs (per layer) |" in md
    assert "`tiny_b8_full_auto`: attention=auto ran 0 cuDNN forward" in md  # XLA on a CPU
    assert "`tiny_8b_proxy_bf16`: 2 layers" in md
    if HAS_FP8:
        assert all(
            points[n]["ok"] and points[n]["matmul_precision"] == "fp8_all" for n in fp8_rows()
        )
        lowering = {n: points[n]["fp8_lowering"] for n in fp8_rows()}
        assert lowering == {n: "qdq" if n.endswith("_qdq") else "direct" for n in fp8_rows()}
        for n in fp8_rows():  # where the FP8 values went, and the HLO to read it from
            assert points[n]["f8_census"]["results"].get("convert", 0) > 0, points[n]["f8_census"]
            assert (out / "hlo" / f"{n}.txt.gz").stat().st_size > 0
        # fp8_all casts every block matmul: 3 GEMMs each expected, none on a CPU
        assert (
            "`tiny_gpt_fp8_qdq`: 0 FP8 GEMMs (0 cuBLASLt + 0 Triton; 0.0 a layer, 12.0 "
            "expected: 3 × 4 of the 4 block matmuls pass the size rule)" in md
        ), md
        assert points["tiny_llama_fp8"]["fp8_matmuls_per_layer"] == 7
        assert not any(points[n]["fp8_all_blocks"] for n in fp8_rows())
    else:
        skip = "FP8 rows skipped: this tree's config schema has no train.matmul_precision"
        assert skip in proc.stdout and skip in md


def test_decode_row_beside_transformers(dry_run):
    out, _ = dry_run
    d = json.loads((out / "decode.json").read_text())
    assert d["study"] == "decode_vs_transformers" and d["config"] == "configs/llama_tiny.py"
    assert set(d["rows"]) == {"batch 1"}
    for row in d["rows"].values():
        assert row["agreement"]["tokens_equal"] == 1.0
        assert row["jaxdist"]["tokens_per_s"] > 0 and row["transformers"]["tokens_per_s"] > 0
    md = (out / "gpu_check.md").read_text()
    assert "## Decode: jaxdist vs transformers' generate" in md
    assert json.loads((out / "gpu_check.json").read_text())["decode"]["rows"] == d["rows"]


def fp8_rows() -> list[str]:
    return ["tiny_gpt_fp8", "tiny_llama_fp8", "tiny_8b_proxy_fp8", "tiny_gpt_fp8_qdq"]


def test_gemm_counts_read_the_compiled_hlo(monkeypatch):
    """FP8 GEMMs are cuBLASLt custom calls with their own target, or Triton GEMM fusions whose
    dot takes FP8 operands; other GEMMs are counted apart, so an FP8 recipe whose matmuls fell
    back to bf16 shows as other GEMMs, not FP8 ones."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))
    import benchlib

    hlo = "\n".join(
        [
            "%a = (bf16[16,64]{1,0}, s8[0]{0}) custom-call(f8e4m3fn[16,32]{1,0} %x, "
            'f8e4m3fn[64,32]{1,0} %w, f32[] %s, f32[] %t), custom_call_target="__cublas$lt$matmul$f8"',
            "%b = (bf16[16,64]{1,0}, s8[0]{0}) custom-call(bf16[16,32]{1,0} %x, bf16[32,64]{1,0} %w), "
            'custom_call_target="__cublas$gemm"',
            "%c = bf16[16,64]{1,0} fusion(%x, %w), kind=kCustom, calls=%f, "
            'backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}',
            "%d = bf16[16,64]{1,0} dot(f8e5m2[16,32]{1,0} %g, f8e4m3fn[32,64]{1,0} %w), "
            "lhs_contracting_dims={1}, rhs_contracting_dims={0}",
            '%e = f32[2,2]{1,0} custom-call(f32[2,2]{1,0} %p), custom_call_target="__cudnn$fmhaSoftmax"',
            "%q = f8e4m3fn[16,32]{1,0} convert(bf16[16,32]{1,0} %x)",
            "ROOT %r = f8e5m2[16,32]{1,0} fusion(bf16[16,32]{1,0} %x), kind=kLoop, calls=%h",
            "%s = bf16[16,32]{1,0} convert(%q)",  # operands named without their types
        ]
    )
    assert benchlib.f8_census(hlo) == {
        "results": {"convert": 1, "fusion": 1},
        "consumers": {"custom-call": 1, "dot": 1, "convert": 1},
    }
    assert benchlib.gemm_counts(hlo) == {
        "fp8_cublaslt": 1,
        "cublas_other": 1,
        "triton_gemm": 1,
        "fp8_triton": 0,
        "fp8_gemms": 1,
    }
    # a Triton GEMM fusion of FP8 operands, as XLA on an H100 printed one (jax 0.11.2)
    fused = "\n".join(
        [
            "%gemm_fusion_dot.1_computation (parameter_0: f8e4m3fn[16,32], parameter_1: "
            "f8e4m3fn[32,64]) -> bf16[16,64] {",
            "  %parameter_0 = f8e4m3fn[16,32]{1,0} parameter(0)",
            "  %parameter_1 = f8e4m3fn[32,64]{0,1} parameter(1)",
            "  ROOT %dot.9 = bf16[16,64]{1,0} dot(%parameter_0, %parameter_1), "
            "lhs_contracting_dims={1}, rhs_contracting_dims={0}",
            "}",
            "%gemm_fusion_dot.2_computation (parameter_0: bf16[16,32], parameter_1: "
            "bf16[32,64]) -> bf16[16,64] {",
            "  %parameter_0.1 = bf16[16,32]{1,0} parameter(0)",
            "  %parameter_1.1 = bf16[32,64]{1,0} parameter(1)",
            "  ROOT %dot.10 = bf16[16,64]{1,0} dot(%parameter_0.1, %parameter_1.1)",
            "}",
            "ENTRY %main (x: bf16[16,32]) -> bf16[16,64] {",
            "  %k = bf16[16,64]{1,0} fusion(%x8, %w8), kind=kCustom, "
            'calls=%gemm_fusion_dot.1_computation, backend_config={"fusion_backend_config":'
            '{"kind":"__triton_nested_gemm_fusion"}}',
            "  %l = bf16[16,64]{1,0} fusion(%x, %w), kind=kCustom, "
            'calls=%gemm_fusion_dot.2_computation, backend_config={"fusion_backend_config":'
            '{"kind":"__triton_gemm"}}',
            "}",
        ]
    )
    assert benchlib.gemm_counts(fused) == {
        "fp8_cublaslt": 0,
        "cublas_other": 0,
        "triton_gemm": 2,
        "fp8_triton": 1,
        "fp8_gemms": 1,
    }


def test_only_refuses_a_row_this_machine_has_not(tmp_path):
    # A GPU window's `--only` names GPU rows; on a CPU they are not rows, and the script says so
    # in one line listing the rows it has, before running anything.
    env = {**os.environ, "PYTHON": python(), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", str(tmp_path / "out"), "--only", "gpt_1b_bf16,correct"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = proc.stderr.strip()
    assert "\n" not in line and "Traceback" not in proc.stdout + proc.stderr
    assert line.startswith("error: --only names gpt_1b_bf16, which is not a row here")
    assert "tiny_gpt_bf16" in line and "correct" in line
    assert not (tmp_path / "out" / "points" / "gpt_1b_bf16.json").exists()
