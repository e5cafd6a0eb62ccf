"""passes/select.py: every kernel's spec gets the target's scratch size and, under tf32, the
contractions (only they) the tf32 flag; the pass copies, refuses a precision the target lacks,
and is deterministic."""
from __future__ import annotations

import pytest

from ember.ir.kernel import CONTRACTIONS
from ember.passes import targets
from ember.passes.fusion import fuse
from ember.passes.select import select_kernels

from models import cnn, train_graph


def _toy(precisions=frozenset({"float32", "tf32"})) -> targets.Target:
    # scratch as a function of the kernel alone, distinct per kernel shape
    return targets.Target("toy", "a test target", pipeline=lambda t: [],
                          kernel_scratch=lambda sub, spec: 64 * (len(sub.inputs) + len(spec.kind)),
                          precisions=frozenset(precisions))


def _fused(g):
    return [n for n in g.nodes() if g.op(n) == "fused"]


@pytest.mark.parametrize("precision", ["float32", "tf32"])
def test_every_kernel_gets_its_scratch_and_the_steps_precision(precision):
    g = fuse(train_graph(cnn(), (2, 1, 28, 28)))
    g.meta["precision"] = precision
    before = {n: g.attrs(n)["kernel"] for n in _fused(g)}
    out = select_kernels(g, _toy())
    assert {n: g.attrs(n)["kernel"] for n in _fused(g)} == before  # the input graph is not changed
    kinds = set()
    for n in _fused(out):
        spec, sub = out.attrs(n)["kernel"], out.attrs(n)["graph"]
        kinds.add(spec.kind)
        assert spec.scratch_bytes == 64 * (len(sub.inputs) + len(spec.kind))
        assert bool(spec.param("tf32")) == (precision == "tf32" and spec.kind in CONTRACTIONS), spec.kind
        assert spec.kind == before[n].kind and spec.epilogues == before[n].epilogues
    assert kinds & set(CONTRACTIONS) and kinds - set(CONTRACTIONS)


def test_select_is_deterministic_and_refuses_an_unknown_precision():
    g = fuse(train_graph(cnn(), (2, 1, 28, 28)))
    a, b = select_kernels(g, _toy()), select_kernels(g, _toy())
    assert [a.attrs(n)["kernel"] for n in _fused(a)] == [b.attrs(n)["kernel"] for n in _fused(b)]
    g.meta["precision"] = "tf32"
    with pytest.raises(ValueError, match="device 'toy' computes in float32, not precision 'tf32'"):
        select_kernels(g, _toy(precisions={"float32"}))
