"""The CUDA ReLU lets NaN through, checked without a GPU.

relu(NaN) is NaN in the interpreter and PyTorch. CUDA's fmaxf(NaN, 0) is 0, and so is
`x > 0 ? x : 0`, so a NaN-dropping spelling compiles, passes every finite-input test and only
shows on a GPU fed a poisoned batch (test_nonfinite.py, marked cuda). Here every kernel family's
ReLU epilogue is taken out of its rendered source (the lines that relu=True adds to relu=False)
and evaluated on the host with g++ on NaN, +-inf and ordinary values: CUDA's float comparisons,
conditional operator and fmaxf are IEEE, as the host's are. Plus a rendered step for device cuda
holds no NaN-dropping max and compiles with nvcc.
"""
from __future__ import annotations

import difflib
import re
import subprocess
from collections.abc import Callable

import numpy as np
import pytest

from ember.codegen import cuda, cuda_direct, cuda_direct_tc, cuda_kernels, cuda_skinny, cuda_small_conv

from nvcc import assert_compiles, nvcc_or_skip

# One relu-capable renderer per family, at odd geometries (each returns a kernel for them).
FAMILIES: dict[str, Callable[[bool], object]] = {
    "gemm_conv": lambda relu: cuda_kernels.render_conv2d_forward(
        "k", N=2, C=3, H=9, W=7, O=5, KH=3, KW=2, stride=(2, 1), padding=(1, 0), bias=True, relu=relu),
    "gemm_conv_tf32": lambda relu: cuda_kernels.render_conv2d_forward(
        "k", N=2, C=3, H=9, W=7, O=5, KH=3, KW=2, stride=(2, 1), padding=(1, 0), bias=True, relu=relu, tf32=True),
    "gemm_matmul": lambda relu: cuda_kernels.render_matmul(
        "k", M=7, N=13, K=5, trans_a=True, trans_b=False, bias=True, relu=relu),
    "direct": lambda relu: cuda_direct.render_direct(
        "k", grad_input=False, N=3, C=3, H=11, W=9, O=5, KH=3, KW=3, stride=1, padding=1, bias=True, relu=relu),
    "direct_tc": lambda relu: cuda_direct_tc.render_direct_tc(
        "k", grad_input=False, N=3, C=3, H=11, W=9, O=5, KH=3, KW=3, stride=1, padding=1, bias=True, relu=relu),
    "thin": lambda relu: cuda_direct.render_matmul_thin(
        "k", M=33, N=36, K=16, trans_a=False, trans_b=False, bias=True, relu=relu),
    "narrow": lambda relu: cuda_skinny.render_matmul_narrow(
        "k", M=1000, N=13, K=37, trans_a=False, trans_b=True, bias=True, relu=relu),
    "short_m": lambda relu: cuda_skinny.render_matmul_short_m(
        "k", M=3, N=64, K=999, trans_a=False, trans_b=False, bias=True, relu=relu),
    "small_window": lambda relu: cuda_small_conv.render_small_forward(
        "k", N=3, C=1, H=11, W=9, O=5, KH=3, KW=3, stride=1, padding=1, bias=True, relu=relu),
}
_ASSIGN = re.compile(r"^\s*([A-Za-z_]\w*(?:\[\w+\])?)\s*=\s*(.+);\s*$")
VALUES = [np.nan, np.inf, -np.inf, -1.5, 0.0, 2.5, -np.float32(1e-40)]


def _relu_statements(family: str) -> list[tuple[str, str]]:
    """The (target, expression) assignments that relu=True adds to the family's kernel."""
    plain, relu = (FAMILIES[family](r) for r in (False, True))
    assert plain is not None and relu is not None, family
    added = [ln[1:] for ln in difflib.unified_diff(plain.code.splitlines(), relu.code.splitlines(), lineterm="", n=0)
             if ln.startswith("+") and not ln.startswith("+++") and not ln[1:].lstrip().startswith("//")]
    out = []
    for line in added:
        m = _ASSIGN.match(line)
        assert m, f"{family}: an added line that is not an assignment: {line!r}"
        out.append((m.group(1), m.group(2)))
    assert out, f"{family}: relu=True adds no statement"
    return out


