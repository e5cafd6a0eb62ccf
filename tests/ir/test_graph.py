"""Graph: building, verify(), copy, deterministic order, editing helpers, printer and DOT export,
fused groups in the interpreter."""
from __future__ import annotations

import re

import networkx as nx
import numpy as np
import pytest

from ember.ir import (Graph, ShapeError, TensorType, VerifyError, evaluate, float32, format_graph, int64, run,
                      subgraph_of, to_dot)


def f32(*shape):
    return TensorType(shape, float32)


def mlp_like(name: str = "net") -> Graph:
    """x @ w + b -> relu -> sum; plus a step counter state updated by +1."""
    g = Graph(name)
    x = g.add_input("x", f32(4, 3))
    w = g.add_parameter("w", f32(3, 5))
    b = g.add_parameter("b", f32(5))
    step = g.add_state("step", TensorType((), int64))
    h = g.add("relu", [g.add("add", [g.add("matmul", [x, w]), b])])
    g.set_output("h", h)
    g.set_output("loss", g.add("sum", [h], axes=(0, 1)))
    g.set_update("step", g.add("add", [step, g.add_constant(1, "int64")]))
    return g.verify()


def feeds(seed: int = 0):
    rng = np.random.default_rng(seed)
    return ({"x": rng.standard_normal((4, 3)).astype(np.float32)},
            {"w": rng.standard_normal((3, 5)).astype(np.float32), "b": rng.standard_normal(5).astype(np.float32)},
            {"step": np.int64(7)})


# ---- building --------------------------------------------------------------------------------

def test_build_and_read():
    g = mlp_like()
    assert list(g.inputs) == ["x"] and list(g.parameters) == ["w", "b"] and list(g.states) == ["step"]
    assert list(g.outputs) == ["h", "loss"] and list(g.updates) == ["step"]
    mm = next(n for n in g.nodes() if g.op(n) == "matmul")
    assert g.operands(mm) == [g.inputs["x"], g.parameters["w"]]
    assert g.type(mm) == f32(4, 5)
    assert g.users(g.inputs["x"]) == [(mm, 0)]
    assert g.count("add") == 2 and g.count() == len(g) == 10
    assert g.roots() == [g.outputs["h"], g.outputs["loss"], g.updates["step"]]
    assert mm in g and 999 not in g


def test_repeated_operand_gives_parallel_edges():
    g = Graph()
    x = g.add_input("x", f32(3))
    sq = g.add("mul", [x, x])
    assert g.operands(sq) == [x, x]
    assert g.users(x) == [(sq, 0), (sq, 1)]
    g.set_output("y", sq)
    np.testing.assert_array_equal(evaluate(g.verify(), np.array([1, 2, 3], np.float32)), [1, 4, 9])


def test_building_errors():
    g = Graph("g")
    x = g.add_input("x", f32(2))
    with pytest.raises(ValueError, match="already has an entry named 'x'"):
        g.add_parameter("x", f32(2))
    with pytest.raises(VerifyError, match="operand %42"):
        g.add("neg", [42])
    with pytest.raises(ShapeError, match="at model.py:7"):
        g.add("matmul", [x, x], loc="model.py:7")
    with pytest.raises(ValueError, match="neither a parameter nor a state"):
        g.set_update("x", x)
    p = g.add_parameter("p", f32(3))
    with pytest.raises(ShapeError, match="update of 'p'"):
        g.set_update("p", x)
    assert g.count() == 2  # failed adds leave nothing behind
    assert p in g


def test_run_results_and_feed_errors():
    g = mlp_like()
    i, p, s = feeds()
    res = run(g, i, p, s)
    h = np.maximum(i["x"] @ p["w"] + p["b"], 0)
    np.testing.assert_allclose(res.outputs["h"], h, rtol=1e-6)
    np.testing.assert_allclose(res.outputs["loss"], h.sum(), rtol=1e-5)
    assert res.updates["step"] == 8 and res.updates["step"].dtype == np.int64
    with pytest.raises(KeyError, match="missing parameter 'b'"):
        run(g, i, {"w": p["w"]}, s)
    with pytest.raises(ValueError, match="input 'x': expected shape"):
        run(g, {"x": np.zeros((3, 4), np.float32)}, p, s)
    r64 = run(g, i, p, s, precision="float64")
    assert r64.outputs["h"].dtype == np.float64 and r64.updates["step"].dtype == np.int64
    np.testing.assert_allclose(r64.outputs["h"], h, rtol=1e-5, atol=1e-6)


