"""Generation checked by `transformers`: greedy continuations of an imported tiny Llama equal
`generate(do_sample=False)` token for token, on one device and split over data × tensor."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

transformers = pytest.importorskip(
    "transformers", reason="needs the hf extra: pip install -e '.[hf]' (transformers, torch)"
)
torch = pytest.importorskip("torch", reason="needs the hf extra: pip install -e '.[hf]'")
tokenizers = pytest.importorskip("tokenizers", reason="needs the hf extra: pip install -e '.[hf]'")

from tests.helpers import python  # noqa: E402
from tests.test_hf import REPO, VOCAB, hf_tiny  # noqa: E402

PROMPTS = ["w5 w17 w3", "w40 w20 w9 w9 w11 w60 w7", "w88", "w10 w30 w31 w32 w50"]
NEW = 32


def word_tokenizer(path) -> tokenizers.Tokenizer:
    """A word-level tokenizer.json over the model's 96 ids: <unk> 0, <s> 1, </s> 2, w3..w95, with
    a BOS added as Llama's tokenizers do."""
    from tokenizers import models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.decoder = None
    tok.save(str(path))
    return tok


def hf_greedy(model, ids: list[int], new: int = NEW) -> list[int]:
    """transformers' greedy continuation of `ids` by `new` tokens (EOS 2, padding 0)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def test_greedy_equals_transformers_generate(tmp_path):
    model, hf_dir = hf_tiny(tmp_path, "hf", tie=False, seed=3)
    tok = word_tokenizer(hf_dir / "tokenizer.json")
    run = tmp_path / "run"
    subprocess.run(
        [python(), "scripts/hf.py", "import", str(hf_dir), "--out", str(run)],
        cwd=REPO, check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    assert (run / "tokenizer.json").is_file()
    expected = [hf_greedy(model, tok.encode(p).ids) for p in PROMPTS]
    assert all(e[0] != e[-1] or len(set(e)) > 1 for e in expected)  # not one repeated token
    for mesh in (["--data=1", "--tensor=1"], ["--data=2", "--tensor=2"]):
        out = tmp_path / f"out{mesh[0][-1]}{mesh[1][-1]}.jsonl"
        cmd = [python(), "scripts/sample.py", f"--checkpoint={run}"]
        cmd += [f"--prompt={p}" for p in PROMPTS]
        cmd += [f"--max_new_tokens={NEW}", "--temperature=0", f"--out={out}", *mesh]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "tokens/s" in proc.stdout
        records = [json.loads(line) for line in out.read_text().splitlines()]
        assert [r["prompt"] for r in records] == PROMPTS
        assert [r["tokens"] for r in records] == expected, mesh
        assert records[0]["text"] == tok.decode(expected[0], skip_special_tokens=True)


def test_sampling_filters():
    """top_k = 1 and a tiny top_p both leave only the argmax; temperature sampling stays inside
    the top-k set."""
    import jax

    from jaxdist import generate

    logits = jax.random.normal(jax.random.key(0), (4, 50))
    best = np.asarray(logits.argmax(-1))
    key = jax.random.key(1)
    for s in (generate.Sampling(1.0, top_k=1), generate.Sampling(1.0, top_p=1e-6)):
        assert (np.asarray(generate.sample_token(logits, key, s)) == best).all()
    top3 = np.argsort(-np.asarray(logits), axis=-1)[:, :3]
    for i in range(20):
        got = np.asarray(
            generate.sample_token(logits, jax.random.key(i), generate.Sampling(2.0, 3))
        )
        assert all(g in row for g, row in zip(got, top3))


def test_bad_input_is_one_line(tmp_path):
    _, hf_dir = hf_tiny(tmp_path, "hf", tie=True)
    proc = subprocess.run(
        [python(), "scripts/sample.py", f"--checkpoint={hf_dir}", "--prompt=" + "x" * 80,
         "--max_new_tokens=8"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().startswith("error: --prompt='xxxx")
    assert "passes model.seq_len=64" in proc.stderr and proc.stderr.count("\n") == 1
