"""Tests for ember.runtime.data: IDX reading/writing, MNIST loading, DataLoader (the download is
tests/frontends/training/test_datasets.py)."""

from __future__ import annotations

import gzip
import hashlib
import struct
from pathlib import Path

import numpy as np
import pytest

from conftest import require_mnist
from ember.runtime import data as D
from ember.runtime.data import DataLoader, IDXError, MNIST_FILES, load_mnist, read_idx, write_idx

MNIST_DIR = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "mnist"
STEMS = [s for pair in MNIST_FILES.values() for s in pair]


# --------------------------------------------------------------------------------- IDX format

@pytest.mark.parametrize("suffix", ["", ".gz"])
@pytest.mark.parametrize("arr", [
    np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4),
    np.array([-(2**31), -1, 0, 1, 2**31 - 1], dtype=np.int32),
    np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
    np.array([1.5, -2.25], dtype=np.float64),
    np.array([[-128, 127]], dtype=np.int8),
    np.array([-300, 300], dtype=np.int16),
], ids=["u8-3d", "i32-1d", "f32-2d", "f64", "i8", "i16"])
def test_roundtrip(tmp_path, arr, suffix):
    p = tmp_path / f"a.idx{suffix}"
    write_idx(p, arr)
    assert (p.read_bytes()[:2] == b"\x1f\x8b") == (suffix == ".gz")
    out = read_idx(p)
    assert out.dtype == arr.dtype and out.dtype.isnative
    assert out.shape == arr.shape
    np.testing.assert_array_equal(out, arr)
    out[...] = 0  # writable
    assert [f.name for f in tmp_path.iterdir()] == [p.name]  # no temp file left


def test_gzip_detected_by_magic_not_name(tmp_path):
    arr = np.arange(10, dtype=np.uint8)
    write_idx(tmp_path / "a.gz", arr)
    (tmp_path / "a.gz").rename(tmp_path / "plain-name")
    np.testing.assert_array_equal(read_idx(tmp_path / "plain-name"), arr)


def test_big_endian_on_disk(tmp_path):
    write_idx(tmp_path / "a", np.array([1, 258], dtype=np.int32))
    raw = (tmp_path / "a").read_bytes()
    assert raw == bytes([0, 0, 0x0C, 1]) + struct.pack(">I", 2) + struct.pack(">2i", 1, 258)


def _good_bytes() -> bytes:
    return bytes([0, 0, 0x08, 3]) + struct.pack(">3I", 2, 3, 4) + bytes(range(24))


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gz"])
@pytest.mark.parametrize("content, expected", [
    (_good_bytes()[:-5], ["truncated IDX payload", "expected 24 bytes of payload", "got 19"]),
    (_good_bytes()[:10], ["truncated IDX header", "expected 16 bytes", "got 10"]),
    (b"\x00\x00", ["truncated IDX header", "got 2"]),
    (b"", ["truncated IDX header", "got 0"]),
    (b"\x00\x01\x08\x03" + _good_bytes()[4:], ["bad IDX magic number", "00 01 08 03",
                                               "two zero bytes"]),
    (b"\x00\x00\x07\x03" + _good_bytes()[4:], ["unknown IDX dtype code 0x07", "0x08 (uint8)"]),
    (_good_bytes() + b"junk", ["4 unexpected trailing bytes", "expected 24 bytes of payload",
                               "got 28"]),
], ids=["payload", "header", "short-magic", "empty", "magic", "dtype", "trailing"])
def test_bad_idx(tmp_path, content, expected, gz):
    p = tmp_path / "bad-file"
    p.write_bytes(gzip.compress(content) if gz else content)
    with pytest.raises(IDXError) as ei:
        read_idx(p)
    msg = str(ei.value)
    assert str(p) in msg
    for s in expected:
        assert s in msg


