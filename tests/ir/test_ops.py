"""Every primitive op of ember.ir: its type rule (good and bad operands) and the NumPy reference
interpreter against PyTorch's forward, on random shapes drawn by hypothesis.

Tolerances (float32, values drawn from [-1, 1] or a similarly tame domain):
  elementwise and reductions over few terms   rtol 1e-5, atol 1e-6
  sums over n terms                            atol 1e-6 * sqrt(n)
  contractions over K terms (matmul, conv)     rtol 1e-5, atol 2e-6 * sqrt(K)
float64 precision mode (precision="float64" on a float32 graph) is compared with torch in float64
at rtol 1e-12, atol 1e-12 (times sqrt(K) for contractions).
"""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as TF
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from conftest import torch_threads
from ember.ir import OPS, Graph, ShapeError, TensorType, bool_, float32, float64, int32, int64, run
from ember.ir.ops import BINARY, COMPARE, UNARY



@pytest.fixture(scope="module", autouse=True)
def _torch_threads():
    with torch_threads(1):  # this module's figures were measured with 1; restored after it
        yield

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PRECISIONS = st.sampled_from([None, "float64"])
LOC = "user_model.py:42"

TESTED: set[str] = set()  # ops exercised against torch below; checked by test_every_op_is_tested


def covers(*ops: str):
    TESTED.update(ops)

    def deco(f):
        return f
    return deco


# ---- helpers ---------------------------------------------------------------------------------

def graph_of(op: str, types: list[TensorType], **attrs) -> Graph:
    g = Graph(op)
    ins = [g.add_input(f"in{i}", t) for i, t in enumerate(types)]
    g.set_output("out", g.add(op, ins, loc=LOC, **attrs))
    return g.verify()


def interp(op: str, arrays: list[np.ndarray], precision: str | None = None, **attrs) -> np.ndarray:
    """Runs one op through the interpreter; checks the value against the node's type."""
    g = graph_of(op, [TensorType.of(a) for a in arrays], **attrs)
    out = run(g, {f"in{i}": a for i, a in enumerate(arrays)}, precision=precision).outputs["out"]
    t = g.type(g.outputs["out"])
    assert out.shape == t.shape, f"{op}: interpreter gave shape {out.shape}, the rule says {t.shape}"
    want = np.float64 if precision == "float64" and t.dtype.is_float else t.dtype.numpy
    assert out.dtype == want, f"{op}: interpreter gave dtype {out.dtype}, expected {np.dtype(want)}"
    return out


def T(a: np.ndarray, precision: str | None = None) -> torch.Tensor:
    a = np.asarray(a)
    if precision == "float64" and a.dtype.kind == "f":
        a = a.astype(np.float64)
    return torch.from_numpy(np.asarray(a, order="C"))  # (ascontiguousarray makes 0-d arrays 1-d)


def close(out: np.ndarray, ref: torch.Tensor, precision: str | None, *, rtol=1e-5, atol=1e-6, k: int = 1) -> None:
    ref = ref.detach().numpy()
    if out.dtype.kind in "biu" or out.dtype == np.bool_:
        np.testing.assert_array_equal(out, ref)
        return
    if precision == "float64":
        rtol, atol = 1e-12, 1e-12
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=atol * math.sqrt(k))


def rand(rng: np.random.Generator, shape, low=-1.0, high=1.0, dtype=np.float32) -> np.ndarray:
    return rng.uniform(low, high, size=shape).astype(dtype)


seeds = st.integers(0, 2**32 - 1)
shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=1, max_side=5)


def expect_shape_error(op: str, types: list[TensorType], *fragments: str, **attrs) -> str:
    g = Graph("bad")
    ins = [g.add_input(f"in{i}", t) for i, t in enumerate(types)]
    with pytest.raises(ShapeError) as ei:
        g.add(op, ins, loc=LOC, **attrs)
    msg = str(ei.value)
    assert op in msg, msg
    for t in types:
        assert str(t) in msg, f"operand {t} missing from: {msg}"
    assert LOC in msg, msg
    for f in fragments:
        assert f in msg, f"{f!r} missing from: {msg}"
    return msg


def f32(*shape) -> TensorType:
    return TensorType(shape, float32)


# ---- elementwise -----------------------------------------------------------------------------

TORCH_UNARY = {
    "neg": (torch.neg, (-1, 1)), "exp": (torch.exp, (-3, 3)), "log": (torch.log, (0.05, 4)),
    "sqrt": (torch.sqrt, (0.0, 4)), "reciprocal": (torch.reciprocal, (0.1, 2)), "relu": (torch.relu, (-1, 1)),
    "sigmoid": (torch.sigmoid, (-12, 12)), "tanh": (torch.tanh, (-4, 4)), "abs": (torch.abs, (-1, 1)),
    "erf": (torch.erf, (-3, 3)), "sin": (torch.sin, (-4, 4)), "cos": (torch.cos, (-4, 4)),
    "floor": (torch.floor, (-5, 5)),
}


