"""all_reduce: its type rule and attribute errors, its printing, and its semantics over a simulated
world of ranks (`ember.ir.run_world`) checked against NumPy; a plain `run` is a world of one."""
from __future__ import annotations

import re

import numpy as np
import pytest

from ember import ir
from ember.ir import Graph, ShapeError, TensorType, float32, float64, format_graph, run, run_world


def _graph(shape=(3, 4), dtype=float32, **attrs) -> Graph:
    g = Graph("ar")
    x = g.add_input("x", TensorType(shape, dtype))
    g.set_output("y", g.add("all_reduce", [x], **attrs))
    return g


# ---- type rule and attributes -------------------------------------------------------------

@pytest.mark.parametrize("dtype", [float32, float64, ir.bfloat16])
@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_type_is_the_operands(dtype, reduce):
    g = _graph((2, 5), dtype, reduce=reduce)
    y = g.outputs["y"]
    assert g.type(y) == TensorType((2, 5), dtype)
    assert g.attrs(y) == {"reduce": reduce, "group": "world"}  # the group defaults to the world


def test_scalar_operand_and_named_group():
    g = _graph((), reduce="mean", group="pipeline.0")
    assert g.type(g.outputs["y"]) == TensorType(())
    assert g.attrs(g.outputs["y"])["group"] == "pipeline.0"


@pytest.mark.parametrize("dtype", ["int32", "int64", "bool"])
def test_integer_and_bool_operands_are_refused(dtype):
    with pytest.raises(ShapeError, match=f"all_reduce needs a floating-point operand, got {dtype}"):
        _graph((3,), ir.as_dtype(dtype), reduce="sum")


@pytest.mark.parametrize("attrs,message", [
    ({"reduce": "max"}, "all_reduce: bad attribute reduce='max': expected one of sum, mean"),
    ({"reduce": None}, "all_reduce: missing attribute 'reduce'"),
    ({}, "all_reduce: missing attribute 'reduce'"),
    ({"reduce": "sum", "group": ""}, "all_reduce: bad attribute group='': expected a non-empty name"),
    ({"reduce": "sum", "group": 3}, "all_reduce: bad attribute group=3"),
    ({"reduce": "sum", "axes": (0,)}, "all_reduce: unknown attribute(s) ['axes']"),
])
def test_bad_attributes_are_refused(attrs, message):
    with pytest.raises(ShapeError, match=re.escape(message)):
        _graph((3,), **attrs)


def test_arity_is_one():
    g = Graph()
    x = g.add_input("x", TensorType((3,)))
    with pytest.raises(ShapeError, match="all_reduce takes 1 operand"):
        g.add("all_reduce", [x, x], reduce="sum")


def test_printer_shows_it_like_any_op():
    text = format_graph(_graph((3, 4), reduce="mean", group="dp"))
    assert text == ("graph ar {\n"
                    "  %0 = input 'x' : f32[3,4]\n"
                    "  %1 = all_reduce(%0) group='dp' reduce='mean' : f32[3,4]\n"
                    "  output 'y' = %1\n"
                    "}")
    assert "all_reduce" in ir.to_dot(_graph(reduce="sum"))


# ---- semantics ----------------------------------------------------------------------------

def _rank_values(world_size: int, shape=(3, 4), seed=0) -> list[np.ndarray]:
    # Magnitudes that differ by orders so the order of the additions shows in the rounding.
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 4, size=shape)).astype(np.float32)
            for _ in range(world_size)]


