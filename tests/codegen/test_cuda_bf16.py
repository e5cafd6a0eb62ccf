"""The CUDA bfloat16 kernels on a GPU against the interpreter: every contraction kind (the GEMM
family's mma.sync m16n8k16 path) with its epilogues, on the cases and with the tolerance of the
CPU's (tests/codegen/test_cpp_bf16.py: one bfloat16 step where a float32 sum in another order lies
next to a rounding boundary, most elements bit for bit), and the generated kernels and pooling
exactly."""
from __future__ import annotations

import numpy as np
import pytest

import test_cpp_bf16 as cpu
from ember import ir

from models import run_compiled

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("case", cpu.CONVS, ids=[c[0] for c in cpu.CONVS])
@pytest.mark.parametrize("kind", ["conv2d", "conv2d_grad_input", "conv2d_grad_weight"])
def test_convolutions(case, kind):
    graph, inputs, reduction = cpu._conv_graph(case, kind, epilogue=kind != "conv2d_grad_weight")
    cpu._check(graph, inputs, "", reduction, device="cuda")


@pytest.mark.parametrize("case", cpu.MATMULS, ids=[c[0] for c in cpu.MATMULS])
def test_matmuls(case):
    graph, inputs, k = cpu.matmul_graph(case)
    cpu._check(graph, inputs, "", k, device="cuda")


def test_generated_kernels_and_pooling_round_as_the_interpreter():
    graph, inputs = cpu.pointwise_and_pooling_graph()
    want = ir.run(graph, inputs).outputs["out"]
    _, got = run_compiled(graph, "cuda", inputs)
    assert np.array_equal(got["out"], want)