@covers(*UNARY)
@pytest.mark.parametrize("op", UNARY)
@SETTINGS
@given(shape=shapes, seed=seeds, precision=PRECISIONS, negate=st.booleans())
def test_unary_vs_torch(op, shape, seed, precision, negate):
    fn, (lo, hi) = TORCH_UNARY[op]
    x = rand(np.random.default_rng(seed), shape, lo, hi)
    if negate and op == "reciprocal":
        x = -x
    close(interp(op, [x], precision), fn(T(x, precision)), precision)


def test_sigmoid_extremes_do_not_warn():
    x = np.array([-1e4, -100.0, -20.0, 0.0, 20.0, 100.0, 1e4], np.float32)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        out = interp("sigmoid", [x])
    np.testing.assert_allclose(out, torch.sigmoid(T(x)).numpy(), rtol=1e-6, atol=1e-30)  # torch flushes denormals


@covers("neg", "abs", "relu")
@pytest.mark.parametrize("op", ["neg", "abs", "relu"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_integer_unary(op, dtype):
    x = np.arange(-5, 6, dtype=dtype).reshape(1, 11)
    out = interp(op, [x])
    close(out, TORCH_UNARY[op][0](T(x)), None)


@pytest.mark.parametrize("op", [o for o in UNARY if o not in ("neg", "abs", "relu")])
def test_float_only_unary_rejects_integers(op):
    expect_shape_error(op, [TensorType((2, 3), int32)], "floating-point")


TORCH_BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
                "maximum": torch.maximum, "minimum": torch.minimum}
TORCH_COMPARE = {"eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge}


@covers(*BINARY)
@pytest.mark.parametrize("op", BINARY)
@SETTINGS
@given(shapes=hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=4, max_side=4),
       seed=seeds, precision=PRECISIONS)
def test_binary_broadcasting_vs_torch(op, shapes, seed, precision):
    rng = np.random.default_rng(seed)
    a, b = (rand(rng, s) for s in shapes.input_shapes)
    if op == "div":
        b = np.where(np.abs(b) < 0.1, np.float32(0.5), b).astype(np.float32)
    out = interp(op, [a, b], precision)
    assert out.shape == shapes.result_shape
    close(out, TORCH_BINARY[op](T(a, precision), T(b, precision)), precision)


@covers(*BINARY)
@pytest.mark.parametrize("op", BINARY)
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_integer_binary(op, dtype):
    rng = np.random.default_rng(1)
    a = rng.integers(-20, 20, size=(3, 4)).astype(dtype)
    b = rng.integers(1, 7, size=(4,)).astype(dtype) * np.array([1, -1, 1, -1], dtype)
    out = interp(op, [a, b])
    if op == "div":  # integer division floors (NumPy's //), as torch's rounding_mode="floor"
        ref = torch.div(T(a), T(b), rounding_mode="floor")
    else:
        ref = TORCH_BINARY[op](T(a), T(b))
    assert out.dtype == dtype
    close(out, ref, None)


@pytest.mark.parametrize("op", ["maximum", "minimum", "add", "mul"])
def test_bool_binary_that_numpy_and_torch_agree_on(op):
    a = np.array([True, False, True, False])
    b = np.array([True, True, False, False])
    close(interp(op, [a, b]), TORCH_BINARY[op](T(a), T(b)), None)


@pytest.mark.parametrize("op,arity", [("neg", 1), ("sub", 2), ("div", 2)])
def test_bool_arithmetic_without_a_meaning_is_refused(op, arity):
    expect_shape_error(op, [TensorType((4,), bool_)] * arity, "bool")


@covers(*COMPARE)
@pytest.mark.parametrize("op", COMPARE)
@SETTINGS
@given(shapes=hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=4, max_side=4),
       seed=seeds, dtype=st.sampled_from([np.float32, np.int32, np.int64]))
def test_compare_vs_torch(op, shapes, seed, dtype):
    rng = np.random.default_rng(seed)
    a, b = (rng.integers(-2, 3, size=s).astype(dtype) for s in shapes.input_shapes)  # ties happen
    out = interp(op, [a, b])
    assert out.dtype == np.bool_
    close(out, TORCH_COMPARE[op](T(a), T(b)), None)


@pytest.mark.parametrize("op", BINARY + COMPARE)
def test_binary_bad_shapes_and_dtypes(op):
    expect_shape_error(op, [f32(2, 3), f32(4)], "do not broadcast")
    expect_shape_error(op, [f32(2, 3), f32(3, 2)], "do not broadcast")
    expect_shape_error(op, [f32(2, 3), TensorType((2, 3), int32)], "dtypes differ")
    expect_shape_error(op, [f32(2, 3)], "takes 2 operand")


