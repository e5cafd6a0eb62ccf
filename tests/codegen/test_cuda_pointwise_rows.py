"""CUDA pointwise kernels with per-row operands (a normalisation's per-channel mean, variance, scale
and shift) take the rows form, without a GPU: rows of the trailing axes' elements, a thread computing
four consecutive elements of a row (the row's last thread fewer where four do not divide it) with
the per-row values (their loads, the square root and divisions of the variance) computed once for
them, not once an element. A kernel whose operands
all have the output's shape keeps one thread an element. Each runs on the CPU through its own
source (cuda_emulator.py) against the interpreter, rows of 196, 14 and 49 elements, and on
run-time sizes (the batch an argument)."""
from __future__ import annotations

import numpy as np
import pytest

import cuda_emulator
from ember.codegen import cuda_choices
from ember.codegen.cuda_kernels import CudaKernel
from ember.ir import Graph, TensorType
from models import plan_for

rng = np.random.default_rng(29)


def _normalize(shape: tuple[int, ...]) -> Graph:
    """BatchNorm's normalize (statistics given per channel) with its affine scale and shift and a ReLU."""
    g = Graph("normalize")
    x = g.add_input("x", TensorType(shape))
    per_channel = (1, shape[1]) + (1,) * (len(shape) - 2)
    mean, var, w, b = (g.add_input(k, TensorType(per_channel)) for k in ("mean", "var", "w", "b"))
    y = g.add("div", [g.add("sub", [x, mean]), g.add("sqrt", [g.add("add", [var, g.add_constant(1e-5, "float32")])])])
    g.set_output("y", g.add("relu", [g.add("add", [g.add("mul", [y, w]), b])]))
    return g


def _elementwise(shape: tuple[int, ...]) -> Graph:
    g = Graph("elementwise")
    x, z = g.add_input("x", TensorType(shape)), g.add_input("z", TensorType(shape))
    g.set_output("y", g.add("mul", [g.add("relu", [x]), z]))
    return g


def _pointwise_kernel(graph: Graph, runtime: bool = False) -> tuple[Graph, CudaKernel]:
    """(subgraph, kernel) of the one pointwise kernel of `graph` planned for CUDA, as the step renders
    it (`runtime`: on run-time sizes, as a step whose plans came from another batch size)."""
    return cuda_emulator.only_kernel(plan_for(graph, "cuda"), "pointwise",
                                     ("pointwise", cuda_choices.RUNTIME) if runtime else None)


@pytest.mark.parametrize("shape", [(3, 5, 14, 14), (2, 3, 2, 7), (4, 3, 7, 7)],
                         ids=["rows-of-196", "rows-of-14", "rows-of-49"])
def test_a_normalize_takes_rows_with_its_per_channel_values_hoisted(shape, tmp_path):
    sub, kernel = _pointwise_kernel(_normalize(shape))
    row = shape[2] * shape[3]
    assert f"rows of {row}, 4 of a row a thread" in kernel.code and ("break;" in kernel.code) == (row % 4 != 0)
    body = kernel.code.split("#pragma unroll", 1)
    assert "em_sqrt" in body[0] and "em_sqrt" not in body[1]  # once a row's values, before the loop
    (launch,) = kernel.launches
    threads = shape[0] * shape[1] * -(-row // 4)  # a thread four elements of a row
    assert launch.grid[0] * launch.block[0] >= threads > (launch.grid[0] - 1) * launch.block[0]
    inputs = {k: rng.standard_normal(sub.type(n).shape).astype(np.float32) for k, n in sub.inputs.items()}
    for k, n in sub.inputs.items():
        if sub.type(n).shape != sub.type(sub.outputs["out"]).shape:
            inputs[k] = np.abs(inputs[k]) + 0.5  # every per-channel operand positive (the variance among them)
    cuda_emulator.check_against_interpreter(sub, kernel, inputs, tmp_path, f"rows{row}", rtol=2e-6, atol=2e-6)


def test_the_rows_form_on_run_time_sizes_is_one_text_and_the_interpreters_values(tmp_path):
    texts = set()
    for batch in (3, 5):
        sub, kernel = _pointwise_kernel(_normalize((batch, 4, 6, 6)), runtime=True)
        texts.add(kernel.code)
        assert "rows of 36, 4 of a row a thread" in kernel.code and kernel.launches[0].scalars == (("int", batch),)
        inputs = {k: np.abs(rng.standard_normal(sub.type(n).shape)).astype(np.float32) + 0.5
                  for k, n in sub.inputs.items()}
        cuda_emulator.check_against_interpreter(sub, kernel, inputs, tmp_path, f"runtime{batch}", rtol=2e-6, atol=2e-6)
    assert len(texts) == 1


def test_operands_of_the_outputs_shape_alone_keep_one_thread_an_element(tmp_path):
    sub, kernel = _pointwise_kernel(_elementwise((3, 4, 5, 6)))
    assert "one thread each" in kernel.code and "rows of" not in kernel.code
    inputs = {k: rng.standard_normal(sub.type(n).shape).astype(np.float32) for k, n in sub.inputs.items()}
    cuda_emulator.check_against_interpreter(sub, kernel, inputs, tmp_path, "flat", rtol=0, atol=0)
