"""The CUDA `winograd`, `winograd4`, `winograd_x3` and `winograd_fused` families' kernels on a GPU against float64 references (what
test_cuda_winograd.py checks in the CPU emulation, here on the device): the three kinds with their
epilogues at small odd geometries and at airbench's 256-channel 14x14 layer (batch 8), output and
scratch poisoned with NaN, each run twice and bit-identical. Tolerance as test_cuda_kernels_gpu:
|got - ref| <= 1e-5 |ref| + 1e-5 sqrt(R), R the length of the sums behind an output."""
from __future__ import annotations

import math

import numpy as np
import pytest

import cuda_refs
from ember.codegen import cuda_winograd, cuda_winograd_fused

KIND = {"conv2d": "conv_fwd", "conv2d_grad_input": "conv_gi", "conv2d_grad_weight": "conv_gw"}
EXTRA = {"conv2d": dict(bias=True, relu=True), "conv2d_grad_input": dict(relu_mask=True),
         "conv2d_grad_weight": dict(bias=False)}


def _geometry(kind: str, N: int, C: int, H: int, W: int, O: int, p: int) -> dict:
    return dict(kind=kind, N=N, C=C, H=H, W=W, O=O, KH=3, KW=3, stride=(1, 1), padding=(p, p),
                HO=H + 2 * p - 2, WO=W + 2 * p - 2, tf32=False, epilogues=())


CASES = [(kind, sizes) for kind in KIND for sizes in ((2, 5, 7, 9, 6, 1), (3, 17, 8, 6, 20, 0), (8, 256, 14, 14, 256, 1))]


def _check_on_the_gpu(cp, g: dict, kernel, seed: int, what: str) -> None:
    """Runs `kernel` twice on random operands (output and scratch poisoned with NaN): every output
    within the bound of the float64 reference, and the two runs bit-identical."""
    kind = g["kind"]
    spec = {k: g[k] for k in ("N", "C", "H", "W", "O", "KH", "KW", "stride", "padding")}
    ins, refs, lengths = cuda_refs.make_case(KIND[kind], spec, EXTRA[kind], np.random.default_rng(seed))
    module = cuda_refs.compile_module(cp, [kernel.code])
    bufs = {k: cp.asarray(v) for k, v in ins.items()}
    got = []
    for _ in range(2):
        bufs["out"] = cp.full(np.shape(refs["out"]), np.nan, cp.float32)
        scratch = cp.full(max(kernel.scratch_bytes // 4, 1), np.nan, cp.float32)
        cuda_refs.run_launches(cp, module, kernel, bufs, scratch)
        got.append(cp.asnumpy(bufs["out"]))
    want = refs["out"]
    bound = 1e-5 * np.abs(want) + 1e-5 * math.sqrt(lengths["out"])
    err = np.abs(got[0] - want)
    assert np.all(err <= bound), f"{what}: worst {float(np.max(err - bound)):.3g} over the bound"
    assert got[0].tobytes() == got[1].tobytes(), "two runs differ"


@pytest.mark.cuda
@pytest.mark.parametrize("m,x3", ((2, False), (4, False), (2, True)), ids=("winograd", "winograd4", "winograd_x3"))
@pytest.mark.parametrize("kind,sizes", CASES, ids=[f"{k}_{s[1]}x{s[4]}_{s[2]}" for k, s in CASES])
def test_winograd_kernels_on_the_gpu(kind, sizes, m, x3):
    cp = pytest.importorskip("cupy")
    g = _geometry(kind, *sizes)
    plan = cuda_winograd.plans(g, m=m, x3=x3)[0]
    kernel = cuda_winograd.render("wk", g, plan, m=m, x3=x3, **{k: v for k, v in EXTRA[kind].items() if v})
    _check_on_the_gpu(cp, g, kernel, seed=3, what=f"{kind} {sizes}, plan {plan}")


FUSED_CASES = [(kind, sizes) for kind, sizes in CASES if kind != "conv2d_grad_weight"] + [
    ("conv2d", (16, 64, 28, 28, 64, 1)), ("conv2d_grad_input", (16, 64, 28, 28, 64, 1))]


@pytest.mark.cuda
@pytest.mark.parametrize("plan", cuda_winograd_fused.PLANS,
                         ids=lambda q: f"{q.BT}x{q.BCO}mb{q.min_blocks}{'p' if q.pipelined else ''}")
@pytest.mark.parametrize("kind,sizes", FUSED_CASES, ids=[f"{k}_{s[1]}x{s[4]}_{s[2]}" for k, s in FUSED_CASES])
def test_fused_winograd_kernels_on_the_gpu(kind, sizes, plan):
    """The fused family (`winograd_fused`), every blocking, at the same bound, bit-identical twice."""
    cp = pytest.importorskip("cupy")
    g = _geometry(kind, *sizes)
    kernel = cuda_winograd_fused.render("fk", g, plan, **{k: v for k, v in EXTRA[kind].items() if v})
    _check_on_the_gpu(cp, g, kernel, seed=5, what=f"{kind} {sizes}, plan {plan}")
