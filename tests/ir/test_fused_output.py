"""Fused nodes with several outputs: each output but "out" is read through one `fused_output`
node; the verifier checks them against the kernel's subgraph, the interpreter evaluates them."""
from __future__ import annotations

import numpy as np
import pytest

from ember import ir
from ember.ir import KernelSpec, VerifyError, subgraph_of


def _two_output_kernel() -> tuple[ir.Graph, ir.Graph, int]:
    """x -> (sum(x, axis 1), max(x, axis 1) + 1) as one reduction kernel; returns (source, fused, kernel)."""
    src = ir.Graph("src")
    x = src.add_input("x", ir.TensorType((3, 5)))
    s = src.add("sum", [x], axes=(1,))
    m = src.add("add", [src.add("max", [x], axes=(1,)), src.add_constant(1.0, "float32")])
    src.set_output("s", s)
    src.set_output("m", m)
    members = {n for n in src.g if src.op(n) not in ("input",)}
    sub, outer = subgraph_of(src, members, [s, m], "k")
    assert list(sub.outputs) == ["out", "out1"]
    g = ir.Graph("fused")
    gx = g.add_input("x", ir.TensorType((3, 5)))
    k = g.add("fused", [gx], graph=sub, kernel=KernelSpec("reduction", core=sub.operands(sub.outputs["out"])[0],
                                                            outputs=("out", "out1")))
    g.set_output("s", k)
    g.set_output("m", g.add("fused_output", [k], output="out1", type=sub.type(sub.outputs["out1"])))
    return src, g, k


def test_the_interpreter_evaluates_every_output_of_a_kernel():
    src, g, _ = _two_output_kernel()
    g.verify(full=True)
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    want, got = ir.run(src, {"x": x}), ir.run(g, {"x": x})
    for k in ("s", "m"):
        np.testing.assert_array_equal(got.outputs[k], want.outputs[k])


def test_the_verifier_checks_each_further_output():
    _, g, k = _two_output_kernel()
    (proj,) = [u for u, _ in g.users(k) if g.op(u) == "fused_output"]
    g.g.nodes[proj]["attrs"] = {**g.attrs(proj), "output": "out7"}
    with pytest.raises(VerifyError, match="no extra output 'out7'"):
        g.verify(full=True)
    _, g, k = _two_output_kernel()
    (proj,) = [u for u, _ in g.users(k) if g.op(u) == "fused_output"]
    g.g.nodes[proj]["type"] = ir.TensorType((4,))
    with pytest.raises(VerifyError, match="type"):
        g.verify(full=True)
    _, g, k = _two_output_kernel()
    g.add("fused_output", [k], output="out1", type=ir.TensorType((3,)))
    with pytest.raises(VerifyError, match="already read"):
        g.verify(full=False)
    _, g, k = _two_output_kernel()
    (proj,) = [u for u, _ in g.users(k) if g.op(u) == "fused_output"]
    del g.outputs["m"]
    g.remove(proj)
    with pytest.raises(VerifyError, match="no fused_output node"):
        g.verify(full=False)


def test_fused_output_reads_a_kernel_and_not_its_own_value():
    _, g, k = _two_output_kernel()
    with pytest.raises(ir.ShapeError, match="own value"):
        g.add("fused_output", [k], output="out", type=ir.TensorType((3,)))
    x = g.inputs["x"]
    g.add("fused_output", [x], output="out1", type=ir.TensorType((3,)))
    with pytest.raises(VerifyError, match="not a fused node"):
        g.verify(full=False)
