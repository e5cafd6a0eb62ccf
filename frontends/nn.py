"""`nn`: modules with PyTorch's names, parameter layouts and default initialisation.

Parameters are created from ember's own seeded generator (`manual_seed`), distributed as
PyTorch's defaults (kaiming_uniform with a=sqrt(5) for weights, U(+-1/sqrt(fan_in)) for biases);
the values differ from PyTorch's for the same seed, so alignment tests load PyTorch's weights
with `load_state_dict`.
"""
from __future__ import annotations

import math
import sys
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from . import functional as F
from .tensor import Buffer, Parameter, Tensor, active, caller_location, in_ember, model_changed, user_location

_rng = np.random.default_rng(0)


def manual_seed(seed: int) -> None:
    """Seeds parameter initialisation (and nothing else)."""
    global _rng
    _rng = np.random.default_rng(seed)


def _uniform(shape: tuple[int, ...], bound: float) -> np.ndarray:
    return _rng.uniform(-bound, bound, size=shape).astype(np.float32)


class Module:
    def __new__(cls, *args: Any, **kwargs: Any) -> "Module":
        # The construction site is recorded here rather than in __init__, so that it is known even
        # for a subclass whose __init__ forgets super().__init__(): it is the source line of the
        # nodes of a built-in layer (see `tensor.user_location`).
        self = super().__new__(cls)
        object.__setattr__(self, "_ember_loc", caller_location())
        return self

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "training", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if "_parameters" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__}.__init__ must call super().__init__() before assigning {name!r}")
        params, modules = self.__dict__["_parameters"], self.__dict__["_modules"]
        buffers = self.__dict__.get("_buffers", {})
        if name in params or name in modules or name in buffers or isinstance(value, (Buffer, Parameter, Module)):
            model_changed()  # a compiled step of this model adopts or refuses it on its next call
        params.pop(name, None)
        modules.pop(name, None)
        buffers.pop(name, None)
        if isinstance(value, Buffer):
            self.__dict__["_buffers"][name] = value
        elif isinstance(value, Parameter):
            params[name] = value
        elif isinstance(value, Module):
            modules[name] = value
        elif value is None and name in ("bias",):
            params[name] = None
        object.__setattr__(self, name, value)

    def forward(self, *args: Any) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not define forward()")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ctx = active()
        if ctx is None:
            if any(isinstance(a, np.ndarray) for a in (*args, *kwargs.values())):
                raise TypeError(f"{type(self).__name__} was called on a NumPy array: an ember model runs compiled. "
                                f"Use step.inference(x) on the step compile() returned, or "
                                f"ember.frontends.compile_inference(model, x)(x) for a model without a loss")
            return self.forward(*args, **kwargs)
        # nodes built by forward get this module's path (and, called from ember, its line)
        ctx.enter_module(self, in_ember(sys._getframe(1).f_code.co_filename))
        try:
            return self.forward(*args, **kwargs)
        finally:
            ctx.exit_module()

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, "Module"]]:
        yield prefix, self
        for name, m in self.__dict__.get("_modules", {}).items():
            yield from m.named_modules(f"{prefix}.{name}" if prefix else name)

    def named_parameters(self, prefix: str = "", remove_duplicate: bool = True) -> Iterator[tuple[str, Parameter]]:
        """(name, parameter) of this module and its children, as PyTorch's: a parameter held
        under two names (tied weights) is listed once, under the first, unless
        `remove_duplicate=False`. (`state_dict()` keeps every name, as PyTorch's does.)"""
        seen: set[int] = set()
        for mod_name, m in self.named_modules(prefix):
            for name, p in m.__dict__.get("_parameters", {}).items():
                if p is None or (remove_duplicate and id(p) in seen):
                    continue
                seen.add(id(p))
                yield (f"{mod_name}.{name}" if mod_name else name), p

    def named_buffers(self, prefix: str = "") -> Iterator[tuple[str, Buffer]]:
        for mod_name, m in self.named_modules(prefix):
            for name, b in m.__dict__.get("_buffers", {}).items():
                yield (f"{mod_name}.{name}" if mod_name else name), b

    def _named_state(self) -> Iterator[tuple[str, Parameter | Buffer]]:
        """Parameters then buffers of each module, module by module: PyTorch's state_dict order."""
        for mod_name, m in self.named_modules():
            for table in ("_parameters", "_buffers"):
                for name, p in m.__dict__.get(table, {}).items():
                    if p is not None:
                        yield (f"{mod_name}.{name}" if mod_name else name), p

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def state_dict(self) -> "OrderedDict[str, np.ndarray]":
        return OrderedDict((k, p._read().copy()) for k, p in self._named_state())

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        own = dict(self._named_state())
        missing = [k for k in own if k not in state]
        unexpected = [k for k in state if k not in own]
        if strict and (missing or unexpected):
            raise KeyError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
        for k, p in own.items():
            if k not in state:
                continue
            v = np.asarray(state[k].detach().cpu().numpy() if hasattr(state[k], "detach") else state[k])
            if v.shape == (1,) and p.shape == ():
                v = v.reshape(())  # checkpoints written before 0-d buffers kept num_batches_tracked 1-d
            if v.shape != p.shape:
                raise ValueError(f"{k}: expected shape {p.shape}, got {v.shape}")
            p._assign(v.astype(p.dtype.numpy))

    def train(self, mode: bool = True) -> "Module":
        for _, m in self.named_modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> "Module":
        return self.train(False)

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        inner = [f"({k}): " + repr(m).replace("\n", "\n  ") for k, m in self._modules.items()]
        if not inner:
            return f"{type(self).__name__}({self.extra_repr()})"
        return f"{type(self).__name__}(\n  " + "\n  ".join(inner) + "\n)"


