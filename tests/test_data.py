"""Data sources and batching: deterministic, per-process rows, every source format."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxdist import config as config_lib
from jaxdist import data
from jaxdist.errors import ConfigError


def data_cfg(source):
    c = config_lib.base_config().data
    c.source = source
    c.max_bytes = 200_000
    return c


def shardings():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    s = NamedSharding(mesh, PartitionSpec("data"))
    return {"inputs": s, "targets": s}


def test_stdlib_batches_are_deterministic_and_shifted_by_one():
    ds = data.load(data_cfg("stdlib"), seq_len=32, vocab_size=256)
    assert ds.kind == "tokens" and (len(ds.train), len(ds.val)) == (180_000, 20_000)  # 10% held out
    b = data.Batches(ds, batch_size=16, seq_len=32, seed=3, shardings=shardings())
    x, y = b.get(5), b.get(5)
    np.testing.assert_array_equal(np.asarray(x["inputs"]), np.asarray(y["inputs"]))
    host = b.get_host(5)
    np.testing.assert_array_equal(np.asarray(x["inputs"]), host["inputs"])
    np.testing.assert_array_equal(host["inputs"][:, 1:], host["targets"][:, :-1])
    assert not np.array_equal(host["inputs"], b.get_host(6)["inputs"])
    assert x["inputs"].sharding.spec == PartitionSpec("data")


def test_text_directory_and_token_bin(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 200)
    (tmp_path / "b.txt").write_text("jaxdist " * 200)
    ds = data.load(data_cfg(str(tmp_path)), seq_len=16, vocab_size=256)
    assert ds.kind == "tokens" and bytes(ds.train[:5]) == b"hello"
    tokens = np.arange(5000, dtype=np.uint16) % 1000
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tokens.tofile(bin_dir / "train.bin")
    tokens[:500].tofile(bin_dir / "val.bin")
    ds = data.load(data_cfg(str(bin_dir)), seq_len=16, vocab_size=1024)
    assert len(ds.train) == 5000 and len(ds.val) == 500
    with pytest.raises(ConfigError, match="model.vocab_size=512 must exceed it"):
        data.load(data_cfg(str(bin_dir)), seq_len=16, vocab_size=512)


def test_a_text_folder_is_read_in_sorted_order_and_only_as_far_as_max_bytes(tmp_path, monkeypatch):
    """Folders and files in sorted order, each file a document; the walk stops at `max_bytes`
    instead of listing the whole tree first (the default `stdlib` source sits beside thousands
    of folders of site-packages: listing them cost every job ~0.5 s at start)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "2.txt").write_text("bb")
    (tmp_path / "a" / "1.txt").write_text("aaa")
    for i in range(20):
        (tmp_path / "z" / str(i)).mkdir(parents=True)
        (tmp_path / "z" / str(i) / "x.txt").write_text("zzzz")
    walked = []
    real_walk = data.os.walk

    def walk(root):
        for d, dirs, files in real_walk(root):
            walked.append(d)
            yield d, dirs, files

    monkeypatch.setattr(data.os, "walk", walk)
    tokens, starts = data._read_text_files(str(tmp_path), max_bytes=6, suffix=".txt")
    assert bytes(tokens) == b"aaabbz" and starts.tolist() == [0, 3, 5]
    assert len(walked) <= 5, walked  # the root, a, z, z/0 and z/1 (the next file): not z/2..19


def test_npz_images_epoch_order(tmp_path):
    images = np.random.default_rng(0).integers(0, 255, (100, 4, 4), dtype=np.uint8)
    np.savez(tmp_path / "img.npz", images=images, labels=np.arange(100) % 10)
    ds = data.load(data_cfg(str(tmp_path / "img.npz")), seq_len=0, vocab_size=0)
    assert ds.kind == "images" and ds.example_shape == (4, 4) and ds.train.dtype == np.float32
    b = data.Batches(ds, batch_size=30, seq_len=0, seed=0, shardings=shardings() | {})
    seen = np.concatenate([b._indices(i, "train") for i in range(3)])  # 90 = one epoch
    assert len(set(seen.tolist())) == 90  # no repeats within an epoch
    np.savez(tmp_path / "bad.npz", x=images)
    with pytest.raises(ConfigError, match="needs arrays 'images' and 'labels'"):
        data.load(data_cfg(str(tmp_path / "bad.npz")), seq_len=0, vocab_size=0)


def test_process_rows_cover_the_batch_once():
    s = shardings()["inputs"]
    assert data.process_row_range(s, (16, 8)) == (0, 16)  # one process holds every row


def _mixture_cfg(tmp_path, weights=(3.0, 1.0)):
    """Two token files with disjoint ids: a row's source is read off its first token."""
    np.arange(0, 100, dtype=np.uint16).repeat(40).tofile(tmp_path / "a.bin")
    np.arange(100, 200, dtype=np.uint16).repeat(40).tofile(tmp_path / "b.bin")
    c = data_cfg("stdlib")
    c.sources = (str(tmp_path / "a.bin"), str(tmp_path / "b.bin"))
    c.weights = weights
    return c


def test_a_mixture_draws_rows_by_weight_deterministically(tmp_path):
    ds = data.load(_mixture_cfg(tmp_path), seq_len=16, vocab_size=256)
    assert len(ds.parts) == 2 and ds.weights.tolist() == [0.75, 0.25]
    b = data.Batches(ds, batch_size=64, seq_len=16, seed=3, shardings=shardings())
    rows = np.concatenate([b.get_host(step)["inputs"] for step in range(40)])  # [2560, 16]
    from_a = rows[:, 0] < 100
    # Every row is one source's contiguous window, never a splice of the two.
    assert ((rows < 100).all(axis=1) == from_a).all()
    assert abs(from_a.mean() - 0.75) < 0.03, from_a.mean()  # 2560 rows: 3σ ≈ 0.026
    again = data.Batches(ds, batch_size=64, seq_len=16, seed=3, shardings=shardings())
    np.testing.assert_array_equal(again.get_host(7)["inputs"], b.get_host(7)["inputs"])
    # The global batch, built from each process's rows, is the host batch.
    np.testing.assert_array_equal(np.asarray(b.get(5)["targets"]), b.get_host(5)["targets"])
    val = np.concatenate([b.get_host(s, "val")["inputs"] for s in range(10)])
    assert 0 < (val[:, 0] < 100).mean() < 1  # validation mixes both held-out splits too


@pytest.mark.parametrize(
    "sources, weights, message",
    [
        (("a.bin", "b.bin"), (1.0,), "data.weights has 1 entries for 2 data.sources"),
        (("a.bin", "b.bin"), (1.0, 0.0), "data.weights=[1.0, 0.0]: each must be > 0"),
        (("a.bin", "missing.bin"), (), "data.sources entry '{root}/missing.bin': no such file"),
        ((), (1.0,), "data.weights is set without data.sources"),
    ],
)
def test_bad_mixtures_are_refused_in_one_line(tmp_path, sources, weights, message):
    _mixture_cfg(tmp_path)
    c = config_lib.base_config()
    c.data.sources = tuple(str(tmp_path / s) for s in sources)
    c.data.weights = weights
    with pytest.raises(ConfigError, match=message.format(root=tmp_path).replace("[", r"\[")):
        config_lib.validate(c, 8)
