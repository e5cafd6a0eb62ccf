"""Completeness of the op table: every op in ember.ir.ops.OPS has a type rule and attribute schema,
and every op that computes something has a NumPy reference implementation in the interpreter's
IMPLS. Sources (input, parameter, state, constant) are produced by `run` itself. A collective
(kind "collective") also owes a rule for the simulated world (`ember.ir.world.COLLECTIVES`), its
meaning over N ranks; `IMPLS` holds its single-process (world of one) meaning.

The checks are functions so that the test can also show that they catch a newly registered op
that someone forgot to give an interpreter rule.
"""
from __future__ import annotations

import inspect

import pytest

from ember.ir import IMPLS, OPS, Graph, ShapeError, TensorType
from ember.ir import interpreter, world
from ember.ir.ops import Attr, OpDef

KINDS = {"source", "elementwise", "reduction", "layout", "contraction", "index", "collective", "fused"}


def missing_shape_rules(ops: dict[str, OpDef]) -> list[str]:
    bad = []
    for name, op in ops.items():
        ok = (isinstance(op, OpDef) and op.name == name and callable(op.infer)
              and len(inspect.signature(op.infer).parameters) == 2 and op.kind in KINDS
              and all(isinstance(a, Attr) and callable(a.convert) for a in op.attrs.values())
              and (op.arity is None or op.arity >= 0))
        if not ok:
            bad.append(name)
    return sorted(bad)


def missing_impls(ops: dict[str, OpDef], impls: dict) -> list[str]:
    return sorted(n for n, op in ops.items()
                  if n not in interpreter.SOURCES and not callable(impls.get(n)))


def missing_world_rules(ops: dict[str, OpDef], collectives: dict) -> list[str]:
    return sorted(n for n, op in ops.items() if op.kind == "collective" and not callable(collectives.get(n)))


def test_every_collective_has_a_world_rule():
    assert not missing_world_rules(OPS, world.COLLECTIVES), \
        f"collectives the simulated world cannot run: {missing_world_rules(OPS, world.COLLECTIVES)}"
    assert {n for n, op in OPS.items() if op.kind == "collective"} == set(world.COLLECTIVES), \
        "world.COLLECTIVES rules for ops that are not collectives"
    assert "all_reduce" in world.COLLECTIVES


def test_checks_catch_a_collective_without_a_world_rule(monkeypatch):
    fake = OpDef("all_gather", 1, "collective", lambda types, attrs: types[0])
    monkeypatch.setitem(OPS, "all_gather", fake)
    monkeypatch.setitem(IMPLS, "all_gather", lambda a, at, t: a[0])
    assert missing_world_rules(OPS, world.COLLECTIVES) == ["all_gather"]
    assert missing_shape_rules(OPS) == [] and missing_impls(OPS, IMPLS) == []
    monkeypatch.delitem(IMPLS, "all_gather")
    assert missing_impls(OPS, IMPLS) == ["all_gather"]


def test_every_op_has_a_shape_rule():
    assert not missing_shape_rules(OPS), f"ops without a usable type rule: {missing_shape_rules(OPS)}"


def test_every_op_has_an_interpreter_rule():
    assert not missing_impls(OPS, IMPLS), f"ops the interpreter cannot run: {missing_impls(OPS, IMPLS)}"


def test_no_stray_interpreter_rules():
    assert set(IMPLS) <= set(OPS), f"IMPLS entries for unknown ops: {sorted(set(IMPLS) - set(OPS))}"


def test_sources_are_exactly_the_source_ops():
    assert set(interpreter.SOURCES) == {n for n, op in OPS.items() if op.kind == "source"}
    for n in interpreter.SOURCES:
        assert OPS[n].arity == 0


def test_issue_op_set_is_present():
    required = {"input", "parameter", "state", "constant",
                "neg", "exp", "log", "sqrt", "reciprocal", "relu", "sigmoid", "tanh", "abs",
                "add", "sub", "mul", "div", "maximum", "eq", "ne", "lt", "le", "gt", "ge",
                "where", "cast", "sum", "max", "reshape", "transpose", "broadcast_to", "matmul",
                "conv2d", "conv2d_grad_input", "conv2d_grad_weight", "one_hot"}
    assert required <= set(OPS), sorted(required - set(OPS))


def test_rule_runs_when_a_node_is_created():
    g = Graph()
    x = g.add_input("x", TensorType((2, 3)))
    with pytest.raises(ShapeError):
        g.add("matmul", [x, x])


def test_checks_catch_an_op_without_an_interpreter_rule(monkeypatch):
    fake = OpDef("frobnicate", 1, "elementwise", lambda types, attrs: types[0])
    monkeypatch.setitem(OPS, "frobnicate", fake)
    assert missing_impls(OPS, IMPLS) == ["frobnicate"]
    assert missing_shape_rules(OPS) == []
    # and running a graph that uses it fails loudly rather than silently
    g = Graph()
    x = g.add_input("x", TensorType((2,)))
    g.set_output("y", g.add("frobnicate", [x]))
    with pytest.raises(NotImplementedError, match="frobnicate"):
        interpreter.run(g, {"x": [1.0, 2.0]})


def test_checks_catch_an_op_without_a_shape_rule(monkeypatch):
    monkeypatch.setitem(OPS, "broken", OpDef("broken", 1, "elementwise", None))  # type: ignore[arg-type]
    monkeypatch.setitem(IMPLS, "broken", lambda a, at, t: a[0])
    assert missing_shape_rules(OPS) == ["broken"]
