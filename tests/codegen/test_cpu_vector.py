"""The CPU kernels' vector variants (codegen/cpu_vector.py): avx2 (8 lanes, 16 registers) and
avx512 (16 lanes, 32 registers), each against float64 NumPy references, whatever CPU runs this.

Which variant runs where:

* ``avx2``: compiled and run everywhere (``-march=x86-64-v3`` where it is not the native variant);
* ``avx512``: compiled everywhere (g++ builds AVX-512 code on any x86-64), run only where
  /proc/cpuinfo has avx512f, skipped elsewhere with that reason;
* ``avx512-emulated``: the same 16-lane source compiled without AVX-512
  (``-DEMBER_CPU_VECTOR_EMULATE``: vectors as register pairs, portable FMA and masked loads) and
  run everywhere, so the 16-lane tiles, tails and lane reductions are checked on any machine.

Tolerance (float32 kernels against float64 references; every kernel here is float32): as in
test_cpp_kernels, ``|got - ref| <= 1e-4 |ref| + 1e-5 sqrt(R) max(1, max|ref| / sqrt(R))`` with R
the reduction length. Variants are never compared with each other bit for bit: their lanes
split each reduction differently. Within a variant, results are bit-identical for any number of
threads (its arithmetic order is fixed by construction). The whole step is checked against the
reference interpreter (per-step loss within 1e-5, parameters within rtol 1e-4 / atol 1e-5, as in
tests/e2e/test_cpu_vs_reference.py) for every variant this CPU can run.
"""
from __future__ import annotations

import ctypes
import platform
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import test_cpp_kernels as base
from ember.codegen import cpp_kernels as ck
from ember.codegen import cpu_vector as cv
from ember.codegen.compiler import DEFAULT_CXX_FLAGS, compile_cpp

pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                                reason="the CPU vector variants are x86-64 ISAs")

NO_AVX512 = "this CPU has no avx512f in /proc/cpuinfo: the AVX-512 build is compiled (and run emulated) here, not run"
VARIANTS = ["avx2", "avx512", "avx512-emulated"]

# Existing shapes (MNIST layers, paddings, strides, odd sizes) plus ones whose sizes are not
# multiples of 16: 16-lane rows (WO = 32, 48), channel counts past a tile (17, 33), k and n tails.
CONV_CASES = [c for c in base.CONV_CASES if c[0] in (
    "mnist_conv1", "mnist_conv2", "stride2_pad1", "pad1_o7", "pad2_odd", "pad3_gt_kernel", "c1_batch1_odd",
    "rect_mixed", "k5_pad2", "k1", "row_sh2", "row_nv4", "row_o13")] + [
    ("row16_nv2_o17", 2, 3, 10, 34, 17, 3, 3, (1, 1), (0, 0), True, True),
    ("row16_nv3", 1, 2, 6, 50, 9, 3, 3, (1, 1), (0, 0), True, False),
    ("flat16_o33", 2, 5, 11, 13, 33, 3, 3, (1, 1), (1, 1), True, False),
    ("k5_o24", 2, 4, 20, 21, 24, 5, 5, (1, 1), (2, 2), True, True),
]
MATMUL_CASES = [c for c in base.MATMUL_CASES if c[0] in (
    "linear_fwd", "linear_grad_in", "linear_grad_w", "mlp1_fwd", "mlp1_grad_in", "mlp1_grad_w", "mlp2_fwd",
    "odd_nn", "odd_tn", "odd_nt", "odd_tt", "wide_tt", "batched_nt_dot", "dot_long_k", "tiny", "m_rem",
    "dot_rows_rem", "dot_n64_par", "axpy_par_inplace", "axpy_par_packed_tt")] + [
    ("v16_nn_tail", 13, 47, 33, False, False, 1, True, True),
    ("v16_dot_ktail", 11, 17, 101, False, True, 1, True, False),
    ("v16_dot_batched", 6, 33, 64, False, True, 2, False, True),
    ("v16_axpy_par", 37, 257, 70, False, False, 1, True, False),
    ("v16_tn", 29, 61, 64, True, False, 1, False, False),
]


