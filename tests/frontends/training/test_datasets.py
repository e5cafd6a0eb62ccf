"""Tests for ember.frontends.training.datasets: downloading MNIST from (local) mirrors, md5 checks,
fallback between mirrors, and nothing left behind on any failure."""

from __future__ import annotations

import functools
import hashlib
import http.server
import socket
import threading
from pathlib import Path

import numpy as np
import pytest

from ember.frontends.training import datasets
from ember.frontends.training.datasets import ChecksumError, DownloadError, ensure_mnist
from ember.runtime.data import MNIST_FILES, load_mnist, write_idx

STEMS = [s for pair in MNIST_FILES.values() for s in pair]


def _write_mnist(root: Path, n_train=5, n_test=3, suffix=".gz", seed=0) -> None:
    rng = np.random.default_rng(seed)
    for split, n in (("train", n_train), ("test", n_test)):
        img, lbl = MNIST_FILES[split]
        write_idx(root / f"{img}{suffix}", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        write_idx(root / f"{lbl}{suffix}", rng.integers(0, 10, n, dtype=np.uint8))


def test_runtime_data_has_no_download():
    """Fetching files is the training layer's job; the runtime only reads them."""
    import ember.runtime.data as data
    for name in ("ensure_mnist", "DownloadError", "ChecksumError", "MNIST_MD5", "DEFAULT_MIRRORS", "urllib"):
        assert not hasattr(data, name), name


def test_mnist_load_with_download(tmp_path, mirror, monkeypatch):
    url, md5s = mirror
    monkeypatch.setattr(datasets, "ensure_mnist", functools.partial(ensure_mnist, mirrors=[url], md5s=md5s, timeout=60))
    m = datasets.MNIST.load(tmp_path, flat=True, download=True)
    assert m.x_train.shape == (5, 784) and m.y_test.shape == (3,)


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Serves the temp dir; under /cut/ sends half of each file with the full Content-Length."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        if not self.path.startswith("/cut/"):
            return super().do_GET()
        body = (Path(self.directory) / self.path[len("/cut/"):]).read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[: len(body) // 2])
        self.close_connection = True


@pytest.fixture(scope="module")
def mirror(tmp_path_factory):
    """A local HTTP mirror of small synthetic MNIST .gz files: (base URL, md5s)."""
    served = tmp_path_factory.mktemp("served")
    _write_mnist(served)
    md5s = {s: hashlib.md5((served / f"{s}.gz").read_bytes()).hexdigest() for s in STEMS}
    handler = functools.partial(_Handler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", md5s
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
def dead_url():
    """A URL whose port nobody answers on: the OS picks a free port (bind to 0) and the socket
    stays bound, never listening, for the whole test, so no other process can take the port
    (connections are refused) -- closing it first would let one race for it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}/"


def test_download_and_verify(tmp_path, mirror):
    url, md5s = mirror
    root = tmp_path / "new" / "dir"
    assert ensure_mnist(root, mirrors=[url], md5s=md5s, timeout=60) == root
    assert sorted(p.name for p in root.iterdir()) == sorted(f"{s}.gz" for s in STEMS)
    x, y = load_mnist(root, "train")
    assert x.shape == (5, 1, 28, 28) and y.shape == (5,)
    # Present files are not fetched again (no mirrors needed).
    assert ensure_mnist(root, mirrors=[], md5s=md5s) == root


def test_download_only_missing(tmp_path, mirror):
    url, md5s = mirror
    _write_mnist(tmp_path, suffix="", seed=1)  # raw files count as present
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    ensure_mnist(tmp_path, mirrors=[url], md5s=md5s, timeout=60)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        STEMS[:3] + ["t10k-labels-idx1-ubyte.gz"])


def test_download_bad_checksum_leaves_nothing(tmp_path, mirror):
    url, md5s = mirror
    with pytest.raises(ChecksumError) as ei:
        ensure_mnist(tmp_path, mirrors=[url], md5s={s: "0" * 32 for s in md5s}, timeout=60)
    assert "0" * 32 in str(ei.value) and url in str(ei.value)
    assert list(tmp_path.iterdir()) == []


def test_download_interrupted_leaves_nothing(tmp_path, mirror):
    url, md5s = mirror
    with pytest.raises(DownloadError, match="interrupted"):
        ensure_mnist(tmp_path, mirrors=[url + "cut/"], md5s=md5s, timeout=60)
    assert list(tmp_path.iterdir()) == []


def test_download_ctrl_c_leaves_nothing(tmp_path, mirror, monkeypatch):
    url, md5s = mirror

    class Resp:
        headers = {}
        def __enter__(self): return self
        def __exit__(self, *a): return False
        def read(self, n):
            raise KeyboardInterrupt

    monkeypatch.setattr(datasets.urllib.request, "urlopen", lambda *a, **k: Resp())
    with pytest.raises(KeyboardInterrupt):
        ensure_mnist(tmp_path, mirrors=[url], md5s=md5s, timeout=60)
    assert list(tmp_path.iterdir()) == []


def test_download_falls_back_to_next_mirror(tmp_path, mirror, dead_url):
    url, md5s = mirror
    ensure_mnist(tmp_path, mirrors=[dead_url, url + "cut/", url], md5s=md5s, timeout=60)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{s}.gz" for s in STEMS)


def test_download_all_dead(tmp_path, mirror, dead_url):
    _, md5s = mirror
    with pytest.raises(DownloadError) as ei:
        ensure_mnist(tmp_path, mirrors=[dead_url, dead_url + "x/"], md5s=md5s, timeout=60)
    msg = str(ei.value)
    assert not isinstance(ei.value, ChecksumError)
    assert "--data" in msg and "No network?" in msg
    assert dead_url + "train-images-idx3-ubyte.gz" in msg and dead_url + "x/" in msg
    assert list(tmp_path.iterdir()) == []


def test_dataset_dirs(monkeypatch, tmp_path):
    from ember.frontends.training import datasets as D
    monkeypatch.setenv("EMBER_DATA", str(tmp_path / "m"))
    assert D.dataset_dir("mnist") == tmp_path / "m"
    monkeypatch.setenv("HOME", str(tmp_path))
    empty = tmp_path / "system"
    monkeypatch.setitem(D.DATASETS, "fashion-mnist", D.Dataset("fashion-mnist", {}, (), (str(empty),)))
    assert D.dataset_dir("fashion-mnist") == tmp_path / ".cache" / "ember" / "fashion-mnist"  # system copy incomplete
    empty.mkdir()
    for stem in D.MNIST_MD5:
        (empty / f"{stem}.gz").write_bytes(b"")
    assert D.dataset_dir("fashion-mnist") == empty
    with pytest.raises(ValueError, match="unknown dataset 'cifar'; expected one of mnist, fashion-mnist"):
        D.dataset_dir("cifar")
