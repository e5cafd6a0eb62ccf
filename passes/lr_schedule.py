"""Learning-rate schedules as data, computed inside the compiled step from its step counter.

A schedule is a frozen dataclass with torch.optim.lr_scheduler's parameters and semantics: at
optimizer step t (0-based: t calls of `scheduler.step()` have been made before it, as in the
usual `optimizer.step(); scheduler.step()` loop) the learning rate is `value(t, base_lr)`.
`build(builder, t, base_lr)` emits the same formula as float64 graph ops on the step counter, so
changing the rate costs nothing per step and never recompiles; `value` is the same formula in
Python (docs, tests, the trainer's logs). Formulas are torch's closed forms (`_get_closed_form_lr`
where torch has one); torch's chained form equals them up to float64 rounding.

| schedule | torch | lr at step t |
| --- | --- | --- |
| `Linear(start_factor, end_factor, total_iters)` | `LinearLR` (warm-up or linear decay) | base * (s + (e - s) * min(t, T) / T) |
| `Cosine(t_max, eta_min)` | `CosineAnnealingLR` | eta_min + (base - eta_min) * (1 + cos(pi t / T)) / 2 |
| `Step(step_size, gamma)` | `StepLR` | base * gamma ** floor(t / step_size) |
| `OneCycle(max_lr, total_steps, ...)` | `OneCycleLR` (lr and, for SGD, momentum) | phases annealed by cos or linearly |
| `Sequential(schedules, milestones)` | `SequentialLR` | the i-th schedule from milestone i, its t restarting at 0 |
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol, Union


class _Builder(Protocol):
    """What `build` needs of `optimizer._Ops`: float64 scalar arithmetic on graph nodes."""

    def c(self, value: float, like: int) -> int: ...
    def add(self, a: int, b: int) -> int: ...
    def sub(self, a: int, b: int) -> int: ...
    def mul(self, a: int, b: int) -> int: ...
    def div(self, a: int, b: int) -> int: ...
    def op(self, name: str, *operands: int, **attrs: Any) -> int: ...


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class Linear:
    """torch's LinearLR: the factor goes linearly from `start_factor` to `end_factor` over
    `total_iters` steps, then stays (a warm-up with start < 1 = end, a decay with end < 1)."""
    start_factor: float = 1.0 / 3
    end_factor: float = 1.0
    total_iters: int = 5

    def __post_init__(self) -> None:
        if not 0 < self.start_factor <= 1 or not 0 <= self.end_factor <= 1:
            raise ValueError("Linear: start_factor must be in (0, 1] and end_factor in [0, 1] (as torch's LinearLR), "
                             f"got {self.start_factor} and {self.end_factor}")
        _positive_int("Linear: total_iters", self.total_iters)

    def value(self, t: int, base_lr: float) -> float:
        s, e, n = self.start_factor, self.end_factor, self.total_iters
        return base_lr * (s + (e - s) * min(n, t) / n)

    def build(self, o: _Builder, t: int, base_lr: float) -> int:
        s, e, n = self.start_factor, self.end_factor, self.total_iters
        progress = o.div(o.op("minimum", t, o.c(float(n), t)), o.c(float(n), t))
        return o.mul(o.c(base_lr, t), o.add(o.c(s, t), o.mul(o.c(e - s, t), progress)))


@dataclass(frozen=True)
class Cosine:
    """torch's CosineAnnealingLR: half a cosine from the base rate down to `eta_min` over
    `t_max` steps (and back up after, as torch's closed form does)."""
    t_max: int
    eta_min: float = 0.0

    def __post_init__(self) -> None:
        _positive_int("Cosine: t_max", self.t_max)

    def value(self, t: int, base_lr: float) -> float:
        return self.eta_min + (base_lr - self.eta_min) * (1 + math.cos(math.pi * t / self.t_max)) / 2

    def build(self, o: _Builder, t: int, base_lr: float) -> int:
        cos = o.op("cos", o.mul(t, o.c(math.pi / self.t_max, t)))
        return o.add(o.c(self.eta_min, t), o.mul(o.c((base_lr - self.eta_min) / 2, t), o.add(o.c(1.0, t), cos)))


@dataclass(frozen=True)
class Step:
    """torch's StepLR: the rate times `gamma` every `step_size` steps."""
    step_size: int
    gamma: float = 0.1

    def __post_init__(self) -> None:
        _positive_int("Step: step_size", self.step_size)
        if self.gamma <= 0:
            raise ValueError(f"Step: gamma must be positive, got {self.gamma}")

    def value(self, t: int, base_lr: float) -> float:
        return base_lr * self.gamma ** (t // self.step_size)

    def build(self, o: _Builder, t: int, base_lr: float) -> int:
        k = o.op("floor", o.div(t, o.c(float(self.step_size), t)))
        return o.mul(o.c(base_lr, t), o.op("exp", o.mul(k, o.c(math.log(self.gamma), t))))


@dataclass(frozen=True)
class OneCycle:
    """torch's OneCycleLR: from max_lr/div_factor up to max_lr over pct_start of the steps, then
    down to that over final_div_factor (three_phase: back to the start first, then down). The
    base rate is ignored, as torch does. With `cycle_momentum`, SGD's momentum runs the opposite
    way between base_momentum and max_momentum (`momentum_value`)."""
    max_lr: float
    total_steps: int
    pct_start: float = 0.3
    anneal_strategy: str = "cos"
    div_factor: float = 25.0
    final_div_factor: float = 1e4
    three_phase: bool = False
    cycle_momentum: bool = True
    base_momentum: float = 0.85
    max_momentum: float = 0.95

    def __post_init__(self) -> None:
        _positive_int("OneCycle: total_steps", self.total_steps)
        if not 0 <= self.pct_start <= 1:
            raise ValueError(f"OneCycle: pct_start must be in [0, 1], got {self.pct_start}")
        if self.anneal_strategy not in ("cos", "linear"):
            raise ValueError(f"OneCycle: anneal_strategy must be 'cos' or 'linear', got {self.anneal_strategy!r}")

    def _phases(self, lo: float, hi: float, end: float) -> list[tuple[float, float, float]]:
        """(end step, start value, end value) per phase, as torch's `_schedule_phases`."""
        n, p = self.total_steps, self.pct_start
        if self.three_phase:
            return [(p * n - 1, lo, hi), (2 * p * n - 2, hi, lo), (n - 1, lo, end)]
        return [(p * n - 1, lo, hi), (n - 1, hi, end)]

    def _lr_phases(self) -> list[tuple[float, float, float]]:
        initial = self.max_lr / self.div_factor
        return self._phases(initial, self.max_lr, initial / self.final_div_factor)

    def _momentum_phases(self) -> list[tuple[float, float, float]]:
        # momentum falls while the rate rises: phase values swapped relative to the rate's
        return self._phases(self.max_momentum, self.base_momentum, self.max_momentum)

    def _anneal(self, start: float, end: float, pct: float) -> float:
        if self.anneal_strategy == "cos":
            return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def _value(self, phases: list[tuple[float, float, float]], t: int) -> float:
        begin = 0.0
        for i, (stop, start_v, end_v) in enumerate(phases):
            if t <= stop or i == len(phases) - 1:
                return self._anneal(start_v, end_v, (t - begin) / (stop - begin))
            begin = stop
        raise AssertionError("unreachable")

    def _build(self, o: _Builder, t: int, phases: list[tuple[float, float, float]]) -> int:
        begin = 0.0
        pieces = []
        for stop, start_v, end_v in phases:
            pct = o.div(o.sub(t, o.c(begin, t)), o.c(stop - begin, t))
            if self.anneal_strategy == "cos":
                wave = o.add(o.op("cos", o.mul(pct, o.c(math.pi, t))), o.c(1.0, t))
                pieces.append((stop, o.add(o.c(end_v, t), o.mul(o.c((start_v - end_v) / 2.0, t), wave))))
            else:
                pieces.append((stop, o.add(o.c(start_v, t), o.mul(o.c(end_v - start_v, t), pct))))
            begin = stop
        value = pieces[-1][1]
        for stop, piece in reversed(pieces[:-1]):  # the first phase whose end is not passed
            value = o.op("where", o.op("le", t, o.c(stop, t)), piece, value)
        return value

    def value(self, t: int, base_lr: float) -> float:
        return self._value(self._lr_phases(), t)

    def build(self, o: _Builder, t: int, base_lr: float) -> int:
        return self._build(o, t, self._lr_phases())

    def momentum_value(self, t: int) -> float:
        return self._value(self._momentum_phases(), t)

    def build_momentum(self, o: _Builder, t: int) -> int:
        return self._build(o, t, self._momentum_phases())


@dataclass(frozen=True)
class Sequential:
    """torch's SequentialLR: schedule i from milestone i - 1 on (its own t starting at 0 there);
    the usual warm-up then decay is `Sequential((Linear(0.1, 1, W), Cosine(T - W)), (W,))`."""
    schedules: tuple["Schedule", ...]
    milestones: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedules", tuple(self.schedules))
        object.__setattr__(self, "milestones", tuple(int(m) for m in self.milestones))
        if len(self.milestones) != len(self.schedules) - 1:
            raise ValueError(f"Sequential: expected {len(self.schedules) - 1} milestones for {len(self.schedules)} "
                             f"schedules, got {len(self.milestones)}")
        if list(self.milestones) != sorted(self.milestones) or any(m <= 0 for m in self.milestones):
            raise ValueError(f"Sequential: milestones must be positive and increasing, got {self.milestones}")
        if any(isinstance(s, OneCycle) and s.cycle_momentum for s in self.schedules):
            raise ValueError("Sequential: a OneCycle inside it cannot cycle the momentum; pass cycle_momentum=False")

    def value(self, t: int, base_lr: float) -> float:
        start = 0
        for schedule, milestone in zip(self.schedules, (*self.milestones, None)):
            if milestone is None or t < milestone:
                return schedule.value(t - start, base_lr)
            start = milestone
        raise AssertionError("unreachable")

    def build(self, o: _Builder, t: int, base_lr: float) -> int:
        starts = (0, *self.milestones)
        value = self.schedules[-1].build(o, o.sub(t, o.c(float(starts[-1]), t)), base_lr)
        for schedule, start, milestone in reversed(list(zip(self.schedules[:-1], starts, self.milestones))):
            piece = schedule.build(o, o.sub(t, o.c(float(start), t)) if start else t, base_lr)
            value = o.op("where", o.op("lt", t, o.c(float(milestone), t)), piece, value)
        return value


Schedule = Union[Linear, Cosine, Step, OneCycle, Sequential]
SCHEDULES = (Linear, Cosine, Step, OneCycle, Sequential)


def cycles_momentum(schedule: "Schedule | None") -> bool:
    return isinstance(schedule, OneCycle) and schedule.cycle_momentum
