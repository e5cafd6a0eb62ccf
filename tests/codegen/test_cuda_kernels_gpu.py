"""The CUDA kernels (codegen/cuda_kernels.py) on a GPU against NumPy float64 references.

Every rendered kernel of ``cuda_cases.all_kernels()`` (MNIST CNN/MLP shapes at batch 64 and
1024, odd geometries with stride, padding and tails, the loss, SGD) is compiled into one CuPy
RawModule (NVRTC) and launched per its Launch list. Outputs and scratch are poisoned with NaN
first, so a kernel that leaves an element unwritten or reads scratch it did not write fails.

Tolerance, fp32 result against the float64 reference (inputs uniform in [-1, 1]):

    |got - ref| <= 1e-5 * |ref| + 1e-5 * sqrt(R)

where R is the length of the reduction behind each output (C*KH*KW for the forward conv, O*KH*KW
for grad-input, N*HO*WO for grad-weight and its bias, K for matmul, C for the loss): fp32
rounding error grows like sqrt(R) * 6e-8 * |term| for these random sums. Each kernel is also run
twice and the two results must be bit-identical (no atomics; split-K sums in a fixed order).
"""
from __future__ import annotations

import numpy as np
import pytest

import cuda_cases
import cuda_refs

CASES = cuda_cases.all_kernels()


@pytest.fixture(scope="module")
def gpu():
    cp = pytest.importorskip("cupy")
    try:
        mod = cuda_refs.compile_module(cp, [k.code for k, _ in CASES])
    except Exception as e:  # show NVRTC's log clearly
        pytest.fail(f"NVRTC could not compile the concatenated kernels: {e}")
    return cp, mod


def _run(cp, mod, kernel, ins, refs):
    bufs = {r: cp.asarray(a) for r, a in ins.items()}
    outs = {}
    for role, ref in refs.items():
        if role not in bufs:  # pure outputs: poison
            bufs[role] = cp.full(ref.shape, np.nan, dtype=cp.float32)
            outs[role] = bufs[role]
        else:  # in-place (SGD)
            outs[role] = bufs[role]
    scratch = cp.full(max(kernel.scratch_bytes // 4, 1), np.nan, dtype=cp.float32)
    cuda_refs.run_launches(cp, mod, kernel, bufs, scratch)
    cp.cuda.Device().synchronize()
    return {r: cp.asnumpy(b) for r, b in outs.items()}


@pytest.mark.cuda
@pytest.mark.parametrize("idx", range(len(CASES)), ids=[k.name for k, _ in CASES])
def test_kernel_matches_reference_and_is_deterministic(gpu, idx):
    cp, mod = gpu
    kernel, (kind, spec, extra) = CASES[idx]
    rng = np.random.default_rng(1234 + idx)
    ins, refs, red = cuda_refs.make_case(kind, spec, extra, rng)
    got1 = _run(cp, mod, kernel, ins, refs)
    got2 = _run(cp, mod, kernel, ins, refs)
    for role, ref in refs.items():
        g = got1[role].reshape(ref.shape) if got1[role].size == ref.size else got1[role]
        assert g.shape == ref.shape, (role, g.shape, ref.shape)
        R = red.get(role, 1)
        tol = 1e-5 * np.abs(ref) + 1e-5 * np.sqrt(R)
        err = np.abs(g.astype(np.float64) - ref)
        bad = ~(err <= tol)
        assert not bad.any(), (
            f"{kernel.name} role {role}: {bad.sum()} of {bad.size} elements out of tolerance; "
            f"worst |err| {np.nanmax(err) if np.isfinite(err).any() else 'nan'} at "
            f"{np.unravel_index(np.argmax(np.where(np.isnan(err), np.inf, err)), err.shape)}; "
            f"NaNs {int(np.isnan(g).sum())}; launches {kernel.launches}")
        assert np.array_equal(got1[role].view(np.uint32), got2[role].view(np.uint32)), \
            f"{kernel.name} role {role}: two runs differ bitwise"
