"""Learning-rate schedules inside the step against torch.optim.lr_scheduler, step for step.

Two checks per schedule: the Python formula (`value`) against the scheduler's `get_last_lr()`
over every step, and the update graph (the rate built from the step counter in the graph) fed
PyTorch's own gradients, parameters and momentum within 1e-6 relative of torch.optim driven by
the torch scheduler after every step (as tests/passes/test_optimizer.py does for constant rates).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ember.ir import Graph, TensorType, run
from ember.passes import lr_schedule as ls
from ember.passes.optimizer import SGD, Adam, AdamW, apply_optimizer, initial_state
from ember.passes.simplify import simplify

STEPS = 40
RTOL = 1e-6


def _torch_scheduler(schedule, opt):
    S = torch.optim.lr_scheduler
    if isinstance(schedule, ls.Linear):
        return S.LinearLR(opt, schedule.start_factor, schedule.end_factor, schedule.total_iters)
    if isinstance(schedule, ls.Cosine):
        return S.CosineAnnealingLR(opt, schedule.t_max, schedule.eta_min)
    if isinstance(schedule, ls.Step):
        return S.StepLR(opt, schedule.step_size, schedule.gamma)
    if isinstance(schedule, ls.OneCycle):
        return S.OneCycleLR(opt, schedule.max_lr, schedule.total_steps, pct_start=schedule.pct_start,
                            anneal_strategy=schedule.anneal_strategy, cycle_momentum=schedule.cycle_momentum,
                            base_momentum=schedule.base_momentum, max_momentum=schedule.max_momentum,
                            div_factor=schedule.div_factor, final_div_factor=schedule.final_div_factor,
                            three_phase=schedule.three_phase)
    return S.SequentialLR(opt, [_torch_scheduler(s, opt) for s in schedule.schedules], list(schedule.milestones))


SCHEDULES = [
    pytest.param(ls.Linear(0.1, 1.0, 10), id="linear-warmup"),
    pytest.param(ls.Linear(1.0, 0.05, 30), id="linear-decay"),
    pytest.param(ls.Cosine(25, 0.001), id="cosine"),
    pytest.param(ls.Step(7, 0.5), id="step"),
    pytest.param(ls.OneCycle(0.2, STEPS, cycle_momentum=False), id="onecycle"),
    pytest.param(ls.OneCycle(0.2, STEPS, pct_start=0.25, anneal_strategy="linear", three_phase=True,
                             cycle_momentum=False), id="onecycle-linear-three-phase"),
    pytest.param(ls.Sequential((ls.Linear(0.2, 1.0, 8), ls.Cosine(STEPS - 8)), (8,)), id="warmup-cosine"),
]


@pytest.mark.parametrize("schedule", SCHEDULES + [pytest.param(ls.OneCycle(0.2, STEPS), id="onecycle-momentum")])
def test_value_matches_torch_scheduler(schedule) -> None:
    base = 0.1
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base, momentum=0.9)
    sched = _torch_scheduler(schedule, opt)
    for t in range(STEPS):
        want = sched.get_last_lr()[0]
        assert schedule.value(t, base) == pytest.approx(want, rel=1e-12, abs=1e-15), f"step {t}"
        if ls.cycles_momentum(schedule):
            assert schedule.momentum_value(t) == pytest.approx(opt.param_groups[0]["momentum"], rel=1e-12)
        opt.step()
        sched.step()


def _grad_graph(shapes: dict[str, tuple[int, ...]]) -> Graph:
    g = Graph("grads")
    for name, shape in shapes.items():
        t = TensorType(shape)
        g.add_parameter(name, t)
        g.set_output(f"grad:{name}", g.add_input(f"g.{name}", t))
    return g


def _run_against_torch(cfg, make_torch_opt, schedule) -> None:
    rng = np.random.default_rng(0)
    shapes = {"w": (6, 5), "b": (5,)}
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    grads = [{k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()} for _ in range(STEPS)]
    step = simplify(apply_optimizer(_grad_graph(shapes), cfg))
    states = initial_state(step)
    tparams = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    topt = make_torch_opt(list(tparams.values()))
    tsched = _torch_scheduler(schedule, topt)
    for i in range(STEPS):
        for k, tp in tparams.items():
            tp.grad = torch.from_numpy(grads[i][k].copy())
        res = run(step, {f"g.{k}": v for k, v in grads[i].items()}, params, states)
        params = {k: res.updates[k] for k in params}
        states = {k: res.updates[k] for k in states}
        topt.step()
        tsched.step()
        assert states["step"] == i + 1
        for k, tp in tparams.items():
            want = tp.detach().numpy()
            err = np.abs(params[k] - want).max() / np.abs(want).max()
            assert err <= RTOL, f"step {i}: {k} off by {err:.2e} relative"
            if f"{k}.momentum_buffer" in states:
                tbuf = topt.state[tp]["momentum_buffer"].numpy()
                berr = np.abs(states[f"{k}.momentum_buffer"] - tbuf).max() / np.abs(tbuf).max()
                assert berr <= RTOL, f"step {i}: {k}.momentum_buffer off by {berr:.2e} relative"


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_sgd_nesterov_with_schedule_matches_torch(schedule) -> None:
    cfg = SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, schedule=schedule)
    _run_against_torch(cfg, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
                       schedule)


def test_onecycle_cycles_sgd_momentum_like_torch() -> None:
    schedule = ls.OneCycle(0.2, STEPS)
    cfg = SGD(lr=0.1, momentum=0.9, schedule=schedule)
    _run_against_torch(cfg, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), schedule)


@pytest.mark.parametrize("cls,tcls", [(Adam, torch.optim.Adam), (AdamW, torch.optim.AdamW)])
def test_adam_with_schedule_matches_torch(cls, tcls) -> None:
    schedule = ls.Sequential((ls.Linear(0.1, 1.0, 5), ls.Cosine(STEPS - 5, 1e-4)), (5,))
    cfg = cls(lr=1e-2, weight_decay=0.05, schedule=schedule)
    _run_against_torch(cfg, lambda ps: tcls(ps, lr=1e-2, weight_decay=0.05), schedule)


def test_schedule_needs_the_step_counter_only_once() -> None:
    cfg = Adam(lr=1e-2, schedule=ls.Cosine(10))
    g = apply_optimizer(_grad_graph({"w": (3,)}), cfg)
    assert sorted(g.states) == ["step", "w.exp_avg", "w.exp_avg_sq"]


@pytest.mark.parametrize("make,match", [
    (lambda: ls.Cosine(0), "t_max must be a positive integer"),
    (lambda: ls.Linear(0.0, 1.0, 5), "start_factor must be in"),
    (lambda: ls.Step(3, gamma=0.0), "gamma must be positive"),
    (lambda: ls.OneCycle(0.1, 10, anneal_strategy="exp"), "anneal_strategy"),
    (lambda: ls.Sequential((ls.Cosine(5), ls.Cosine(5)), ()), "expected 1 milestones"),
    (lambda: Adam(schedule=ls.OneCycle(0.1, 10)), "cycle_momentum=False"),
    (lambda: SGD(lr=0.1, schedule="cosine"), "schedule must be one of"),
])
def test_bad_schedules_are_refused_in_one_line(make, match) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        make()
