"""The start-of-run checks of a data-parallel world (runtime/consistency.py): every rank compiled
the same step and reads the same data, else the run stops on every rank with one line on rank 0
naming the rank that differs and what differs. In-process on a simulated world of threads (the
verdict and its wording), and end to end through `ember launch` and `ember mnist` over MPI: a rank
with another --lr (another compiled step) and a rank reading a folder with one label changed."""
from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from ember.runtime import consistency as K

BIN = Path(sys.executable).parent


class ThreadWorld:
    """N ranks as threads: all_reduce sums through a shared slot list and two barriers."""

    def __init__(self, size: int) -> None:
        self.size, self.slots, self.bar = size, [None] * size, threading.Barrier(size)

    def rank(self, r: int):
        world = self

        class Comm:
            rank, size = r, world.size

            def all_reduce(self, buffer, op="sum"):
                world.slots[r] = buffer.copy()
                world.bar.wait()
                total = np.sum(world.slots, axis=0)
                world.bar.wait()
                buffer[...] = total / world.size if op == "mean" else total

            def barrier(self):
                world.bar.wait()
        return Comm()


def _run(size, fn):
    world, out = ThreadWorld(size), [None] * size

    def body(r):
        try:
            fn(world.rank(r))
        except Exception as e:  # noqa: BLE001 (collected per rank)
            out[r] = e
    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


@pytest.mark.parametrize("size", [2, 3])  # 2: the smallest world, where a skipped check once went unseen
def test_same_data_passes_and_a_changed_label_names_the_rank_and_the_data(size):
    x = np.random.default_rng(0).random((100, 1, 4, 4), dtype=np.float32)
    y = np.arange(100) % 10
    last = size - 1
    assert _run(size, lambda c: K.agree_on_data(c, "the training data", (x, y))) == [None] * size

    def changed(c):
        yy = y.copy()
        if c.rank == last:
            yy[57] = 3
        K.agree_on_data(c, "the training data", (x, yy))
    errs = _run(size, changed)
    assert all(isinstance(e, K.ConsistencyError) for e in errs)  # every rank stops, none waits
    msg = str(errs[0])
    assert len(msg.splitlines()) == 1 and all(str(e) == msg for e in errs)
    assert msg.startswith(f"rank {last} differs from rank 0 in the training data: 100 samples, sha256 "), msg


@pytest.mark.parametrize("size", [2, 3])
def test_a_rank_that_compiled_another_step_is_named(size):
    class Step:
        def __init__(self, code):
            self.source = type("Source", (), {"code": code})()

    def run(c):
        K.agree_on_step(c, Step("k();\n" if c.rank < size - 1 else "k(); k();\n"))
    msg = str(_run(size, run)[0])
    assert msg.startswith(f"rank {size - 1} differs from rank 0 in the compiled training step"), msg


def test_sizes_are_named_and_several_ranks_listed():
    def sized(c):
        K.agree_on_data(c, "the test data", (np.zeros((10 + (c.rank > 0), 3), np.float32),))
    msg = str(_run(3, sized)[0])
    assert msg.startswith("ranks 1, 2 differ from rank 0 in the test data: 11 samples"), msg
    assert "10 samples, sha256" in msg and "on rank 0" in msg


def test_a_strided_sample_above_the_limit_still_sees_the_sizes_and_sampled_rows():
    a = np.zeros((1000, 8), np.float32)
    d0, full = K.data_digest([a], full_limit=1024)
    assert not full
    b = a.copy()
    b[0, 0] = 1  # row 0 is always sampled
    assert K.data_digest([b], full_limit=1024)[0] != d0
    assert K.data_digest([a[:999]], full_limit=1024)[0] != d0
    assert K.data_digest([a], full_limit=10**9) == (K.data_digest([a.copy()])[0], True)


def test_step_digest_ignores_comment_lines_only():
    base = "// kernel k51 implements /home/a/model.py:12\nvoid f() { x = 0.05f; }\n"
    assert K.source_digest(base) == K.source_digest(base.replace("/home/a", "/srv/b"))
    assert K.source_digest(base) != K.source_digest(base.replace("0.05f", "0.04f"))


def test_labelled_settings_name_the_first_that_differs_and_its_value_per_rank():
    def model(c):
        K.agree_on_fields(c, [("model", "mlp" if c.rank == 1 else "cnn"), ("batch size", 64)])
    errs = _run(2, model)
    assert all(isinstance(e, K.ConsistencyError) for e in errs) and str(errs[0]) == str(errs[1])
    assert str(errs[0]) == ("rank 1 differs from rank 0: model is mlp on rank 1, cnn on rank 0; "
                            "every rank must be started with the same settings"), errs[0]

    def later(c):  # the first differing label is named, values compared whole beyond what is shown
        long = "x" * 100
        K.agree_on_fields(c, [("model", "cnn"), ("lr", 0.05), ("init", long + str(c.rank > 1)),
                              ("batch size", 32 if c.rank else 64)])
    x64 = "x" * K.VALUE_BYTES
    assert str(_run(3, later)[0]) == (f"rank 2 differs from rank 0: init is {x64} on rank 2, {x64} on rank 0 (they "
                                      f"differ past the 64 bytes shown); every rank must be started with the same "
                                      f"settings")
    assert _run(3, lambda c: K.agree_on_fields(c, [("epochs", 2), ("steps per epoch", 10)])) == [None] * 3

    def fields(c):  # ranks passing different fields: named, not a hang in a mismatched all-reduce
        K.agree_on_fields(c, [("epochs", 2)] + ([("limit steps", 10)] if c.rank else []))
    assert str(_run(2, fields)[0]).startswith("rank 1 differs from rank 0 in the settings checked at the start: 2 settings")