def _host_eval(exprs: list[str], tmp_path) -> np.ndarray:
    """Each expression (over the float `t`) evaluated by g++-compiled code on every VALUE:
    rows are expressions, columns values."""
    funcs = "\n".join(f"static float f{i}(float t) {{ return {e}; }}" for i, e in enumerate(exprs))
    calls = ", ".join(f"f{i}" for i in range(len(exprs)))
    vals = ", ".join(f"std::bit_cast<float>(0x{np.float32(v).view(np.uint32):08x}u)" for v in VALUES)
    src = tmp_path / "relu.cpp"
    src.write_text(f"""#include <bit>
#include <cmath>
#include <cstdio>
// what the generated CUDA may call: its max(float, float) is fmaxf
static inline float max(float a, float b) {{ return fmaxf(a, b); }}
{funcs}
int main() {{
  float (*fs[])(float) = {{{calls}}};
  const float xs[] = {{{vals}}};
  for (auto f : fs) for (float x : xs) {{ float y = f(x); unsigned u; __builtin_memcpy(&u, &y, 4); std::printf("%08x\\n", u); }}
}}
""")
    exe = tmp_path / "relu"
    subprocess.run(["g++", "-std=c++20", "-O2", "-o", str(exe), str(src)], check=True, capture_output=True)
    bits = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()
    return np.array([int(b, 16) for b in bits], np.uint32).view(np.float32).reshape(len(exprs), len(VALUES))


def test_every_cuda_relu_epilogue_and_the_pointwise_spelling_pass_nan_and_inf(tmp_path):
    exprs, where = [], []
    for family in FAMILIES:
        for target, expr in _relu_statements(family):
            exprs.append(re.sub(rf"(?<![\w\]]){re.escape(target)}(?![\w\[])", "t", expr))
            where.append(family)
    exprs.append(cuda.SPELLING.ops["relu"].format("t", zero="0.0f", one="1.0f", ctype="float"))
    where.append("SPELLING['relu']")
    got = _host_eval(exprs, tmp_path)
    want = np.maximum(np.array(VALUES, np.float32), np.float32(0))
    for row, family, expr in zip(got, where, exprs):
        np.testing.assert_array_equal(row, want, err_msg=f"{family}: relu spelled {expr!r}")


NAN_DROPPING = [re.compile(p) for p in (
    r"\bfmaxf?\s*\([^;]*?,\s*0(\.0*)?f?\s*\)",      # fmaxf(x, 0.f)
    r"\b(fmaxf?|max)\s*\(\s*0(\.0*)?f?\s*,",        # fmaxf(0.f, x), max(0.f, x)
    r"\bmax\s*\([^;]*?,\s*0(\.0*)?f?\s*\)",          # max(x, 0.f)
    r"([\w\[\]]+)\s*>=?\s*0(\.0*)?f?\s*\?\s*\1\s*:\s*0(\.0*)?f?\b",  # x > 0 ? x : 0
)]


def test_a_cuda_step_spells_relu_nan_propagating_and_compiles(tmp_path):
    """The step of a model with every fused-ReLU site (conv, matmul, pointwise after pooling)
    rendered for device cuda: no NaN-dropping max anywhere, and nvcc compiles it."""
    from ember.frontends import nn, optim, plan
    from ember.runtime import target
    nn.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 5 * 4, 12), nn.ReLU(), nn.Linear(12, 10))
    example = (np.zeros((6, 1, 11, 9), np.float32), np.zeros(6, np.int64))
    graphs = plan(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example, device="cuda")
    train = next(g for name, g in graphs.items() if name.startswith("train"))
    code = target("cuda").source(train)
    assert code.count("relu") >= 2
    for pattern in NAN_DROPPING:
        hit = pattern.search(code)
        assert hit is None, f"NaN-dropping max in the cuda step: {hit.group(0)!r}"
    src = tmp_path / "step.cu"
    src.write_text(code)
    assert_compiles(nvcc_or_skip(), src)


