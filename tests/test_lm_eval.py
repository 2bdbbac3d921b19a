"""lm-eval through jaxdist checked by lm-eval's own Hugging Face backend: on one exported checkpoint
(a random tiny Llama imported and exported with `scripts/hf.py`), `JaxdistLM` (sharded forward,
key/value-cache generation) and `HFLM` (transformers, torch) give the same per-item
log-likelihoods within 1e-4, the same accuracy and the same generated text, on the shipped local
tasks (configs/lm_eval_tasks)."""

from __future__ import annotations

import json
import pathlib
import subprocess

import numpy as np
import pytest

pytest.importorskip("lm_eval", reason="needs the eval extra: pip install -e '.[eval]' (lm-eval)")
transformers = pytest.importorskip(
    "transformers", reason="needs the hf extra: pip install -e '.[hf]' (transformers, torch)"
)
torch = pytest.importorskip("torch", reason="needs the hf extra: pip install -e '.[hf]'")
pytest.importorskip("accelerate", reason="needs the eval extra: pip install -e '.[eval]'")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from jaxdist import lm_eval_adapter  # noqa: E402
from jaxdist.errors import ConfigError  # noqa: E402
from tests.helpers import python  # noqa: E402
from tests.test_hf import REPO  # noqa: E402

REPO_PATH = pathlib.Path(REPO)
TASKS = ["jaxdist_choice", "jaxdist_copy"]
SHIPPED = [lm_eval_adapter.SHIPPED_TASKS]  # configs/lm_eval_tasks
EOS = "<|endoftext|>"


def _tokenizer(path):
    """A byte-level BPE of 320 ids trained on the shipped task files, EOS `<|endoftext|>` (id 0),
    as scripts/tokenize.py trains them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [
        line
        for name in TASKS
        for line in (REPO_PATH / "configs" / "lm_eval_tasks" / f"{name}.jsonl").open()
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS})
    )
    return tok


def _script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([python(), *args], cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(jaxdist run folder, exported HF folder): a random LlamaForCausalLM (2 layers, d 32, 4
    heads over 2 key/value heads, 64 positions) with the tokenizer above, imported, exported."""
    root = tmp_path_factory.mktemp("lm_eval")
    hf_dir = root / "hf"
    hf_dir.mkdir()
    tok = _tokenizer(hf_dir)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.1,  # logits of a few units: differences show
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tok.token_to_id(EOS),
    )
    transformers.LlamaForCausalLM(cfg).float().save_pretrained(hf_dir)
    run, exported = root / "run", root / "exported"
    for args in (["import", hf_dir, "--out", run], ["export", run, "--out", exported]):
        proc = _script("scripts/hf.py", *map(str, args))
        assert proc.returncode == 0, proc.stderr[-3000:]
    return run, exported


@pytest.fixture(scope="module")
def results(folders):
    """lm-eval's results of both backends on the shipped tasks, on the exported folder: jaxdist's
    split over data=2 × tensor=2 (8 rows a batch), transformers' one request at a time."""
    _, exported = folders
    ours = lm_eval_adapter.JaxdistLM(str(exported), data=2, tensor=2, batch_size=8)
    theirs = HFLM(pretrained=str(exported), dtype="float32", batch_size=1, device="cpu")
    return {
        name: lm_eval_adapter.evaluate(lm, lm_eval_adapter.load_tasks(TASKS, SHIPPED))
        for name, lm in (("jaxdist", ours), ("hf", theirs))
    } | {"lms": (ours, theirs)}


def _loglikelihoods(result) -> np.ndarray:
    """[items, choices] summed log-likelihoods of the multiple-choice task, in document order."""
    samples = sorted(result["samples"]["jaxdist_choice"], key=lambda s: s["doc_id"])
    return np.array([[r[0][0] for r in s["resps"]] for s in samples])


