"""Hostile input refused in one line (issue 31, items 4, 5, 7, 8, 9).

Each case runs the real script in a subprocess and checks: exit code 2, exactly one line on stderr
(`error: ...`, naming the file or field), no traceback, nothing written. Tables of inputs hold one
class each: gin files, config files, degenerate data, Hugging Face folders, the coordinator port.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import env_without_cluster, python

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
DEFAULT = ROOT / "configs" / "default.py"
# Each refused run stops before compiling; a run that compiled would print the step summary.
TINY = (
    "--config.train.steps=1",
    "--config.model.d_model=32",
    "--config.model.seq_len=16",
    "--config.train.batch_size=8",
    "--config.data.max_bytes=200000",
    "--config.train.eval_batches=1",
)


def _env(**extra: str) -> dict[str, str]:
    env = env_without_cluster()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["JAX_PLATFORMS"] = "cpu"
    env.update(extra)
    return env


def run(script: str, *args: str, cwd: Path, timeout: float = 120, **env: str):
    return subprocess.run(
        [python(), str(SCRIPTS / script), *map(str, args)],
        cwd=cwd,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_line(proc: subprocess.CompletedProcess, prefix: str = "error: ") -> str:
    """The single stderr line of a refused run: exit code 2, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(prefix), proc.stderr[-3000:]
    return lines[0]


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


# ------------------------------------------------------------------------------------------------
# Item 8: a busy coordinator port.


