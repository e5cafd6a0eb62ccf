"""The generated CPU kernels (codegen/cpp_kernels.py) against NumPy float64 references.

Each kernel is compiled into a translation unit with a small ``extern "C"`` wrapper and called
through ctypes. Kernels are grouped into a few translation units, compiled in parallel, to keep
g++ time down. Tolerance (fp32 against a float64 reference):

    |got - ref| <= 1e-4 * |ref| + 1e-5 * sqrt(R) * max(1, max|ref| / sqrt(R))

where R is the length of the reduction behind each output (C*KH*KW for the forward conv, O*KH*KW
for grad-input, N*HO*WO for grad-weight, K for matmul). With unit-variance random inputs the
outputs are O(sqrt(R)), and fp32 rounding error grows like sqrt(R) * eps * |terms|.
"""
from __future__ import annotations

import ctypes
import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from ember.codegen import cpp_kernels as ck
from ember.codegen.compiler import compile_cpp
from ember.codegen.cpu_vector import cxx_flags, resolve

# The kernels below are rendered for the variant $EMBER_CPU_VECTOR selects (native by default),
# so they are built with its flags (test_cpu_vector.py covers every variant explicitly).
FLAGS = cxx_flags(resolve())

sliding = np.lib.stride_tricks.sliding_window_view


# --------------------------------------------------------------------------- references

def _pad(x, ph, pw):
    return np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))


def conv_fwd_ref(x, w, b, stride, padding, relu):
    sh, sw = stride
    ph, pw = padding
    O, C, KH, KW = w.shape
    win = sliding(_pad(x.astype(np.float64), ph, pw), (KH, KW), axis=(2, 3))[:, :, ::sh, ::sw]
    y = np.einsum("nchwij,ocij->nohw", win, w.astype(np.float64), optimize=True)
    if b is not None:
        y = y + b.astype(np.float64)[None, :, None, None]
    return np.maximum(y, 0.0) if relu else y


def conv_grad_input_ref(dy, w, xshape, stride, padding):
    sh, sw = stride
    ph, pw = padding
    N, C, H, W = xshape
    O, _, KH, KW = w.shape
    HO, WO = dy.shape[2:]
    dxp = np.zeros((N, C, H + 2 * ph, W + 2 * pw))
    dy64, w64 = dy.astype(np.float64), w.astype(np.float64)
    for kh in range(KH):
        for kw in range(KW):
            contrib = np.einsum("nohw,oc->nchw", dy64, w64[:, :, kh, kw], optimize=True)
            dxp[:, :, kh:kh + sh * (HO - 1) + 1:sh, kw:kw + sw * (WO - 1) + 1:sw] += contrib
    return dxp[:, :, ph:ph + H, pw:pw + W]


def conv_grad_weight_ref(x, dy, wshape, stride, padding):
    sh, sw = stride
    ph, pw = padding
    O, C, KH, KW = wshape
    HO, WO = dy.shape[2:]
    xp = _pad(x.astype(np.float64), ph, pw)
    dy64 = dy.astype(np.float64)
    dw = np.empty(wshape)
    for kh in range(KH):
        for kw in range(KW):
            xs = xp[:, :, kh:kh + sh * (HO - 1) + 1:sh, kw:kw + sw * (WO - 1) + 1:sw]
            dw[:, :, kh, kw] = np.einsum("nohw,nchw->oc", dy64, xs, optimize=True)
    return dw, dy64.sum(axis=(0, 2, 3))


def matmul_ref(A, B, bias, ta, tb, relu):
    a = A.astype(np.float64)
    b = B.astype(np.float64)
    a = np.swapaxes(a, -1, -2) if ta else a
    b = np.swapaxes(b, -1, -2) if tb else b
    c = a @ b
    if bias is not None:
        c = c + bias.astype(np.float64)
    return np.maximum(c, 0.0) if relu else c


def assert_close(got, ref, reduction):
    scale = max(1.0, float(np.abs(ref).max(initial=0.0)) / math.sqrt(reduction))
    atol = 1e-5 * math.sqrt(reduction) * scale
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=atol)


# --------------------------------------------------------------------------- cases

