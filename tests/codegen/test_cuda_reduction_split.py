"""CUDA reductions with few outputs split across blocks, whatever their innermost extent, without a GPU.

BatchNorm's statistics and backward sums over 5x5 planes (the speedrun net's second block) were
one block an output: 32 blocks for a 132-multiprocessor GPU, 52 us of a 505 us step on an H200.
The split kernels walk one flat counter, so a short innermost loop splits too. Here a normalisation
over (N, H, W) with 5x5 planes, planned for a small GPU (so a few splits suffice; each has the
elements of three blocks, REDUCTION_MIN_PER_BLOCK each), is split, and its
launches run on the CPU through the kernels' own source (cuda_emulator.py) and give the
interpreter's statistics, twice over the same counters, which each run leaves zero.

A variance's two sums (the mean's, then the squared deviations from it) are one walk of the values:
Welford's running mean in each thread, Chan's formula where threads, then splits meet. BatchNorm's
statistics read each activation once instead of twice (airbench's took 133 us an activation of
100 MB on an H100 in two walks). A sum that is not such a pair still takes a pass of its own."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import cuda_emulator
from ember.codegen import device
from ember.codegen.cuda_kernels import counter_words
from ember.ir import Graph, TensorType
from ember.ir.dtypes import DType, bf16_bits, bfloat16, float32
from models import plan_for
from test_multi_output_kernels import _inputs, _normalise

SMALL_GPU = dataclasses.replace(device.H200, multiprocessors=1)  # 8 blocks fill it: a few splits an output


def _mean_deviations(shape: tuple[int, ...], axes: tuple[int, ...], relu: bool, dtype: DType = float32) -> Graph:
    """The mean of x over `axes` and the sum of relu(x - mean) (a second pass: no variance) or of
    (x - mean)^2 (the variance's pair); x of `dtype`, widened to float32 (as under autocast)."""
    g = Graph("deviations")
    x = g.add_input("x", TensorType(shape, dtype))
    if dtype != float32:
        x = g.add("cast", [x], dtype="float32")
    count = g.add_constant(float(np.prod([shape[a] for a in axes])), "float32")
    mean = g.add("div", [g.add("sum", [x], axes=axes, keepdims=True), count])
    centred = g.add("sub", [x, mean])
    spread = g.add("relu", [centred]) if relu else g.add("mul", [centred, centred])
    g.set_output("mean", mean)
    g.set_output("spread", g.add("sum", [spread], axes=axes, keepdims=True))
    return g


def _run_twice(sub, kernel, inputs, tmp_path) -> None:
    """Two runs over the same counters: each leaves them zero, so the second gives the same bits."""
    (role,) = [r for r in kernel.launches[-1].args if counter_words(r) is not None]
    counters = np.zeros(counter_words(role), np.uint32)
    lib = cuda_emulator.build([kernel], tmp_path, "again")
    runs = []
    for _ in range(2):
        bufs = dict(inputs, **{k: np.full(sub.type(n).shape, np.nan, np.float32) for k, n in sub.outputs.items()},
                    **{role: counters})
        cuda_emulator.run(lib, 0, kernel, bufs)
        assert not counters.any(), counters
        runs.append({k: bufs[k].copy() for k in sub.outputs})
    for k in sub.outputs:
        np.testing.assert_array_equal(runs[0][k], runs[1][k], err_msg=k)


def test_a_short_innermost_loop_is_split_and_its_launches_give_the_interpreters_sums(tmp_path):
    g = _normalise((400, 2, 5, 5), (0, 2, 3))  # 10000 elements an output
    with device.using(SMALL_GPU):
        sub, kernel = cuda_emulator.only_reduction(plan_for(g, "cuda"))
    # the mean's sum and the variance's squares in one launch, which counts arrivals: no combining launch
    (part,) = kernel.launches
    assert part.function.endswith("_part0") and kernel.scratch_bytes > 0 and "sum+m2" in kernel.code
    assert part.grid[1] == 3  # 2 outputs x 3 splits of 134 images
    (role,) = [r for r in part.args if counter_words(r) is not None]
    assert counter_words(role) == 2
    inputs = {name: np.ascontiguousarray(v) for name, v in _inputs(sub).items()}
    cuda_emulator.check_against_interpreter(sub, kernel, inputs, tmp_path, "split", rtol=2e-5, atol=2e-5)
    _run_twice(sub, kernel, inputs, tmp_path)


def test_a_sum_that_reads_an_earlier_result_and_is_no_variance_takes_a_second_pass(tmp_path):
    g = _mean_deviations((400, 2, 5, 5), (0, 2, 3), relu=True)
    with device.using(SMALL_GPU):
        sub, kernel = cuda_emulator.only_reduction(plan_for(g, "cuda"))
    parts = [ln for ln in kernel.launches if "_part" in ln.function]
    assert len(parts) == len(kernel.launches) == 2 and "m2" not in kernel.code, kernel.launches
    assert all(ln.grid[1] == 3 for ln in parts)
    (role,) = [r for r in parts[-1].args if counter_words(r) is not None]  # the last pass counts arrivals
    assert counter_words(role) == 2 and not any(counter_words(r) for r in parts[0].args)
    inputs = {"in0": (np.random.default_rng(3).standard_normal((400, 2, 5, 5)) + 2).astype(np.float32)}
    cuda_emulator.check_against_interpreter(sub, kernel, inputs, tmp_path, "two", rtol=2e-5, atol=2e-5 * 100)
    _run_twice(sub, kernel, inputs, tmp_path)


def test_more_splits_than_threads_are_added_by_the_last_block(tmp_path):
    """One output of 300 x 3072 elements on an H200 is 300 splits, more than a block's threads:
    the last block to arrive adds all 300 partials in split order and still gives the
    interpreter's sums."""
    g = _normalise((300, 1, 3072), (0, 2))
    with device.using(device.H200):
        sub, kernel = cuda_emulator.only_reduction(plan_for(g, "cuda"))
    assert all(ln.grid == (1, 300, 1) for ln in kernel.launches), kernel.launches
    inputs = {name: np.ascontiguousarray(v) for name, v in _inputs(sub).items()}
    cuda_emulator.check_against_interpreter(sub, kernel, inputs, tmp_path, "chunks", rtol=1e-5, atol=1e-5 * np.sqrt(300 * 3072))


@pytest.mark.parametrize("plane,dtype,lanes", [((7, 5), float32, 0), ((8, 6), float32, 4), ((8, 6), bfloat16, 8)],
                         ids=["one-a-step", "float32-vectors", "bfloat16-vectors"])
def test_a_variance_in_one_walk_is_as_close_to_float64_as_two_walks_far_from_zero(tmp_path, plane, dtype, lanes):
    """Values at 300 +- 0.05 (a mean thousands of standard deviations away; bfloat16's at 3): the squares'
    sum about zero would lose every digit of the variance in float32 (300^2 / 0.05^2 = 3.6e7 > 2^24; at 3,
    12 of 24 bits). Taken relative to
    the output's first value, Welford's running means and Chan's merges keep it within 1e-6 of
    float64 (NumPy's two walks in float32: 4-8e-7; one element a step here 9e-8). The images drift, so
    the splits' means differ, and the counts do (the last split is short, threads get one element or
    step more or less): a merge that took them equal, or dropped the spread between the means, is
    wrong here. Planes of 48 are walked in 16-byte vectors (4 float32 or 8 bfloat16 values a step,
    each step's own mean and squares merged into the thread's); bfloat16 values are exact in float32,
    so float64's statistics are of the rounded values."""
    shape = (333, 2, *plane)
    g = _mean_deviations(shape, (0, 2, 3), relu=False, dtype=dtype)
    with device.using(SMALL_GPU):
        sub, kernel = cuda_emulator.only_reduction(plan_for(g, "cuda"))
    (part,) = kernel.launches
    assert part.grid[1] > 1 and "sum+m2" in kernel.code
    assert (f"... {lanes} elements a step" in kernel.code) == bool(lanes)
    assert kernel.code.count("reinterpret_cast") == (1 if lanes else 0)  # one vector load a step
    rng = np.random.default_rng(5)
    # a drift over the images: the splits' means differ, so their merge must weigh them by their counts
    drift = 0.1 * np.arange(shape[0]).reshape(-1, 1, 1, 1) / shape[0]
    centre = 300 if dtype == float32 else 3  # bfloat16 keeps 8 bits: 0.05 of spread is 0.016 steps at 3
    x = (centre + drift + 0.05 * rng.standard_normal(shape)).astype(np.float32)
    if dtype == bfloat16:
        x, given = bf16_values_of(x), bf16_bits(x)
    else:
        given = x
    bufs = {"in0": given, "out": np.full((1, 2, 1, 1), np.nan, np.float32), "out1": np.full((1, 2, 1, 1), np.nan, np.float32)}
    (role,) = [r for r in part.args if counter_words(r) is not None]
    bufs[role] = np.zeros(2, np.uint32)
    cuda_emulator.run(cuda_emulator.build([kernel], tmp_path, "far"), 0, kernel, bufs)
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=(0, 2, 3), keepdims=True)
    m2 = ((x64 - mean) ** 2).sum(axis=(0, 2, 3), keepdims=True)
    (got_mean,), (got_m2,) = ([bufs[k] for k, n in sub.outputs.items() if sub.op(n) == op] for op in ("div", "sum"))
    np.testing.assert_allclose(got_mean, mean, rtol=1e-6)
    np.testing.assert_allclose(got_m2, m2, rtol=1e-6)