# ---- verify ----------------------------------------------------------------------------------

def test_verify_catches_a_cycle():
    g = mlp_like()
    relu = next(n for n in g.nodes() if g.op(n) == "relu")
    add = g.operands(relu)[0]
    g.g.add_edge(relu, add, key=2)  # relu now feeds the add that feeds it
    with pytest.raises(VerifyError, match="cycle"):
        g.verify()


def test_verify_catches_a_wrong_stored_type():
    g = mlp_like()
    relu = next(n for n in g.nodes() if g.op(n) == "relu")
    g.g.nodes[relu]["type"] = f32(5, 4)
    with pytest.raises(VerifyError, match=re.escape("stored type f32[5,4] but the rule gives f32[4,5]")):
        g.verify()


def test_verify_catches_bad_operand_indices():
    g = mlp_like()
    mm = next(n for n in g.nodes() if g.op(n) == "matmul")
    w = g.parameters["w"]
    g.g.remove_edge(w, mm, key=1)
    g.g.add_edge(w, mm, key=3)
    with pytest.raises(VerifyError, match=r"operand indices \[0, 3\]"):
        g.verify()
    g = mlp_like()
    mm = next(n for n in g.nodes() if g.op(n) == "matmul")
    g.g.add_edge(g.inputs["x"], mm, key=1)  # a second operand 1 from another node: indices [0, 1, 1]
    with pytest.raises(VerifyError, match="operand indices"):
        g.verify()


def test_the_operand_list_follows_every_edit_and_verify_catches_an_edge_edited_around_it():
    """`operands` reads the list each node keeps (add, replace_uses, set_operand update it), not
    its sorted in-edges; verify compares the two."""
    g = mlp_like()
    mm = next(n for n in g.nodes() if g.op(n) == "matmul")
    x, w = g.operands(mm)
    w2 = g.add_parameter("w2", g.type(w))
    g.replace_uses(w, w2)
    assert g.operands(mm) == [x, w2]
    g.set_operand(mm, 1, w)
    assert g.operands(mm) == [x, w]
    twice = g.add("add", [w, w])
    g.replace_uses(w, w2)
    assert g.operands(twice) == [w2, w2] and g.operands(mm) == [x, w2]
    g.copy().verify(full=True)
    g.g.remove_edge(w2, mm, key=1)
    g.g.add_edge(w, mm, key=1)  # the edge says w, the list still says w2
    with pytest.raises(VerifyError, match=r"operand list .* is not its in-edges"):
        g.verify()


def test_verify_catches_a_missing_operand():
    g = mlp_like()
    mm = next(n for n in g.nodes() if g.op(n) == "matmul")
    g.g.remove_edge(g.parameters["w"], mm, key=1)
    with pytest.raises(VerifyError, match="matmul takes 2 operand"):
        g.verify()


def test_verify_catches_a_dangling_output_and_update():
    g = mlp_like()
    g.remove(g.outputs["loss"])
    with pytest.raises(VerifyError, match="'loss' refers to a removed node"):
        g.verify()
    g = mlp_like()
    g.remove(g.updates["step"])
    with pytest.raises(VerifyError, match="'step' refers to a removed node"):
        g.verify()


def test_verify_catches_broken_registrations():
    g = mlp_like()
    g.inputs["y"] = g.inputs.pop("x")
    with pytest.raises(VerifyError, match="input 'y' does not name a matching input node"):
        g.verify()
    g = mlp_like()
    del g.parameters["b"]
    with pytest.raises(VerifyError, match="parameter 'b' is not registered"):
        g.verify()
    g = mlp_like()
    g.updates["step"] = g.outputs["loss"]
    with pytest.raises(VerifyError, match="update 'step' does not match"):
        g.verify()
    g = mlp_like()
    g.g.nodes[g.outputs["h"]]["op"] = "frobnicate"
    with pytest.raises(VerifyError, match="unknown op 'frobnicate'"):
        g.verify()


def test_verify_returns_the_graph():
    g = mlp_like()
    assert g.verify() is g


# ---- copy, order, editing --------------------------------------------------------------------

