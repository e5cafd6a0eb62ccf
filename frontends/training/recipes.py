"""The MNIST recipes: the models (`MODELS`, `build_model`), PyTorch's default initialisation
reproduced bit for bit (`pytorch_init`) and the optimizer factory (`make_optimizer`).

The models are the ones of the reference recipe (`../shared/reference/torch_mnist.py`).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ember.frontends import functional as F
from ember.frontends import nn, optim

__all__ = ["ResNet8", "BasicBlock", "MODELS", "INITS", "build_model", "pytorch_init", "make_optimizer"]


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 16, 3), nn.ReLU(), nn.Conv2d(16, 32, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(32 * 24 * 24, 10))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 30), nn.Sigmoid(), nn.Linear(30, 10))


def _lenet5() -> nn.Module:
    """LeNet-5 with ReLU and max pooling (28x28 input padded to LeNet's 32x32 by the first conv)."""
    return nn.Sequential(nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10))


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 conv + BatchNorm, plus the input (through a 1x1 conv + BN
    where the shape changes); layers registered in torchvision's order (pytorch_init draws in it)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x: Any) -> Any:
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        return self.relu(out + (self.downsample(x) if self.downsample is not None else x))


class ResNet8(nn.Module):
    """ResNet-8 for 28x28 MNIST: a 3x3 stem, three one-block stages (16, 32, 64 channels; the
    last two halve the resolution), global average pooling and a linear head: 8 weighted layers."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU()
        self.layer1 = BasicBlock(16, 16, 1)
        self.layer2 = BasicBlock(16, 32, 2)
        self.layer3 = BasicBlock(32, 64, 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, classes)

    def forward(self, x: Any) -> Any:
        x = self.layer3(self.layer2(self.layer1(self.relu(self.bn1(self.conv1(x))))))
        return self.fc(F.flatten(self.avgpool(x), 1))


# name -> (builder, whether it takes flat 784-pixel rows). cnn and mlp are torch_mnist.py's models.
MODELS: dict[str, tuple[Callable[[], nn.Module], bool]] = {"cnn": (_cnn, False), "mlp": (_mlp, True),
                                                           "lenet5": (_lenet5, False), "resnet8": (ResNet8, False)}

def pytorch_init(model: nn.Module, seed: int = 0) -> nn.Module:
    """Sets `model`'s Linear and Conv2d parameters, in place, to exactly the values PyTorch's
    default initialisation gives on the CPU after `torch.manual_seed(seed)` when the same layers
    are constructed in the same order (as a Sequential is); PyTorch itself is not needed.

    PyTorch's CPU generator is the standard MT19937 (the one NumPy's legacy RandomState runs),
    and `uniform_(a, b)` turns each 32-bit draw r into a + (r mod 2**24) * 2**-24 * (b - a),
    computed in double from the float32 bounds. Each layer draws its weight (kaiming_uniform
    with a=sqrt(5), bound sqrt(3) * sqrt(1/3) / sqrt(fan_in)) and then its bias (bound
    1 / sqrt(fan_in)). Bit-for-bit equality with torch is tested where PyTorch is installed.
    """
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32) for PyTorch's initialisation, got {seed}")
    rs = np.random.RandomState(seed)

    def uniform(p: Any, bound: float) -> None:
        raw = rs.randint(0, 2**32, size=p.data.size, dtype=np.uint32)  # full range: the raw MT19937 outputs
        x = (raw & np.uint32(0xFFFFFF)).astype(np.float64) * 2.0**-24
        lo, hi = float(np.float32(-bound)), float(np.float32(bound))
        p.data[...] = (x * (hi - lo) + lo).astype(np.float32).reshape(p.data.shape)

    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            fan_in = int(np.prod(m.weight.data.shape[1:]))
            uniform(m.weight, math.sqrt(3.0) * (math.sqrt(2.0 / (1 + 5)) / math.sqrt(fan_in)) if fan_in else 0.0)
            if m.bias is not None:
                uniform(m.bias, 1.0 / math.sqrt(fan_in) if fan_in else 0.0)
        elif isinstance(m, (nn.BatchNorm2d, nn.LayerNorm)):
            pass  # PyTorch initialises these to ones and zeros, drawing nothing from the generator
        elif m._parameters:
            raise NotImplementedError(f"pytorch_init: no PyTorch initialisation rule for {type(m).__name__} ({name!r})")
    return model


INITS = ("torch", "ember")


def build_model(name: str, seed: int = 0, init: str = "torch") -> nn.Module:
    """The named MNIST model. init "torch": PyTorch's default initialisation for `seed`, bit for
    bit (what the reference recipe, torch_mnist.py, starts from); "ember": ember's own
    generator (`nn.manual_seed(seed)`), the same distributions but other values."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(MODELS)}")
    if init not in INITS:
        raise ValueError(f"unknown init {init!r}; expected one of {INITS}")
    nn.manual_seed(seed)
    model = MODELS[name][0]()
    return pytorch_init(model, seed) if init == "torch" else model


def make_optimizer(name: str, lr: float, momentum: float = 0.0) -> optim.Optimizer:
    if name == "sgd":
        return optim.SGD(lr=lr, momentum=momentum)
    if name == "adam":
        if momentum:
            raise ValueError("--momentum applies to SGD; Adam's moment decay is its betas (0.9, 0.999)")
        return optim.Adam(lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; expected 'sgd' or 'adam'")