# (id, N, C, H, W, O, KH, KW, stride, padding, bias, relu)
CONV_CASES = [
    ("mnist_conv1", 64, 1, 28, 28, 16, 3, 3, (1, 1), (0, 0), True, True),
    ("mnist_conv2", 64, 16, 26, 26, 32, 3, 3, (1, 1), (0, 0), True, True),
    ("stride2", 2, 3, 9, 11, 5, 3, 3, (2, 2), (0, 0), True, False),
    ("stride2_pad1", 2, 4, 10, 9, 6, 3, 3, (2, 2), (1, 1), True, True),
    ("pad1_o7", 2, 3, 8, 8, 7, 3, 3, (1, 1), (1, 1), True, True),
    ("pad2_odd", 3, 2, 7, 9, 10, 3, 3, (1, 1), (2, 2), False, False),
    ("pad3_gt_kernel", 1, 2, 5, 5, 3, 3, 3, (1, 1), (3, 3), True, False),
    ("c1_batch1_odd", 1, 1, 5, 7, 3, 3, 3, (1, 1), (0, 0), True, True),
    ("rect_mixed", 2, 3, 9, 8, 9, 2, 4, (1, 2), (1, 0), True, False),
    ("stride21", 2, 2, 11, 10, 4, 3, 2, (2, 1), (0, 1), False, True),
    ("k5_pad2", 2, 3, 12, 12, 8, 5, 5, (1, 1), (2, 2), False, True),
    ("k1", 2, 5, 6, 6, 12, 1, 1, (1, 1), (0, 0), True, False),
    ("row_sh2", 2, 3, 9, 26, 8, 3, 3, (2, 1), (0, 0), True, True),
    ("row_nv1", 2, 4, 10, 10, 8, 3, 3, (1, 1), (0, 0), True, True),
    ("row_nv4", 1, 3, 6, 34, 5, 3, 3, (1, 1), (0, 0), True, False),
    ("row_o13", 3, 5, 12, 18, 13, 3, 3, (1, 1), (0, 0), True, True),
]

# (id, M, N, K, trans_a, trans_b, batch, bias, relu)
MATMUL_CASES = [
    ("linear_fwd", 64, 10, 18432, False, True, 1, True, False),
    ("linear_grad_in", 64, 18432, 10, False, False, 1, False, False),
    ("linear_grad_w", 10, 18432, 64, True, False, 1, False, False),
    ("mlp1_fwd", 64, 30, 784, False, True, 1, True, True),
    ("mlp2_fwd", 64, 10, 30, False, True, 1, True, False),
    ("mlp1_grad_in", 64, 784, 30, False, False, 1, False, False),
    ("mlp1_grad_w", 30, 784, 64, True, False, 1, False, False),
    ("mlp2_grad_in", 64, 30, 10, False, False, 1, False, False),
    ("mlp2_grad_w", 10, 30, 64, True, False, 1, False, False),
    ("odd_nn", 7, 13, 11, False, False, 1, True, True),
    ("odd_tn", 7, 13, 11, True, False, 1, False, True),
    ("odd_nt", 7, 13, 11, False, True, 1, True, False),
    ("odd_tt", 7, 13, 11, True, True, 1, False, False),
    ("wide_tt", 9, 37, 21, True, True, 1, True, True),
    ("batched_nn", 5, 9, 17, False, False, 3, True, False),
    ("batched_tt", 6, 5, 19, True, True, 2, False, True),
    ("batched_nt_dot", 5, 3, 40, False, True, 3, True, True),
    ("dot_long_k", 5, 3, 4101, False, True, 1, False, False),
    ("axpy_long_k", 3, 20, 5000, False, False, 1, True, False),
    ("tiny", 1, 1, 1, False, False, 1, True, False),
    ("m_rem", 13, 50, 9, False, False, 1, False, True),
    # dot form (trans_b, K >= 64): row tiles with a remainder, k tail, chunked k, batches; the
    # parallel ones split columns (2 threads) or rows (3 threads: fewer column tiles than threads)
    ("dot_rows_rem", 13, 7, 100, False, True, 1, True, True),
    ("dot_n64_par", 37, 64, 136, False, True, 1, True, False),
    ("dot_batched_chunks", 7, 5, 4200, False, True, 3, True, False),
    ("dot_m1", 1, 30, 64, False, True, 1, False, False),
    # axpy form, parallel: B in place with a partial last vector, units split mid-block
    ("axpy_par_inplace", 37, 203, 70, True, False, 1, True, True),
    ("axpy_par_nn", 41, 150, 90, False, False, 2, True, False),
    # axpy form, parallel, B packed (transposed, zero-padded)
    ("axpy_par_packed_tt", 33, 100, 90, True, True, 1, True, False),
    ("axpy_par_packed_4k", 9, 1024, 40, False, False, 1, False, False),
]


