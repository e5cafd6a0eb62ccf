"""Checkpoints: a safetensors round trip of model, optimizer state and progress; atomic writes
(a crash at any point of a save leaves the previous checkpoint whole and loadable); clear
errors for files that are not checkpoints; initial weights from .npz and .safetensors."""
from __future__ import annotations

import os

import numpy as np
import pytest

from ember.frontends import compile, nn, optim
from ember.frontends import checkpoint
from ember.frontends.checkpoint import CheckpointError, load_checkpoint, load_weights, save_checkpoint

from models import mlp

RNG = np.random.default_rng(0)
X = RNG.random((8, 784), dtype=np.float32)
Y = RNG.integers(0, 10, 8)


def _trained_step(opt, steps: int = 3, seed: int = 0):
    step = compile(mlp(seed), nn.CrossEntropyLoss(), opt, example_inputs=(X, Y), device="reference")
    for _ in range(steps):
        step(X, Y)
    return step


@pytest.mark.parametrize("opt", [optim.SGD(lr=0.1, momentum=0.9), optim.Adam(lr=1e-3)], ids=["sgd-momentum", "adam"])
def test_round_trip_restores_model_optimizer_and_progress(tmp_path, opt):
    a = _trained_step(opt)
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, a.state_dict(), a.optimizer_state_dict(), epoch=2, step=1875, step_in_epoch=7,
                    config={"model": "mlp", "lr": 0.1})
    ck = load_checkpoint(path)
    assert (ck.epoch, ck.step, ck.step_in_epoch, ck.config) == (2, 1875, 7, {"model": "mlp", "lr": 0.1})
    assert set(ck.model) == set(a.state_dict()) and set(ck.optimizer) == set(a.optimizer_state_dict())
    for k, v in a.state_dict().items():
        assert ck.model[k].dtype == v.dtype and np.array_equal(ck.model[k], v)
    for k, v in a.optimizer_state_dict().items():
        assert ck.optimizer[k].dtype == v.dtype and ck.optimizer[k].shape == v.shape and np.array_equal(ck.optimizer[k], v)

    b = _trained_step(opt, steps=0, seed=1)  # other weights, fresh optimizer state
    b.load_state_dict(ck.model)
    b.load_optimizer_state_dict(ck.optimizer)
    for _ in range(2):  # the restored step continues exactly as the original
        assert a(X, Y) == b(X, Y)
    for k, v in a.state_dict().items():
        assert np.array_equal(v, b.state_dict()[k])


def _save(path, value: float) -> None:
    save_checkpoint(path, {"w": np.full((256, 256), value, np.float32)}, {"w.momentum_buffer": np.zeros(3, np.float32)},
                    epoch=int(value), step=int(value) * 10)


def _assert_old_checkpoint_intact(path, value: float) -> None:
    ck = load_checkpoint(path)
    assert ck.epoch == int(value) and ck.step == int(value) * 10
    assert np.array_equal(ck.model["w"], np.full((256, 256), value, np.float32))
    leftovers = [p.name for p in path.parent.iterdir() if p.name != path.name]
    assert leftovers == [], f"temporary files left behind: {leftovers}"


