"""The model zoo: small MNIST models written in PyTorch and imported with `from_torch`, as a user
would bring their own, so that `ember bench --zoo` (and `--model NAME` in `ember bench` and
`ember kernels`) measures ember on models it was not tuned for.

Every entry is a PyTorch module for 28x28 single-channel inputs and 10 classes, built by a
function of a width factor (1.0: the model as described; tests use small widths), plus the batch
size it is benchmarked at. The recipes' twins (cnn, mlp, lenet5, resnet8, speednet: `torch_twins`) are
entries too, so the zoo is the whole set. PyTorch is imported only when a model is built;
without it, building one raises a one-line error.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .torch_twins import TWINS
from .torch_twins import torch_model as _twin

__all__ = ["ZooModel", "ZOO", "torch_zoo_model", "ember_zoo_model", "zoo_model", "require_torch"]


@dataclass(frozen=True)
class ZooModel:
    name: str
    #: (torch, torch.nn, width factor) -> a fresh torch module (PyTorch's own initialisation)
    build: Callable[[Any, Any, float], Any]
    description: str
    batch_size: int = 64
    #: whether the model reads flat 784-pixel rows instead of (1, 28, 28) images
    flat: bool = False

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (784,) if self.flat else (1, 28, 28)


def require_torch() -> Any:
    """The torch module, or a one-line error saying how to get it."""
    try:
        import torch
    except ImportError:
        raise ModuleNotFoundError("the model zoo is defined in PyTorch, which is not installed: "
                                  "pip install 'ember[torch]'") from None
    return torch


def _scaled(width: float, channels: int) -> int:
    return max(1, int(round(channels * width)))


def _twin_entry(name: str) -> Callable[[Any, Any, float], Any]:
    def build(torch: Any, tnn: Any, width: float) -> Any:
        if width != 1.0:
            raise ValueError(f"zoo model {name!r} has one width (the recipe's); got width={width}")
        return _twin(name)
    return build


def _airbench(torch: Any, tnn: Any, width: float) -> Any:
    """airbench-style: no biases; blocks of (3x3 conv, BatchNorm, GELU) x2 then 2x2 max pooling,
    widths 64/256/256; global max pooling and a linear head (28 -> 14 -> 7 -> 3 -> 1)."""
    widths = [_scaled(width, w) for w in (64, 256, 256)]

    def conv_bn(cin: int, cout: int) -> list[Any]:
        return [tnn.Conv2d(cin, cout, 3, padding=1, bias=False), tnn.BatchNorm2d(cout), tnn.GELU()]

    layers: list[Any] = []
    cin = 1
    for w in widths:
        layers += conv_bn(cin, w) + conv_bn(w, w) + [tnn.MaxPool2d(2)]
        cin = w
    layers += [tnn.MaxPool2d(3), tnn.Flatten(), tnn.Linear(cin, 10, bias=False)]
    return tnn.Sequential(*layers)


def _mobilenet(torch: Any, tnn: Any, width: float) -> Any:
    """MobileNet-style: a 3x3 stem, then depthwise-separable blocks (3x3 depthwise conv with
    groups=C, BatchNorm, ReLU6, 1x1 pointwise conv, BatchNorm, ReLU6), two of them with stride 2;
    global average pooling and a linear head."""
    c = [_scaled(width, w) for w in (32, 64, 128, 128, 256)]
    strides = (1, 2, 1, 2)

    class DepthwiseSeparable(tnn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.depthwise = tnn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False)
            self.bn1 = tnn.BatchNorm2d(cin)
            self.pointwise = tnn.Conv2d(cin, cout, 1, bias=False)
            self.bn2 = tnn.BatchNorm2d(cout)
            self.act = tnn.ReLU6()

        def forward(self, x: Any) -> Any:
            return self.act(self.bn2(self.pointwise(self.act(self.bn1(self.depthwise(x))))))

    class MobileNet(tnn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = tnn.Sequential(tnn.Conv2d(1, c[0], 3, 1, 1, bias=False), tnn.BatchNorm2d(c[0]), tnn.ReLU6())
            self.blocks = tnn.Sequential(*[DepthwiseSeparable(c[i], c[i + 1], s) for i, s in enumerate(strides)])
            self.pool = tnn.AdaptiveAvgPool2d((1, 1))
            self.fc = tnn.Linear(c[-1], 10)

        def forward(self, x: Any) -> Any:
            return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))

    return MobileNet()


def _vit(sdpa: bool) -> Callable[[Any, Any, float], Any]:
    """A small vision transformer: 7x7 patches embedded by a strided convolution (16 tokens),
    learned position embeddings, pre-norm blocks (LayerNorm, multi-head self-attention, LayerNorm,
    a GELU MLP, residual adds), a final LayerNorm, mean pooling over the tokens and a linear head.
    Attention is written out (reshape, permute, matmul, softmax) or, with `sdpa`, is
    F.scaled_dot_product_attention."""
    def build(torch: Any, tnn: Any, width: float) -> Any:
        import torch.nn.functional as TF
        heads = 4
        dim = heads * _scaled(width, 16)
        depth, patch, tokens = 2, 7, 16

        class Attention(tnn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.q, self.k, self.v = tnn.Linear(dim, dim), tnn.Linear(dim, dim), tnn.Linear(dim, dim)
                self.proj = tnn.Linear(dim, dim)

            def split(self, t: Any) -> Any:  # (B, T, D) -> (B, heads, T, D / heads)
                b, n, _ = t.shape
                return t.reshape(b, n, heads, dim // heads).permute(0, 2, 1, 3)

            def forward(self, x: Any) -> Any:
                b, n, _ = x.shape
                q, k, v = self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x))
                if sdpa:
                    o = TF.scaled_dot_product_attention(q, k, v)
                else:
                    att = (q @ k.transpose(-2, -1)) * (dim // heads) ** -0.5
                    o = att.softmax(dim=-1) @ v
                return self.proj(o.transpose(1, 2).reshape(b, n, dim))

        class Block(tnn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.norm1, self.attn = tnn.LayerNorm(dim), Attention()
                self.norm2 = tnn.LayerNorm(dim)
                self.mlp = tnn.Sequential(tnn.Linear(dim, 2 * dim), tnn.GELU(), tnn.Linear(2 * dim, dim))

            def forward(self, x: Any) -> Any:
                x = x + self.attn(self.norm1(x))
                return x + self.mlp(self.norm2(x))

        class ViT(tnn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.patch = tnn.Conv2d(1, dim, patch, stride=patch)
                self.pos = tnn.Parameter(0.02 * torch.randn(1, tokens, dim))
                self.blocks = tnn.Sequential(*[Block() for _ in range(depth)])
                self.norm = tnn.LayerNorm(dim)
                self.head = tnn.Linear(dim, 10)

            def forward(self, x: Any) -> Any:
                x = self.patch(x).flatten(2).transpose(1, 2) + self.pos
                x = self.norm(self.blocks(x))
                return self.head(x.mean(dim=1))

        return ViT()
    return build


ZOO: dict[str, ZooModel] = {m.name: m for m in (
    ZooModel("cnn", _twin_entry("cnn"), "the MNIST CNN (two 3x3 convolutions, ReLU, linear)"),
    ZooModel("mlp", _twin_entry("mlp"), "the MNIST MLP (784-30-10, sigmoid)", flat=True),
    ZooModel("lenet5", _twin_entry("lenet5"), "LeNet-5 with ReLU and max pooling"),
    ZooModel("resnet8", _twin_entry("resnet8"), "ResNet-8 (BatchNorm, residual blocks, stride 2)"),
    ZooModel("speednet", _twin_entry("speednet"), "the speedrun recipe's: conv-pool-BatchNorm-ReLU x2, two linear "
             "layers (its random translation is the training step's, not the model's)"),
    ZooModel("airbench", _airbench, "airbench-style: bias-free conv-BatchNorm-GELU blocks, max pooling"),
    ZooModel("mobilenet", _mobilenet, "MobileNet-style: depthwise-separable blocks, ReLU6"),
    ZooModel("vit", _vit(False), "a small vision transformer, attention as reshape/permute/matmul/softmax"),
    ZooModel("vit_sdpa", _vit(True), "the small vision transformer with F.scaled_dot_product_attention"),
)}
assert set(TWINS) <= set(ZOO)


def _entry(name: str) -> ZooModel:
    if name not in ZOO:
        raise ValueError(f"unknown zoo model {name!r}; expected one of {', '.join(ZOO)}")
    return ZOO[name]


def torch_zoo_model(name: str, width: float = 1.0, seed: int | None = None) -> Any:
    """A fresh PyTorch module of zoo model `name` (PyTorch's initialisation; after
    `torch.manual_seed(seed)` when a seed is given)."""
    entry = _entry(name)
    torch = require_torch()
    if seed is not None:
        torch.manual_seed(seed)
    return entry.build(torch, torch.nn, width)


def ember_zoo_model(name: str, width: float = 1.0, seed: int | None = None, torch_module: Any = None) -> Any:
    """Zoo model `name` imported into ember with `from_torch` (from `torch_module` when given,
    else from a fresh one): the same parameters, under PyTorch's names."""
    import numpy as np

    from ember.frontends import from_torch
    entry = _entry(name)
    tm = torch_module if torch_module is not None else torch_zoo_model(name, width, seed)
    example = np.zeros((2, *entry.input_shape), np.float32)
    return from_torch(tm, example)


def zoo_model(name: str, seed: int = 0) -> Any:
    """The ember model of zoo model `name` with PyTorch's initialisation for `seed`, as the
    commands build it: a recipe's own ember model where it has one (cnn, mlp, lenet5, resnet8, speednet:
    the twin's layers and names, no PyTorch needed; speednet's random translation off, as its
    twin has none), else the PyTorch definition imported."""
    from .recipes import MODELS, build_model
    if name in MODELS:
        model = build_model(name, seed, init="torch")
        augment = getattr(model, "augment", None)
        if augment is not None:  # the twin leaves augmentation to its training step: the same work
            augment.max_shift = 0
        return model
    return ember_zoo_model(name, seed=seed)
