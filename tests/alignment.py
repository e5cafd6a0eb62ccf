"""Machine-independent comparisons of an ember training run with PyTorch, shared by the e2e tests.

Why these and not a free-running "ember is closer to float64 than PyTorch is" check: the first
steps of the CNN recipe (lr 0.05 on an 18432-wide linear layer) amplify any rounding difference
chaotically, so which of two float32 runs lands nearer the float64 run depends on the BLAS /
oneDNN kernels of the machine (2.58e-4 against 1.27e-4 on one CPU, the other way round on
another). What holds on every CPU is a comparison *per step, from the same weights*:

* the loss ember computes on its current weights equals PyTorch float32's on those weights;
* ember's update of those weights is as close to the float64 update as PyTorch float32's is.

Each step is compared from ember's own weights (PyTorch reloaded before every step), so errors
never accumulate and the figures do not depend on the trajectory's chaos.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ember.frontends.training import torch_twins as twins

LR = 0.05


def torch_model(name: str) -> torch.nn.Module:
    tnn = torch.nn
    if name == "cnn":
        return tnn.Sequential(tnn.Conv2d(1, 16, 3), tnn.ReLU(), tnn.Conv2d(16, 32, 3), tnn.ReLU(), tnn.Flatten(),
                              tnn.Linear(18432, 10))
    return tnn.Sequential(tnn.Linear(784, 30), tnn.Sigmoid(), tnn.Linear(30, 10))


def torch_sgd_step(model: torch.nn.Module, weights: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray,
                   dtype: torch.dtype, lr: float = LR) -> tuple[float, dict[str, np.ndarray]]:
    """Loads `weights` into `model` (cast to `dtype`), takes one SGD step; (loss, new weights in float64)."""
    return twins.torch_sgd_step(model, weights, x, y, dtype, lr)


def sgd_steps_match_torch(step: Callable[[np.ndarray, np.ndarray], float], torch_module: torch.nn.Module,
                          torch_params: Sequence[torch.nn.Parameter], x: np.ndarray, y: np.ndarray, lr: float,
                          steps: int = 3) -> None:
    """`steps` steps of an ember training step and of torch.optim.SGD(torch_params, lr) on
    `torch_module` under cross-entropy, started from the same weights: each loss within 1e-5."""
    opt = torch.optim.SGD(torch_params, lr=lr)
    for i in range(steps):
        ours = step(x, y)
        opt.zero_grad()
        ref = torch.nn.functional.cross_entropy(torch_module(torch.from_numpy(x)), torch.from_numpy(y))
        ref.backward()
        opt.step()
        assert abs(ours - ref.item()) < 1e-5, f"step {i}: ember {ours} torch {ref.item()}"


@dataclass
class PerStep:
    loss_diff: np.ndarray    # |ember loss - PyTorch float32 loss| on the same weights, per step
    ember_err: np.ndarray    # |ember update - float64 update| / |float64 update|, per step
    torch_err: np.ndarray    # the same for PyTorch float32
    ratio: np.ndarray        # ember_err / torch_err

    def describe(self) -> str:
        return (f"loss |ember - torch f32| max {self.loss_diff.max():.3g}; update error vs float64: ember median "
                f"{np.median(self.ember_err):.3g}, torch f32 median {np.median(self.torch_err):.3g}; ratio median "
                f"{np.median(self.ratio):.3f}, max {self.ratio.max():.3g}")


def _update_error(new: dict[str, np.ndarray], exact: dict[str, np.ndarray], old: dict[str, np.ndarray]) -> float:
    num = sum(float(np.sum((np.asarray(new[k], np.float64) - exact[k]) ** 2)) for k in exact)
    den = sum(float(np.sum((exact[k] - np.asarray(old[k], np.float64)) ** 2)) for k in exact)
    return (num / den) ** 0.5


def per_step(ember_step: Callable[[np.ndarray, np.ndarray], float], weights: Callable[[], dict[str, np.ndarray]],
             model_name: str | Callable[[], torch.nn.Module], batches: Sequence[tuple[np.ndarray, np.ndarray]],
             lr: float = LR) -> PerStep:
    """Runs ember's step on every batch; before each, PyTorch float32 and float64 take the same step
    from ember's current weights (`weights()` returns copies under PyTorch's names). The PyTorch
    model is `model_name`'s here, or what `model_name()` builds (a zoo model, say)."""
    make = model_name if callable(model_name) else (lambda: torch_model(model_name))
    t32, t64 = make(), make()
    loss_diff, ember_err, torch_err = [], [], []
    for x, y in batches:
        before = weights()
        loss32, after32 = torch_sgd_step(t32, before, x, y, torch.float32, lr)
        _, after64 = torch_sgd_step(t64, before, x, y, torch.float64, lr)
        loss = ember_step(x, y)
        after = weights()
        loss_diff.append(abs(loss - loss32))
        ember_err.append(_update_error(after, after64, before))
        torch_err.append(_update_error(after32, after64, before))
    e, t = np.array(ember_err), np.array(torch_err)
    return PerStep(np.array(loss_diff), e, t, e / t)


def free_run_torch(model_name: str, init: dict[str, np.ndarray], batches, dtype: torch.dtype, lr: float = LR) -> np.ndarray:
    """PyTorch trained alone from `init`; its losses."""
    model = torch_model(model_name)
    losses, weights = [], {k: np.asarray(v) for k, v in init.items()}
    for x, y in batches:
        loss, weights = torch_sgd_step(model, weights, x, y, dtype, lr)
        losses.append(loss)
    return np.array(losses)


def initial_weights(model_name: str, seed: int = 0) -> dict[str, np.ndarray]:
    torch.manual_seed(seed)
    return {k: v.detach().numpy().copy() for k, v in torch_model(model_name).state_dict().items()}
