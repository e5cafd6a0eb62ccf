"""Tracing: golden text of the MNIST models, clear errors for bad input, and traced functions
(operators, scalars, NumPy constants, layout ops, reductions, losses) evaluated by the reference
interpreter against PyTorch.

Golden files live in tests/frontends/golden/; regenerate them only deliberately with
EMBER_UPDATE_GOLDEN=1 python -m pytest tests/frontends/test_trace.py
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

from ember.frontends import Parameter, functional as F, nn, spec, trace
from ember.ir import ShapeError, TensorType, evaluate, run

GOLDEN = Path(__file__).resolve().parent / "golden"
HERE = Path(__file__).resolve()
SOURCE = HERE.read_text().splitlines()
RTOL, ATOL = 1e-5, 1e-6


def line_of(marker: str) -> int:
    """1-based line number of the one line of this file that ends with `# <marker>`."""
    hits = [i + 1 for i, line in enumerate(SOURCE) if line.rstrip().endswith(f"# {marker}")]
    assert len(hits) == 1, (marker, hits)
    return hits[0]


def assert_points_here(msg: str, marker: str) -> None:
    m = re.search(r"at (.+):(\d+)\s*$", msg)
    assert m, f"no 'at file:line' in: {msg}"
    assert Path(m.group(1)).name == HERE.name, msg
    assert int(m.group(2)) == line_of(marker), msg


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 16, 3), nn.ReLU(), nn.Conv2d(16, 32, 3), nn.ReLU(), nn.Flatten(),  # CNN-0
                         nn.Linear(18432, 10))  # CNN-5


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 30), nn.Sigmoid(), nn.Linear(30, 10))  # MLP


# ---- golden text -----------------------------------------------------------------------------

def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    text = text + "\n"
    if os.environ.get("EMBER_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"{path} is missing; create it with EMBER_UPDATE_GOLDEN=1"
    expected = path.read_text()
    assert text == expected, (f"traced graph differs from {path} (if the change is intended, "
                              f"regenerate with EMBER_UPDATE_GOLDEN=1):\n{text}")


@pytest.mark.parametrize("name,make,shape", [("cnn.txt", cnn, (64, 1, 28, 28)), ("mlp.txt", mlp, (64, 784))])
def test_golden(name, make, shape):
    g = trace(make(), spec(shape))
    check_golden(name, str(g))
    # tracing is deterministic: a second model of the same architecture prints the same
    assert str(trace(make(), spec(shape))) == str(g)


def test_golden_graph_structure():
    g = trace(cnn(), spec((64, 1, 28, 28)))
    assert list(g.inputs) == ["x"]
    assert list(g.parameters) == ["0.weight", "0.bias", "2.weight", "2.bias", "5.weight", "5.bias"]
    assert list(g.outputs) == ["out"] and str(g.type(g.outputs["out"])) == "f32[64,10]"
    assert g.count("conv2d") == 2 and g.count("relu") == 2 and g.count("matmul") == 1
    assert set(g.meta["parameters"]) == set(g.parameters)


# ---- bad input -------------------------------------------------------------------------------

def add_mismatch(x, y):
    return x + y  # BAD-ADD


def matmul_mismatch(x, w):
    h = x * 2.0
    return h @ w  # BAD-MATMUL


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 4)
        self.fc2 = nn.Linear(5, 3)

    def forward(self, x):
        h = self.fc1(x).relu()
        return self.fc2(h)  # BAD-MODULE


def test_shape_mismatch_names_op_shapes_and_line():
    with pytest.raises(ShapeError) as ei:
        trace(add_mismatch, spec((2, 3)), spec((4,)))
    msg = str(ei.value)
    assert msg.startswith("add:") and "f32[2,3]" in msg and "f32[4]" in msg and "do not broadcast" in msg
    assert_points_here(msg, "BAD-ADD")


def test_dtype_mismatch_names_op_dtypes_and_line():
    with pytest.raises(ShapeError) as ei:
        trace(add_mismatch, spec((2, 3)), spec((2, 3), "int32"))
    msg = str(ei.value)
    assert "add" in msg and "f32[2,3]" in msg and "i32[2,3]" in msg and "cast one explicitly" in msg
    assert_points_here(msg, "BAD-ADD")


def test_matmul_mismatch_through_operator():
    with pytest.raises(ShapeError) as ei:
        trace(matmul_mismatch, spec((4, 3)), spec((4, 2)))
    msg = str(ei.value)
    assert "matmul" in msg and "f32[4,3]" in msg and "f32[4,2]" in msg
    assert_points_here(msg, "BAD-MATMUL")


def test_user_module_forward_line():
    with pytest.raises(ShapeError) as ei:
        trace(TwoLayer(), spec((2, 8)))
    msg = str(ei.value)
    assert "matmul" in msg and "f32[2,4]" in msg and "f32[5,3]" in msg
    assert_points_here(msg, "BAD-MODULE")


def test_library_model_points_at_the_layer_line():
    # a layer of a Sequential reports the line that constructed it, and its module path
    with pytest.raises(ShapeError) as ei:
        trace(mlp(), spec((64, 100)))
    msg = str(ei.value)
    assert "matmul" in msg and "f32[64,100]" in msg and "f32[784,30]" in msg and "in module '0'" in msg
    assert_points_here(msg, "MLP")
    with pytest.raises(ShapeError) as ei:
        trace(cnn(), spec((64, 3, 28, 28)))
    msg = str(ei.value)
    assert "conv2d" in msg and "f32[64,3,28,28]" in msg and "f32[16,1,3,3]" in msg and "channels" in msg
    assert "in module '0'" in msg
    assert_points_here(msg, "CNN-0")
    with pytest.raises(ShapeError) as ei:
        trace(cnn(), spec((64, 1, 28, 28), "int32"))
    msg = str(ei.value)
    assert "conv2d" in msg and "i32[64,1,28,28]" in msg and "f32[16,1,3,3]" in msg
    assert_points_here(msg, "CNN-0")


def test_linear_of_the_wrong_width_names_module_op_types_and_line():
    model = nn.Sequential(nn.Flatten(), nn.ReLU(),
                          nn.Linear(100, 10))  # WRONG-LINEAR
    with pytest.raises(ShapeError) as ei:
        trace(model, spec((64, 784)))
    msg = str(ei.value)
    assert msg.startswith("matmul") and "f32[64,784]" in msg and "f32[100,10]" in msg
    assert "\n  in module '2'\n" in msg
    assert_points_here(msg, "WRONG-LINEAR")


def reshape_bad(x):
    return x.reshape(5, -1)  # BAD-RESHAPE


def sum_bad(x):
    return x.sum(axis=2)  # BAD-SUM


def argmax_bad(x):
    return x.argmax(5)  # BAD-ARGMAX


def flatten_bad(x):
    return x.flatten(1, 0)  # BAD-FLATTEN


def ce_bad(z, y):
    return F.cross_entropy(z, y)  # BAD-CE


def mse_bad(p, t):
    return F.mse_loss(p, t)  # BAD-MSE


def int_plus_half(x):
    return x + 0.5  # BAD-INT-SCALAR


@pytest.mark.parametrize("fn,args,marker,fragments", [
    (reshape_bad, [spec((2, 3))], "BAD-RESHAPE", ["reshape", "f32[2,3]", "(5, -1)"]),
    (sum_bad, [spec((2, 3))], "BAD-SUM", ["axis 2 out of range", "f32[2,3]"]),
    (argmax_bad, [spec((2, 3))], "BAD-ARGMAX", ["axis 5 out of range", "f32[2,3]"]),
    (flatten_bad, [spec((2, 3))], "BAD-FLATTEN", ["flatten", "f32[2,3]"]),
    (ce_bad, [spec((4, 10)), spec((4,))], "BAD-CE", ["cross_entropy", "integer labels", "f32[4]"]),
    (ce_bad, [spec((4, 10)), spec((5,), "int64")], "BAD-CE", ["cross_entropy", "i64[5]", "f32[4,10]"]),
    (mse_bad, [spec((4, 10)), spec((4, 1))], "BAD-MSE", ["mse_loss", "f32[4,10]", "f32[4,1]"]),
    (int_plus_half, [spec((3,), "int32")], "BAD-INT-SCALAR", ["add", "i32[3]", "f32[]", "cast one explicitly"]),
], ids=["reshape", "sum-axis", "argmax-axis", "flatten", "ce-float-labels", "ce-batch", "mse", "int+0.5"])
def test_frontend_errors(fn, args, marker, fragments):
    with pytest.raises(ShapeError) as ei:
        trace(fn, *args)
    msg = str(ei.value)
    for f in fragments:
        assert f in msg, f"{f!r} missing from: {msg}"
    assert_points_here(msg, marker)


def test_other_trace_errors():
    with pytest.raises(TypeError, match="float64"):
        trace(lambda x: x, np.zeros(3))
    with pytest.raises(TypeError, match="must return a Tensor"):
        trace(lambda x: 3, spec((2,)))
    with pytest.raises(TypeError, match="cannot be used in `if`"):
        trace(lambda x: x if x else x, spec((2,)))
    with pytest.raises(RuntimeError, match="inside ember.frontends.trace"):
        F.exp(Parameter(np.zeros(3)))
    with pytest.raises(NotImplementedError, match="dilation"):
        trace(lambda x, w: F.conv2d(x, w, dilation=2), spec((1, 1, 8, 8)), spec((1, 1, 3, 3)))
    with pytest.raises(ShapeError, match="groups must be >= 1 and divide the 3 output channels"):
        trace(lambda x, w: F.conv2d(x, w, groups=2), spec((1, 2, 8, 8)), spec((3, 1, 3, 3)))
    with pytest.raises(ShapeError, match=r"expects 4 \(2 per group x 2 groups\)"):
        trace(lambda x, w: F.conv2d(x, w, groups=2), spec((1, 3, 8, 8)), spec((2, 2, 3, 3)))
    escaped = []
    trace(lambda x: escaped.append(x) or x, spec((2,)))
    with pytest.raises(ValueError, match="another traced graph"):
        trace(lambda y: y + escaped[0], spec((2,)))


# ---- traced functions vs torch -----------------------------------------------------------------

def rng_arrays(*shapes, seed=0, low=-1.0, high=1.0):
    rng = np.random.default_rng(seed)
    return [rng.uniform(low, high, size=s).astype(np.float32) for s in shapes]


def check(fn_ember, fn_torch, *arrays, rtol=RTOL, atol=ATOL, specs=None):
    g = trace(fn_ember, *(specs or arrays))
    out = evaluate(g, *arrays)
    ref = fn_torch(*(torch.from_numpy(np.asarray(a)) for a in arrays))
    if isinstance(ref, (tuple, list)):
        assert isinstance(out, dict) and len(out) == len(ref)
        outs = [out[f"out{i}"] for i in range(len(ref))]
    else:
        outs, ref = [out], [ref]
    for o, r in zip(outs, ref):
        r = r.detach().numpy()
        assert o.shape == r.shape, (o.shape, r.shape)
        assert o.dtype == r.dtype, (o.dtype, r.dtype)
        np.testing.assert_allclose(o, r, rtol=rtol, atol=atol)
    return g


def test_operators_and_python_scalars():
    x, y = rng_arrays((3, 4), (4,))
    g = check(lambda x, y: (2.0 * x - y / 3 + 1) * -x + (1 - y) / (x * x + 2) + 2 / (y + 3),
              lambda x, y: (2.0 * x - y / 3 + 1) * -x + (1 - y) / (x * x + 2) + 2 / (y + 3), x, y)
    consts = [g.attrs(n)["value"] for n in g.nodes() if g.op(n) == "constant"]
    assert consts and all(c.dtype == np.float32 and c.shape == () for c in consts)


def test_comparisons_and_where():
    x, y = rng_arrays((5, 3), (3,), seed=1)
    check(lambda x, y: F.where(x > y, x, y * 0.5) + F.where(x <= 0.25, 1.0, 0.0) + F.cast(x < y, "float32")
          + F.maximum(x, y) - F.minimum(x, 0.0) + F.cast(x >= 0, "float32"),
          lambda x, y: torch.where(x > y, x, y * 0.5) + torch.where(x <= 0.25, 1.0, 0.0) + (x < y).float()
          + torch.maximum(x, y) - torch.minimum(x, torch.tensor(0.0)) + (x >= 0).float(), x, y)


def test_numpy_constants():
    (x,) = rng_arrays((2, 4))
    a32 = np.arange(4, dtype=np.float32)
    a64 = np.linspace(0, 1, 4)  # float64: becomes a float32 constant
    g = check(lambda x: x * a32 + a64 - np.float64(0.25) * x + np.float32(2),
              lambda x: x * torch.from_numpy(a32) + torch.from_numpy(a64).float() - 0.25 * x + 2, x)
    assert {str(g.type(n)) for n in g.nodes() if g.op(n) == "constant"} == {"f32[4]", "f32[]"}
    labels = np.array([0, 2, 1], np.int64)
    check(lambda y: F.one_hot(y + 1, 4) * 2.0 - F.cast(y * 2 - np.int64(1), "float32").reshape(3, 1),
          lambda y: TF.one_hot(y + 1, 4).float() * 2.0 - (y * 2 - 1).float().reshape(3, 1), labels)


def test_numpy_operands_on_the_left():
    x, y = rng_arrays((3, 4), (4,), seed=9)
    a = np.linspace(-1, 1, 4, dtype=np.float32)
    m = np.ones((2, 3), np.float32)
    g = check(lambda x: (a * x, a - x, a / (x + 2), m @ x, a + x, np.float32(3) - x),
              lambda x: (torch.from_numpy(a) * x, torch.from_numpy(a) - x, torch.from_numpy(a) / (x + 2),
                         torch.from_numpy(m) @ x, torch.from_numpy(a) + x, 3 - x), x)
    assert g.count("mul") == 1  # one node, not one per element of `a`
    check(lambda x: F.cast(a < x, "float32"), lambda x: (torch.from_numpy(a) < x).float(), x)


def test_where_with_tensor_and_scalar_branches():
    x, y = rng_arrays((3, 4), (4,), seed=10)
    check(lambda x, y: (F.where(x > 0, x, 0.0), F.where(x > 0, -1.0, y), F.where(y < x, x, y)),
          lambda x, y: (torch.where(x > 0, x, 0.0), torch.where(x > 0, -1.0, y), torch.where(y < x, x, y)), x, y)
    n = np.array([1, -2, 3], np.int64)
    g = check(lambda n: F.where(n > 0, n, 0), lambda n: torch.where(n > 0, n, 0), n)
    assert str(g.type(g.outputs["out"])) == "i64[3]"


def test_numpy_integer_axes():
    (x,) = rng_arrays((3, 4), seed=11)
    check(lambda x: (x.sum(np.int64(1)), x.max(np.int32(0)), x.argmax(np.int64(1))),
          lambda x: (x.sum(1), x.amax(0), x.argmax(1)), x)


def test_integer_scalars_keep_integer_dtype():
    y = np.array([3, -1, 4], np.int32)
    g = check(lambda y: y * 2 + 1 - y, lambda y: y * 2 + 1 - y, y)
    assert all(g.type(n).dtype.name == "int32" for n in g.nodes())


def test_layout_ops():
    (x,) = rng_arrays((2, 3, 4), seed=2)
    check(lambda x: (x.reshape(-1), x.reshape(6, -1), x.reshape((4, 3, 2)), x.view(-1, 2)),
          lambda x: (x.reshape(-1), x.reshape(6, -1), x.reshape((4, 3, 2)), x.view(-1, 2)), x)
    check(lambda x: (x.flatten(), x.flatten(1), x.flatten(0, 1), x.flatten(-2, -1)),
          lambda x: (x.flatten(), x.flatten(1), x.flatten(0, 1), x.flatten(-2, -1)), x)
    check(lambda x: (x.transpose(0, 2), x.permute(2, 0, 1), x.T, F.broadcast_to(x.sum(1, keepdims=True), (2, 3, 4))),
          lambda x: (x.transpose(0, 2), x.permute(2, 0, 1), x.permute(2, 1, 0),
                     torch.broadcast_to(x.sum(1, keepdim=True), (2, 3, 4))), x)
    s = np.float32(3.5).reshape(())
    check(lambda s: s.flatten(), lambda s: s.flatten(), s)


def test_reductions():
    (x,) = rng_arrays((3, 4, 5), seed=3)
    check(lambda x: (x.sum(), x.sum(1), x.sum((0, 2), keepdims=True), x.sum(-1)),
          lambda x: (x.sum(), x.sum(1), x.sum((0, 2), keepdim=True), x.sum(-1)), x, atol=1e-5)
    check(lambda x: (x.mean(), x.mean(1), x.mean((0, 2), keepdims=True), x.mean(-1, keepdims=True)),
          lambda x: (x.mean(), x.mean(1), x.mean((0, 2), keepdim=True), x.mean(-1, keepdim=True)), x)
    check(lambda x: (x.max(), x.max(1), x.max(-1, keepdims=True), x.max((0, 2))),
          lambda x: (x.max(), x.amax(1), x.amax(-1, keepdim=True), x.amax((0, 2))), x)
    check(lambda x: (x.argmax(), x.argmax(0), F.argmax(x, 1)),
          lambda x: (x.argmax(-1), x.argmax(0), x.argmax(1)), x)


def test_unary_methods():
    (x,) = rng_arrays((4, 5), seed=4, low=0.1, high=2.0)
    check(lambda x: (x.exp(), x.log(), x.sqrt(), (-x).abs(), (x - 1).relu(), x.sigmoid(), x.tanh(), F.reciprocal(x)),
          lambda x: (x.exp(), x.log(), x.sqrt(), (-x).abs(), (x - 1).relu(), x.sigmoid(), x.tanh(), x.reciprocal()), x)


def test_matmul_variants():
    a, b, v, u, bb, c = rng_arrays((3, 7), (7, 2), (7,), (3,), (4, 7, 2), (2,), seed=5)
    check(lambda a, b, v, u, bb, c: (a @ b, v @ b, a @ v, v @ v, u @ a, a @ bb, F.linear(a, b.T, c), F.linear(v, b.T)),
          lambda a, b, v, u, bb, c: (a @ b, v @ b, a @ v, v @ v, u @ a, a @ bb, TF.linear(a, b.T, c), TF.linear(v, b.T)),
          a, b, v, u, bb, c, atol=1e-5)


def test_softmax_family():
    (x,) = rng_arrays((6, 10), seed=6, low=-8, high=8)
    check(lambda x: (F.log_softmax(x), F.log_softmax(x, 0), F.softmax(x, -1)),
          lambda x: (TF.log_softmax(x, -1), TF.log_softmax(x, 0), TF.softmax(x, -1)), x)
    big = x * 100  # the stable form survives large logits
    check(lambda x: F.log_softmax(x, 1), lambda x: TF.log_softmax(x, 1), big, atol=1e-4)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_losses(reduction):
    z, p, t = rng_arrays((8, 10), (8, 3), (8, 3), seed=7, low=-3, high=3)
    y = np.random.default_rng(7).integers(0, 10, size=8).astype(np.int64)
    check(lambda z, y: F.cross_entropy(z, y, reduction), lambda z, y: TF.cross_entropy(z, y, reduction=reduction), z, y)
    check(lambda z, y: nn.CrossEntropyLoss(reduction)(z, y), lambda z, y: TF.cross_entropy(z, y, reduction=reduction),
          z, y)
    check(lambda p, t: F.mse_loss(p, t, reduction), lambda p, t: TF.mse_loss(p, t, reduction=reduction), p, t,
          atol=1e-5)
    check(lambda p, t: nn.MSELoss(reduction)(p, t), lambda p, t: TF.mse_loss(p, t, reduction=reduction), p, t,
          atol=1e-5)
    y32 = y.astype(np.int32)
    check(lambda z, y: F.cross_entropy(z, y, reduction),
          lambda z, y: TF.cross_entropy(z, y.long(), reduction=reduction), z, y32)


def test_conv2d_functional_with_bias_stride_padding():
    x, w, b = rng_arrays((2, 3, 9, 8), (4, 3, 3, 2), (4,), seed=8)
    check(lambda x, w, b: F.conv2d(x, w, b, stride=(2, 1), padding=(1, 2)),
          lambda x, w, b: TF.conv2d(x, w, b, stride=(2, 1), padding=(1, 2)), x, w, b, atol=1e-5)


def test_training_graph_with_modules_argument_names_parameters():
    model = mlp()
    loss = nn.CrossEntropyLoss()
    g = trace(lambda x, y: loss(model(x), y), spec((4, 784)), spec((4,), "int64"), modules={"model": model})
    assert list(g.inputs) == ["x", "y"]
    assert list(g.parameters) == ["model.0.weight", "model.0.bias", "model.2.weight", "model.2.bias"]
    assert g.type(g.outputs["out"]) == TensorType((), "float32")
    # without names, closure parameters are numbered
    g2 = trace(lambda x: model(x), spec((4, 784)))
    assert list(g2.parameters) == ["param0", "param1", "param2", "param3"]


def test_output_and_input_naming():
    g = trace(lambda a, b: {"s": a + b, "d": a - b}, spec((2,)), spec((2,)))
    assert list(g.inputs) == ["a", "b"] and list(g.outputs) == ["s", "d"]
    g = trace(lambda *xs: (xs[0], xs[1] * 2), spec((2,)), spec((2,)))
    assert list(g.inputs) == ["arg0", "arg1"] and list(g.outputs) == ["out0", "out1"]
    g = trace(lambda a: a * 2, spec((2,)), input_names=["pixels"], name="double")
    assert list(g.inputs) == ["pixels"] and g.name == "double"


def test_parameters_trace_once_and_support_operators():
    p = Parameter(np.array([1.0, 2.0, 3.0]))
    g = trace(lambda x: p * x + p - 1.0 + p.sum(), spec((3,)))
    assert list(g.parameters) == ["param0"] and g.count("parameter") == 1
    x = np.array([0.5, -1.0, 2.0], np.float32)
    out = run(g, {"x": x}, {"param0": p.data}).outputs["out"]
    np.testing.assert_allclose(out, p.data * x + p.data - 1 + p.data.sum(), rtol=1e-6)


def test_trace_accepts_arrays_specs_and_tensor_types():
    x = np.zeros((2, 3), np.float32)
    for example in (x, spec((2, 3)), TensorType((2, 3))):
        g = trace(lambda x: x + 1, example)
        assert str(g.type(g.inputs["x"])) == "f32[2,3]"
    g = trace(lambda x: x + 1, np.zeros(3, np.int64))
    assert str(g.type(g.outputs["out"])) == "i64[3]"