def _isa(variant: str) -> cv.VectorISA:
    return cv.VARIANTS[variant.split("-")[0]]


def _flags(variant: str) -> tuple[str, ...]:
    if variant == "avx512-emulated":   # 16-lane source, built for AVX2 (no AVX-512 instruction)
        return (*cv.cxx_flags(cv.AVX2), "-DEMBER_CPU_VECTOR_EMULATE")
    return cv.cxx_flags(_isa(variant))


def _kernels(variant: str) -> list[list[ck.KernelSource]]:
    isa = _isa(variant)
    conv, mm = [], []
    for cid, N, C, H, W, O, KH, KW, st, pd, bias, relu in CONV_CASES:
        kw = dict(N=N, C=C, H=H, W=W, O=O, KH=KH, KW=KW, stride=st, padding=pd, isa=isa)
        conv += [ck.render_conv2d_forward(f"fwd_{cid}", bias=bias, relu=relu, **kw),
                 ck.render_conv2d_grad_input(f"gin_{cid}", **kw),
                 ck.render_conv2d_grad_weight(f"gwt_{cid}", bias=bias, **kw)]
    for cid, M, N, K, ta, tb, batch, bias, relu in MATMUL_CASES:
        mm.append(ck.render_matmul(f"mm_{cid}", M=M, N=N, K=K, trans_a=ta, trans_b=tb, batch=batch, bias=bias,
                                   relu=relu, isa=isa))
    return [conv[0::2], conv[1::2], mm]


@pytest.fixture(scope="session")
def build(tmp_path_factory):
    """variant -> {kernel name: Lib}, compiled once per variant on first use."""
    cache, built = tmp_path_factory.mktemp("ember_vector_cache"), {}

    def get(variant: str) -> dict[str, base.Lib]:
        if variant not in built:
            groups = _kernels(variant)
            with ThreadPoolExecutor(max_workers=2) as pool:
                arts = list(pool.map(lambda g: compile_cpp(base._translation_unit(g), flags=_flags(variant), cache=cache,
                                                           name=f"kernels_{variant}"), groups))
            built[variant] = {}
            for g, art in zip(groups, arts):
                if variant == "avx512" and not cv.host_supports(cv.AVX512):
                    continue       # compiled (the point of the build test) but never loaded here
                lib = base.Lib(art.path, g)
                built[variant].update({k.name: lib for k in g})
        return built[variant]
    return get


def _runnable(variant: str) -> None:
    if variant == "avx512" and not cv.host_supports(cv.AVX512):
        pytest.skip(NO_AVX512)


# --------------------------------------------------------------------------- kernels

def test_avx512_source_compiles(build):
    """Every kernel shape, rendered for 16 lanes, compiles with AVX-512 flags on any x86-64."""
    build("avx512")
    assert "-march=x86-64-v4" in cv.cxx_flags(cv.AVX512) or cv.native_isa() == cv.AVX512


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", CONV_CASES, ids=[c[0] for c in CONV_CASES])
def test_conv2d_kernels(build, variant, case):
    _runnable(variant)
    libs = build(variant)
    cid, N, C, H, W, O, KH, KW, st, pd, bias, relu = case
    HO, WO = base._out_hw(H, W, KH, KW, st, pd)
    rng = base._rng(11)
    x, w, dy = base._f32(rng, N, C, H, W), base._f32(rng, O, C, KH, KW), base._f32(rng, N, O, HO, WO)
    b = base._f32(rng, O) if bias else None
    y = np.full((N, O, HO, WO), np.nan, np.float32)
    libs[f"fwd_{cid}"](f"fwd_{cid}", x, w, b, y)
    base.assert_close(y, base.conv_fwd_ref(x, w, b, st, pd, relu), C * KH * KW)
    dx = np.full((N, C, H, W), np.nan, np.float32)
    libs[f"gin_{cid}"](f"gin_{cid}", dy, w, dx)
    base.assert_close(dx, base.conv_grad_input_ref(dy, w, (N, C, H, W), st, pd), O * KH * KW)
    dw, db = np.full((O, C, KH, KW), np.nan, np.float32), np.full((O,), np.nan, np.float32) if bias else None
    libs[f"gwt_{cid}"](f"gwt_{cid}", x, dy, dw, db)
    ref_dw, ref_db = base.conv_grad_weight_ref(x, dy, (O, C, KH, KW), st, pd)
    base.assert_close(dw, ref_dw, N * HO * WO)
    if bias:
        base.assert_close(db, ref_db, N * HO * WO)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", MATMUL_CASES, ids=[c[0] for c in MATMUL_CASES])
