"""A training step follows the model's mode when it runs, as PyTorch's does: `model.eval()` after
compile() trains with BatchNorm's running statistics and dropout off, `model.train()` after an
eval-mode compile with the batch's statistics (the probe of session 36 found the step frozen in
the mode it was compiled in: BatchNorm's running statistics updated under eval(), and a new batch
size then compiled in the other mode than the first)."""
from __future__ import annotations

import numpy as np
import pytest

from ember.frontends import compile, nn, optim

RNG = np.random.default_rng(0)
X = RNG.standard_normal((4, 2, 7, 7)).astype(np.float32)
Y = np.array([0, 1, 2, 0])


def _model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 5 * 5, 3))


def _bn_state(step) -> tuple[np.ndarray, int]:
    sd = step.state_dict()
    return np.array(sd["1.running_mean"]), int(np.asarray(sd["1.num_batches_tracked"]))


@pytest.mark.parametrize("device", ["reference", "cpu"])
def test_eval_after_compile_trains_with_the_running_statistics(device):
    m = _model()
    step = compile(m, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), (X, Y), device=device)
    step(X, Y)
    mean, tracked = _bn_state(step)
    assert tracked == 1 and np.abs(mean).max() > 0
    m.eval()
    step(X, Y)
    step(X[:3], Y[:3])  # a new batch size in eval mode too
    assert _bn_state(step)[1] == tracked and np.array_equal(_bn_state(step)[0], mean), "eval mode updated BatchNorm"
    m.train()
    step(X[:3], Y[:3])
    assert _bn_state(step)[1] == tracked + 1, "train mode again: the batch's statistics, the counter counts"
    assert "4x2x7x7 (eval mode)" in repr(step) and "3x2x7x7" in repr(step)


def test_the_eval_mode_step_matches_pytorch_from_the_same_weights():
    torch = pytest.importorskip("torch")
    from alignment import sgd_steps_match_torch

    from ember.frontends import from_torch
    torch.manual_seed(0)
    tm = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                             torch.nn.Flatten(), torch.nn.Linear(4 * 5 * 5, 3))
    with torch.no_grad():
        tm[1].running_mean.uniform_(-1, 1)
        tm[1].running_var.uniform_(0.5, 2)
    m = from_torch(tm, example_inputs=(torch.zeros(4, 2, 7, 7),))
    step = compile(m, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), (X, Y), device="cpu")
    m.eval()
    tm.eval()
    sgd_steps_match_torch(step, tm, tm.parameters(), X, Y, lr=0.1)
    assert int(np.asarray(step.state_dict()["1.num_batches_tracked"])) == 0
