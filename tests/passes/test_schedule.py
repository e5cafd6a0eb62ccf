"""passes/schedule.py: the kernel order is a topological order of the whole graph, every kernel
appears once, and an update is written in place only where no reader of its parameter runs after it."""
from __future__ import annotations

from ember import ir
from ember.passes.fusion import fuse
from ember.passes.schedule import schedule

from models import cnn, mlp, train_graph


def _check_order(g: ir.Graph) -> list[int]:
    steps = g.meta["schedule"]
    assert len(steps) == len(set(steps))
    pos = {n: i for i, n in enumerate(steps)}
    assert {n for n in g.nodes() if g.op(n) == "fused"} <= set(steps)
    for n in steps:
        for o in g.operands(n):
            assert o not in pos or pos[o] < pos[n], f"%{n} scheduled before its operand %{o}"
    return steps


def test_schedule_is_topological_and_updates_in_place_after_every_reader():
    # _param_graph builds (so numbers) the update before the parameter's other readers: only the
    # schedule's ordering edges put them first
    for graph in (_param_graph(False), train_graph(mlp(), (16, 784)), train_graph(cnn(), (2, 1, 28, 28))):
        g = schedule(fuse(graph))
        steps = _check_order(g)
        pos = {n: i for i, n in enumerate(steps)}
        in_place = [(k, n) for k, n in g.updates.items() if g.notes(n).get("storage") == "parameter"]
        assert {k for k, _ in in_place} >= {k for k in g.parameters if k.endswith("w") or k.endswith("weight")}
        for name, n in in_place:
            for reader, _ in g.users(g.parameters[name]):
                assert reader == n or pos[reader] < pos[n], f"{name}: %{reader} reads it after the update"


def _param_graph(update_is_output: bool) -> ir.Graph:
    g = ir.Graph("upd")
    w = g.add_parameter("w", ir.TensorType((4, 4)))
    x = g.add_input("x", ir.TensorType((4, 4)))
    upd = g.add("sub", [w, g.add("mul", [x, g.add_constant(0.5, "float32")])])
    g.set_update("w", upd)
    g.set_output("direct", g.add("sum", [g.add("mul", [w, x])], axes=(0, 1)))
    if update_is_output:  # an output's buffer is the caller's, not the parameter's storage
        g.set_output("new_w", upd)
    return g


def test_an_update_that_is_also_an_output_is_not_written_in_place():
    plain = schedule(fuse(_param_graph(False)))
    (upd,) = plain.updates.values()
    assert plain.notes(upd).get("storage") == "parameter"
    both = schedule(fuse(_param_graph(True)))
    (upd,) = both.updates.values()
    assert both.notes(upd).get("storage") != "parameter"
    _check_order(both)


def test_schedule_is_deterministic():
    g = fuse(train_graph(mlp(), (16, 784)))
    assert schedule(g).meta["schedule"] == schedule(g).meta["schedule"]