@pytest.mark.parametrize("bad", ["fmaxf(v, 0.f)", "v > 0.f ? v : 0.f", "max(0.f, v)"])
def test_the_scan_sees_nan_dropping_spellings(bad):
    assert any(p.search(f"  v = {bad};") for p in NAN_DROPPING)


# The geometry of each FAMILIES kernel, for its inputs and reference on a GPU.
GEOMETRY = {
    "gemm_conv": ("conv_fwd", dict(N=2, C=3, H=9, W=7, O=5, KH=3, KW=2, stride=(2, 1), padding=(1, 0))),
    "gemm_conv_tf32": ("conv_fwd", dict(N=2, C=3, H=9, W=7, O=5, KH=3, KW=2, stride=(2, 1), padding=(1, 0))),
    "gemm_matmul": ("matmul", dict(M=7, N=13, K=5, trans_a=True, trans_b=False)),
    "direct": ("conv_fwd", dict(N=3, C=3, H=11, W=9, O=5, KH=3, KW=3, stride=1, padding=1)),
    "direct_tc": ("conv_fwd", dict(N=3, C=3, H=11, W=9, O=5, KH=3, KW=3, stride=1, padding=1)),
    "thin": ("matmul", dict(M=33, N=36, K=16, trans_a=False, trans_b=False)),
    "narrow": ("matmul", dict(M=1000, N=13, K=37, trans_a=False, trans_b=True)),
    "short_m": ("matmul", dict(M=3, N=64, K=999, trans_a=False, trans_b=False)),
    "small_window": ("conv_fwd", dict(N=3, C=1, H=11, W=9, O=5, KH=3, KW=3, stride=1, padding=1)),
}


@pytest.mark.cuda
@pytest.mark.parametrize("family", list(FAMILIES))
def test_relu_epilogue_on_a_gpu_passes_nan_and_inf(family):
    """Each family's kernel with relu, NaN and +-inf in its input and bias: the NaN and inf
    positions of the output are the float64 reference's (np.maximum lets NaN through)."""
    cp = pytest.importorskip("cupy")
    import cuda_refs
    kind, geo = GEOMETRY[family]
    spec = geo | dict(bias=True, relu=True) if kind == "matmul" else geo
    ins, _, _ = cuda_refs.make_case(kind, spec, dict(bias=True, relu=True), np.random.default_rng(5))
    first = "x" if kind == "conv_fwd" else "a"
    flat = ins[first].reshape(-1)
    flat[[1, flat.size // 2, flat.size - 2]] = [np.nan, np.inf, -np.inf]
    ins["bias"][[0, -1]] = [np.nan, np.inf]
    with np.errstate(invalid="ignore"):
        if kind == "conv_fwd":
            ref = cuda_refs.conv_fwd_ref(ins["x"], ins["w"], ins["bias"], geo, relu=True)
        else:
            ref = cuda_refs.matmul_ref(ins["a"], ins["b"], spec, ins["bias"]).reshape(1, spec["M"], spec["N"])
    kernel = FAMILIES[family](True)
    module = cuda_refs.compile_module(cp, [kernel.code])
    bufs = {role: cp.asarray(a) for role, a in ins.items()}
    bufs["out"] = cp.full(ref.shape, -7.0, dtype=cp.float32)  # finite: an unwritten element shows
    scratch = cp.full(max(kernel.scratch_bytes // 4, 1), np.nan, dtype=cp.float32)
    cuda_refs.run_launches(cp, module, kernel, bufs, scratch)
    got = cp.asnumpy(bufs["out"]).reshape(ref.shape)
    assert np.isnan(ref).any() and np.isposinf(ref).any()
    for test in (np.isnan, np.isposinf, np.isneginf):
        np.testing.assert_array_equal(test(got), test(ref), err_msg=f"{family}: {test.__name__}")
    finite = np.isfinite(ref)
    np.testing.assert_allclose(got[finite], ref[finite], rtol=1e-2, atol=1e-2, err_msg=family)
