"""Training metrics: JSON-lines records, and the loss/accuracy of logits (NumPy, float64).

A metrics file holds one JSON object per line, each with a "type":

* ``run``: written once when a run (or a resumed run) starts: model, device, optimizer and
  the other settings, compile seconds, the epoch and step it starts from.
* ``step``: every ``log_every`` training steps: ``epoch`` (1-based), ``step`` (global, counted
  from the first step of the first run, so a resumed run continues the count), ``loss`` (that
  batch), ``loss_avg`` (mean batch loss since the previous step record), ``samples_per_s``
  (over that interval) and ``time`` (seconds since the run started).
* ``epoch``: after each epoch: ``epoch``, ``step``, ``steps``, ``samples``, ``train_loss``
  (mean per-sample loss of the epoch), ``test_loss``, ``test_acc`` (a fraction),
  ``samples_per_s``, ``epoch_seconds`` (training only, evaluation excluded),
  ``eval_seconds`` and ``time``.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

import numpy as np

__all__ = ["MetricsWriter", "read_metrics", "MetricsError", "cross_entropy_sum", "correct_count", "epoch_records",
           "format_loss"]


class MetricsError(ValueError):
    """A metrics file that is not JSON lines of records; the message names file and line."""


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
    """Appends records to a JSON-lines file, one flushed line each (a crash loses no record).

    mode "w" starts a new file; "a" continues one (a resumed run appends to its history).
    """

    def __init__(self, path: str | os.PathLike, mode: str = "w") -> None:
        if mode not in ("w", "a"):
            raise ValueError(f"mode must be 'w' or 'a', got {mode!r}")
        self.path = Path(path)
        if self.path.parent != Path(""):
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f: IO[str] | None = open(self.path, mode, encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        if self._f is None:
            raise ValueError(f"{self.path}: metrics writer is closed")
        self._f.write(json.dumps(_clean(record), allow_nan=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# the numeric fields of each record type that readers (plot, trackers) compute with
_NUMERIC: dict[str, tuple[str, ...]] = {
    "step": ("epoch", "step", "loss", "loss_avg", "samples_per_s", "time"),
    "epoch": ("epoch", "step", "steps", "samples", "train_loss", "test_loss", "test_acc", "samples_per_s",
              "epoch_seconds", "eval_seconds", "time"),
}


def _check_types(rec: dict[str, Any], where: str) -> None:
    for key in _NUMERIC.get(rec["type"], ()):
        v = rec.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise MetricsError(f"{where}: field {key!r} of a {rec['type']!r} record is {v!r}; expected a number")


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a metrics file, in order; blank lines are skipped. A line that is not a
    JSON object with a "type", or whose step/epoch numbers are not numbers, raises MetricsError
    naming the file and line number."""
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


def epoch_records(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("type") == "epoch"]


def format_loss(x: float) -> str:
    """4 decimals for the usual range; exponent form where fixed point would print dozens of digits."""
    return f"{x:.4f}" if math.isfinite(x) and abs(x) < 1e5 else f"{x:.3g}"
