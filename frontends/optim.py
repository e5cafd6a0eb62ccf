"""`optim`: torch.optim-style constructors that describe an optimizer for `compile()`.

`ember.frontends.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)` reads like PyTorch. The
object is a description only: the update itself is appended to the training graph by
`ember.passes.optimizer` and runs inside the compiled step. `params` is optional: without it
every parameter the loss depends on is trained; with it only those listed (as in PyTorch, the
others keep their values and no gradient is computed for them). Either way a Parameter with
`requires_grad = False` is not trained.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from ember.passes import optimizer as _opt

from .tensor import Parameter


def _check_params(params: Any) -> tuple[Parameter, ...] | None:
    """The parameters an optimizer was given (None: every parameter of the model)."""
    if params is None:
        return None
    if isinstance(params, Parameter):
        raise TypeError("params argument given to the optimizer should be an iterable of Parameters, "
                        "but got a Parameter (wrap it in a list)")
    if not isinstance(params, Iterable):
        raise TypeError(f"params must be an iterable of Parameters, got {type(params).__name__}")
    params = list(params)
    if any(isinstance(p, dict) for p in params):
        raise NotImplementedError("per-parameter option groups are not supported yet; pass the parameters "
                                  "(or nothing) and one set of options")
    bad = [type(p).__name__ for p in params if not isinstance(p, Parameter)]
    if bad:
        raise TypeError(f"optimizer params must be ember Parameters, got {bad[:3]}")
    if not params:
        raise ValueError("optimizer got an empty parameter list")
    return tuple(params)


def _check_finite(**values: float) -> None:
    # torch.optim lets a NaN learning rate through (NaN < 0 is false); it only ever trains to NaN
    for name, v in values.items():
        if not math.isfinite(v):
            raise ValueError(f"Invalid {name}: {v} (expected a finite number)")


class Optimizer:
    """Base: holds the validated `config` (an `ember.passes.optimizer` dataclass)."""

    config: _opt.OptimizerConfig
    params: tuple[Parameter, ...] | None = None  # what `params` listed (None: the whole model)

    def __repr__(self) -> str:
        return repr(self.config)  # SGD(lr=0.1, momentum=0.9, ...): the config classes carry torch's names


class SGD(Optimizer):
    def __init__(self, params: Any = None, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False) -> None:
        if maximize:
            raise NotImplementedError("SGD(maximize=True) is not supported; negate the loss instead")
        self.params = _check_params(params)
        _check_finite(lr=float(lr), momentum=float(momentum))
        self.config = _opt.SGD(lr=float(lr), momentum=float(momentum), dampening=float(dampening),
                               nesterov=bool(nesterov), weight_decay=float(weight_decay))


class Adam(Optimizer):
    _config = _opt.Adam

    def __init__(self, params: Any = None, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float | None = None, amsgrad: bool = False, *,
                 maximize: bool = False) -> None:
        if amsgrad or maximize:
            raise NotImplementedError(f"{type(self).__name__}: amsgrad and maximize are not supported yet")
        self.params = _check_params(params)
        _check_finite(lr=float(lr))
        wd = self._config.weight_decay if weight_decay is None else float(weight_decay)
        self.config = self._config(lr=float(lr), betas=tuple(betas), eps=float(eps), weight_decay=wd)


class AdamW(Adam):
    """Adam with decoupled weight decay (default 1e-2, as torch.optim.AdamW)."""

    _config = _opt.AdamW


def as_config(optimizer: Any) -> _opt.OptimizerConfig:
    """An `optim` object or a passes config -> the passes config."""
    if isinstance(optimizer, Optimizer):
        return optimizer.config
    if isinstance(optimizer, (_opt.SGD, _opt.Adam, _opt.AdamW)):
        return optimizer
    raise TypeError(f"expected an ember.frontends.optim optimizer (SGD, Adam, AdamW), got {type(optimizer).__name__}"
                    + (" (a torch optimizer? use ember.frontends.optim instead)" if "torch" in type(optimizer).__module__ else ""))


# torch.optim.lr_scheduler's place; imported last, as it builds on Optimizer
from . import lr_scheduler  # noqa: E402

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "as_config", "lr_scheduler"]
