"""A model fine-tuned from a Hugging Face folder keeps its tokenizer: import → fine-tune (data ×
fsdp × tensor) → export → `sample.py`'s greedy text equals `transformers` `generate` on the export.
And a folder with no tokenizer says so instead of encoding text as bytes behind the user's back."""

from __future__ import annotations

import importlib.util
import json
import subprocess

import pytest

transformers = pytest.importorskip(
    "transformers", reason="needs the hf extra: pip install -e '.[hf]' (transformers, torch)"
)
torch = pytest.importorskip("torch", reason="needs the hf extra: pip install -e '.[hf]'")
tokenizers = pytest.importorskip("tokenizers", reason="needs the hf extra: pip install -e '.[hf]'")

from tests.helpers import python  # noqa: E402
from tests.test_hf import REPO, VOCAB, hf_tiny  # noqa: E402
from tests.test_sample import hf_greedy  # noqa: E402

TEXT = " ".join(
    ["the mesh splits the model over the devices and the data over the mesh"] * 40
    + ["a tensor axis splits heads; a data axis splits the batch of text"] * 40
)
PROMPTS = ["the mesh splits", "a data axis"]
NEW = 8


def bpe_tokenizer(path, vocab_size: int = VOCAB) -> tokenizers.Tokenizer:
    """A BPE trained on TEXT with the `tokenizers` library: <unk> 0, <s> 1, </s> 2 (the tiny
    Llama's BOS and EOS), merges up to `vocab_size`, a BOS added as Llama's tokenizers do."""
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", end_of_word_suffix="</w>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], end_of_word_suffix="</w>"
    )
    tok.train_from_iterator([TEXT], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.decoder = decoders.BPEDecoder(suffix="</w>")
    assert tok.get_vocab_size() <= VOCAB
    tok.save(str(path))
    return tok


def script(*args, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [python(), *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def fine_tune(hf_dir, tokens, work) -> subprocess.CompletedProcess:
    flags = [f"--config.train.init_from={hf_dir}", f"--config.data.source={tokens}"]
    flags += ["--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2"]
    flags += ["--config.train.steps=2", "--config.checkpoint.every=2", "--config.model.seq_len=32"]
    flags += ["--config.train.batch_size=8", "--config.train.eval_batches=1"]
    flags += ["--config.train.warmup_steps=0", "--config.train.learning_rate=0.01"]
    return script(
        "scripts/train.py",
        "--config=configs/llama_tiny.py",
        f"--workdir={work}",
        *flags,
        check=False,
    )


def test_fine_tuned_run_keeps_its_tokenizer_through_export(tmp_path):
    _, hf_dir = hf_tiny(tmp_path, "hf", tie=False, seed=5)
    bpe_tokenizer(hf_dir / "tokenizer.json")
    (tmp_path / "text.txt").write_text(TEXT)
    script("scripts/tokenize.py", f"--input={tmp_path / 'text.txt'}", f"--out={tmp_path / 'tok'}",
           f"--tokenizer={hf_dir}", "--workers=1")  # fmt: skip
    work = tmp_path / "ft"
    proc = fine_tune(hf_dir, tmp_path / "tok", work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"initialised from {hf_dir} (hf); its tokenizer copied: tokenizer.json" in proc.stdout
    assert (work / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
    script("scripts/hf.py", "export", work, "--out", tmp_path / "export")
    assert (tmp_path / "export" / "tokenizer.json").is_file()

    out = tmp_path / "samples.jsonl"
    cmd = ["scripts/sample.py", f"--checkpoint={work}", *[f"--prompt={p}" for p in PROMPTS]]
    proc = script(*cmd, f"--max_new_tokens={NEW}", "--temperature=0", f"--out={out}")
    assert proc.stdout.splitlines()[0] == f"tokenizer: {work / 'tokenizer.json'}", proc.stdout
    ours = [json.loads(line) for line in out.read_text().splitlines()]

    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "export" / "tokenizer.json")
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").float().eval()
    for prompt, record in zip(PROMPTS, ours):
        ids = hf_tok(prompt)["input_ids"]
        assert ids[0] == 1 and len(ids) > 2  # BOS, then BPE pieces: not bytes
        new = hf_greedy(model, ids, NEW)
        assert record["tokens"] == new, (prompt, record, new)
        assert record["text"] == hf_tok.decode(new, skip_special_tokens=True), record
        assert record["text"].strip(), record  # words, not an empty string


def test_data_tokenized_with_another_tokenizer_is_refused(tmp_path):
    _, hf_dir = hf_tiny(tmp_path, "hf", tie=False, seed=5)
    bpe_tokenizer(hf_dir / "tokenizer.json")
    other = tmp_path / "other.json"
    bpe_tokenizer(other, vocab_size=60)
    (tmp_path / "text.txt").write_text(TEXT)
    script("scripts/tokenize.py", f"--input={tmp_path / 'text.txt'}", f"--out={tmp_path / 'tok'}",
           f"--tokenizer={other}", "--workers=1")  # fmt: skip
    proc = fine_tune(hf_dir, tmp_path / "tok", tmp_path / "ft")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(
        f"error: train.init_from={hf_dir} has its own tokenizer ({hf_dir / 'tokenizer.json'}), "
        f"but data.source={tmp_path / 'tok'} was tokenized with another"
    ), proc.stderr
    assert not (tmp_path / "ft").exists()  # refused before anything was made


def test_a_folder_without_tokenizer_takes_ids_or_explicit_bytes(tmp_path):
    _, hf_dir = hf_tiny(tmp_path, "hf", tie=True, seed=6)
    base = ["scripts/sample.py", f"--checkpoint={hf_dir}", "--max_new_tokens=4"]
    proc = script(*base, "--prompt=hello", check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        f"error: {hf_dir} has no tokenizer (no tokenizer.json, and it did not train on bytes): "
        "give prompts as token ids, --prompt_ids='[5, 17, 33]', or encode the text as UTF-8 "
        "bytes with --bytes"
    )
    out = tmp_path / "ids.jsonl"
    proc = script(*base, "--prompt_ids=[5, 17, 33]", f"--out={out}")
    assert proc.stdout.splitlines()[0] == "tokenizer: none (prompts given as ids)"
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["prompt"] == [5, 17, 33] and len(record["tokens"]) == 4 and record["text"] is None
    proc = script(*base, "--prompt=(0)", "--bytes")  # bytes 40, 48, 41: inside the vocabulary
    assert proc.stdout.splitlines()[0] == "tokenizer: UTF-8 bytes (--bytes)"
    # hf.py import says there is none (generation_config.json, which it copies, is no tokenizer).
    assert (hf_dir / "generation_config.json").is_file()
    imported = script("scripts/hf.py", "import", hf_dir, "--out", tmp_path / "run")
    assert "; no tokenizer (sample.py then takes --prompt_ids, or --bytes)" in imported.stdout, (
        imported.stdout
    )
    bad = script(*base, "--prompt_ids=5, 17", check=False)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --prompt_ids='5, 17': expected")


def test_printed_text_has_its_control_characters_escaped():
    spec = importlib.util.spec_from_file_location("sample_script", f"{REPO}/scripts/sample.py")
    sample = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sample)
    assert sample.escape("ok\tline\n\x1b[2J\x07\u202e") == "ok\tline\n\\x1b[2J\\x07\\u202e"
    assert sample.escape("héllo wörld") == "héllo wörld"