def test_copy_is_independent():
    g = mlp_like()
    before = str(g)
    c = g.copy("c")
    assert c.name == "c" and g.name == "net"
    assert str(c).replace("graph c", "graph net") == before
    relu = next(n for n in c.nodes() if c.op(n) == "relu")
    t = c.add("tanh", [relu])
    c.replace_uses(relu, t)
    c.set_operand(t, 0, relu)  # replace_uses also moved the tanh's own use of relu; restore it
    c.set_output("extra", t)
    c.annotate(t, "group", 1)
    c.meta["arena"] = 123
    c.verify()
    c.attrs(g.outputs["loss"])["keepdims"] = True  # attribute dicts are per copy
    assert str(g) == before
    assert "extra" not in g.outputs and "arena" not in g.meta and t not in g
    assert g.attrs(g.outputs["loss"])["keepdims"] is False
    assert g.notes(g.outputs["loss"]) == {}
    g.verify()
    # and the other way round
    g.annotate(g.outputs["h"], "x", 1)
    assert c.notes(g.outputs["h"]) == {}


def test_copy_evaluates_the_same():
    g = mlp_like()
    c = g.copy()
    i, p, s = feeds(3)
    a, b = run(g, i, p, s), run(c, i, p, s)
    for k in a.outputs:
        np.testing.assert_array_equal(a.outputs[k], b.outputs[k])


def test_topo_order_is_deterministic_and_topological():
    g1, g2 = mlp_like(), mlp_like()
    assert g1.topo_order() == g2.topo_order() == g1.nodes()
    order = g1.topo_order()
    pos = {n: i for i, n in enumerate(order)}
    for u, v in g1.g.edges():
        assert pos[u] < pos[v]
    # among ready nodes, the smallest id comes first: sources in creation order lead
    assert order[:4] == sorted(order[:4])
    assert sorted(order) == sorted(g1.g.nodes)


def test_topo_order_after_edits_puts_a_late_node_before_its_user():
    g = Graph()
    x = g.add_input("x", f32(3))
    e = g.add("exp", [x])
    g.set_output("y", e)
    late = g.add("neg", [x])  # created after exp, then made its operand
    g.set_operand(e, 0, late)
    order = g.verify().topo_order()
    assert order.index(late) < order.index(e)
    np.testing.assert_allclose(evaluate(g, np.array([0, 1, 2], np.float32)), np.exp(-np.arange(3)), rtol=1e-6)


def _random_dag(seed: int) -> Graph:
    """A graph of adds and negs over random earlier nodes, some rewired after the fact (so ids and
    edge insertion orders disagree with the topological order), with repeated operands."""
    rng = np.random.default_rng(seed)
    g = Graph()
    nodes = [g.add_input(f"x{i}", f32(2)) for i in range(3)]
    for _ in range(40):
        if rng.random() < 0.3:
            nodes.append(g.add("neg", [nodes[rng.integers(len(nodes))]]))
        else:
            a, b = rng.integers(len(nodes), size=2)
            nodes.append(g.add("add", [nodes[a], nodes[b]]))
    for _ in range(10):  # point an operand at a later node that does not depend on the user
        v = nodes[rng.integers(3, len(nodes))]
        free = [n for n in nodes if n != v and v not in nx.ancestors(g.g, n)]
        g.set_operand(v, int(rng.integers(len(g.operands(v)))), free[rng.integers(len(free))])
    g.set_output("y", nodes[-1])
    return g.verify(full=True)


@pytest.mark.parametrize("seed", range(5))
def test_topo_order_copy_and_edges_match_networkx(seed):
    """topo_order, operands, users and copy read networkx's dicts directly: the same results
    and iteration orders as its own algorithms and views."""
    g = _random_dag(seed)
    assert g.topo_order() == list(nx.lexicographical_topological_sort(g.g, key=lambda n: n))
    for n in g.g:
        assert g.operands(n) == [u for _, u in sorted((k, u) for u, _, k in g.g.in_edges(n, keys=True))]
        assert g.users(n) == sorted((v, k) for _, v, k in g.g.out_edges(n, keys=True))
    ours, theirs = g.copy().g, g.g.copy()
    assert list(ours.nodes(data=True)) == list(theirs.nodes(data=True))
    assert list(ours.edges(keys=True, data=True)) == list(theirs.edges(keys=True, data=True))
    for n in theirs:
        assert list(ours.pred[n]) == list(theirs.pred[n])
        assert [list(k) for k in ours.pred[n].values()] == [list(k) for k in theirs.pred[n].values()]
        for u in ours.pred[n]:
            assert ours._pred[n][u] is ours._succ[u][n]  # one key dict per node pair, as networkx keeps it
    cyclic = g.copy()
    u, v = next(iter(cyclic.g.edges()))
    cyclic.g.add_edge(v, u, key=9)
    with pytest.raises(nx.NetworkXUnfeasible):
        cyclic.topo_order()


