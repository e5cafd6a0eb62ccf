"""CUDA reductions with few outputs split across blocks, whatever their innermost extent, without a GPU.

BatchNorm's statistics and backward sums over 5x5 planes (the speedrun net's second block) were
one block an output: 32 blocks for a 132-multiprocessor GPU, 52 us of a 505 us step on an H200.
The split kernels walk one flat counter, so a short innermost loop splits too. Here a normalisation
over (N, H, W) with 5x5 planes, planned for a small GPU (so a few splits suffice; each has the
elements of three blocks, REDUCTION_MIN_PER_BLOCK each), is split, and its
launches (the partial passes, the combine) run on the CPU through the kernels' own source
(cuda_emulator.py) and give the interpreter's statistics."""
from __future__ import annotations

import dataclasses

import numpy as np

import cuda_emulator
from ember.codegen import device
from models import plan_for
from test_multi_output_kernels import _inputs, _normalise

SMALL_GPU = dataclasses.replace(device.H200, multiprocessors=1)  # 8 blocks fill it: a few splits an output


def test_a_short_innermost_loop_is_split_and_its_launches_give_the_interpreters_sums(tmp_path):
    g = _normalise((400, 2, 5, 5), (0, 2, 3))  # 10000 elements an output
    with device.using(SMALL_GPU):
        sub, kernel = cuda_emulator.only_reduction(plan_for(g, "cuda"))
    parts = [ln for ln in kernel.launches if "_part" in ln.function]
    assert len(parts) == 2 and kernel.scratch_bytes > 0, kernel.launches  # two passes, then the combine
    assert all(ln.grid[1] == 3 for ln in parts)  # 2 outputs x 3 splits of 134 images
    inputs = {name: np.ascontiguousarray(v) for name, v in _inputs(sub).items()}
    cuda_emulator.check_against_interpreter(sub, kernel, inputs, tmp_path, "split", rtol=2e-5, atol=2e-5)
