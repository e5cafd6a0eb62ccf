"""Metrics files on a full disk: every line is whole or absent. A write that does not fit leaves the
file as it was before it; a reader skips a cut last line (left by a crash) with a warning; a writer
continuing a file first removes such a line, so its records never glue onto it."""
from __future__ import annotations

import errno
import json
import os
import warnings

import pytest

from ember.frontends.training import metrics
from ember.frontends.training.metrics import (MetricsError, MetricsWarning, MetricsWriteError, MetricsWriter,
                                              read_metrics)

from fullfs import fill, tiny_tmpfs

RUN = {"type": "run", "model": "mlp", "device": "cpu", "note": "x" * 300}


def _step(i: int) -> dict:
    return {"type": "step", "epoch": 1, "step": i, "loss": 2.0 / i, "loss_avg": 2.0, "samples_per_s": 1e4,
            "time": 0.01 * i}


def test_a_record_that_does_not_fit_leaves_no_cut_line(tmp_path):
    with tiny_tmpfs(tmp_path / "fs") as fs:
        fill(fs, room=4096)
        path = fs / "m.jsonl"
        w = MetricsWriter(path)
        w.write(RUN)
        written = 1
        with pytest.raises(MetricsWriteError) as e:
            for i in range(1, 1000):  # ~130 bytes each: the disk fills within the first few dozen
                w.write(_step(i))
                written += 1
        w.close()  # nothing buffered is left to fail here
        assert e.value.errno == errno.ENOSPC and e.value.filename == os.fspath(path)
        data = path.read_bytes()
        assert data.endswith(b"\n"), data[-80:]
        assert len(read_metrics(path)) == written


class _DiskFull:
    """Stands in for `os` in the metrics module: writes go through until `room` bytes have been
    written, then one is cut short and the next fails with ENOSPC, as on a full disk."""

    def __init__(self, room: int) -> None:
        self.room = room

    def __getattr__(self, name: str):
        return getattr(os, name)

    def write(self, fd: int, data: bytes) -> int:
        if self.room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = os.write(fd, bytes(data[:self.room]))
        self.room -= n
        return n


def test_a_short_write_is_cut_back_without_a_real_full_disk(tmp_path, monkeypatch):
    path = tmp_path / "m.jsonl"
    first = json.dumps(RUN) + "\n"
    monkeypatch.setattr(metrics, "os", _DiskFull(len(first) + 40))  # the second record fits only in part
    w = MetricsWriter(path)
    w.write(RUN)
    with pytest.raises(MetricsWriteError, match="No space left on device"):
        w.write(_step(1))
    w.close()
    assert path.read_text() == first


def test_reader_skips_a_cut_last_line_with_a_warning(tmp_path):
    path = tmp_path / "m.jsonl"
    whole = json.dumps(RUN) + "\n" + json.dumps(_step(1)) + "\n"
    path.write_text(whole + json.dumps(_step(2))[:40])
    with pytest.warns(MetricsWarning, match=r"m\.jsonl:3: skipped the cut last line"):
        assert [r["type"] for r in read_metrics(path)] == ["run", "step"]
    said = []
    assert len(read_metrics(path, warn=said.append)) == 2 and len(said) == 1
    # a bad line that is followed by others is not a cut line: still refused
    path.write_text(json.dumps(_step(2))[:40] + "\n" + whole)
    with pytest.raises(MetricsError, match=r"m\.jsonl:1: not valid JSON"):
        read_metrics(path)
    # a last record lacking only its newline is whole: read, no warning
    path.write_text(whole + json.dumps(_step(2)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(read_metrics(path)) == 3


def test_appending_starts_on_a_line_of_its_own(tmp_path):
    path = tmp_path / "m.jsonl"
    whole = json.dumps(RUN) + "\n"
    path.write_text(whole + json.dumps(_step(1))[:40])  # cut by a crash mid-write
    with MetricsWriter(path, mode="a") as w:
        assert w.repaired is not None and "removed its cut last line (40 bytes" in w.repaired
        w.write(_step(2))
    assert path.read_text() == whole + json.dumps(_step(2)) + "\n"
    path.write_text(whole + json.dumps(_step(1)))  # whole, lacking only its newline: kept
    with MetricsWriter(path, mode="a") as w:
        assert w.repaired is None
        w.write(_step(2))
    assert [r.get("step") for r in read_metrics(path)] == [None, 1, 2]
