"""Long float32 sums of the CPU reduction kernels are as accurate as a pairwise (NumPy) sum.

A float32 sum walked as one chain of adds over a BatchNorm channel (N*H*W values: 73728 at
batch 512) loses about 20 roundings' worth (1.3e-6 relative on values of one sign); that made
speednet's CPU update 1.07x less accurate than PyTorch's against float64 (whose BatchNorm sums in
double). The kernels add float partials of bounded length into double totals
(`codegen/cpp.py: SUM_CHUNK`), so the error of a sum is a few roundings at most, whatever its
length or layout: the bound below is the one NumPy's pairwise sum meets on the contiguous case.
"""
from __future__ import annotations

import numpy as np
import pytest

from ember.ir import Graph, TensorType
from models import run_compiled

# |sum - exact| / sum(|x|): four float32 roundings (2**-24 each)
BOUND = 4 * 2.0 ** -24


def _relative_error(got: np.ndarray, x: np.ndarray, axes: tuple[int, ...]) -> float:
    exact = np.sum(x.astype(np.float64), axis=axes)
    return float(np.max(np.abs(got.astype(np.float64) - exact) / np.sum(np.abs(x.astype(np.float64)), axis=axes)))


@pytest.mark.parametrize("shape,axes", [
    ((512, 4, 12, 12), (0, 2, 3)),  # BatchNorm statistics: rows of 144 over a batch of 512
    ((2, 300_000), (1,)),           # one contiguous row, longer than a chunk
    ((160_000, 2), (0,)),           # a strided walk (a bias gradient over a long batch)
])
def test_long_float32_sums_stay_within_a_few_roundings(shape, axes):
    # values of one sign with a large mean: what a single float chain rounds worst
    x = (np.random.default_rng(0).random(shape, dtype=np.float32) + 1.0).astype(np.float32)
    g = Graph("long_sum")
    xi = g.add_input("x", TensorType(shape))
    g.set_output("sum", g.add("sum", [xi], axes=axes, keepdims=False))
    g.set_output("sum_sq", g.add("sum", [g.add("mul", [xi, xi])], axes=axes, keepdims=False))
    _, got = run_compiled(g, "cpu", {"x": x})
    assert _relative_error(got["sum"], x, axes) <= BOUND
    assert _relative_error(got["sum_sq"], x * x, axes) <= 2 * BOUND  # x*x itself rounds once
    if axes == (len(shape) - 1,):  # the yardstick: NumPy sums a contiguous row pairwise
        assert _relative_error(np.sum(x, axis=axes), x, axes) <= BOUND
