"""Token shards: scripts/tokenize.py's output round-trips to the documents, and jaxdist.data reads
it memory-mapped (uint16 and uint32), refusing shards that disagree with their index."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
from ml_collections import ConfigDict

from jaxdist import data
from jaxdist.errors import ConfigError
from tests.helpers import python

tokenizers = pytest.importorskip("tokenizers", reason="needs the hf extra: pip install -e '.[hf]'")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [f"def f{i}(x):\n    return x * {i} + {i * i}  # café {i}\n" for i in range(12)]


def _source(path):
    return ConfigDict({"source": str(path), "val_fraction": 0.1, "max_bytes": 0})


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tok")
    (tmp / "text").mkdir()
    for i, d in enumerate(DOCS[:8]):
        (tmp / "text" / f"{i:02d}.py").write_text(d)
    with open(tmp / "more.jsonl", "w") as f:
        for d in DOCS[8:]:
            f.write(json.dumps({"body": d}) + "\n")
    cmd = [python(), "scripts/tokenize.py", f"--input={tmp / 'text'}"]
    cmd += [f"--input={tmp / 'more.jsonl'}", "--text_key=body", f"--out={tmp / 'out'}"]
    cmd += ["--train_vocab=300", "--val_fraction=0.2", "--workers=2"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "out"


def test_shards_round_trip_to_the_documents(shards):
    index = json.loads((shards / "index.json").read_text())
    assert index["dtype"] == "uint16" and index["vocab_size"] == 300
    assert index["documents"] == {"train": 10, "val": 2}  # the last 20% of 12 documents
    tok = tokenizers.Tokenizer.from_file(str(shards / "tokenizer.json"))
    decoded = []
    for split in ("train", "val"):
        ids = np.fromfile(shards / f"{split}.bin", dtype=np.uint16)
        assert ids.size == index["tokens"][split] and ids[-1] == index["eos_id"]
        cuts = np.flatnonzero(ids == index["eos_id"])
        starts = np.concatenate([[0], cuts[:-1] + 1])
        decoded += [tok.decode(ids[a:b].tolist()) for a, b in zip(starts, cuts)]
    assert decoded == DOCS  # documents in input order, each followed by EOS


def test_loader_reads_shards_and_checks_them(shards, tmp_path):
    ds = data.load(_source(shards), seq_len=16, vocab_size=300)
    assert isinstance(ds.train, np.memmap) and ds.train.dtype == np.uint16
    assert ds.val.size == json.loads((shards / "index.json").read_text())["tokens"]["val"]
    with pytest.raises(ConfigError, match=r"index.json: the tokenizer has 300 tokens, more than"):
        data.load(_source(shards), seq_len=16, vocab_size=256)
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("index.json", "train.bin"):
        (broken / name).write_bytes((shards / name).read_bytes())
    (broken / "val.bin").write_bytes((shards / "val.bin").read_bytes()[:-2])
    with pytest.raises(ConfigError, match=r"val.bin: \d+ bytes, but .*index.json says") as e:
        data.load(_source(broken), seq_len=16, vocab_size=300)
    assert "\n" not in str(e.value)


def test_uint32_shards(tmp_path):
    """Vocabularies past 65536 (Llama 3's 128256) are stored as uint32 and read back as such."""
    ids = np.random.default_rng(0).integers(0, 128256, size=4096).astype(np.uint32)
    ids[:2] = [128255, 70000]
    ids.tofile(tmp_path / "train.bin")
    ids[:512].tofile(tmp_path / "val.bin")
    index = {"dtype": "uint32", "tokens": {"train": 4096, "val": 512}, "vocab_size": 128256}
    (tmp_path / "index.json").write_text(json.dumps(index))
    ds = data.load(_source(tmp_path), seq_len=16, vocab_size=128256)
    assert ds.train.dtype == np.uint32 and int(ds.train[0]) == 128255 and int(ds.train[1]) == 70000
    batches = data.Batches(ds, batch_size=2, seq_len=16, seed=0, shardings={})
    assert batches.get_host(0)["inputs"].max() < 128256


@pytest.mark.parametrize(
    "args, match",
    [
        (["--input=/nonexistent/*.txt", "--train_vocab=300"], "--input=/nonexistent/"),
        (["--input=README.md"], "give one of --tokenizer"),
        (["--input=README.md", "--tokenizer=README.md"], "README.md: not a readable tokenizer"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, args, match):
    from jaxdist import token_shards

    assert token_shards.main([*args, f"--out={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and match in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_shards_carry_their_document_index(shards):
    """train.docs.npy / val.docs.npy hold each document's first token (the token after each
    EOS), which `data.packing=documents` packs whole; without them only windows read the shards."""
    index = json.loads((shards / "index.json").read_text())
    cfg = _source(shards)
    cfg.packing = "documents"
    ds = data.load(cfg, seq_len=16, vocab_size=300)
    for split, docs in (("train", ds.train_docs), ("val", ds.val_docs)):
        ids = np.fromfile(shards / f"{split}.bin", dtype=np.uint16)
        eos = np.flatnonzero(ids == index["eos_id"])
        np.testing.assert_array_equal(docs, np.concatenate([[0], eos[:-1] + 1]))
        assert len(docs) == index["documents"][split]
