"""Memory planning: no two live buffers overlap, peak below the sum, updates written in place."""
from __future__ import annotations

import numpy as np

from ember import ir
from ember.passes.fusion import fuse
from ember.passes.memory import check_plan, plan_memory

from models import cnn, cpu_plan, mlp, run_both, train_graph


def test_cnn_step_plan_has_no_overlap_and_reuses_memory():
    m = cnn()
    planned = plan_memory(fuse(train_graph(m, (64, 1, 28, 28))))
    check_plan(planned)  # every pair of simultaneously live arena buffers is disjoint
    assert planned.meta["arena_bytes"] < planned.meta["buffer_bytes_total"]
    # schedule covers every node once, in an order consistent with the edges
    pos = {n: i for i, n in enumerate(planned.meta["schedule"])}
    assert sorted(pos) == sorted(planned.g.nodes)
    for u, v in planned.g.edges():
        assert pos[u] < pos[v]


def test_parameter_updates_are_in_place_and_read_after_all_uses():
    m = mlp()
    planned = plan_memory(fuse(train_graph(m, (64, 784))))
    pos = {n: i for i, n in enumerate(planned.meta["schedule"])}
    in_place = 0
    for name, n in planned.updates.items():
        notes = planned.notes(n)
        if notes["storage"] == "parameter":
            in_place += 1
            assert notes["name"] == name
            src = planned.parameters[name]
            assert all(pos[u] <= pos[n] for u, _ in planned.users(src))
    assert in_place >= 2  # the weights at least (bias updates may fuse with their reductions)


def test_planned_graph_still_evaluates_the_same():
    m = mlp()
    g = train_graph(m, (32, 784))
    planned = plan_memory(fuse(g))
    a, b = run_both(g, planned, m, (32, 784), seed=2)
    np.testing.assert_allclose(a.outputs["loss"], b.outputs["loss"], rtol=1e-6)


def test_aligned_offsets():
    planned = plan_memory(fuse(train_graph(mlp(), (8, 784))))
    for n in planned.meta["liveness"]:
        assert planned.notes(n)["offset"] % 64 == 0


# ---- independent checks: recomputed here from the schedule and the operands, not read from the plan

def _buffer_of(planned: ir.Graph, n: int) -> int:
    """The node owning n's memory, following reshape aliases."""
    while planned.notes(n)["storage"] == "alias":
        n = planned.notes(n)["alias_of"]
    return n


def _readers(planned: ir.Graph, buffer: int) -> set[int]:
    """Nodes that read `buffer`, directly or through any chain of aliases of it."""
    out = set()
    for n in planned.nodes():
        if planned.notes(n).get("storage") == "alias":
            continue  # an alias reads nothing itself; its users are the readers
        if any(_buffer_of(planned, o) == buffer for o in planned.operands(n)):
            out.add(n)
    return out


def _independent_liveness(planned: ir.Graph) -> dict[int, tuple[int, int]]:
    """Arena buffer -> (position written, last position read), from the schedule alone; outputs and
    updates stay live to the end of the step."""
    pos = {n: i for i, n in enumerate(planned.meta["schedule"])}
    end = len(pos)
    live = {}
    for n in planned.nodes():
        storage = planned.notes(n)["storage"]
        if storage not in ("arena", "input"):
            continue
        first = -1 if storage == "input" else pos[n]  # an input buffer is filled before the first kernel
        last = max((pos[r] for r in _readers(planned, n)), default=pos[n])
        if any(_buffer_of(planned, o) == n for o in list(planned.outputs.values()) + list(planned.updates.values())):
            last = end
        live[n] = (first, last)
    return live


def _assert_no_overlap(planned: ir.Graph) -> None:
    live = _independent_liveness(planned)
    items = [(n, s, e, planned.notes(n)["offset"], planned.type(n).nbytes) for n, (s, e) in live.items()]
    pos = {n: i for i, n in enumerate(planned.meta["schedule"])}
    items += [(f"scratch of %{n}", pos[n], pos[n], planned.notes(n)["scratch_offset"],
               planned.attrs(n)["kernel"].scratch_bytes)  # a kernel's scratch: live while it runs
              for n in planned.nodes() if planned.op(n) == "fused" and planned.attrs(n)["kernel"].scratch_bytes]
    for i, (a, s1, e1, o1, z1) in enumerate(items):
        for b, s2, e2, o2, z2 in items[i + 1:]:
            if not (e1 < s2 or e2 < s1):
                assert o1 + z1 <= o2 or o2 + z2 <= o1, f"%{a} [{s1},{e1}] and %{b} [{s2},{e2}] are live together and overlap"


def _assert_in_place_updates_after_readers(planned: ir.Graph) -> int:
    pos = {n: i for i, n in enumerate(planned.meta["schedule"])}
    count = 0
    for name, n in planned.updates.items():
        if planned.notes(n)["storage"] not in ("parameter", "state"):
            continue
        count += 1
        source = planned.parameters.get(name, planned.states.get(name))
        for r in _readers(planned, source) - {n}:
            assert pos[r] < pos[n], f"%{r} reads {name!r} after its in-place update %{n} overwrote it"
    return count


