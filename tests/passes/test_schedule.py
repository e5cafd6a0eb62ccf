"""passes/schedule.py: the kernel order is a topological order of the whole graph, every kernel
appears once, and an update is written in place only where no reader of its parameter runs after it."""
from __future__ import annotations

import numpy as np

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


def test_a_reader_through_a_reshape_alias_runs_before_an_in_place_update():
    """w's update is an output of the reduction kernel (it reads w at its output index only), and
    a later kernel reads w through a reshape alias: the update must not overwrite w before that
    kernel ran, which here (the later kernel needs the reduction's sum) means not in place."""
    from ember.passes.memory import plan_memory
    from ember.passes.targets import FusionCaps
    g = ir.Graph("alias")
    w = g.add_parameter("w", ir.TensorType((4,)))
    x = g.add_input("x", ir.TensorType((8, 4)))
    row = g.add("reshape", [w], shape=(1, 4))  # read by two kernels: it stays a top-level alias of w
    s = g.add("sum", [g.add("mul", [x, row])], axes=(0,))
    g.set_update("w", g.add("sub", [w, g.add("mul", [s, g.add_constant(0.1, "float32")])]))
    later = g.add("add", [g.add("mul", [x, row]), g.add("reshape", [s], shape=(1, 4))])
    g.set_output("y", later)
    fused = fuse(g, FusionCaps(multi_output=True))
    sched = schedule(fused)
    _check_order(sched)
    pos = {n: i for i, n in enumerate(sched.meta["schedule"])}
    upd = sched.updates["w"]
    kernel = sched.operands(upd)[0] if sched.op(upd) == "fused_output" else upd
    readers = [u for u in sched.g if sched.op(u) == "fused" and u != kernel
               and any(sched.op(o) == "reshape" and sched.operands(o) == [w] for o in sched.operands(u))]
    assert readers, "the later kernel reads w through the alias"
    if sched.notes(upd).get("storage") == "parameter":
        assert all(pos[r] < pos[kernel] for r in readers)
    else:
        assert any(pos[r] > pos[kernel] for r in readers)
    planned = plan_memory(sched)
    x_val = np.arange(32, dtype=np.float32).reshape(8, 4) / 10
    w_val = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
    want, got = ir.run(g, {"x": x_val}, {"w": w_val}), ir.run(planned, {"x": x_val}, {"w": w_val})
    np.testing.assert_array_equal(got.outputs["y"], want.outputs["y"])
