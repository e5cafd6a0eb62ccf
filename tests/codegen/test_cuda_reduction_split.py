"""CUDA reductions with few outputs split across blocks, whatever their innermost extent, without a GPU.

BatchNorm's statistics and backward sums over 5x5 planes (the speedrun net's second block) were
one block an output: 32 blocks for a 132-multiprocessor GPU, 52 us of a 505 us step on an H200.
The split kernels walk one flat counter, so a short innermost loop splits too. Here a normalisation
over (N, H, W) with 5x5 planes, planned for a small GPU (so a few splits suffice; each has the
elements of three blocks, REDUCTION_MIN_PER_BLOCK each), is split, and its
launches (the two passes; the last block of each output adds its partials) run on the CPU through
the kernels' own source (cuda_emulator.py) and give the interpreter's statistics, twice over the
same counters, which each run leaves zero."""
from __future__ import annotations

import dataclasses

import numpy as np

import cuda_emulator
from ember.codegen import device
from ember.codegen.cuda_kernels import counter_words
from models import plan_for
from test_multi_output_kernels import _inputs, _normalise

SMALL_GPU = dataclasses.replace(device.H200, multiprocessors=1)  # 8 blocks fill it: a few splits an output


def test_a_short_innermost_loop_is_split_and_its_launches_give_the_interpreters_sums(tmp_path):
    g = _normalise((400, 2, 5, 5), (0, 2, 3))  # 10000 elements an output
    with device.using(SMALL_GPU):
        sub, kernel = cuda_emulator.only_reduction(plan_for(g, "cuda"))
    parts = [ln for ln in kernel.launches if "_part" in ln.function]
    assert len(parts) == len(kernel.launches) == 2 and kernel.scratch_bytes > 0, kernel.launches  # no combining launch
    assert all(ln.grid[1] == 3 for ln in parts)  # 2 outputs x 3 splits of 134 images
    (role,) = [r for r in parts[-1].args if counter_words(r) is not None]  # the last pass counts arrivals
    assert counter_words(role) == 2 and not any(counter_words(r) for r in parts[0].args)
    inputs = {name: np.ascontiguousarray(v) for name, v in _inputs(sub).items()}
    cuda_emulator.check_against_interpreter(sub, kernel, inputs, tmp_path, "split", rtol=2e-5, atol=2e-5)
    # the same counters twice: each run leaves them zero, so the second gives the same bits
    counters = np.zeros(2, np.uint32)
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
