"""Each simplification on a small graph: node counts before and after, and the interpreter's
outputs unchanged (bit for bit: every rewrite here is exact)."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from ember.ir import Graph, TensorType, float64, run
from ember.passes.simplify import algebraic, cse, dce, fold_constants, simplify

RNG = np.random.default_rng(0)
X = RNG.normal(size=(2, 3)).astype(np.float32)


def _graph() -> tuple[Graph, int]:
    g = Graph("t")
    return g, g.add_input("x", TensorType((2, 3)))


def _check(g: Graph, fn: Callable[[Graph], Graph], before: int, after: int, inputs: dict | None = None,
           params: dict | None = None) -> Graph:
    inputs = {"x": X} if inputs is None else inputs
    assert len(g) == before, str(g)
    text = str(g)
    out = fn(g)
    assert str(g) == text, "the pass changed its input graph"
    assert len(out) == after, str(out)
    want, got = run(g, inputs, params or {}), run(out, inputs, params or {})
    assert list(got.outputs) == list(want.outputs)
    for k in want.outputs:
        np.testing.assert_array_equal(got.outputs[k], want.outputs[k])
        assert got.outputs[k].dtype == want.outputs[k].dtype
    return out


def test_dce_removes_dead_nodes_and_keeps_the_signature() -> None:
    g, x = _graph()
    g.add_input("unused_input", TensorType((4,)))
    p = g.add_parameter("unused_param", TensorType((4,)))
    g.add("exp", [p])  # dead
    g.add("neg", [g.add("exp", [x])])  # dead chain
    g.set_output("out", g.add("relu", [x]))
    out = _check(g, dce, 7, 4, {"x": X, "unused_input": np.zeros(4, np.float32)},
                 {"unused_param": np.zeros(4, np.float32)})
    assert set(out.inputs) == {"x", "unused_input"} and set(out.parameters) == {"unused_param"}


def test_dce_keeps_updates() -> None:
    g, x = _graph()
    s = g.add_state("s", TensorType((2, 3)))
    g.set_update("s", g.add("add", [s, x]))
    g.set_output("out", g.add("relu", [x]))
    out = dce(g)
    assert len(out) == len(g) == 4 and out.count("add") == 1


def test_cse_merges_equal_nodes_and_constants() -> None:
    g, x = _graph()
    a = g.add("mul", [x, g.add_constant(np.float32(2))])
    b = g.add("mul", [x, g.add_constant(np.float32(2))])  # same constant value, separate node
    c = g.add("mul", [x, g.add_constant(np.float32(3))])  # different constant: kept
    g.set_output("out", g.add("add", [g.add("add", [a, b]), c]))
    g.set_output("again", b)
    out = _check(g, cse, 9, 7)
    assert out.outputs["again"] == out.operands(out.operands(out.outputs["out"])[0])[0]


def test_cse_distinguishes_attributes() -> None:
    g, x = _graph()
    g.set_output("a", g.add("sum", [x], axes=(0,)))
    g.set_output("b", g.add("sum", [x], axes=(1,)))
    g.set_output("c", g.add("sum", [x], axes=(1,)))
    _check(g, cse, 4, 3)


def test_fold_constants_small_results() -> None:
    g, x = _graph()
    c = g.add("exp", [g.add("add", [g.add_constant(np.float32(1)), g.add_constant(np.float32(2))])])
    g.set_output("out", g.add("mul", [x, c]))
    out = _check(g, fold_constants, 6, 3)
    (const,) = [n for n in out.g if out.op(n) == "constant"]
    assert out.attrs(const)["value"] == np.exp(np.float32(3))


def test_fold_constants_keeps_broadcasts_whatever_their_size() -> None:
    # a fold creates no constant larger than its operands: whether a broadcast over the batch
    # folds must not depend on the batch size (a step of another batch size is the same graph)
    g = Graph("t")
    x = g.add_input("x", TensorType((64, 100)))
    big = g.add("broadcast_to", [g.add_constant(np.float32(0.5))], shape=(64, 100))
    small = g.add("broadcast_to", [g.add_constant(np.float32(2))], shape=(4,))
    scaled = g.add("mul", [g.add_constant(np.arange(4, dtype=np.float32)), g.add_constant(np.float32(3))])
    g.set_output("out", g.add("mul", [x, big]))
    g.set_output("small", small)
    g.set_output("scaled", scaled)
    out = _check(g, fold_constants, 9, 7, {"x": RNG.normal(size=(64, 100)).astype(np.float32)})
    assert out.count("broadcast_to") == 2 and out.count("mul") == 1  # the scaled constant folded
    assert max(out.attrs(n)["value"].size for n in out.g if out.op(n) == "constant") == 4


def test_fold_constants_keeps_dtypes() -> None:
    g, x = _graph()
    c = g.add("cast", [g.add_constant(np.int64(3))], dtype="float32")
    g.set_output("out", g.add("add", [x, c]))
    out = _check(g, fold_constants, 4, 3)
    (const,) = [n for n in out.g if out.op(n) == "constant"]
    assert out.attrs(const)["value"].dtype == np.float32


@pytest.mark.parametrize("op,const,const_first", [
    ("mul", 1.0, False), ("mul", 1.0, True), ("add", 0.0, False), ("add", 0.0, True),
    ("sub", 0.0, False), ("div", 1.0, False),
])
def test_neutral_elements(op: str, const: float, const_first: bool) -> None:
    g, x = _graph()
    c = g.add_constant(np.float32(const))
    y = g.add(op, [c, x] if const_first else [x, c])
    g.set_output("out", g.add("relu", [y]))
    out = _check(g, algebraic, 4, 2)
    assert out.count(op) == 0


def test_neutral_element_through_broadcast_and_not_when_it_changes_the_shape() -> None:
    g, x = _graph()
    ones = g.add("broadcast_to", [g.add_constant(np.float32(1))], shape=(2, 3))
    zeros_wide = g.add("broadcast_to", [g.add_constant(np.float32(0))], shape=(4, 2, 3))
    g.set_output("out", g.add("mul", [x, ones]))
    g.set_output("wide", g.add("add", [x, zeros_wide]))  # result is (4,2,3), not x: kept
    out = _check(g, algebraic, 7, 4)
    assert out.count("mul") == 0 and out.count("add") == 1


def test_zero_minus_x_and_x_times_two_are_kept() -> None:
    g, x = _graph()
    g.set_output("a", g.add("sub", [g.add_constant(np.float32(0)), x]))
    g.set_output("b", g.add("mul", [x, g.add_constant(np.float32(2))]))
    _check(g, algebraic, 5, 5)


def test_double_negation() -> None:
    g, x = _graph()
    g.set_output("out", g.add("exp", [g.add("neg", [g.add("neg", [x])])]))
    out = _check(g, algebraic, 4, 2)
    assert out.count("neg") == 0


def test_reshape_of_reshape_and_identity_reshape() -> None:
    g, x = _graph()
    r = g.add("reshape", [g.add("reshape", [x], shape=(6,))], shape=(3, 2))
    g.set_output("out", r)
    g.set_output("same", g.add("exp", [g.add("reshape", [x], shape=(2, 3))]))
    out = _check(g, algebraic, 5, 3)
    assert out.count("reshape") == 1
    (r,) = [n for n in out.g if out.op(n) == "reshape"]
    assert out.operands(r) == [out.inputs["x"]] and out.type(r).shape == (3, 2)


def test_transpose_of_transpose_composed_and_identity_removed() -> None:
    g = Graph("t")
    x = g.add_input("x", TensorType((2, 3, 4)))
    t1 = g.add("transpose", [x], perm=(1, 2, 0))
    g.set_output("composed", g.add("transpose", [t1], perm=(0, 2, 1)))
    g.set_output("identity", g.add("exp", [g.add("transpose", [g.add("transpose", [x], perm=(2, 0, 1))], perm=(1, 2, 0))]))
    g.set_output("trivial", g.add("neg", [g.add("transpose", [x], perm=(0, 1, 2))]))
    xv = RNG.normal(size=(2, 3, 4)).astype(np.float32)
    out = _check(g, algebraic, 8, 4, {"x": xv})
    assert out.count("transpose") == 1
    (t,) = [n for n in out.g if out.op(n) == "transpose"]
    assert out.attrs(t)["perm"] == (1, 0, 2)


def test_noop_broadcast_and_cast() -> None:
    g, x = _graph()
    b = g.add("broadcast_to", [x], shape=(2, 3))
    c = g.add("cast", [b], dtype="float32")
    g.set_output("out", g.add("exp", [c]))
    g.set_output("real_cast", g.add("cast", [x], dtype=float64))
    out = _check(g, algebraic, 5, 3)
    assert out.count("broadcast_to") == 0 and out.count("cast") == 1


def test_simplify_reaches_a_fixed_point_across_passes() -> None:
    # Folding makes the 1, the identity then exposes a duplicate, which CSE merges; DCE cleans.
    g, x = _graph()
    one = g.add("sub", [g.add_constant(np.float32(3)), g.add_constant(np.float32(2))])
    a = g.add("exp", [g.add("mul", [x, one])])
    b = g.add("exp", [x])
    g.add("tanh", [x])  # dead
    g.set_output("out", g.add("add", [a, b]))
    out = _check(g, simplify, 9, 3)
    assert out.count("exp") == 1
    assert str(simplify(out)) == str(out)


def test_simplify_preserves_a_training_graph_exactly() -> None:
    from ember.frontends import nn, trace
    from ember.passes.autodiff import grad
    from ember.passes.optimizer import SGD, apply_optimizer

    nn.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))
    loss = nn.CrossEntropyLoss()
    x = RNG.normal(size=(4, 1, 6, 6)).astype(np.float32)
    y = np.array([0, 2, 1, 2])
    fwd = trace(lambda x, y: loss(model(x), y), x, y, modules={"": model})
    g = apply_optimizer(grad(fwd), SGD(lr=0.1, momentum=0.9))
    s = simplify(g)
    assert len(s) < len(g)
    params = {k: p.data for k, p in model.named_parameters()}
    states = {k: np.ones(g.type(n).shape, np.float32) for k, n in g.states.items()}
    want, got = run(g, {"x": x, "y": y}, params, states), run(s, {"x": x, "y": y}, params, states)
    for table in ("outputs", "updates"):
        for k, v in getattr(want, table).items():
            np.testing.assert_array_equal(getattr(got, table)[k], v, err_msg=k)


def test_transpose_of_matmul_becomes_matmul_of_transposes() -> None:
    # (A B^T)^T = B A^T: the weight-gradient orientation, with no transposed copy of the product.
    g = Graph("t")
    a = g.add_input("a", TensorType((3, 4)))
    b = g.add_input("b", TensorType((5, 4)))
    g.set_output("y", g.add("transpose", [g.add("matmul", [a, g.add("transpose", [b], perm=(1, 0))])], perm=(1, 0)))
    ints = {"a": RNG.integers(-4, 5, (3, 4)).astype(np.float32), "b": RNG.integers(-4, 5, (5, 4)).astype(np.float32)}
    out = _check(g, simplify, 5, 4, ints)  # small integers: both orders are exact
    (mm,) = [n for n in out.g if out.op(n) == "matmul"]
    lhs, rhs = out.operands(mm)
    assert lhs == out.inputs["b"] and out.op(rhs) == "transpose"
