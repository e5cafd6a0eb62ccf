"""The optimizer pass against torch.optim: 20 steps of each variant on a small model, parameters
(and optimizer state) within 1e-6 relative of PyTorch's after every step."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import torch_threads

from ember.frontends import nn, trace
from ember.ir import Graph, TensorType, run
from ember.passes.autodiff import grad
from ember.passes.optimizer import SGD, Adam, AdamW, apply_optimizer, initial_state
from ember.passes.simplify import simplify



@pytest.fixture(scope="module", autouse=True)
def _torch_threads():
    with torch_threads(2):  # this module's figures were measured with 2; restored after it
        yield
STEPS = 20
RTOL = 1e-6  # float32 parameters: relative to the largest element of each tensor


def _data(seed: int = 0):
    rng = np.random.default_rng(seed)
    xs = rng.normal(size=(STEPS, 16, 8)).astype(np.float32)
    ys = rng.integers(0, 4, size=(STEPS, 16))
    return xs, ys


def _models():
    nn.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    tmodel = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    with torch.no_grad():
        for name, p in tmodel.named_parameters():
            p.copy_(torch.from_numpy(dict(model.named_parameters())[name].data))
    return model, tmodel


def _torch_optimizer(cfg, params):
    if isinstance(cfg, SGD):
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, dampening=cfg.dampening,
                               nesterov=cfg.nesterov, weight_decay=cfg.weight_decay)
    cls = torch.optim.AdamW if isinstance(cfg, AdamW) else torch.optim.Adam
    return cls(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


CONFIGS = [
    pytest.param(SGD(lr=0.1), id="sgd"),
    pytest.param(SGD(lr=0.1, weight_decay=0.05), id="sgd-wd"),
    pytest.param(SGD(lr=0.1, momentum=0.9), id="sgd-momentum"),
    pytest.param(SGD(lr=0.1, momentum=0.9, nesterov=True), id="sgd-nesterov"),
    pytest.param(SGD(lr=0.1, momentum=0.9, dampening=0.3), id="sgd-dampening"),
    pytest.param(SGD(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.01), id="sgd-nesterov-wd"),
    pytest.param(Adam(lr=1e-2), id="adam"),
    pytest.param(Adam(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01), id="adam-wd"),
    pytest.param(AdamW(lr=1e-2), id="adamw"),
    pytest.param(AdamW(lr=1e-2, betas=(0.85, 0.995), weight_decay=0.1), id="adamw-wd"),
]


def _check_step(i: int, params: dict, states: dict, tnames: dict, topt, rtol: float) -> None:
    for name, tp in tnames.items():
        want = tp.detach().numpy()
        err = np.abs(params[name] - want).max() / np.abs(want).max()
        assert err <= rtol, f"step {i}: parameter {name} off by {err:.2e} relative"
        for key in ("momentum_buffer", "exp_avg", "exp_avg_sq"):
            if f"{name}.{key}" in states:
                tstate = topt.state[tp][key].numpy()
                serr = np.abs(states[f"{name}.{key}"] - tstate).max() / max(np.abs(tstate).max(), 1e-30)
                assert serr <= rtol, f"step {i}: {name}.{key} off by {serr:.2e} relative"
    if "step" in states:
        assert states["step"] == i + 1


def _torch_step(tmodel, topt, x, y) -> float:
    topt.zero_grad()
    loss = torch.nn.functional.cross_entropy(tmodel(torch.from_numpy(x)), torch.from_numpy(y))
    loss.backward()
    return loss.item()


@pytest.mark.parametrize("cfg", CONFIGS)
def test_trajectory_matches_torch_optim(cfg) -> None:
    """float32: the update graph fed PyTorch's own gradients each step, so that what is compared
    is the optimizer's arithmetic alone. (With ember's gradients, float32 gradients that differ
    from PyTorch's by ~4e-7 relative, summation order, accumulate through momentum to ~1e-6 in 20
    steps; the float64 test below covers that path, and the joint-graph gradients are compared in
    tests/frontends/test_compile.py.)"""
    model, tmodel = _models()
    xs, ys = _data()
    g = Graph("grads")
    for name, p in model.named_parameters():
        t = TensorType.of(p.data)
        g.add_parameter(name, t)
        g.set_output(f"grad:{name}", g.add_input(f"g.{name}", t))
    step = simplify(apply_optimizer(g, cfg))
    params = {k: p.data.copy() for k, p in model.named_parameters()}
    states = initial_state(step)
    topt = _torch_optimizer(cfg, tmodel.parameters())
    tnames = dict(tmodel.named_parameters())
    for i in range(STEPS):
        _torch_step(tmodel, topt, xs[i], ys[i])
        grads = {f"g.{k}": tp.grad.numpy().copy() for k, tp in tnames.items()}
        res = run(step, grads, params, states)
        params = {k: res.updates[k] for k in params}
        states = {k: res.updates[k] for k in states}
        topt.step()
        _check_step(i, params, states, tnames, topt, RTOL)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_trajectory_with_ember_gradients_float64(cfg) -> None:
    """The whole train graph (trace, autodiff, optimizer, simplify) in float64 against PyTorch
    in float64: ember's own gradients, 20 steps, parameters within 1e-12 relative."""
    model, tmodel = _models()
    for p in model.parameters():
        p.data = p.data.astype(np.float64)
    tmodel.double()
    loss_fn = nn.CrossEntropyLoss()
    xs, ys = _data()
    xs = xs.astype(np.float64)
    fwd = trace(lambda x, y: loss_fn(model(x), y), TensorType(xs[0].shape, "float64"), ys[0], modules={"": model})
    step = simplify(apply_optimizer(grad(fwd), cfg))
    params = {k: p.data.copy() for k, p in model.named_parameters()}
    states = initial_state(step)
    topt = _torch_optimizer(cfg, tmodel.parameters())
    tnames = dict(tmodel.named_parameters())
    for i in range(STEPS):
        res = run(step, {"x": xs[i], "y": ys[i]}, params, states)
        params = {k: res.updates[k] for k in params}
        states = {k: res.updates[k] for k in states}
        loss = _torch_step(tmodel, topt, xs[i], ys[i])
        topt.step()
        assert abs(float(res.outputs["loss"]) - loss) <= 1e-12 * abs(loss), f"loss at step {i}"
        _check_step(i, params, states, tnames, topt, 1e-12)


