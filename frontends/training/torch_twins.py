"""The MNIST recipes written in PyTorch: the twins that `ember bench`, `ember align`, the CUDA
benchmark and the accuracy comparison (`torch_accuracy.py`) run next to ember's models.

Each twin registers its layers in the order of ember's recipe (`recipes.MODELS`), so the state
dict names match and `twin.load_state_dict(ember_model.state_dict())` gives both the same
weights (BatchNorm's running statistics included). PyTorch is imported only when a twin is built.
"""
from __future__ import annotations

from typing import Any

__all__ = ["TWINS", "torch_model", "torch_sgd_step"]

TWINS = ("cnn", "mlp", "lenet5", "resnet8", "speednet")


def _resnet8(tnn: Any, torch: Any) -> Any:
    class BasicBlock(tnn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.conv1 = tnn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = tnn.BatchNorm2d(cout)
            self.relu = tnn.ReLU()
            self.conv2 = tnn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = tnn.BatchNorm2d(cout)
            self.downsample = (tnn.Sequential(tnn.Conv2d(cin, cout, 1, stride, bias=False), tnn.BatchNorm2d(cout))
                               if stride != 1 or cin != cout else None)

        def forward(self, x: Any) -> Any:
            out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
            return self.relu(out + (self.downsample(x) if self.downsample is not None else x))

    class ResNet8(tnn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = tnn.Conv2d(1, 16, 3, 1, 1, bias=False)
            self.bn1 = tnn.BatchNorm2d(16)
            self.relu = tnn.ReLU()
            self.layer1, self.layer2, self.layer3 = BasicBlock(16, 16, 1), BasicBlock(16, 32, 2), BasicBlock(32, 64, 2)
            self.avgpool = tnn.AdaptiveAvgPool2d(1)
            self.fc = tnn.Linear(64, 10)

        def forward(self, x: Any) -> Any:
            x = self.layer3(self.layer2(self.layer1(self.relu(self.bn1(self.conv1(x))))))
            return self.fc(torch.flatten(self.avgpool(x), 1))

    return ResNet8()


def _speednet(tnn: Any, torch: Any) -> Any:
    class SpeedNet(tnn.Module):
        """recipes.SpeedNet without its random translation, which the step applies to the batch
        (tools/torch_speedrun.py); the state dict is the same (the translation has none)."""

        def __init__(self) -> None:
            super().__init__()
            self.conv1 = tnn.Conv2d(1, 24, 5)
            self.bn1 = tnn.BatchNorm2d(24)
            self.conv2 = tnn.Conv2d(24, 32, 3)
            self.bn2 = tnn.BatchNorm2d(32)
            self.pool = tnn.MaxPool2d(2)
            self.relu = tnn.ReLU()
            self.fc1 = tnn.Linear(32 * 5 * 5, 256)
            self.fc2 = tnn.Linear(256, 10)

        def forward(self, x: Any) -> Any:
            x = self.relu(self.bn1(self.pool(self.conv1(x))))
            x = self.relu(self.bn2(self.pool(self.conv2(x))))
            return self.fc2(self.relu(self.fc1(torch.flatten(x, 1))))

    return SpeedNet()


def torch_model(name: str) -> Any:
    """A fresh PyTorch twin of recipe `name` (PyTorch's own initialisation; load ember's weights)."""
    import torch
    import torch.nn as tnn
    if name == "cnn":
        return tnn.Sequential(tnn.Conv2d(1, 16, 3), tnn.ReLU(), tnn.Conv2d(16, 32, 3), tnn.ReLU(), tnn.Flatten(),
                              tnn.Linear(32 * 24 * 24, 10))
    if name == "mlp":
        return tnn.Sequential(tnn.Linear(784, 30), tnn.Sigmoid(), tnn.Linear(30, 10))
    if name == "lenet5":
        return tnn.Sequential(tnn.Conv2d(1, 6, 5, padding=2), tnn.ReLU(), tnn.MaxPool2d(2), tnn.Conv2d(6, 16, 5),
                              tnn.ReLU(), tnn.MaxPool2d(2), tnn.Flatten(), tnn.Linear(16 * 5 * 5, 120), tnn.ReLU(),
                              tnn.Linear(120, 84), tnn.ReLU(), tnn.Linear(84, 10))
    if name == "resnet8":
        return _resnet8(tnn, torch)
    if name == "speednet":
        return _speednet(tnn, torch)
    raise ValueError(f"no PyTorch twin for model {name!r}; expected one of {', '.join(TWINS)}")


def torch_sgd_step(model: Any, weights: Any, x: Any, y: Any, dtype: Any, lr: float) -> tuple[float, dict[str, Any]]:
    """Loads `weights` (name -> array) into the PyTorch `model` as `dtype`, takes one plain SGD step
    of cross-entropy on (x, y): (the loss, the new weights in float64). What the per-step
    comparisons of ember with PyTorch float32 and float64 run (tests/alignment.py,
    tools/zoo_alignment.py)."""
    import numpy as np
    import torch
    model.to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(np.asarray(weights[name])).to(dtype))
    model.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x).to(dtype)), torch.from_numpy(y))
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return loss.item(), {k: p.detach().double().numpy().copy() for k, p in model.named_parameters()}
