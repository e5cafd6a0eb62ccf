"""The zoo in the commands: `ember bench --zoo` times every zoo model, `--model NAME` takes a zoo
model as it takes a recipe, `ember kernels --model NAME` writes a zoo model's sources, `ember tune`
takes zoo names too, and a zoo model without PyTorch is refused in one line."""
from __future__ import annotations

import json
import re
import sys

import pytest

from ember.frontends import cli
from ember.frontends.cli import bench
from ember.frontends.training.zoo import ZOO


def test_bench_zoo_times_every_zoo_model_at_its_batch_size(monkeypatch, capsys):
    seen = {}

    def fake_run_bench(models, **kwargs):
        seen.update(models=models, **kwargs)
        return {"device": "cpu", "threads": 1, "batch": kwargs["batch"] or "per model", "steps": 1, "models": {}}

    monkeypatch.setattr(bench, "run_bench", fake_run_bench)
    assert cli.main(["bench", "--zoo"]) == 0
    assert seen["models"] == list(ZOO) and seen["batch"] is None
    assert cli.main(["bench", "--model", "mobilenet,resnet8", "--batch-size", "8"]) == 0
    assert seen["models"] == ["mobilenet", "resnet8"] and seen["batch"] == 8


def test_bench_runs_a_zoo_model_against_pytorch(capsys, monkeypatch):
    pytest.importorskip("torch")
    for name in ("OMP_NUM_THREADS", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):  # bench sets them; put them back after
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["bench", "--model", "vit_sdpa", "--steps", "2", "--warmup", "1", "--batch-size", "4",
                     "--threads", "1", "--no-torch-compile"]) == 0
    out = capsys.readouterr().out
    assert "vit_sdpa  ember-cpu" in out and "vit_sdpa  torch-eager" in out


def test_bench_compiles_cold_but_with_the_users_tuning_database(tmp_path, monkeypatch):
    """`ember bench` times a cold compile in an empty cache folder, yet the kernels it picks are
    the ones `ember tune` recorded under the user's cache folder ($EMBER_CACHE_DIR/tuning)."""
    from ember.codegen import compiler, tuning_db

    user = tmp_path / "user-cache"
    monkeypatch.setenv("EMBER_CACHE_DIR", str(user))
    seen = []

    def fake_compile(*args, **kwargs):
        seen.append((compiler.cache_dir(), tuning_db.active().user_dir))
        raise RuntimeError("stop")

    class Model:
        def load_state_dict(self, state):
            pass

    monkeypatch.setattr(bench, "zoo_model", lambda name: Model())
    monkeypatch.setattr(bench, "ember_compile", fake_compile)
    with pytest.raises(RuntimeError, match="stop"):
        bench._ember("cnn", "cpu", {}, None, 0.1)
    (cache, db_dir), = seen
    assert cache != user and db_dir == user / "tuning"
    assert compiler.cache_dir() == user   # the user's cache folder is back afterwards


def test_kernels_writes_a_zoo_models_sources(tmp_path, capsys):
    pytest.importorskip("torch")
    assert cli.main(["kernels", "--model", "mobilenet", "--device", "cpu", "--batch-size", "2",
                     "--out", str(tmp_path)]) == 0
    train = (tmp_path / "mobilenet-train-2x1x28x28.cpp").read_text()
    # the depthwise grad-weight (32 groups of one channel at 28x28), by the phase-plane family (the
    # CPU cost model's for groups > 1), which takes the images and the groups at run time
    assert re.search(r"// conv2d_grad_weight \w+: x \(N,G\*1,28,28\), w \(G\*1,1,3,3\), G groups, .*"
                     r"N and G at run time; mode phase", train)


@pytest.mark.parametrize("argv", [["bench", "--model", "cnn,airbench", "--steps", "1"],
                                  ["kernels", "--model", "airbench", "--out", "OUT"],
                                  ["tune", "--model", "cnn,airbench"]])
def test_zoo_models_without_pytorch_are_refused_in_one_line(argv, monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    assert cli.main([str(tmp_path) if a == "OUT" else a for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "airbench: the model zoo is defined in PyTorch, which is not installed: pip install 'ember[torch]'" in err


def test_tune_takes_zoo_names(capsys):
    assert cli.main(["tune", "--model", "vit,nope"]) == 2
    assert "--model nope: expected names from cnn, mlp, lenet5, resnet8, speednet, airbench, mobilenet, vit, vit_sdpa (or all)" \
        in capsys.readouterr().err


def test_tune_families_narrows_the_run_and_refuses_unknown_names(capsys, tmp_path):
    """`ember tune --families`: only those families' candidates (beside the reference and the
    stamped choice) are measured, and the records say so; an unknown name is one line naming the
    target's families, before any work."""
    assert cli.main(["tune", "--device", "cpu", "--model", "mlp", "--families", "matmul_axpy,nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--families 'matmul_axpy,nope': expected names from matmul_dot, matmul_axpy" in err
    argv = ["tune", "--device", "cpu", "--model", "mlp", "--batch-size", "4", "--families", "matmul_axpy",
            "--db", str(tmp_path), "--quiet", "--budget-s", "300"]
    assert cli.main(argv) == 0
    assert "kernels measured" in capsys.readouterr().out
    (db,) = tmp_path.glob("cpu-*.json")
    records = json.loads(db.read_text())["records"]
    assert records and all(set(r["versions"]) <= {"matmul_axpy", "matmul_dot"} and "matmul_axpy" in r["versions"]
                           for r in records.values())
