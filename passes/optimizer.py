"""The optimizer update as graph ops: `apply_optimizer(graph, config) -> graph`.

Consumes the `grad:<param>` outputs that `autodiff.grad` added, and appends the update of every
such parameter with torch.optim's exact semantics (the single-tensor code paths of
torch/optim/sgd.py and adam.py, operation by operation, so float32 rounding matches as closely
as the arithmetic allows). Optimizer state (momentum buffers, Adam moments, the step count) is
graph `state`: read at the start of the step, written back through `updates` at its end, owned
by the runtime. Hyperparameters become constants; nothing is computed in Python per step.

Scalar bias corrections (Adam's 1 - beta**step) are computed in float64 inside the graph and
rounded once to the parameter dtype, because PyTorch computes them in Python doubles; a float32
beta**step would be off by a few ulps already at step 1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

import numpy as np

from ember.ir import Graph, TensorType, float32, float64

from . import lr_schedule
from .autodiff import Builder
from .lr_schedule import Schedule


@dataclass(frozen=True)
class SGD:
    lr: float
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    schedule: Schedule | None = None  # the learning rate per step (passes/lr_schedule.py); None: constant

    def __post_init__(self) -> None:
        _check_schedule(self.schedule)
        # The same checks, in the same words, as torch.optim.SGD.
        if self.lr < 0.0:
            raise ValueError(f"Invalid learning rate: {self.lr}")
        if self.momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {self.momentum}")
        if self.weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {self.weight_decay}")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")


def _check_schedule(schedule: object) -> None:
    if schedule is not None and not isinstance(schedule, lr_schedule.SCHEDULES):
        raise TypeError(f"schedule must be one of {', '.join(c.__name__ for c in lr_schedule.SCHEDULES)} "
                        f"(ember.passes.lr_schedule), got {type(schedule).__name__}")


def _check_adam(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if len(betas) != 2:
        raise ValueError(f"betas must be a pair, got {betas!r}")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


@dataclass(frozen=True)
class Adam:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0  # L2 penalty added to the gradient (coupled)
    schedule: Schedule | None = None  # the learning rate per step (passes/lr_schedule.py); None: constant

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        _check_adam(self.lr, self.betas, self.eps, self.weight_decay)
        _check_schedule(self.schedule)
        if lr_schedule.cycles_momentum(self.schedule):
            raise ValueError("a OneCycle schedule cycles SGD's momentum; with Adam pass cycle_momentum=False "
                             "(cycling Adam's beta1 is not supported)")


@dataclass(frozen=True)
class AdamW:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2  # decoupled: p *= 1 - lr * weight_decay before the Adam step
    schedule: Schedule | None = None  # the learning rate per step (passes/lr_schedule.py); None: constant

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        _check_adam(self.lr, self.betas, self.eps, self.weight_decay)
        _check_schedule(self.schedule)
        if lr_schedule.cycles_momentum(self.schedule):
            raise ValueError("a OneCycle schedule cycles SGD's momentum; with AdamW pass cycle_momentum=False "
                             "(cycling Adam's beta1 is not supported)")


OptimizerConfig = Union[SGD, Adam, AdamW]


class _Ops(Builder):
    """Builder helpers for update formulas; constants take the dtype of the value they meet."""

    def c(self, value: float, like: int) -> int:
        return self.scalar(value, like)

    def add(self, a: int, b: int) -> int:
        return self.op("add", a, b)

    def sub(self, a: int, b: int) -> int:
        return self.op("sub", a, b)

    def mul(self, a: int, b: int) -> int:
        return self.op("mul", a, b)

    def div(self, a: int, b: int) -> int:
        return self.op("div", a, b)

    def axpy(self, alpha: float, x: int, y: int) -> int:
        """y + alpha * x: torch's `y.add(x, alpha=alpha)`."""
        return self.add(y, self.mul(self.c(alpha, x), x))

    def at(self, g: Graph, name: str | None) -> "_Ops":
        """Sets the provenance of the nodes built next: scope `optimizer/<name>` and the
        parameter's source line for one parameter's update, `optimizer` for shared scalars."""
        self.scope = f"{SCOPE}/{name}" if name else SCOPE
        self.loc = g.loc(g.parameters[name]) if name else None
        return self


SCOPE = "optimizer"  # module path of the optimizer's nodes; per parameter `optimizer/<param>`


def _state(g: Graph, name: str, ttype: TensorType, o: "_Ops | None" = None) -> int:
    if name in g.parameters or name in g.states or name in g.inputs:
        raise ValueError(f"optimizer state {name!r} clashes with an existing graph entry of that name")
    return g.add_state(name, ttype, o.loc if o else None, scope=o.scope if o else SCOPE)


