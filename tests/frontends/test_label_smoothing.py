"""Label smoothing in `F.cross_entropy` / `nn.CrossEntropyLoss` against PyTorch's: the loss in
float64 on the interpreter, and one training step (loss and updated weights, so the gradient too)
through compile() on every target."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from models import compiled_targets

from ember.frontends import compile, nn, optim, trace
from ember.frontends import functional as F
from ember.ir import TensorType, run


@pytest.mark.parametrize("smoothing,reduction", [(0.1, "mean"), (0.35, "sum"), (1.0, "mean"), (0.0, "none")])
def test_loss_and_gradient_match_torch(smoothing, reduction) -> None:
    rng = np.random.default_rng(0)
    z = rng.normal(size=(7, 5)).astype(np.float64)
    y = rng.integers(0, 5, size=7)
    g = trace(lambda a, b: F.cross_entropy(a, b, reduction, label_smoothing=smoothing),
              TensorType(z.shape, "float64"), y)
    zname, yname = list(g.inputs)
    got = run(g, {zname: z, yname: y}).outputs["out"]
    tz = torch.tensor(z)
    want = torch.nn.functional.cross_entropy(tz, torch.tensor(y), reduction=reduction, label_smoothing=smoothing)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("device", ["reference"] + compiled_targets())
def test_training_step_with_smoothing_matches_torch(device) -> None:
    nn.manual_seed(0)
    model = nn.Linear(6, 4)
    tmodel = torch.nn.Linear(6, 4)
    tmodel.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in model.state_dict().items()})
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 6)).astype(np.float32)
    y = rng.integers(0, 4, size=16)
    step = compile(model, nn.CrossEntropyLoss(label_smoothing=0.2), optim.SGD(lr=0.5), example_inputs=(x, y),
                   device=device)
    loss = step(x, y)
    tloss = torch.nn.CrossEntropyLoss(label_smoothing=0.2)(tmodel(torch.from_numpy(x)), torch.from_numpy(y))
    tloss.backward()
    with torch.no_grad():
        for p in tmodel.parameters():
            p -= 0.5 * p.grad
    assert loss == pytest.approx(tloss.item(), rel=1e-6)
    for k, v in step.state_dict().items():
        np.testing.assert_allclose(v, tmodel.state_dict()[k].numpy(), rtol=1e-5, atol=1e-6, err_msg=k)


def test_smoothing_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="label_smoothing must be between 0.0 and 1.0"):
        trace(lambda a, b: F.cross_entropy(a, b, label_smoothing=1.5), np.zeros((2, 3), np.float32), np.zeros(2, np.int64))
