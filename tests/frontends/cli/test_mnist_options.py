"""`ember mnist`'s training options on short MLP runs (device cpu): learning-rate schedules
against torch.optim.lr_scheduler, resume inside a schedule, label smoothing against PyTorch,
the validation split, the run folder, --save-every, --dataset, and their refusals; `ember bench`
with more threads than cores."""
from __future__ import annotations

import json
import os
import warnings
import shutil

import numpy as np
import pytest

from ember.frontends import cli, nn
from ember.frontends import functional as F
from ember.frontends.checkpoint import load_checkpoint
from ember.frontends.cli import mnist
from ember.frontends.training import Trainer, build_model, make_optimizer
from ember.frontends.training.metrics import read_metrics
from ember.frontends.training.recipes import LRSchedule

from conftest import require_mnist

LIMIT = 6  # steps per epoch


@pytest.fixture(scope="module")
def mnist_dir():
    return str(require_mnist())


def _run(tmp_path, mnist_dir, *extra: str, metrics: str | None = "m.jsonl") -> int:
    argv = ["mnist", "--model", "mlp", "--device", "cpu", "--data", mnist_dir, "--limit-steps", str(LIMIT),
            "--log-every", "1", "--no-progress", "--eval-batch-size", "2000",
            *(["--metrics-file", str(tmp_path / metrics)] if metrics else []), *extra]
    return cli.main(argv)


def _steps(path):
    return [r for r in read_metrics(path) if r["type"] == "step"]


def _torch_lrs(steps: int, lr: float, make):
    """get_last_lr() before each of `steps` optimizer steps, as a torch training loop sees it."""
    torch = pytest.importorskip("torch")
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    sched = make(opt, torch.optim.lr_scheduler)
    out = []
    for _ in range(steps):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


