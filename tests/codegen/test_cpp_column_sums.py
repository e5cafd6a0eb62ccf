"""CPU column sums: a reduction over leading axes into contiguous outputs (a bias's or a
normalisation's parameter gradient over a [rows, features] activation) runs row by row with the
outputs vectorised (`reduction_columns.j2`), each output summed in row order (float partials of
64 rows, double totals), and gives the interpreter's values; below a vector of outputs, or with
a pass that reads an earlier one's results, the other form serves."""
from __future__ import annotations

import numpy as np
import pytest

from ember.codegen import cpp
from ember.ir import Graph, TensorType, run
from models import cpu_plan, run_compiled

rng = np.random.default_rng(5)


def _layer_norm_grads(shape: tuple[int, ...], axes: tuple[int, ...]) -> Graph:
    """dbias = sum(dy), dweight = sum(dy * (x - mean) / std) over `axes`, and an SGD step of
    each (the kernel LayerNorm's backward fuses): rows read per row, elements per element."""
    g = Graph("ln_grads")
    row_shape = tuple(d if i in axes else 1 for i, d in enumerate(shape))
    dy, x = g.add_input("dy", TensorType(shape)), g.add_input("x", TensorType(shape))
    mean, std = g.add_input("mean", TensorType(row_shape)), g.add_input("std", TensorType(row_shape))
    kept = tuple(d for i, d in enumerate(shape) if i not in axes)
    w, b = g.add_input("w", TensorType(kept)), g.add_input("b", TensorType(kept))
    lr = g.add_constant(-0.05, "float32")
    xhat = g.add("div", [g.add("sub", [x, mean]), std])
    g.set_output("w_new", g.add("add", [w, g.add("mul", [lr, g.add("sum", [g.add("mul", [dy, xhat])], axes=axes)])]))
    g.set_output("b_new", g.add("add", [b, g.add("mul", [lr, g.add("sum", [dy], axes=axes)])]))
    return g


def _reduction_code(planned) -> list[str]:
    return [cpp.render_reduction("k", planned.attrs(n)["graph"], planned.attrs(n)["kernel"].core)
            for n in planned.g if planned.op(n) == "fused" and planned.attrs(n)["kernel"].kind == "reduction"]


@pytest.mark.parametrize("shape,axes", [((37, 19), (0,)), ((64, 70), (0,)), ((5, 3, 130), (0, 1)), ((7, 16, 64), (0, 1))])
def test_column_sums_run_row_by_row_and_give_the_interpreters_values(shape, axes):
    g = _layer_norm_grads(shape, axes)
    inputs = {k: rng.standard_normal(g.type(n).shape).astype(np.float32) for k, n in g.inputs.items()}
    inputs["std"] = rng.uniform(0.5, 2.0, inputs["std"].shape).astype(np.float32)
    codes = _reduction_code(cpu_plan(g))
    assert codes and all("row by row" in c for c in codes), codes
    want = run(g, inputs).outputs
    _, got = run_compiled(g, "cpu", inputs)
    rows = int(np.prod([shape[a] for a in axes]))
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6 * np.sqrt(rows), err_msg=k)


def test_few_outputs_or_a_sum_over_the_last_axis_keep_the_other_form():
    for shape, axes in (((64, 8), (0,)), ((64, 70), (1,))):  # below a vector of outputs; a row's own sum
        codes = _reduction_code(cpu_plan(_layer_norm_grads(shape, axes)))
        assert codes and not any("row by row" in c for c in codes), (shape, axes)
