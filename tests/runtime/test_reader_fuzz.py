"""The file readers fed damaged files: random truncations and byte flips of a valid IDX file (raw
and gzip) and of a safetensors checkpoint. Each must fail only with the error it documents
(IDXError, a ValueError; CheckpointError), allocate no more than the file warrants (a header
claiming 2**31 items in a 100-byte file is refused before any payload is read), and return
promptly (hypothesis' per-example deadline)."""
from __future__ import annotations

import gzip
import struct
import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember.frontends.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ember.runtime.data import IDXError, read_idx

# No wall-clock deadline: a starved machine stalls an example for seconds; `_bounded_read` bounds
# the reader's own CPU time instead (a reader that loops on a damaged header still fails).
FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
# Allocation allowed beyond the file's own size: the gzip reader's bounded 1 MiB chunks plus the
# interpreter's own noise; a reader that trusted a damaged header would ask for gigabytes.
SLACK = 8 << 20

_IMAGES = np.arange(3 * 5 * 4, dtype=np.uint8).reshape(3, 5, 4)
_IDX = bytes([0, 0, 0x08, 3]) + struct.pack(">3I", 3, 5, 4) + _IMAGES.tobytes()


def _damage(data: bytes, cut: int | None, flips: list[tuple[int, int]]) -> bytes:
    b = bytearray(data if cut is None else data[:cut % (len(data) + 1)])
    for pos, val in flips:
        if b:
            b[pos % len(b)] = val
    return bytes(b)


def _damaged(data: bytes):
    return st.tuples(st.none() | st.integers(0, len(data)),
                     st.lists(st.tuples(st.integers(0, len(data)), st.integers(0, 255)), max_size=4))


def _bounded_read(fn, path, nbytes: int):
    """fn(path), asserting its peak allocation whether it returns or raises."""
    tracemalloc.start()
    cpu = time.thread_time()
    try:
        fn(path)
    finally:
        cpu = time.thread_time() - cpu
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak <= 4 * nbytes + SLACK, f"{peak} bytes allocated reading a {nbytes}-byte file"
        assert cpu < 2.0, f"{cpu:.2f} s of CPU reading a {nbytes}-byte file"


@pytest.mark.parametrize("compress", [False, True], ids=["raw", "gzip"])
@FUZZ
@given(damage=_damaged(gzip.compress(_IDX, mtime=0)))
def test_idx_reader_survives_damage(tmp_path, compress, damage):
    base = gzip.compress(_IDX, mtime=0) if compress else _IDX
    path = tmp_path / "f.idx"
    data = _damage(base, *damage)
    path.write_bytes(data)
    try:
        _bounded_read(read_idx, path, len(data))
    except IDXError as e:
        assert str(path) in str(e)


@pytest.mark.parametrize("compress", [False, True], ids=["raw", "gzip"])
@pytest.mark.parametrize("dims", [(2**31,), (2**16, 2**16), (2**32 - 1, 2**32 - 1, 255)])
def test_idx_header_claiming_huge_payload_is_refused_before_allocating(tmp_path, compress, dims):
    data = bytes([0, 0, 0x0D, len(dims)]) + struct.pack(f">{len(dims)}I", *dims) + bytes(100)
    path = tmp_path / "huge.idx"
    path.write_bytes(gzip.compress(data, mtime=0) if compress else data)
    with pytest.raises(IDXError, match="truncated IDX payload"):
        _bounded_read(read_idx, path, len(data))


def test_gzip_bomb_after_a_valid_payload_is_refused_without_inflating_it(tmp_path):
    path = tmp_path / "bomb.idx.gz"
    path.write_bytes(gzip.compress(_IDX + bytes(64 << 20), mtime=0, compresslevel=1))  # 64 MiB of zeros, ~280 KiB
    with pytest.raises(IDXError, match="unexpected trailing bytes"):
        _bounded_read(read_idx, path, path.stat().st_size)


@pytest.fixture(scope="module")
def checkpoint_bytes(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("ckpt") / "c.safetensors"
    save_checkpoint(path, {"0.weight": np.ones((3, 4), np.float32), "0.bias": np.zeros(3, np.float32)},
                    {"0.weight.momentum_buffer": np.ones((3, 4), np.float32), "step": np.array(2.0, np.float32)},
                    epoch=1, step=7, config={"lr": 0.1})
    return path.read_bytes()


@FUZZ
@given(data=st.data())
def test_checkpoint_reader_survives_damage(tmp_path, checkpoint_bytes, data):
    damaged = _damage(checkpoint_bytes, *data.draw(_damaged(checkpoint_bytes)))
    path = tmp_path / "c.safetensors"
    path.write_bytes(damaged)
    try:
        _bounded_read(load_checkpoint, path, len(damaged))
    except CheckpointError as e:
        assert str(path) in str(e)


@pytest.mark.parametrize("header_len", [2**31, 2**63, 100])
def test_checkpoint_header_length_beyond_the_file_is_refused(tmp_path, header_len):
    path = tmp_path / "c.safetensors"
    path.write_bytes(struct.pack("<Q", header_len) + b'{"__metadata__":{}}' + bytes(10))
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        _bounded_read(load_checkpoint, path, 100)
