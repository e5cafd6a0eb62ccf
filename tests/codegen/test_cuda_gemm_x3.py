"""The GEMM skeleton's 3xTF32 path (`x3`, family `gemm_x3`): float32 contractions on TF32 tensor
cores as three products of each operand's TF32 big and small parts. In the CPU emulation of its
own source (cuda_emulator.py, whose mma adds in double), every GEMM kind (convolution forward,
strided grad-input by phase, grad-weight with split-K and the bias row sum, a batched transposed
matmul, one on run-time sizes) gives the float64 reference of the *unrounded* operands to the
float32 kernels' tolerance, where one TF32 product (precision "tf32") misses it by far; the text
is its own, and the float32 and TF32 kernels' texts do not change with the flag's existence."""
from __future__ import annotations

import numpy as np
import pytest

import cuda_emulator
import cuda_refs
from ember.codegen import cuda_kernels as ck

rng = np.random.default_rng(11)

CONV = dict(N=3, C=6, H=9, W=9, O=12, KH=3, KW=3, stride=1, padding=(1, 1))
STRIDED = dict(N=2, C=6, H=10, W=10, O=16, KH=3, KW=3, stride=2, padding=(1, 1))
DEEP = dict(N=4, C=32, H=5, W=5, O=8, KH=3, KW=3, stride=1, padding=(1, 1))  # grad-weight K = 100, C*9 = 288

CASES = [
    ("conv_fwd", CONV, dict(bias=True, relu=True)),
    ("conv_gi", STRIDED, dict(relu_mask=True)),
    ("conv_gw", DEEP, dict(bias=True)),
    ("conv_gw", CONV, dict(bias=False)),
    ("matmul", dict(M=24, N=20, K=300, batch=2, trans_a=True, trans_b=False), {}),
    ("matmul", dict(M=33, N=17, K=45, batch=1, trans_a=False, trans_b=True, bias=True), {}),
]


def _render(kind: str, g: dict, extra: dict, name: str, **flags) -> ck.CudaKernel:
    if kind == "matmul":
        return ck.render_matmul(name, **g, **flags)
    if kind == "conv_fwd":
        return ck.render_conv2d_forward(name, **g, **extra, **flags)
    if kind == "conv_gi":
        return ck.render_conv2d_grad_input(name, **g, **extra, **flags)
    return ck.render_conv2d_grad_weight(name, **g, **extra, **flags)


def _errors(kernel: ck.CudaKernel, kind: str, g: dict, extra: dict, tmp_path, tag: str) -> tuple[float, float]:
    """(worst error over the float32 kernels' tolerance, worst error over the output's largest
    magnitude) against the float64 reference of the unrounded operands."""
    ins, refs, lengths = cuda_refs.make_case(kind, g, extra, rng)
    bufs = dict(ins, **{k: np.full(np.shape(v), np.nan, np.float32) for k, v in refs.items()})
    cuda_emulator.run(cuda_emulator.build([kernel], tmp_path, tag), 0, kernel, bufs)
    over_tol = relative = 0.0
    for role, want in refs.items():
        err = np.abs(bufs[role].reshape(np.shape(want)).astype(np.float64) - want)
        # the float32 kernels' tolerance (tests/codegen/test_cuda_gemm_runtime_batch.py)
        over_tol = max(over_tol, float(np.max(err / (1e-5 * np.abs(want) + 2e-6 * lengths[role] + 1e-6))))
        relative = max(relative, float(np.max(err) / np.max(np.abs(want))))
    return over_tol, relative


@pytest.mark.parametrize("kind,g,extra", CASES, ids=[f"{k}{i}" for i, (k, _, _) in enumerate(CASES)])
def test_three_tf32_products_keep_float32_accuracy_where_one_does_not(kind, g, extra, tmp_path):
    x3 = _render(kind, g, extra, "kx", x3=True)
    assert "split_tf32(" in x3.code and x3.code != _render(kind, g, extra, "kx", tf32=True).code
    over_tol, relative = _errors(x3, kind, g, extra, tmp_path, "x3")
    # float32 sums of up to 300 products of [-1, 1] values: ~1e-7 of the largest output
    assert over_tol <= 1.0 and relative < 2e-6, (over_tol, relative)
    _, one = _errors(_render(kind, g, extra, "k1", tf32=True), kind, g, extra, tmp_path, "x1")
    assert one > 20 * relative and one > 1e-4, (one, relative)  # TF32's 2^-11 per operand


def test_the_split_k_plans_and_run_time_sizes_of_3xtf32():
    """Every plan the family offers is a tensor-core plan (warp grid, k-tiles of 8) with its
    registers counted; split-K and run-time sizes render, and the flag refuses TF32 and bfloat16."""
    plans = ck.plan_candidates(4, 32 * 9, 6400, 1, a_kfast=True, b_kfast=True, x3=True)
    assert any(p.splits > 1 for p in plans)
    assert all(p.BK % 8 == 0 and ck.tf32_warp_grid(p.BM, p.BN, p.threads) for p in plans)
    one = ck.plan_candidates(4, 32 * 9, 6400, 1, a_kfast=True, b_kfast=True, tf32=True)
    assert len(plans) <= len(one)  # more registers: no tile that one TF32 product cannot run
    split = next(p for p in plans if p.splits > 1)
    k = ck.render_conv2d_grad_weight("kgw", **dict(DEEP, N=256), bias=True, plan=split, x3=True, runtime_batch=True)
    assert len(k.launches) == 2 and all(ln.scalars for ln in k.launches)
    with pytest.raises(ValueError, match="3xTF32"):
        ck.render_matmul("bad", M=8, N=8, K=8, trans_a=False, trans_b=False, tf32=True, x3=True)
    with pytest.raises(ValueError, match="3xTF32"):
        ck.render_matmul("bad", M=8, N=8, K=8, trans_a=False, trans_b=False, x3=True, bf16_roles=frozenset({"a"}))
