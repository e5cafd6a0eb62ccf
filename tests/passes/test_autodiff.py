"""VJP rules, table-driven (one row per differentiable op, as JAX's LAX_GRAD_OPS), checked
against float64 central differences and against torch.autograd on random shapes; plus the
structure of the joint graph (what is and is not differentiated, fan-out, outputs)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from conftest import torch_threads

from ember.ir import OPS, Graph, TensorType, float32, float64, run
from ember.passes.autodiff import VJP_RULES, grad, missing_rules



@pytest.fixture(scope="module", autouse=True)
def _torch_threads():
    with torch_threads(2):  # this module's figures were measured with 2; restored after it
        yield

Gen = Callable[[np.random.Generator], tuple[list[np.ndarray], dict]]


@dataclass
class Row:
    op: str
    gen: Gen  # rng -> (operand values, attrs); bool operands are constants, float ones parameters
    torch_fn: Callable[..., torch.Tensor]  # (attrs, *tensors) -> tensor


def _shape(rng, lo=1, hi=4, rank=None):
    rank = int(rng.integers(1, 4)) if rank is None else rank
    return tuple(int(d) for d in rng.integers(lo, hi + 1, size=rank))


def _away(rng, shape, lo=0.2, hi=1.5, signed=True):
    """Values with |v| in [lo, hi]: far from kinks (relu, abs) and poles (log, reciprocal)."""
    v = rng.uniform(lo, hi, size=shape)
    return v * rng.choice([-1.0, 1.0], size=shape) if signed else v


def _broadcast_pair(rng):
    out = _shape(rng, 2, 4)
    def operand():
        s = [d if rng.random() < 0.6 else 1 for d in out]
        return tuple(s[int(rng.integers(0, len(s) + 1)):]) if rng.random() < 0.3 else tuple(s)
    return operand(), operand()


def _unary(gen_values):
    return lambda rng: ([gen_values(rng, _shape(rng))], {})


def _binary(gen_values):
    def gen(rng):
        sa, sb = _broadcast_pair(rng)
        return [gen_values(rng, sa), gen_values(rng, sb)], {}
    return gen


def _distinct(rng, shape):
    # maximum/minimum/max: no ties, so the function is smooth at the sample point.
    return rng.permutation(int(np.prod(shape)) or 1)[: int(np.prod(shape))].reshape(shape) * 0.37 - 1.0


def _reduce_gen(rng):
    s = _shape(rng, 2, 4)
    axes = tuple(sorted(int(a) for a in rng.choice(len(s), size=int(rng.integers(1, len(s) + 1)), replace=False)))
    return [_distinct(rng, s)], {"axes": axes, "keepdims": bool(rng.integers(0, 2))}


def _reshape_gen(rng):
    s = _shape(rng, 1, 4)
    n = int(np.prod(s))
    return [rng.normal(size=s)], {"shape": (n,) if rng.random() < 0.5 else (1, n, 1)}


def _transpose_gen(rng):
    s = _shape(rng, 1, 4, rank=int(rng.integers(2, 5)))
    return [rng.normal(size=s)], {"perm": tuple(int(p) for p in rng.permutation(len(s)))}


def _broadcast_to_gen(rng):
    out = _shape(rng, 2, 4)
    src = tuple(d if rng.random() < 0.5 else 1 for d in out)[int(rng.integers(0, len(out))):]
    return [rng.normal(size=src)], {"shape": out}


def _where_gen(rng):
    sa, sb = _broadcast_pair(rng)
    cond = rng.random(np.broadcast_shapes(sa, sb)) < 0.5
    return [cond, rng.normal(size=sa), rng.normal(size=sb)], {}


def _matmul_gen(rng):
    m, k, n = (int(d) for d in rng.integers(1, 5, size=3))
    batch = [(), (2,), (3, 1)][int(rng.integers(0, 3))]
    bbatch = [(), (1,), (2,)][int(rng.integers(0, 3))] if batch != (3, 1) else (2,)
    return [rng.normal(size=batch + (m, k)), rng.normal(size=bbatch + (k, n))], {}


def _conv_setup(rng):
    n, c, o = int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.integers(1, 4))
    kh, kw = int(rng.integers(1, 4)), int(rng.integers(1, 4))
    stride = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
    padding = (int(rng.integers(0, 2)), int(rng.integers(0, 2)))
    h, w = int(rng.integers(kh + 1, 8)), int(rng.integers(kw + 1, 8))
    ho = (h + 2 * padding[0] - kh) // stride[0] + 1
    wo = (w + 2 * padding[1] - kw) // stride[1] + 1
    return (n, c, h, w), (o, c, kh, kw), (n, o, ho, wo), {"stride": stride, "padding": padding}


def _conv2d_gen(rng):
    xs, ws, _, at = _conv_setup(rng)
    return [rng.normal(size=xs), rng.normal(size=ws)], at


def _conv2d_gi_gen(rng):
    xs, ws, ys, at = _conv_setup(rng)
    return [rng.normal(size=ys), rng.normal(size=ws)], {**at, "input_shape": xs}


def _conv2d_gw_gen(rng):
    xs, ws, ys, at = _conv_setup(rng)
    return [rng.normal(size=xs), rng.normal(size=ys)], {**at, "weight_shape": ws}


def _torch_grad_input(at, dy, w):
    x0 = torch.zeros(at["input_shape"], dtype=dy.dtype, requires_grad=True)
    y = torch.nn.functional.conv2d(x0, w, stride=at["stride"], padding=at["padding"])
    return torch.autograd.grad(y, x0, dy, create_graph=True)[0]


def _torch_grad_weight(at, x, dy):
    w0 = torch.zeros(at["weight_shape"], dtype=x.dtype, requires_grad=True)
    y = torch.nn.functional.conv2d(x, w0, stride=at["stride"], padding=at["padding"])
    return torch.autograd.grad(y, w0, dy, create_graph=True)[0]


def _normal(rng, s):
    return rng.normal(size=s)


def _pos(rng, s):
    return _away(rng, s, signed=False)


ROWS = [
    Row("neg", _unary(_normal), lambda at, x: -x),
    Row("exp", _unary(_normal), lambda at, x: torch.exp(x)),
    Row("log", _unary(_pos), lambda at, x: torch.log(x)),
    Row("sqrt", _unary(_pos), lambda at, x: torch.sqrt(x)),
    Row("reciprocal", _unary(_away), lambda at, x: torch.reciprocal(x)),
    Row("relu", _unary(_away), lambda at, x: torch.relu(x)),
    Row("sigmoid", _unary(lambda rng, s: 3 * rng.normal(size=s)), lambda at, x: torch.sigmoid(x)),
    Row("tanh", _unary(_normal), lambda at, x: torch.tanh(x)),
    Row("abs", _unary(_away), lambda at, x: torch.abs(x)),
    Row("erf", _unary(_normal), lambda at, x: torch.erf(x)),
    Row("sin", _unary(_normal), lambda at, x: torch.sin(x)),
    Row("cos", _unary(_normal), lambda at, x: torch.cos(x)),
    Row("max_pool2d", lambda rng: ([_distinct(rng, (2, 2, 5, 6))], {"kernel": 3, "stride": 2, "padding": 1}),
        lambda at, x: torch.nn.functional.max_pool2d(x, 3, 2, 1)),
    Row("add", _binary(_normal), lambda at, a, b: a + b),
    Row("sub", _binary(_normal), lambda at, a, b: a - b),
    Row("mul", _binary(_normal), lambda at, a, b: a * b),
    Row("div", _binary(_away), lambda at, a, b: a / b),
    Row("maximum", _binary(lambda rng, s: rng.normal(size=s)), lambda at, a, b: torch.maximum(a, b)),
    Row("minimum", _binary(lambda rng, s: rng.normal(size=s)), lambda at, a, b: torch.minimum(a, b)),
    Row("where", _where_gen, lambda at, c, a, b: torch.where(c, a, b)),
    # The operand is float32: its cotangent is rounded to float32 by the cast back (the
    # interpreter's float64 mode keeps explicit casts), so torch sees the same f32 round trip.
    Row("cast", lambda rng: ([rng.normal(size=_shape(rng))], {"dtype": float64}),
        lambda at, x: x.to(torch.float32).to(torch.float64)),
    Row("sum", _reduce_gen, lambda at, x: torch.sum(x, dim=at["axes"], keepdim=at["keepdims"])),
    Row("max", _reduce_gen, lambda at, x: torch.amax(x, dim=at["axes"], keepdim=at["keepdims"])),
    Row("reshape", _reshape_gen, lambda at, x: x.reshape(at["shape"])),
    Row("transpose", _transpose_gen, lambda at, x: x.permute(at["perm"])),
    Row("broadcast_to", _broadcast_to_gen, lambda at, x: x.broadcast_to(at["shape"])),
    Row("matmul", _matmul_gen, lambda at, a, b: a @ b),
    Row("conv2d", _conv2d_gen, lambda at, x, w: torch.nn.functional.conv2d(x, w, stride=at["stride"], padding=at["padding"])),
    Row("conv2d_grad_input", _conv2d_gi_gen, _torch_grad_input),
    Row("conv2d_grad_weight", _conv2d_gw_gen, _torch_grad_weight),
    # A single process is a world of one rank, where all_reduce (sum or mean) is the identity;
    # tests/passes/test_collectives.py checks its VJP over simulated worlds of several ranks.
    Row("all_reduce", lambda rng: ([rng.normal(size=_shape(rng))], {"reduce": ("sum", "mean")[int(rng.integers(0, 2))]}),
        lambda at, x: x.clone()),
]
SEEDS = (0, 1, 2)
CASES = [pytest.param(row, seed, id=f"{row.op}-{seed}") for row in ROWS for seed in SEEDS]


def _case(row: Row, seed: int):
    """(forward graph with loss = sum(op(...) * ct), parameter values, ct value)."""
    rng = np.random.default_rng(1000 * seed + ROWS.index(row))
    values, attrs = row.gen(rng)
    values = [np.array(v) for v in values]  # rank-0 values come back as NumPy scalars
    g = Graph(f"vjp_{row.op}")
    nodes, params = [], {}
    for i, v in enumerate(values):
        if v.dtype == np.bool_:
            nodes.append(g.add_constant(v))
        else:
            nodes.append(g.add_parameter(f"p{i}", TensorType(v.shape, float32)))
            params[f"p{i}"] = v.astype(np.float64)
    out = g.add(row.op, nodes, **attrs)
    t = g.type(out)
    ct = g.add_input("ct", t)
    g.set_output("out", g.add("sum", [g.add("mul", [out, ct])], axes=tuple(range(t.rank))))
    return g, params, rng.normal(size=t.shape), values, attrs


def _loss64(g: Graph, params: dict, ct: np.ndarray) -> float:
    return float(run(g, {"ct": ct}, params, precision="float64").outputs["out"])


@pytest.mark.parametrize("row,seed", CASES)
def test_vjp_matches_central_differences(row: Row, seed: int) -> None:
    g, params, ct, _, _ = _case(row, seed)
    res = run(grad(g), {"ct": ct}, params, precision="float64").outputs
    h = 1e-6
    for name, value in params.items():
        numeric = np.zeros_like(value)
        for idx in np.ndindex(value.shape):
            plus, minus = value.copy(), value.copy()
            plus[idx] += h
            minus[idx] -= h
            numeric[idx] = (_loss64(g, {**params, name: plus}, ct) - _loss64(g, {**params, name: minus}, ct)) / (2 * h)
        np.testing.assert_allclose(res[f"grad:{name}"], numeric, rtol=1e-6, atol=1e-8,
                                   err_msg=f"{row.op}: gradient of operand {name}")


@pytest.mark.parametrize("row,seed", CASES)
def test_vjp_matches_torch_autograd(row: Row, seed: int) -> None:
    g, params, ct, values, attrs = _case(row, seed)
    res = run(grad(g), {"ct": ct}, params, precision="float64").outputs
    tensors = [torch.tensor(v) if v.dtype == np.bool_ else torch.tensor(v, dtype=torch.float64, requires_grad=True)
               for v in values]
    out = row.torch_fn(attrs, *tensors)
    (out * torch.tensor(ct)).sum().backward()
    for i, t in enumerate(tensors):
        if t.requires_grad:
            np.testing.assert_allclose(res[f"grad:p{i}"], t.grad.numpy(), rtol=1e-10, atol=1e-12,
                                       err_msg=f"{row.op}: gradient of operand {i} vs torch")


def test_every_differentiable_op_has_a_rule_and_a_row() -> None:
    assert missing_rules() == []
    assert set(VJP_RULES) <= set(OPS), "rules for ops the IR does not define"
    differentiable = {name for name, op in OPS.items() if op.differentiable}
    # max_pool2d_grad's rule refuses second-order gradients (test below) rather than having a row
    assert differentiable - {"max_pool2d_grad"} <= {row.op for row in ROWS}, "a differentiable op has no test row"


def test_second_order_through_max_pool_is_refused() -> None:
    g = Graph()
    p = g.add_parameter("p", TensorType((1, 1, 4, 4)))
    dy = g.add_input("dy", TensorType((1, 1, 2, 2)))
    dx = g.add("max_pool2d_grad", [p, dy], kernel=2, stride=2)
    g.set_output("out", g.add("sum", [g.add("mul", [dx, p])], axes=(0, 1, 2, 3)))
    with pytest.raises(NotImplementedError, match="second-order gradients through max pooling are not supported"):
        grad(g)


def test_missing_rule_is_reported(monkeypatch) -> None:
    monkeypatch.delitem(VJP_RULES, "tanh")
    assert missing_rules() == ["tanh"]
    g = Graph()
    p = g.add_parameter("p", TensorType((3,)))
    g.set_output("out", g.add("sum", [g.add("tanh", [p])], axes=(0,)))
    with pytest.raises(NotImplementedError, match="no VJP rule for op 'tanh'"):
        grad(g)


@pytest.mark.parametrize("op", ["maximum", "minimum"])
def test_ties_split_the_gradient_like_torch(op: str) -> None:
    a = np.array([1.0, 2.0, 3.0])
    b = np.array([1.0, 0.0, 3.0])
    g = Graph()
    pa, pb = g.add_parameter("a", TensorType((3,))), g.add_parameter("b", TensorType((3,)))
    g.set_output("out", g.add("sum", [g.add(op, [pa, pb])], axes=(0,)))
    res = run(grad(g), {}, {"a": a, "b": b}, precision="float64").outputs
    ta, tb = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    getattr(torch, op)(ta, tb).sum().backward()
    np.testing.assert_array_equal(res["grad:a"], ta.grad.numpy())
    np.testing.assert_array_equal(res["grad:b"], tb.grad.numpy())


@pytest.mark.parametrize("op", ["abs", "relu"])
def test_kinks_at_zero_have_torchs_gradient(op: str) -> None:
    """At exactly 0 (where the derivative is undefined) the VJP must pick PyTorch's value (0 for
    both abs and relu), in float32 and float64; the random tests above keep away from kinks."""
    x = np.array([-2.0, -0.0, 0.0, 1e-30, -1e-30, 3.0])
    weights = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    for precision, dtype in (("float32", torch.float32), ("float64", torch.float64)):
        g = Graph()
        p = g.add_parameter("x", TensorType((6,)))
        w = g.add_constant(weights.astype(np.float32))
        g.set_output("out", g.add("sum", [g.add("mul", [g.add(op, [p]), w])], axes=(0,)))
        res = run(grad(g), {}, {"x": x.astype(np.float32)}, precision=precision).outputs
        t = torch.tensor(x, dtype=dtype, requires_grad=True)
        (getattr(torch, op)(t) * torch.tensor(weights, dtype=dtype)).sum().backward()
        np.testing.assert_array_equal(res["grad:x"], t.grad.numpy().astype(res["grad:x"].dtype), err_msg=precision)


@pytest.mark.parametrize("op", ["maximum", "minimum"])
def test_ties_including_signed_zeros_match_torch(op: str) -> None:
    """Ties at 0, -0 and 0, and equal negative values, weighted so each side's share is visible."""
    a = np.array([0.0, -0.0, 0.0, -1.5, 2.0])
    b = np.array([0.0, 0.0, -0.0, -1.5, 2.0])
    g = Graph()
    pa, pb = g.add_parameter("a", TensorType((5,))), g.add_parameter("b", TensorType((5,)))
    w = g.add_constant(np.array([1.0, 2.0, 3.0, 4.0, 5.0], np.float32))
    g.set_output("out", g.add("sum", [g.add("mul", [g.add(op, [pa, pb]), w])], axes=(0,)))
    res = run(grad(g), {}, {"a": a, "b": b}, precision="float64").outputs
    ta, tb = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    (getattr(torch, op)(ta, tb) * torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], dtype=torch.float64)).sum().backward()
    np.testing.assert_array_equal(res["grad:a"], ta.grad.numpy())
    np.testing.assert_array_equal(res["grad:b"], tb.grad.numpy())