def test_binary_good_shape_rule():
    g = Graph()
    a, b = g.add_input("a", f32(5, 1, 3)), g.add_input("b", f32(4, 1))
    assert g.type(g.add("add", [a, b])) == f32(5, 4, 3)
    assert g.type(g.add("lt", [a, b])) == TensorType((5, 4, 3), bool_)
    s = g.add_input("s", f32())
    assert g.type(g.add("mul", [s, a])) == f32(5, 1, 3)
    z = g.add_input("z", f32(0, 3))
    assert g.type(g.add("sub", [z, g.add_input("o", f32(1, 3))])) == f32(0, 3)


@covers("where")
@SETTINGS
@given(shapes=hnp.mutually_broadcastable_shapes(num_shapes=3, min_dims=0, max_dims=4, max_side=4),
       seed=seeds, precision=PRECISIONS)
def test_where_vs_torch(shapes, seed, precision):
    rng = np.random.default_rng(seed)
    sc, sa, sb = shapes.input_shapes
    cond = rng.random(sc) < 0.5
    a, b = rand(rng, sa), rand(rng, sb)
    out = interp("where", [np.asarray(cond), a, b], precision)
    close(out, torch.where(T(np.asarray(cond)), T(a, precision), T(b, precision)), precision)


def test_where_bad():
    b3 = TensorType((3,), bool_)
    expect_shape_error("where", [f32(3), f32(3), f32(3)], "must be bool")
    expect_shape_error("where", [b3, f32(3), TensorType((3,), int32)], "dtypes differ")
    expect_shape_error("where", [TensorType((2,), bool_), f32(3), f32(3)], "do not broadcast")


@covers("cast")
@pytest.mark.parametrize("src,dst", [
    (np.float32, "int32"), (np.float32, "int64"), (np.float32, "bool"), (np.float32, "float64"),
    (np.int32, "float32"), (np.int64, "int32"), (np.bool_, "float32"), (np.int32, "bool"), (np.float64, "float32"),
])
def test_cast_vs_torch(src, dst):
    rng = np.random.default_rng(0)
    x = (rng.uniform(-5, 5, size=(3, 4)) * (rng.random((3, 4)) < 0.8)).astype(src)  # zeros included
    out = interp("cast", [x], dtype=dst)
    ref = T(x).to(getattr(torch, dst))
    assert out.dtype == np.dtype(dst)
    np.testing.assert_array_equal(out, ref.numpy())


@covers("stop_gradient")
def test_stop_gradient_is_the_identity_like_detach():
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_array_equal(interp("stop_gradient", [x]), T(x).detach().numpy())
    assert not OPS["stop_gradient"].differentiable


def test_cast_bad_dtype():
    msg = expect_shape_error("cast", [f32(3)], "bad attribute", dtype="float16")
    assert "dtype" in msg
    expect_shape_error("cast", [f32(3)], "missing attribute")


# ---- reductions ------------------------------------------------------------------------------

@st.composite
def shape_and_axes(draw, min_dims=0):
    shape = draw(hnp.array_shapes(min_dims=min_dims, max_dims=4, min_side=1, max_side=5))
    axes = sorted(draw(st.sets(st.integers(0, len(shape) - 1), min_size=1)) if shape else ())
    return shape, tuple(axes)


@covers("sum", "max")
@pytest.mark.parametrize("op", ["sum", "max"])
@SETTINGS
@given(sa=shape_and_axes(min_dims=1), keepdims=st.booleans(), seed=seeds, precision=PRECISIONS)
def test_reductions_vs_torch(op, sa, keepdims, seed, precision):
    shape, axes = sa
    x = rand(np.random.default_rng(seed), shape)
    out = interp(op, [x], precision, axes=axes, keepdims=keepdims)
    fn = torch.sum if op == "sum" else torch.amax
    n = int(np.prod([shape[a] for a in axes]))
    close(out, fn(T(x, precision), dim=axes, keepdim=keepdims), precision, k=n)


