"""The speedrun recipe on the CUDA backend (marked `cuda`: run on a GPU; skipped elsewhere).

- `ember mnist --recipe speedrun --target-acc 0.99` reaches 99% in its epoch and says when;
- a Trainer restarted for a seed on the device runs that seed exactly as a fresh one does
  (weights, optimizer state, random stream and shuffled order reset in device memory), and
  evaluates on the device as on the host (`logit_sums` over CuPy arrays).
"""
from __future__ import annotations

import numpy as np
import pytest

from ember.frontends import cli, nn
from ember.frontends.training import Trainer
from ember.frontends.training.recipes import LRSchedule, build_model, make_optimizer
from ember.runtime.data import load_mnist

from conftest import require_mnist

pytestmark = pytest.mark.cuda

DEVICE = "cuda"  # a dry run of these checks elsewhere: set to "cpu"


def test_the_recipe_reaches_99_percent(capsys):
    data = str(require_mnist())
    assert cli.main(["mnist", "--recipe", "speedrun", "--device", DEVICE, "--data", data, "--no-progress",
                     "--target-acc", "0.99"]) == 0
    out = capsys.readouterr().out
    assert "reached test accuracy 99." in out and "s of training" in out, out


def _trainer(x, y, seed: int) -> Trainer:
    return Trainer(build_model("speednet", seed), make_optimizer("adam", 0.02, betas=(0.7, 0.9)), (x, y),
                   (x[:3000], y[:3000]), device=DEVICE, batch_size=512, shuffle=True, seed=seed,
                   eval_batch_size=1000, limit_steps=12, log_every=1, epochs=1, lr_schedule=LRSchedule("onecycle"),
                   loss_fn=nn.CrossEntropyLoss(label_smoothing=0.1))


def test_restart_on_the_device_is_a_fresh_trainer():
    x, y = load_mnist(require_mnist(), "train")
    fresh = _trainer(x, y, 3)
    fresh.fit(1)
    restarted = _trainer(x, y, 0)
    restarted.fit(1)
    restarted.restart(build_model("speednet", 3).state_dict(), 3)
    restarted.fit(1)
    losses = [[r["loss"] for r in t.records if r["type"] == "step"] for t in (fresh, restarted)]
    assert losses[0] == losses[1] and len(losses[0]) == 12
    # the device evaluation reduced on the GPU is the host evaluation of the same logits
    loss, acc = restarted.evaluate()
    model = restarted.step.model
    model.eval()
    logits = np.concatenate([restarted.step.inference(x[s:s + 1000]) for s in range(0, 3000, 1000)])
    model.train()
    z = logits.astype(np.float64)
    m = z.max(1, keepdims=True)
    want = float((m[:, 0] + np.log(np.exp(z - m).sum(1)) - z[np.arange(3000), y[:3000]]).sum()) / 3000
    assert loss == pytest.approx(want, rel=1e-9) and acc == float((logits.argmax(1) == y[:3000]).mean())
