"""Ordinary mistakes end in one line `ember <command>: error: ...` with exit status 2, checked
before any data is read or step compiled; a diverged run stops and never overwrites a good
checkpoint. All in-process through `cli.main` on small slices of MNIST (the MLP)."""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

from ember.codegen import compiler as C
from ember.frontends import nn, optim
from ember.frontends import cli
from ember.frontends.cli import mnist
from ember.frontends.training import trainer
from ember.frontends import compile as ember_compile
from ember.frontends.checkpoint import load_checkpoint
from ember.frontends.cli.cli_checks import format_loss
from ember.frontends.training.metrics import read_metrics

from models import MNIST_DIR


@pytest.fixture(scope="module")
def mnist_dir():
    if not (MNIST_DIR / "train-images-idx3-ubyte.gz").exists():
        pytest.skip(f"MNIST not found at {MNIST_DIR}")
    return str(MNIST_DIR)


@pytest.fixture
def a_file(tmp_path):
    """A regular file: a path under it can never be created, even by root (which these tests
    run as, so a chmod'ed read-only folder would still be writable)."""
    f = tmp_path / "a_file"
    f.write_text("x")
    return f


def _fail(capsys, argv: list[str], code: int = 2) -> str:
    assert cli.main(argv) == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def _mnist(mnist_dir: str, *extra: str) -> list[str]:
    return ["mnist", "--model", "mlp", "--device", "cpu", "--data", mnist_dir, "--limit-steps", "2",
            "--no-progress", *extra]


# ---- 4: every output is checked before the first step, before compile even -----------------------

@pytest.fixture
def no_compile(monkeypatch):
    """Any of these checks reaching the compile is a failure of the check."""
    def boom(*a, **k):
        raise AssertionError("compiled before the arguments were checked")
    monkeypatch.setattr(trainer, "ember_compile", boom)


def test_output_paths_are_checked_before_compiling(tmp_path, a_file, mnist_dir, capsys, monkeypatch, no_compile):
    under = a_file / "sub"
    cases = [
        (["--save", str(tmp_path)], f"ember mnist: error: --save {tmp_path}: is a directory; expected a file name"),
        (["--save", str(under / "c.st")], f"--save {under / 'c.st'}: {a_file} is a file, not a directory"),
        (["--plot", str(tmp_path / "foo.xyz")], f"--plot {tmp_path / 'foo.xyz'}: unknown image format '.xyz'; expected one of"),
        (["--plot", str(under / "c.png")], f"--plot {under / 'c.png'}: {a_file} is a file, not a directory"),
        (["--metrics-file", str(tmp_path)], f"--metrics-file {tmp_path}: is a directory"),
        (["--metrics-file", str(under / "m.jsonl")], f"--metrics-file {under / 'm.jsonl'}: {a_file} is a file"),
        (["--dump-kernels", str(a_file)], f"--dump-kernels {a_file}: is a file; expected a directory"),
        (["--tensorboard", str(a_file)], f"--tensorboard {a_file}: is a file; expected a directory"),
    ]
    for extra, want in cases:
        assert want in _fail(capsys, _mnist(mnist_dir, *extra)), extra
    monkeypatch.setenv("EMBER_DUMP_DIR", str(a_file))
    assert f"EMBER_DUMP_DIR {a_file}: is a file; expected a directory" in _fail(capsys, _mnist(mnist_dir))


def test_unwritable_output_folder_is_refused(tmp_path, mnist_dir, capsys, monkeypatch, no_compile):
    # root may write anywhere: os.access stands in for a read-only folder
    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == ro else real(p, mode))
    for flag, name in (("--save", "c.st"), ("--plot", "c.png"), ("--metrics-file", "m.jsonl")):
        err = _fail(capsys, _mnist(mnist_dir, flag, str(ro / name)))
        assert f"{flag} {ro / name}: cannot write in {ro} (permission denied)" in err
    assert f"--tensorboard {ro}: cannot write in this directory" in _fail(capsys, _mnist(mnist_dir, "--tensorboard", str(ro)))