def _step_state(g: Graph) -> tuple[int, int]:
    """The scalar float32 `step` state (torch keeps it as a float32 tensor too) and step + 1;
    the state is made once, shared by whatever reads it (a schedule, Adam, SGD's dampening)."""
    if "step" in g.states:
        return g.states["step"], g.updates["step"]
    step = _state(g, "step", TensorType((), float32))
    o = _Ops(g, scope=SCOPE)
    new = o.add(step, o.c(1.0, step))
    g.set_update("step", new)
    return step, new


def apply_optimizer(graph: Graph, config: OptimizerConfig) -> Graph:
    """Replaces the `grad:<p>` outputs of `graph` by updates of the parameters and optimizer state."""
    if not isinstance(config, (SGD, Adam, AdamW)):
        raise TypeError(f"apply_optimizer: expected an SGD, Adam or AdamW config, got {type(config).__name__}")
    g = graph.copy()
    grads = {p: g.outputs[f"grad:{p}"] for p in g.parameters if f"grad:{p}" in g.outputs}
    stray = [k for k in g.outputs if k.startswith("grad:") and k[5:] not in g.parameters]
    if stray:
        raise ValueError(f"apply_optimizer: gradient outputs {stray} name no parameter")
    if not grads:
        raise ValueError(f"apply_optimizer: graph {g.name!r} has no 'grad:<param>' outputs; run autodiff.grad first")
    for p in list(grads):
        del g.outputs[f"grad:{p}"]
        if g.type(g.parameters[p]) != g.type(grads[p]):
            raise TypeError(f"apply_optimizer: gradient of {p!r} is {g.type(grads[p])}, parameter is {g.type(g.parameters[p])}")
        if _structural_zero(g, grads[p]):
            # The loss does not depend on p (autodiff gave a zeros constant): torch.optim skips a
            # parameter whose .grad is None, so no weight decay or moment update touches it.
            del grads[p]

    if isinstance(config, SGD):
        _sgd(g, config, grads)
    else:
        _adam(g, config, grads, decoupled=isinstance(config, AdamW))
    return g.verify()


def _structural_zero(g: Graph, n: int) -> bool:
    while g.op(n) == "broadcast_to":
        (n,) = g.operands(n)
    return g.op(n) == "constant" and not g.attrs(n)["value"].any()


def _scheduled(g: Graph, o: "_Ops", cfg: OptimizerConfig) -> tuple[int | None, int | None]:
    """The float64 learning rate (and, for a momentum-cycling OneCycle, momentum) of this step,
    from the step counter (steps done before this one, as torch's scheduler counts them); None
    without a schedule: the rate is then a constant."""
    if cfg.schedule is None:
        return None, None
    o.at(g, None)
    step, _ = _step_state(g)
    t = o.op("cast", step, dtype=float64)
    lr = cfg.schedule.build(o, t, cfg.lr)
    momentum = cfg.schedule.build_momentum(o, t) if lr_schedule.cycles_momentum(cfg.schedule) else None
    return lr, momentum


def _sgd(g: Graph, cfg: SGD, grads: dict[str, int]) -> None:
    o = _Ops(g, scope=SCOPE)
    lr64, momentum64 = _scheduled(g, o, cfg)
    rounded: dict[tuple[int, object], int] = {}

    def scalar(node64: int | None, value: float, like: int) -> int:
        """A hyperparameter as torch passes it to a float32 kernel: rounded once from a double."""
        if node64 is None:
            return o.c(value, like)
        key = (node64, g.type(like).dtype)
        if key not in rounded:
            rounded[key] = o.op("cast", node64, dtype=g.type(like).dtype)
        return rounded[key]

    neg_lr64 = o.op("neg", lr64) if lr64 is not None else None
    uses_momentum = cfg.momentum != 0 or momentum64 is not None
    first = None
    if uses_momentum and cfg.dampening != 0:
        # torch sets the buffer to the gradient itself on the first step (no dampening);
        # with dampening 0 the general formula gives exactly that from a zero buffer.
        step, _ = _step_state(g)
        first = o.op("eq", step, o.c(0.0, step))
    for name, grad in grads.items():
        p = g.parameters[name]
        o.at(g, name)
        d_p = grad
        if cfg.weight_decay != 0:
            d_p = o.axpy(cfg.weight_decay, p, d_p)
        if uses_momentum:
            buf = _state(g, f"{name}.momentum_buffer", g.type(p), o)
            new_buf = o.axpy(1 - cfg.dampening, d_p, o.mul(buf, scalar(momentum64, cfg.momentum, buf)))
            if first is not None:
                new_buf = o.op("where", first, d_p, new_buf)
            g.set_update(f"{name}.momentum_buffer", new_buf)
            if cfg.nesterov:  # grad.add(buf, alpha=momentum)
                d_p = o.add(d_p, o.mul(scalar(momentum64, cfg.momentum, new_buf), new_buf))
            else:
                d_p = new_buf
        g.set_update(name, o.add(p, o.mul(scalar(neg_lr64, -cfg.lr, d_p), d_p)))  # p.add_(d_p, alpha=-lr)


