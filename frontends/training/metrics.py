"""Training metrics: JSON-lines records, and the loss/accuracy of logits (NumPy, float64).

A metrics file holds one JSON object per line, each with a "type":

* ``run``: written once when a run (or a resumed run) starts: model, device, optimizer and
  the other settings, compile seconds, the epoch and step it starts from.
* ``step``: every ``log_every`` training steps: ``epoch`` (1-based), ``step`` (global, counted
  from the first step of the first run, so a resumed run continues the count), ``loss`` (that
  batch), ``loss_avg`` (mean batch loss since the previous step record), ``samples_per_s``
  (over that interval), ``lr`` (the learning rate that step used, from the schedule) and
  ``time`` (seconds since the run started).
* ``epoch``: after each epoch: ``epoch``, ``step``, ``steps``, ``samples``, ``train_loss``
  (mean per-sample loss of the epoch), ``test_loss``, ``test_acc`` (a fraction),
  ``val_loss``, ``val_acc`` (with a validation split), ``samples_per_s`` (this rank's;
  data parallel: ``samples_per_s_all_ranks`` too), ``epoch_seconds`` (training only, evaluation
  excluded), ``eval_seconds`` and ``time``.

Each record is one line written whole or not at all (see `MetricsWriter`), so a full disk never
leaves a cut line; a file cut by a crash mid-write (or by an older ember) loses only that last
line: readers skip it with a warning, and a resumed run removes it before appending.
"""
from __future__ import annotations

import errno
import json
import math
import os
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["MetricsWriter", "read_metrics", "MetricsError", "MetricsWriteError", "MetricsWarning", "cross_entropy_sum", "correct_count", "logit_sums", "epoch_records",
           "format_loss"]


class MetricsError(ValueError):
    """A metrics file that is not JSON lines of records; the message names file and line."""


class MetricsWriteError(OSError):
    """A record could not be written (full disk, vanished folder); errno and filename are set, and
    the file was cut back to its last whole line."""


class MetricsWarning(UserWarning):
    """Something a reader skipped (a cut last line)."""


def _clean(value: Any) -> Any:
    """JSON-safe: NumPy scalars to Python numbers, non-finite floats to None (strict JSON)."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Appends records to a JSON-lines file, each line whole or not at all.

    A record is built in full and handed to the kernel with os.write on an O_APPEND descriptor
    (no Python buffer, so a crash loses no record and close() has nothing left to fail on); a
    write that fails part-way, as on a full disk, is cut back to the size before it, so the file
    never ends in half a record. The failure raises MetricsWriteError.

    mode "w" starts a new file; "a" continues one (a resumed run appends to its history), after
    removing a cut last line (a crash mid-write, an older ember): `repaired` then says what was
    dropped, for the caller to report.
    """

    def __init__(self, path: str | os.PathLike, mode: str = "w") -> None:
        if mode not in ("w", "a"):
            raise ValueError(f"mode must be 'w' or 'a', got {mode!r}")
        self.path = Path(path)
        if self.path.parent != Path(""):
            self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if mode == "w" else 0)
        self._fd: int | None = os.open(self.path, flags, 0o666)
        self.repaired: str | None = None
        if mode == "a":
            try:
                self.repaired = self._end_on_a_whole_line()
            except OSError as e:
                self.close()
                raise MetricsWriteError(e.errno, e.strerror, os.fspath(self.path)) from None

    def _end_on_a_whole_line(self) -> str | None:
        """Makes the file end with a newline, so the next record starts a line of its own: a last
        line that is a whole record lacking only its newline gets one; anything else is cut off."""
        assert self._fd is not None
        size = os.fstat(self._fd).st_size
        if size == 0:
            return None
        with open(self.path, "rb") as f:
            pos, tail = size, b""
            while pos > 0:  # back to the last newline, a block at a time (the file may be long)
                n = min(pos, 1 << 16)
                pos -= n
                f.seek(pos)
                tail = f.read(n) + tail
                if b"\n" in tail[:n]:
                    break
        cut = tail[tail.rfind(b"\n") + 1:]
        if not cut:
            return None
        try:
            whole = isinstance(json.loads(cut), dict)
        except ValueError:
            whole = False
        if whole:
            self._write_all(b"\n")
            return None
        os.ftruncate(self._fd, size - len(cut))
        return (f"{self.path}: removed its cut last line ({len(cut)} bytes of an unfinished record, "
                f"from an interrupted write) before appending")

    def _write_all(self, data: bytes) -> None:
        assert self._fd is not None
        done = 0
        while done < len(data):  # os.write returns short only when the disk fills mid-line
            n = os.write(self._fd, data[done:])
            if n == 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            done += n

    def write(self, record: dict[str, Any]) -> None:
        if self._fd is None:
            raise ValueError(f"{self.path}: metrics writer is closed")
        data = (json.dumps(_clean(record), allow_nan=False) + "\n").encode("utf-8")
        before = os.fstat(self._fd).st_size
        try:
            self._write_all(data)
        except OSError as e:
            try:
                os.ftruncate(self._fd, before)
            except OSError:
                pass  # nothing more to do; readers skip a cut last line
            raise MetricsWriteError(e.errno, e.strerror, os.fspath(self.path)) from None

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# the numeric fields of each record type that readers (plot, trackers) compute with
_NUMERIC: dict[str, tuple[str, ...]] = {
    "step": ("epoch", "step", "loss", "loss_avg", "lr", "samples_per_s", "time"),
    "epoch": ("epoch", "step", "steps", "samples", "train_loss", "test_loss", "test_acc", "val_loss", "val_acc",
              "samples_per_s", "samples_per_s_all_ranks", "epoch_seconds", "eval_seconds", "time"),
}


