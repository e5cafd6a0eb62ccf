"""Every op compiled by each code-generating backend (cpu; cuda on a GPU), alone and inside fused
groups, against the interpreter.

Many ops share one graph (one output each) so that one g++ run covers a table of cases.
Tolerances (float32): elementwise rtol 1e-6 / atol 1e-6 (transcendentals may differ from NumPy's
by an ulp or two); reductions and contractions atol 1e-5 * sqrt(terms summed), rtol 1e-5.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from ember.ir import OPS, Graph, TensorType, run
from ember.passes.fusion import fuse, kernel_counts
from ember.passes.memory import check_plan
from ember.runtime.cpu import CpuExecutor
from ember.runtime.executor import HostStorage
from models import compiled_targets, cpu_plan, run_compiled

F32 = "float32"
rng = np.random.default_rng(7)


@pytest.fixture(params=compiled_targets())
def device(request) -> str:
    return request.param


def _compile_and_compare(graph: Graph, inputs: dict, params: dict | None = None, tol: dict | None = None,
                         device: str = "cpu"):
    params = params or {}
    expect = run(graph, inputs, params).outputs
    planned, got = run_compiled(graph, device, inputs, params)
    check_plan(planned)
    for name, want in expect.items():
        rtol, atol = (tol or {}).get(name, (1e-6, 1e-6))
        np.testing.assert_allclose(got[name], want, rtol=rtol, atol=atol, err_msg=name)
    return planned


def _data(t: TensorType, positive: bool = False) -> np.ndarray:
    if t.dtype.is_float:
        x = rng.standard_normal(t.shape).astype(t.dtype.numpy)
        return np.abs(x) + 0.1 if positive else x
    if t.dtype.name == "bool":
        return rng.random(t.shape) > 0.5
    return rng.integers(0, 5, t.shape).astype(t.dtype.numpy)


UNARY_POSITIVE = {"log", "sqrt", "reciprocal"}


def test_elementwise_ops_alone(device):
    g = Graph("elementwise")
    inputs = {}

    def inp(name, shape, dtype=F32, positive=False):
        t = TensorType(shape, dtype)
        inputs[name] = _data(t, positive)
        return g.add_input(name, t)

    for op in ("neg", "exp", "log", "sqrt", "reciprocal", "relu", "sigmoid", "tanh", "abs", "erf", "sin", "cos", "floor"):
        x = inp(f"x_{op}", (3, 37), positive=op in UNARY_POSITIVE)
        g.set_output(op, g.add(op, [x]))
    for op in ("add", "sub", "mul", "div", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge"):
        a = inp(f"a_{op}", (4, 1, 5))
        b = inp(f"b_{op}", (3, 1), positive=op == "div")
        g.set_output(op, g.add(op, [a, b]))
    c = inp("cond", (2, 3), "bool")
    g.set_output("where", g.add("where", [c, inp("wa", (2, 3)), inp("wb", (3,))]))
    g.set_output("cast_i", g.add("cast", [inp("ci", (5, 2))], dtype="int32"))
    g.set_output("cast_f", g.add("cast", [inp("cf", (7,), "int64")], dtype="float32"))
    g.set_output("int_add", g.add("add", [inp("ia", (6,), "int64"), inp("ib", (6,), "int64")]))
    labels = inp("labels", (9,), "int64")
    g.set_output("one_hot", g.add("one_hot", [labels], num_classes=5))
    planned = _compile_and_compare(g, inputs, tol={"exp": (2e-6, 1e-6), "tanh": (2e-6, 1e-6), "sigmoid": (2e-6, 1e-6),
                                                       "erf": (2e-6, 1e-6), "sin": (2e-6, 1e-6), "cos": (2e-6, 1e-6)},
                                 device=device)
    assert kernel_counts(planned) == {"pointwise": len(g.outputs)}


def test_layout_ops_and_views(device):
    g = Graph("layout")
    x = g.add_input("x", TensorType((2, 3, 4)))
    inputs = {"x": _data(TensorType((2, 3, 4)))}
    g.set_output("transpose", g.add("transpose", [x], perm=(2, 0, 1)))
    g.set_output("broadcast", g.add("broadcast_to", [g.add("reshape", [x], shape=(2, 1, 12))], shape=(2, 5, 12)))
    t = g.add("transpose", [x], perm=(1, 2, 0))
    g.set_output("reshape_of_transpose", g.add("exp", [g.add("reshape", [t], shape=(6, 4))]))
    g.set_output("reshape", g.add("reshape", [x], shape=(4, 6)))
    _compile_and_compare(g, inputs, tol={"reshape_of_transpose": (2e-6, 1e-6)}, device=device)


@pytest.mark.parametrize("shape,axes,keepdims", [((5, 7), (1,), True), ((5, 7), (0,), False), ((3, 4, 5, 6), (0, 2, 3), False),
                                                 ((3, 4, 5), (0, 1, 2), False), ((64, 10), (1,), True),
                                                 ((37, 4, 16, 16), (0, 2, 3), False)])  # bias-gradient shaped: cuda splits it
def test_reductions(shape, axes, keepdims, device):
    g = Graph("reduce")
    x = g.add_input("x", TensorType(shape))
    inputs = {"x": _data(TensorType(shape))}
    g.set_output("sum", g.add("sum", [x], axes=axes, keepdims=keepdims))
    g.set_output("max", g.add("max", [x], axes=axes, keepdims=keepdims))
    g.set_output("argmax", g.add("argmax", [x], axis=axes[-1]))
    sq = g.add("mul", [x, x])  # prologue
    s = g.add("sum", [sq], axes=axes, keepdims=keepdims)
    g.set_output("sum_sq_sqrt", g.add("sqrt", [s]))  # epilogue
    n = math.prod(shape[a] for a in axes)
    tol = (1e-5, 1e-5 * math.sqrt(n))
    planned = _compile_and_compare(g, inputs, tol={"sum": tol, "sum_sq_sqrt": tol}, device=device)
    # sum, max and the sum of squares walk one domain: one kernel with three outputs; argmax keeps its own
    assert kernel_counts(planned) == {"reduction": 2}


@pytest.mark.parametrize("m,k,n,ta,tb,bias,relu", [(5, 7, 3, False, False, False, False), (64, 30, 10, False, True, True, False),
                                                   (13, 17, 19, True, False, True, True), (8, 9, 33, True, True, False, True)])
def test_matmul_with_epilogues(m, k, n, ta, tb, bias, relu, device):
    g = Graph("mm")
    a_shape, b_shape = ((k, m) if ta else (m, k)), ((n, k) if tb else (k, n))
    a, b = g.add_input("a", TensorType(a_shape)), g.add_parameter("b", TensorType(b_shape))
    inputs, params = {"a": _data(TensorType(a_shape))}, {"b": _data(TensorType(b_shape))}
    a2 = g.add("transpose", [a], perm=(1, 0)) if ta else a
    b2 = g.add("transpose", [b], perm=(1, 0)) if tb else b
    y = g.add("matmul", [a2, b2])
    if bias:
        params["bias"] = _data(TensorType((n,)))
        y = g.add("add", [y, g.add_parameter("bias", TensorType((n,)))])
    if relu:
        y = g.add("relu", [y])
    g.set_output("y", y)
    planned = _compile_and_compare(g, inputs, params, tol={"y": (1e-5, 1e-5 * math.sqrt(k))}, device=device)
    assert kernel_counts(planned) == {"matmul": 1}


def test_batched_matmul_with_bias_epilogue(device):
    g = Graph("bmm")
    a = g.add_input("a", TensorType((3, 2, 5, 7)))
    b = g.add_input("b", TensorType((3, 2, 7, 4)))
    bias = g.add_input("bias", TensorType((4,)))
    g.set_output("y", g.add("relu", [g.add("add", [g.add("matmul", [a, b]), bias])]))
    inputs = {k: _data(g.type(n)) for k, n in g.inputs.items()}
    planned = _compile_and_compare(g, inputs, tol={"y": (1e-5, 1e-5 * math.sqrt(7))}, device=device)
    assert kernel_counts(planned) == {"matmul": 1}


def test_matmul_broadcasting_batch_dims_is_refused_clearly():
    g = Graph("bmm")
    a = g.add_input("a", TensorType((3, 5, 7)))
    b = g.add_input("b", TensorType((1, 7, 4)))
    g.set_output("y", g.add("matmul", [a, b]))
    with pytest.raises(NotImplementedError, match=r"f32\[3,5,7\] and f32\[1,7,4\] broadcasts batch dimensions"):
        cpu_plan(g)


@pytest.mark.parametrize("n,c,h,w,o,k,stride,pad", [(2, 3, 9, 8, 5, 3, 1, 0), (2, 1, 28, 28, 16, 3, 1, 0), (1, 4, 11, 7, 6, 3, 2, 1),
                                                    (3, 2, 6, 6, 3, 2, 1, 2)])
def test_convolutions(n, c, h, w, o, k, stride, pad, device):
    g = Graph("conv")
    x_t, w_t = TensorType((n, c, h, w)), TensorType((o, c, k, k))
    x, wt, b = g.add_input("x", x_t), g.add_parameter("w", w_t), g.add_parameter("b", TensorType((o,)))
    y = g.add("conv2d", [x, wt], stride=stride, padding=pad)
    y_t = g.type(y)
    g.set_output("conv", g.add("relu", [g.add("add", [y, g.add("reshape", [b], shape=(o, 1, 1))])]))
    dy = g.add_input("dy", y_t)
    g.set_output("grad_input", g.add("conv2d_grad_input", [dy, wt], stride=stride, padding=pad, input_shape=x_t.shape))
    g.set_output("grad_weight", g.add("conv2d_grad_weight", [x, dy], stride=stride, padding=pad, weight_shape=w_t.shape))
    inputs = {"x": _data(x_t), "dy": _data(y_t)}
    params = {"w": _data(w_t), "b": _data(TensorType((o,)))}
    terms = max(c * k * k, o * k * k, n * y_t.shape[2] * y_t.shape[3])
    tol = (1e-5, 1e-5 * math.sqrt(terms))
    planned = _compile_and_compare(g, inputs, params, tol={k_: tol for k_ in g.outputs}, device=device)
    assert kernel_counts(planned) == {"conv2d": 1, "conv2d_grad_input": 1, "conv2d_grad_weight": 1}


@pytest.mark.parametrize("shape,k,s,p,ceil", [((2, 3, 28, 28), 2, 2, 0, False), ((2, 3, 7, 6), 3, 2, 1, False),
                                              ((3, 2, 9, 8), (3, 2), (1, 2), (1, 0), False), ((2, 2, 7, 5), 2, 2, 0, True),
                                              ((1, 3, 8, 5), 3, 2, 1, True), ((64, 6, 28, 28), 2, 2, 0, False)])
def test_max_pool_and_grad_bitwise_equal_to_the_interpreter(shape, k, s, p, ceil, device):
    g = Graph("pool")
    x_t = TensorType(shape)
    x = g.add_input("x", x_t)
    y = g.add("max_pool2d", [x], kernel=k, stride=s, padding=p, ceil_mode=ceil)
    g.set_output("pool", y)
    dy_t = g.type(y)
    g.set_output("grad", g.add("max_pool2d_grad", [x, g.add_input("dy", dy_t)], kernel=k, stride=s, padding=p,
                               ceil_mode=ceil))
    xs = _data(x_t)
    xs[..., ::3, 1::2] = 0.0  # ties (all-zero windows after a ReLU): the first maximum takes the gradient
    xs[:, :, 0, :] = np.maximum(xs[:, :, 0, :], 0.25)
    if shape[0] < 4:
        xs[0, 0, 1, 1] = np.nan  # a NaN is its window's maximum
    dys = _data(dy_t)
    dys[..., 0, 0] = -0.0  # a window's sum from zero makes it +0
    inputs = {"x": xs, "dy": dys}
    expect = run(g, inputs).outputs
    planned, got = run_compiled(g, device, inputs, {})
    for name in expect:
        assert got[name].tobytes() == expect[name].tobytes(), name
    assert kernel_counts(planned) == {"max_pool2d": 1, "max_pool2d_grad": 1}


def test_max_pool_random_geometries_bitwise_equal_to_the_interpreter(device):
    """Twelve seeded random geometries (kernel 1-4, stride 1-3, padding up to half the kernel,
    odd sizes, ceil_mode, rounded inputs full of ties) in one graph: one compile."""
    r = np.random.default_rng(11)
    g, inputs = Graph("pools"), {}
    for i in range(12):
        kh, kw = (int(v) for v in r.integers(1, 5, 2))
        ph, pw = int(r.integers(0, kh // 2 + 1)), int(r.integers(0, kw // 2 + 1))
        shape = (int(r.integers(1, 3)), int(r.integers(1, 4)), int(r.integers(max(1, kh - 2 * ph), 10)),
                 int(r.integers(max(1, kw - 2 * pw), 10)))
        attrs = dict(kernel=(kh, kw), stride=tuple(int(v) for v in r.integers(1, 4, 2)), padding=(ph, pw),
                     ceil_mode=bool(r.integers(0, 2)))
        x = g.add_input(f"x{i}", TensorType(shape))
        y = g.add("max_pool2d", [x], **attrs)
        g.set_output(f"pool{i}", y)
        g.set_output(f"grad{i}", g.add("max_pool2d_grad", [x, g.add_input(f"dy{i}", g.type(y))], **attrs))
        inputs[f"x{i}"] = np.round(_data(TensorType(shape)))
        inputs[f"dy{i}"] = _data(g.type(y))
    expect = run(g, inputs).outputs
    _, got = run_compiled(g, device, inputs, {})
    for name in expect:
        assert got[name].tobytes() == expect[name].tobytes(), name


def test_fused_chain_is_one_kernel_and_matches(device):
    g = Graph("chain")
    ts = TensorType((17, 33))
    a, b, c = (g.add_input(k, ts) for k in "abc")
    g.set_output("y", g.add("relu", [g.add("add", [g.add("mul", [a, b]), c])]))
    planned = _compile_and_compare(g, {k: _data(ts) for k in "abc"}, device=device)
    assert kernel_counts(planned) == {"pointwise": 1}


def test_every_op_has_a_cpu_lowering_path():
    """Every op is either lowered by a kernel kind or handled as a source/alias (see fusion.py)."""
    from ember.passes import fusion
    handled = (fusion.ELEMENTWISE | fusion.VIEWS | fusion.REDUCTIONS | fusion.SOURCES | fusion.CONV_OPS | fusion.POOL_OPS
               | {"matmul", "fused", "fused_output"})  # the last two: what fusion makes
    # Collectives are fused into "collective" kernels, which the CPU step refuses by design (it has
    # no communicator): test_cpp_collectives.py checks that message.
    handled |= fusion.COLLECTIVES
    # Ops listed as interpreter-only are refused with a message naming device='reference'
    # (tests/frontends/test_from_torch_ops.py checks it); every other op must have a kernel kind.
    handled |= fusion.INTERPRETER_ONLY
    assert set(OPS) <= handled, sorted(set(OPS) - handled)
    # and today there are none: every op compiles on cpu and cuda (max pooling was the last)
    assert not fusion.INTERPRETER_ONLY, sorted(fusion.INTERPRETER_ONLY)


def test_vectorisable_exp_is_within_two_ulp_over_the_whole_range():
    xs = np.concatenate([np.linspace(-110, 95, 200_001, dtype=np.float32),
                         np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32)])
    g = Graph("exp")
    x = g.add_input("x", TensorType(xs.shape))
    g.set_output("e", g.add("exp", [x]))
    got = CpuExecutor(cpu_plan(g), HostStorage())({"x": xs})["e"]
    with np.errstate(over="ignore"):
        want = np.exp(xs.astype(np.float64)).astype(np.float32)
    normal = np.isfinite(want) & (want >= np.finfo(np.float32).tiny)
    ulp = np.abs(got[normal].view(np.int32).astype(np.int64) - want[normal].view(np.int32).astype(np.int64))
    assert ulp.max() <= 2
    subnormal = (want > 0) & (want < np.finfo(np.float32).tiny)
    assert np.abs(got[subnormal] - want[subnormal]).max() <= 2e-45
    assert np.isnan(got[-5]) and got[-4] == np.inf and got[-3] == 0.0 and got[-2] == 1.0 and got[-1] == 1.0
    assert np.all(np.isinf(got[(xs > 88.73) & np.isfinite(xs)]))
    assert np.all(got[xs < -103.98] == 0.0)  # computed as e^0 there (no subnormal assists), then 0


def test_vectorisable_erf_is_within_two_ulp_and_keeps_its_special_values():
    """em_erf (the prelude's polynomial erf, tools/fit_erf.py) against float64 erf rounded to
    float32, over [-5, 5], tiny and subnormal arguments, and the special values."""
    import math
    xs = np.concatenate([np.linspace(-5, 5, 200_001, dtype=np.float32),
                         np.logspace(-44, 0, 2001).astype(np.float32),
                         np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0], np.float32)])
    g = Graph("erf")
    x = g.add_input("x", TensorType(xs.shape))
    g.set_output("e", g.add("erf", [x]))
    got = CpuExecutor(cpu_plan(g), HostStorage())({"x": xs})["e"]
    want = np.array([math.erf(float(v)) if np.isfinite(v) else np.nan for v in xs], np.float32)
    finite = np.isfinite(xs)
    normal = finite & (np.abs(want) >= np.finfo(np.float32).tiny)
    ulp = np.abs(got[normal].view(np.int32).astype(np.int64) - want[normal].view(np.int32).astype(np.int64))
    assert ulp.max() <= 2, (ulp.max(), xs[normal][ulp.argmax()])
    tiny = finite & ~normal
    assert np.abs(got[tiny] - want[tiny]).max() <= 2e-45
    assert np.array_equal(np.sign(got[finite]), np.sign(xs[finite]))  # odd, and erf(-0) = -0's sign kept
    assert np.isnan(got[-7]) and got[-6] == 1.0 and got[-5] == -1.0 and got[-4] == 0.0 and np.signbit(got[-3])


def test_exp_for_normal_results_has_em_exps_bits(tmp_path):
    """em_exp_normal (em_erf's exp, without em_exp's clamps and selects) gives em_exp's bits
    wherever its caller may use it: every 61st float in [-87, 88], every float near 0."""
    import ctypes
    from ember.codegen.compiler import compile_cpp
    from ember.codegen.cpp_units import prelude
    from ember.codegen.cpu_vector import cxx_flags, resolve
    name, text = prelude()
    source = text + '''
extern "C" int64_t mismatches(uint32_t first, uint32_t last, uint32_t stride) {
  int64_t bad = 0;
  for (uint64_t b = first; b <= last; b += stride) {
    const float x = __builtin_bit_cast(float, static_cast<uint32_t>(b));
    bad += __builtin_bit_cast(uint32_t, em_exp(x)) != __builtin_bit_cast(uint32_t, em_exp_normal(x));
  }
  return bad;
}
'''
    lib = ctypes.CDLL(str(compile_cpp(source, flags=cxx_flags(resolve()), cache=tmp_path).path))
    lib.mismatches.restype = ctypes.c_int64
    bits = lambda v: int(np.array(v, np.float32).view(np.uint32))  # noqa: E731
    assert lib.mismatches(0x80000000, bits(-87.0), 61) == 0     # negative: -0 down to -87
    assert lib.mismatches(0, bits(88.0), 61) == 0               # positive: 0 up to 88
    assert lib.mismatches(bits(-1e-3), bits(-1e-3) + 2_000_000, 1) == 0
    assert lib.mismatches(bits(-18.1) - 1_000_000, bits(-18.1), 1) == 0


@pytest.mark.parametrize("src,mid,out", [
    ((4, 6), (24,), (3, 24)),         # the reshaped coordinate splits from i % 24: ((i / 6) % 4, i % 6)
    ((2, 3, 4), (6, 4), (5, 6, 4)),   # splits from i / 4 % 6 into a coordinate and its own % 3
    ((6, 5), (2, 15), (2, 2, 15)),    # mixed-radix split: 15 = 3 * 5 over 6 * 5
    ((3, 8), (24, 1), (24, 7)),       # a split coordinate broadcast along the last axis
])
def test_reshape_then_broadcast_inside_one_pointwise_kernel(src, mid, out):
    """A reshape feeding a broadcast in the same fused kernel: the kernel's flat index is split
    into the operand's coordinates (`codegen.indexing`), each of which needs its `% d`."""
    g = Graph("reshape_broadcast")
    a, b = g.add_input("a", TensorType(src)), g.add_input("b", TensorType(out))
    r = g.add("reshape", [a], shape=mid)  # a view: fused into the consumer, read through the split
    g.set_output("out", g.add("mul", [g.add("add", [r, b]), b]))
    planned = _compile_and_compare(g, {"a": _data(TensorType(src)), "b": _data(TensorType(out))})
    assert kernel_counts(planned).get("pointwise", 0) == 1  # really one fused kernel


F64_TOL = (1e-12, 1e-12)  # float64: the same formulas, summation order aside (16-64 terms)


def test_float64_pointwise_and_reduction_compile():
    g = Graph("f64")
    t = TensorType((6, 16), "float64")
    a, b = g.add_input("a", t), g.add_input("b", t)
    g.set_output("pointwise", g.add("mul", [g.add("exp", [a]), g.add("tanh", [b])]))
    g.set_output("sum", g.add("sum", [g.add("mul", [a, b])], axes=(1,)))
    g.set_output("max", g.add("max", [a], axes=(0,)))
    inputs = {"a": _data(t), "b": _data(t)}
    _compile_and_compare(g, inputs, tol={k: F64_TOL for k in ("pointwise", "sum", "max")})


def test_float64_max_of_negative_values_starts_below_them():
    # A float64 max's accumulator is double, as the blocked float sums' totals are; it must start at
    # -inf, not at those totals' 0.0 (columns of negative values came back 0)
    g = Graph("f64_max")
    t = TensorType((6, 16), "float64")
    a = g.add_input("a", t)
    g.set_output("max", g.add("max", [a], axes=(0,)))
    g.set_output("argmax", g.add("argmax", [a], axis=0))
    inputs = {"a": -np.abs(_data(t)) - 0.5}
    _compile_and_compare(g, inputs, tol={k: F64_TOL for k in ("max", "argmax")})


def test_float64_matmul_compiles_or_is_refused_clearly():
    g = Graph("f64_matmul")
    a, b = g.add_input("a", TensorType((5, 16), "float64")), g.add_input("b", TensorType((16, 3), "float64"))
    g.set_output("out", g.add("matmul", [a, b]))
    inputs = {"a": _data(TensorType((5, 16), "float64")), "b": _data(TensorType((16, 3), "float64"))}
    # The contraction templates are float32 and bfloat16 kernels: float64 is refused before g++ runs.
    with pytest.raises(NotImplementedError, match=r"device='cpu' compiles matmul for float32 and bfloat16 only, got float64"):
        _compile_and_compare(g, inputs, tol={"out": F64_TOL})