def test_trainer_checks_settings_before_data_and_the_step_plan_before_training(monkeypatch):
    """A rank with another model reads other-shaped data (the MLP's are flat): the model must be
    named, not the data; a rank with another epoch count or step limit would leave the others
    waiting in an all-reduce forever: fit() stops every rank before the first step."""
    from types import SimpleNamespace

    from ember.frontends import nn, optim
    from ember.frontends.training import trainer as T

    def fake_compile(model, loss, opt, example_inputs, communicator=None, **kw):
        return SimpleNamespace(comm=communicator, precompile=lambda *a: None, seed_random=lambda seed: None)
    monkeypatch.setattr(T, "ember_compile", fake_compile)
    x, y = np.zeros((64, 4), np.float32), np.zeros(64, np.int64)

    def build(c, **kw):
        flat = c.rank == 0
        data = (x if flat else x.reshape(64, 1, 2, 2), y)
        return T.Trainer(nn.Linear(4, 3), optim.SGD(lr=0.1), data, device="cpu", batch_size=8, communicator=c,
                         config={"model": "mlp" if flat else "cnn"}, **kw)
    msg = str(_run(2, build)[0])
    assert msg == ("rank 1 differs from rank 0: model is cnn on rank 1, mlp on rank 0; "
                   "every rank must be started with the same settings"), msg

    def plan(c, what):
        t = T.Trainer(nn.Linear(4, 3), optim.SGD(lr=0.1), (x, y), device="cpu", batch_size=8, communicator=c,
                      limit_steps=(2 if c.rank else 4) if what == "limit" else None)
        t.fit(2 if c.rank and what == "epochs" else 1)
    assert str(_run(2, lambda c: plan(c, "epochs"))[0]) == (
        "rank 1 differs from rank 0: epochs is 2 on rank 1, 1 on rank 0; every rank must run the same steps")
    assert str(_run(2, lambda c: plan(c, "limit"))[0]) == (
        "rank 1 differs from rank 0: limit steps is 2 on rank 1, 4 on rank 0; every rank must run the same steps")


# ---- end to end over MPI ------------------------------------------------------------------------

def _mpi_env() -> dict:
    if not (shutil.which("mpiexec", path=str(BIN)) or shutil.which("mpiexec")):
        pytest.skip("no mpiexec (pip install 'ember[mpi]')")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PMI_RANK", "PMI_SIZE")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def _launch_mnist(per_rank: str, data: str, *extra: str) -> subprocess.CompletedProcess:
    """`ember launch` of 2 ranks running `ember mnist` (MLP), where `per_rank` is a shell snippet
    setting LR, DATA or MODEL from $RANK."""
    mnist = (f'{per_rank}; exec "{sys.executable}" -m ember.frontends.cli mnist --model "$MODEL" --device cpu '
             f'--epochs 1 --limit-steps 1 --no-progress --eval-batch-size 5000 --lr "$LR" --data "$DATA" '
             + " ".join(extra))
    return subprocess.run([sys.executable, "-m", "ember.frontends.cli", "launch", "--nproc-per-node", "2", "--",
                           "sh", "-c", mnist], env=_mpi_env() | {"DATA": data, "LR": "0.05", "MODEL": "mlp"},
                          capture_output=True, text=True, timeout=240)


def _rank0_error(err: str) -> str:
    lines = [x for x in err.splitlines() if x.startswith("ember mnist: error:")]
    assert len(lines) == 1, err  # rank 0 alone says it, in one line
    return lines[0]


@pytest.mark.slow
def test_a_rank_with_another_lr_stops_the_run_naming_it(mnist_dir):
    r = _launch_mnist('[ "$RANK" = 1 ] && LR=0.04', str(mnist_dir))
    assert r.returncode == 1, r.stderr[-3000:]
    line = _rank0_error(r.stderr)
    assert line == ("ember mnist: error: rank 1 differs from rank 0: lr is 0.04 on rank 1, 0.05 on rank 0; every "
                    "rank must be started with the same settings"), line
    assert "epoch 1/1" not in r.stdout  # stopped before training