def test_replace_uses_moves_operands_outputs_and_updates():
    g = Graph()
    x = g.add_input("x", f32(3))
    s = g.add_state("s", f32(3))
    a = g.add("exp", [x])
    m = g.add("mul", [a, a])
    g.set_output("a", a)
    g.set_output("m", m)
    g.set_update("s", a)
    b = g.add("tanh", [x])
    g.replace_uses(a, b)
    assert g.operands(m) == [b, b]
    assert g.outputs == {"a": b, "m": m} and g.updates == {"s": b}
    assert g.users(a) == []
    g.remove(a)
    g.verify()
    xv = np.array([0.1, 0.2, 0.3], np.float32)
    res = run(g, {"x": xv}, {}, {"s": np.zeros(3, np.float32)})
    np.testing.assert_allclose(res.outputs["m"], np.tanh(xv) ** 2, rtol=1e-6)
    g.replace_uses(b, b)  # no-op
    assert g.operands(m) == [b, b]
    assert s in g


def test_set_operand_and_remove():
    g = Graph()
    x, y = g.add_input("x", f32(2)), g.add_input("y", f32(2))
    d = g.add("sub", [x, y])
    g.set_output("d", d)
    g.set_operand(d, 1, x)
    assert g.operands(d) == [x, x]
    g.remove(y)
    assert "y" not in g.inputs
    np.testing.assert_array_equal(evaluate(g.verify(), np.array([1, 2], np.float32)), [0, 0])


def test_subgraph_of():
    g = mlp_like()
    mm = next(n for n in g.nodes() if g.op(n) == "matmul")
    add = g.users(mm)[0][0]
    relu = g.users(add)[0][0]
    c = g.add_constant(np.float32(2))
    dbl = g.add("mul", [relu, c])
    sub, outer = subgraph_of(g, [add, relu, c, dbl], dbl, name="grp")
    assert outer == [mm, g.parameters["b"]]
    assert list(sub.inputs) == ["in0", "in1"] and list(sub.outputs) == ["out"]
    assert sub.count("constant") == 1 and sub.count("add") == 1 and sub.name == "grp"
    sub.verify()
    xs = [np.ones((4, 5), np.float32) * -1, np.arange(5, dtype=np.float32)]
    np.testing.assert_array_equal(evaluate(sub, *xs), 2 * np.maximum(xs[0] + xs[1], 0))


# ---- printer ---------------------------------------------------------------------------------

EXPECTED_TEXT = """\
graph net {
  %0 = input 'x' : f32[4,3]
  %1 = parameter 'w' : f32[3,5]
  %2 = parameter 'b' : f32[5]
  %3 = state 'step' : i64[]
  %4 = matmul(%0, %1) : f32[4,5]
  %5 = add(%4, %2) : f32[4,5]
  %6 = relu(%5) : f32[4,5]
  %7 = sum(%6) axes=(0,1) keepdims=False : f32[]
  %8 = constant 1 : i64[]
  %9 = add(%3, %8) : i64[]
  output 'h' = %6
  output 'loss' = %7
  update 'step' = %9
}"""


def test_printer_text_is_exact():
    assert str(mlp_like()) == EXPECTED_TEXT
    assert format_graph(mlp_like()) == EXPECTED_TEXT


