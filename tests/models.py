"""The MNIST models and data location shared by the tests."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ember import ir
from ember.frontends import functional as F
from ember.frontends import nn, spec, trace

REPO = Path(__file__).resolve().parents[1]
MNIST_DIR = REPO.parent / "shared" / "data" / "mnist"


def cnn(seed: int = 0) -> nn.Module:
    nn.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 16, 3), nn.ReLU(), nn.Conv2d(16, 32, 3), nn.ReLU(), nn.Flatten(), nn.Linear(18432, 10))


def mlp(seed: int = 0) -> nn.Module:
    nn.manual_seed(seed)
    return nn.Sequential(nn.Linear(784, 30), nn.Sigmoid(), nn.Linear(30, 10))


def train_graph(model: nn.Module, x_shape: tuple[int, ...], lr: float = 0.05) -> ir.Graph:
    """The simplified SGD training graph of `model` under cross-entropy."""
    from ember.passes.optimizer import SGD
    from ember.passes.pipeline import build_train_graph
    from ember.passes.simplify import simplify
    fwd = trace(lambda x, y: F.cross_entropy(model(x), y), spec(x_shape), spec((x_shape[0],), "int64"), modules={"": model})
    return simplify(build_train_graph(fwd, SGD(lr=lr)))


def params_of(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: p.data for k, p in model.named_parameters()}
