"""Datasets and loaders: IDX files, MNIST loaded from a folder, and a sharded batch loader.

Only NumPy and the standard library, so that reading data never depends on a device backend.
Fetching the files (mirrors, md5 checks) is not the runtime's business: it is
`ember.frontends.training.datasets`.
The loader owns *where samples go* (order, batching, which rank gets which rows); what is
computed on them is the compiled step's business.
"""

from __future__ import annotations

import gzip
import io
import math
import os
import struct
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "IDXError", "read_idx", "write_idx",
    "MNIST_FILES", "DATA_HINT", "default_data_dir", "find_mnist_file", "load_mnist", "check_labels", "DataLoader",
]

# ---------------------------------------------------------------------------------------------
# IDX format
# ---------------------------------------------------------------------------------------------

#: IDX type code (third magic byte) -> big-endian dtype as stored in the file.
IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype("u1"), 0x09: np.dtype("i1"), 0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8"),
}
_GZIP_MAGIC = b"\x1f\x8b"


class IDXError(ValueError):
    """A file is not a well-formed IDX file; the message names the file, the fault and what
    was expected, so a user can tell a truncated download from a wrong file."""


def _expected_codes() -> str:
    return ", ".join(f"0x{c:02X} ({d.newbyteorder('=').name})" for c, d in IDX_DTYPES.items())


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file, gzip-compressed or raw, into a native-endian array of its shape.

    Compression is detected from the gzip magic bytes (1f 8b), not the file name, since
    renamed or hand-decompressed files are common. The header and payload size are checked
    exactly (a short or over-long file is an error, never silently reshaped).
    """
    name = os.fspath(path)
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == _GZIP_MAGIC:
        # Decompressed lazily in bounded chunks, never past what the header says the payload
        # is (plus a little, to report trailing bytes): a small corrupt or hostile .gz could
        # otherwise inflate to gigabytes before any size check.
        stream = gzip.GzipFile(fileobj=io.BytesIO(raw))

        def read(n: int) -> bytes:
            parts, left = [], n
            try:
                while left > 0 and (chunk := stream.read(min(left, 1 << 20))):
                    parts.append(chunk)
                    left -= len(chunk)
            except (OSError, EOFError, zlib.error) as e:
                raise IDXError(f"{name}: corrupt gzip stream ({type(e).__name__}: {e}); expected a "
                               f"complete gzip-compressed IDX file (re-download it?)") from None
            return b"".join(parts)
    else:
        pos = 0

        def read(n: int) -> bytes:
            nonlocal pos
            chunk = raw[pos:pos + n]
            pos += len(chunk)
            return chunk
    data = read(4)
    if len(data) < 4:
        raise IDXError(f"{name}: truncated IDX header: expected at least 4 bytes of magic "
                       f"number, got {len(data)}")
    z0, z1, code, ndim = data[:4]
    if z0 != 0 or z1 != 0:
        raise IDXError(f"{name}: bad IDX magic number {data[:4].hex(' ')}: expected two zero "
                       f"bytes, then a dtype code and the number of dimensions (00 00 TT DD)")
    if code not in IDX_DTYPES:
        raise IDXError(f"{name}: unknown IDX dtype code 0x{code:02X} in magic number "
                       f"{data[:4].hex(' ')}: expected one of {_expected_codes()}")
    header_len = 4 + 4 * ndim
    data += read(header_len - 4)
    if len(data) < header_len:
        raise IDXError(f"{name}: truncated IDX header: expected {header_len} bytes for "
                       f"{ndim} dimensions, got {len(data)}")
    dims = struct.unpack(f">{ndim}I", data[4:header_len])
    dtype = IDX_DTYPES[code]
    expected = math.prod(dims) * dtype.itemsize
    # Reading past the payload tells a file with trailing bytes from an exact one; the excess
    # read is bounded so that a gzip bomb after a valid payload cannot exhaust memory.
    data += read(expected + (1 << 20))
    got = len(data) - header_len
    if got != expected:
        extra = "at least " if got >= expected + (1 << 20) else ""
        what = "truncated IDX payload" if got < expected else \
            f"{extra}{got - expected} unexpected trailing bytes after the IDX payload"
        raise IDXError(f"{name}: {what}: expected {expected} bytes of payload for shape "
                       f"{dims} of {dtype.newbyteorder('=').name}, got {got}")
    arr = np.frombuffer(data, dtype=dtype, offset=header_len).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=True)  # native order, writable


def _atomic_write(path: Path, data: bytes) -> None:
    """Write via a temp file in the same folder and os.replace, so readers never see a
    half-written file and a crash leaves the old file (or none) behind."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_idx(path: str | os.PathLike, array: np.ndarray) -> None:
    """Write `array` as an IDX file (gzip-compressed when the name ends in .gz), atomically."""
    arr = np.asarray(array)
    codes = {d.newbyteorder("="): c for c, d in IDX_DTYPES.items()}
    native = arr.dtype.newbyteorder("=")
    if native not in codes:
        raise ValueError(f"{os.fspath(path)}: IDX cannot store dtype {arr.dtype}; expected one "
                         f"of {_expected_codes()}")
    if not 1 <= arr.ndim <= 255 or any(d >= 2**32 for d in arr.shape):
        raise ValueError(f"{os.fspath(path)}: IDX cannot store shape {arr.shape}; expected "
                         f"1..255 dimensions each < 2**32")
    code = codes[native]
    header = bytes([0, 0, code, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    payload = np.ascontiguousarray(arr, dtype=IDX_DTYPES[code]).tobytes()
    data = header + payload
    p = Path(path)
    if p.name.endswith(".gz"):
        data = gzip.compress(data, compresslevel=6, mtime=0)  # mtime=0: reproducible bytes
    _atomic_write(p, data)


# ---------------------------------------------------------------------------------------------
# MNIST: files and loading
# ---------------------------------------------------------------------------------------------

#: split -> (images file stem, labels file stem); each file is found as `<stem>.gz` or `<stem>`.
MNIST_FILES: dict[str, tuple[str, str]] = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
DATA_HINT = ("pass --data DIR (the folder holding the four MNIST IDX files) "
         "or set EMBER_DATA")


def default_data_dir() -> Path:
    """`$EMBER_DATA` if set, else `~/.cache/ember/mnist`: one place shared by CLI and tests."""
    env = os.environ.get("EMBER_DATA")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ember" / "mnist"


def find_mnist_file(root: str | os.PathLike, stem: str) -> Path | None:
    """`root/<stem>.gz` if present, else `root/<stem>`, else None."""
    for cand in (Path(root) / f"{stem}.gz", Path(root) / stem):
        if cand.is_file():
            return cand
    return None


def _require(root: Path, stem: str) -> Path:
    p = find_mnist_file(root, stem)
    if p is None:
        raise FileNotFoundError(f"MNIST file not found: {root / (stem + '.gz')} (or "
                                f"{root / stem}); {DATA_HINT}")
    return p


def load_mnist(root: str | os.PathLike | None = None, split: str = "train",
               flat: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Load one MNIST split from IDX files in `root` (default: `default_data_dir()`).

    Returns images as float32 pixel/255 (computed as `x.astype(float32) / float32(255)`, so
    every frontend and oracle sees bit-identical inputs), shaped (N, 1, 28, 28), or (N, 784)
    when `flat`; and labels as int64 (what cross-entropy indexes with).
    """
    if split not in MNIST_FILES:
        raise ValueError(f"unknown MNIST split {split!r}; expected one of {sorted(MNIST_FILES)}")
    root = Path(root) if root is not None else default_data_dir()
    img_path, lbl_path = (_require(root, s) for s in MNIST_FILES[split])
    images, labels = read_idx(img_path), read_idx(lbl_path)
    if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != (28, 28):
        raise IDXError(f"{img_path}: expected MNIST images of shape (N, 28, 28) uint8, got "
                       f"{images.shape} {images.dtype}")
    if labels.dtype != np.uint8 or labels.ndim != 1:
        raise IDXError(f"{lbl_path}: expected MNIST labels of shape (N,) uint8, got "
                       f"{labels.shape} {labels.dtype}")
    if len(images) != len(labels):
        raise IDXError(f"MNIST {split} split: {img_path} holds {len(images)} images but "
                       f"{lbl_path} holds {len(labels)} labels; expected equal counts")
    check_labels(labels, 10, lbl_path.name)
    x = images.astype(np.float32) / np.float32(255.0)
    x = x.reshape(len(x), 784) if flat else x.reshape(len(x), 1, 28, 28)
    return x, labels.astype(np.int64)


def check_labels(labels: np.ndarray, num_classes: int, source: str) -> None:
    """Raises ValueError naming `source`, the first label outside 0..num_classes-1 and its index.

    A label out of range would otherwise one-hot encode to a zero row and train silently.
    """
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        i = int(np.flatnonzero((labels < 0) | (labels >= num_classes))[0])
        raise ValueError(f"{source}: label {int(labels[i])} at index {i} is out of range for "
                         f"{num_classes} classes (expected 0..{num_classes - 1})")


# ---------------------------------------------------------------------------------------------
# Batch loader
# ---------------------------------------------------------------------------------------------

class DataLoader:
    """Batches over in-memory arrays (x, y), optionally shuffled and sharded across ranks.

    The rule, identical on every rank so that data-parallel ranks agree without talking:

    1. Order: `arange(N)`, or with `shuffle` `default_rng([seed, epoch]).permutation(N)`;
       call `set_epoch(e)` before each epoch to get a new (reproducible) order.
    2. Global batches: consecutive chunks of `batch_size` of that order; the last chunk is
       partial (N % batch_size samples) unless `drop_last`, which drops it.
       `len(loader)` is the number of global batches, the same on every rank.
    3. Sharding: of a global batch holding n samples, rank r takes rows
       `[r * n // world_size, (r + 1) * n // world_size)`. So `batch_size` is the *global*
       batch size and must be divisible by `world_size` (full batches split evenly into
       `batch_size // world_size` rows each); ranks together cover each global batch exactly
       once and all run `len(loader)` steps. A partial last batch splits into sizes that
       differ by at most one, and a rank's share is empty (0 rows, still yielded) when
       n < world_size: weight each rank's gradient by its row count, or use `drop_last`.

    With world_size=1 this is plain batching. Batches are gathered per batch through the
    index array, so no epoch-sized copy of the data is made; unshuffled batches are views.
    Arrays on a device (with `to_device`, the target's host -> device copy) are shuffled once
    an epoch instead, by one gather through the uploaded order, so each batch is a slice: no
    index copy and no gather per step.
    """

    def __init__(self, x: np.ndarray, y: np.ndarray, batch_size: int, shuffle: bool = False,
                 seed: int = 0, drop_last: bool = False, rank: int = 0, world_size: int = 1,
                 to_device: Any = None):
        if len(x) != len(y):
            raise ValueError(f"x has {len(x)} samples but y has {len(y)}; expected equal")
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"bad batch_size={batch_size}, rank={rank}, "
                             f"world_size={world_size}; expected batch_size >= 1 and "
                             f"0 <= rank < world_size")
        if batch_size % world_size:
            raise ValueError(f"global batch_size={batch_size} is not divisible by "
                             f"world_size={world_size}")
        self.x, self.y = x, y
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.drop_last, self.rank, self.world_size = drop_last, rank, world_size
        self.to_device = to_device if hasattr(x, "__cuda_array_interface__") else None
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose shuffled order the next iteration uses."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        n = len(self.x)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        n_total, bs, w, r = len(self.x), self.batch_size, self.world_size, self.rank
        order = (np.random.default_rng([self.seed, self.epoch]).permutation(n_total)
                 if self.shuffle else None)
        x, y = self.x, self.y
        if order is not None and self.to_device is not None:
            on_device = self.to_device(order)
            x, y, order = x[on_device], y[on_device], None
        for k in range(len(self)):
            start = k * bs
            n = min(bs, n_total - start)
            lo, hi = start + r * n // w, start + (r + 1) * n // w
            if order is None:
                # a slice of host arrays is already contiguous; of device arrays (CuPy) too, and
                # np.ascontiguousarray would pull it to the host
                yield (x[lo:hi], y[lo:hi]) if hasattr(x, "__cuda_array_interface__") else \
                    (np.ascontiguousarray(x[lo:hi]), np.ascontiguousarray(y[lo:hi]))
            else:
                idx = order[lo:hi]
                yield self.x[idx], self.y[idx]