def _adam(g: Graph, cfg: Adam | AdamW, grads: dict[str, int], decoupled: bool) -> None:
    o = _Ops(g, scope=SCOPE)
    beta1, beta2 = cfg.betas
    lr64, _ = _scheduled(g, o, cfg)
    o.at(g, None)
    _, step = _step_state(g)
    # Scalars of the step, in float64 as torch computes them in Python:
    #   bias_correction1 = 1 - beta1 ** step;  step_size = lr / bias_correction1
    #   bias_correction2_sqrt = sqrt(1 - beta2 ** step)
    s64 = o.op("cast", step, dtype=float64)

    def one_minus_pow(beta: float) -> int:
        if beta == 0.0:
            return o.c(1.0, s64)
        return o.sub(o.c(1.0, s64), o.op("exp", o.mul(s64, o.c(math.log(beta), s64))))

    step_size = o.div(lr64 if lr64 is not None else o.c(cfg.lr, s64), one_minus_pow(beta1))
    bc2_sqrt = o.op("sqrt", one_minus_pow(beta2))
    scalars: dict[object, tuple[int, int]] = {}
    decay: dict[object, int] = {}  # AdamW's 1 - lr * weight_decay per dtype, with a scheduled rate

    for name, grad in grads.items():
        p = g.parameters[name]
        t = g.type(p)
        if t.dtype not in scalars:  # one rounding of the float64 scalars per parameter dtype
            o.at(g, None)
            neg_step = o.op("cast", o.op("neg", step_size), dtype=t.dtype)
            scalars[t.dtype] = (neg_step, o.op("cast", bc2_sqrt, dtype=t.dtype))
        neg_step_size, bc2 = scalars[t.dtype]
        o.at(g, name)
        if decoupled:
            if cfg.weight_decay != 0 and lr64 is None:
                p = o.mul(p, o.c(1 - cfg.lr * cfg.weight_decay, p))  # param.mul_(1 - lr * wd)
            elif cfg.weight_decay != 0:
                if t.dtype not in decay:
                    o.at(g, None)
                    decay[t.dtype] = o.op("cast", o.sub(o.c(1.0, lr64), o.mul(lr64, o.c(cfg.weight_decay, lr64))),
                                          dtype=t.dtype)
                    o.at(g, name)
                p = o.mul(p, decay[t.dtype])
        elif cfg.weight_decay != 0:
            grad = o.axpy(cfg.weight_decay, p, grad)  # grad.add(param, alpha=wd)
        m = _state(g, f"{name}.exp_avg", t, o)
        v = _state(g, f"{name}.exp_avg_sq", t, o)
        # exp_avg.lerp_(grad, 1 - beta1): torch uses m + w * (grad - m) for |w| < 0.5.
        w = 1 - beta1
        if abs(w) < 0.5:
            new_m = o.add(m, o.mul(o.c(w, m), o.sub(grad, m)))
        else:
            new_m = o.sub(grad, o.mul(o.sub(grad, m), o.c(1 - w, m)))
        # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        new_v = o.add(o.mul(v, o.c(beta2, v)), o.mul(o.mul(o.c(1 - beta2, grad), grad), grad))
        # denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        denom = o.add(o.div(o.op("sqrt", new_v), bc2), o.c(cfg.eps, new_v))
        # param.addcdiv_(exp_avg, denom, value=-step_size): p + (value * exp_avg) / denom
        new_p = o.add(p, o.div(o.mul(neg_step_size, new_m), denom))
        g.set_update(f"{name}.exp_avg", new_m)
        g.set_update(f"{name}.exp_avg_sq", new_v)
        g.set_update(name, new_p)


def initial_state(graph: Graph) -> dict[str, np.ndarray]:
    """Zeros for every state of `graph` (fresh optimizer state: step 0, empty buffers)."""
    return {name: np.zeros(graph.type(n).shape, dtype=graph.type(n).dtype.numpy) for name, n in graph.states.items()}
