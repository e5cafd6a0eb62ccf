"""Experiment trackers fed with the same records as the metrics file (see `metrics.py`).

`TensorBoardWriter` writes TensorBoard event files (through tensorboardX, `pip install
'ember[tensorboard]'`) as a run goes: the step records' loss, and each epoch's train/test loss
and test accuracy, all against the global step so a resumed run continues its curves.
`scalars()` is the one mapping from a record to tracker scalars; `ember export-metrics` replays
a finished metrics file through it into SwanLab.
"""
from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["scalars", "TensorBoardWriter", "Tee", "TENSORBOARD_MISSING"]

TENSORBOARD_MISSING = "--tensorboard needs tensorboardX: pip install 'ember[tensorboard]' (or pip install tensorboardX)"

# record type -> (field, tracker tag)
_TAGS: dict[str, tuple[tuple[str, str], ...]] = {
    "step": (("loss", "train/loss"), ("loss_avg", "train/loss_avg"), ("samples_per_s", "train/samples_per_s")),
    "epoch": (("train_loss", "epoch/train_loss"), ("test_loss", "epoch/test_loss"), ("test_acc", "epoch/test_acc"),
              ("samples_per_s", "epoch/samples_per_s")),
}


def scalars(record: dict[str, Any]) -> tuple[int, dict[str, float]] | None:
    """(global step, {tag: value}) of a step or epoch record; None for other records. Missing
    and non-finite values (a metrics file stores NaN as null) are left out."""
    tags = _TAGS.get(record.get("type", ""))
    if tags is None or not isinstance(record.get("step"), int):
        return None
    out = {}
    for key, tag in tags:
        v = record.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[tag] = float(v)
    if record["type"] == "epoch" and isinstance(record.get("epoch"), int):
        out["epoch/epoch"] = float(record["epoch"])
    return record["step"], out


class TensorBoardWriter:
    """Has MetricsWriter's write/close, so the Trainer feeds it like the metrics file."""

    def __init__(self, logdir: str | os.PathLike) -> None:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ImportError(TENSORBOARD_MISSING) from None
        self._w = SummaryWriter(logdir=os.fspath(logdir))

    def write(self, record: dict[str, Any]) -> None:
        got = scalars(record)
        if got is None:
            return
        step, values = got
        for tag, v in values.items():
            self._w.add_scalar(tag, v, global_step=step)
        if record.get("type") == "epoch":
            self._w.flush()  # an epoch is worth seeing in TensorBoard at once

    def close(self) -> None:
        self._w.close()


class Tee:
    """Several record writers behind one write/close."""

    def __init__(self, writers: Sequence[Any]) -> None:
        self.writers = list(writers)

    def write(self, record: dict[str, Any]) -> None:
        for w in self.writers:
            w.write(record)

    def close(self) -> None:
        for w in self.writers:
            w.close()