def test_max_ties_share_the_gradient_like_torch_amax() -> None:
    x = np.array([[1.0, 3.0, 3.0], [2.0, 0.0, 2.0]])
    g = Graph()
    p = g.add_parameter("x", TensorType((2, 3)))
    m = g.add("max", [p], axes=(1,))
    g.set_output("out", g.add("sum", [g.add("mul", [m, g.add_constant(np.array([1.0, 2.0], np.float32))])], axes=(0,)))
    res = run(grad(g), {}, {"x": x}, precision="float64").outputs
    t = torch.tensor(x, requires_grad=True)
    (torch.amax(t, dim=1) * torch.tensor([1.0, 2.0], dtype=torch.float64)).sum().backward()
    np.testing.assert_array_equal(res["grad:x"], t.grad.numpy())


# ---- structure of the joint graph ------------------------------------------------------------

def _conv_net() -> Graph:
    g = Graph("net")
    x = g.add_input("x", TensorType((2, 1, 6, 6)))
    labels = g.add_input("y", TensorType((2,), "int64"))
    w1 = g.add_parameter("w1", TensorType((3, 1, 3, 3)))
    w2 = g.add_parameter("w2", TensorType((4, 3, 3, 3)))
    unused = g.add_parameter("unused", TensorType((5,)))
    h = g.add("relu", [g.add("conv2d", [x, w1])])
    z = g.add("reshape", [g.add("conv2d", [h, w2])], shape=(2, 16))
    logits = g.add("reshape", [g.add("sum", [g.add("reshape", [z], shape=(2, 4, 4))], axes=(2,))], shape=(2, 4))
    onehot = g.add("one_hot", [labels], num_classes=4)
    loss = g.add("sum", [g.add("mul", [logits, onehot])], axes=(0, 1))
    g.set_output("logits", logits)
    g.set_output("out", loss)
    assert unused in g
    return g