def test_crash_mid_write_leaves_the_old_checkpoint_whole(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.safetensors"
    _save(path, 1.0)

    def half_then_crash(f, data):  # the disk fills (or the process dies) half way through
        f.write(data[: len(data) // 2])
        f.flush()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "_write", half_then_crash)
    with pytest.raises(OSError, match="No space left"):
        _save(path, 2.0)
    _assert_old_checkpoint_intact(path, 1.0)


def test_interrupt_mid_write_leaves_the_old_checkpoint_whole(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.safetensors"
    _save(path, 1.0)

    def interrupted(f, data):
        f.write(data[:1000])
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "_write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _save(path, 2.0)
    _assert_old_checkpoint_intact(path, 1.0)


def test_failed_rename_leaves_the_old_checkpoint_whole(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.safetensors"
    _save(path, 1.0)
    seen = []

    def failing_replace(src, dst):
        seen.append((os.path.getsize(src), dst))  # the new file was complete when the rename failed
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(checkpoint.os, "replace", failing_replace)
    with pytest.raises(OSError, match="simulated crash"):
        _save(path, 2.0)
    monkeypatch.undo()
    assert seen and seen[0][0] > 256 * 256 * 4
    _assert_old_checkpoint_intact(path, 1.0)
    _save(path, 3.0)  # and the next save goes through
    _assert_old_checkpoint_intact(path, 3.0)


def test_a_torn_file_is_refused_with_a_clear_error(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    _save(path, 1.0)
    torn = tmp_path / "torn.safetensors"
    torn.write_bytes(path.read_bytes()[:5000])  # what a non-atomic writer leaves after a crash
    with pytest.raises(CheckpointError, match=r"torn\.safetensors: not a readable safetensors file"):
        load_checkpoint(torn)
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        load_checkpoint(tmp_path / "nope.safetensors")


def test_plain_safetensors_is_weights_not_a_checkpoint(tmp_path):
    from safetensors.numpy import save_file
    state = {k: v for k, v in mlp(3).state_dict().items()}
    path = tmp_path / "weights.safetensors"
    save_file(state, str(path))
    with pytest.raises(CheckpointError, match="not an ember checkpoint.*--init-weights"):
        load_checkpoint(path)
    got = load_weights(path)
    assert set(got) == set(state) and all(np.array_equal(got[k], state[k]) for k in state)


def test_load_weights_npz_and_checkpoint(tmp_path):
    state = dict(mlp(4).state_dict())
    np.savez(tmp_path / "init.npz", **state)  # what torch_mnist.py --dump-init writes
    got = load_weights(tmp_path / "init.npz")
    assert list(got) == list(state) and all(np.array_equal(got[k], state[k]) for k in state)
    save_checkpoint(tmp_path / "c.safetensors", state, {"step": np.zeros((), np.float32)}, epoch=1, step=5)
    got = load_weights(tmp_path / "c.safetensors")  # a checkpoint's model part
    assert set(got) == set(state)
    model = mlp(9)
    model.load_state_dict(got)
    assert np.array_equal(model.state_dict()["0.weight"], state["0.weight"])
    with pytest.raises(CheckpointError, match=r"unsupported weights file '\.pt'.*\.safetensors or \.npz"):
        load_weights(tmp_path / "model.pt")


def test_world_size_and_global_batch_round_trip_and_a_mid_epoch_resume_maps_the_samples_done(tmp_path):
    from ember.frontends.training import Trainer
    path = tmp_path / "dp.safetensors"
    a = _trained_step(optim.SGD(lr=0.1, momentum=0.9), steps=1)
    # written by 2 ranks x batch 4, stopped 3 steps (24 samples) into its second epoch
    save_checkpoint(path, a.state_dict(), a.optimizer_state_dict(), epoch=1, step=5, step_in_epoch=3,
                    world_size=2, global_batch=8)
    ck = load_checkpoint(path)
    assert (ck.world_size, ck.global_batch) == (2, 8)
    x, y = RNG.random((64, 784), dtype=np.float32), RNG.integers(0, 10, 64)
    t = Trainer(mlp(1), optim.SGD(lr=0.1, momentum=0.9), (x, y), device="reference", batch_size=5)
    t.load(path)
    assert (t.epoch, t.global_step, t.step_in_epoch) == (1, 5, 4)  # 24 samples done: 4 steps of 5, rounded down
    assert "24 samples into epoch 2" in t.resume_note and "global batch of 8 (2 rank(s))" in t.resume_note
    for k, v in ck.model.items():
        assert np.array_equal(t.step.state_dict()[k], v)
    t = Trainer(mlp(1), optim.SGD(lr=0.1, momentum=0.9), (x, y), device="reference", batch_size=8)
    t.load(path)  # the same global batch: the step count stands
    assert t.step_in_epoch == 3 and t.resume_note is None
    save_checkpoint(path, a.state_dict(), a.optimizer_state_dict(), epoch=1, step=5)  # no world recorded: one process
    assert (load_checkpoint(path).world_size, load_checkpoint(path).global_batch) == (1, None)