def test_printer_names_nodes_by_their_real_ids():
    # node ids are stable names: the printer shows the ids editing left behind (no renumbering),
    # so `%7` in a dump is node 7 of the graph, as in kernel headers and error messages
    g = Graph("net")
    junk = [g.add_input(f"j{i}", f32(1)) for i in range(5)]
    for j in junk:
        g.remove(j)
    x = g.add_input("x", f32(4, 3))
    w = g.add_parameter("w", f32(3, 5))
    b = g.add_parameter("b", f32(5))
    step = g.add_state("step", TensorType((), int64))
    mm = g.add("matmul", [x, w])
    g.remove(g.add("neg", [mm]))
    h = g.add("relu", [g.add("add", [mm, b])])
    g.set_output("h", h)
    g.set_output("loss", g.add("sum", [h], axes=(0, 1)))
    g.set_update("step", g.add("add", [step, g.add_constant(1, "int64")]))
    assert min(g.g.nodes) == 5
    text = str(g.verify())
    assert f"  %{h} = relu(%{h - 1}) : f32[4,5]" in text and f"  %{mm} = matmul(%{x}, %{w}) : f32[4,5]" in text
    assert f"output 'h' = %{h}" in text
    printed = [int(m) for m in re.findall(r"^  %(\d+) = ", text, re.M)]
    assert printed == g.topo_order() and sorted(printed) == sorted(g.g.nodes)
    assert str(g.copy()) == text
    assert str(mlp_like()) == str(mlp_like())


def test_printer_after_a_rewrite_still_prints_topologically():
    g = mlp_like()
    relu = g.outputs["h"]
    r2 = g.add("relu", [g.operands(relu)[0]])
    g.replace_uses(relu, r2)
    g.remove(relu)
    lines = str(g.verify()).splitlines()
    defined = set()
    for line in lines[1:-1]:
        if m := re.match(r"  %(\d+) = \w+(?:\((.*?)\))?", line):
            uses = re.findall(r"%(\d+)", m.group(2) or "")
            assert set(uses) <= defined, line
            defined.add(m.group(1))
    assert len(defined) == len(g)


def test_printer_constants_and_attributes():
    g = Graph("c")
    x = g.add_input("x", f32(2, 3))
    a = g.add("mul", [x, g.add_constant(np.float32(0.1))])
    b = g.add("add", [a, g.add_constant(np.array([1, 2, 3], np.float32))])
    c = g.add("sub", [b, g.add_constant(np.zeros((2, 3), np.float32))])
    d = g.add("cast", [g.add("transpose", [c], perm=(1, 0))], dtype="int32")
    g.set_output("d", d)
    text = str(g.verify())
    assert "constant 0.1 : f32[]" in text
    assert "constant [1.,2.,3.] : f32[3]" in text
    assert "constant <float32[2, 3]> : f32[2,3]" in text
    assert "transpose(%6) perm=(1,0) : f32[3,2]" in text
    assert "cast(%7) dtype=int32 : i32[3,2]" in text


def test_printer_notes():
    g = mlp_like()
    g.annotate(g.outputs["h"], "group", 2)
    assert str(g) == EXPECTED_TEXT  # notes are hidden by default
    assert "[group=2]" in format_graph(g, show_notes=True)


# ---- DOT -------------------------------------------------------------------------------------

NODE_RE = re.compile(r'^  n(\d+) \[label="%(\d+) (\w+)(?: ([\w.]+))?\\n([^"]+)"[^\]]*\];$')
EDGE_RE = re.compile(r'^  n(\d+) -> n(\d+) \[label="(\d+)"\];$')
OUT_RE = re.compile(r'^  "out:([^"]+)" \[shape=ellipse\]; n(\d+) -> "out:\1";$')


def parse_dot(text: str):
    lines = text.splitlines()
    assert lines[0].startswith("digraph ") and lines[0].endswith("{") and lines[-1] == "}"
    nodes, edges, outs = {}, [], {}
    for line in lines[1:-1]:
        if m := NODE_RE.match(line):
            assert m.group(1) == m.group(2)
            nodes[int(m.group(1))] = (m.group(3), m.group(4), m.group(5))
        elif m := EDGE_RE.match(line):
            edges.append((int(m.group(1)), int(m.group(2)), int(m.group(3))))
        elif m := OUT_RE.match(line):
            outs[m.group(1)] = int(m.group(2))
        else:
            assert line.strip().startswith("node ["), f"unparsed DOT line: {line!r}"
    return nodes, edges, outs