def _check_types(rec: dict[str, Any], where: str) -> None:
    for key in _NUMERIC.get(rec["type"], ()):
        v = rec.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise MetricsError(f"{where}: field {key!r} of a {rec['type']!r} record is {v!r}; expected a number")


def read_metrics(path: str | os.PathLike, warn: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """The records of a metrics file, in order; blank lines are skipped. A line that is not a
    JSON object with a "type", or whose step/epoch numbers are not numbers, raises MetricsError
    naming the file and line number, except a last line cut short (no newline, not valid JSON:
    a crash mid-write), which is skipped and reported through `warn` (default: a MetricsWarning)."""
    records = []
    name = os.fspath(path)
    with open(path, encoding="utf-8") as f:
        lineno = 0
        try:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    if not line.endswith("\n"):  # only the last line can lack its newline
                        msg = (f"{name}:{lineno}: skipped the cut last line ({len(line)} characters of an "
                               f"unfinished record: the run writing it was interrupted)")
                        if warn is None:
                            warnings.warn(msg, MetricsWarning, stacklevel=2)
                        else:
                            warn(msg)
                        break
                    raise MetricsError(f"{name}:{lineno}: not valid JSON ({e.msg}); "
                                       f"expected one JSON object per line") from None
                if not isinstance(rec, dict) or "type" not in rec:
                    raise MetricsError(f"{name}:{lineno}: expected a JSON object with a "
                                       f"'type' field, got {line.strip()[:80]!r}")
                _check_types(rec, f"{name}:{lineno}")
                records.append(rec)
        except UnicodeDecodeError:
            raise MetricsError(f"{name}:{lineno + 1}: not UTF-8 text (a binary file?); expected the JSON-lines "
                               f"file that `ember mnist --metrics-file` writes") from None
    return records


def cross_entropy_sum(logits: np.ndarray, labels: np.ndarray) -> float:
    """Sum over the batch of -log softmax(logits)[label], computed in float64."""
    z = np.asarray(logits, dtype=np.float64)
    m = z.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(z - m).sum(axis=1))
    return float((lse - z[np.arange(len(z)), np.asarray(labels)]).sum())


def correct_count(logits: np.ndarray, labels: np.ndarray) -> int:
    """How many rows' argmax equals the label."""
    return int((np.asarray(logits).argmax(axis=1) == np.asarray(labels)).sum())


def logit_sums(logits: Any, labels: Any) -> tuple[Any, Any]:
    """(cross-entropy summed over the batch in float64, how many rows' argmax is the label), as
    0-d arrays where `logits` and `labels` are: NumPy's functions dispatch to a device array's
    own (CuPy implements NumPy's protocols), so an evaluation on a GPU adds them up there and
    reads back two numbers at its end instead of every batch's logits."""
    z = logits.astype(np.float64)
    m = z.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(z - m).sum(axis=1))
    picked = np.take_along_axis(z, labels.reshape(-1, 1), axis=1)[:, 0]
    return (lse - picked).sum(), (z.argmax(axis=1) == labels).sum()


def epoch_records(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("type") == "epoch"]


def format_loss(x: float) -> str:
    """4 decimals for the usual range; exponent form where fixed point would print dozens of digits."""
    return f"{x:.4f}" if math.isfinite(x) and abs(x) < 1e5 else f"{x:.3g}"