TOTAL = 2 * LIMIT
SCHEDULES = {
    "cosine-warmup": (["--lr-schedule", "cosine", "--warmup-steps", "3"],
                      lambda o, S: S.SequentialLR(o, [S.LinearLR(o, 0.1, 1.0, 3), S.CosineAnnealingLR(o, TOTAL - 3)],
                                                  milestones=[3])),
    "linear": (["--lr-schedule", "linear"], lambda o, S: S.LinearLR(o, 1.0, 0.0, TOTAL)),
    "step-warmup": (["--lr-schedule", "step", "--lr-step-size", "4", "--lr-gamma", "0.5", "--warmup-steps", "2"],
                    lambda o, S: S.SequentialLR(o, [S.LinearLR(o, 0.1, 1.0, 2), S.StepLR(o, 4, 0.5)], milestones=[2])),
    "onecycle": (["--lr-schedule", "onecycle"],
                 lambda o, S: S.OneCycleLR(o, max_lr=0.05, total_steps=TOTAL, cycle_momentum=False)),
    "constant-warmup": (["--warmup-steps", "4"], lambda o, S: S.LinearLR(o, 0.1, 1.0, 4)),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_lr_per_step_is_torchs(tmp_path, mnist_dir, name, capsys):
    flags, make = SCHEDULES[name]
    assert _run(tmp_path, mnist_dir, "--epochs", "2", "--lr", "0.05", *flags) == 0
    got = [r["lr"] for r in _steps(tmp_path / "m.jsonl")]
    assert got == pytest.approx(_torch_lrs(TOTAL, 0.05, make), rel=1e-12, abs=1e-15)
    out = capsys.readouterr().out
    assert "lr schedule: " in out and "SGD(lr=0.05, momentum=0.0," in out


def test_the_compiled_step_follows_the_schedule():
    """A 1-parameter model whose loss has gradient 1: each step moves the weight by that step's rate."""
    nn.manual_seed(0)
    model = nn.Linear(1, 1, bias=False)
    model.weight.data[...] = 0.0
    # batch 2: a batch of 1 hits a fusion bug (KeyError in fusion._spec for a 1-row matmul)
    x, y = np.ones((16, 1), np.float32), np.zeros(16, np.int64)
    t = Trainer(model, make_optimizer("sgd", 0.5), (x, y), device="cpu", batch_size=2, log_every=1,
                loss_fn=lambda out, _: F.mean(out), lr_schedule=LRSchedule("cosine", warmup_steps=3), epochs=2)
    weights = [0.0]
    inner = t.step.run

    def run(xb, yb, check_labels=True):
        loss = inner(xb, yb, check_labels=check_labels)
        weights.append(float(t.step.state_dict()["weight"][0, 0]))
        return loss

    t.step.run = run
    t.fit(2)
    want = _torch_lrs(16, 0.5, lambda o, S: S.SequentialLR(
        o, [S.LinearLR(o, 0.1, 1.0, 3), S.CosineAnnealingLR(o, 13)], milestones=[3]))
    assert list(-np.diff(weights)) == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert [r["lr"] for r in t.records if r["type"] == "step"] == pytest.approx(want, rel=1e-12)


def test_resume_continues_the_schedule(tmp_path, mnist_dir, monkeypatch, capsys):
    flags = ["--epochs", "2", "--lr-schedule", "cosine", "--warmup-steps", "2", "--shuffle", "--momentum", "0.9"]
    assert _run(tmp_path, mnist_dir, *flags, metrics="whole.jsonl") == 0

    class StopAt8(Trainer):  # what a Ctrl-C after step 8 does (the flag the signal handler sets)
        def record(self, rec):
            super().record(rec)
            if rec["type"] == "step" and rec["step"] == 8:
                self.stop_requested = True

    monkeypatch.setattr(mnist, "Trainer", StopAt8)
    ckpt = str(tmp_path / "c.safetensors")
    assert _run(tmp_path, mnist_dir, *flags, "--save", ckpt, metrics="part.jsonl") == 130
    assert load_checkpoint(ckpt).step == 8
    monkeypatch.setattr(mnist, "Trainer", Trainer)
    assert _run(tmp_path, mnist_dir, *flags, "--resume", ckpt, metrics="part.jsonl") == 0
    whole, part = _steps(tmp_path / "whole.jsonl"), _steps(tmp_path / "part.jsonl")
    assert [(r["step"], r["loss"], r["lr"]) for r in part] == [(r["step"], r["loss"], r["lr"]) for r in whole]

    capsys.readouterr()  # a schedule of another length (--epochs 3) is refused, naming both
    assert _run(tmp_path, mnist_dir, *flags[2:], "--epochs", "3", "--resume", ckpt, metrics="x.jsonl") == 2
    err = capsys.readouterr().err
    assert "lr_schedule=" in err and "Cosine(t_max=10" in err and "Cosine(t_max=16" in err


def test_label_smoothing_loss_is_pytorchs(tmp_path, mnist_dir):
    torch = pytest.importorskip("torch")
    from ember.runtime.data import load_mnist
    assert _run(tmp_path, mnist_dir, "--epochs", "1", "--limit-steps", "1", "--label-smoothing", "0.2") == 0
    loss = _steps(tmp_path / "m.jsonl")[0]["loss"]
    x, y = load_mnist(mnist_dir, "train", flat=True)
    tm = torch.nn.Sequential(torch.nn.Linear(784, 30), torch.nn.Sigmoid(), torch.nn.Linear(30, 10))
    tm.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in build_model("mlp", 0).state_dict().items()})
    want = torch.nn.functional.cross_entropy(tm(torch.from_numpy(x[:64])), torch.from_numpy(y[:64]),
                                             label_smoothing=0.2).item()
    assert loss == pytest.approx(want, rel=1e-5)
    plain = torch.nn.functional.cross_entropy(tm(torch.from_numpy(x[:64])), torch.from_numpy(y[:64])).item()
    assert abs(loss - plain) > 1e-3  # the smoothing did change the loss


def test_val_split_holds_out_the_last_fraction(tmp_path, mnist_dir, capsys):
    from ember.runtime.data import load_mnist
    # lr 0: the epoch's model is the initial one, so its validation loss can be computed here
    assert _run(tmp_path, mnist_dir, "--epochs", "1", "--limit-steps", "1", "--lr", "0", "--val-split", "0.1") == 0
    out = capsys.readouterr().out
    assert "54000 training + 6000 validation (the last 0.1 of 60000)" in out.splitlines()[0]
    assert "val loss" in out and "val accuracy" in out
    epoch = [r for r in read_metrics(tmp_path / "m.jsonl") if r["type"] == "epoch"][0]
    x, y = load_mnist(mnist_dir, "train", flat=True)
    w = {k: v.astype(np.float64) for k, v in build_model("mlp", 0).state_dict().items()}
    h = 1 / (1 + np.exp(-(x[54000:] @ w["0.weight"].T + w["0.bias"])))
    z = h @ w["2.weight"].T + w["2.bias"]
    lse = z.max(1) + np.log(np.exp(z - z.max(1, keepdims=True)).sum(1))
    assert epoch["val_loss"] == pytest.approx(float((lse - z[np.arange(6000), y[54000:]]).mean()), rel=1e-5)
    assert epoch["val_acc"] == pytest.approx(float((z.argmax(1) == y[54000:]).mean()), abs=1 / 6000)


