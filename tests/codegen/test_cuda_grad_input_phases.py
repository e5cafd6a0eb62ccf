"""Strided convolutions' CUDA grad-input by phase, without a GPU.

At stride S an output row h reads only the kernel rows kh with kh = (h + PH) mod S (mod S), so the
plain implicit GEMM (k over every O x KH x KW tap) multiplied zeros for 3 of every 4 taps of a 3x3
stride-2 layer, and paid a division and two remainders a load to find them (ResNet-8's two
stride-2 grad-inputs took 39-44 us each on an H200). The GEMM family now runs one GEMM per
phase, batched (`cuda_kernels.grad_input_gemm`): a phase's taps are a stride-1 correlation on its
sub-grid. Here odd geometries (strides 2, 3 and (2, 3); kernels smaller than the stride, so some
phases have no tap at all; sizes not multiples of the stride; split-K; the ReLU mask; TF32) run
in the CPU emulation of the kernel's own source (cuda_emulator.py) against a float64 reference."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import cuda_emulator
import cuda_refs
from ember.codegen import cuda_kernels as ck

rng = np.random.default_rng(11)

CASES = [
    dict(N=2, C=3, H=14, W=14, O=8, KH=3, KW=3, stride=2, padding=1),        # ResNet's downsampling 3x3
    dict(N=2, C=1, H=13, W=17, O=7, KH=3, KW=5, stride=2, padding=1),        # odd sizes, a 3x5 window
    dict(N=1, C=4, H=9, W=8, O=3, KH=4, KW=2, stride=(2, 3), padding=(2, 1)),
    dict(N=3, C=5, H=11, W=7, O=6, KH=1, KW=1, stride=2, padding=0),         # 1x1: three phases have no tap
    dict(N=2, C=2, H=10, W=11, O=4, KH=2, KW=2, stride=3, padding=0),        # a window smaller than the stride
    dict(N=1, C=3, H=9, W=9, O=5, KH=5, KW=5, stride=3, padding=2),
]


def _plan(g: dict, split: bool, tf32: bool) -> ck.GemmPlan:
    """The cost model's best plan, or that tile with the reduction split in two (these K are too
    short for the cost model to split)."""
    M, N, K, batch = ck.grad_input_gemm(*(g[k] for k in ("N", "C", "H", "W", "O", "KH", "KW", "stride", "padding")))
    best = ck.plan_candidates(M, N, K, batch, a_kfast=False, b_kfast=True, tf32=tf32)[0]
    if not split:
        return best
    bk = 8 if tf32 else 4
    return dataclasses.replace(best, BK=bk, splits=2, kchunk=ck.round_up(ck.ceil_div(K, 2), bk))


@pytest.mark.parametrize("split", [False, True], ids=["one-pass", "split-k"])
@pytest.mark.parametrize("g", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_a_strided_grad_input_by_phase_gives_the_reference(g, split, tmp_path):
    sh, sw = ck.pair(g["stride"], "stride")
    M, N, K, batch = ck.grad_input_gemm(*(g[k] for k in ("N", "C", "H", "W", "O", "KH", "KW", "stride", "padding")))
    assert batch == sh * sw and K == g["O"] * -(-g["KH"] // sh) * -(-g["KW"] // sw) < g["O"] * g["KH"] * g["KW"] + 1
    tf32 = split and g is CASES[0]  # one TF32 case: the tensor-core path reads the same loaders
    plan = _plan(g, split, tf32)
    kernel = ck.render_conv2d_grad_input("k", **g, relu_mask=True, plan=plan, tf32=tf32)
    assert kernel.launches[0].grid[2] == batch * plan.splits
    ins, _, lengths = cuda_refs.make_case("conv_gi", g, dict(relu_mask=True), rng)
    if tf32:
        ins = {k: cuda_emulator.tf32(v) if k in ("dy", "w") else v for k, v in ins.items()}
    want = cuda_refs.conv_grad_input_ref(ins["dy"], ins["w"], g, ins["mask_src"])
    bufs = dict(ins, out=np.full(want.shape, np.nan, np.float32))
    cuda_emulator.run(cuda_emulator.build([kernel], tmp_path, "phases"), 0, kernel, bufs)
    np.testing.assert_allclose(bufs["out"].reshape(want.shape), want, rtol=1e-5,
                               atol=2e-6 * lengths["out"] + 1e-6)


def test_a_thread_computes_its_masked_values_before_any_store():
    """The GEMM skeleton's one-pass stores: every value (the ReLU mask's reads) of a thread before
    its first store, so the reads are in flight together (gemm.j2's `epilogue_value` loop, then
    the `epilogue_store` loop)."""
    g = CASES[0]
    for tf32 in (False, True):
        code = ck.render_conv2d_grad_input("k", **g, relu_mask=True, plan=_plan(g, False, tf32), tf32=tf32).code
        main = code.split("epilogue_store(const Params& p", 1)[1]  # past the helpers' definitions
        assert main.count("epilogue_value(p,") == 1 and main.count("epilogue_store(p,") == 1
        assert main.index("epilogue_value(p,") < main.index("epilogue_store(p,")


def test_stride_one_keeps_the_plain_view():
    assert ck.grad_input_gemm(4, 3, 10, 10, 8, 3, 3, 1, 1) == (400, 3, 72, 1)
