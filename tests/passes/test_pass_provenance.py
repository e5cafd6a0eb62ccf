"""Passes keep provenance and node ids: a node present before and after a pass has the same id
(and op, scope, loc); gradient nodes take their forward node's scope and loc, marked backward;
optimizer nodes are scoped `optimizer/<param>`; simplify keeps the surviving node's."""
from __future__ import annotations

import numpy as np
import pytest

from ember.frontends import functional as F
from ember.frontends import spec, trace
from ember.ir import Graph, TensorType, float32
from ember.passes.autodiff import grad
from ember.passes.optimizer import SGD, Adam, apply_optimizer
from ember.passes.simplify import simplify

from models import cnn, mlp


def forward(model, x_shape):
    return trace(lambda x, y: F.cross_entropy(model(x), y), spec(x_shape), spec((x_shape[0],), "int64"),
                 modules={"": model})


def assert_ids_kept(before: Graph, after: Graph) -> None:
    common = set(before.g) & set(after.g)
    assert common, "no node survived"
    for n in common:
        assert after.op(n) == before.op(n), n
        assert after.provenance(n) == before.provenance(n), n
    fresh = set(after.g) - set(before.g)
    assert all(n >= before.next_id for n in fresh), sorted(fresh)


@pytest.fixture(scope="module")
def cnn_graphs():
    fwd = forward(cnn(), (4, 1, 28, 28))
    g1 = grad(fwd)
    g2 = apply_optimizer(g1, SGD(lr=0.1, momentum=0.9))
    g3 = simplify(g2)
    return fwd, g1, g2, g3


def test_autodiff_keeps_ids_and_gives_gradients_their_forward_provenance(cnn_graphs):
    fwd, g1, _, _ = cnn_graphs
    assert set(fwd.g) <= set(g1.g)
    assert_ids_kept(fwd, g1)
    new = set(g1.g) - set(fwd.g)
    assert new and all(g1.is_backward(n) for n in new)
    assert not any(g1.is_backward(n) for n in fwd.g)
    forward_prov = {(fwd.scope(n), fwd.loc(n)) for n in fwd.g}
    assert all((g1.scope(n), g1.loc(n)) in forward_prov for n in new)
    (gw0,) = [n for n in g1.g if g1.op(n) == "conv2d_grad_weight" and g1.scope(n) == "0"]
    (conv0,) = [n for n in fwd.g if fwd.op(n) == "conv2d" and fwd.scope(n) == "0"]
    assert g1.loc(gw0) == fwd.loc(conv0) and g1.where(gw0).startswith("0 (grad) models.py:")
    assert g1.outputs["grad:0.weight"] == gw0
    assert {g1.scope(n) for n in new} >= {"0", "1", "2", "3", "4", "5"}


def test_optimizer_scopes_its_nodes_by_parameter(cnn_graphs):
    _, g1, g2, _ = cnn_graphs
    assert_ids_kept(g1, g2)
    new = set(g2.g) - set(g1.g)
    assert all(g2.scope(n).startswith("optimizer") and not g2.is_backward(n) for n in new)
    for name, p in g2.parameters.items():
        upd = g2.updates[name]
        assert g2.scope(upd) == f"optimizer/{name}" and g2.loc(upd) == g2.loc(p)
        assert g2.scope(g2.states[f"{name}.momentum_buffer"]) == f"optimizer/{name}"


def test_adam_shared_scalars_are_scoped_optimizer():
    g = apply_optimizer(grad(forward(mlp(), (4, 784))), Adam(lr=1e-3))
    assert g.scope(g.states["step"]) == "optimizer"
    assert g.scope(g.updates["step"]) == "optimizer"
    assert g.scope(g.updates["0.weight.exp_avg"]) == "optimizer/0.weight"


def test_simplify_keeps_ids_and_provenance_of_surviving_nodes(cnn_graphs):
    _, _, g2, g3 = cnn_graphs
    assert_ids_kept(g2, g3)
    # rewritten and folded nodes take the provenance of the node they replace
    for n in set(g3.g) - set(g2.g):
        assert g3.scope(n) != "" or g3.loc(n) is not None, g3.where(n)


def test_folded_constant_and_rewrite_carry_the_replaced_nodes_provenance():
    g = Graph("f")
    x = g.add_input("x", TensorType((2, 3), float32))
    c = g.add("add", [g.add_constant(np.float32(1)), g.add_constant(np.float32(2))], loc="m.py:3", scope="blk")
    t = g.add("transpose", [g.add("transpose", [x], perm=(1, 0), loc="m.py:4", scope="a")], perm=(1, 0),
              loc="m.py:5", scope="b", backward=True)
    g.set_output("y", g.add("mul", [t, c], loc="m.py:6", scope="c"))
    s = simplify(g)
    (const,) = [n for n in s.g if s.op(n) == "constant"]
    assert const >= g.next_id and s.provenance(const) == {"loc": "m.py:3", "scope": "blk", "backward": False}
    (mul,) = [n for n in s.g if s.op(n) == "mul"]
    assert mul == g.outputs["y"] and s.where(mul) == "c m.py:6"


def test_dump_ids_match_between_passes(cnn_graphs):
    """A node's printed id is the same in every pass dump that contains it."""
    from ember.ir import format_graph
    _, g1, g2, g3 = cnn_graphs
    (gw,) = [n for n in g3.g if g3.op(n) == "conv2d_grad_weight" and g3.scope(n) == "2"]
    for g in (g1, g2, g3):
        line = next(l for l in format_graph(g, show_notes=True).splitlines() if l.startswith(f"  %{gw} = "))
        assert "conv2d_grad_weight" in line and line.endswith(g.where(gw))
