"""`ember mnist --recipe speedrun`, `--target-acc / --eval-every / --tta` on short runs (device
cpu): the recipe's settings as defaults that options given still override, the stop at the
target with its time line and records, the line of a target not reached, and the refusals."""
from __future__ import annotations

import pytest

from ember.frontends import cli
from ember.frontends.training.metrics import read_metrics

from conftest import require_mnist


@pytest.fixture(scope="module")
def mnist_dir():
    return str(require_mnist())


def _run(tmp_path, mnist_dir, *extra: str) -> int:
    return cli.main(["mnist", "--model", "mlp", "--device", "cpu", "--data", mnist_dir, "--limit-steps", "40",
                     "--no-progress", "--eval-batch-size", "5000", "--lr", "0.5",
                     "--metrics-file", str(tmp_path / "m.jsonl"), *extra])


def test_stops_at_the_target_and_says_when(tmp_path, mnist_dir, capsys):
    assert _run(tmp_path, mnist_dir, "--epochs", "3", "--target-acc", "0.5", "--eval-every", "10") == 0
    out = capsys.readouterr().out
    records = read_metrics(tmp_path / "m.jsonl")
    (target,) = [r for r in records if r["type"] == "target"]
    evals = [r for r in records if r["type"] == "eval"]
    assert evals and evals[-1]["step"] == target["step"] < 40 and target["test_acc"] >= 0.5
    assert not [r for r in records if r["type"] == "epoch"]  # reached before the first epoch's end
    assert f"at epoch 1, step {target['step']}: {target['train_seconds']:.3f} s of training" in out
    assert "s since the command started" in out and "evaluation" in out


def test_a_target_not_reached_says_so(tmp_path, mnist_dir, capsys):
    assert _run(tmp_path, mnist_dir, "--epochs", "1", "--target-acc", "1.0") == 0
    out = capsys.readouterr().out
    assert "target test accuracy 100.00% not reached (best " in out and "of 1 evaluations)" in out


def test_tta_on_images_and_refusals(tmp_path, mnist_dir, capsys):
    argv = ["--model", "cnn", "--limit-steps", "3", "--tta=0:1,-1:0"]
    assert _run(tmp_path, mnist_dir, *argv) == 0
    assert "tta" in read_metrics(tmp_path / "m.jsonl")[0]
    capsys.readouterr()
    for flags, msg in ((["--tta=0:1"], "test-time augmentation shifts NCHW images"),
                       (["--tta", "1"], "--tta 1: '1' is not DY:DX"),
                       (["--target-acc", "1.5"], "--target-acc 1.5: expected a test accuracy in (0, 1]"),
                       (["--eval-every", "0"], "--eval-every 0: expected an integer >= 1")):
        assert _run(tmp_path, mnist_dir, *flags) == 2
        assert msg in capsys.readouterr().err


def test_the_recipe_sets_the_defaults_and_options_given_win(tmp_path, mnist_dir, capsys):
    assert cli.main(["mnist", "--recipe", "speedrun", "--data", mnist_dir, "--limit-steps", "2", "--no-progress",
                     "--batch-size", "128", "--metrics-file", str(tmp_path / "m.jsonl")]) == 0
    out = capsys.readouterr().out
    assert ("ember mnist: recipe speedrun: speednet on cpu, Adam(lr=0.02, betas=(0.7, 0.9), eps=1e-08, "
            "weight_decay=0.0), batch 128, shuffled, label smoothing 0.1, random translation up to 1 px") in out
    assert "lr schedule: onecycle up to 0.02" in out
    run = read_metrics(tmp_path / "m.jsonl")[0]
    assert (run["recipe"], run["model"], run["batch_size"], run["shuffle"], run["translate"]) == \
        ("speedrun", "speednet", 128, True, 1)


def test_recipe_options_refused(tmp_path, mnist_dir, capsys):
    for flags, msg in ((["--translate", "1"], "--translate 1: the mlp model has no random translation layer"),
                       (["--betas", "0.9"], "--betas 0.9: expected two decays B1,B2"),
                       (["--optimizer", "adam", "--betas", "0.9,1.5"], "--betas 0.9,1.5: expected decays in [0, 1)"),
                       (["--betas", "0.9,0.99"], "--betas 0.9,0.99: applies to --optimizer adam or adamw")):
        assert _run(tmp_path, mnist_dir, *flags) == 2
        assert msg in capsys.readouterr().err


def test_the_recipe_with_another_model_leaves_out_its_translation(tmp_path, mnist_dir, capsys):
    """The recipe's random translation is speednet's layer: with a model that has none the recipe's
    other settings apply (it refused every other model: session 36's probe); --translate 0 asks
    for no translation, which any model does."""
    assert cli.main(["mnist", "--recipe", "speedrun", "--model", "mlp", "--data", mnist_dir, "--limit-steps", "2",
                     "--no-progress", "--metrics-file", str(tmp_path / "m.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "recipe speedrun: mlp on cpu, Adam(lr=0.02" in out and "random translation" not in out
    run = read_metrics(tmp_path / "m.jsonl")[0]
    assert (run["model"], run["batch_size"], run["translate"]) == ("mlp", 512, None)
    assert _run(tmp_path, mnist_dir, "--translate", "0", "--limit-steps", "2") == 0