@pytest.mark.slow
def test_a_rank_with_another_model_is_named_as_such_not_as_other_data(mnist_dir):
    r = _launch_mnist('[ "$RANK" = 1 ] && MODEL=cnn', str(mnist_dir))
    assert r.returncode == 1, r.stderr[-3000:]
    assert _rank0_error(r.stderr) == ("ember mnist: error: rank 1 differs from rank 0: model is cnn on rank 1, mlp on "
                                      "rank 0; every rank must be started with the same settings")


@pytest.mark.slow
def test_a_rank_with_another_epoch_count_stops_before_training(mnist_dir):
    r = _launch_mnist('[ "$RANK" = 1 ] && EXTRA="--epochs 2"', str(mnist_dir), "$EXTRA")
    assert r.returncode == 1, r.stderr[-3000:]
    assert _rank0_error(r.stderr) == ("ember mnist: error: rank 1 differs from rank 0: epochs is 2 on rank 1, 1 on "
                                      "rank 0; every rank must run the same steps")
    assert "epoch 1/1" not in r.stdout


@pytest.mark.slow
def test_a_rank_reading_other_data_stops_the_run_naming_it(mnist_dir, tmp_path):
    other = tmp_path / "mnist"
    other.mkdir()
    for stem in ("train-images-idx3-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        (other / f"{stem}.gz").symlink_to(Path(mnist_dir) / f"{stem}.gz")
    labels = bytearray(gzip.decompress((Path(mnist_dir) / "train-labels-idx1-ubyte.gz").read_bytes()))
    labels[8 + 12345] = (labels[8 + 12345] + 1) % 10  # one label of 60000
    (other / "train-labels-idx1-ubyte").write_bytes(bytes(labels))
    r = _launch_mnist(f'[ "$RANK" = 1 ] && DATA="{other}"', str(mnist_dir))
    assert r.returncode == 1, r.stderr[-3000:]
    line = _rank0_error(r.stderr)
    assert line.startswith("ember mnist: error: rank 1 differs from rank 0 in the training data: 60000 samples, "
                           "sha256 "), line


# ---- a checkpoint written by 2 ranks resumes on 1 and on 3 ---------------------------------------

@pytest.mark.slow
def test_a_checkpoint_of_two_ranks_resumes_on_one_and_on_three(mnist_dir, tmp_path):
    import json
    from ember.frontends.checkpoint import load_checkpoint
    env = _mpi_env()
    ckpt, metrics = tmp_path / "two.safetensors", tmp_path / "m.jsonl"
    mnist = [sys.executable, "-m", "ember.frontends.cli", "mnist", "--model", "mlp", "--device", "cpu",
             "--momentum", "0.9", "--limit-steps", "3", "--no-progress", "--eval-batch-size", "5000",
             "--data", str(mnist_dir)]
    launch = [sys.executable, "-m", "ember.frontends.cli", "launch", "--nproc-per-node"]
    r = subprocess.run(launch + ["2", "--"] + mnist + ["--epochs", "1", "--save", str(ckpt)], env=env,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    ck = load_checkpoint(ckpt)
    assert (ck.epoch, ck.step, ck.world_size, ck.global_batch) == (1, 3, 2, 128)
    assert any(k.endswith("momentum_buffer") for k in ck.optimizer)

    # through Trainer.load: every rank holds exactly the checkpoint, and 2 more steps over M ranks
    # equal one process stepping the same global batches from it
    script = Path(__file__).with_name("dp_resume_script.py")
    for size in (1, 3):
        out = tmp_path / f"resume{size}.json"
        if size == 1:  # in this process (a world of one): saves a process start
            import importlib.util
            spec = importlib.util.spec_from_file_location("dp_resume_script", script)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            mod.main(str(ckpt), str(out), str(mnist_dir))
        else:
            r = subprocess.run(launch + [str(size), "--", sys.executable, str(script), str(ckpt), str(out),
                                         str(mnist_dir)], env=env, capture_output=True, text=True, timeout=240)
            assert r.returncode == 0, r.stderr[-3000:]
        res = json.loads(out.read_text())
        assert res["size"] == size and res["loaded_equal"] and res["ranks_equal"], res
        assert res["max_rel"] <= 1e-5, res
        assert (res["epoch"], res["step"]) == (2, 5) and res["records"] == ["epoch"], res

    # and through the command: `ember mnist --resume` on 3 ranks continues the count and saves
    again = tmp_path / "three.safetensors"
    r = subprocess.run(launch + ["3", "--"] + mnist + ["--epochs", "2", "--resume", str(ckpt), "--save", str(again),
                                                       "--metrics-file", str(metrics)],
                       env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "global batch 192" in r.stdout and "epoch 2/2" in r.stdout, r.stdout
    ck3 = load_checkpoint(again)
    assert (ck3.epoch, ck3.step, ck3.world_size, ck3.global_batch) == (2, 6, 3, 192)
    run = json.loads(metrics.read_text().splitlines()[0])
    assert run["type"] == "run" and run["world_size"] == 3 and run["start_step"] == 3