def _through_alias_graph() -> ir.Graph:
    """A reshaped activation read after a long gap (its liveness runs through the alias)."""
    g = ir.Graph("alias_reads")
    x = g.add_input("x", ir.TensorType((8, 16)))
    h = g.add("exp", [g.add("sum", [x], axes=(1,))])          # arena buffer %h
    r = g.add("reshape", [h], shape=(2, 4))                    # alias of %h
    t = x
    for _ in range(4):                                         # unrelated work between
        t = g.add("tanh", [g.add("sum", [t], axes=(1,), keepdims=True) if t is x else t])
    late = g.add("sum", [g.add("mul", [r, g.add("reshape", [g.add("sum", [t], axes=(1,))], shape=(2, 4))])], axes=(0, 1))
    g.set_output("out", late)
    return g


def _update_before_readers_graph() -> ir.Graph:
    """An SGD-like in-place update built (so numbered) before the other readers of the parameter,
    one of them reading it through a reshape: only the planner's ordering edges keep them first."""
    g = ir.Graph("update_order")
    w = g.add_parameter("w", ir.TensorType((4, 4)))
    x = g.add_input("x", ir.TensorType((4, 4)))
    g.set_update("w", g.add("sub", [w, g.add("mul", [x, g.add_constant(0.5, "float32")])]))
    g.set_output("direct", g.add("sum", [g.add("mul", [w, x])], axes=(0, 1)))
    flat = g.add("reshape", [w], shape=(16,))
    g.set_output("via_alias", g.add("sum", [g.add("exp", [flat])], axes=(0,)))
    return g


def test_liveness_recomputed_independently_has_no_overlap():
    for graph in (_through_alias_graph(), train_graph(mlp(), (16, 784)), train_graph(cnn(), (4, 1, 28, 28))):
        _assert_no_overlap(plan_memory(fuse(graph)))
        _assert_no_overlap(cpu_plan(graph))  # with kernel scratch in the arena


def test_in_place_updates_are_scheduled_after_every_reader():
    for graph in (_update_before_readers_graph(), train_graph(mlp(), (16, 784))):
        planned = plan_memory(fuse(graph))
        assert _assert_in_place_updates_after_readers(planned) >= 1


def test_update_before_readers_compiles_to_the_reference_values():
    from ember.runtime.cpu import CpuExecutor
    from ember.runtime.executor import HostStorage
    g = _update_before_readers_graph()
    rng = np.random.default_rng(0)
    w, x = rng.random((4, 4), dtype=np.float32), rng.random((4, 4), dtype=np.float32)
    want = ir.run(g, {"x": x}, {"w": w.copy()})
    storage = HostStorage({"w": w.copy()})
    got = CpuExecutor(cpu_plan(g), storage)({"x": x})
    for k in ("direct", "via_alias"):
        np.testing.assert_allclose(got[k], want.outputs[k], rtol=1e-6, err_msg=k)  # float32, a 16-term sum
    np.testing.assert_allclose(storage["w"], want.updates["w"], rtol=1e-6)


def _alias_chain_graph() -> ir.Graph:
    """A reshape of a reshape of an activation, read early and again at the end: `simplify` would
    merge the chain, so only a direct plan_memory sees an alias whose source is itself an alias."""
    g = ir.Graph("alias_chain")
    x = g.add_input("x", ir.TensorType((8, 16)))
    h = g.add("exp", [g.add("sum", [x], axes=(1,))])          # arena buffer %h
    r = g.add("reshape", [g.add("reshape", [h], shape=(4, 2))], shape=(2, 4))
    g.set_output("early", g.add("sum", [r], axes=(0, 1)))     # a first reader: the chain is placed early
    t = x
    for _ in range(4):                                         # same-sized work that could reuse %h
        t = g.add("tanh", [g.add("sum", [t], axes=(1,)) if t is x else g.add("neg", [t])])
    g.set_output("out", g.add("sum", [g.add("mul", [r, g.add("reshape", [t], shape=(2, 4))])], axes=(0, 1)))
    return g


def test_an_alias_of_an_alias_keeps_its_base_buffer_live():
    g = _alias_chain_graph()
    planned = plan_memory(g)
    chain = [n for n in planned.nodes() if planned.op(n) == "reshape" and planned.op(planned.operands(n)[0]) == "reshape"]
    assert chain and all(planned.op(_buffer_of(planned, n)) == "exp" for n in chain)
    _assert_no_overlap(planned)
    check_plan(planned)
    # and compiled (the arena is real there), the values are the interpreter's
    from ember.runtime.cpu import CpuExecutor
    from ember.runtime.executor import HostStorage
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    want = ir.run(g, {"x": x}).outputs
    got = CpuExecutor(cpu_plan(g), HostStorage())({"x": x})
    for k in ("early", "out"):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, err_msg=k)
