"""The trainer's evaluation and time to accuracy, on a small synthetic task (device cpu):

- `logit_sums` is the float64 cross-entropy sum and the correct count of the logits;
- test-time augmentation averages the logits of the images and their moved copies;
- `fit(target_acc=...)` stops at the first evaluation (every `eval_every` steps, and after each
  epoch) that reaches the target, with its "eval" and "target" records and the time split into
  training and evaluation seconds; a target never reached runs every epoch;
- `restart` runs another seed on the same compiled step exactly as a fresh trainer of that seed,
  and the trainer's seed picks the random stream of the step (`seed_random`);
- a loader over device arrays shuffles once an epoch into the same batches as on the host.
"""
from __future__ import annotations

import numpy as np
import pytest

from ember.frontends import nn, optim
from ember.frontends.training import Trainer
from ember.frontends.training.metrics import logit_sums
from ember.frontends.training.trainer import moved
from ember.runtime.data import DataLoader

from models import FAKE_DEVICE, device_fixture


def _task(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """8x8 images whose class is the brighter half (top or bottom), with noise."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    x = rng.random((n, 1, 8, 8)).astype(np.float32) * 0.5
    x[y == 0, :, :4] += 0.5
    x[y == 1, :, 4:] += 0.5
    return x, y.astype(np.int64)


def _model(seed: int = 0) -> nn.Module:
    nn.manual_seed(seed)
    return nn.Sequential(nn.RandomTranslate(1), nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 8 * 8, 2))


def _trainer(seed: int = 0, device: str = "cpu", **kwargs) -> Trainer:
    return Trainer(_model(seed), optim.SGD(lr=0.05, momentum=0.9), _task(256, 0), _task(200, 1), device=device,
                   batch_size=32, shuffle=True, seed=seed, eval_batch_size=64, **kwargs)


def test_logit_sums_are_the_cross_entropy_sum_and_correct_count():
    rng = np.random.default_rng(0)
    z = rng.standard_normal((7, 5)).astype(np.float32) * 4
    y = rng.integers(0, 5, 7)
    loss, correct = logit_sums(z, y)
    z64 = z.astype(np.float64)
    want = sum(np.log(np.exp(z64[i]).sum()) - z64[i, y[i]] for i in range(7))
    assert float(loss) == pytest.approx(want, rel=1e-12) and int(correct) == int((z.argmax(1) == y).sum())


def test_tta_averages_the_logits_of_the_moved_copies():
    shifts = ((0, 1), (-1, 0))
    trainer = _trainer(tta=shifts)
    trainer.fit(1)
    x, y = _task(200, 1)
    trainer.step.model.eval()
    # in the evaluation's batches of 64: a kernel's summation order may depend on the batch
    logits = np.concatenate([sum(trainer.step.inference(v[s:s + 64]) for v in [x] + [moved(x, dy, dx)
                                                                                    for dy, dx in shifts]) / 3
                             for s in range(0, 200, 64)])
    trainer.step.model.train()
    loss, correct = logit_sums(logits, y)
    assert trainer.evaluate() == pytest.approx((float(loss) / 200, int(correct) / 200), rel=1e-12)
    assert trainer.records[-1]["test_acc"] == int(correct) / 200
    plain = _trainer()
    plain.fit(1)
    assert plain.evaluate()[0] != trainer.evaluate()[0]  # the same run, another evaluation


def test_moved_shifts_with_zero_fill():
    x = np.arange(9, dtype=np.float32).reshape(1, 1, 3, 3)
    np.testing.assert_array_equal(moved(x, 1, -1)[0, 0], [[0, 0, 0], [1, 2, 0], [4, 5, 0]])


def test_target_stops_at_the_first_evaluation_that_reaches_it():
    trainer = _trainer()
    trainer.fit(5, target_acc=0.9, eval_every=4)
    reached = trainer.reached
    assert reached is not None and reached["test_acc"] >= 0.9
    evals = [r for r in trainer.records if r["type"] in ("eval", "epoch")]
    assert evals[-1]["step"] == reached["step"] and all(r["test_acc"] < 0.9 for r in evals[:-1])
    assert trainer.global_step == reached["step"] < 5 * 8  # stopped early
    assert [r["step"] for r in trainer.records if r["type"] == "eval"] == \
        [s for s in range(4, reached["step"] + 1, 4) if s % 8]  # epoch ends evaluate anyway
    assert 0 < reached["train_seconds"] == trainer.records[-2]["train_seconds"]
    assert reached["eval_seconds"] > 0 and reached["time"] > reached["train_seconds"]


def test_a_target_not_reached_trains_every_epoch():
    trainer = _trainer()
    trainer.fit(2, target_acc=1.0 + 1e-9, eval_every=3)
    assert trainer.reached is None and trainer.epoch == 2
    epochs = [r for r in trainer.records if r["type"] == "epoch"]
    assert epochs[-1]["train_seconds"] == pytest.approx(trainer.train_seconds)
    assert trainer.eval_seconds >= sum(r["eval_seconds"] for r in trainer.records if r["type"] in ("eval", "epoch"))


def _losses(trainer: Trainer) -> list[float]:
    trainer.fit(1)
    return [r["loss"] for r in trainer.records if r["type"] == "step"]


@pytest.fixture(params=["cpu", FAKE_DEVICE])
def device(request):
    yield from device_fixture(request)


def test_restart_is_a_fresh_trainer_of_that_seed(device):
    """Also where parameters and state live in device memory (FAKE_DEVICE), which restart
    rewrites through the model and the step's storage."""
    fresh = {seed: _losses(_trainer(seed, log_every=1, device=device)) for seed in (0, 3)}
    trainer = _trainer(0, log_every=1, device=device)
    first = _losses(trainer)
    trainer.restart(_model(3).state_dict(), 3)
    assert int(trainer.step.optimizer_state_dict()["rng_step"]) == 3 << 32  # seed 3's random stream
    again = _losses(trainer)
    assert first == fresh[0] and again == fresh[3] and fresh[0] != fresh[3]
    trainer.restart(_model(0).state_dict(), 0)
    assert _losses(trainer) == fresh[0]


class _OnDevice(np.ndarray):
    """A host array that says it lives on a device (the loader then takes the device path)."""

    @property
    def __cuda_array_interface__(self):
        return {}

    def get(self):
        return np.asarray(self)


def test_losses_on_a_device_are_read_back_stacked_in_order():
    from ember.frontends.training.trainer import _read_back
    losses = [np.asarray(v, np.float32).view(_OnDevice) for v in (0.5, 2.0, float("nan"))]
    got = _read_back(losses)
    assert got[:2] == [0.5, 2.0] and np.isnan(got[2]) and _read_back(losses[:1]) == [0.5]


def test_loader_on_a_device_shuffles_once_an_epoch_into_the_host_batches():
    x, y = np.arange(50, dtype=np.float32).reshape(25, 2), np.arange(25)
    host = DataLoader(x, y, 4, shuffle=True, seed=7)
    uploads = []

    def to_device(a):
        uploads.append(a.shape)
        return np.asarray(a).view(_OnDevice)

    dev = DataLoader(to_device(x), to_device(y), 4, shuffle=True, seed=7, to_device=to_device)
    for epoch in (0, 1):
        host.set_epoch(epoch)
        dev.set_epoch(epoch)
        uploads.clear()
        batches = list(dev)
        assert uploads == [(25,)]  # the order, once
        for (hx, hy), (dx, dy) in zip(host, batches):
            np.testing.assert_array_equal(hx, np.asarray(dx))
            np.testing.assert_array_equal(hy, np.asarray(dy))
