"""The CUDA kernels (codegen/cuda_kernels.py) on a GPU against NumPy float64 references.

Every rendered kernel of ``cuda_cases.all_kernels()`` (MNIST CNN/MLP shapes at batch 64 and
1024, odd geometries with stride, padding and tails, the loss, SGD) is checked by
``cuda_gpu_check.check_all`` (one CuPy RawModule per kernel, in a worker process that is
restarted after a kernel kills the CUDA context, so every case is reported). Outputs and
scratch are poisoned with NaN first, so a kernel that leaves an element unwritten or reads
scratch it did not write fails.

Tolerance, fp32 result against the float64 reference (inputs uniform in [-1, 1]):

    |got - ref| <= 1e-5 * |ref| + 1e-5 * sqrt(R)

where R is the length of the reduction behind each output (C*KH*KW for the forward conv, O*KH*KW
for grad-input, N*HO*WO for grad-weight and its bias, K for matmul, C for the loss): fp32
rounding error grows like sqrt(R) * 6e-8 * |term| for these random sums. Each kernel is also run
twice and the two results must be bit-identical (no atomics; split-K sums in a fixed order).
Each case prints one line (status, kernel, worst error, geometry, plan); the summary line last.
"""
from __future__ import annotations

import json
import os

import pytest

import cuda_cases

CASES = cuda_cases.all_kernels()


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("cupy")
    import cuda_gpu_check
    lines = []
    res = cuda_gpu_check.check_all(log=lambda s: (lines.append(s), print(s, flush=True)))
    path = os.environ.get("EMBER_CUDA_CHECK_JSON")
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
    return res


@pytest.mark.cuda
@pytest.mark.parametrize("idx", range(len(CASES)), ids=[k.name for k, _ in CASES])
def test_kernel_matches_reference_and_is_deterministic(results, idx):
    r = results[idx]
    assert r["kernel"] == CASES[idx][0].name
    assert r["status"] == "ok", json.dumps(r)[:3000]
