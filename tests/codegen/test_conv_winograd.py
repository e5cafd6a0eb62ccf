"""The Winograd F(2x2, 3x3) convolutions (codegen/conv_winograd.py: the CPU table's `winograd`
family) against the interpreter, for both vector variants whatever CPU runs this (as
test_conv_phase.py: avx2 built and run everywhere, avx512 built everywhere and run where the CPU
has AVX-512F, the 16-lane source also run emulated on AVX2).

Geometries: the zoo's 3x3 layers at a small batch, and random ones (seeded): odd and even planes
from 1x1 to 30 wide, padding 0-3 (past the kernel too, where the grad-input's correlation crops),
channel counts past a register tile; forward with bias and ReLU, grad-input with the ReLU mask.
Every geometry runs the cost model's plan, a few every plan the tuner measures. The kernels take
the images at run time, so each runs at its own batch, 1, 2 and 21 against the interpreter, with
scratch sized for that call and checked not to be written past. Tolerance as test_cpp_kernels
(fp32 against float64, rtol 1e-4, atol 1e-5 sqrt(R) scaled by the outputs' size). The results
are bit-identical for 1, 2 and 3 threads, and no less accurate than the direct kernels' on a
layer of the zoo's size.
"""
from __future__ import annotations

import ctypes
import dataclasses
import random

import numpy as np
import pytest

import test_conv_phase as tp
import test_cpp_kernels as base
import test_cpu_vector as tv
from ember.codegen import conv_winograd as cw
from ember.codegen import cpp_kernels as ck
from ember.codegen import cpu_vector as cv
from ember.codegen.compiler import compile_cpp
from ember.codegen.grouped_conv import ConvGeometry

KINDS = cw.KINDS


def _named(label: str, n, c, h, w, o, p) -> tuple[str, ConvGeometry]:
    ho, wo = h + 2 * p - 2, w + 2 * p - 2
    return label, ConvGeometry(n, c, h, w, o, 3, 3, 1, 1, p, p, ho, wo, 1)


def _geometry(rng: random.Random) -> ConvGeometry:
    ph, pw = rng.choice([0, 1, 1, 2, 3]), rng.choice([0, 1, 1, 2])
    h, w = rng.choice([1, 2, 3, 5, 7, 8, 14, 15]), rng.choice([1, 2, 4, 7, 11, 16, 30])
    h, w = max(h, 3 - 2 * ph), max(w, 3 - 2 * pw)
    c, o = rng.choice([1, 3, 8, 17, 33]), rng.choice([1, 5, 16, 19, 40])
    return ConvGeometry(rng.choice([1, 2, 3, 5]), c, h, w, o, 3, 3, 1, 1, ph, pw, h + 2 * ph - 2, w + 2 * pw - 2, 1)


GEOMETRIES = [
    _named("airbench_7x7", 2, 32, 7, 7, 24, 1),
    _named("airbench_14x14", 3, 16, 14, 14, 40, 1),
    _named("mnist_conv2", 2, 16, 26, 26, 32, 0),
    _named("resnet_28x28", 2, 16, 28, 28, 16, 1),
] + [(f"random{i}", _geometry(random.Random(f"winograd{i}"))) for i in range(10)]
TUNED = ("airbench_7x7", "random2")
TUNED_N = 48


def _plans(label: str, kind: str, g: ConvGeometry, isa: cv.VectorISA) -> list[cw.WinogradPlan]:
    if label in TUNED:
        return cw.plans(kind, dataclasses.replace(g, N=TUNED_N), isa, tune=True)
    return cw.plans(kind, g, isa)


def _runs(g: ConvGeometry) -> list[ConvGeometry]:
    return [dataclasses.replace(g, N=n) for n in dict.fromkeys((g.N, 1, 2, 21))]


def _kernels(variant: str) -> list[tuple]:
    return tp.kernels_of(variant, GEOMETRIES, KINDS, _plans, cw.render)


def _unit(kernels) -> str:
    return tp.unit_of(kernels, ("n",))   # the images: a run-time size


@pytest.fixture(scope="session")
def build(tmp_path_factory):
    """variant -> (kernels, {name: library}), compiled once per variant on first use."""
    cache, built = tmp_path_factory.mktemp("ember_winograd_cache"), {}

    def get(variant: str):
        if variant not in built:
            kernels = _kernels(variant)
            built[variant] = (kernels, tp.compiled(variant, kernels, _unit, cache, "winograd", 2,
                                                   scratch=cw.scratch_bytes, extents=lambda g: (g.N,)))
        return built[variant]
    return get