def test_dot_export_has_every_node_edge_and_output():
    g = mlp_like()
    text = to_dot(g)
    assert text == g.to_dot()
    nodes, edges, outs = parse_dot(text)
    order = g.topo_order()
    num = {n: i for i, n in enumerate(order)}
    assert set(nodes) == set(range(len(g)))
    for n in order:
        op, name, ty = nodes[num[n]]
        assert op == g.op(n) and ty == str(g.type(n))
        if op in ("input", "parameter", "state"):
            assert name == g.attrs(n)["name"]
    assert sorted(edges) == sorted((num[u], num[v], k) for u, v, k in g.g.edges(keys=True))
    assert outs == {"h": num[g.outputs["h"]], "loss": num[g.outputs["loss"]], "update step": num[g.updates["step"]]}
    # the edges rebuild the same graph structure
    rebuilt = nx.MultiDiGraph()
    rebuilt.add_nodes_from(nodes)
    for u, v, k in edges:
        rebuilt.add_edge(u, v, key=k)
    assert nx.is_isomorphic(rebuilt, g.g)


# ---- fused groups ----------------------------------------------------------------------------

def fuse(g: Graph, members: list[int], output: int) -> int:
    sub, outer = subgraph_of(g, members, output, name="fused0")
    node = g.add("fused", outer, graph=sub, kernel="pointwise")
    g.replace_uses(output, node)
    for m in sorted(members, reverse=True):
        g.remove(m)
    return node


def test_fused_node_evaluates_like_its_members():
    g = mlp_like()
    i, p, s = feeds(1)
    before = run(g, i, p, s)
    mm = next(n for n in g.nodes() if g.op(n) == "matmul")
    add = g.users(mm)[0][0]
    relu = g.outputs["h"]
    node = fuse(g, [add, relu], relu)
    g.verify()
    assert g.count("fused") == 1 and g.count("relu") == 0
    assert g.operands(node) == [mm, g.parameters["b"]]
    text = str(g)
    assert "fused(%4, %2) kernel=pointwise : f32[4,5]" in text
    assert "    graph fused0 {" in text and "      %2 = add(%0, %1) : f32[4,5]" in text
    after = run(g, i, p, s)
    for k in before.outputs:
        np.testing.assert_array_equal(after.outputs[k], before.outputs[k])
    after64 = run(g, i, p, s, precision="float64")
    assert after64.outputs["h"].dtype == np.float64
    np.testing.assert_allclose(after64.outputs["h"], before.outputs["h"], rtol=1e-6, atol=1e-6)
    assert parse_dot(g.to_dot())[0]  # DOT still parses with a fused node


def test_fused_with_constants_and_integer_inside():
    g = Graph()
    x = g.add_input("x", f32(6))
    lab = g.add_input("lab", TensorType((6,), int64))
    oh = g.add("one_hot", [lab], num_classes=3)
    c = g.add_constant(np.float32(0.5))
    sm = g.add("sum", [oh], axes=(1,))
    y = g.add("mul", [sm, c])
    z = g.add("add", [y, x])
    g.set_output("z", z)
    xv, lv = np.arange(6, dtype=np.float32), np.array([0, 1, 2, 5, -1, 1])
    want = evaluate(g, xv, lv)
    fuse(g, [oh, c, sm, y, z], z)
    g.verify()
    np.testing.assert_array_equal(evaluate(g, xv, lv), want)
    np.testing.assert_array_equal(evaluate(g, xv, lv, precision="float64"), want)


def test_fused_type_rule_checks_operands():
    g = mlp_like()
    mm = next(n for n in g.nodes() if g.op(n) == "matmul")
    add = g.users(mm)[0][0]
    sub, outer = subgraph_of(g, [add], add)
    with pytest.raises(ShapeError, match="fused group expects operands"):
        g.add("fused", [outer[1], outer[0]], graph=sub)


# ---- provenance and stable ids ---------------------------------------------------------------

def provenance_graph() -> Graph:
    g = Graph("p")
    x = g.add_input("x", f32(4, 3), "/home/u/train.py:7")
    w = g.add_parameter("0.weight", f32(3, 5), "/home/u/train.py:3", scope="0.weight")
    mm = g.add("matmul", [x, w], loc="/home/u/train.py:3", scope="0")
    r = g.add("relu", [mm], loc="/home/u/train.py:4", scope="1")
    d = g.add("neg", [r], loc="/home/u/train.py:4", scope="1", backward=True)
    g.set_output("y", g.add("add", [r, d]))
    return g