@pytest.mark.parametrize("mangle", [
    lambda b: b[: len(b) // 2],                 # truncated stream
    lambda b: b[:12] + b"\xff" * 8 + b[20:],   # corrupt deflate data
    lambda b: b[:-4] + b"\x00\x00\x00\x00",    # wrong length trailer
], ids=["truncated", "garbled", "trailer"])
def test_corrupt_gzip(tmp_path, mangle):
    p = tmp_path / "x.gz"
    p.write_bytes(mangle(gzip.compress(_good_bytes() * 4)))
    with pytest.raises(IDXError, match="corrupt gzip stream") as ei:
        read_idx(p)
    assert str(p) in str(ei.value)


def test_write_rejects_unsupported_dtype(tmp_path):
    with pytest.raises(ValueError, match="int64"):
        write_idx(tmp_path / "a", np.zeros(3, dtype=np.int64))


# ------------------------------------------------------------------------------- MNIST loading

def _write_mnist(root: Path, n_train=5, n_test=3, suffix=".gz", seed=0) -> None:
    rng = np.random.default_rng(seed)
    for split, n in (("train", n_train), ("test", n_test)):
        img, lbl = MNIST_FILES[split]
        write_idx(root / f"{img}{suffix}", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        write_idx(root / f"{lbl}{suffix}", rng.integers(0, 10, n, dtype=np.uint8))


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_load_mnist_synthetic(tmp_path, suffix):
    _write_mnist(tmp_path, suffix=suffix)
    x, y = load_mnist(tmp_path, "train")
    assert x.shape == (5, 1, 28, 28) and x.dtype == np.float32
    assert y.shape == (5,) and y.dtype == np.int64
    raw = read_idx(D.find_mnist_file(tmp_path, MNIST_FILES["train"][0]))
    np.testing.assert_array_equal(x.reshape(5, 28, 28), raw.astype(np.float32) / np.float32(255))
    xf, _ = load_mnist(tmp_path, "test", flat=True)
    assert xf.shape == (3, 784)


def test_load_mnist_count_mismatch(tmp_path):
    _write_mnist(tmp_path)
    lbl = tmp_path / f"{MNIST_FILES['train'][1]}.gz"
    write_idx(lbl, np.zeros(4, dtype=np.uint8))
    with pytest.raises(IDXError) as ei:
        load_mnist(tmp_path, "train")
    msg = str(ei.value)
    assert "5 images" in msg and "4 labels" in msg
    assert MNIST_FILES["train"][0] in msg and str(lbl) in msg


def test_load_mnist_wrong_shape(tmp_path):
    _write_mnist(tmp_path)
    write_idx(tmp_path / f"{MNIST_FILES['train'][0]}.gz", np.zeros((5, 28, 27), np.uint8))
    with pytest.raises(IDXError, match=r"expected MNIST images of shape \(N, 28, 28\) uint8"):
        load_mnist(tmp_path, "train")


def test_load_mnist_missing(tmp_path):
    with pytest.raises(FileNotFoundError) as ei:
        load_mnist(tmp_path, "test")
    msg = str(ei.value)
    assert str(tmp_path / "t10k-images-idx3-ubyte.gz") in msg
    assert "--data DIR" in msg and "EMBER_DATA" in msg


def test_default_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("EMBER_DATA", str(tmp_path))
    assert D.default_data_dir() == tmp_path
    monkeypatch.delenv("EMBER_DATA")
    assert D.default_data_dir() == Path.home() / ".cache" / "ember" / "mnist"


needs_mnist = pytest.mark.usefixtures("mnist_dir")  # skips without the files; fails under CI=true


@pytest.fixture(scope="module")
def real_train():
    return load_mnist(require_mnist(), "train")


@needs_mnist
def test_real_mnist_train(real_train):
    x, y = real_train
    assert x.shape == (60000, 1, 28, 28) and x.dtype == np.float32
    assert y.shape == (60000,) and y.dtype == np.int64
    assert x.min() == 0.0 and x.max() == 1.0
    assert set(np.unique(y)) == set(range(10))
    assert y[:8].tolist() == [5, 0, 4, 1, 9, 2, 1, 3]


@needs_mnist
def test_real_mnist_test():
    x, y = load_mnist(MNIST_DIR, "test", flat=True)
    assert x.shape == (10000, 784) and x.dtype == np.float32
    assert y.shape == (10000,) and y.dtype == np.int64
    assert 0.0 <= x.min() and x.max() <= 1.0


@needs_mnist
@pytest.mark.parametrize("stem, md5", [
    ("train-images-idx3-ubyte", "6bbc9ace898e44ae57da46a324031adb"),
    ("t10k-images-idx3-ubyte", "2646ac647ad5339dbf082846283269ea"),
])
def test_real_mnist_payload_md5(stem, md5):
    raw = gzip.decompress((MNIST_DIR / f"{stem}.gz").read_bytes())
    assert hashlib.md5(raw).hexdigest() == md5


# ---------------------------------------------------------------------------------- DataLoader

def _xy(n=60000):
    return np.arange(n, dtype=np.float32).reshape(n, 1), np.arange(n, dtype=np.int64)


def test_loader_file_order_and_partial_batch():
    x, y = _xy()
    dl = DataLoader(x, y, batch_size=64)
    batches = list(dl)
    assert len(dl) == len(batches) == 938
    assert [len(b[1]) for b in batches[:-1]] == [64] * 937 and len(batches[-1][1]) == 32
    np.testing.assert_array_equal(np.concatenate([b[1] for b in batches]), y)
    xb, yb = batches[3]
    assert xb.flags.c_contiguous and yb.flags.c_contiguous
    np.testing.assert_array_equal(xb[:, 0], yb.astype(np.float32))


def test_loader_drop_last():
    x, y = _xy()
    dl = DataLoader(x, y, batch_size=64, drop_last=True)
    sizes = [len(b) for _, b in dl]
    assert len(dl) == len(sizes) == 937 and set(sizes) == {64}


def test_loader_shuffle_reproducible():
    x, y = _xy(1000)

    def order(seed, epoch):
        dl = DataLoader(x, y, batch_size=100, shuffle=True, seed=seed)
        dl.set_epoch(epoch)
        return np.concatenate([b for _, b in dl])

    a = order(0, 0)
    assert sorted(a.tolist()) == list(range(1000)) and not np.array_equal(a, y)
    np.testing.assert_array_equal(a, order(0, 0))
    assert not np.array_equal(a, order(0, 1))
    assert not np.array_equal(a, order(1, 0))
    for xb, yb in DataLoader(x, y, batch_size=100, shuffle=True):  # x and y stay paired
        np.testing.assert_array_equal(xb[:, 0], yb.astype(np.float32))


@pytest.mark.parametrize("n, drop_last", [(60000, False), (60000, True), (1001, False)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_loader_sharding_two_ranks(n, drop_last, shuffle):
    x, y = _xy(n)
    kw = dict(batch_size=64, shuffle=shuffle, seed=3, drop_last=drop_last)
    single = DataLoader(x, y, **kw)
    ranks = [DataLoader(x, y, rank=r, world_size=2, **kw) for r in range(2)]
    for dl in [single, *ranks]:
        dl.set_epoch(2)
    g = list(single)
    r0, r1 = list(ranks[0]), list(ranks[1])
    assert len(r0) == len(r1) == len(g) == len(ranks[0]) == len(ranks[1])
    for (_, gb), (_, b0), (_, b1) in zip(g, r0, r1):
        np.testing.assert_array_equal(np.concatenate([b0, b1]), gb)  # each sample exactly once
        assert abs(len(b0) - len(b1)) <= 1
    assert {len(b) for _, b in r0[:-1]} == {32}


def test_loader_tiny_last_batch_gives_empty_share():
    x, y = _xy(65)
    shares = [list(DataLoader(x, y, batch_size=4 * 16, rank=r, world_size=4)) for r in range(4)]
    assert all(len(s) == 2 for s in shares)
    assert [len(s[1][1]) for s in shares] == [0, 0, 0, 1]


def test_loader_validation():
    x, y = _xy(10)
    with pytest.raises(ValueError, match="divisible"):
        DataLoader(x, y, batch_size=5, world_size=2)
    with pytest.raises(ValueError):
        DataLoader(x, y, batch_size=4, rank=2, world_size=2)
    with pytest.raises(ValueError, match="equal"):
        DataLoader(x, y[:5], batch_size=2)