def test_only_what_needs_gradients_is_differentiated() -> None:
    gg = grad(_conv_net())
    # The first conv's input is the image: its grad_input is never built; the second conv's is.
    assert gg.count("conv2d_grad_input") == 1
    assert gg.count("conv2d_grad_weight") == 2
    gi = next(n for n in gg.g if gg.op(n) == "conv2d_grad_input")
    assert gg.type(gi).shape == (2, 3, 4, 4)
    # Nothing flows towards the labels: one_hot's operand gets no cotangent.
    assert gg.count("one_hot") == 1


def test_outputs_loss_renamed_grads_in_parameter_order_and_zeros_for_unused() -> None:
    g = _conv_net()
    gg = grad(g)
    assert list(gg.outputs) == ["logits", "loss", "grad:w1", "grad:w2", "grad:unused"]
    assert gg.outputs["loss"] == g.outputs["out"]
    rng = np.random.default_rng(0)
    params = {"w1": rng.normal(size=(3, 1, 3, 3)), "w2": rng.normal(size=(4, 3, 3, 3)), "unused": rng.normal(size=5)}
    res = run(gg, {"x": rng.normal(size=(2, 1, 6, 6)), "y": np.array([1, 3])}, params).outputs
    np.testing.assert_array_equal(res["grad:unused"], np.zeros(5, np.float32))
    assert res["grad:unused"].dtype == np.float32
    assert list(grad(g, wrt=["w2"]).outputs) == ["logits", "loss", "grad:w2"]