@pytest.mark.parametrize("op", ["sum", "max"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_integer_reductions(op, dtype):
    x = np.arange(24, dtype=dtype).reshape(2, 3, 4) - 7
    out = interp(op, [x], axes=(0, 2), keepdims=False)
    assert out.dtype == dtype
    fn = torch.sum if op == "sum" else torch.amax
    np.testing.assert_array_equal(out, fn(T(x), dim=(0, 2)).numpy())


def test_reduction_shape_rule():
    g = Graph()
    x = g.add_input("x", f32(2, 3, 4))
    assert g.type(g.add("sum", [x], axes=(0, 2))) == f32(3)
    assert g.type(g.add("sum", [x], axes=(0, 2), keepdims=True)) == f32(1, 3, 1)
    assert g.type(g.add("max", [x], axes=(0, 1, 2))) == f32()
    assert g.type(g.add("sum", [x], axes=())) == f32(2, 3, 4)  # no axes: identity, as NumPy
    s = g.add_input("s", f32())
    assert g.type(g.add("sum", [s], axes=())) == f32()


def test_reduction_over_no_axes_is_identity():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(interp("sum", [x], axes=()), x)


@pytest.mark.parametrize("op", ["sum", "max"])
def test_reduction_bad(op):
    expect_shape_error(op, [f32(2, 3)], "out of range", axes=(2,))
    expect_shape_error(op, [f32(2, 3)], "sorted", axes=(1, 0))
    expect_shape_error(op, [f32(2, 3)], "sorted", axes=(-1,))
    expect_shape_error(op, [f32(2, 3)], "repeated", axes=(1, 1))
    expect_shape_error(op, [f32(2, 3)], "missing attribute")


@covers("argmax")
@SETTINGS
@given(shape=hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=5), data=st.data(), seed=seeds,
       ints=st.booleans())
def test_argmax_vs_torch(shape, data, seed, ints):
    axis = data.draw(st.integers(0, len(shape) - 1))
    rng = np.random.default_rng(seed)
    # small integers make ties; both pick the first maximum
    x = rng.integers(-2, 3, size=shape).astype(np.int32) if ints else rand(rng, shape)
    out = interp("argmax", [x], axis=axis)
    assert out.dtype == np.int64
    np.testing.assert_array_equal(out, torch.argmax(T(x), dim=axis).numpy())


def test_argmax_bad():
    expect_shape_error("argmax", [f32(2, 3)], "out of range", axis=2)
    expect_shape_error("argmax", [f32()], "out of range", axis=0)


# ---- layout ----------------------------------------------------------------------------------

@st.composite
def reshapes(draw):
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=1, max_side=4))
    n = int(np.prod(shape))
    # a random factorisation of n into up to 4 factors (1s allowed)
    new, rest = [], n
    for _ in range(draw(st.integers(0, 3))):
        divs = [d for d in range(1, rest + 1) if rest % d == 0]
        d = draw(st.sampled_from(divs))
        new.append(d)
        rest //= d
    if rest != 1 or draw(st.booleans()):
        new.append(rest)
    return shape, tuple(draw(st.permutations(new)))


@covers("reshape")
@SETTINGS
@given(sh=reshapes(), seed=seeds)
def test_reshape_vs_torch(sh, seed):
    shape, new = sh
    x = rand(np.random.default_rng(seed), shape)
    close(interp("reshape", [x], shape=new), torch.reshape(T(x), new), None, rtol=0, atol=0)


def test_reshape_bad():
    expect_shape_error("reshape", [f32(2, 3)], "cannot reshape", shape=(4, 2))
    expect_shape_error("reshape", [f32(2, 3)], "cannot reshape", shape=(-1, 6))
    expect_shape_error("reshape", [f32(2, 3)], "cannot reshape", shape=(-2, -3))


@covers("transpose")
@SETTINGS
@given(shape=hnp.array_shapes(min_dims=0, max_dims=5, min_side=1, max_side=4), data=st.data(), seed=seeds)
def test_transpose_vs_torch(shape, data, seed):
    perm = tuple(data.draw(st.permutations(range(len(shape)))))
    x = rand(np.random.default_rng(seed), shape)
    out = interp("transpose", [x], perm=perm)
    assert out.flags.c_contiguous
    close(out, torch.permute(T(x), perm), None, rtol=0, atol=0)


def test_transpose_bad():
    expect_shape_error("transpose", [f32(2, 3)], "not a permutation", perm=(0,))
    expect_shape_error("transpose", [f32(2, 3)], "not a permutation", perm=(0, 0))
    expect_shape_error("transpose", [f32(2, 3)], "not a permutation", perm=(1, 2))


@covers("broadcast_to")
@SETTINGS
@given(shapes=hnp.mutually_broadcastable_shapes(num_shapes=1, min_dims=0, max_dims=4, max_side=4), seed=seeds)
def test_broadcast_to_vs_torch(shapes, seed):
    (src,), dst = shapes.input_shapes, shapes.result_shape
    x = rand(np.random.default_rng(seed), src)
    out = interp("broadcast_to", [x], shape=dst)
    close(out, torch.broadcast_to(T(x), dst), None, rtol=0, atol=0)


