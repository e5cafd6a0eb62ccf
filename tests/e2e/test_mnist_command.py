"""The `ember mnist` console command end to end on a slice of MNIST (the CNN, device cpu, a few
steps per epoch): it trains, evaluates on the test set, writes valid JSON-lines metrics, a PNG of
the curves, a loadable checkpoint and the kernel dumps; `ember plot` redraws the curves."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ember.frontends.checkpoint import load_checkpoint

from conftest import require_mnist
from models import MNIST_DIR

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _ember() -> list[str]:
    """The installed console script next to this interpreter (else the module)."""
    script = Path(sys.executable).with_name("ember")
    if script.exists():
        return [str(script)]
    found = shutil.which("ember")
    return [found] if found else [sys.executable, "-m", "ember.frontends.cli"]


def test_ember_mnist_cnn_on_a_slice(tmp_path, mnist_dir):
    pytest.importorskip("matplotlib")
    metrics, png, ckpt, dumps = tmp_path / "m.jsonl", tmp_path / "curves.png", tmp_path / "c.safetensors", tmp_path / "k"
    cmd = _ember() + ["mnist", "--model", "cnn", "--device", "cpu", "--epochs", "1", "--limit-steps", "30",
                      "--data", str(MNIST_DIR), "--metrics-file", str(metrics), "--log-every", "10", "--plot", str(png),
                      "--save", str(ckpt), "--dump-kernels", str(dumps)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "epoch 1/1: train loss" in res.stdout and "test accuracy" in res.stdout, res.stdout
    assert "samples/s" in res.stderr  # the progress bar

    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["type"] for r in records] == ["run", "step", "step", "step", "epoch"]
    assert [r["step"] for r in records[1:4]] == [10, 20, 30]
    epoch = records[-1]
    assert epoch["steps"] == 30 and epoch["samples"] == 30 * 64
    assert epoch["test_loss"] < 1.0 and epoch["test_acc"] > 0.7, epoch  # 30 CNN steps reach ~80%
    assert epoch["epoch_seconds"] > 0 and epoch["samples_per_s"] > 0
    assert png.read_bytes()[:8] == PNG_MAGIC
    ck = load_checkpoint(ckpt)
    assert (ck.epoch, ck.step) == (1, 30) and ck.config["model"] == "cnn"
    assert ck.model["2.weight"].shape == (32, 16, 3, 3)
    assert (dumps / "train-64x1x28x28").is_dir() and any((dumps / "train-64x1x28x28").iterdir())
    assert (dumps / "inference-1000x1x28x28").is_dir()

    res = subprocess.run(_ember() + ["plot", str(metrics), "-o", str(tmp_path / "again.png")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "again.png").read_bytes()[:8] == PNG_MAGIC


def test_ctrl_c_saves_mid_epoch_and_resume_continues(tmp_path):
    """SIGINT stops after the current step and writes the checkpoint; --resume picks up at the
    next batch of the same epoch."""
    import signal
    import time
    require_mnist()
    ckpt = tmp_path / "c.safetensors"
    base = _ember() + ["mnist", "--model", "cnn", "--device", "cpu", "--data", str(MNIST_DIR), "--no-progress",
                       "--save", str(ckpt), "--metrics-file", str(tmp_path / "m.jsonl"), "--log-every", "1"]
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen(base + ["--epochs", "1"], stdout=subprocess.PIPE, stderr=err, text=True)
        lines = []
        for line in proc.stdout:  # wait until training has started
            lines.append(line)
            if line.startswith("compiled the training step"):
                break
        metrics, deadline = tmp_path / "m.jsonl", time.monotonic() + 120
        while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().count('"type": "step"') >= 3):
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=300)
    out = "".join(lines) + out
    assert proc.returncode == 130, out + (tmp_path / "stderr.txt").read_text()
    ck = load_checkpoint(ckpt)
    assert ck.epoch == 0 and 3 <= ck.step == ck.step_in_epoch < 938, (ck.step, ck.step_in_epoch)
    assert f"stopped at step {ck.step}; resume with --resume {ckpt}" in out

    res = subprocess.run(base + ["--epochs", "1", "--resume", str(ckpt), "--limit-steps", str(ck.step + 4)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if r["type"] == "step"]
    assert steps == list(range(1, ck.step + 5))  # no step lost or repeated across the stop
    assert records[-1]["type"] == "epoch" and records[-1]["resumed_at_step_in_epoch"] == ck.step
    assert (load_checkpoint(ckpt).epoch, load_checkpoint(ckpt).step) == (1, ck.step + 4)