def bf16_values_of(x: np.ndarray) -> np.ndarray:
    from ember.ir.dtypes import bf16_values
    return bf16_values(bf16_bits(x))


def test_an_outlying_first_value_costs_neither_the_mean_nor_the_variance_its_precision(tmp_path):
    """The shift is the output's first value: here 3e4 among standard normal values (and then an
    infinity). The variance's values are taken relative to it, but the mean's sum stays a plain sum
    of the values: a sum of the shifted values with n times the shift added back lost the mean to
    rounding (an error of 1.8e-3 on a mean of 0.29; an infinite first value gave NaN, not inf)."""
    shape = (400, 2, 16, 16)
    g = _mean_deviations(shape, (0, 2, 3), relu=False)
    with device.using(SMALL_GPU):
        sub, kernel = cuda_emulator.only_reduction(plan_for(g, "cuda"))
    assert "sum+m2" in kernel.code and "... 4 elements a step" in kernel.code
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    x[0, :, 0, 0] = 3e4
    lib = cuda_emulator.build([kernel], tmp_path, "outlier")
    (mean_out,), (m2_out,) = ([k for k, n in sub.outputs.items() if sub.op(n) == op] for op in ("div", "sum"))
    for first in (3e4, np.inf):
        x[0, :, 0, 0] = first
        bufs = {"in0": x, **{k: np.full(sub.type(n).shape, np.nan, np.float32) for k, n in sub.outputs.items()}}
        cuda_emulator.run(lib, 0, kernel, bufs)
        x64 = x.astype(np.float64)
        mean = x64.mean(axis=(0, 2, 3), keepdims=True)
        if np.isinf(first):
            assert np.all(bufs[mean_out] == np.inf), bufs[mean_out]
            continue
        np.testing.assert_allclose(bufs[mean_out], mean, rtol=0, atol=1e-6)
        np.testing.assert_allclose(bufs[m2_out], ((x64 - mean) ** 2).sum(axis=(0, 2, 3), keepdims=True), rtol=1e-5)


def test_a_variance_computed_in_bfloat16_keeps_its_roundings_and_two_walks():
    """Deviations and squares the graph computes in bfloat16 are rounded at every element: one walk
    in float32 would skip those roundings, so such a pair is not found (float32 ones are)."""
    from ember.codegen.lowering import centered_squares
    for dtype, pairs in ((float32, 1), (bfloat16, 0)):
        g = Graph("narrow")
        x = g.add_input("x", TensorType((4, 3, 8), dtype))
        count = g.add_constant(32.0, dtype.name)
        centred = g.add("sub", [x, g.add("div", [g.add("sum", [x], axes=(0, 2), keepdims=True), count])])
        g.set_output("m2", g.add("sum", [g.add("mul", [centred, centred])], axes=(0, 2), keepdims=True))
        cores = [n for n in g.topo_order() if g.op(n) == "sum"]
        assert len(centered_squares(g, cores)) == pairs, dtype