def _reference(values: list[np.ndarray], reduce: str) -> np.ndarray:
    total = values[0]
    for v in values[1:]:
        total = total + v
    return total / np.float32(len(values)) if reduce == "mean" else total


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_single_process_run_is_a_world_of_one(reduce):
    x = _rank_values(1)[0]
    np.testing.assert_array_equal(run(_graph(reduce=reduce), {"x": x}).outputs["y"], x)


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_world_matches_numpy(world_size, reduce):
    g = _graph(reduce=reduce)
    values = _rank_values(world_size)
    results = run_world(g, [{"x": v} for v in values], world_size=world_size)
    assert len(results) == world_size
    expected = _reference(values, reduce)  # rank order, left to right, in float32
    np_fn = np.sum if reduce == "sum" else np.mean
    for r, res in enumerate(results):
        y = res.outputs["y"]
        assert y.dtype == np.float32
        np.testing.assert_array_equal(y, expected, err_msg=f"rank {r}")  # bit-exact: the defined order
        np.testing.assert_allclose(y, np_fn(np.stack(values).astype(np.float64), axis=0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_world_is_deterministic_and_every_rank_agrees(reduce):
    g = _graph(reduce=reduce)
    inputs = [{"x": v} for v in _rank_values(3, seed=4)]
    first = [r.outputs["y"] for r in run_world(g, inputs)]
    again = [r.outputs["y"] for r in run_world(g, inputs)]
    for a, b in zip(first, again):
        assert a.tobytes() == b.tobytes()
    assert all(a.tobytes() == first[0].tobytes() for a in first)


def test_ranks_compute_their_own_values_around_the_collective():
    # y_r = all_reduce(2 * x_r) + x_r: per-rank arithmetic on both sides of the reduction.
    g = Graph("around")
    x = g.add_input("x", TensorType((5,)))
    two = g.add_constant(np.float32(2))
    s = g.add("all_reduce", [g.add("mul", [x, two])], reduce="sum")
    g.set_output("y", g.add("add", [s, x]))
    values = _rank_values(3, (5,), seed=1)
    results = run_world(g, [{"x": v} for v in values])
    total = _reference([v * 2 for v in values], "sum")
    for v, res in zip(values, results):
        np.testing.assert_array_equal(res.outputs["y"], total + v)


def test_parameters_and_states_shared_or_per_rank():
    g = Graph("ps")
    p = g.add_parameter("p", TensorType((2,)))
    s = g.add_state("s", TensorType((2,)))
    g.set_output("y", g.add("all_reduce", [g.add("mul", [p, s])], reduce="mean"))
    shared = run_world(g, [{}, {}], {"p": np.array([1.0, 2.0])}, [{"s": np.array([1.0, 1.0])}, {"s": np.array([3.0, 5.0])}])
    for res in shared:
        np.testing.assert_array_equal(res.outputs["y"], np.array([2.0, 6.0], np.float32))
    with pytest.raises(ValueError, match="3 parameter tables given for a world of 2 ranks"):
        run_world(g, [{}, {}], [{"p": 0}] * 3, {"s": np.zeros(2)})


def test_world_precision_float64():
    g = _graph(reduce="mean")
    values = _rank_values(3)
    for res in run_world(g, [{"x": v} for v in values], precision="float64"):
        assert res.outputs["y"].dtype == np.float64
        np.testing.assert_allclose(res.outputs["y"], np.mean(np.stack(values).astype(np.float64), axis=0), rtol=1e-15)


def test_groups_partition_the_ranks():
    g = _graph((2,), reduce="sum", group="pairs")
    values = [np.full(2, 10.0 ** r, np.float32) for r in range(4)]
    results = run_world(g, [{"x": v} for v in values], groups={"pairs": [[0, 2], [1, 3]]})
    for r, res in enumerate(results):
        np.testing.assert_array_equal(res.outputs["y"], values[r % 2] + values[r % 2 + 2])


def test_world_errors():
    g = _graph(reduce="sum")
    x = {"x": np.zeros((3, 4), np.float32)}
    with pytest.raises(ValueError, match="2 input tables given for a world of 3 ranks"):
        run_world(g, [x, x], world_size=3)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        run_world(g, [])
    with pytest.raises(KeyError, match="group 'dp', which the world does not define"):
        run_world(_graph(reduce="sum", group="dp"), [x, x])
    with pytest.raises(ValueError, match="group 'halves' must split ranks 0..2"):
        run_world(g, [x, x, x], groups={"halves": [[0], [1]]})
    with pytest.raises(KeyError, match="missing input 'x'"):
        run_world(g, [x, {}])


def test_run_world_is_run_for_graphs_without_collectives():
    g = Graph("plain")
    a = g.add_input("a", TensorType((4,)))
    g.set_output("y", g.add("exp", [a]))
    values = [np.random.default_rng(r).standard_normal(4).astype(np.float32) for r in range(2)]
    for v, res in zip(values, run_world(g, [{"a": v} for v in values])):
        np.testing.assert_array_equal(res.outputs["y"], run(g, {"a": v}).outputs["y"])