# ---- 5: a diverged run ---------------------------------------------------------------------------

def test_non_finite_and_negative_hyperparameters_are_refused(mnist_dir, capsys, no_compile):
    assert "--lr nan: expected a finite learning rate >= 0" in _fail(capsys, _mnist(mnist_dir, "--lr", "nan"))
    assert "--lr inf: expected a finite" in _fail(capsys, _mnist(mnist_dir, "--lr", "inf"))
    assert "--lr -0.1: expected a finite learning rate >= 0" in _fail(capsys, _mnist(mnist_dir, "--lr", "-0.1"))
    assert "--momentum nan: expected a finite momentum >= 0" in _fail(capsys, _mnist(mnist_dir, "--momentum", "nan"))
    assert "--momentum -0.5" in _fail(capsys, _mnist(mnist_dir, "--momentum", "-0.5"))
    with pytest.raises(ValueError, match="Invalid lr: nan"):
        optim.SGD(lr=float("nan"))
    with pytest.raises(ValueError, match="Invalid lr: inf"):
        optim.Adam(lr=float("inf"))


def test_diverged_run_stops_and_keeps_the_good_checkpoint(tmp_path, mnist_dir, capsys):
    good = tmp_path / "good.st"
    assert cli.main(_mnist(mnist_dir, "--save", str(good))) == 0
    before = good.read_bytes()
    capsys.readouterr()
    # lr 1e38: the first update overflows float32; the next loss is inf
    err = _fail(capsys, _mnist(mnist_dir, "--epochs", "2", "--limit-steps", "5", "--resume", str(good), "--save",
                               str(good), "--lr", "1e38", "--metrics-file", str(tmp_path / "m.jsonl")), code=1)
    assert err == (f"ember mnist: error: the training loss became inf at epoch 2, step 4; stopped. Try a lower --lr "
                   f"(this run: 1e+38); --save {good} keeps its previous contents (non-finite parameters are never saved)")
    assert good.read_bytes() == before and load_checkpoint(good).epoch == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.st", "m.jsonl"]  # nothing written beside it
    assert read_metrics(tmp_path / "m.jsonl")[-1] == {"type": "diverged", "epoch": 2, "step": 4, "step_in_epoch": 2,
                                                      "loss": None}


def test_non_finite_parameters_are_never_saved(tmp_path, mnist_dir):
    from ember.frontends.training import NonFiniteError, Trainer, build_model, make_optimizer
    from ember.runtime.data import load_mnist
    x, y = load_mnist(mnist_dir, "train", flat=True)
    t = Trainer(build_model("mlp"), make_optimizer("sgd", 0.05), (x[:256], y[:256]), device="cpu", limit_steps=2)
    t.fit(1, save=tmp_path / "c.st")
    before = (tmp_path / "c.st").read_bytes()
    t.model.parameters()[0].data[0, 0] = np.inf  # as an update that overflowed after a finite loss leaves it
    with pytest.raises(NonFiniteError, match="not written: the parameters or optimizer state are not finite"):
        t.save(tmp_path / "c.st")
    # the epoch's losses can all be finite and its update still overflow: checked before every save
    t.step.__class__ = type("Finite", (type(t.step),), {"run": lambda self, x, y, check_labels=True: np.float32(1.0)})
    t.fit(2, save=tmp_path / "c.st")
    assert t.diverged == {"type": "diverged", "epoch": 2, "step": 4, "step_in_epoch": 0, "loss": None,
                          "reason": "parameters"}
    assert (tmp_path / "c.st").read_bytes() == before


def test_large_losses_print_readably(mnist_dir, capsys):
    assert format_loss(1.4618e32) == "1.46e+32" and format_loss(0.123456) == "0.1235" and format_loss(float("nan")) == "nan"
    assert cli.main(_mnist(mnist_dir, "--lr", "1e30")) == 0  # huge but finite: the sigmoid MLP saturates
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("epoch 1/1"))
    assert re.search(r"train loss \d(\.\d+)?e\+\d\d, test loss \d(\.\d+)?e\+\d\d,", line), line