def test_broadcast_to_bad():
    expect_shape_error("broadcast_to", [f32(2, 3)], "cannot broadcast", shape=(3,))
    expect_shape_error("broadcast_to", [f32(2, 3)], "(4, 3)", shape=(4, 3))
    expect_shape_error("broadcast_to", [f32(2, 1)], "cannot broadcast", shape=(1, 3))


# ---- contractions ----------------------------------------------------------------------------

@covers("matmul")
@SETTINGS
@given(batch=hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=3, max_side=3),
       m=st.integers(1, 6), k=st.integers(1, 40), n=st.integers(1, 6), seed=seeds, precision=PRECISIONS)
def test_matmul_vs_torch(batch, m, k, n, seed, precision):
    rng = np.random.default_rng(seed)
    ba, bb = batch.input_shapes
    a, b = rand(rng, ba + (m, k)), rand(rng, bb + (k, n))
    out = interp("matmul", [a, b], precision)
    assert out.shape == batch.result_shape + (m, n)
    close(out, torch.matmul(T(a, precision), T(b, precision)), precision, atol=2e-6, k=k)


def test_matmul_large_k_tolerance():
    rng = np.random.default_rng(0)
    a, b = rand(rng, (8, 4096)), rand(rng, (4096, 8))
    close(interp("matmul", [a, b]), torch.matmul(T(a), T(b)), None, atol=2e-6, k=4096)


def test_matmul_bad():
    expect_shape_error("matmul", [f32(3), f32(3, 2)], "rank >= 2")
    expect_shape_error("matmul", [f32(2, 3), f32(4, 2)], "contraction mismatch")
    expect_shape_error("matmul", [f32(2, 2, 3), f32(3, 3, 2)], "do not broadcast")
    expect_shape_error("matmul", [TensorType((2, 3), int32), TensorType((3, 2), int32)], "floating-point")
    expect_shape_error("matmul", [f32(2, 3), TensorType((3, 2), float64)], "dtypes differ")


@st.composite
def conv_cases(draw):
    """(x shape, weight shape, stride, padding, groups): groups 1, 2 or 3 with 1-3 input and 1-2
    output channels a group (groups == C, depthwise, among them)."""
    groups = draw(st.sampled_from([1, 1, 2, 3]))
    n, cg = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    o = groups * draw(st.integers(1, 2)) if groups > 1 else draw(st.integers(1, 4))
    kh, kw = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    sh, sw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    ph, pw = draw(st.integers(0, 2)), draw(st.integers(0, 2))
    # odd and even sizes, large enough for at least one output pixel
    h = draw(st.integers(max(1, kh - 2 * ph), 11))
    w = draw(st.integers(max(1, kw - 2 * pw), 11))
    return (n, cg * groups, h, w), (o, cg, kh, kw), (sh, sw), (ph, pw), groups


@covers("conv2d")
@SETTINGS
@given(case=conv_cases(), seed=seeds, precision=PRECISIONS)
def test_conv2d_vs_torch(case, seed, precision):
    xs, ws, stride, padding, groups = case
    rng = np.random.default_rng(seed)
    x, w = rand(rng, xs), rand(rng, ws)
    out = interp("conv2d", [x, w], precision, stride=stride, padding=padding, groups=groups)
    ref = TF.conv2d(T(x, precision), T(w, precision), stride=stride, padding=padding, groups=groups)
    close(out, ref, precision, atol=2e-6, k=ws[1] * ws[2] * ws[3])


@pytest.mark.parametrize("stride,padding", [(1, 0), (1, 1), (2, 0), (2, 1), ((1, 2), (2, 0)), (3, 2)])
def test_conv2d_grid(stride, padding):
    rng = np.random.default_rng(0)
    x, w = rand(rng, (2, 3, 13, 10)), rand(rng, (4, 3, 3, 5))
    out = interp("conv2d", [x, w], stride=stride, padding=padding)
    ref = TF.conv2d(T(x), T(w), stride=stride, padding=padding)
    close(out, ref, None, atol=2e-6, k=45)


@covers("conv2d_grad_input")
@SETTINGS
@given(case=conv_cases(), seed=seeds, precision=PRECISIONS)
def test_conv2d_grad_input_vs_torch(case, seed, precision):
    xs, ws, stride, padding, groups = case
    rng = np.random.default_rng(seed)
    w = rand(rng, ws)
    ys = TF.conv2d(torch.zeros(xs), torch.zeros(ws), stride=stride, padding=padding, groups=groups).shape
    dy = rand(rng, tuple(ys))
    out = interp("conv2d_grad_input", [dy, w], precision, stride=stride, padding=padding, groups=groups, input_shape=xs)
    ref = torch.nn.grad.conv2d_input(xs, T(w, precision), T(dy, precision), stride=stride, padding=padding,
                                     groups=groups)
    close(out, ref, precision, atol=2e-6, k=ws[0] * ws[2] * ws[3])


