"""Sums holding a centred term (passes/linear_sums.py): structure (which sums remain and what they
read), where the rule does not apply, and numerics (the interpreter before and after agree within
float32's rounding of the sums, and the rewritten graph is no further from float64 than the
original); BatchNorm's backward in bfloat16 becomes one reduction kernel like float32's."""
from __future__ import annotations

import numpy as np

from ember import ir
from ember.ir import Graph, TensorType, float64
from ember.passes.fusion import fuse
from ember.passes.linear_sums import distribute_sums
from ember.passes.targets import FusionCaps

SHAPE = (4, 3, 5, 5)
AXES = (0, 2, 3)


def _bn_backward_like(dtype=ir.float32) -> tuple[Graph, dict[str, int]]:
    """The mean gradient as autodiff writes it: sum(-(dy * invstd + 2 * c * (x - mean))), with
    invstd and c from other sums and the mean as `functional.mean` writes it."""
    g = Graph("t")
    t = TensorType(SHAPE, dtype)
    x, dy = g.add_input("x", t), g.add_input("dy", t)
    count = g.add_constant(np.array(SHAPE[0] * SHAPE[2] * SHAPE[3], dtype.numpy), dtype)
    mean = g.add("div", [g.add("sum", [x], axes=AXES, keepdims=True), count])
    xc = g.add("sub", [x, mean])
    var = g.add("div", [g.add("sum", [g.add("mul", [xc, xc])], axes=AXES, keepdims=True), count])
    invstd = g.add("reciprocal", [g.add("sqrt", [var])])
    c = g.add("div", [g.add("sum", [g.add("mul", [dy, xc])], axes=AXES, keepdims=True), count])
    two_c = g.add("broadcast_to", [g.add("mul", [c, g.add_constant(np.array(2.0, dtype.numpy), dtype)])], shape=SHAPE)
    e = g.add("add", [g.add("mul", [dy, invstd]), g.add("mul", [two_c, xc])])
    s = g.add("sum", [g.add("neg", [e])], axes=AXES, keepdims=False)
    g.outputs["dmean"] = s
    return g, {"x": x, "dy": dy, "xc": xc, "invstd": invstd}


def _inputs(dtype=np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {"x": rng.standard_normal(SHAPE).astype(dtype) * 2 + 1, "dy": rng.standard_normal(SHAPE).astype(dtype)}


def _new_sums(before: Graph, after: Graph) -> set[int]:
    """What the sums the pass added read."""
    return {after.operands(n)[0] for n in after.g if after.op(n) == "sum" and n not in before.g}


def test_the_mean_gradient_becomes_sums_of_dy_and_the_centred_input():
    g, named = _bn_backward_like()
    text = str(g)
    out = distribute_sums(g)
    assert str(g) == text, "the pass changed its input graph"
    # -invstd * sum(dy): the centred term (zero) dropped, invstd (from the variance's sum) outside;
    # nothing the output sums waits for another sum
    assert _new_sums(g, out) == {named["dy"]}
    assert out.op(out.outputs["dmean"]) != "sum" and out.outputs["dmean"] != g.outputs["dmean"]
    want, got = ir.run(g, _inputs()).outputs["dmean"], ir.run(out, _inputs()).outputs["dmean"]
    # float32: the dropped term is float32's rounding residue of a zero sum, the rest reordered
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * (np.abs(want).max() + 1.0))
    # and against float64 the rewritten graph is no further off than the original
    exact = ir.run(_bn_backward_like(float64)[0], _inputs(np.float64)).outputs["dmean"]
    assert np.abs(got - exact).max() <= np.abs(want - exact).max() + 1e-6


def test_in_float64_the_split_sums_agree_to_rounding():
    g, _ = _bn_backward_like(float64)
    out = distribute_sums(g)
    want = ir.run(g, _inputs(np.float64)).outputs["dmean"]
    got = ir.run(out, _inputs(np.float64)).outputs["dmean"]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-11 * (np.abs(want).max() + 1.0))


def test_sums_without_a_centred_term_are_left_alone():
    g = Graph("t")
    t = TensorType(SHAPE)
    a, b = g.add_input("a", t), g.add_input("b", t)
    w = g.add_parameter("w", TensorType((1, 3, 1, 1)))
    # a - b stays one term (no reordering of a difference's rounding where nothing is gained)
    g.outputs["diff"] = g.add("sum", [g.add("sub", [a, b])], axes=AXES, keepdims=False)
    # a parameter is not computed from a reduction: sum(a * w) waits for nothing
    g.outputs["scaled"] = g.add("sum", [g.add("mul", [a, w])], axes=AXES, keepdims=False)
    assert str(distribute_sums(g)) == str(g)


def test_batch_norm_backward_in_bfloat16_is_one_reduction_kernel():
    from ember.frontends import compile as ember_compile  # noqa: F401 (the package's frontends)
    from ember.frontends import functional as F
    from ember.frontends import nn, optim
    from ember.frontends.compile import plan

    class ConvBnRelu6(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 4, 3, 1, 1, bias=False)
            self.bn = nn.BatchNorm2d(4)
            self.fc = nn.Linear(4 * 8 * 8, 10)

        def forward(self, x):
            return self.fc(F.flatten(F.hardtanh(self.bn(self.conv(x)), 0.0, 6.0), 1))

    nn.manual_seed(0)
    x, y = np.zeros((6, 1, 8, 8), np.float32), np.zeros(6, np.int64)
    for precision in ("float32", "bf16"):
        graph = plan(ConvBnRelu6(), nn.CrossEntropyLoss(), optim.SGD(lr=0.1), (x, y), precision=precision)
        fused = graph["train-6x1x8x8"]
        backward_sums = [n for n in fused.g if fused.op(n) == "fused" and any(
            s.op(m) == "sum" and s.scope(m) == "bn" and s.is_backward(m)
            for s in [fused.attrs(n)["graph"]] for m in s.g)]
        # every sum of the backward pass (the mean gradient's too) in one multi-output kernel
        assert len(backward_sums) == 1, precision
