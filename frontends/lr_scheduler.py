"""`optim.lr_scheduler`: torch.optim.lr_scheduler's names, computed inside the compiled step.

    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=1000)
    step = compile(model, loss_fn, opt, ...)    # the rate of every step is part of the step

A scheduler attaches its schedule (`ember.passes.lr_schedule`) to the optimizer it is given, so
create it before `compile()`. The rate at step t is a function of the step counter the compiled
step keeps (and checkpoints), so nothing runs in Python per step and nothing recompiles;
`scheduler.step()`, which a torch loop calls after every optimizer step, does nothing here (it
warns once). `lr_at(t)` gives the rate of step t, as `get_last_lr()` would after t steps.
"""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence

from ember.passes import lr_schedule as _ls

from .optim import Optimizer


class LRScheduler:
    """Base: the optimizer it scheduled and the schedule it attached."""

    schedule: _ls.Schedule
    _warned = False

    def __init__(self, optimizer: Optimizer, schedule: _ls.Schedule) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"{type(self).__name__} expects an ember.frontends.optim optimizer, "
                            f"got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.schedule = schedule
        optimizer.config = dataclasses.replace(optimizer.config, schedule=schedule)

    def lr_at(self, t: int) -> float:
        """The learning rate of optimizer step t (0-based)."""
        return self.schedule.value(int(t), self.optimizer.config.lr)

    def step(self) -> None:
        if not LRScheduler._warned:
            LRScheduler._warned = True
            warnings.warn("ember computes the learning rate inside the compiled step from its step counter; "
                          "scheduler.step() does nothing (create the scheduler before compile())", stacklevel=2)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.schedule})"


class LinearLR(LRScheduler):
    def __init__(self, optimizer: Optimizer, start_factor: float = 1.0 / 3, end_factor: float = 1.0,
                 total_iters: int = 5) -> None:
        super().__init__(optimizer, _ls.Linear(float(start_factor), float(end_factor), int(total_iters)))


class CosineAnnealingLR(LRScheduler):
    def __init__(self, optimizer: Optimizer, T_max: int, eta_min: float = 0.0) -> None:  # noqa: N803 (torch's name)
        super().__init__(optimizer, _ls.Cosine(int(T_max), float(eta_min)))


class StepLR(LRScheduler):
    def __init__(self, optimizer: Optimizer, step_size: int, gamma: float = 0.1) -> None:
        super().__init__(optimizer, _ls.Step(int(step_size), float(gamma)))


class OneCycleLR(LRScheduler):
    def __init__(self, optimizer: Optimizer, max_lr: float, total_steps: int | None = None, epochs: int | None = None,
                 steps_per_epoch: int | None = None, pct_start: float = 0.3, anneal_strategy: str = "cos",
                 cycle_momentum: bool = True, base_momentum: float = 0.85, max_momentum: float = 0.95,
                 div_factor: float = 25.0, final_div_factor: float = 1e4, three_phase: bool = False) -> None:
        if total_steps is None:
            if epochs is None or steps_per_epoch is None:
                raise ValueError("You must define either total_steps OR (epochs AND steps_per_epoch)")
            total_steps = int(epochs) * int(steps_per_epoch)
        super().__init__(optimizer, _ls.OneCycle(
            float(max_lr), int(total_steps), float(pct_start), anneal_strategy, float(div_factor),
            float(final_div_factor), bool(three_phase), bool(cycle_momentum), float(base_momentum),
            float(max_momentum)))


class SequentialLR(LRScheduler):
    def __init__(self, optimizer: Optimizer, schedulers: Sequence[LRScheduler], milestones: Sequence[int]) -> None:
        for s in schedulers:
            if not isinstance(s, LRScheduler) or s.optimizer is not optimizer:
                raise ValueError("SequentialLR expects schedulers of the same optimizer, each an "
                                 "ember.frontends.optim.lr_scheduler scheduler")
        super().__init__(optimizer, _ls.Sequential(tuple(s.schedule for s in schedulers), tuple(milestones)))


__all__ = ["LRScheduler", "LinearLR", "CosineAnnealingLR", "StepLR", "OneCycleLR", "SequentialLR"]
