"""The phase-plane convolutions (codegen/conv_phase.py: the CPU table's `phase` family) against the
interpreter, for both vector variants whatever CPU runs this (as test_cpu_vector.py: avx2 built and
run everywhere, avx512 built everywhere and run where the CPU has AVX-512F, the 16-lane source
also run emulated on AVX2).

Random geometries (seeded): odd sizes, strides 1-3 (2 most often), padding 0-3 (past the kernel
too), kernels 1x1 to 5x5 and non-square, groups 1, 2, 3 and C (depthwise, channel multipliers
1 and 2), batches 1-5 (grad-weight: images in slots of one or more, stacked or not); each kind
with its epilogues (forward: bias and ReLU, grad-input: the ReLU mask). Every geometry runs the
cost model's plan; a few run every plan the tuner measures (planned for 48 images: grad-weight
plans that stack up to 3 images a pass). The kernels take the images and the groups at run time,
so each compiled kernel runs at several batch sizes: its own, 1, 2 (fewer images than a plan's
stack), 21 (more than the 16 image slots), and a grouped one with one group more, each against
the interpreter, its scratch sized for that call and checked not to be written past. Tolerance as
test_cpp_kernels (fp32 against float64, rtol 1e-4, atol 1e-5 sqrt(R) scaled by the outputs'
size). Within a variant the results are bit-identical for 1, 2 and 3 threads.
"""
from __future__ import annotations

import ctypes
import dataclasses
import random
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import test_cpp_kernels as base
import test_cpu_vector as tv
from ember.codegen import conv_phase as cp
from ember.codegen import cpu_vector as cv
from ember.codegen.compiler import compile_cpp
from ember.codegen.grouped_conv import ConvGeometry
from ember.ir import IMPLS, TensorType

KINDS = ("conv2d", "conv2d_grad_input", "conv2d_grad_weight")
_SHORT = {"conv2d": "fwd", "conv2d_grad_input": "gin", "conv2d_grad_weight": "gwt"}


def _geometry(rng: random.Random) -> ConvGeometry:
    kh, kw = rng.choice([1, 2, 3, 3, 5]), rng.choice([1, 3, 3, 4])
    sh = rng.choice([1, 2, 2, 3])
    sw = sh if rng.random() < 0.7 else rng.randint(1, 3)
    ph, pw = rng.choice([0, 1, 1, 2]), rng.choice([0, 1, 2, 3])
    h, w = max(rng.choice([5, 7, 9, 14, 15]), kh), max(rng.choice([4, 7, 11, 13, 28]), kw)
    c = rng.choice([1, 2, 3, 5, 6, 8])
    groups = rng.choice([1, 1, c, 2 if c % 2 == 0 else 1, 3 if c % 3 == 0 else c])
    o = groups * rng.choice([1, 1, 2, 3, 5] if groups > 1 else [1, 4, 7, 13, 17])
    n = rng.choice([1, 2, 3, 5, 17])
    ho, wo = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    return ConvGeometry(n, c, h, w, o, kh, kw, sh, sw, ph, pw, ho, wo, groups)


def _named(label: str, n, c, h, w, o, k, s, p, groups) -> tuple[str, ConvGeometry]:
    kh, kw = k if isinstance(k, tuple) else (k, k)
    ho, wo = (h + 2 * p - kh) // s + 1, (w + 2 * p - kw) // s + 1
    return label, ConvGeometry(n, c, h, w, o, kh, kw, s, s, p, p, ho, wo, groups)


# the zoo's layers at a small batch, then random ones
GEOMETRIES = [
    _named("resnet_3x3s2", 3, 16, 28, 28, 32, 3, 2, 1, 1),
    _named("resnet_1x1s2", 2, 32, 14, 14, 64, 1, 2, 0, 1),
    _named("depthwise_s1", 2, 32, 28, 28, 32, 3, 1, 1, 32),
    _named("depthwise_s2", 3, 24, 14, 14, 24, 3, 2, 1, 24),
    _named("depthwise_x2_s2", 2, 5, 13, 11, 10, 3, 2, 1, 5),
    _named("grouped_1x1", 2, 12, 9, 9, 8, 1, 1, 0, 4),
    _named("patch_7x7s7", 2, 1, 28, 28, 12, 7, 7, 0, 1),
] + [(f"random{i}", _geometry(random.Random(f"phase{i}"))) for i in range(12)]
#: geometries whose every tuning plan runs too, planned for this many images
TUNED = ("resnet_3x3s2", "depthwise_x2_s2", "random3")
TUNED_N = 48