def test_output_dir_numbered_runs_and_resume_into_one(tmp_path, mnist_dir, capsys):
    runs = tmp_path / "runs"
    assert _run(tmp_path, mnist_dir, "--epochs", "1", "--output-dir", str(runs), metrics=None) == 0
    assert _run(tmp_path, mnist_dir, "--epochs", "1", "--output-dir", str(runs), "--metrics-file",
                str(tmp_path / "mine.jsonl"), metrics=None) == 0
    assert sorted(p.name for p in runs.iterdir()) == ["run-001", "run-002"]
    first = runs / "run-001"
    want = {"config.json", "checkpoint.safetensors", "metrics.jsonl"}
    try:
        import matplotlib  # noqa: F401
        want.add("curves.png")
    except ImportError:
        pass
    assert {p.name for p in first.iterdir()} == want
    assert (tmp_path / "mine.jsonl").exists() and not (runs / "run-002" / "metrics.jsonl").exists()  # explicit wins
    config = json.loads((first / "config.json").read_text())
    assert config["model"] == "mlp" and config["run_dir"] == str(first) and config["epochs"] == 1
    assert load_checkpoint(first / "checkpoint.safetensors").epoch == 1

    capsys.readouterr()  # --resume of a run folder continues in it: no run-003
    assert _run(tmp_path, mnist_dir, "--epochs", "2", "--output-dir", str(runs), "--resume", str(first),
                metrics=None) == 0
    assert f"run folder: {first}" in capsys.readouterr().out
    assert sorted(p.name for p in runs.iterdir()) == ["run-001", "run-002"]
    records = read_metrics(first / "metrics.jsonl")
    assert [r["type"] for r in records].count("run") == 2 and records[-1]["epoch"] == 2
    assert load_checkpoint(first / "checkpoint.safetensors").epoch == 2

    # --resume of a run folder without --output-dir continues in it too (it once trained and wrote
    # nothing: no checkpoint, no metrics)
    assert _run(tmp_path, mnist_dir, "--epochs", "3", "--resume", str(first / "checkpoint.safetensors"),
                metrics=None) == 0
    assert f"run folder: {first}" in capsys.readouterr().out
    assert load_checkpoint(first / "checkpoint.safetensors").epoch == 3
    assert read_metrics(first / "metrics.jsonl")[-1]["epoch"] == 3
    assert sorted(p.name for p in runs.iterdir()) == ["run-001", "run-002"]

    (tmp_path / "afile").write_text("")
    assert _run(tmp_path, mnist_dir, "--output-dir", str(tmp_path / "afile")) == 2
    assert "--output-dir" in capsys.readouterr().err


def test_save_every_writes_mid_epoch_checkpoints_that_resume_exactly(tmp_path, mnist_dir):
    from ember.runtime.data import load_mnist
    x, y = load_mnist(mnist_dir, "train", flat=True)

    def trainer():
        return Trainer(build_model("mlp", 1), make_optimizer("sgd", 0.05, 0.5), (x[:2000], y[:2000]), None,
                       device="cpu", shuffle=True, seed=1, limit_steps=12, log_every=1,
                       config={"model": "mlp", "optimizer": "sgd"})

    path = tmp_path / "c.safetensors"
    whole = trainer()
    saved = []
    save = whole.save

    def save_and_keep(p):
        save(p)
        saved.append(whole.global_step)
        shutil.copy(p, tmp_path / f"at-{whole.global_step}.safetensors")

    whole.save = save_and_keep
    whole.fit(1, save=path, save_every=5)
    assert saved == [5, 10, 12]
    ck = load_checkpoint(tmp_path / "at-10.safetensors")
    assert (ck.epoch, ck.step, ck.step_in_epoch) == (0, 10, 10)
    rest = trainer()
    rest.load(tmp_path / "at-10.safetensors")
    rest.fit(1)
    losses = [r["loss"] for r in whole.records if r["type"] == "step"]
    assert [r["loss"] for r in rest.records if r["type"] == "step"] == losses[10:]