def _conv_kernels(case):
    cid, N, C, H, W, O, KH, KW, st, pd, bias, relu = case
    kw = dict(N=N, C=C, H=H, W=W, O=O, KH=KH, KW=KW, stride=st, padding=pd)
    return [
        ck.render_conv2d_forward(f"fwd_{cid}", bias=bias, relu=relu, **kw),
        ck.render_conv2d_grad_input(f"gin_{cid}", **kw),
        ck.render_conv2d_grad_weight(f"gwt_{cid}", bias=bias, **kw),
    ]


def _matmul_kernel(case):
    cid, M, N, K, ta, tb, batch, bias, relu = case
    return ck.render_matmul(f"mm_{cid}", M=M, N=N, K=K, trans_a=ta, trans_b=tb, batch=batch,
                            bias=bias, relu=relu)


_NARGS = {"fwd": 5, "gin": 4, "gwt": 5, "mm": 5}


def _args(k, n):
    """The wrapper's call: its n pointers, then the sizes the kernel takes at run time."""
    return ", ".join([f"a{i}" for i in range(n)] + [str(e) for e in k.extents])


def _translation_unit(kernels):
    parts = []
    for k in kernels:
        n = _NARGS[k.name.split("_", 1)[0]]
        params = ", ".join(f"float* a{i}" for i in range(n))
        args = _args(k, n)
        parts.append(k.code)
        parts.append(f'extern "C" void call_{k.name}({params}) {{ {k.name}({args}); }}\n')
    return "\n".join(parts)


