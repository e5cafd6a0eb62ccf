"""CUDA pointwise kernels with per-row operands (a normalisation's per-channel mean, variance, scale
and shift) take the rows form, without a GPU: rows of the trailing axes' elements, a thread computing
four consecutive elements of a row (the row's last thread fewer where four do not divide it) with
the per-row values (their loads, the square root and divisions of the variance) computed once for
them, not once an element. Where 16 bytes of the narrowest value (4 float32, 8 bfloat16; at least
4) divide a row, a thread's consecutive elements are a vector's lanes: the inputs contiguous along
the row are read, every output written, in accesses of up to 16 bytes (airbench's BatchNorm and
GELU kernels read and wrote bfloat16 two bytes an access, 1.0-1.7 TB/s on an H100). A kernel whose
operands all have the output's shape takes vectors along rows of the batch where they divide
them, else one thread an element. Each runs on the CPU through its own source (cuda_emulator.py)
against the interpreter, rows of 196, 14 and 49 elements, and on run-time sizes (the batch an
argument)."""
from __future__ import annotations

import numpy as np
import pytest

import cuda_emulator
from ember.codegen import cuda_choices
from ember.codegen.cuda_kernels import CudaKernel
from ember.ir import Graph, TensorType
from ember.ir.dtypes import bfloat16
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
    vectors = row % 4 == 0  # 196: float4 lanes; 14 and 49 four scalar elements a thread
    assert f"rows of {row}, 4 of a row a thread" in kernel.code and ("break;" in kernel.code) == (row % 4 != 0)
    assert ("as\n// vectors" in kernel.code) == vectors
    if vectors:  # one vector load and store, the per-row values (one square root) before the lanes'
        assert kernel.code.count("em_sqrt") == 1 and kernel.code.count("reinterpret_cast") == 2
        assert kernel.code.index("em_sqrt") < kernel.code.index("reinterpret_cast<const float4*>")
    else:
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


@pytest.mark.parametrize("shape,vectors", [((3, 4, 5, 6), True), ((3, 5, 7, 7), False)], ids=["rows-of-120", "odd"])
def test_operands_of_the_outputs_shape_alone_take_vectors_along_the_batchs_rows_or_one_thread_an_element(
        shape, vectors, tmp_path):
    sub, kernel = _pointwise_kernel(_elementwise(shape))
    if vectors:
        assert "rows of 120, 4 of a row a thread as" in kernel.code and kernel.launches[0].scalars == (("int", 3),)
    else:
        assert "one thread each" in kernel.code and "rows of" not in kernel.code
    inputs = {k: rng.standard_normal(sub.type(n).shape).astype(np.float32) for k, n in sub.inputs.items()}
    cuda_emulator.check_against_interpreter(sub, kernel, inputs, tmp_path, "flat", rtol=0, atol=0)


@pytest.mark.parametrize("out", ["bfloat16", "float32"])
def test_bfloat16_values_take_eight_lanes_read_and_written_sixteen_bytes_an_access(out, tmp_path):
    """A GELU of a bfloat16 activation scaled per channel, stored in bfloat16 or float32: eight lanes
    a thread, the input one 16-byte load; a bfloat16 output one 16-byte store of packed pairs
    (rounded to nearest even, as the interpreter rounds), a float32 one two float4 stores; against
    the interpreter."""
    shape = (2, 3, 8, 8)
    g = Graph("gelu")
    x = g.add("cast", [g.add_input("x", TensorType(shape, bfloat16))], dtype="float32")
    y = g.add("mul", [x, g.add_input("w", TensorType((1, 3, 1, 1)))])
    gelu = g.add("mul", [g.add("mul", [y, g.add_constant(0.5, "float32")]),
                         g.add("add", [g.add_constant(1.0, "float32"),
                                       g.add("erf", [g.add("mul", [y, g.add_constant(0.7071067811865476, "float32")])])])])
    g.set_output("y", g.add("cast", [gelu], dtype="bfloat16") if out == "bfloat16" else gelu)
    sub, kernel = _pointwise_kernel(g)
    assert "rows of 64, 8 of a row a thread as" in kernel.code
    assert kernel.code.count("reinterpret_cast<const uint4*>") == 1
    if out == "bfloat16":
        assert kernel.code.count("make_uint4(em_bf16_pack2") == 1 and "make_float4(" not in kernel.code
    else:
        assert kernel.code.count("make_float4(") == 2 and "make_uint4" not in kernel.code
    inputs = {k: (rng.standard_normal(sub.type(n).shape) * 2).astype(np.float32) for k, n in sub.inputs.items()}
    cuda_emulator.check_against_interpreter(sub, kernel, inputs, tmp_path, "bf16", rtol=0, atol=0)


def test_a_boolean_output_keeps_the_scalar_forms():
    """A comparison's boolean result has no vector spelling: its kernel keeps one thread an element
    although four float32 lanes divide its rows (the float32 input alone would take vectors)."""
    g = Graph("mask")
    x = g.add_input("x", TensorType((3, 4, 5, 6)))
    g.set_output("mask", g.add("gt", [x, g.add_constant(0.0, "float32")]))
    sub, kernel = _pointwise_kernel(g)
    assert sub.type(sub.outputs["out"]).dtype.name == "bool"
    assert "one thread each" in kernel.code and "reinterpret_cast" not in kernel.code
