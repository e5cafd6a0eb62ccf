"""Experiment trackers: `ember mnist --tensorboard DIR` event files read back by TensorBoard's
own reader, and `ember export-metrics --swanlab` replaying a metrics file into a SwanLab run
recorded offline (read back with SwanLab's own record reader)."""
from __future__ import annotations

import builtins
import math

import pytest

from ember.frontends import cli
from ember.frontends.training.metrics import read_metrics

from models import MNIST_DIR


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One short MLP run writing both the metrics file and TensorBoard events."""
    pytest.importorskip("tensorboardX")
    if not (MNIST_DIR / "train-images-idx3-ubyte.gz").exists():
        pytest.skip(f"MNIST not found at {MNIST_DIR}")
    d = tmp_path_factory.mktemp("run")
    argv = ["mnist", "--model", "mlp", "--device", "cpu", "--data", str(MNIST_DIR), "--epochs", "2", "--limit-steps", "4",
            "--log-every", "2", "--no-progress", "--metrics-file", str(d / "m.jsonl"), "--tensorboard", str(d / "tb")]
    assert cli.main(argv) == 0
    return d, read_metrics(d / "m.jsonl")


def test_tensorboard_events_read_back(run):
    ea_mod = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    d, records = run
    acc = ea_mod.EventAccumulator(str(d / "tb"))
    acc.Reload()
    got = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    steps = [r for r in records if r["type"] == "step"]
    epochs = [r for r in records if r["type"] == "epoch"]
    assert [s for s, _ in got["train/loss"]] == [2, 4, 6, 8] == [r["step"] for r in steps]
    assert [v for _, v in got["train/loss"]] == pytest.approx([r["loss"] for r in steps], rel=1e-6)
    for tag, key in (("epoch/train_loss", "train_loss"), ("epoch/test_loss", "test_loss"), ("epoch/test_acc", "test_acc")):
        assert [s for s, _ in got[tag]] == [4, 8]
        assert [v for _, v in got[tag]] == pytest.approx([r[key] for r in epochs], rel=1e-6), tag


def test_tensorboard_missing_is_one_line(tmp_path, capsys, monkeypatch):
    real = builtins.__import__

    def no_tbx(name, *a, **k):
        if name == "tensorboardX":
            raise ImportError(name)
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_tbx)
    assert cli.main(["mnist", "--data", str(tmp_path), "--tensorboard", str(tmp_path / "tb")]) == 2
    assert capsys.readouterr().err.strip() == ("ember mnist: error: --tensorboard needs tensorboardX: pip install "
                                               "'ember[tensorboard]' (or pip install tensorboardX)")


def _swanlab_scalars(log_dir):
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader
    files = sorted(log_dir.glob("run-*/*.swanlab"))
    assert len(files) == 1, files
    reader = DataStoreReader()
    reader.open(str(files[0]))
    out: dict[str, list[tuple[int, float]]] = {}
    start = None
    for raw in reader:
        rec = Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "scalar":
            out.setdefault(rec.scalar.key, []).append((rec.scalar.step, rec.scalar.value.number))
        elif kind == "start":
            start = rec.start
    reader.close()
    return start, out


def test_export_metrics_to_swanlab_offline(run, tmp_path, monkeypatch, capsys):
    pytest.importorskip("swanlab")
    d, records = run
    secret = "sk-ember-test-not-a-real-key-0123456789"
    monkeypatch.setenv("SWANLAB_API_KEY", secret)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["export-metrics", str(d / "m.jsonl"), "--swanlab", "--project", "P", "--experiment-name", "E",
                     "--mode", "offline", "--log-dir", str(tmp_path / "sw")]) == 0
    assert "exported 22 values from" in capsys.readouterr().out  # 4 steps x 3 tags, 2 epochs x 5
    start, got = _swanlab_scalars(tmp_path / "sw")
    assert (start.project, start.name) == ("P", "E")
    steps = [r for r in records if r["type"] == "step"]
    epochs = [r for r in records if r["type"] == "epoch"]
    assert got["train/loss"] == [(r["step"], pytest.approx(r["loss"], rel=1e-12)) for r in steps]
    assert got["epoch/test_acc"] == [(r["step"], pytest.approx(r["test_acc"])) for r in epochs]
    assert got["epoch/train_loss"] == [(r["step"], pytest.approx(r["train_loss"])) for r in epochs]
    assert all(math.isfinite(v) for vals in got.values() for _, v in vals)
    for f in tmp_path.rglob("*"):  # the key from the environment is written nowhere
        if f.is_file():
            assert secret.encode() not in f.read_bytes(), f


def test_export_metrics_refusals(run, tmp_path, capsys, monkeypatch):
    d, _ = run
    monkeypatch.delenv("SWANLAB_API_KEY", raising=False)
    assert cli.main(["export-metrics", str(d / "m.jsonl")]) == 2
    assert capsys.readouterr().err.strip() == "ember export-metrics: error: choose a tracker: --swanlab"
    if pytest.importorskip("swanlab"):
        assert cli.main(["export-metrics", str(d / "m.jsonl"), "--swanlab"]) == 2
        assert "--mode cloud needs the SWANLAB_API_KEY environment variable" in capsys.readouterr().err
    assert cli.main(["export-metrics", str(tmp_path / "nope.jsonl"), "--swanlab"]) == 2
    assert f"{tmp_path / 'nope.jsonl'}: no such file" in capsys.readouterr().err