def test_dataset_option_says_where_the_data_comes_from(tmp_path, capsys):
    from ember.frontends.training.datasets import dataset_dir, missing_mnist_files
    folder = dataset_dir("fashion-mnist")
    if missing_mnist_files(folder):
        pytest.skip(f"Fashion-MNIST not installed (apt install dataset-fashion-mnist); {folder}")
    assert cli.main(["mnist", "--model", "mlp", "--dataset", "fashion-mnist", "--limit-steps", "2", "--no-progress",
                     "--eval-batch-size", "2000", "--save", str(tmp_path / "f.safetensors")]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith(f"data: fashion-mnist from {folder} (60000 training")
    # a checkpoint of one dataset does not resume on the other
    assert cli.main(["mnist", "--model", "mlp", "--data", str(require_mnist()), "--epochs", "2", "--no-progress",
                     "--resume", str(tmp_path / "f.safetensors")]) == 2
    assert "dataset='fashion-mnist', this run has dataset='mnist'" in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [
    (["--nesterov"], "--nesterov: Nesterov momentum requires a momentum and zero dampening; add --momentum"),
    (["--optimizer", "adam", "--nesterov"], "--nesterov: applies to --optimizer sgd"),
    (["--weight-decay", "-1"], "--weight-decay -1.0: expected a finite weight decay >= 0"),
    (["--lr-step-size", "3"], "--lr-step-size 3: applies to --lr-schedule step (this run: constant)"),
    (["--lr-schedule", "step"], "--lr-schedule step needs --lr-step-size N"),
    (["--label-smoothing", "1"], "--label-smoothing 1.0: expected a number in [0, 1)"),
    (["--val-split", "1.5"], "--val-split 1.5: expected a fraction of the training set in (0, 1)"),
    (["--save-every", "5"], "--save-every 5: needs a checkpoint file: add --save FILE or --output-dir DIR"),
    (["--lr-schedule", "cosine", "--warmup-steps", "6"], "--warmup-steps 6: the run has 6 steps in all"),
], ids=lambda v: v if isinstance(v, str) and v.startswith("--") else None)
def test_refusals_are_one_line(tmp_path, mnist_dir, capsys, flags, message):
    assert _run(tmp_path, mnist_dir, *flags) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_data_parallel_epoch_line_gives_the_global_rate():
    rec = {"epoch": 1, "steps": 3, "train_loss": 1.0, "test_loss": 1.0, "test_acc": 0.5, "epoch_seconds": 1.0,
           "samples_per_s": 100.0, "samples_per_s_all_ranks": 200.0}
    assert mnist._epoch_line(rec, 1, 10, world_size=2).endswith("200 samples/s (all 2 ranks)")
    assert mnist._epoch_line(rec, 1, 10).endswith("; 1.0 s, 100 samples/s")


def test_bench_warns_once_when_threads_exceed_the_cores(monkeypatch, capsys):
    pytest.importorskip("torch")
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    for name in ("OMP_NUM_THREADS", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):  # bench sets them; put them back after
        monkeypatch.delenv(name, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli.main(["bench", "--model", "mlp", "--threads", "2", "--steps", "4", "--warmup", "1",
                         "--no-torch-compile"]) == 0
    assert not caught, [str(w.message) for w in caught]  # PyTorch's float(loss) warning no longer leaks
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "warning" in line.lower()]
    assert len(lines) == 1 and "--threads 2 exceeds the 1 cores" in lines[0], err
    assert "measured fp32 FMA peak on 1 thread(s)" in err


def test_optimizer_options_build_torchs_optimizers():
    assert repr(make_optimizer("sgd", 0.1, 0.9, 1e-4, nesterov=True)) == (
        "SGD(lr=0.1, momentum=0.9, dampening=0.0, nesterov=True, weight_decay=0.0001, schedule=None)")
    assert make_optimizer("adamw", 1e-3).config.weight_decay == 0.01  # torch.optim.AdamW's default
    assert make_optimizer("adamw", 1e-3, weight_decay=0.0).config.weight_decay == 0.0
    assert make_optimizer("adam", 1e-3, weight_decay=0.1).config.weight_decay == 0.1
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum"):
        make_optimizer("sgd", 0.1, nesterov=True)