class Linear(Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        bound = 1.0 / math.sqrt(in_features) if in_features else 0.0
        self.weight = Parameter(_uniform((out_features, in_features), bound))
        self.bias = Parameter(_uniform((out_features,), bound)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _conv_padding(padding: Any, kernel: tuple[int, int], stride: Any) -> Any:
    """PyTorch's padding strings as numbers: 'valid' is none, 'same' (stride 1) keeps the size,
    half the window on each side; an even window would need one more on one side, which ember's
    convolutions (the same padding both sides) do not do."""
    if not isinstance(padding, str):
        return padding
    if padding == "valid":
        return 0
    if padding != "same":
        raise ValueError(f"Conv2d: invalid padding string {padding!r}, should be one of {{'valid', 'same'}}")
    if np.any(np.asarray(stride) != 1):
        raise ValueError(f"Conv2d: padding='same' is not supported for strided convolutions (stride={stride})")
    if any(k % 2 == 0 for k in kernel):
        raise NotImplementedError(f"Conv2d: padding='same' with the even kernel {kernel} pads one side more than the "
                                  f"other, which ember's convolutions do not; use an odd kernel or integer padding")
    return ((kernel[0] - 1) // 2, (kernel[1] - 1) // 2)


class Conv2d(Module):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, int], stride: int | tuple[int, int] = 1,
                 padding: int | tuple[int, int] | str = 0, dilation: int | tuple[int, int] = 1, groups: int = 1,
                 bias: bool = True) -> None:
        super().__init__()
        if np.any(np.asarray(dilation) != 1):
            raise NotImplementedError(f"Conv2d: dilation={dilation} is not supported yet (only dilation=1)")
        if groups < 1 or in_channels % groups or out_channels % groups:
            raise ValueError(f"Conv2d: groups={groups} must divide in_channels={in_channels} and "
                             f"out_channels={out_channels}")
        kh, kw = (kernel_size, kernel_size) if isinstance(kernel_size, int) else tuple(kernel_size)
        self.in_channels, self.out_channels, self.kernel_size = in_channels, out_channels, (kh, kw)
        self.stride, self.padding, self.groups = stride, _conv_padding(padding, (kh, kw), stride), groups
        fan_in = in_channels // groups * kh * kw
        bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform(a=sqrt(5)) reduces to this bound
        self.weight = Parameter(_uniform((out_channels, in_channels // groups, kh, kw), bound))
        self.bias = Parameter(_uniform((out_channels,), bound)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, groups=self.groups)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}" + (f", groups={self.groups}" if self.groups != 1 else ""))


class _Elementwise(Module):
    fn = staticmethod(F.relu)

    def forward(self, x: Tensor) -> Tensor:
        return self.fn(x)


class ReLU(_Elementwise):
    fn = staticmethod(F.relu)


class Sigmoid(_Elementwise):
    fn = staticmethod(F.sigmoid)


class Tanh(_Elementwise):
    fn = staticmethod(F.tanh)


class ReLU6(_Elementwise):
    fn = staticmethod(F.relu6)


class Hardtanh(Module):
    def __init__(self, min_val: float = -1.0, max_val: float = 1.0) -> None:
        super().__init__()
        self.min_val, self.max_val = float(min_val), float(max_val)

    def forward(self, x: Tensor) -> Tensor:
        return F.hardtanh(x, self.min_val, self.max_val)

    def extra_repr(self) -> str:
        return f"min_val={self.min_val}, max_val={self.max_val}"


class Dropout(Module):
    """PyTorch's Dropout(p): in training mode zeroes each element with probability p and scales
    the rest by 1/(1-p); in eval mode (`model.eval()`) the identity. The masks come from ember's
    counter-based generator (`F.dropout`): deterministic for a `seed`, new every step, the same
    on every device, but not PyTorch's masks."""

    def __init__(self, p: float = 0.5, inplace: bool = False, seed: int = 0) -> None:
        super().__init__()
        if not 0.0 <= float(p) <= 1.0:
            raise ValueError(f"Dropout: p must be in [0, 1], got {p}")
        self.p, self.seed = float(p), int(seed)  # inplace changes only aliasing, which a traced graph has none of

    def forward(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.p, self.training, self.seed)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class RandomTranslate(Module):
    """Data augmentation as a layer: in training mode moves each image by up to `max_shift`
    pixels along each axis (zeros fill the border; `F.random_translate`), in eval mode the
    identity. Put first in a model, it runs inside the compiled step on the batch the step was
    given, drawn from ember's counter-based generator (deterministic for a `seed`, new every
    step, the same on every device). Not a PyTorch module: torchvision's RandomAffine(translate)
    draws fractions of the size and interpolates; this moves whole pixels."""

    def __init__(self, max_shift: int = 2, seed: int = 0) -> None:
        super().__init__()
        if int(max_shift) < 0:
            raise ValueError(f"RandomTranslate: max_shift must be >= 0, got {max_shift}")
        self.max_shift, self.seed = int(max_shift), int(seed)

    def forward(self, x: Tensor) -> Tensor:
        return F.random_translate(x, self.max_shift, self.training, self.seed)

    def extra_repr(self) -> str:
        return f"max_shift={self.max_shift}"


class Flatten(Module):
    def __init__(self, start_dim: int = 1, end_dim: int = -1) -> None:
        super().__init__()
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, x: Tensor) -> Tensor:
        return F.flatten(x, self.start_dim, self.end_dim)


class Sequential(Module):
    def __init__(self, *modules: Module) -> None:
        super().__init__()
        for i, m in enumerate(modules):
            setattr(self, str(i), m)

    def forward(self, x: Tensor) -> Tensor:
        for m in self._modules.values():
            x = m(x)
        return x

    def __getitem__(self, i: int) -> Module:
        return list(self._modules.values())[i]

    def __len__(self) -> int:
        return len(self._modules)


class ModuleList(Module):
    """torch.nn.ModuleList: modules held in order (named 0, 1, ...), called by the user's forward."""

    def __init__(self, modules: Iterable[Module] | None = None) -> None:
        super().__init__()
        for m in modules or ():
            self.append(m)

    def append(self, module: Module) -> "ModuleList":
        if not isinstance(module, Module):
            raise TypeError(f"ModuleList holds ember Modules, got {type(module).__name__}")
        setattr(self, str(len(self._modules)), module)
        return self

    def extend(self, modules: Iterable[Module]) -> "ModuleList":
        for m in modules:
            self.append(m)
        return self

    def __getitem__(self, i: int) -> Module:
        return list(self._modules.values())[i]

    def __iter__(self) -> Iterator[Module]:
        return iter(list(self._modules.values()))

    def __len__(self) -> int:
        return len(self._modules)

    def forward(self, *args: Any) -> Tensor:
        raise NotImplementedError("a ModuleList is not called itself: iterate over it in your forward()")


class ModuleDict(Module):
    """torch.nn.ModuleDict: modules by name, in insertion order."""

    def __init__(self, modules: Mapping[str, Module] | None = None) -> None:
        super().__init__()
        for k, m in (modules or {}).items():
            self[k] = m

    def __setitem__(self, key: str, module: Module) -> None:
        if not isinstance(module, Module):
            raise TypeError(f"ModuleDict holds ember Modules, got {type(module).__name__} for {key!r}")
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"ModuleDict keys must be identifiers (they name parameters), got {key!r}")
        setattr(self, key, module)

    def __getitem__(self, key: str) -> Module:
        return self._modules[key]

    def __contains__(self, key: object) -> bool:
        return key in self._modules

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._modules))

    def __len__(self) -> int:
        return len(self._modules)

    def keys(self):
        return self._modules.keys()

    def values(self):
        return self._modules.values()

    def items(self):
        return self._modules.items()

    def forward(self, *args: Any) -> Tensor:
        raise NotImplementedError("a ModuleDict is not called itself: pick its modules in your forward()")