class Lib:
    def __init__(self, path, kernels):
        self.dll = ctypes.CDLL(str(path))
        self.kernels = {k.name: k for k in kernels}

    def __call__(self, name, *arrays):
        k = self.kernels[name]
        scratch = _aligned(max(k.scratch_bytes // 4, 1))
        fn = getattr(self.dll, f"call_{name}")
        ptrs = [None if a is None else a.ctypes.data_as(ctypes.c_void_p) for a in arrays]
        fn.argtypes = [ctypes.c_void_p] * (len(ptrs) + 1)
        fn(*ptrs, scratch.ctypes.data_as(ctypes.c_void_p))
        return scratch


def _aligned(n):
    raw = np.full(n + 16, np.nan, dtype=np.float32)   # NaN: a kernel must not read stale scratch
    off = (-raw.ctypes.data % 64) // 4
    return raw[off:off + n]


@pytest.fixture(scope="session")
def libs(tmp_path_factory):
    cache = tmp_path_factory.mktemp("ember_kernel_cache")
    conv = [k for c in CONV_CASES for k in _conv_kernels(c)]
    mm = [_matmul_kernel(c) for c in MATMUL_CASES]
    # four translation units, two compiles at a time (one per core)
    groups = [conv[0::3], conv[1::3], conv[2::3], mm]
    with ThreadPoolExecutor(max_workers=2) as pool:
        arts = list(pool.map(lambda g: compile_cpp(_translation_unit(g), flags=FLAGS, cache=cache, name="kernels"),
                             groups))
    out = {}
    for g, art in zip(groups, arts):
        lib = Lib(art.path, g)
        for k in g:
            out[k.name] = lib
    return out


def _rng(seed):
    return np.random.default_rng(seed)


def _f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


# --------------------------------------------------------------------------- conv tests

def _out_hw(H, W, KH, KW, st, pd):
    return (H + 2 * pd[0] - KH) // st[0] + 1, (W + 2 * pd[1] - KW) // st[1] + 1


@pytest.mark.parametrize("case", CONV_CASES, ids=[c[0] for c in CONV_CASES])
def test_conv2d_forward(libs, case):
    cid, N, C, H, W, O, KH, KW, st, pd, bias, relu = case
    HO, WO = _out_hw(H, W, KH, KW, st, pd)
    rng = _rng(1)
    x, w = _f32(rng, N, C, H, W), _f32(rng, O, C, KH, KW)
    b = _f32(rng, O) if bias else None
    y = np.full((N, O, HO, WO), np.nan, np.float32)
    libs[f"fwd_{cid}"](f"fwd_{cid}", x, w, b, y)
    assert_close(y, conv_fwd_ref(x, w, b, st, pd, relu), C * KH * KW)


@pytest.mark.parametrize("case", CONV_CASES, ids=[c[0] for c in CONV_CASES])
def test_conv2d_grad_input(libs, case):
    cid, N, C, H, W, O, KH, KW, st, pd, bias, relu = case
    HO, WO = _out_hw(H, W, KH, KW, st, pd)
    rng = _rng(2)
    dy, w = _f32(rng, N, O, HO, WO), _f32(rng, O, C, KH, KW)
    dx = np.full((N, C, H, W), np.nan, np.float32)
    libs[f"gin_{cid}"](f"gin_{cid}", dy, w, dx)
    assert_close(dx, conv_grad_input_ref(dy, w, (N, C, H, W), st, pd), O * KH * KW)


@pytest.mark.parametrize("case", CONV_CASES, ids=[c[0] for c in CONV_CASES])
def test_conv2d_grad_weight(libs, case):
    cid, N, C, H, W, O, KH, KW, st, pd, bias, relu = case
    HO, WO = _out_hw(H, W, KH, KW, st, pd)
    rng = _rng(3)
    x, dy = _f32(rng, N, C, H, W), _f32(rng, N, O, HO, WO)
    dw = np.full((O, C, KH, KW), np.nan, np.float32)
    db = np.full((O,), np.nan, np.float32) if bias else None
    libs[f"gwt_{cid}"](f"gwt_{cid}", x, dy, dw, db)
    ref_dw, ref_db = conv_grad_weight_ref(x, dy, (O, C, KH, KW), st, pd)
    assert_close(dw, ref_dw, N * HO * WO)
    if bias:
        assert_close(db, ref_db, N * HO * WO)


# --------------------------------------------------------------------------- matmul tests

@pytest.mark.parametrize("case", MATMUL_CASES, ids=[c[0] for c in MATMUL_CASES])
def test_matmul(libs, case):
    cid, M, N, K, ta, tb, batch, bias, relu = case
    rng = _rng(4)
    A = _f32(rng, batch, *((K, M) if ta else (M, K)))
    B = _f32(rng, batch, *((N, K) if tb else (K, N)))
    b = _f32(rng, N) if bias else None
    C = np.full((batch, M, N), np.nan, np.float32)
    libs[f"mm_{cid}"](f"mm_{cid}", A, B, b, C)
    assert_close(C, matmul_ref(A, B, b, ta, tb, relu), K)


# --------------------------------------------------------------------------- contract

def _set_threads(n):
    """The kernels' OpenMP team size (libgomp is shared by every library in the process)."""
    ctypes.CDLL("libgomp.so.1").omp_set_num_threads(n)


_MM_BY_ID = {c[0]: c for c in MATMUL_CASES}
# matmul kernels whose OpenMP partition changes with the team size (dot: columns or rows,
# depending on the team; axpy: units)
_MM_DETERMINISM = ["linear_grad_w", "linear_fwd", "mlp1_fwd", "mlp1_grad_w", "dot_n64_par",
                   "dot_batched_chunks", "axpy_par_inplace", "axpy_par_packed_tt"]


@pytest.mark.parametrize("kind", ["fwd", "gin", "gwt", "mm"] + [f"mm:{c}" for c in _MM_DETERMINISM[1:]])
def test_deterministic_across_runs_and_threads(libs, kind):
    rng = _rng(5)
    threads = (2, 2, 1)
    if kind.startswith("mm"):
        cid, M, N, K, ta, tb, batch, bias, relu = _MM_BY_ID[kind[3:] if ":" in kind else _MM_DETERMINISM[0]]
        name = f"mm_{cid}"
        args = (_f32(rng, batch, *((K, M) if ta else (M, K))), _f32(rng, batch, *((N, K) if tb else (K, N))),
                _f32(rng, N) if bias else None)
        outs = [(batch, M, N)]
        threads = (2, 2, 1, 3)
    else:
        name = f"{kind}_mnist_conv2"
        x, w, dy = _f32(rng, 64, 16, 26, 26), _f32(rng, 32, 16, 3, 3), _f32(rng, 64, 32, 24, 24)
        args = {"fwd": (x, w, _f32(rng, 32)), "gin": (dy, w), "gwt": (x, dy)}[kind]
        outs = {"fwd": [(64, 32, 24, 24)], "gin": [(64, 16, 26, 26)],
                "gwt": [(32, 16, 3, 3), (32,)]}[kind]
    results = []
    try:
        for t in threads:
            _set_threads(t)
            bufs = [np.full(s, np.nan, np.float32) for s in outs]
            libs[name](name, *args, *bufs)
            results.append([bf.tobytes() for bf in bufs])
    finally:
        _set_threads(2)
    assert results[0] == results[1], "two runs with the same inputs differ"
    for t, r in zip(threads[2:], results[2:]):
        assert results[0] == r, f"{t} thread(s) and 2 threads give different bits"


def test_matmul_serial_below_threshold():
    """Small matmuls run without an OpenMP region; large ones keep it (both forms)."""
    small = [ck.render_matmul("s1", M=64, N=10, K=30, trans_a=False, trans_b=True, bias=True),
             ck.render_matmul("s2", M=64, N=30, K=10, trans_a=False, trans_b=False),
             ck.render_matmul("s3", M=10, N=30, K=64, trans_a=True, trans_b=False)]
    large = [ck.render_matmul("l1", M=64, N=30, K=784, trans_a=False, trans_b=True, bias=True),
             ck.render_matmul("l2", M=30, N=784, K=64, trans_a=True, trans_b=False)]
    for k in small:
        assert 2 * 64 * 10 * 30 < ck.MATMUL_SERIAL_FLOPS
        assert "#pragma omp parallel" not in k.code and "serial" in k.code.splitlines()[0]
    for k in large:
        assert "#pragma omp parallel" in k.code
    assert "mode dot" in large[0].code.splitlines()[0] and "mode axpy" in large[1].code.splitlines()[0]
    # in-place B (no panel, no scratch) for rows of B that map to distinct L1 sets; packed for 4 KiB strides
    assert large[1].scratch_bytes == 0
    assert ck.render_matmul("p", M=64, N=18432, K=10, trans_a=False, trans_b=False).scratch_bytes > 0


def test_scratch_and_names():
    k = ck.render_conv2d_forward("c2", N=64, C=16, H=26, W=26, O=32, KH=3, KW=3, bias=True, relu=True)
    assert k.name == "c2" and k.code.startswith("// conv2d_forward")
    assert k.scratch_bytes % 64 == 0 and k.scratch_bytes >= 4 * 32 * 16 * 9
    for src in (ck.render_conv2d_grad_input("g", N=1, C=1, H=3, W=3, O=1, KH=3, KW=3).code,
                ck.render_conv2d_grad_weight("h", N=1, C=1, H=3, W=3, O=1, KH=3, KW=3, bias=False).code,
                ck.render_matmul("m", M=1, N=1, K=1, trans_a=False, trans_b=False).code):
        assert src.startswith("// conv2d_grad_input") or src.startswith("// conv2d_grad_weight") \
            or src.startswith("// matmul")
    with pytest.raises(ValueError):
        ck.render_conv2d_forward("bad name", N=1, C=1, H=3, W=3, O=1, KH=3, KW=3, bias=False, relu=False)
    with pytest.raises(ValueError):
        ck.render_conv2d_forward("k", N=1, C=1, H=2, W=2, O=1, KH=3, KW=3, bias=False, relu=False)


# --------------------------------------------------------------------------- relu_mask epilogue

# (id, kind, shape parameters): grad-input at stride 1 (flat tiles, direct and staged stores) and
# stride 2 (scatter), and matmuls that would take each form (relu_mask forces axpy).
MASK_CASES = [
    ("gin_mnist2", "gin", dict(N=4, C=16, H=26, W=26, O=32, KH=3, KW=3, stride=(1, 1), padding=(0, 0))),
    ("gin_pad1", "gin", dict(N=2, C=3, H=8, W=8, O=7, KH=3, KW=3, stride=(1, 1), padding=(1, 1))),
    ("gin_stride2", "gin", dict(N=2, C=3, H=9, W=11, O=5, KH=3, KW=3, stride=(2, 2), padding=(0, 0))),
    ("mm_axpy", "mm", dict(M=64, N=18432, K=10, trans_a=False, trans_b=False)),
    ("mm_odd", "mm", dict(M=13, N=29, K=7, trans_a=True, trans_b=False)),
    ("mm_dotform", "mm", dict(M=64, N=10, K=300, trans_a=False, trans_b=True)),
]


@pytest.fixture(scope="module")
def mask_lib(tmp_path_factory):
    ks = []
    for cid, kind, p in MASK_CASES:
        if kind == "gin":
            ks.append(ck.render_conv2d_grad_input(f"mk_{cid}", relu_mask=True, **p))
        else:
            ks.append(ck.render_matmul(f"mk_{cid}", relu_mask=True, **p))
    parts = []
    for k, (cid, kind, _) in zip(ks, MASK_CASES):
        n = 5 if kind == "gin" else 6   # with the scratch pointer Lib appends
        params = ", ".join(f"float* a{i}" for i in range(n))
        parts += [k.code, f'extern "C" void call_{k.name}({params}) {{ {k.name}({_args(k, n)}); }}\n']
    art = compile_cpp("\n".join(parts), flags=FLAGS, cache=tmp_path_factory.mktemp("ember_mask_cache"), name="mask_kernels")
    return Lib(art.path, ks)


@pytest.mark.parametrize("case", MASK_CASES, ids=[c[0] for c in MASK_CASES])
def test_relu_mask_epilogue(mask_lib, case):
    """out = where(mask > 0, contraction, 0), bit-identical to the unmasked kernel's values."""
    cid, kind, p = case
    rng = _rng(7)
    if kind == "gin":
        N, C, H, W, O, KH, KW = (p[k] for k in ("N", "C", "H", "W", "O", "KH", "KW"))
        HO, WO = _out_hw(H, W, KH, KW, p["stride"], p["padding"])
        dy, w = _f32(rng, N, O, HO, WO), _f32(rng, O, C, KH, KW)
        mask = np.maximum(_f32(rng, N, C, H, W), 0)      # a ReLU output: about half zeros
        out = np.full((N, C, H, W), np.nan, np.float32)
        mask_lib(f"mk_{cid}", dy, w, mask, out)
        ref, red = conv_grad_input_ref(dy, w, (N, C, H, W), p["stride"], p["padding"]), O * KH * KW
    else:
        M, Nn, K, ta, tb = (p[k] for k in ("M", "N", "K", "trans_a", "trans_b"))
        A = _f32(rng, *((K, M) if ta else (M, K)))
        B = _f32(rng, *((Nn, K) if tb else (K, Nn)))
        mask = np.maximum(_f32(rng, M, Nn), 0)
        out = np.full((M, Nn), np.nan, np.float32)
        mask_lib(f"mk_{cid}", A, B, None, mask, out)
        ref, red = matmul_ref(A, B, None, ta, tb, False), K
    assert not np.isnan(out).any()
    assert (out[mask <= 0] == 0).all()
    assert_close(out, np.where(mask > 0, ref, 0).astype(np.float32), red)


@pytest.mark.parametrize("case", MASK_CASES, ids=[c[0] for c in MASK_CASES])
def test_relu_mask_of_a_nan_activation_blocks_the_gradient(mask_lib, case):
    """The interpreter's ReLU VJP is where(y > 0, dy, 0): a NaN (or -inf) forward activation
    passes no gradient, a +inf one passes it; the epilogue must agree."""
    cid, kind, p = case
    rng = _rng(8)
    if kind == "gin":
        N, C, H, W, O, KH, KW = (p[k] for k in ("N", "C", "H", "W", "O", "KH", "KW"))
        HO, WO = _out_hw(H, W, KH, KW, p["stride"], p["padding"])
        args, shape = [_f32(rng, N, O, HO, WO), _f32(rng, O, C, KH, KW)], (N, C, H, W)
    else:
        M, Nn, K, ta, tb = (p[k] for k in ("M", "N", "K", "trans_a", "trans_b"))
        args = [_f32(rng, *((K, M) if ta else (M, K))), _f32(rng, *((Nn, K) if tb else (K, Nn))), None]
        shape = (M, Nn)
    mask = np.abs(_f32(rng, *shape)) + 0.5
    flat = mask.reshape(-1)
    flat[0::7], flat[3::11], flat[5::13] = np.nan, -np.inf, np.inf
    out, plain = np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32)
    mask_lib(f"mk_{cid}", *args, mask, out)
    mask_lib(f"mk_{cid}", *args, np.ones(shape, np.float32), plain)
    np.testing.assert_array_equal(out, np.where(mask > 0, plain, np.float32(0)))


def _poison(a: np.ndarray, seed: int) -> np.ndarray:
    """`a` with a few NaN, +inf and -inf elements at random places."""
    flat = a.reshape(-1)
    idx = np.random.default_rng(seed).permutation(flat.size)[:6]
    flat[idx] = [np.nan, np.inf, -np.inf, np.nan, np.inf, -np.inf][:idx.size]
    return a


def _assert_nonfinite_close(got, ref, reduction):
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref), err_msg="NaN positions")
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(ref), err_msg="+inf positions")
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref), err_msg="-inf positions")
    finite = np.isfinite(ref)
    assert_close(got[finite], ref[finite], reduction)


