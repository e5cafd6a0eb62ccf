"""TrainStep.precompile: the last partial batch's step is built before the epoch, and used."""
from __future__ import annotations

import numpy as np
import pytest

from ember.frontends import compile, nn, optim
from ember.ir import ShapeError
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


@pytest.mark.parametrize("enabled", [True, False])
def test_compiling_leaves_the_garbage_collector_as_it_was(enabled, monkeypatch):
    """A compile runs with the cyclic collector paused (a full collection of a process holding
    PyTorch took a third of a new batch size's compile) and restores it, on or off, after."""
    import gc
    import sys
    compile_module = sys.modules["ember.frontends.compile"]  # the package exports the function by that name
    seen = []
    planned = compile_module._Compiled._planned

    def spy(self, *args, **kwargs):
        seen.append(gc.isenabled())
        return planned(self, *args, **kwargs)

    monkeypatch.setattr(compile_module._Compiled, "_planned", spy)
    x, y = np.zeros((4, 784), np.float32), np.zeros(4, np.int64)
    (gc.enable if enabled else gc.disable)()
    try:
        step = compile(mlp(), nn.CrossEntropyLoss(), optim.SGD(lr=0.05), example_inputs=(x, y), device="cpu")
        assert gc.isenabled() == enabled
        step.precompile((3, 784))
        step.inference(x)
        assert gc.isenabled() == enabled
        with pytest.raises(ShapeError):  # a failed compile restores it too
            step.inference(np.zeros((2, 785), np.float32))
        assert gc.isenabled() == enabled
    finally:
        gc.enable()
    assert seen == [False, False, False]