@covers("conv2d_grad_weight")
@SETTINGS
@given(case=conv_cases(), seed=seeds, precision=PRECISIONS)
def test_conv2d_grad_weight_vs_torch(case, seed, precision):
    xs, ws, stride, padding, groups = case
    rng = np.random.default_rng(seed)
    x = rand(rng, xs)
    ys = TF.conv2d(torch.zeros(xs), torch.zeros(ws), stride=stride, padding=padding, groups=groups).shape
    dy = rand(rng, tuple(ys))
    out = interp("conv2d_grad_weight", [x, dy], precision, stride=stride, padding=padding, groups=groups,
                 weight_shape=ws)
    ref = torch.nn.grad.conv2d_weight(T(x, precision), ws, T(dy, precision), stride=stride, padding=padding,
                                      groups=groups)
    close(out, ref, precision, atol=2e-6, k=ys[0] * ys[2] * ys[3])


def test_conv2d_shape_rule():
    g = Graph()
    x, w = g.add_input("x", f32(64, 1, 28, 28)), g.add_input("w", f32(16, 1, 3, 3))
    assert g.type(g.add("conv2d", [x, w])) == f32(64, 16, 26, 26)
    assert g.type(g.add("conv2d", [x, w], stride=2, padding=1)) == f32(64, 16, 14, 14)
    assert g.type(g.add("conv2d", [x, w], stride=(3, 1), padding=(0, 2))) == f32(64, 16, 9, 30)
    dy = g.add_input("dy", f32(64, 16, 26, 26))
    assert g.type(g.add("conv2d_grad_input", [dy, w], input_shape=(64, 1, 28, 28))) == f32(64, 1, 28, 28)
    assert g.type(g.add("conv2d_grad_weight", [x, dy], weight_shape=(16, 1, 3, 3))) == f32(16, 1, 3, 3)
    # stride that skips the last rows: input 28 with stride 2, kernel 3 -> 13 outputs
    dy2 = g.add_input("dy2", f32(64, 16, 13, 13))
    assert g.type(g.add("conv2d_grad_input", [dy2, w], stride=2, input_shape=(64, 1, 28, 28))) == f32(64, 1, 28, 28)


def test_conv2d_bad():
    expect_shape_error("conv2d", [f32(1, 28, 28), f32(16, 1, 3, 3)], "4-D")
    expect_shape_error("conv2d", [f32(2, 3, 8, 8), f32(4, 2, 3, 3)], "channels")
    expect_shape_error("conv2d", [f32(2, 3, 4, 4), f32(4, 3, 5, 5)], "larger than")
    expect_shape_error("conv2d", [f32(2, 3, 8, 8), f32(4, 3, 3, 3)], "stride", stride=0)
    expect_shape_error("conv2d", [f32(2, 3, 8, 8), f32(4, 3, 3, 3)], "padding", padding=-1)
    expect_shape_error("conv2d", [f32(2, 3, 8, 8), TensorType((4, 3, 3, 3), float64)], "dtypes differ")
    expect_shape_error("conv2d", [TensorType((2, 3, 8, 8), int32)] * 2, "floating-point")
    expect_shape_error("conv2d", [f32(2, 3, 8, 8), f32(4, 3, 3, 3)], "bad attribute", stride=(1, 2, 3))
    expect_shape_error("conv2d", [f32(2, 3, 8, 8), f32(4, 3, 3, 3)], "unknown attribute", dilation=2)
    expect_shape_error("conv2d", [f32(2, 4, 8, 8), f32(3, 2, 3, 3)], "divide the 3 output channels", groups=2)
    expect_shape_error("conv2d", [f32(2, 4, 8, 8), f32(4, 2, 3, 3)], "groups must be >= 1", groups=0)
    expect_shape_error("conv2d", [f32(2, 4, 8, 8), f32(4, 1, 3, 3)], "expects 2 (1 per group x 2 groups)", groups=2)


def test_grouped_conv2d_shape_rule():
    g = Graph()
    x = g.add_input("x", f32(8, 6, 9, 9))
    assert g.type(g.add("conv2d", [x, g.add_input("w", f32(4, 3, 3, 3))], groups=2)) == f32(8, 4, 7, 7)
    dw = g.add_input("dw", f32(6, 1, 3, 3))  # depthwise: groups == C
    y = g.add("conv2d", [x, dw], stride=2, padding=1, groups=6)
    assert g.type(y) == f32(8, 6, 5, 5)
    assert g.type(g.add("conv2d_grad_input", [y, dw], stride=2, padding=1, groups=6, input_shape=(8, 6, 9, 9))) \
        == f32(8, 6, 9, 9)
    assert g.type(g.add("conv2d_grad_weight", [x, y], stride=2, padding=1, groups=6, weight_shape=(6, 1, 3, 3))) \
        == f32(6, 1, 3, 3)