# Every relu case: conv in the flat, row and generic (strided) modes, matmul in the dot and axpy
# forms, each with its vector epilogue and scalar tails.
RELU_CONV = [c for c in CONV_CASES if c[-1] and c[0] != "mnist_conv2"]
RELU_MATMUL = [c for c in MATMUL_CASES if c[-1]]


@pytest.mark.parametrize("case", RELU_CONV, ids=[c[0] for c in RELU_CONV])
def test_conv2d_forward_relu_passes_nan_and_inf(libs, case):
    """relu(NaN) is NaN (torch.relu and the interpreter): a NaN input or bias must not come out 0."""
    cid, N, C, H, W, O, KH, KW, st, pd, bias, relu = case
    HO, WO = _out_hw(H, W, KH, KW, st, pd)
    rng = _rng(11)
    x, w = _poison(_f32(rng, N, C, H, W), 1), _f32(rng, O, C, KH, KW)
    b = _f32(rng, O) if bias else None
    if bias:
        b[[0, O - 1]] = [np.nan, np.inf]
    y = np.full((N, O, HO, WO), -1.0, np.float32)
    libs[f"fwd_{cid}"](f"fwd_{cid}", x, w, b, y)
    with np.errstate(invalid="ignore"):
        ref = conv_fwd_ref(x, w, b, st, pd, relu)
    assert np.isnan(ref).any()
    _assert_nonfinite_close(y, ref, C * KH * KW)