# ---- 6: one line for ordinary mistakes -----------------------------------------------------------

def test_flags_are_named(mnist_dir, capsys, no_compile):
    assert _fail(capsys, _mnist(mnist_dir, "--batch-size", "0")) == "ember mnist: error: --batch-size 0: expected an integer >= 1"
    assert _fail(capsys, _mnist(mnist_dir, "--seed", "-1")) == "ember mnist: error: --seed -1: expected an integer in [0, 2**32)"
    assert _fail(capsys, _mnist(mnist_dir, "--log-every", "0")) == "ember mnist: error: --log-every 0: expected an integer >= 1"
    assert _fail(capsys, _mnist(mnist_dir, "--bucket-bytes", "0")) == \
        "ember mnist: error: --bucket-bytes 0: expected an integer >= 1"
    err = _fail(capsys, _mnist(mnist_dir, "--bucket-bytes", "1.5"))
    assert "--bucket-bytes" in err and "1.5" in err, err


def test_compile_checks_bucket_bytes():
    model = nn.Sequential(nn.Linear(4, 2))
    ex = (np.zeros((2, 4), np.float32), np.zeros((2,), np.int64))
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=r"bucket_bytes .*: expected an integer >= 1"):
            ember_compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example_inputs=ex, bucket_bytes=bad, device="reference")


def test_compile_refuses_empty_batches_and_parameterless_models():
    model = nn.Sequential(nn.Linear(4, 2))
    x, y = np.zeros((0, 4), np.float32), np.zeros((0,), np.int64)
    with pytest.raises(ValueError, match=r"example_inputs: input 'x' has a batch of 0 samples .*expected at least 1"):
        ember_compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example_inputs=(x, y), device="reference")
    with pytest.raises(ValueError, match="the model .* has no parameters to train"):
        ember_compile(nn.Sequential(nn.ReLU()), nn.CrossEntropyLoss(), optim.SGD(lr=0.1),
                      example_inputs=(np.zeros((2, 4), np.float32), np.zeros((2,), np.int64)), device="reference")
    step = ember_compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1),
                         example_inputs=(np.zeros((2, 4), np.float32), np.zeros((2,), np.int64)), device="reference")
    with pytest.raises(ValueError, match="the batch: input 'x' has a batch of 0 samples"):
        step(x, y)


def test_data_paths(tmp_path, a_file, mnist_dir, capsys, monkeypatch, no_compile):
    assert _fail(capsys, _mnist(str(a_file))) == \
        f"ember mnist: error: --data {a_file}: is a file; expected a folder holding the four MNIST IDX files"
    typo = tmp_path / "mnsit"
    assert _fail(capsys, _mnist(str(typo))) == (f"ember mnist: error: --data {typo}: no such folder; expected the "
                                                f"folder holding the four MNIST IDX files (add --download to download them there)")
    assert not typo.exists()  # nothing created, nothing downloaded
    (tmp_path / "empty").mkdir()
    assert "4 of the 4 MNIST files missing" in _fail(capsys, _mnist(str(tmp_path / "empty")))
    # the default folder (no --data) still downloads: here from a mirror that is not there
    monkeypatch.setattr(mnist, "MNIST_MIRRORS", ("http://127.0.0.1:9/",))
    monkeypatch.setenv("EMBER_DATA", str(tmp_path / "default"))
    assert cli.main(["mnist", "--model", "mlp", "--no-progress"]) == 2
    assert "could not download" in capsys.readouterr().err


def test_empty_training_set(tmp_path, capsys, no_compile):
    from ember.runtime.data import write_idx
    for stem, n in (("train", 0), ("t10k", 3)):
        write_idx(tmp_path / f"{stem}-images-idx3-ubyte", np.zeros((n, 28, 28), np.uint8))
        write_idx(tmp_path / f"{stem}-labels-idx1-ubyte", np.zeros((n,), np.uint8))
    assert _fail(capsys, _mnist(str(tmp_path))) == \
        f"ember mnist: error: --data {tmp_path}: the training set holds no images; expected the MNIST IDX files"


