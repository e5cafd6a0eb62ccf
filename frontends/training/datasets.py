"""Fetching datasets: MNIST and Fashion-MNIST (the same four IDX files) from public mirrors,
md5-checked, into a folder.

Reading the files is `ember.runtime.data` (IDX, `load_mnist`, the loader); this module only
makes sure a folder holds them, downloading what is missing. Only the standard library: a
verified file is the only thing ever given its final name.
"""
from __future__ import annotations

import hashlib
import http.client
import os
import tempfile
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ember.runtime.data import DATA_HINT, MNIST_FILES, default_data_dir, find_mnist_file, load_mnist

__all__ = ["MNIST_MD5", "DEFAULT_MIRRORS", "DownloadError", "ChecksumError", "ensure_mnist", "missing_mnist_files",
           "MNIST", "DATASETS", "Dataset", "dataset_dir"]

#: md5 of the published `<stem>.gz` files (what the mirrors serve).
MNIST_MD5: dict[str, str] = {
    "train-images-idx3-ubyte": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte": "ec29112dd5afa0611ce80d1b7f02629c",
}
#: Base URLs tried in order; `<base>/<stem>.gz` is fetched.
DEFAULT_MIRRORS: tuple[str, ...] = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
)


@dataclass(frozen=True)
class Dataset:
    """A dataset in MNIST's file layout: where it is published, its checksums, and folders
    where a system package may already have installed it (searched before any download)."""
    name: str
    md5s: dict[str, str]
    mirrors: tuple[str, ...]
    system_dirs: tuple[str, ...] = ()


DATASETS: dict[str, Dataset] = {
    "mnist": Dataset("mnist", MNIST_MD5, DEFAULT_MIRRORS),
    # Zalando's Fashion-MNIST: 28x28 grey images of 10 clothing classes, MNIST's format and sizes;
    # checksums from its README. Debian's dataset-fashion-mnist installs it (recompressed).
    "fashion-mnist": Dataset("fashion-mnist", {
        "train-images-idx3-ubyte": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
        "train-labels-idx1-ubyte": "25c81989df183df01b3e8a0aad5dffbe",
        "t10k-images-idx3-ubyte": "bef4ecab320f06d8554ea6380940ec79",
        "t10k-labels-idx1-ubyte": "bb300cfdad3c16e7a12a480ee83cd310",
    }, ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",), ("/usr/share/datasets/fashion-mnist",)),
}


def dataset_dir(name: str) -> Path:
    """Where a dataset is read from without `--data`: MNIST at `default_data_dir()` ($EMBER_DATA
    or ~/.cache/ember/mnist); another dataset at a system package's folder when that holds all
    its files, else ~/.cache/ember/<name> (downloaded there when missing)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; expected one of {', '.join(DATASETS)}")
    if name == "mnist":
        return default_data_dir()
    for folder in DATASETS[name].system_dirs:
        if not missing_mnist_files(folder):
            return Path(folder)
    return Path.home() / ".cache" / "ember" / name


def missing_mnist_files(root: str | os.PathLike) -> list[str]:
    """The stems of the four MNIST files that `root` does not hold (as `<stem>.gz` or `<stem>`)."""
    return [s for pair in MNIST_FILES.values() for s in pair if find_mnist_file(root, s) is None]


class DownloadError(RuntimeError):
    """No mirror delivered a file; the message lists every URL tried and why it failed."""


class ChecksumError(DownloadError):
    """A mirror delivered bytes whose md5 differs from the published one (and none matched)."""


class _NetworkError(Exception):
    pass


def _fetch(url: str, dest: Path, md5: str, timeout: float) -> None:
    """Download `url` to a temp file next to `dest`, check its md5, then rename to `dest`.

    Nothing is left behind on any failure (network, checksum, Ctrl-C): only a verified file
    ever gets `dest`'s name. Raises _NetworkError or ChecksumError.
    """
    req = urllib.request.Request(url, headers={"User-Agent": "ember"})
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    try:
        digest, size = hashlib.md5(), 0
        with os.fdopen(fd, "wb") as f:
            try:
                with urllib.request.urlopen(req, timeout=timeout) as resp:
                    length = resp.headers.get("Content-Length")
                    while chunk := resp.read(1 << 20):
                        f.write(chunk)
                        digest.update(chunk)
                        size += len(chunk)
            except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
                raise _NetworkError(f"{type(e).__name__}: {e}") from None
        if length is not None and int(length) != size:
            raise _NetworkError(f"download interrupted: got {size} of {length} bytes")
        if digest.hexdigest() != md5:
            raise ChecksumError(f"md5 {digest.hexdigest()}, expected {md5}")
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def ensure_mnist(root: str | os.PathLike | None = None,
                 mirrors: Sequence[str] = DEFAULT_MIRRORS,
                 md5s: dict[str, str] | None = None, timeout: float = 30.0) -> Path:
    """Make sure `root` (default: `default_data_dir()`) holds the four MNIST files; return it.

    Each missing file is fetched as `<stem>.gz` from `mirrors` in turn and kept only if its md5
    matches `md5s` (default: the published MNIST_MD5); files already present (raw or .gz) are
    not touched or re-checked. Mirrors and checksums are parameters so tests can serve small
    files from a local server. Raises DownloadError (ChecksumError if some mirror answered with
    wrong bytes) listing every URL tried.
    """
    root = Path(root) if root is not None else default_data_dir()
    md5s = MNIST_MD5 if md5s is None else md5s
    missing = missing_mnist_files(root)
    if not missing:
        return root
    root.mkdir(parents=True, exist_ok=True)
    for stem in missing:
        failures: list[tuple[str, BaseException]] = []
        for base in mirrors:
            url = base.rstrip("/") + f"/{stem}.gz"
            try:
                _fetch(url, root / f"{stem}.gz", md5s[stem], timeout)
                break
            except (_NetworkError, ChecksumError) as e:
                failures.append((url, e))
        else:
            tried = "\n".join(f"  {url}: {e}" for url, e in failures) or "  (no mirrors given)"
            if any(isinstance(e, ChecksumError) for _, e in failures):
                raise ChecksumError(f"could not download {stem}.gz into {root}: checksum "
                                    f"mismatch (nothing was kept). URLs tried:\n{tried}\n"
                                    f"Or {DATA_HINT}.")
            raise DownloadError(f"could not download {stem}.gz into {root}. URLs tried:\n"
                                f"{tried}\nNo network? {DATA_HINT}.")
    return root


@dataclass
class MNIST:
    """Both MNIST splits in memory: float32 images (see load_mnist) and int64 labels."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @classmethod
    def load(cls, root: str | os.PathLike | None = None, flat: bool = False,
             download: bool = False) -> "MNIST":
        """Load both splits from `root`; with `download`, fetch missing files first."""
        if download:
            root = ensure_mnist(root)
        return cls(*load_mnist(root, "train", flat), *load_mnist(root, "test", flat))