@pytest.mark.parametrize("case", RELU_MATMUL, ids=[c[0] for c in RELU_MATMUL])
def test_matmul_relu_passes_nan_and_inf(libs, case):
    cid, M, N, K, ta, tb, batch, bias, relu = case
    rng = _rng(12)
    A = _poison(_f32(rng, batch, *((K, M) if ta else (M, K))), 2)
    B = _f32(rng, batch, *((N, K) if tb else (K, N)))
    b = _f32(rng, N) if bias else None
    if bias:
        b[[0, N - 1]] = [np.nan, np.inf] if N > 1 else [np.nan]
    C = np.full((batch, M, N), -1.0, np.float32)
    libs[f"mm_{cid}"](f"mm_{cid}", A, B, b, C)
    with np.errstate(invalid="ignore"):
        ref = matmul_ref(A, B, b, ta, tb, relu)
    assert np.isnan(ref).any()
    _assert_nonfinite_close(C, ref, K)


# --------------------------------------------------------------------------- grad-weight image blocks

# (id, C, H, W, O, KH, KW, padding, bias): small planes, where the flat grad-weight sums IB images
# per tile before reducing its lanes; the blocks' last one is partial at most of these batch sizes
GW_BLOCK_CASES = [
    ("p7_pad1", 5, 7, 7, 11, 3, 3, (1, 1), True),
    ("p5x6_pad0", 3, 5, 6, 7, 3, 2, (0, 0), False),
    ("p4_k1", 6, 4, 4, 9, 1, 1, (0, 0), True),
]
GW_BLOCKS = (0, 2, 4, 8)


