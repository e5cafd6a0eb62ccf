"""200 SGD steps of the MNIST CNN on device="reference" against PyTorch from the same weights.

Batch 64, lr 0.05, the training set in file order, PyTorch's seeded initialisation. What is
asserted holds on any CPU (see tests/alignment.py for why a free-running "closer to float64
than PyTorch float32" comparison does not: which of two chaotic float32 runs lands nearer the
float64 run depends on the machine's BLAS/oneDNN):

* Per step, from the same weights (PyTorch float32 and float64 reloaded with ember's weights
  before every step): the loss agrees with PyTorch float32 within 1e-5 (float32 losses of a
  64-sample mean, measured ~3e-7), and the MEDIAN over steps of (ember's update error against
  the float64 update) / (PyTorch float32's) is at most MEDIAN_RATIO. The median, because at a
  few steps a pre-activation within float32 rounding of zero falls on the other side of a ReLU
  in one implementation, which moves that single step's update by ~1e-4 either way (ratios of
  0.01 or 200 at isolated steps, for ember or for PyTorch); such flips cannot shift a median.
* Free running (each trains alone): ember float32 stays within 1e-3 of PyTorch float32 over
  the 200 steps, the bound the upstream project's own alignment uses; chaos amplifies rounding
  to ~2e-4 here, so 1e-3 is a real check (a wrong gradient drifts by 1e-2 within tens of steps).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ember.frontends import compile, nn, optim
from ember.frontends.training import build_model
from ember.runtime.data import load_mnist

from conftest import torch_threads
from alignment import free_run_torch, initial_weights, per_step
from models import MNIST_DIR

STEPS, BATCH, LR = 200, 64, 0.05
# Both update errors include rounding the updated weights to float32, the same for both
# implementations; where it dominates (the MLP) the ratio is 1.000-1.001, on the CNN's median
# step 0.8-0.85 measured. 1.05 leaves room for summation order only: an ember gradient off by
# just PyTorch's own float32 update error would put the median at ~1.4.
MEDIAN_RATIO = 1.05


@pytest.mark.slow
def test_mnist_cnn_200_sgd_steps_match_pytorch(mnist_dir) -> None:
    x, y = load_mnist(mnist_dir, "train")
    batches = [(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]) for i in range(STEPS)]
    init = initial_weights("cnn")

    def ember_step():
        model = build_model("cnn")
        model.load_state_dict(init)
        return compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=LR), example_inputs=batches[0], device="reference")

    step = ember_step()
    with torch_threads(2):
        r = per_step(step, step.state_dict, "cnn", batches, LR)
    free = ember_step()
    ember = np.array([free(xb, yb) for xb, yb in batches])
    with torch_threads(2):
        torch32 = free_run_torch("cnn", init, batches, torch.float32, LR)
    drift = np.abs(ember - torch32)
    print(f"\nMNIST CNN, {STEPS} SGD steps, reference device vs PyTorch {torch.__version__}:\n  per step: {r.describe()}"
          f"\n  free running: largest |ember f32 - torch f32| {drift.max():.3e} (step {drift.argmax()})")
    assert r.loss_diff.max() <= 1e-5, r.describe()
    assert np.median(r.ratio) <= MEDIAN_RATIO, r.describe()
    assert drift.max() <= 1e-3
    assert ember[-20:].mean() < 0.6 * ember[:20].mean()  # and it does learn