@pytest.mark.parametrize("variant", tv.VARIANTS)
@pytest.mark.parametrize("gi", range(len(GEOMETRIES)), ids=[label for label, _ in GEOMETRIES])
def test_winograd_kernels_match_the_interpreter(build, variant, gi):
    """Each compiled kernel of the geometry, at every run of `_runs`: one kernel for all of them."""
    tv._runnable(variant)
    kernels, libs = build(variant)
    g = GEOMETRIES[gi][1]
    assert tp.check_against_the_interpreter(kernels, libs, g, _runs(g), 1000 * gi) >= 2


@pytest.mark.parametrize("variant", tv.VARIANTS)
def test_bit_identical_across_threads(build, variant):
    """Tasks own whole output tiles (the grad-weight: its sums have the blocks' order): 1, 2 and 3
    threads give the same bits, at 7 images (several blocks)."""
    tv._runnable(variant)
    kernels, libs = build(variant)
    tp.check_threads(kernels, libs, [g for label, g in GEOMETRIES if label in ("airbench_14x14", "random4")],
                     at=lambda g: dataclasses.replace(g, N=7))


def test_the_family_serves_ungrouped_3x3_stride_1_convolutions_only():
    g = GEOMETRIES[0][1]
    assert all(cw.serves(kind, g) is None for kind in KINDS)
    assert "it serves convolutions" in cw.serves("matmul", g)
    for other in (dataclasses.replace(g, SH=2, SW=2), dataclasses.replace(g, KH=5, KW=5),
                  dataclasses.replace(g, G=2, O=24)):
        assert "ungrouped 3x3 convolutions at stride 1" in cw.serves("conv2d", other)
    with pytest.raises(ValueError, match="ungrouped 3x3"):
        cw.plans("conv2d", dataclasses.replace(g, KH=5, KW=5), cv.AVX2)


@pytest.mark.parametrize("lanes", [8, 16])
def test_the_grad_weights_register_transpose_is_a_transpose(lanes):
    """The shuffles the grad-weight template applies to a lanes x lanes square (rows i and i + h,
    __builtin_shuffle's two-source masks), played on NumPy rows, leave row r holding column r."""
    rows = [np.arange(lanes) + lanes * r for r in range(lanes)]
    for h, lo, hi in cw._transpose_stages(lanes):
        for i in range(lanes):
            if i & h:
                continue
            both = np.concatenate([rows[i], rows[i + h]])
            rows[i], rows[i + h] = both[lo], both[hi]
    square = np.arange(lanes * lanes).reshape(lanes, lanes)
    np.testing.assert_array_equal(np.stack(rows), square.T)


def test_plans_fit_the_register_file_and_refuse_what_does_not():
    g = GEOMETRIES[1][1]
    for isa in (cv.AVX2, cv.AVX512):
        for kind in KINDS:
            for plan in cw.plans(kind, dataclasses.replace(g, N=64), isa, tune=True):
                # every kind's tile: OB x VB accumulators, VB vector loads and a broadcast
                assert plan.OB * plan.VB + plan.VB + 1 <= isa.registers, plan
                assert cw.scratch_bytes(kind, g, plan, isa) > 0
    with pytest.raises(ValueError, match="vector registers"):
        cw.scratch_bytes("conv2d", g, cw.WinogradPlan(OB=16, VB=6, RB=1), cv.AVX2)
    with pytest.raises(ValueError, match="1 <= RB"):
        cw.scratch_bytes("conv2d", g, cw.WinogradPlan(OB=4, VB=2, RB=0), cv.AVX2)
    with pytest.raises(ValueError, match="no relu_mask epilogue"):
        cw.render("k", "conv2d", g, cw.plans("conv2d", g, cv.AVX2)[0], cv.AVX2, relu_mask=True)
    with pytest.raises(ValueError, match="no bias/relu epilogue"):
        cw.render("k", "conv2d_grad_weight", g, cw.plans("conv2d_grad_weight", g, cv.AVX2)[0], cv.AVX2, bias=True)


#: RMS error against float64 of the Winograd kernels over the direct ones', at most. The forward
#: and grad-input sum C (or O) products of transformed values, CK at a time, where the direct
#: kernels sum 9C in one chain: measured 0.77x and 0.61x (16 and 40 channels in). The grad-weight's 16 sums (chains of 16 tiles in float, then the chains,
#: then the blocks in double) are combined by G^T m G, whose cancellation alone, on exact sums,
#: leaves 1.0-1.1x of the direct kernel's error on this layer (a float32 simulation): measured
#: 1.73x (1.7x with the lane sums of before).
ERROR_BOUND = {"conv2d": 1.0, "conv2d_grad_input": 1.0, "conv2d_grad_weight": 2.0}