@pytest.fixture(scope="module")
def gw_block_lib(tmp_path_factory):
    kernels = {}
    for cid, C, H, W, O, KH, KW, pd, bias in GW_BLOCK_CASES:
        for ib in GW_BLOCKS:
            for ob in (1, 3):
                plan = ck.ConvPlan("flat", 0, ob, ib)
                kernels[(cid, ib, ob)] = ck.render_conv2d_grad_weight(
                    f"gwb_{cid}_{ib}_{ob}", N=64, C=C, H=H, W=W, O=O, KH=KH, KW=KW, padding=pd, bias=bias, plan=plan)
    unit = "\n".join(k.code + f'extern "C" void call_{k.name}(float* x, float* dy, float* dw, float* db, float* s, '
                     f'long n) {{ {k.name}(x, dy, dw, db, s, n); }}\n' for k in kernels.values())
    art = compile_cpp(unit, flags=FLAGS, cache=tmp_path_factory.mktemp("gw_blocks"), name="gw_blocks")
    return ctypes.CDLL(str(art.path)), kernels


@pytest.mark.parametrize("case", GW_BLOCK_CASES, ids=[c[0] for c in GW_BLOCK_CASES])
def test_grad_weight_image_blocks_match_the_reference_at_any_batch(gw_block_lib, case):
    dll, kernels = gw_block_lib
    cid, C, H, W, O, KH, KW, pd, bias = case
    HO, WO = _out_hw(H, W, KH, KW, (1, 1), pd)
    rng = _rng(7)
    for n in (1, 3, 9, 21):  # one image; fewer images than a block; blocks with a remainder per slot
        x, dy = _f32(rng, n, C, H, W), _f32(rng, n, O, HO, WO)
        ref_dw, ref_db = conv_grad_weight_ref(x, dy, (O, C, KH, KW), (1, 1), pd)
        for (kid, ib, ob), k in kernels.items():
            if kid != cid:
                continue
            dw = np.full((O, C, KH, KW), np.nan, np.float32)
            db = np.full((O,), np.nan, np.float32) if bias else None
            scratch = _aligned(max(k.scratch_bytes // 4, 1))
            fn = getattr(dll, f"call_{k.name}")
            fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long]
            fn(x.ctypes.data, dy.ctypes.data, dw.ctypes.data, None if db is None else db.ctypes.data,
               scratch.ctypes.data, n)
            assert_close(dw, ref_dw, n * HO * WO)
            if bias:
                assert_close(db, ref_db, n * HO * WO)


def test_grad_weight_image_blocks_are_the_flat_modes_and_chosen_for_small_planes():
    from ember.codegen.cpu_vector import AVX512
    small = ck.conv_plans("conv2d_grad_weight", N=64, C=256, H=7, W=7, O=256, KH=3, KW=3, padding=(1, 1), isa=AVX512)
    large = ck.conv_plans("conv2d_grad_weight", N=64, C=64, H=28, W=28, O=64, KH=3, KW=3, padding=(1, 1), isa=AVX512)
    assert small[0].mode == "flat" and small[0].IB == 4, small  # 4 vectors an image -> 16 a tile
    assert large[0].IB == 0, large  # 52 vectors an image: one image a tile already amortises the reduction
    tuned = ck.conv_plans("conv2d_grad_weight", N=64, C=256, H=7, W=7, O=256, KH=3, KW=3, padding=(1, 1),
                          isa=AVX512, tune=True)
    assert {p.IB for p in tuned if p.mode == "flat"} >= {0, 2, 4}, tuned
    with pytest.raises(ValueError, match="image blocks"):
        ck.render_conv2d_forward("f", N=2, C=1, H=5, W=5, O=1, KH=3, KW=3, bias=False, relu=False,
                                 plan=ck.ConvPlan("flat", 1, 1, 2))
    with pytest.raises(ValueError, match="IB must be one of"):
        ck.render_conv2d_grad_weight("g", N=2, C=1, H=5, W=5, O=1, KH=3, KW=3, bias=False,
                                     plan=ck.ConvPlan("flat", 0, 1, 3))
