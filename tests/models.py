"""The MNIST models and data location shared by the tests."""
from __future__ import annotations

from pathlib import Path

from ember.frontends import nn

REPO = Path(__file__).resolve().parents[1]
MNIST_DIR = REPO.parent / "shared" / "data" / "mnist"


def cnn(seed: int = 0) -> nn.Module:
    nn.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 16, 3), nn.ReLU(), nn.Conv2d(16, 32, 3), nn.ReLU(), nn.Flatten(), nn.Linear(18432, 10))


def mlp(seed: int = 0) -> nn.Module:
    nn.manual_seed(seed)
    return nn.Sequential(nn.Linear(784, 30), nn.Sigmoid(), nn.Linear(30, 10))