def _tiny() -> Graph:
    g = Graph()
    x = g.add_input("x", TensorType((3,)))
    w = g.add_parameter("w", TensorType((3,)))
    frozen = g.add_parameter("frozen", TensorType((3,)))
    g.set_output("out", g.add("sum", [g.add("mul", [g.add("mul", [x, w]), frozen])], axes=(0,)))
    return grad(g, wrt=["w"])


@pytest.mark.parametrize("cfg,states", [
    (SGD(lr=0.1), []),
    (SGD(lr=0.1, momentum=0.9), ["w.momentum_buffer"]),
    (SGD(lr=0.1, momentum=0.9, dampening=0.5), ["step", "w.momentum_buffer"]),
    (Adam(), ["step", "w.exp_avg", "w.exp_avg_sq"]),
    (AdamW(), ["step", "w.exp_avg", "w.exp_avg_sq"]),
])
def test_state_and_updates(cfg, states) -> None:
    g = apply_optimizer(_tiny(), cfg)
    assert sorted(g.states) == states
    assert list(g.outputs) == ["loss"]  # grad:w consumed
    assert set(g.updates) == {"w", *states}  # 'frozen' had no gradient output: not updated
    if "step" in g.states:
        assert g.type(g.states["step"]) == TensorType((), "float32")
    init = initial_state(g)
    assert sorted(init) == states
    for name, value in init.items():
        assert value.dtype == np.float32 and not value.any() and value.shape == g.type(g.states[name]).shape


def test_hyperparameters_are_constants_and_the_graph_is_pure() -> None:
    base = _tiny()
    text = str(base)
    g = apply_optimizer(base, Adam(lr=0.25))
    assert str(base) == text
    assert any(g.op(n) == "constant" and g.attrs(n)["value"].shape == () for n in g.g)
    assert not g.inputs.keys() - {"x"}


def test_requires_gradients() -> None:
    g = Graph()
    w = g.add_parameter("w", TensorType((3,)))
    g.set_output("out", g.add("sum", [w], axes=(0,)))
    with pytest.raises(ValueError, match="no 'grad:<param>' outputs"):
        apply_optimizer(g, SGD(lr=0.1))
    with pytest.raises(TypeError, match="expected an SGD, Adam or AdamW"):
        apply_optimizer(grad(g), "sgd")


@pytest.mark.parametrize("make,match", [
    (lambda: SGD(lr=-1.0), "Invalid learning rate"),
    (lambda: SGD(lr=0.1, momentum=-0.5), "Invalid momentum"),
    (lambda: SGD(lr=0.1, weight_decay=-1), "Invalid weight_decay"),
    (lambda: SGD(lr=0.1, nesterov=True), "Nesterov momentum requires a momentum and zero dampening"),
    (lambda: SGD(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), "Nesterov"),
    (lambda: Adam(lr=-1e-3), "Invalid learning rate"),
    (lambda: Adam(eps=-1.0), "Invalid epsilon"),
    (lambda: Adam(betas=(1.0, 0.999)), "Invalid beta parameter at index 0"),
    (lambda: AdamW(betas=(0.9, -0.1)), "Invalid beta parameter at index 1"),
    (lambda: AdamW(weight_decay=-0.1), "Invalid weight_decay"),
])
def test_validation_like_torch(make, match) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_parameter_without_influence_is_left_alone_like_torch() -> None:
    """torch.optim skips a parameter whose .grad is None (no weight decay, no state)."""
    g = Graph()
    x = g.add_input("x", TensorType((3,)))
    w = g.add_parameter("w", TensorType((3,)))
    g.add_parameter("unused", TensorType((3,)))
    g.set_output("out", g.add("sum", [g.add("mul", [x, w])], axes=(0,)))
    step = apply_optimizer(grad(g), AdamW(lr=0.1, weight_decay=0.5))
    assert set(step.updates) == {"w", "step", "w.exp_avg", "w.exp_avg_sq"}
    tw, tu = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    opt = torch.optim.AdamW([tw, tu], lr=0.1, weight_decay=0.5)
    (torch.arange(3.0) * tw).sum().backward()
    opt.step()
    res = run(step, {"x": np.arange(3, dtype=np.float32)}, {"w": np.ones(3, np.float32), "unused": np.ones(3, np.float32)},
              initial_state(step))
    np.testing.assert_allclose(res.updates["w"], tw.detach().numpy(), rtol=1e-6)
    assert (tu.detach().numpy() == 1).all() and tu not in opt.state