def test_conv2d_grads_bad():
    expect_shape_error("conv2d_grad_input", [f32(2, 4, 5, 5), f32(4, 3, 3, 3)], "does not match",
                       input_shape=(2, 3, 8, 8))
    expect_shape_error("conv2d_grad_input", [f32(2, 4, 6, 6), f32(4, 3, 3, 3)], "missing attribute")
    expect_shape_error("conv2d_grad_weight", [f32(2, 3, 8, 8), f32(2, 4, 6, 5)], "does not match",
                       weight_shape=(4, 3, 3, 3))
    expect_shape_error("conv2d_grad_weight", [f32(2, 3, 8, 8), f32(2, 4, 6, 6)], "channels",
                       weight_shape=(4, 2, 3, 3))


# ---- indexing --------------------------------------------------------------------------------

@covers("one_hot")
@SETTINGS
@given(shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=6), classes=st.integers(1, 12),
       seed=seeds, dtype=st.sampled_from([np.int32, np.int64]), out=st.sampled_from(["float32", "int64", "float64"]))
def test_one_hot_vs_torch(shape, classes, seed, dtype, out):
    labels = np.random.default_rng(seed).integers(0, classes, size=shape).astype(dtype)
    got = interp("one_hot", [labels], num_classes=classes, dtype=out)
    ref = TF.one_hot(T(labels).long(), classes).to(getattr(torch, out))
    assert got.dtype == np.dtype(out)
    np.testing.assert_array_equal(got, ref.numpy())


def test_one_hot_bad():
    expect_shape_error("one_hot", [f32(4)], "integer labels", num_classes=3)
    expect_shape_error("one_hot", [TensorType((4,), bool_)], "integer labels", num_classes=3)
    expect_shape_error("one_hot", [TensorType((4,), int64)], "num_classes", num_classes=0)


# ---- random numbers ---------------------------------------------------------------------------

@covers("random_uniform")
def test_random_uniform_is_philox_and_uniform():
    # No PyTorch counterpart (its generators are other algorithms): checked against the generator
    # (whose known answers tests/frontends/test_dropout.py checks) and for uniformity.
    from ember.ir import philox
    step = np.asarray(5, np.int64)
    a = interp("random_uniform", [step], shape=(300, 100), seed=3, stream=2)
    assert a.dtype == np.float32 and a.shape == (300, 100)
    np.testing.assert_array_equal(a, philox.uniform((300, 100), 3, 5, 2))
    assert a.min() >= 0 and a.max() < 1 and np.all((a * 2**24) % 1 == 0)  # 24-bit grid of [0, 1)
    counts = np.histogram(a, bins=10, range=(0, 1))[0]
    assert np.all(np.abs(counts - 3000) < 5 * np.sqrt(3000 * 0.9)), counts
    for other in (dict(seed=4, stream=2), dict(seed=3, stream=3)):
        assert np.mean(a == interp("random_uniform", [step], shape=(300, 100), **other)) < 1e-3
    assert np.mean(a == interp("random_uniform", [np.asarray(6, np.int64)], shape=(300, 100), seed=3, stream=2)) < 1e-3


def test_random_uniform_bad():
    expect_shape_error("random_uniform", [f32()], "integer scalar", shape=(2,))
    expect_shape_error("random_uniform", [TensorType((2,), int64)], "integer scalar", shape=(2,))
    expect_shape_error("random_uniform", [TensorType((), int64)], "2**32", shape=(2,), stream=2**32)


# ---- pooling ---------------------------------------------------------------------------------

# (shape, kernel, stride, padding, ceil_mode); the ceil cases include a last window that
# overhangs the input ((5, 5) by 2 stride 2) and one dropped for starting in the padding
POOL_CASES = [((2, 3, 7, 6), 3, 2, 1, False), ((1, 2, 6, 6), 2, 2, 0, False), ((2, 1, 5, 5), 3, 1, 0, False),
              ((1, 1, 8, 5), (3, 2), (2, 1), (1, 0), False), ((2, 3, 7, 6), 3, 2, 1, True),
              ((1, 2, 5, 5), 2, 2, 0, True), ((1, 1, 8, 5), (3, 2), (2, 3), (1, 1), True), ((1, 1, 6, 6), 2, 3, 1, True)]