@pytest.fixture
def held_port():
    """A port held by a listening socket, as a stale job or another service would hold it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_busy_coordinator_port_is_one_line_not_a_segfault(held_port, tmp_path):
    """Process 0 of a 2-process job whose coordinator port is taken: JAX would segfault (139)."""
    from jaxdist import distributed

    assert distributed.port_in_use(held_port)
    started = time.monotonic()
    proc = run(
        "train.py",
        f"--config={DEFAULT}",
        f"--workdir={tmp_path / 'run'}",
        cwd=tmp_path,
        JAXDIST_COORDINATOR=f"127.0.0.1:{held_port}",
        JAXDIST_NUM_PROCESSES="2",
        JAXDIST_PROCESS_ID="0",
    )
    line = one_line(proc)
    assert line == (
        f"error: coordinator port {held_port} (127.0.0.1:{held_port}, from env) is already in use "
        "on this host, where process 0 serves the job's coordinator: stop what holds it, or pick "
        "another port (JAXDIST_COORDINATOR_PORT=N, JAXDIST_COORDINATOR=host:N, or "
        "scripts/launch.py --coordinator_port=0 for a free one)"
    ), line
    assert time.monotonic() - started < 60  # refused at once, not after the join timeout
    assert listing(tmp_path) == []


def test_launcher_refuses_a_busy_coordinator_port(held_port, tmp_path):
    proc = run(
        "launch.py",
        "--num_processes=2",
        f"--coordinator_port={held_port}",
        "--",
        "python",
        SCRIPTS / "train.py",
        f"--workdir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    line = one_line(proc, prefix="launch.py: ")
    assert line == (
        f"launch.py: --coordinator_port={held_port} is already in use on this host; pick "
        "another, or 0 (the default) for a free one"
    ), line
    assert listing(tmp_path) == []


def test_a_free_port_is_not_reported_busy():
    from jaxdist import distributed

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert not distributed.port_in_use(port)


# ------------------------------------------------------------------------------------------------
# Item 7: every token of every token file is below model.vocab_size, checked before compiling.


def _tokens(path: Path, n: int, bad_at: int | None = None, bad: int = 300) -> None:
    ids = (np.arange(n) % 200).astype(np.uint16)
    if bad_at is not None:
        ids[bad_at] = bad
    ids.tofile(path)


@pytest.mark.parametrize(
    "case, bad_file, offset",
    [
        ("past the first 2^20 train tokens", "train.bin", (1 << 20) + 12_345),
        ("in val.bin", "val.bin", 777),
    ],
)
def test_out_of_vocabulary_token_is_one_line_naming_file_offset_id(
    tmp_path, case, bad_file, offset
):
    folder = tmp_path / "tokens"
    folder.mkdir()
    sizes = {"train.bin": (1 << 20) + 50_000, "val.bin": 5_000}
    for name, n in sizes.items():
        _tokens(folder / name, n, offset if name == bad_file else None)
    work = tmp_path / "work"
    work.mkdir()
    proc = run(
        "train.py",
        f"--config={DEFAULT}",
        *TINY,
        f"--workdir={work / 'run'}",
        f"--config.data.source={folder}",
        cwd=work,
    )
    line = one_line(proc)
    assert line == (
        f"error: data.source='{folder}': {folder / bad_file} has token id 300 at token offset "
        f"{offset} (byte {2 * offset}); model.vocab_size=256 must exceed it"
    ), line
    assert listing(work) == []


def test_token_check_reads_every_chunk_and_remembers_each_file(tmp_path, monkeypatch):
    from jaxdist import data
    from jaxdist.errors import ConfigError

    monkeypatch.setattr(data, "_TOKEN_CHUNK", 1000)
    path = tmp_path / "t.bin"
    _tokens(path, 10_500, bad_at=10_321, bad=4000)
    with pytest.raises(
        ConfigError, match=r"has token id 4000 at token offset 10321 \(byte 20642\)"
    ):
        data._check_token_ids("x", str(path), np.dtype(np.uint16), 1024)
    assert data.token_max(str(path), np.dtype(np.uint16)) == 4000
    # Same path, size and mtime: the remembered maximum, without reading the file again.
    reads = []
    monkeypatch.setattr(data.np, "memmap", lambda *a, **k: reads.append(a) or np.zeros(0))
    assert data.token_max(str(path), np.dtype(np.uint16)) == 4000 and reads == []
    monkeypatch.undo()
    _tokens(path, 10_500)  # rewritten: a new mtime, scanned again
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert data.token_max(str(path), np.dtype(np.uint16)) == 199


# ------------------------------------------------------------------------------------------------
# Item 9: degenerate data.


def _degenerate(root: Path) -> None:
    np.array([5], np.uint16).tofile(root / "one.bin")
    np.savez(root / "strings.npz", images=np.array(["a", "b", "c"]), labels=np.arange(3))
    np.savez(root / "zero_d.npz", images=np.array(3.0), labels=np.array(1))
    np.savez(root / "str_labels.npz", images=np.zeros((4, 2, 2)), labels=np.array(list("wxyz")))
    np.savez(root / "few_labels.npz", images=np.zeros((4, 2, 2)), labels=np.arange(3))
    np.savez(root / "neg_labels.npz", images=np.zeros((4, 2, 2)), labels=np.array([0, 1, -1, 2]))
    np.savez(root / "one_image.npz", images=np.zeros((1, 2, 2)), labels=np.array([0]))
    (root / "not_zip.npz").write_bytes(b"PK\x03\x04 not really a zip")
    for name, index in {
        "index_vocab_text": '{"dtype": "uint16", "tokens": {"train": 4000}, "vocab_size": "abc"}',
        "index_split_outside": '{"dtype": "uint16", "tokens": {"../../etc/x": 1}}',
        "index_count_5000_digits": '{"dtype": "uint16", "tokens": {"train": ' + "9" * 5000 + "}}",
    }.items():
        (root / name).mkdir()
        _tokens(root / name / "train.bin", 4000)
        (root / name / "index.json").write_text(index)


DEGENERATE = {
    "one.bin": "the train split has 0 tokens, fewer than model.seq_len+1=65",
    "strings.npz": "'images' is <U1 of shape [3]; expected numbers of shape [N, H, W]",
    "zero_d.npz": "'images' is float64 of shape []; expected numbers of shape [N, H, W]",
    "str_labels.npz": "'labels' is <U1 of shape [4]; expected integers of shape [N]",
    "few_labels.npz": "4 images and 3 labels; expected as many of each",
    "neg_labels.npz": "labels range over -1..2; class ids are 0..N-1",
    "one_image.npz": "1 images and 1 labels; expected as many of each, at least 2",
    "not_zip.npz": "not a readable .npz",
    "index_vocab_text": "index.json: malformed token index (ValueError: invalid literal for int()",
    "index_split_outside": "index.json: tokens of split '../../etc/x'; the splits are train and val",
    "index_count_5000_digits": "index.json: malformed token index (ValueError: ",
}


@pytest.fixture(scope="module")
def degenerate(tmp_path_factory):
    root = tmp_path_factory.mktemp("degenerate")
    _degenerate(root)
    return root


@pytest.mark.parametrize("name", list(DEGENERATE))
def test_degenerate_data_is_one_line(degenerate, tmp_path, name):
    config = ROOT / "configs" / ("mlp.py" if name.endswith(".npz") else "default.py")
    proc = run(
        "train.py",
        f"--config={config}",
        "--config.train.steps=1",
        f"--workdir={tmp_path / 'run'}",
        f"--config.data.source={degenerate / name}",
        cwd=tmp_path,
    )
    line = one_line(proc)
    if name.startswith("index_"):  # the token index is named by its own path
        assert line.startswith(f"error: {degenerate / name / 'index.json'}: "), line
    else:
        assert line.startswith(f"error: data.source='{degenerate / name}'"), line
    assert DEGENERATE[name] in line, line
    assert listing(tmp_path) == []


# ------------------------------------------------------------------------------------------------
# Items 4, 5, 9: `hf.py import` of hostile Hugging Face folders.


def tiny_hf(folder: Path, *, tokenizer: bool = False) -> Path:
    """A random 2-layer Llama as a Hugging Face folder (config.json, model.safetensors,
    generation_config.json), written with numpy alone."""
    from safetensors.numpy import save_file

    from jaxdist import config as config_lib
    from jaxdist import hf

    m = config_lib.base_config().model
    m.name, m.num_layers, m.d_model, m.num_heads, m.num_kv_heads = "llama", 2, 32, 4, 2
    m.mlp_dim, m.vocab_size, m.seq_len = 64, 96, 64
    rng = np.random.default_rng(0)
    tensors = {}
    for t in hf.tensor_map(m):
        for i in range(m.num_layers) if t.stacked else [None]:
            tensors[t.hf_name.format(i=i)] = rng.normal(size=t.hf_shape).astype(np.float32)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(hf.hf_config_from(m)))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    if tokenizer:
        (folder / "tokenizer.json").write_text("{}")
    return folder


def _set(folder: Path, **fields) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(fields)
    (folder / "config.json").write_text(json.dumps(cfg))


def _raw_field(folder: Path, key: str, raw: str) -> None:
    """Writes `raw` as the JSON text of config field `key` (for values json.dumps cannot make)."""
    cfg = json.loads((folder / "config.json").read_text())
    cfg[key] = "@@"
    (folder / "config.json").write_text(json.dumps(cfg).replace('"@@"', raw))


def _outside_index(folder: Path) -> None:
    from safetensors import safe_open

    other = folder.parent / "other"
    other.mkdir()
    os.rename(folder / "model.safetensors", other / "model.safetensors")
    with safe_open(str(other / "model.safetensors"), "numpy") as f:
        keys = list(f.keys())
    index = {"weight_map": dict.fromkeys(keys, "../other/model.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _linked_weights(folder: Path) -> None:
    outside = folder.parent / "elsewhere.safetensors"
    os.rename(folder / "model.safetensors", outside)
    os.symlink(outside, folder / "model.safetensors")


HOSTILE_HF = {
    # name: (what is done to a tiny folder `f`, what the line says with {f} filled in)
    "tokenizer.json links to a system file": (
        lambda f: os.symlink("/etc/hostname", f / "tokenizer.json"),
        "{f}/tokenizer.json links to /etc/hostname, outside {f}; a model folder is "
        "self-contained (copy the file in instead)",
    ),
    "model.safetensors links outside": (
        _linked_weights,
        "{f}/model.safetensors links to ",
    ),
    "index names ../other/model.safetensors": (
        _outside_index,
        "{f}/model.safetensors.index.json names '../other/model.safetensors', which is outside "
        "{f}; a model folder is self-contained",
    ),
    "num_hidden_layers 1000000000": (
        lambda f: _set(f, num_hidden_layers=1_000_000_000),
        "{f}/config.json: 1000000000 layers (llama model.num_layers), but the safetensors hold 2; "
        "config.json must describe the weights next to it",
    ),
    "hidden_size larger than the tensors": (
        lambda f: _set(f, hidden_size=1 << 30, head_dim=8),
        "{f}/model.safetensors: model.embed_tokens.weight has shape [96, 32], but config.json "
        "implies [96, 1073741824]",
    ),
    "vocab_size of 100 digits": (
        lambda f: _raw_field(f, "vocab_size", "9" * 100),
        "{f}/config.json: model.vocab_size=99999999... (100 digits) is out of range",
    ),
    "vocab_size of 5000 digits": (
        lambda f: _raw_field(f, "vocab_size", "9" * 5000),
        "{f}/config.json: not valid JSON (an integer of more than 4300 digits)",
    ),
    "max_position_embeddings 1e12": (
        lambda f: _set(f, max_position_embeddings=10**12),
        "{f}/config.json: model.seq_len=1000000000000 is out of range (at most 2147483647)",
    ),
    "rope_theta 1e999": (
        lambda f: _raw_field(f, "rope_theta", "1e999"),
        "{f}/config.json: model.rope_theta=inf must be a finite number",
    ),
    "num_hidden_layers a string": (
        lambda f: _set(f, num_hidden_layers="2"),
        "{f}/config.json: num_hidden_layers='2' must be an integer",
    ),
    "num_attention_heads a list": (
        lambda f: _set(f, num_attention_heads=[4]),
        "{f}/config.json: num_attention_heads=[4] must be an integer",
    ),
    "config.json nested 100000 deep": (
        lambda f: (f / "config.json").write_text("[" * 100_000 + "]" * 100_000),
        "{f}/config.json: not valid JSON (nested too deeply)",
    ),
}


@pytest.mark.parametrize("name", list(HOSTILE_HF))
def test_hostile_hf_folder_is_one_line_and_writes_nothing(tmp_path, name):
    folder = tiny_hf(tmp_path / "hf")
    damage, expected = HOSTILE_HF[name]
    damage(folder)
    before = listing(tmp_path)
    started = time.monotonic()
    proc = run("hf.py", "import", folder, "--out", tmp_path / "run", cwd=tmp_path, timeout=60)
    line = one_line(proc)
    assert expected.format(f=folder) in line, line
    assert listing(tmp_path) == before  # no run folder, no temporary
    assert time.monotonic() - started < 60


@pytest.mark.parametrize(
    "name", ["num_hidden_layers 1000000000", "hidden_size larger than the tensors"]
)
def test_absurd_sizes_are_refused_from_the_headers_at_once(tmp_path, name):
    """The refusal reads config.json and the safetensors headers only: well under a second (a
    billion layers once hung `hf.py import`, growing memory until killed at 90 s)."""
    from jaxdist import weights
    from jaxdist.errors import ConfigError

    folder = tiny_hf(tmp_path / "hf")
    HOSTILE_HF[name][0](folder)
    weights.resolve(str(tiny_hf(tmp_path / "warm")))  # imports done, so only the check is timed
    started = time.perf_counter()
    with pytest.raises(ConfigError, match="config.json"):
        weights.import_hf(str(folder), str(tmp_path / "run"))
    assert time.perf_counter() - started < 1.0
    assert not (tmp_path / "run").exists()


def test_hub_cache_snapshot_links_are_inside_the_model(tmp_path):
    """A snapshot of the Hugging Face hub cache is links into `../../blobs`: that is accepted
    (the links resolve to the cache's own blobs), and sample.py-style lookups find the files."""
    from jaxdist import weights

    plain = tiny_hf(tmp_path / "plain", tokenizer=True)
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for i, p in enumerate(sorted(plain.iterdir())):
        os.rename(p, repo / "blobs" / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snapshot / p.name)
    proc = run("hf.py", "import", snapshot, "--out", tmp_path / "run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "run")) == [
        "checkpoints", "config.json", "generation_config.json", "tokenizer.json"
    ]  # fmt: skip
    assert weights.resolve(str(snapshot)).file("tokenizer.json") == str(snapshot / "tokenizer.json")


def test_no_tokenizer_is_said_and_generation_config_is_not_one(tmp_path):
    folder = tiny_hf(tmp_path / "hf")
    proc = run("hf.py", "import", folder, "--out", tmp_path / "run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.rstrip().endswith(
        "; no tokenizer (sample.py then takes --prompt_ids, or --bytes); also copied: "
        "generation_config.json"
    ), proc.stdout
    assert (tmp_path / "run" / "generation_config.json").is_file()


def test_two_writers_of_one_out_folder_one_is_refused_nothing_mixed(tmp_path):
    """Two imports (or exports) to one --out at once: the one that finishes second is refused in
    one line and the first one's folder is left whole; no temporary is left behind."""
    from jaxdist import weights
    from jaxdist.errors import ConfigError

    out = tmp_path / "out"
    with pytest.raises(ConfigError) as err:
        with weights._staged(str(out)) as first:
            (Path(first) / "who").write_text("first")
            with weights._staged(str(out)) as second:  # started before the first finished
                (Path(second) / "who").write_text("second")
    assert str(err.value) == (
        f"--out {out} was written by another process while this one ran (two imports or exports "
        "to one folder?); this one wrote nothing"
    )
    assert listing(tmp_path) == ["out", "out/who"] and (out / "who").read_text() == "second"


def test_two_concurrent_imports_to_one_out(tmp_path):
    folder = tiny_hf(tmp_path / "hf", tokenizer=True)
    cmd = [python(), str(SCRIPTS / "hf.py"), "import", str(folder), "--out"]
    procs = [
        subprocess.Popen(
            [*cmd, str(tmp_path / "run")],
            cwd=tmp_path,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    for p in procs:
        p.stdout.close()
        p.stderr.close()
    assert sorted(code for code, _ in results) == [0, 2], results
    refused = next(err for code, err in results if code == 2)
    lines = [ln for ln in refused.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in refused, refused
    assert lines[0].startswith(f"error: --out {tmp_path / 'run'} "), lines[0]
    assert {"checkpoints", "config.json", "tokenizer.json"} <= set(os.listdir(tmp_path / "run"))
    assert sorted(os.listdir(tmp_path)) == ["hf", "run"]  # no temporary left
    from jaxdist import weights

    assert weights.resolve(str(tmp_path / "run")).step == 0  # a whole, readable run folder


# ------------------------------------------------------------------------------------------------
# Item 9: gin files and bindings, experiment files, flag values.

GIN = {
    # name: (gin file text, or None for the binding in the line; what the line says)
    "wrong value type": ("train.steps = 'abc'\n", "gin: train.steps = 'abc' must be an integer"),
    "float for an int": (
        "train.batch_size = 2.5\n",
        "gin: train.batch_size = 2.5 must be an integer",
    ),
    "integer of 38 digits": (
        "train.seed = " + "9" * 38 + "\n",
        "gin: train.seed = 999999999... (38 digits) is out of range (at most 2147483647)",
    ),
    "include of a missing file": (
        "include 'missing.gin'\n",
        "gin: Unable to open file: missing.gin. Searched config paths: ['']. (In file \"{f}\", line 1)",
    ),
    "import of a missing module": (
        "import nonexistent_module_xyz\n",
        "gin: No module named 'nonexistent_module_xyz' (In file \"{f}\", line 1)",
    ),
    "unclosed bracket": ("train.steps = [1\n", "gin: EOF in multi-line statement"),
    "undefined macro": (
        "train.steps = %MACRO\n",
        "gin: No bindings specified for 'MACRO/gin.macro'",
    ),
}


@pytest.mark.parametrize("name", list(GIN))
def test_bad_gin_is_one_line(tmp_path, name):
    text, expected = GIN[name]
    gin_file = tmp_path / "bad.gin"
    gin_file.write_text(text)
    work = tmp_path / "work"
    work.mkdir()
    proc = run(
        "train.py",
        f"--config={DEFAULT}",
        f"--workdir={work / 'run'}",
        f"--gin_file={gin_file}",
        cwd=work,
    )
    line = one_line(proc)
    assert line.startswith("error: " + expected.format(f=gin_file)), line
    assert listing(work) == []


CONFIG_FILES = {
    # name: (file text, what the line says after "--config=FILE")
    "raises": ("raise RuntimeError('boom')\n", " raised RuntimeError: boom while loading"),
    "exits": ("import sys\nsys.exit(3)\n", " raised SystemExit: 3 while loading"),
    "does not parse": ("def get_config(:\n", ": line 1: invalid syntax"),
    "lacks get_config": (
        "x = 1\n",
        " has no get_config(); an experiment file defines get_config()",
    ),
    "returns None": (
        "def get_config():\n    return None\n",
        ": get_config() returned NoneType, not an ml_collections.ConfigDict",
    ),
    "returns a dict": (
        "def get_config():\n    return {'train': {'steps': 1}}\n",
        ": get_config() returned dict, not an ml_collections.ConfigDict",
    ),
    "get_config raises": (
        "def get_config():\n    return 1 / 0\n",
        ": get_config() raised ZeroDivisionError: division by zero",
    ),
    "get_config takes arguments": (
        "def get_config(a):\n    return None\n",
        ": get_config() raised TypeError: get_config() missing 1 required positional argument",
    ),
    "a section missing": (
        "import ml_collections\ndef get_config():\n"
        "    return ml_collections.ConfigDict({'train': {'steps': 1}})\n",
        ": the config has no section 'checkpoint'; start from jaxdist.config.base_config()",
    ),
    "a field of the wrong type": (
        "from jaxdist.config import base_config\ndef get_config():\n"
        "    c = base_config()\n    c.train.steps = None\n    return c\n",
        ": train.steps=None must be an integer",
    ),
    "not python": ("not python at all (\n", ": line 1: "),
}


@pytest.mark.parametrize("name", list(CONFIG_FILES))
def test_bad_config_file_is_one_line(tmp_path, name):
    text, expected = CONFIG_FILES[name]
    config = tmp_path / "experiment.py"
    config.write_text(text)
    work = tmp_path / "work"
    work.mkdir()
    proc = run("train.py", f"--config={config}", f"--workdir={work / 'run'}", cwd=work)
    line = one_line(proc)
    assert line.startswith(f"error: --config={config}{expected}"), line
    assert listing(work) == []


FLAGS = {
    "an int field given text": (
        "--config.train.steps=abc",
        "error: flag --config.train.steps=abc: invalid literal for int() with base 10: 'abc'",
    ),
    "an int field of 26 digits": (
        "--config.train.steps=" + "9" * 26,
        "error: --config.train.steps=" + "9" * 26 + " is out of range (at most 2147483647)",
    ),
    "a bool field given maybe": (
        "--config.train.nesterov=maybe",
        "error: flag --config.train.nesterov=maybe: ('Non-boolean argument to boolean flag', "
        "'maybe')",
    ),
    "an unknown flag": ("--nosuchflag=1", "error: Unknown command line flag 'nosuchflag'"),
    "--config twice": (
        f"--config={DEFAULT}",
        "error: --config is given 2 times; give one experiment file",
    ),
}


@pytest.mark.parametrize("name", list(FLAGS))
def test_bad_flag_value_is_one_line(tmp_path, name):
    flag, expected = FLAGS[name]
    proc = run(
        "train.py", f"--config={DEFAULT}", f"--workdir={tmp_path / 'run'}", flag, cwd=tmp_path
    )
    assert one_line(proc) == expected
    assert listing(tmp_path) == []


def test_no_experiment_file_of_the_repository_is_refused():
    from jaxdist import config as config_lib

    for path in sorted((ROOT / "configs").glob("*.py")):
        if path.name != "__init__.py":
            config_lib.load_config_file(str(path))  # raises on any refusal