def test_resume_and_init_weights_files(tmp_path, mnist_dir, capsys, no_compile):
    assert _fail(capsys, _mnist(mnist_dir, "--resume", str(tmp_path))) == \
        f"ember mnist: error: --resume {tmp_path}: is a directory; expected a checkpoint file written by --save"
    bad = tmp_path / "x.st"
    bad.write_bytes(b"not weights")
    err = _fail(capsys, _mnist(mnist_dir, "--init-weights", str(bad)))
    assert err.startswith(f"ember mnist: error: --init-weights {bad}: unsupported weights file '.st'; expected a "
                          f".safetensors or .npz file"), err
    assert "does not fit" not in err
    nan = tmp_path / "nan.npz"
    np.savez(nan, **{"0.weight": np.full((2, 2), np.nan, np.float32), "0.bias": np.zeros(2, np.float32)})
    assert _fail(capsys, _mnist(mnist_dir, "--init-weights", str(nan))) == \
        f"ember mnist: error: --init-weights {nan}: 0.weight hold NaN or infinite values; expected finite initial weights"
    ckpt = tmp_path / "c.safetensors"
    ckpt.write_bytes(b"")
    assert _fail(capsys, _mnist(mnist_dir, "--resume", str(ckpt), "--init-weights", str(bad))) == \
        (f"ember mnist: error: --init-weights {bad} and --resume {ckpt}: a resumed run continues from the "
         f"checkpoint's weights; give one of them")


def test_missing_compiler_and_unusable_cache(tmp_path, a_file, mnist_dir, capsys, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(a_file / "cache"))
    err = _fail(capsys, _mnist(mnist_dir))
    assert err == (f"ember mnist: error: ember's compile cache {a_file / 'cache'} cannot be created (Not a directory); "
                   f"set EMBER_CACHE_DIR to a writable folder to move it")
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "fresh"))
    monkeypatch.setattr(C.shutil, "which", lambda name: None)
    err = _fail(capsys, _mnist(mnist_dir))
    assert err.startswith("ember mnist: error: C++ compiler 'g++' not found on PATH: a C++ compiler with OpenMP (g++) "
                          "is needed for device='cpu'; install it (Debian/Ubuntu: apt-get install g++"), err


def test_debug_shows_the_traceback(mnist_dir, monkeypatch):
    from ember.frontends.cli.cli_checks import UsageError
    with pytest.raises(UsageError, match="--batch-size 0"):
        cli.main(_mnist(mnist_dir, "--batch-size", "0", "--debug"))
    monkeypatch.setenv("EMBER_DEBUG", "1")
    with pytest.raises(UsageError):
        cli.main(_mnist(mnist_dir, "--seed", "-1"))