def _plans(label: str, kind: str, g: ConvGeometry, isa: cv.VectorISA) -> list[cp.PhasePlan]:
    if label in TUNED:
        return cp.plans(kind, dataclasses.replace(g, N=TUNED_N), isa, tune=True)
    return cp.plans(kind, g, isa)


def _runs(g: ConvGeometry) -> list[ConvGeometry]:
    """The geometries one compiled kernel of `g` runs at: other batch sizes, and one group more."""
    out = [dataclasses.replace(g, N=n) for n in dict.fromkeys((g.N, 1, 2, 21))]
    if g.G > 1:
        G = g.G + 1
        out.append(dataclasses.replace(g, N=2, C=g.C // g.G * G, O=g.O // g.G * G, G=G))
    return out


def _epilogues(kind: str) -> dict[str, bool]:
    return {"conv2d": dict(bias=True, relu=True), "conv2d_grad_input": dict(relu_mask=True)}.get(kind, {})


def kernels_of(variant: str, geometries, kinds, plans, render) -> list[tuple]:
    """(name, kind, geometry, plan, source, roles) of every plan `plans(label, kind, g, isa)` of
    every geometry and kind, rendered by `render` with the kind's epilogues."""
    isa = tv._isa(variant)
    out = []
    for gi, (label, g) in enumerate(geometries):
        for kind in kinds:
            for pi, plan in enumerate(plans(label, kind, g, isa)):
                name = f"{_SHORT[kind]}_{gi}_{pi}"
                ks, order = render(name, kind, g, plan, isa, **_epilogues(kind))
                out.append((name, kind, g, plan, ks, order))
    return out


def unit_of(kernels, extents: tuple[str, ...]) -> str:
    """A translation unit of `kernels`, each called as `call_<name>(roles..., extents...)`."""
    parts = ["#include <cstdint>\n#include <omp.h>"]
    for name, _, _, _, ks, order in kernels:
        assert len(ks.extents) == len(extents)   # the run-time sizes
        params = ", ".join([f"float* a{i}" for i in range(len(order))] + [f"int64_t {e}" for e in extents])
        args = [f"a{i}" for i in range(len(order))] + list(extents)
        parts += [ks.code, f'extern "C" void call_{name}({params}) {{ {name}({", ".join(args)}); }}']
    return "\n".join(parts) + "\n"


def _kernels(variant: str) -> list[tuple]:
    return kernels_of(variant, GEOMETRIES, KINDS, _plans, cp.render)


def _unit(kernels) -> str:
    return unit_of(kernels, ("n", "groups"))   # the images and the groups: run-time sizes


_CANARY = 64  # floats past the scratch a call may not write


class _Lib:
    """A compiled library of kernels `(name, kind, geometry, plan, source, roles)`, each called as
    `call_<name>(roles..., extents...)`: `scratch(kind, g, plan, isa)` sizes a call's scratch and
    `extents(g)` gives its run-time sizes (the phase family's: the images and the groups)."""

    def __init__(self, path, kernels, isa: cv.VectorISA, scratch=cp.scratch_bytes,
                 extents=lambda g: (g.N, g.G)) -> None:
        self.dll = ctypes.CDLL(str(path))
        self.kernels = {k[0]: k for k in kernels}
        self.isa, self.scratch, self.extents = isa, scratch, extents

    def __call__(self, name: str, arrays: dict[str, np.ndarray], g: ConvGeometry | None = None) -> None:
        """Runs kernel `name` at geometry `g` (default: the one it was rendered for), with scratch
        of the size its plan needs there (NaN: no kernel may read scratch it did not write)."""
        _, kind, kg, plan, ks, order = self.kernels[name]
        g = g or kg
        words = self.scratch(kind, g, plan, self.isa) // 4
        block = base._aligned(words + _CANARY)
        block[words:] = 1234.5
        ptrs = [None if r is None else (block if r == "scratch" else arrays[r]).ctypes.data_as(ctypes.c_void_p)
                for r in order]
        extents = self.extents(g)
        fn = getattr(self.dll, f"call_{name}")
        fn.argtypes = [ctypes.c_void_p] * len(ptrs) + [ctypes.c_int64] * len(extents)
        fn(*ptrs, *extents)
        assert np.all(block[words:] == 1234.5), f"{name}: wrote past its {words} floats of scratch at {g}"


def compiled(variant: str, kernels: list, unit, cache, tag: str, units: int, **lib) -> dict[str, _Lib]:
    """{name: library} of `kernels` in `units` translation units (`unit(group)` their source), two
    compiles at a time; none where the CPU cannot run the variant (it is still compiled)."""
    groups = [kernels[i::units] for i in range(units)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        arts = list(pool.map(lambda grp: compile_cpp(unit(grp), flags=tv._flags(variant), cache=cache,
                                                     name=f"{tag}_{variant}"), groups))
    libs = {}
    if variant != "avx512" or cv.host_supports(cv.AVX512):
        for grp, art in zip(groups, arts):
            one = _Lib(art.path, grp, tv._isa(variant), **lib)
            libs.update({k[0]: one for k in grp})
    return libs


@pytest.fixture(scope="session")
def build(tmp_path_factory):
    """variant -> (kernels, {name: library}), compiled once per variant on first use."""
    cache, built = tmp_path_factory.mktemp("ember_phase_cache"), {}

    def get(variant: str):
        if variant not in built:
            kernels = _kernels(variant)
            built[variant] = (kernels, compiled(variant, kernels, _unit, cache, "phase", 4))
        return built[variant]
    return get


def _data(g: ConvGeometry, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return dict(x=f(g.N, g.C, g.H, g.W), w=f(g.O, g.C // g.G, g.KH, g.KW), dy=f(g.N, g.O, g.HO, g.WO), bias=f(g.O),
                mask=f(g.N, g.C, g.H, g.W))


def _reference(kind: str, g: ConvGeometry, d: dict[str, np.ndarray]) -> tuple[np.ndarray, int]:
    """The interpreter's result in float64, and the length of the sums behind each output."""
    attrs = dict(stride=(g.SH, g.SW), padding=(g.PH, g.PW), groups=g.G)
    x, w, dy = (d[k].astype(np.float64) for k in ("x", "w", "dy"))
    if kind == "conv2d":
        y = IMPLS["conv2d"]([x, w], attrs, TensorType((g.N, g.O, g.HO, g.WO))) + d["bias"][None, :, None, None]
        return np.maximum(y, 0.0), g.C // g.G * g.KH * g.KW
    if kind == "conv2d_grad_input":
        shape = (g.N, g.C, g.H, g.W)
        dx = IMPLS["conv2d_grad_input"]([dy, w], dict(attrs, input_shape=shape), TensorType(shape))
        return np.where(d["mask"] > 0, dx, 0.0), g.O // g.G * g.KH * g.KW
    shape = (g.O, g.C // g.G, g.KH, g.KW)
    return IMPLS["conv2d_grad_weight"]([x, dy], dict(attrs, weight_shape=shape), TensorType(shape)), g.N * g.HO * g.WO


def _out_shape(kind: str, g: ConvGeometry) -> tuple[int, ...]:
    return {"conv2d": (g.N, g.O, g.HO, g.WO), "conv2d_grad_input": (g.N, g.C, g.H, g.W),
            "conv2d_grad_weight": (g.O, g.C // g.G, g.KH, g.KW)}[kind]


def check_against_the_interpreter(kernels, libs, g: ConvGeometry, runs: list[ConvGeometry], seed: int) -> int:
    """Runs each compiled kernel of geometry `g` at every geometry of `runs` (one kernel for all of
    them) against the interpreter; how many kernels ran."""
    data = [_data(r, seed + i) for i, r in enumerate(runs)]
    wants: dict[tuple[int, str], tuple[np.ndarray, int]] = {}
    ran = 0
    for name, kind, kg, plan, _, _ in kernels:
        if kg is not g:
            continue
        for i, r in enumerate(runs):
            want, terms = wants.setdefault((i, kind), _reference(kind, r, data[i]))
            out = np.full(_out_shape(kind, r), np.nan, np.float32)
            libs[name](name, dict(data[i], out=out), r)
            try:
                base.assert_close(out, want, terms)
            except AssertionError as e:
                raise AssertionError(f"{name} {kind} planned for {kg} run at N={r.N} G={r.G}, plan {plan.pairs()}") \
                    from e
        ran += 1
    return ran


def check_threads(kernels, libs, picks: list[ConvGeometry], at=lambda g: g) -> None:
    """The first plan's kernel of each geometry of `picks`, run at `at(g)` on 2, 1 and 3 threads,
    gives the same bits."""
    try:
        for name, kind, g, plan, _, _ in kernels:
            if not any(g is p for p in picks) or not name.endswith("_0"):
                continue
            r = at(g)
            d = _data(r, 1)
            got = []
            for t in (2, 1, 3):
                base._set_threads(t)
                out = np.full(_out_shape(kind, r), np.nan, np.float32)
                libs[name](name, dict(d, out=out), r)
                got.append(out.tobytes())
            assert got[0] == got[1] == got[2], f"{name}: thread counts give different bits"
    finally:
        base._set_threads(2)


@pytest.mark.parametrize("variant", tv.VARIANTS)
@pytest.mark.parametrize("gi", range(len(GEOMETRIES)), ids=[label for label, _ in GEOMETRIES])
def test_phase_kernels_match_the_interpreter(build, variant, gi):
    """Each compiled kernel of the geometry, at every run of `_runs`: one kernel for all of them."""
    tv._runnable(variant)
    kernels, libs = build(variant)
    g = GEOMETRIES[gi][1]
    assert check_against_the_interpreter(kernels, libs, g, _runs(g), 1000 * gi) >= 3


@pytest.mark.parametrize("variant", tv.VARIANTS)
def test_bit_identical_across_threads(build, variant):
    """Tasks own whole outputs or fixed image slots: 1, 2 and 3 threads give the same bits."""
    tv._runnable(variant)
    kernels, libs = build(variant)
    check_threads(kernels, libs, [g for label, g in GEOMETRIES if label in ("resnet_3x3s2", "depthwise_s2", "random5")])


def test_plans_fit_the_register_file_and_refuse_what_does_not():
    g = GEOMETRIES[0][1]
    for isa in (cv.AVX2, cv.AVX512):
        for kind in KINDS:
            for plan in cp.plans(kind, g, isa, tune=True):
                if kind == "conv2d_grad_weight":
                    x = plan.CB * plan.TC
                    assert plan.OB * x + x + 1 <= isa.registers, plan
                else:
                    assert plan.VB * plan.OB + plan.VB + 1 <= isa.registers, plan
                assert cp.scratch_bytes(kind, g, plan, isa) > 0
    with pytest.raises(ValueError, match="vector registers"):
        cp.scratch_bytes("conv2d", g, cp.PhasePlan(VB=6, OB=16), cv.AVX2)
    with pytest.raises(ValueError, match="CB > 1 only with"):
        cp.scratch_bytes("conv2d_grad_weight", g, cp.PhasePlan(OB=1, CB=2, TC=3, IB=1), cv.AVX512)
    with pytest.raises(ValueError, match="no bias/relu epilogue"):
        cp.render("k", "conv2d_grad_weight", g, cp.plans("conv2d_grad_weight", g, cv.AVX2)[0], cv.AVX2, bias=True)


def test_the_grad_weight_cost_model_prefers_tiles_that_reuse_their_loads():
    """A tile of many dy channels against one x stream loads as often as it multiplies (measured
    1.7x slower than a balanced one for ResNet-8's stride-2 3x3): the model's tiles load at most
    0.6 times per FMA where the channels allow (AVX2: 4 x 3 taps, AVX-512: 8 x 3 taps)."""
    g = GEOMETRIES[0][1]
    for isa in (cv.AVX2, cv.AVX512):
        p = cp.plans("conv2d_grad_weight", g, isa)[0]
        x = p.CB * p.TC
        assert (x + p.OB) / (p.OB * x) <= 0.6, p
