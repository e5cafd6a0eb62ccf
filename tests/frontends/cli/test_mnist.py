"""`ember mnist` and the Trainer on short slices of MNIST (MLP, device cpu): resuming gives the
same run as not stopping, the metrics file is valid JSON lines, plots are PNGs, and the
command refuses what it cannot do with a clear message."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from ember.frontends import cli
from ember.frontends.cli import mnist
from ember.frontends.checkpoint import load_checkpoint
from ember.frontends.training.metrics import MetricsError, read_metrics
from ember.frontends.training import Trainer, build_model, make_optimizer

from conftest import require_mnist

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LIMIT = 12  # steps per epoch


@pytest.fixture(scope="module")
def mnist_dir():
    return str(require_mnist())


def _mnist(tmp_path, mnist_dir, *extra: str, metrics: str = "m.jsonl") -> int:
    argv = ["mnist", "--model", "mlp", "--device", "cpu", "--data", mnist_dir, "--limit-steps", str(LIMIT),
            "--log-every", "1", "--no-progress", "--metrics-file", str(tmp_path / metrics), *extra]
    return cli.main(argv)


def _losses(records):
    return [r["loss"] for r in records if r["type"] == "step"]


def _epochs(records):
    return [{k: r[k] for k in ("epoch", "step", "steps", "samples", "train_loss", "test_loss", "test_acc")}
            for r in records if r["type"] == "epoch"]


@pytest.mark.parametrize("opt", [["--optimizer", "sgd", "--momentum", "0.9"], ["--optimizer", "adam", "--lr", "0.001"]],
                         ids=["sgd-momentum", "adam"])
def test_two_epochs_equal_one_epoch_save_resume_one_more(tmp_path, mnist_dir, opt):
    common = ["--shuffle", "--seed", "3", *opt]
    assert _mnist(tmp_path, mnist_dir, "--epochs", "2", "--save", str(tmp_path / "a.safetensors"), *common,
                  metrics="a.jsonl") == 0
    assert _mnist(tmp_path, mnist_dir, "--epochs", "1", "--save", str(tmp_path / "b.safetensors"), *common,
                  metrics="b.jsonl") == 0
    first = load_checkpoint(tmp_path / "b.safetensors")
    assert (first.epoch, first.step, first.step_in_epoch) == (1, LIMIT, 0)
    assert _mnist(tmp_path, mnist_dir, "--epochs", "2", "--resume", str(tmp_path / "b.safetensors"),
                  "--save", str(tmp_path / "b.safetensors"), *common, metrics="b.jsonl") == 0

    a, b = read_metrics(tmp_path / "a.jsonl"), read_metrics(tmp_path / "b.jsonl")  # b: appended by the resumed run
    assert [r["type"] for r in b].count("run") == 2
    assert len(_losses(a)) == 2 * LIMIT
    assert _losses(a) == _losses(b)  # identical, not close
    assert _epochs(a) == _epochs(b)
    assert [r["step"] for r in b if r["type"] == "step"] == list(range(1, 2 * LIMIT + 1))
    ca, cb = load_checkpoint(tmp_path / "a.safetensors"), load_checkpoint(tmp_path / "b.safetensors")
    assert (ca.epoch, ca.step) == (cb.epoch, cb.step) == (2, 2 * LIMIT)
    for part in ("model", "optimizer"):
        da, db = getattr(ca, part), getattr(cb, part)
        assert set(da) == set(db) and all(np.array_equal(da[k], db[k]) for k in da), part


def test_stopped_mid_epoch_resumes_at_the_next_batch(tmp_path, mnist_dir):
    from ember.runtime.data import load_mnist
    x, y = load_mnist(mnist_dir, "train", flat=True)
    data = (x[:2000], y[:2000])

    def trainer():
        return Trainer(build_model("mlp", 1), make_optimizer("sgd", 0.05, 0.5), data, None, device="cpu",
                       shuffle=True, seed=1, limit_steps=LIMIT, log_every=1, config={"model": "mlp", "optimizer": "sgd"})

    whole = trainer()
    whole.fit(2)

    class StopAfter:  # the flag a Ctrl-C sets, raised after the 5th step of epoch 2
        def __init__(self, t, n):
            self.t, self.inner, self.n = t, t.step, n

        def run(self, xb, yb, check_labels=True):  # the trainer's entry into the step
            loss = self.inner.run(xb, yb, check_labels=check_labels)
            self.n -= 1
            self.t.stop_requested = self.n == 0
            return loss

        def __getattr__(self, name):
            return getattr(self.inner, name)

    part = trainer()
    part.step = StopAfter(part, LIMIT + 5)
    part.fit(2, save=tmp_path / "c.safetensors")
    assert (part.epoch, part.global_step, part.step_in_epoch) == (1, LIMIT + 5, 5)
    ck = load_checkpoint(tmp_path / "c.safetensors")
    assert (ck.epoch, ck.step, ck.step_in_epoch) == (1, LIMIT + 5, 5)

    rest = trainer()
    rest.load(tmp_path / "c.safetensors")
    rest.fit(2)
    assert _losses(part.records) + _losses(rest.records) == _losses(whole.records)
    for k, v in whole.step.state_dict().items():
        assert np.array_equal(v, rest.step.state_dict()[k])
    assert rest.records[-1]["resumed_at_step_in_epoch"] == 5


def test_metrics_file_plot_and_ember_plot(tmp_path, mnist_dir, capsys):
    pytest.importorskip("matplotlib")
    assert _mnist(tmp_path, mnist_dir, "--epochs", "2", "--log-every", "4", "--plot", str(tmp_path / "curves.png")) == 0
    out = capsys.readouterr().out
    assert "epoch 2/2: train loss" in out and "test accuracy" in out
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]  # every line is strict JSON
    assert [r["type"] for r in records] == ["run"] + ["step"] * 3 + ["epoch"] + ["step"] * 3 + ["epoch"]
    run = records[0]
    assert run["model"] == "mlp" and run["device"] == "cpu" and run["batch_size"] == 64 and run["limit_steps"] == LIMIT
    for r in records[1:]:
        assert r["step"] >= 1 and r["epoch"] in (1, 2)
        if r["type"] == "step":
            assert r["step"] % 4 == 0 and math.isfinite(r["loss"]) and r["samples_per_s"] > 0
        else:
            assert r["steps"] == LIMIT and r["samples"] == LIMIT * 64
            for key in ("train_loss", "test_loss", "samples_per_s", "epoch_seconds"):
                assert math.isfinite(r[key]) and r[key] > 0, key
            assert 0 <= r["test_acc"] <= 1
    assert records[-1]["test_loss"] < 2.3  # 24 steps of the MLP already learn something
    assert (tmp_path / "curves.png").read_bytes()[:8] == PNG_MAGIC

    assert cli.main(["plot", str(tmp_path / "m.jsonl"), "-o", str(tmp_path / "again.png")]) == 0
    assert (tmp_path / "again.png").read_bytes()[:8] == PNG_MAGIC
    assert cli.main(["plot", str(tmp_path / "m.jsonl"), str(tmp_path / "m.jsonl"), "-o", str(tmp_path / "two.png")]) == 0
    assert (tmp_path / "two.png").stat().st_size > 1000

    (tmp_path / "bad.jsonl").write_text('{"type": "step", "step": 1, "loss": 2.0}\nnot json\n')
    with pytest.raises(MetricsError, match=r"bad\.jsonl:2: not valid JSON"):
        read_metrics(tmp_path / "bad.jsonl")
    assert cli.main(["plot", str(tmp_path / "bad.jsonl"), "-o", str(tmp_path / "x.png")]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err


def test_init_weights_are_the_starting_point(tmp_path, mnist_dir):
    init = build_model("mlp", 7).state_dict()
    np.savez(tmp_path / "init.npz", **init)
    # lr 0: one step leaves the parameters where they started
    assert _mnist(tmp_path, mnist_dir, "--epochs", "1", "--limit-steps", "1", "--lr", "0",
                  "--init-weights", str(tmp_path / "init.npz"), "--save", str(tmp_path / "c.safetensors")) == 0
    got = load_checkpoint(tmp_path / "c.safetensors").model
    assert all(np.array_equal(got[k], v) for k, v in init.items())


def test_verbose_says_where_the_compile_went(tmp_path, mnist_dir, monkeypatch, capsys):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))
    for cached in (False, True):
        assert _mnist(tmp_path, mnist_dir, "--epochs", "1", "--limit-steps", "1", "--verbose") == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("compile: "))
        assert "passes " in line and "render " in line and "compiler " in line, line
        objects = int(line.split(" objects (")[0].rsplit(" ", 1)[1])
        assert (f"({objects} cached, 0 built" if cached else f"(0 cached, {objects} built") in line, line


def test_refusals_are_clear(tmp_path, mnist_dir, monkeypatch, capsys):
    try:
        import cupy  # noqa: F401
    except ImportError:  # without CuPy, --device cuda says what to install
        assert cli.main(["mnist", "--device", "cuda", "--data", mnist_dir]) == 2
        assert "--device cuda: device 'cuda' needs CuPy: pip install 'ember[cuda13]'" in capsys.readouterr().err

    # an empty folder and no reachable mirror: the error says to pass --data
    monkeypatch.setattr(mnist, "MNIST_MIRRORS", ("http://127.0.0.1:9/",))
    assert cli.main(["mnist", "--model", "mlp", "--data", str(tmp_path / "empty"), "--download"]) == 2
    err = capsys.readouterr().err
    assert "could not download" in err and "pass --data DIR" in err

    np.savez(tmp_path / "cnn.npz", **build_model("cnn").state_dict())
    assert _mnist(tmp_path, mnist_dir, "--init-weights", str(tmp_path / "cnn.npz")) == 2
    assert "does not fit the mlp model" in capsys.readouterr().err

    assert _mnist(tmp_path, mnist_dir, "--epochs", "1", "--limit-steps", "1",
                  "--save", str(tmp_path / "mlp.safetensors")) == 0
    capsys.readouterr()
    assert cli.main(["mnist", "--model", "cnn", "--device", "cpu", "--data", mnist_dir, "--no-progress",
                     "--resume", str(tmp_path / "mlp.safetensors")]) == 2
    assert "written with model='mlp', this run has model='cnn'" in capsys.readouterr().err


@pytest.mark.parametrize("name,seed", [("cnn", 0), ("mlp", 0), ("mlp", 12345)])
def test_default_init_is_pytorchs_bit_for_bit(name, seed):
    torch = pytest.importorskip("torch")
    from ember.frontends.cli.align import _torch_model
    torch.manual_seed(seed)
    want = {k: v.numpy() for k, v in _torch_model(name).state_dict().items()}
    got = build_model(name, seed).state_dict()  # init="torch" is the default
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == np.float32 and np.array_equal(got[k], want[k]), k
    own = build_model(name, seed, init="ember").state_dict()
    assert not np.array_equal(own["0.weight"], want["0.weight"])  # ember's own generator differs