def test_ctrl_c_during_startup_exits_quietly(mnist_dir, capsys, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(trainer, "ember_compile", interrupted)
    assert cli.main(_mnist(mnist_dir)) == 130
    assert capsys.readouterr().err.strip() == "ember mnist: interrupted"


def test_plot_refusals(tmp_path, capsys):
    (tmp_path / "bin.jsonl").write_bytes(bytes(range(256)))
    assert _fail(capsys, ["plot", str(tmp_path / "bin.jsonl"), "-o", str(tmp_path / "a.png")]) == \
        (f"ember plot: error: {tmp_path / 'bin.jsonl'}:1: not UTF-8 text (a binary file?); expected the JSON-lines "
         f"file that `ember mnist --metrics-file` writes")
    (tmp_path / "types.jsonl").write_text('{"type": "run"}\n{"type": "step", "step": 1, "loss": "abc"}\n')
    assert _fail(capsys, ["plot", str(tmp_path / "types.jsonl"), "-o", str(tmp_path / "a.png")]) == \
        f"ember plot: error: {tmp_path / 'types.jsonl'}:2: field 'loss' of a 'step' record is 'abc'; expected a number"
    assert "-o x.xyz: unknown image format '.xyz'" in _fail(capsys, ["plot", str(tmp_path / "types.jsonl"), "-o", "x.xyz"])
    assert "no such file" in _fail(capsys, ["plot", str(tmp_path / "none.jsonl")])


# ---- 7 -------------------------------------------------------------------------------------------

def test_version(capsys):
    import importlib.metadata
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"ember {importlib.metadata.version('ember')}"


def test_epoch_line_after_a_mid_epoch_resume_says_what_the_loss_covers(tmp_path, mnist_dir, capsys):
    ck = tmp_path / "c.st"
    trainer_args = _mnist(mnist_dir, "--limit-steps", "6", "--save", str(ck))
    # a checkpoint 4 steps into epoch 1, as Ctrl-C leaves it
    from ember.frontends.training import Trainer, build_model, make_optimizer
    from ember.runtime.data import load_mnist
    x, y = load_mnist(mnist_dir, "train", flat=True)
    t = Trainer(build_model("mlp"), make_optimizer("sgd", 0.05), (x[:640], y[:640]), device="cpu", limit_steps=4,
                config={"model": "mlp", "optimizer": "sgd"})
    t.train_epoch()
    t.epoch, t.step_in_epoch = 0, 4
    t.save(ck)
    assert cli.main(trainer_args + ["--resume", str(ck)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("epoch 1/1"))
    assert "(steps 5-6 of the epoch only, those run since the resume)" in line, line


def test_help_shows_defaults_and_unknown_options_suggest_the_closest(capsys, monkeypatch):
    from ember.frontends.cli import main
    monkeypatch.setenv("COLUMNS", "300")  # one line per option
    with pytest.raises(SystemExit) as e:
        main(["mnist", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "(a resumed run continues the count) (default: 1)" in out  # added where the help was silent
    assert out.count("default 64") == 1 and "(default: 64)" not in out  # not repeated where it spoke
    with pytest.raises(SystemExit) as e:
        main(["mnist", "--lrr", "0.1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ember mnist") and "unrecognized arguments: --lrr 0.1; did you mean --lr?" in err


def test_torchrun_underscore_spellings_are_accepted():
    from ember.frontends.cli import _dashes, build_parser
    parser = build_parser()
    argv = ["launch", "--nproc_per_node=2", "--master_port", "29501", "--", "ember", "mnist", "--batch_size", "8"]
    assert _dashes(parser, argv) == ["launch", "--nproc-per-node=2", "--master-port", "29501", "--", "ember", "mnist",
                                     "--batch_size", "8"]  # the launched command respells its own
    assert _dashes(parser, ["mnist", "--batch_size", "8", "--not_an_option"])[1:] == ["--batch-size", "8",
                                                                                      "--not_an_option"]


def test_bench_models_are_a_list_or_all(capsys):
    from ember.frontends.cli import main
    assert main(["bench", "--model", "cnn,lenett", "--steps", "1"]) == 2
    assert "--model cnn,lenett: expected model names from cnn, mlp, lenet5, resnet8, speednet, airbench, mobilenet, vit, " \
           "vit_sdpa (comma-separated) or all" in capsys.readouterr().err


def test_bench_max_autotune_is_for_cuda(capsys):
    from ember.frontends.cli import main
    assert main(["bench", "--device", "cpu", "--model", "mlp", "--max-autotune", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "--max-autotune: expected --device cuda" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("flag, value, least", [("--steps", "0", 1), ("--warmup", "-1", 0), ("--batch-size", "0", 1),
                                                ("--threads", "0", 1)])
def test_bench_refuses_counts_out_of_range(capsys, flag, value, least):
    """(--steps 0 timed 4 steps, --batch-size 0 ran 64: session 36's probe)"""
    from ember.frontends.cli import main
    assert main(["bench", "--device", "cpu", "--model", "mlp", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"ember bench: error: {flag} {value}: expected an integer >= {least}", err
