"""scripts/bench_data.py runs end to end, small (timings are reported, never asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import ROOT, run_script


def run(*flags: str) -> dict:
    run_script("scripts/bench_data.py", *flags)
    return json.loads(Path(flags[-1].split("=", 1)[1]).read_text())


def test_tokenize_study_compares_the_same_work(tmp_path):
    r = run(
        "--study=tokenize",
        "--corpus_mb=50",  # docs/MODELS.md's command, then a smaller corpus
        "--corpus_mb=0.5",
        "--vocab=512",
        "--repeats=1",
        f"--out={tmp_path / 't.json'}",
    )
    rows = r["rows"]
    assert set(rows) == {
        "token_shards_1_workers",
        "token_shards_2_workers",
        "tokenizers_encode_batch",
    }
    # The study itself refuses to compare runs that tokenized different amounts.
    assert len({row["tokens"] for row in rows.values()}) == 1 and r["corpus_bytes"] >= 500_000
    assert all(row["tokens_per_s"] > 0 for row in rows.values())


def test_decode_study_times_prefill_and_decode(tmp_path):
    r = run(
        "--study=decode",
        "--config=configs/llama_tiny.py",
        "--new_tokens=4",
        "--repeats=1",
        f"--out={tmp_path / 'd.json'}",
    )
    assert set(r["rows"]) == {"batch 1", "batch 8"}
    for row in r["rows"].values():
        assert row["prefill_s"]["median_s"] > 0 and row["decode_tokens_per_s"] > 0


def test_loader_study_sets_the_loader_beside_the_step(tmp_path):
    r = run("--study=loader", "--steps=2", f"--out={tmp_path / 'l.json'}")
    assert r["rows"]["default job train step"]["step_s"]["median_s"] > 0
    for name in ("stdlib (in memory)", "token shards (memory-mapped)"):
        assert r["rows"][name]["fraction_of_step"] > 0


def test_packing_study_reports_the_efficiency(tmp_path):
    r = run(
        "--study=packing",
        "--seq_lens=64,256",
        "--repeats=1",
        "--steps=2",
        f"--out={tmp_path / 'p.json'}",
    )
    assert set(r["rows"]) == {"seq_len 64", "seq_len 256"}
    for row in r["rows"].values():
        assert 0.9 < row["efficiency"] <= 1 and row["target_fraction"] <= row["efficiency"]


def test_decode_vs_transformers_agrees_token_for_token(tmp_path):
    """The dry run of the side-by-side decode: llama_tiny's random weights exported to a Hugging
    Face folder and run by transformers' greedy `generate` continue the same prompts exactly as
    jaxdist's `generate` does in float32. Speed is recorded, never asserted."""
    r = run(
        "--study=decode",
        "--vs_transformers",
        "--config=configs/llama_tiny.py",
        "--batch_sizes=1,2",
        "--new_tokens=8",
        "--repeats=1",
        f"--out={tmp_path / 'v.json'}",
    )
    assert r["study"] == "decode_vs_transformers" and r["config"] == "configs/llama_tiny.py"
    assert r["dtype"] == "float32" and r["hf_cache"] == "static" and r["new_tokens"] == 8
    assert r["torch_device"] == "cpu" and r["versions"]["transformers"]
    assert set(r["rows"]) == {"batch 1", "batch 2"}
    for name, row in r["rows"].items():
        assert row["batch"] == int(name.split()[1])
        assert row["agreement"] == {
            "tokens_equal": 1.0,
            "rows_identical": row["batch"],
            "rows": row["batch"],
            "first_difference": [None] * row["batch"],
        }
        for side in ("jaxdist", "transformers"):
            assert row[side]["tokens_per_s"] > 0 and row[side]["generate_s"]["n"] == 1
        assert row["jaxdist_vs_transformers"] > 0


def test_decode_agreement_finds_the_first_difference(monkeypatch):
    import importlib.util

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # its `import benchlib`
    spec = importlib.util.spec_from_file_location("bench_data", ROOT / "scripts/bench_data.py")
    bench_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_data)
    a = bench_data._agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 4], [5, 6, 7, 8]])
    assert a == {
        "tokens_equal": 7 / 8,
        "rows_identical": 1,
        "rows": 2,
        "first_difference": [2, None],
    }
