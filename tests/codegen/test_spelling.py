"""Completeness of the per-target spelling tables: every registered target that generates code
spells every elementwise op of the op table (and the extra keys the lowering asks for), and its
reduction template renders every reduction the fusion pass hands it."""
from __future__ import annotations

import importlib

import pytest

import ember.runtime
from ember.codegen.lowering import REDUCTIONS, SPELLED
from ember.ir import OPS, Graph, TensorType
from ember.passes import targets

EXTRA_KEYS = ("floordiv", "lowest")


def _generating_targets() -> list[targets.Target]:
    return [t for t in targets.all_targets() if t.language is not None]


def test_some_target_generates_code():
    assert "cpu" in [t.name for t in _generating_targets()]


@pytest.mark.parametrize("target", _generating_targets(), ids=lambda t: t.name)
def test_every_elementwise_op_has_a_spelling(target):
    spelling = importlib.import_module(f"ember.codegen.{target.language}").SPELLING
    missing = [op for op in SPELLED + list(EXTRA_KEYS) if op not in spelling.ops]
    assert not missing, f"target {target.name!r} ({target.language}) has no spelling for {missing}"
    assert set(SPELLED) >= {n for n, op in OPS.items() if op.kind == "elementwise"}


@pytest.mark.parametrize("target", _generating_targets(), ids=lambda t: t.name)
@pytest.mark.parametrize("op", REDUCTIONS)
def test_every_reduction_renders(target, op):
    codegen = importlib.import_module(f"ember.codegen.{target.language}")
    sub = Graph("r")
    x = sub.add_input("in0", TensorType((3, 5)))
    core = sub.add(op, [x], **({"axis": 1} if op == "argmax" else {"axes": (1,)}))
    sub.set_output("out", core)
    rendered = codegen.render_reduction("k_" + op, sub, core)
    code = getattr(rendered, "code", rendered)  # cuda returns its launches with the code
    assert "k_" + op in code