def test_matmul_kernels(build, variant, case):
    _runnable(variant)
    libs = build(variant)
    cid, M, N, K, ta, tb, batch, bias, relu = case
    rng = base._rng(12)
    A = base._f32(rng, batch, *((K, M) if ta else (M, K)))
    B = base._f32(rng, batch, *((N, K) if tb else (K, N)))
    b = base._f32(rng, N) if bias else None
    C = np.full((batch, M, N), np.nan, np.float32)
    libs[f"mm_{cid}"](f"mm_{cid}", A, B, b, C)
    base.assert_close(C, base.matmul_ref(A, B, b, ta, tb, relu), K)


@pytest.mark.parametrize("variant", VARIANTS)
def test_bit_identical_across_threads(build, variant):
    """Within a variant the partitions and reduction orders are fixed: 1, 2 and 3 threads agree
    bit for bit (MNIST conv2's three kernels, a column-split and a row-split matmul)."""
    _runnable(variant)
    libs = build(variant)
    rng = base._rng(13)
    x, w, dy = base._f32(rng, 64, 16, 26, 26), base._f32(rng, 32, 16, 3, 3), base._f32(rng, 64, 32, 24, 24)
    runs = {"fwd_mnist_conv2": ((x, w, base._f32(rng, 32)), [(64, 32, 24, 24)]),
            "gin_mnist_conv2": ((dy, w), [(64, 16, 26, 26)]),
            "gwt_mnist_conv2": ((x, dy), [(32, 16, 3, 3), (32,)]),
            "mm_linear_fwd": ((base._f32(rng, 1, 64, 18432), base._f32(rng, 1, 10, 18432), base._f32(rng, 10)), [(1, 64, 10)]),
            "mm_axpy_par_inplace": ((base._f32(rng, 1, 70, 37), base._f32(rng, 1, 70, 203), base._f32(rng, 203)),
                                    [(1, 37, 203)])}
    try:
        for name, (args, shapes) in runs.items():
            got = []
            for t in (2, 1, 3):
                base._set_threads(t)
                bufs = [np.full(s, np.nan, np.float32) for s in shapes]
                libs[name](name, *args, *bufs)
                got.append(b"".join(bf.tobytes() for bf in bufs))
            assert got[0] == got[1] == got[2], f"{name}: thread counts give different bits"
    finally:
        base._set_threads(2)


# --------------------------------------------------------------------------- choices and flags

def _const(code: str, name: str) -> int:
    return int(re.search(rf"constexpr int {name} = (\d+);", code).group(1))


def test_register_tiles_fill_the_register_file():
    """AVX2 keeps its measured tiles; AVX-512 tiles fit 32 registers and use more than 16."""
    kw = dict(N=64, C=16, H=26, W=26, O=32, KH=3, KW=3)
    for isa, (vb, ob), gw_ob in ((cv.AVX2, (3, 4), 4), (cv.AVX512, (3, 8), 8)):
        fwd = ck.render_conv2d_forward("f", bias=True, relu=True, isa=isa, **kw).code
        assert (_const(fwd, "VB"), _const(fwd, "OB")) == (vb, ob)
        gwt = ck.render_conv2d_grad_weight("g", bias=False, isa=isa, **kw).code
        assert _const(gwt, "OB") == gw_ob
    for cid, N, C, H, W, O, KH, KW, st, pd, bias, relu in CONV_CASES:
        code = ck.render_conv2d_forward("f", N=N, C=C, H=H, W=W, O=O, KH=KH, KW=KW, stride=st, padding=pd,
                                        bias=bias, relu=relu, isa=cv.AVX512).code
        if "constexpr int VB" in code:
            vb, ob = _const(code, "VB"), _const(code, "OB")
            assert vb * ob + vb + 1 <= 32, cid
    for cid, M, N, K, ta, tb, batch, bias, relu in MATMUL_CASES:
        code = ck.render_matmul("m", M=M, N=N, K=K, trans_a=ta, trans_b=tb, batch=batch, isa=cv.AVX512).code
        mr = _const(code, "MR")
        if "mode dot" in code.splitlines()[0]:
            nr = _const(code, "NR")
            assert mr * nr + min(mr, nr) + 1 <= 32, cid
        else:
            nv = _const(code, "NV")
            assert mr * nv + nv + 1 <= 32, cid


