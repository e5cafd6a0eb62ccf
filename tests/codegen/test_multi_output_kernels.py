"""Generated kernels with several outputs (cpu; cuda on a GPU, and its sources through nvcc here):
normalisation statistics as one reduction kernel of two passes, the normalisation as one
pointwise kernel (on the CPU looping over rows with the per-channel operands hoisted), several
independent updates in one kernel written in place; against the interpreter."""
from __future__ import annotations

import re
import tempfile
from pathlib import Path

import numpy as np
import pytest

from ember.ir import Graph, TensorType, run
from ember.passes.fusion import kernel_counts
from ember.passes.memory import check_plan
from ember.runtime import target
from models import compiled_targets, plan_for, run_compiled
from nvcc import assert_compiles, nvcc_or_skip

rng = np.random.default_rng(11)


@pytest.fixture(params=compiled_targets())
def device(request) -> str:
    return request.param


def _normalise(shape: tuple[int, ...], axes: tuple[int, ...]) -> Graph:
    """Batch- or layer-norm over `axes` with an affine per-kept-element scale and shift, a ReLU, and
    a running mean (momentum 0.1): the statistics, the running mean and the output."""
    g = Graph("norm")
    x = g.add_input("x", TensorType(shape))
    keep = tuple(1 if i in axes else d for i, d in enumerate(shape))
    w, b = g.add_input("w", TensorType(keep)), g.add_input("b", TensorType(keep))
    running = g.add_input("running", TensorType(keep))
    count = g.add_constant(float(np.prod([shape[a] for a in axes])), "float32")
    mean = g.add("div", [g.add("sum", [x], axes=axes, keepdims=True), count])
    centred = g.add("sub", [x, mean])
    var = g.add("div", [g.add("sum", [g.add("mul", [centred, centred])], axes=axes, keepdims=True), count])
    y = g.add("div", [centred, g.add("sqrt", [g.add("add", [var, g.add_constant(1e-5, "float32")])])])
    g.set_output("y", g.add("relu", [g.add("add", [g.add("mul", [y, w]), b])]))
    g.set_output("running", g.add("add", [g.add("mul", [running, g.add_constant(0.9, "float32")]),
                                          g.add("mul", [mean, g.add_constant(0.1, "float32")])]))
    g.set_output("var", var)
    return g


CASES = [((5, 3, 6, 7), (0, 2, 3)),      # batch norm, odd sizes: short rows (one block an output)
         ((6, 5, 9), (2,)),               # layer norm over the last axis: reduced extent 9 (a thread an output)
         ((37, 4, 16, 16), (0, 2, 3))]    # bias-gradient shaped: cuda splits the reduction across blocks


def _inputs(g: Graph) -> dict:
    return {k: rng.standard_normal(g.type(n).shape).astype(np.float32) + (2.0 if k == "x" else 0.0)
            for k, n in g.inputs.items()}


@pytest.mark.parametrize("shape,axes", CASES)
def test_normalisation_is_two_kernels_with_the_interpreters_values(shape, axes, device):
    g = _normalise(shape, axes)
    inputs = _inputs(g)
    want = run(g, inputs).outputs
    planned, got = run_compiled(g, device, inputs)
    check_plan(planned)
    assert kernel_counts(planned) == {"pointwise": 1, "reduction": 1}
    (stats,) = [n for n in planned.g if planned.op(n) == "fused" and planned.attrs(n)["kernel"].kind == "reduction"]
    assert len(planned.attrs(stats)["graph"].outputs) >= 3  # mean, variance, running mean
    n = float(np.prod([shape[a] for a in axes]))
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5 * np.sqrt(n), err_msg=k)


def test_cpu_pointwise_loads_per_channel_operands_once_a_row():
    g = _normalise((5, 3, 6, 7), (0, 2, 3))
    code = target("cpu").source(plan_for(g, "cpu"))
    # 630 elements, 15 rows of 42: the batch (5) is the kernel's argument n
    (kernel,) = re.findall(r"// ek_\w+: pointwise over n \* 126 elements, n \* 3 rows of 42\n.*?\n}\n",
                           code, re.S)
    per_row, per_element = kernel.split("for (int64_t j")
    # the mean, variance, scale and shift of the row's channel: read before the inner loop
    assert len(re.findall(r"in\d\[\(p % 3\)\]", per_row)) == 4
    assert "% 3" not in per_element and re.search(r"in\d\[(j \+ p \* 42|p \* 42 \+ j)\]", per_element)


def test_independent_counters_are_one_kernel_updating_in_place(device):
    g = Graph("counters")
    for name in ("a", "b", "c"):
        g.set_update(name, g.add("add", [g.add_state(name, TensorType((), "int64")), g.add_constant(1, "int64")]))
    x = g.add_input("x", TensorType((4,)))
    g.set_output("y", g.add("mul", [x, x]))
    planned = plan_for(g, device)
    (kernel,) = {planned.operands(n)[0] if planned.op(n) == "fused_output" else n for n in planned.updates.values()}
    assert len(planned.attrs(kernel)["graph"].outputs) == 3
    assert all(planned.notes(n)["storage"] == "state" for n in planned.updates.values())
    t = target(device)
    storage = t.storage()
    for name in ("a", "b", "c"):
        storage.add(name, np.array(10 * len(name) + ord(name), np.int64))
    step = t.executor(planned, storage)
    for _ in range(2):
        step({"x": np.ones(4, np.float32)})
    assert [int(np.asarray(storage.read(k) if hasattr(storage, "read") else storage[k])) for k in "abc"] == \
        [10 + ord(k) + 2 for k in "abc"]


def test_cuda_sources_of_multi_output_kernels_compile():
    nvcc = nvcc_or_skip()
    with tempfile.TemporaryDirectory() as tmp:
        for i, (shape, axes) in enumerate(CASES):
            src = Path(tmp) / f"norm{i}.cu"
            code = target("cuda").source(plan_for(_normalise(shape, axes), "cuda"))
            assert "red1" in code  # a later pass reading an earlier one's result
            src.write_text(code)
            assert_compiles(nvcc, src)
