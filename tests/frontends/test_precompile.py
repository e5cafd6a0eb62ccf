"""TrainStep.precompile: the last partial batch's step is built before the epoch, and used."""
from __future__ import annotations

import numpy as np
import pytest

from ember.frontends import compile, nn, optim
from models import mlp


def test_precompile_builds_the_partial_batch_step():
    rng = np.random.default_rng(0)
    x, y = rng.random((10, 784), dtype=np.float32), rng.integers(0, 10, 10)
    step = compile(mlp(), nn.CrossEntropyLoss(), optim.SGD(lr=0.05), example_inputs=(x[:8], y[:8]), device="cpu")
    assert len(step._steps) == 1
    step.precompile((2, 784))
    assert len(step._steps) == 2
    step.precompile((2, 784))   # already there: no-op
    assert len(step._steps) == 2
    step(x[:8], y[:8])
    assert np.isfinite(step(x[8:], y[8:]))
    assert len(step._steps) == 2
    with pytest.raises(ValueError):
        step.precompile((2, 785))
