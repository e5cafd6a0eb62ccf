"""bfloat16 in the IR: rounding to nearest (ties to even) as PyTorch rounds, its held forms (uint16
bits, float32 values), and the interpreter's semantics (compute in float32, round every bfloat16
result), checked against PyTorch's bfloat16 ops on the CPU."""
from __future__ import annotations

import numpy as np
import pytest

from ember.ir import Graph, TensorType, bfloat16, float32, run
from ember.ir.dtypes import as_array, as_dtype, as_values, bf16_bits, bf16_values, round_bf16
from ember.passes.autodiff import grad
from ember.passes.simplify import simplify

torch = pytest.importorskip("torch")


def _torch_bits(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _special() -> np.ndarray:
    rng = np.random.default_rng(0)
    # every float32 that is exactly halfway between two bfloat16 values (both parities), its
    # neighbours, denormals, the overflow edge, infinities and signed zeros
    halves = (rng.integers(0, 2**16, 2000, dtype=np.uint32) << 16) | 0x8000
    near = np.concatenate([halves, halves + 1, halves - 1]).view(np.float32)
    edge = np.array([3.3895313892515355e38, 3.4028235e38, 1e-40, -1e-45, 0.0, -0.0, np.inf, -np.inf], np.float32)
    return np.concatenate([near, edge, rng.standard_normal(5000).astype(np.float32) * 1e3]).astype(np.float32)


def test_rounding_matches_torch_bit_for_bit():
    x = _special()
    x = x[np.isfinite(x) | np.isinf(x)]
    assert np.array_equal(bf16_bits(x), _torch_bits(x))
    assert np.array_equal(round_bf16(x).view(np.uint32), bf16_values(_torch_bits(x)).view(np.uint32))


def test_nan_stays_nan_and_keeps_its_sign():
    x = np.array([np.nan, -np.nan, np.float32(np.uint32(0x7F800001).view(np.float32))], np.float32)
    got = bf16_values(bf16_bits(x))
    assert np.isnan(got).all()
    assert list(np.signbit(got)) == list(np.signbit(x))


def test_float64_is_rounded_once():
    # 1 + 2^-8 is halfway between the bfloat16 values 1 and 1 + 2^-7; a float64 just above it
    # rounds to float32's 1 + 2^-8 (the tie), from which a second rounding would go to even (1)
    x = np.array([1 + 2.0**-8 + 2.0**-40, -(1 + 2.0**-8 + 2.0**-40), 1 + 2.0**-8 - 2.0**-40, 1 + 2.0**-8])
    assert list(round_bf16(x)) == [1 + 2.0**-7, -(1 + 2.0**-7), 1.0, 1.0]
    assert round_bf16(x).dtype == np.float64
    assert list(bf16_values(as_array(x, bfloat16))) == [1 + 2.0**-7, -(1 + 2.0**-7), 1.0, 1.0]


def test_held_forms():
    assert bfloat16.numpy == np.uint16 and bfloat16.compute == np.float32 and bfloat16.itemsize == 2
    assert float32.compute == float32.numpy == np.float32
    assert as_dtype(np.uint16) is bfloat16  # uint16 arrays are bfloat16 bits
    bits = as_array([1.0, -2.5, 3.14159], bfloat16)
    assert bits.dtype == np.uint16 and list(bits) == [0x3F80, 0xC020, 0x4049]
    assert list(as_values(bits, bfloat16)) == [1.0, -2.5, 3.140625]
    assert as_array(bits, bfloat16) is bits  # already held
    assert TensorType.of(bits) == TensorType((3,), bfloat16)


def _binary(op: str, shape=(4, 5)) -> Graph:
    g = Graph(op)
    a, b = g.add_input("a", TensorType(shape, bfloat16)), g.add_input("b", TensorType(shape, bfloat16))
    g.set_output("out", g.add(op, [a, b]))
    return g


@pytest.mark.parametrize("op,fn", [("add", torch.add), ("sub", torch.sub), ("mul", torch.mul), ("div", torch.div),
                                   ("maximum", torch.maximum)])
def test_elementwise_ops_round_as_torch(op, fn):
    rng = np.random.default_rng(1)
    a, b = (round_bf16(rng.standard_normal((4, 5)).astype(np.float32) * 10) for _ in range(2))
    got = run(_binary(op), {"a": a, "b": b}).outputs["out"]
    want = fn(torch.from_numpy(a).bfloat16(), torch.from_numpy(b).bfloat16()).float().numpy()
    assert got.dtype == np.float32
    assert np.array_equal(got, want)


def test_inputs_as_bits_or_floats_and_rounded():
    g = _binary("add", (3,))
    x = np.array([1.0, 1.00390625, 100.3], np.float32)  # the second is a tie: rounds to even (1.0)
    as_floats = run(g, {"a": x, "b": np.zeros(3, np.float32)}).outputs["out"]
    as_bits = run(g, {"a": bf16_bits(x), "b": np.zeros(3, np.uint16)}).outputs["out"]
    assert np.array_equal(as_floats, as_bits)
    assert list(as_floats) == [1.0, 1.0, 100.5]


def test_matmul_accumulates_in_float32_and_rounds_once():
    rng = np.random.default_rng(2)
    a = round_bf16(rng.standard_normal((8, 300)).astype(np.float32))
    b = round_bf16(rng.standard_normal((300, 6)).astype(np.float32))
    g = Graph("mm")
    x, w = g.add_input("a", TensorType(a.shape, bfloat16)), g.add_input("b", TensorType(b.shape, bfloat16))
    g.set_output("out", g.add("matmul", [x, w]))
    got = run(g, {"a": a, "b": b}).outputs["out"]
    exact = a.astype(np.float64) @ b.astype(np.float64)
    assert np.array_equal(got, round_bf16(got))  # a bfloat16 result
    ulp = np.abs(round_bf16(exact)) * 2.0**-7
    assert np.all(np.abs(got - exact) <= ulp)  # float32 accumulation: within one rounding of the exact sum
    torch_out = (torch.from_numpy(a).bfloat16() @ torch.from_numpy(b).bfloat16()).float().numpy()
    assert np.all(np.abs(got - torch_out) <= ulp)


def test_cast_round_trip_and_float64_oracle():
    g = Graph("cast")
    x = g.add_input("x", TensorType((5,), float32))
    h = g.add("cast", [x], dtype=bfloat16)
    g.set_output("out", g.add("cast", [g.add("mul", [h, h])], dtype=float32))
    v = np.array([1.1, -3.7, 1e-3, 65504.0, 0.0], np.float32)
    out = run(g, {"x": v}).outputs["out"]
    hb = round_bf16(v)
    assert np.array_equal(out, round_bf16(hb * hb))
    # the float64 oracle computes in float64 but keeps the graph's bfloat16 roundings
    out64 = run(g, {"x": v}, precision="float64").outputs["out"]
    assert out64.dtype == np.float64
    assert np.array_equal(out64, round_bf16(round_bf16(v.astype(np.float64)) ** 2))


def test_constants_hold_bits_and_fold():
    g = Graph("const")
    x = g.add_input("x", TensorType((3,), bfloat16))
    c = g.add_constant(0.1, dtype=bfloat16)
    assert g.type(c) == TensorType((), bfloat16) and g.attrs(c)["value"].dtype == np.uint16
    two = g.add("add", [g.add_constant(1.0, dtype=bfloat16), g.add_constant(1.0, dtype=bfloat16)])
    g.set_output("out", g.add("mul", [g.add("add", [x, c]), two]))
    v = np.array([1.0, 2.0, 3.0], np.float32)
    before = run(g, {"x": v}).outputs["out"]
    folded = simplify(g)
    assert folded.count("constant") == 2 and folded.count("add") == 1  # 1 + 1 folded into a bfloat16 2
    assert np.array_equal(run(folded, {"x": v}).outputs["out"], before)
    assert np.array_equal(before, round_bf16(round_bf16(v + np.float32(0.10009765625)) * 2))


def test_gradient_of_a_bfloat16_graph():
    """autodiff's constants take the operand's dtype: a bfloat16 graph differentiates."""
    g = Graph("g")
    x = g.add_input("x", TensorType((4, 3), float32))
    w = g.add_parameter("w", TensorType((3, 2), float32))
    y = g.add("matmul", [g.add("cast", [x], dtype=bfloat16), g.add("cast", [w], dtype=bfloat16)])
    z = g.add("cast", [g.add("sigmoid", [g.add("relu", [y])]), ], dtype=float32)
    g.set_output("out", g.add("sum", [z], axes=(0, 1)))
    d = grad(g)
    rng = np.random.default_rng(3)
    xv, wv = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal((3, 2)).astype(np.float32)
    got = run(d, {"x": xv}, {"w": wv}).outputs["grad:w"]
    xb, wb = round_bf16(xv).astype(np.float64), round_bf16(wv).astype(np.float64)
    pre = xb @ wb
    s = 1 / (1 + np.exp(-np.maximum(pre, 0)))
    want = xb.T @ (s * (1 - s) * (pre > 0))
    assert np.allclose(got, want, rtol=3e-2, atol=3e-2)
    assert not np.allclose(got, want, rtol=1e-6, atol=1e-7)  # it did round