def test_loglikelihoods_and_accuracy_equal_the_hf_backend(results):
    ours, theirs = _loglikelihoods(results["jaxdist"]), _loglikelihoods(results["hf"])
    assert ours.shape == theirs.shape == (16, 4)
    delta = np.abs(ours - theirs).max()
    print(f"max |Δ| per-item log-likelihood, jaxdist vs HFLM: {delta:.2e}")  # docs/MODELS.md
    assert delta <= 1e-4, delta
    assert np.abs(theirs).min() > 1 and len(np.unique(theirs.round(3))) > 32  # real numbers
    for metric in ("acc,none", "acc_norm,none"):
        a = results["jaxdist"]["results"]["jaxdist_choice"][metric]
        b = results["hf"]["results"]["jaxdist_choice"][metric]
        assert a == b, (metric, a, b)


def test_generate_until_equals_the_hf_backend(results):
    def texts(result):
        samples = sorted(result["samples"]["jaxdist_copy"], key=lambda s: s["doc_id"])
        return [s["resps"][0][0] for s in samples]

    ours, theirs = texts(results["jaxdist"]), texts(results["hf"])
    assert len(ours) == 12 and ours == theirs, (ours, theirs)
    assert sum(bool(t) for t in theirs) >= 6 and len(set(theirs)) >= 6  # text, not all stops
    em = [
        r["results"]["jaxdist_copy"]["exact_match,none"]
        for r in (results["jaxdist"], results["hf"])
    ]
    assert em[0] == em[1]


def test_loglikelihood_rolling_equals_the_hf_backend(results):
    """Strings of more tokens than the 64 positions: several windows, each behind the prefix."""
    ours, theirs = results["lms"]
    text = (REPO_PATH / "configs" / "lm_eval_tasks" / "jaxdist_copy.jsonl").read_text()
    strings = [text[:400], text[400:520]]
    assert len(ours.tok_encode(strings[0])) > 2 * 64  # three windows or more
    reqs = [Instance("loglikelihood_rolling", {}, (s,), i) for i, s in enumerate(strings)]
    a = np.array(ours.loglikelihood_rolling(reqs, disable_tqdm=True))
    b = np.array(theirs.loglikelihood_rolling(reqs, disable_tqdm=True))
    # sums over 100+ tokens of float32 log-probabilities: 1e-4 of each item's own size
    assert np.all(np.abs(a - b) <= 1e-4 * np.maximum(1, np.abs(b))), (a, b)
    assert np.all(b < -100)


def test_a_jaxdist_checkpoint_scores_as_its_export(folders, results):
    """The orbax run folder the export came from, on one device: the same log-likelihoods."""
    run, _ = folders
    lm = lm_eval_adapter.JaxdistLM(str(run), batch_size=16)
    tasks = lm_eval_adapter.load_tasks(["jaxdist_choice"], SHIPPED)
    ours = _loglikelihoods(lm_eval_adapter.evaluate(lm, tasks))
    assert np.abs(ours - _loglikelihoods(results["hf"])).max() <= 1e-4


def test_bad_task_name_or_file_is_one_line_before_the_model_loads(folders, tmp_path):
    _, exported = folders
    with pytest.raises(ConfigError, match=r"no task 'jaxdist_choise'.*known: jaxdist_choice"):
        lm_eval_adapter.load_tasks(["jaxdist_choise"], SHIPPED)
    with pytest.raises(ConfigError, match="--lm_eval_include=.*no such folder"):
        lm_eval_adapter.load_tasks(["jaxdist_choice"], [str(tmp_path / "nope")])
    yaml = (REPO_PATH / "configs" / "lm_eval_tasks" / "jaxdist_choice.yaml").read_text()
    (tmp_path / "gone.yaml").write_text(
        yaml.replace("task: jaxdist_choice", "task: gone").replace(
            "jaxdist_choice.jsonl", "missing.jsonl"
        )
    )
    with pytest.raises(ConfigError, match="a data file is missing"):
        lm_eval_adapter.load_tasks(["gone"], [str(tmp_path)])
    # From the command line: one `error:` line, exit 2, no traceback.
    proc = _script(
        "scripts/eval.py",
        f"--checkpoint={exported}",
        "--lm_eval_tasks=jaxdist_choice,nosuch",
        "--lm_eval_include=configs/lm_eval_tasks",
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no task 'nosuch'" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