def test_sources_name_their_width():
    k8 = ck.render_matmul("m", M=4, N=20, K=9, trans_a=False, trans_b=False, isa=cv.AVX2).code
    k16 = ck.render_matmul("m", M=4, N=20, K=9, trans_a=False, trans_b=False, isa=cv.AVX512).code
    assert "namespace ember_cpu8" in k8 and "vector_size(32)" in k8 and "ember_cpu16" not in k8
    assert "namespace ember_cpu16" in k16 and "vector_size(64)" in k16 and "__builtin_ia32_vfmaddps512_mask" in k16
    assert "__builtin_ia32_vfmaddps256" in k8 and "#include <immintrin.h>" not in k8 + k16  # 0.28 s of parsing a unit
    assert "#error" in k16 and "__AVX512F__" in k16      # a 16-lane kernel refuses a build without AVX-512
    for code in (k8, k16):
        assert '"+v"(v)' in code and '"+x"' not in code     # the pin reaches zmm16-31 under AVX-512


def test_resolve_and_flags(monkeypatch):
    monkeypatch.delenv(cv.ENV_VAR, raising=False)
    native = cv.native_isa()
    assert cv.resolve() == native and cv.cxx_flags(native) == DEFAULT_CXX_FLAGS
    for word, isa in (("avx2", cv.AVX2), ("AVX512", cv.AVX512), ("native", native), ("", native)):
        monkeypatch.setenv(cv.ENV_VAR, word)
        assert cv.resolve() == isa
    monkeypatch.setenv(cv.ENV_VAR, "sse2")
    with pytest.raises(ValueError, match="avx2, avx512"):
        cv.resolve()
    other = cv.AVX2 if native == cv.AVX512 else cv.AVX512
    flags = cv.cxx_flags(other)
    assert "-march=native" not in flags and flags[1:3] == other.march
    assert [f for f in flags if f not in other.march] == [f for f in DEFAULT_CXX_FLAGS if f != "-march=native"]


def test_host_supports_reads_cpuinfo(tmp_path):
    other = cv.AVX2 if cv.native_isa() == cv.AVX512 else cv.AVX512
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: fpu sse2 avx {other.cpu_flag} fma\n")
    assert cv.host_supports(other, info)
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx fma\n")
    assert not cv.host_supports(other, info)
    assert cv.host_supports(cv.native_isa(), info)     # built with -march=native: always runnable


def test_bf16_products_amx_where_the_cpu_lists_it_and_forced_where_asked(tmp_path, monkeypatch):
    """AMX needs both tile flags in /proc/cpuinfo (and Linux's grant, asked only then); a forced
    "amx" is the avx512 variant's only, and its step builds with the tile options (and
    -mavx512bf16, whose instruction its vector modes use) wherever -march=native lacks them."""
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_tile\n")
    monkeypatch.setattr(cv, "_request_tile_state", lambda: pytest.fail("asked Linux for tiles the CPU lacks"))
    assert not cv.native_amx.__wrapped__(info)  # amx_bf16 missing (the default, cached, reads /proc/cpuinfo)
    monkeypatch.setattr(cv, "_request_tile_state", lambda: False)
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_tile amx_bf16\n")
    assert not cv.native_amx.__wrapped__(info)  # listed, but Linux refused the tile state
    monkeypatch.setattr(cv, "_request_tile_state", lambda: True)
    assert cv.native_amx.__wrapped__(info)
    monkeypatch.setenv(cv.BF16_ENV_VAR, "amx")
    assert cv.bf16_dot(cv.AVX512) == "amx"
    with pytest.raises(ValueError, match="avx512 vector variant"):
        cv.bf16_dot(cv.AVX2)
    monkeypatch.setattr(cv, "native_target_enables", lambda option: False)
    assert set(cv.bf16_flags(cv.AVX512, {"amx"})) == {"-mavx512bf16", "-mamx-tile", "-mamx-bf16"}
    assert cv.bf16_flags(cv.AVX512, {"emulated"}) == ()