@covers("max_pool2d", "max_pool2d_grad")
@pytest.mark.parametrize("shape,k,s,p,ceil", POOL_CASES)
@pytest.mark.parametrize("precision", [None, "float64"])
def test_max_pool2d_and_grad_vs_torch(shape, k, s, p, ceil, precision):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    x[..., 0, :2] = 0.5  # ties: both pick the first maximum of the window
    out = interp("max_pool2d", [x], precision, kernel=k, stride=s, padding=p, ceil_mode=ceil)
    tx = T(x, precision).requires_grad_(True)
    ref = TF.max_pool2d(tx, k, s, p, ceil_mode=ceil)
    close(out, ref, precision)
    dy = rng.standard_normal(ref.shape).astype(np.float32)
    ref.backward(T(dy, precision))
    close(interp("max_pool2d_grad", [x, dy], precision, kernel=k, stride=s, padding=p, ceil_mode=ceil), tx.grad,
          precision)


@st.composite
def pool_cases(draw):
    kh, kw = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    ph, pw = draw(st.integers(0, kh // 2)), draw(st.integers(0, kw // 2))
    h, w = draw(st.integers(max(1, kh - 2 * ph), 9)), draw(st.integers(max(1, kw - 2 * pw), 9))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 3)), h, w)
    return shape, (kh, kw), (draw(st.integers(1, 3)), draw(st.integers(1, 3))), (ph, pw), draw(st.booleans())


@given(case=pool_cases(), seed=seeds, ties=st.booleans())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_max_pool2d_and_grad_vs_torch_hypothesis(case, seed, ties):
    shape, k, s, p, ceil = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    if ties:
        x = np.round(x).astype(np.float32)  # many equal values: the first maximum takes the gradient
    tx = T(x).requires_grad_(True)
    ref = TF.max_pool2d(tx, k, s, p, ceil_mode=ceil)
    close(interp("max_pool2d", [x], kernel=k, stride=s, padding=p, ceil_mode=ceil), ref, None)
    dy = rng.standard_normal(ref.shape).astype(np.float32)
    ref.backward(T(dy))
    close(interp("max_pool2d_grad", [x, dy], kernel=k, stride=s, padding=p, ceil_mode=ceil), tx.grad, None)


def test_max_pool2d_bad():
    expect_shape_error("max_pool2d", [f32(1, 1, 4, 4)], "padding at most half", kernel=2, stride=2, padding=2)
    expect_shape_error("max_pool2d", [f32(4, 4)], "4-D NCHW", kernel=2, stride=2)
    expect_shape_error("max_pool2d_grad", [f32(1, 1, 4, 4), f32(1, 1, 3, 3)], "does not match", kernel=2, stride=2)


# ---- float64 graphs ---------------------------------------------------------------------------

@pytest.mark.parametrize("op,shapes,attrs", [
    ("exp", [(3, 4)], {}), ("sigmoid", [(3, 4)], {}), ("add", [(3, 4), (4,)], {}), ("div", [(3, 4), (3, 1)], {}),
    ("sum", [(3, 4)], {"axes": (1,)}), ("max", [(3, 4)], {"axes": (0, 1)}), ("matmul", [(2, 3, 4), (4, 5)], {}),
    ("conv2d", [(2, 3, 7, 6), (4, 3, 3, 2)], {"stride": 2, "padding": 1}),
])
def test_float64_graphs(op, shapes, attrs):
    rng = np.random.default_rng(0)
    xs = [rng.uniform(0.5, 1.5, size=s) for s in shapes]  # float64 arrays, float64 graph
    out = interp(op, xs, **attrs)
    assert out.dtype == np.float64
    ts = [T(x) for x in xs]
    ref = {"exp": lambda: torch.exp(ts[0]), "sigmoid": lambda: torch.sigmoid(ts[0]),
           "add": lambda: ts[0] + ts[1], "div": lambda: ts[0] / ts[1], "sum": lambda: ts[0].sum(1),
           "max": lambda: ts[0].amax((0, 1)), "matmul": lambda: ts[0] @ ts[1],
           "conv2d": lambda: TF.conv2d(ts[0], ts[1], stride=2, padding=1)}[op]()
    close(out, ref, "float64")


# ---- op table ---------------------------------------------------------------------------------

def test_unknown_op_and_attribute():
    g = Graph()
    x = g.add_input("x", f32(2))
    with pytest.raises(ShapeError, match="unknown op 'frobnicate'"):
        g.add("frobnicate", [x])
    with pytest.raises(ShapeError, match=re.escape("exp: unknown attribute(s) ['axis']")):
        g.add("exp", [x], axis=0)


def test_every_op_is_tested():
    # Collectives have no single-process torch counterpart: tests/ir/test_world.py checks them
    # against NumPy over a simulated world of ranks.
    computed = {n for n, op in OPS.items() if op.kind not in ("source", "fused", "collective")}
    missing = computed - TESTED
    assert not missing, f"ops without a test against torch in tests/ir/test_ops.py: {sorted(missing)}"