class CrossEntropyLoss(Module):
    def __init__(self, reduction: str = "mean", label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.reduction = reduction
        self.label_smoothing = float(label_smoothing)

    def forward(self, logits: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(logits, labels, self.reduction, self.label_smoothing)


class MSELoss(Module):
    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        self.reduction = reduction

    def forward(self, pred: Tensor, target: Tensor) -> Tensor:
        return F.mse_loss(pred, target, self.reduction)


class NLLLoss(Module):
    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        self.reduction = reduction

    def forward(self, log_probs: Tensor, labels: Tensor) -> Tensor:
        return F.nll_loss(log_probs, labels, self.reduction)


class GELU(Module):
    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x, self.approximate)


class LogSoftmax(Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: Tensor) -> Tensor:
        return F.log_softmax(x, self.dim)


class AdaptiveAvgPool2d(Module):
    def __init__(self, output_size: int = 1) -> None:
        super().__init__()
        self.output_size = output_size

    def forward(self, x: Tensor) -> Tensor:
        return F.adaptive_avg_pool2d(x, self.output_size)


class AvgPool2d(Module):
    def __init__(self, kernel_size: int | tuple[int, int], stride: int | tuple[int, int] | None = None,
                 padding: int | tuple[int, int] = 0) -> None:
        super().__init__()
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding

    def forward(self, x: Tensor) -> Tensor:
        return F.avg_pool2d(x, self.kernel_size, self.stride, self.padding)


class MaxPool2d(AvgPool2d):
    def __init__(self, kernel_size: int | tuple[int, int], stride: int | tuple[int, int] | None = None,
                 padding: int | tuple[int, int] = 0, ceil_mode: bool = False) -> None:
        super().__init__(kernel_size, stride, padding)
        self.ceil_mode = ceil_mode

    def forward(self, x: Tensor) -> Tensor:
        return F.max_pool2d(x, self.kernel_size, self.stride, self.padding, self.ceil_mode)


class LayerNorm(Module):
    def __init__(self, normalized_shape: int | tuple[int, ...], eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True) -> None:
        super().__init__()
        self.normalized_shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.eps = eps
        # PyTorch's initialisation: weight ones, bias zeros
        self.weight = Parameter(np.ones(self.normalized_shape, np.float32)) if elementwise_affine else None
        self.bias = Parameter(np.zeros(self.normalized_shape, np.float32)) if elementwise_affine and bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class BatchNorm2d(Module):
    """PyTorch's BatchNorm2d. Training: normalises by the batch's statistics (biased variance) and
    updates the running mean and (unbiased) variance with `momentum`, as graph state written by
    the compiled step; eval (`model.eval()`): normalises by the running statistics."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1, affine: bool = True) -> None:
        super().__init__()
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.weight = Parameter(np.ones(num_features, np.float32)) if affine else None
        self.bias = Parameter(np.zeros(num_features, np.float32)) if affine else None
        self.running_mean = Buffer(np.zeros(num_features, np.float32))
        self.running_var = Buffer(np.ones(num_features, np.float32))
        self.num_batches_tracked = Buffer(np.zeros((), np.int64), "int64")

    def forward(self, x: Tensor) -> Tensor:
        c = self.num_features
        if len(x.shape) != 4 or x.shape[1] != c:
            raise ValueError(f"BatchNorm2d({c}) expects an (N, {c}, H, W) input, got {x.type}")
        ctx = active()
        if self.training:
            n, _, h, w = x.shape
            if n * h * w == 1:  # PyTorch raises too: a variance of one value is 0 and its unbiased form 0/0
                name = f" {ctx.scope()!r}" if ctx is not None and ctx.scope() else ""
                raise ValueError(f"BatchNorm2d({c}){name} expected more than 1 value per channel when training, "
                                 f"got input {x.type} (1 image of 1x1); use a batch of "
                                 f"at least 2, or model.eval() ({user_location()})")
            mean = F.mean(x, (0, 2, 3), keepdims=True)
            centred = F.sub(x, mean)
            var = F.mean(F.mul(centred, centred), (0, 2, 3), keepdims=True)
            count = x.shape[0] * x.shape[2] * x.shape[3]
            if ctx is not None:
                m = float(self.momentum)
                unbiased = F.mul(F.reshape(var, (c,)), count / max(count - 1, 1))
                ctx.set_state(self.running_mean, F.add(F.mul(self.running_mean, 1 - m), F.mul(F.reshape(mean, (c,)), m)))
                ctx.set_state(self.running_var, F.add(F.mul(self.running_var, 1 - m), F.mul(unbiased, m)))
                ctx.set_state(self.num_batches_tracked, F.add(self.num_batches_tracked, 1))
        else:
            mean = F.reshape(self.running_mean, (1, c, 1, 1))
            centred = F.sub(x, mean)
            var = F.reshape(self.running_var, (1, c, 1, 1))
        # times 1/sqrt(var + eps), as PyTorch computes it (invstd): per element a multiply, in the
        # backward too, where a division by the deviation cost two divisions per element
        y = F.mul(centred, F.reciprocal(F.sqrt(F.add(var, float(self.eps)))))
        if self.weight is not None:
            y = F.add(F.mul(y, F.reshape(self.weight, (1, c, 1, 1))), F.reshape(self.bias, (1, c, 1, 1)))
        return y

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}"