def test_fan_out_accumulates_in_a_fixed_order() -> None:
    g = Graph()
    p = g.add_parameter("p", TensorType((3,)))
    a = g.add("mul", [p, p])  # p used twice by one node
    b = g.add("exp", [p])
    g.set_output("out", g.add("sum", [g.add("add", [a, b])], axes=(0,)))
    gg = grad(g)
    x = np.array([0.5, -1.0, 2.0])
    np.testing.assert_allclose(run(gg, {}, {"p": x}, precision="float64").outputs["grad:p"], 2 * x + np.exp(x), rtol=1e-12)
    assert str(grad(g)) == str(gg)  # deterministic construction


def test_grad_is_pure_and_checks_its_arguments() -> None:
    g = _conv_net()
    before = str(g)
    grad(g)
    assert str(g) == before
    with pytest.raises(TypeError, match="must be a float scalar"):
        grad(g, loss="logits")
    with pytest.raises(KeyError, match="no output 'nope'"):
        grad(g, loss="nope")
    with pytest.raises(KeyError, match="not a parameter"):
        grad(g, wrt=["x"])


def test_second_order_through_conv_grads() -> None:
    """grad of a graph that already holds conv2d_grad_* nodes (closure under differentiation)."""
    g = Graph()
    x = g.add_input("x", TensorType((1, 2, 5, 5)))
    w = g.add_parameter("w", TensorType((2, 2, 3, 3)))
    y = g.add("conv2d", [x, w], padding=1)
    g.set_output("out", g.add("sum", [g.add("mul", [y, y])], axes=(0, 1, 2, 3)))
    first = grad(g)
    gw = first.outputs.pop("grad:w")
    del first.outputs["loss"]
    # Second graph: the squared norm of the first gradient, differentiated again.
    first.set_output("gnorm", first.add("sum", [first.add("mul", [gw, gw])], axes=(0, 1, 2, 3)))
    second = grad(first, loss="gnorm")
    rng = np.random.default_rng(3)
    xv, wv = rng.normal(size=(1, 2, 5, 5)), rng.normal(size=(2, 2, 3, 3))
    tx, tw = torch.tensor(xv), torch.tensor(wv, requires_grad=True)
    ty = torch.nn.functional.conv2d(tx, tw, padding=1)
    (g1,) = torch.autograd.grad((ty * ty).sum(), tw, create_graph=True)
    (g1 * g1).sum().backward()
    res = run(second, {"x": xv}, {"w": wv}, precision="float64").outputs
    np.testing.assert_allclose(res["grad:w"], tw.grad.numpy(), rtol=1e-10)