def test_winograd_is_as_accurate_as_the_direct_kernels(build, tmp_path):
    """On a layer of the zoo's proportions (16 channels in, 40 out, a 14x14 plane, 3 images) the
    Winograd kernels land as close to float64 as the direct kernels do (RMS over the outputs), the
    grad-weight within ERROR_BOUND."""
    variant = "avx2"
    tv._runnable(variant)
    kernels, libs = build(variant)
    _, g = GEOMETRIES[1]
    isa = tv._isa(variant)
    d = tp._data(g, 7)
    shape = dict(N=g.N, C=g.C, H=g.H, W=g.W, O=g.O, KH=3, KW=3, padding=(g.PH, g.PW), isa=isa)
    direct = {"conv2d": (ck.render_conv2d_forward("dfwd", bias=True, relu=True, **shape), ("x", "w", "bias")),
              "conv2d_grad_input": (ck.render_conv2d_grad_input("dgin", relu_mask=True, **shape), ("dy", "w", "mask")),
              "conv2d_grad_weight": (ck.render_conv2d_grad_weight("dgwt", bias=False, **shape), ("x", "dy", None))}
    src = ["#include <cstdint>\n#include <omp.h>"]
    for ks, _ in direct.values():
        src += [ks.code, f'extern "C" void call_{ks.name}(float* a, float* b, float* c, float* out, float* s, '
                         f'int64_t n) {{ {ks.name}(a, b, {"out, c" if ks.name == "dgwt" else "c, out"}, s, n); }}']
    dll = ctypes.CDLL(str(compile_cpp("\n".join(src) + "\n", flags=tv._flags(variant), cache=tmp_path,
                                      name="winograd_direct").path))
    ptr = lambda a: None if a is None else a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    for kind, (ks, args) in direct.items():
        want, _ = tp._reference(kind, g, d)
        out_direct = np.full(tp._out_shape(kind, g), np.nan, np.float32)
        fn = getattr(dll, f"call_{ks.name}")
        fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64]
        fn(*(ptr(d[a] if a else None) for a in args), ptr(out_direct), ptr(base._aligned(max(ks.scratch_bytes // 4, 1))),
           g.N)
        name = next(k[0] for k in kernels if k[2] is g and k[1] == kind)
        out_wino = np.full(tp._out_shape(kind, g), np.nan, np.float32)
        libs[name](name, dict(d, out=out_wino))
        rms = lambda a: float(np.sqrt(np.mean((a.astype(np.float64) - want) ** 2)))  # noqa: E731
        assert rms(out_wino) <= ERROR_BOUND[kind] * rms(out_direct), (kind, rms(out_wino), rms(out_direct))


@pytest.mark.parametrize("variant", ["avx2", "avx512"])
def test_nan_and_inf_give_the_direct_sums_non_finite_values(build, variant):
    """A NaN or an infinity in a block's inputs (or in the weights) makes Winograd's transforms add
    an infinity to its opposite and spread NaN over the tile; such a block (or, for the
    grad-weight, the whole call) is computed by the direct sums instead: NaN, +inf and -inf where
    the interpreter has them, the other values as close as ever."""
    tv._runnable(variant)
    kernels, libs = build(variant)
    label, g = GEOMETRIES[1]
    d = tp._data(g, 5)
    for key in ("x", "dy"):
        d[key][1, 0, 3, 2] = np.nan
        d[key][2, 1, 4, 3] = np.inf
        d[key][0, 2, 1, 1] = -np.inf
    weights = dict(d, x=tp._data(g, 5)["x"], w=d["w"].copy())
    weights["w"][3, 1, 1, 2] = np.inf
    for data in (d, weights):
        for name, kind, kg, plan, _, _ in kernels:
            if kg is not g or not name.endswith("_0"):
                continue
            with np.errstate(invalid="ignore", over="ignore"):
                want, terms = tp._reference(kind, g, data)
            out = np.full(tp._out_shape(kind, g), 7.0, np.float32)
            libs[name](name, dict(data, out=out))
            for test in (np.isnan, np.isposinf, np.isneginf):
                np.testing.assert_array_equal(test(out), test(want), err_msg=f"{name}: {test.__name__}")
            finite = np.isfinite(want)
            base.assert_close(out[finite], want[finite], terms)