def test_add_stores_scope_and_backward_beside_loc():
    g = provenance_graph()
    mm, r, d = 2, 3, 4
    assert g.scope(mm) == "0" and g.loc(mm) == "/home/u/train.py:3" and not g.is_backward(mm)
    assert g.is_backward(d) and g.provenance(d) == {"loc": "/home/u/train.py:4", "scope": "1", "backward": True}
    assert g.scope(g.outputs["y"]) == "" and g.loc(g.outputs["y"]) is None and g.where(g.outputs["y"]) == ""
    assert g.where(d) == "1 (grad) train.py:4" and g.where(0) == "train.py:7"
    assert g.verify() is g  # the verifier does not look at provenance


def test_printer_shows_provenance_with_notes_and_base_names_only():
    g = provenance_graph()
    assert "#" not in str(g)  # hidden by default
    text = format_graph(g, show_notes=True)
    assert "  %0 = input 'x' : f32[4,3]  # train.py:7" in text
    assert "  %1 = parameter '0.weight' : f32[3,5]  # 0.weight train.py:3" in text
    assert "  %2 = matmul(%0, %1) : f32[4,5]  # 0 train.py:3" in text
    assert "  %4 = neg(%3) : f32[4,5]  # 1 (grad) train.py:4" in text
    assert "  %5 = add(%3, %4) : f32[4,5]\n" in text  # nothing known: no comment
    assert "/home/u" not in text
    assert format_graph(g, show_notes=False, show_provenance=True) == text
    assert "#" not in format_graph(g, show_notes=True, show_provenance=False)


def test_printer_notes_on_a_node_without_attributes_take_one_space():
    g = provenance_graph()
    g.annotate(3, "group", 1)
    text = format_graph(g, show_notes=True, show_provenance=False)
    assert "  %3 = relu(%2) [group=1] : f32[4,5]" in text
    assert "  " not in text.replace("\n  ", "\n")  # no double space anywhere inside a line


def test_copy_and_subgraph_of_carry_provenance():
    g = provenance_graph()
    c = g.copy()
    assert all(c.provenance(n) == g.provenance(n) for n in g.g)
    mapping: dict[int, int] = {}
    sub, outer = subgraph_of(g, [3, 4], 4, mapping=mapping)
    assert outer == [2]
    assert sub.provenance(mapping[3]) == g.provenance(3) and sub.provenance(mapping[4]) == g.provenance(4)
    kept, outer = subgraph_of(g, [3, 4], 4, keep_ids=True)
    assert 3 in kept and 4 in kept and kept.op(3) == "relu" and kept.where(4) == "1 (grad) train.py:4"
    assert kept.inputs["in0"] >= g.next_id  # inputs take fresh ids above the source graph's
    kept.verify()


def test_node_id_keeps_an_id_and_fresh_ids_go_above():
    g = Graph("k")
    a = g.add_input("a", f32(2), node_id=10)
    assert a == 10 and g.next_id == 11
    b = g.add("neg", [a], node_id=3)
    assert b == 3 and g.next_id == 11
    assert g.add("relu", [b]) == 11
    with pytest.raises(VerifyError, match="taken"):
        g.add("neg", [a], node_id=3)


def test_clone_node_and_empty_like_rebuild_a_graph_under_the_same_ids():
    g = provenance_graph()
    g.annotate(3, "group", 7)
    out = Graph.empty_like(g)
    assert out.name == g.name and out.next_id == g.next_id and len(out) == 0
    for n in g.topo_order():
        out.clone_node(g, n, g.operands(n))
    for k, n in g.outputs.items():
        out.set_output(k, n)
    out.verify()
    assert sorted(out.g) == sorted(g.g) and out.parameters == g.parameters and out.inputs == g.inputs
    assert format_graph(out, show_notes=True) == format_graph(g, show_notes=True)
    assert out.notes(3) == {"group": 7}
    fresh = out.add("relu", [2])  # a node the pass adds takes an id no source node had
    assert fresh == g.next_id
    over = out.clone_node(g, 3, [2], node_id=fresh + 1)
    assert over == fresh + 1 and out.provenance(over) == g.provenance(3)


def test_shape_error_names_module_path_and_line():
    g = Graph("e")
    x = g.add_input("x", f32(4, 3))
    w = g.add_parameter("w", f32(5, 2))
    with pytest.raises(ShapeError, match=r"matmul.*f32\[4,3\].*f32\[5,2\]\)\n  in module 'features\.0'\n  at m\.py:9$"):
        g.add("matmul", [x, w], loc="m.py:9", scope="features.0")
