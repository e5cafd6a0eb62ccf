"""Short CUDA reductions over a contiguous last axis take several lanes of a warp an output, without a GPU.

One thread an output reads a row of its own (a warp's load touches 32 rows' cache lines) and
1024 outputs are only 4 blocks: ViT's LayerNorm statistics and gradients over 64 features took
17-26 us each alone on an H200. With 16 or 32 lanes an output, a row's elements are read side by
side and combined by a shuffle butterfly. Here a layer norm over a last axis of 50 (32 lanes,
a last block only partly used), a softmax's max and sum over 12 (16 lanes, two outputs a warp)
and a column sum (the reduced axis strided: one thread an output, as before) are planned for
CUDA, and their kernels run on the CPU through their own source (cuda_emulator.py) against the
interpreter."""
from __future__ import annotations

import numpy as np
import pytest

import cuda_emulator
from ember.ir import Graph, TensorType
from models import plan_for
from test_multi_output_kernels import _inputs, _normalise


def _softmax_stats(shape: tuple[int, ...]) -> Graph:
    g = Graph("softmax_stats")
    x = g.add_input("x", TensorType(shape))
    top = g.add("max", [x], axes=(len(shape) - 1,), keepdims=True)
    g.set_output("top", top)
    g.set_output("total", g.add("sum", [g.add("exp", [g.add("sub", [x, top])])], axes=(len(shape) - 1,), keepdims=True))
    return g


def _column_sums(shape: tuple[int, ...]) -> Graph:
    g = Graph("columns")
    x = g.add_input("x", TensorType(shape))
    g.set_output("s", g.add("sum", [g.add("mul", [x, x])], axes=(0,)))
    return g


@pytest.mark.parametrize("graph,lanes", [(_normalise((5, 7, 50), (2,)), 32),
                                         (_softmax_stats((9, 12)), 16),
                                         (_column_sums((40, 6)), 0)],
                         ids=["layer-norm-50", "softmax-12", "column-sums"])
def test_a_short_reduction_takes_lanes_by_layout_and_gives_the_interpreters_values(graph, lanes, tmp_path):
    sub, kernel = cuda_emulator.only_reduction(plan_for(graph, "cuda"))
    header = kernel.code.split("\n", 1)[0]
    assert (f"{lanes} lanes of a" in header) if lanes else "one thread an output" in header, header
    (launch,) = kernel.launches
    per_block = launch.block[0] // lanes if lanes else launch.block[0]
    outputs = int(np.prod(sub.type(next(iter(sub.outputs.values()))).shape))
    assert launch.grid[0] == -(-outputs // per_block) and not kernel.scratch_bytes
    inputs = {name: np.ascontiguousarray(v) for name, v in _inputs(sub).items()}
    cuda_emulator.check_against_interpreter(sub, kernel, inputs, tmp_path, "lanes", rtol=2e-6, atol=2e-6)