# --------------------------------------------------------------------------- the whole step

def _odd_cnn(seed: int = 0):
    from ember.frontends import nn
    nn.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 17, 3, padding=1), nn.ReLU(), nn.Conv2d(17, 20, 3), nn.ReLU(),
                         nn.Flatten(), nn.Linear(20 * 11 * 13, 33), nn.ReLU(), nn.Linear(33, 10))


@pytest.mark.parametrize("variant", ["avx2", "avx512"])
def test_step_matches_the_interpreter(monkeypatch, variant):
    """A CNN whose sizes are not multiples of 16 (13x15 images, 17/20/33 channels, batch 19),
    step by step from the same weights, against the reference interpreter."""
    _runnable(variant)
    from ember.frontends import compile, nn, optim
    monkeypatch.setenv(cv.ENV_VAR, variant)
    rng = np.random.default_rng(1)
    batches = [(rng.standard_normal((19, 3, 13, 15)).astype(np.float32), rng.integers(0, 10, 19)) for _ in range(3)]
    steps = {d: compile(_odd_cnn(), nn.CrossEntropyLoss(), optim.SGD(lr=0.05, momentum=0.9), example_inputs=batches[0],
                        device=d) for d in ("reference", "cpu")}
    for x, y in batches:
        steps["cpu"].load_state_dict(steps["reference"].state_dict())
        ref, got = steps["reference"](x, y), steps["cpu"](x, y)
        assert abs(ref - got) <= 1e-5 * max(1.0, abs(ref))
        for k, v in steps["reference"].state_dict().items():
            np.testing.assert_allclose(steps["cpu"].state_dict()[k], v, rtol=1e-4, atol=1e-5, err_msg=k)


def test_forced_avx512_refused_where_the_cpu_lacks_it(monkeypatch):
    if cv.host_supports(cv.AVX512):
        pytest.skip("this CPU runs AVX-512: nothing to refuse")
    from ember.frontends import compile, nn, optim
    monkeypatch.setenv(cv.ENV_VAR, "avx512")
    x, y = np.zeros((4, 3, 13, 15), np.float32), np.zeros(4, np.int64)
    with pytest.raises(RuntimeError, match="avx512f"):
        compile(_odd_cnn(), nn.CrossEntropyLoss(), optim.SGD(lr=0.05), example_inputs=(x, y), device="cpu")


def test_step_source_for_avx512_compiles(monkeypatch, tmp_path):
    """The whole step generated for AVX-512 (planned with 16-lane scratch sizes) compiles here."""
    from ember.codegen import cpp
    from models import cpu_plan, train_graph
    monkeypatch.setenv(cv.ENV_VAR, "avx512")
    graph = cpu_plan(train_graph(_odd_cnn(), (19, 3, 13, 15)))
    src = cpp.render_step(graph)
    assert src.isa == cv.AVX512 and "ember_cpu16" in src.code and "ember_cpu8" not in src.code
    compile_cpp(src.code, flags=src.flags, cache=tmp_path, name="step512")


def test_native_variant_without_a_compiler(monkeypatch):
    """With no g++ on PATH (a step cached earlier still loads) the CPU's flags decide, as -march=native would."""
    from ember.codegen import compiler
    expected = cv.AVX512 if "avx512f" in cv._cpu_flags() else cv.AVX2
    monkeypatch.setattr(compiler.shutil, "which", lambda name: None)
    assert compiler.native_target_enables("-mavx512f") is None
    assert cv.native_isa() == expected
