"""`Graph`: the one IR that flows through every stage, over a `networkx.MultiDiGraph`.

Nodes are integers; each carries `op`, `attrs`, `type` and its provenance: `loc` (the user's
file:line that built it), `scope` (the module path that made it, `features.0`; "" for the root
model, `optimizer/<param>` for optimizer updates) and `backward` (True for a gradient node, which
takes the scope and loc of the forward node it differentiates). Node ids are stable names: a pass
that edits a copy keeps them, a pass that builds a new graph copies nodes with `clone_node` (or
`add(..., node_id=...)`) on a graph from `empty_like`, so `%51` means the same node in every dump,
kernel header and error message; a new node takes a fresh id above every id its source graph used.
An edge u -> v with key i says that u is operand i of v, so a value used twice by one node gives
two parallel edges. Named entry points: `inputs` (fed per call), `parameters` and
`states` (persistent, owned by the runtime), `outputs`, and `updates` (the new value of a
parameter or state, written back at the end of a step).
"""
from __future__ import annotations

import copy as _copy
import heapq
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import networkx as nx
import numpy as np

from .dtypes import TensorType, as_array
from .ops import OPS, ShapeError, infer_type


class VerifyError(AssertionError):
    """The graph breaks an IR invariant (a pass bug, not a user error)."""


def short_loc(loc: str | None) -> str:
    """`file:line` with the file reduced to its base name (stable across checkouts)."""
    return loc.replace("\\", "/").rsplit("/", 1)[-1] if loc else ""


def format_provenance(scope: str, loc: str | None, backward: bool = False) -> str:
    """`<scope> [(grad)] <file:line>`, each part left out when unknown (see `Graph.where`)."""
    parts = [scope] if scope else []
    if backward:
        parts.append("(grad)")
    if loc:
        parts.append(short_loc(loc))
    return " ".join(parts)


class Graph:
    def __init__(self, name: str = "graph") -> None:
        self.name = name
        self.g = nx.MultiDiGraph()
        self.inputs: dict[str, int] = {}
        self.parameters: dict[str, int] = {}
        self.states: dict[str, int] = {}
        self.outputs: dict[str, int] = {}
        self.updates: dict[str, int] = {}
        self.meta: dict[str, Any] = {}  # pass decisions that are not per node (e.g. arena size)
        self._next = 0

    # ---- building ----------------------------------------------------------------------------
    def add(self, op: str, operands: Sequence[int] = (), *, loc: str | None = None, scope: str = "",
            backward: bool = False, node_id: int | None = None, **attrs: Any) -> int:
        """Adds a node after checking its operands and attributes against the op's type rule.

        `loc`, `scope` and `backward` are its provenance (see the module docstring). `node_id`
        keeps an id the node had in another graph (a pass copying nodes); it must be free here, and
        later fresh ids go above it. Without it the node takes a fresh id.
        """
        for o in operands:
            if o not in self.g:
                raise VerifyError(f"{op}: operand %{o} is not a node of graph {self.name!r}")
        try:
            ttype, attrs = infer_type(op, [self.type(o) for o in operands], attrs)
        except ShapeError as e:
            where = ((f"\n  in module {scope!r}" + (" (grad)" if backward else "")) if scope else "") + (
                f"\n  at {loc}" if loc else "")
            raise ShapeError(f"{e}{where}") from None
        return self._insert(op, operands, ttype, attrs, node_id, loc, scope, backward)

    def _insert(self, op: str, operands: Sequence[int], ttype: TensorType, attrs: dict[str, Any],
                node_id: int | None, loc: str | None, scope: str, backward: bool) -> int:
        """Adds a node whose type and attributes are already checked (`add`, or a copy of a node
        of a checked graph over operands of the same types: `subgraph_of`)."""
        if node_id is None:
            node = self._next
        else:
            node = int(node_id)
            if node < 0 or node in self.g:
                raise VerifyError(f"{op}: node id %{node} is taken (or negative) in graph {self.name!r}")
        self._next = max(self._next, node + 1)
        self.g.add_node(node, op=op, attrs=attrs, type=ttype, loc=loc, scope=scope, backward=backward, notes={},
                        operands=tuple(operands))
        for i, o in enumerate(operands):
            self.g.add_edge(o, node, key=i)
        return node

    def _add_named(self, table: dict[str, int], op: str, name: str, ttype: TensorType, loc: str | None,
                   **provenance: Any) -> int:
        if name in self.inputs or name in self.parameters or name in self.states:
            raise ValueError(f"graph {self.name!r} already has an entry named {name!r}")
        table[name] = self.add(op, name=name, type=ttype, loc=loc, **provenance)
        return table[name]

    def add_input(self, name: str, ttype: TensorType, loc: str | None = None, *, scope: str = "",
                  node_id: int | None = None) -> int:
        return self._add_named(self.inputs, "input", name, ttype, loc, scope=scope, node_id=node_id)

    def add_parameter(self, name: str, ttype: TensorType, loc: str | None = None, *, scope: str = "",
                      node_id: int | None = None) -> int:
        return self._add_named(self.parameters, "parameter", name, ttype, loc, scope=scope, node_id=node_id)

    def add_state(self, name: str, ttype: TensorType, loc: str | None = None, *, scope: str = "",
                  node_id: int | None = None) -> int:
        return self._add_named(self.states, "state", name, ttype, loc, scope=scope, node_id=node_id)

    def add_constant(self, value: Any, dtype: Any = None, loc: str | None = None, *, scope: str = "",
                     backward: bool = False, node_id: int | None = None) -> int:
        arr = np.asarray(value) if dtype is None else as_array(value, TensorType((), dtype).dtype)
        return self.add("constant", value=arr, loc=loc, scope=scope, backward=backward, node_id=node_id)

    def clone_node(self, source: "Graph", n: int, operands: Sequence[int] = (), *, node_id: int | None = None,
                   **attrs: Any) -> int:
        """Copies node `n` of `source` into this graph over `operands` (nodes of this graph): same
        op, attributes (`attrs` overrides some), provenance and notes, and the same id unless
        `node_id` says otherwise. An input, parameter or state is registered under its name."""
        op = source.op(n)
        attrs = {**source.attrs(n), **attrs}
        nid = n if node_id is None else node_id
        if op in ("input", "parameter", "state"):
            table = {"input": self.inputs, "parameter": self.parameters, "state": self.states}[op]
            node = self._add_named(table, op, attrs["name"], attrs["type"], source.loc(n), scope=source.scope(n),
                                   node_id=nid)
        else:
            node = self.add(op, list(operands), node_id=nid, **source.provenance(n), **attrs)
        self.g.nodes[node]["notes"].update(source.notes(n))
        return node

    @classmethod
    def empty_like(cls, source: "Graph", name: str | None = None) -> "Graph":
        """An empty graph for a pass that rebuilds `source`: same name and meta, and fresh ids that
        start above every id `source` ever used, so kept ids and new ones never collide."""
        new = cls(name or source.name)
        new.meta = dict(source.meta)
        new._next = source._next
        return new

    def set_output(self, name: str, node: int) -> None:
        self.outputs[name] = node

    def set_update(self, name: str, node: int) -> None:
        target = self.parameters.get(name, self.states.get(name))
        if target is None:
            raise ValueError(f"update for {name!r}, which is neither a parameter nor a state")
        if self.type(node) != self.type(target):
            raise ShapeError(f"update of {name!r} has type {self.type(node)}, expected {self.type(target)}")
        self.updates[name] = node

    # ---- reading -----------------------------------------------------------------------------
    # The readers below go to networkx's node and adjacency dicts (`_node`, `_pred`, `_succ`)
    # rather than its views: they are called tens of thousands of times per compile, and a view
    # object per call was the largest single cost of the passes.
    def op(self, n: int) -> str:
        return self.g._node[n]["op"]

    def attrs(self, n: int) -> dict[str, Any]:
        return self.g._node[n]["attrs"]

    def type(self, n: int) -> TensorType:
        return self.g._node[n]["type"]

    def loc(self, n: int) -> str | None:
        return self.g._node[n]["loc"]

    def scope(self, n: int) -> str:
        """The module path that made node n ("" for the root model or a plain function)."""
        return self.g._node[n].get("scope", "")

    def is_backward(self, n: int) -> bool:
        """Whether node n belongs to the gradient of the node whose scope and loc it carries."""
        return self.g._node[n].get("backward", False)

    def provenance(self, n: int) -> dict[str, Any]:
        """{loc, scope, backward} of node n, to pass on as `add(..., **g.provenance(n))`."""
        d = self.g._node[n]
        return {"loc": d["loc"], "scope": d.get("scope", ""), "backward": d.get("backward", False)}

    def where(self, n: int) -> str:
        """Node n's provenance in one line, as printers, kernel headers and errors show it:
        `features.0 (grad) model.py:12` (module path, a grad marker, the file's base name and
        line), empty when nothing is known."""
        return format_provenance(self.scope(n), self.loc(n), self.is_backward(n))

    @property
    def next_id(self) -> int:
        """The id the next fresh node will take (above every id this graph has used)."""
        return self._next

    def operands(self, n: int) -> list[int]:
        # kept on the node by every edit (add, replace_uses, set_operand), so passes that ask for
        # a node's operands tens of thousands of times do not sort its in-edges each time
        return list(self.g._node[n]["operands"])

    def users(self, n: int) -> list[tuple[int, int]]:
        """(user, operand index) pairs, sorted."""
        return sorted([(v, k) for v, keys in self.g._succ[n].items() for k in keys])

    def nodes(self) -> list[int]:
        return self.topo_order()

    def results(self, n: int) -> list[int]:
        """The nodes holding the values node n computes: n itself, then, for a fused node with
        several outputs, its `fused_output` readers in the order of the kernel's outputs."""
        if self.op(n) != "fused" or len(self.attrs(n)["kernel"].outputs) == 1:
            return [n]
        order = {name: i for i, name in enumerate(self.attrs(n)["kernel"].outputs)}
        extra = [u for u, _ in self.users(n) if self.op(u) == "fused_output"]
        return [n] + sorted(extra, key=lambda u: order[self.attrs(u)["output"]])

    def __len__(self) -> int:
        return self.g.number_of_nodes()

    def __contains__(self, n: int) -> bool:
        return n in self.g

    def roots(self) -> list[int]:
        """Nodes whose values leave the graph (outputs and updates), in a stable order."""
        seen: dict[int, None] = {}
        for n in list(self.outputs.values()) + list(self.updates.values()):
            seen[n] = None
        return list(seen)

    def topo_order(self) -> list[int]:
        """A deterministic topological order: among ready nodes, the smallest id first (the
        order of `nx.lexicographical_topological_sort(g, key=lambda n: n)`, which cost several
        times this on the graphs' int ids). Raises `nx.NetworkXUnfeasible` on a cycle."""
        pred, succ = self.g._pred, self.g._succ
        waiting: dict[int, int] = {}
        ready: list[int] = []
        for v, ins in pred.items():
            if ins:
                waiting[v] = sum(map(len, ins.values()))  # parallel edges count, as in networkx
            else:
                ready.append(v)
        heapq.heapify(ready)
        order: list[int] = []
        while ready:
            n = heapq.heappop(ready)
            order.append(n)
            for child, keys in succ[n].items():
                left = waiting[child] - len(keys)
                waiting[child] = left
                if not left:
                    heapq.heappush(ready, child)
        if len(order) != len(pred):
            raise nx.NetworkXUnfeasible("Graph contains a cycle or graph changed during iteration")
        return order

    def count(self, op: str | None = None) -> int:
        return sum(1 for n in self.g if op is None or self.op(n) == op)

    # ---- editing (used by passes on their own copy) ------------------------------------------
    def replace_uses(self, old: int, new: int) -> None:
        """Points every use of `old` (operands, outputs, updates) at `new`."""
        if old == new:
            return
        for _, v, k in list(self.g.out_edges(old, keys=True)):
            self.g.remove_edge(old, v, key=k)
            self.g.add_edge(new, v, key=k)
            self._set_operand_entry(v, k, new)
        for table in (self.outputs, self.updates):
            for name, n in table.items():
                if n == old:
                    table[name] = new

    def set_operand(self, node: int, index: int, new: int) -> None:
        for u, _, k in list(self.g.in_edges(node, keys=True)):
            if k == index:
                self.g.remove_edge(u, node, key=k)
        self.g.add_edge(new, node, key=index)
        self._set_operand_entry(node, index, new)

    def _set_operand_entry(self, node: int, index: int, new: int) -> None:
        d = self.g._node[node]
        ops = d["operands"]
        d["operands"] = ops[:index] + (new,) + ops[index + 1:]

    def remove(self, n: int) -> None:
        for table in (self.inputs, self.parameters, self.states):
            for name, m in list(table.items()):
                if m == n:
                    del table[name]
        self.g.remove_node(n)

    def copy(self, name: str | None = None) -> "Graph":
        """A copy whose structure can be edited freely; attributes are shared read-only values."""
        new = _copy.copy(self)
        new.name = name or self.name
        new.g = _copy_multidigraph(self.g)
        for d in new.g._node.values():
            d["attrs"] = dict(d["attrs"])
            d["notes"] = dict(d["notes"])
        for table in ("inputs", "parameters", "states", "outputs", "updates", "meta"):
            setattr(new, table, dict(getattr(self, table)))
        return new

    def annotate(self, n: int, key: str, value: Any) -> None:
        """Records a pass decision on a node (kept apart from the op's checked attributes)."""
        self.g.nodes[n]["notes"][key] = value

    def notes(self, n: int) -> dict[str, Any]:
        return self.g.nodes[n]["notes"]

    # ---- checking ----------------------------------------------------------------------------
    def verify(self, full: bool | None = None) -> "Graph":
        """Checks the graph: with `full`, every node's type rule and every fused subgraph,
        recursively, besides the structure (acyclic, operand indices, named tables, kernel plans);
        with `full=False`, the structure alone.

        `full=None` (what the passes call after their work) defers to the environment's
        `EMBER_VERIFY` (read per call; the test suite sets it): set, the full check; unset,
        nothing, and `run_passes` checks the structure once, after the last pass. The full check
        after every pass cost more than the passes themselves on deep models, and each pass's
        own tests are where its type errors are caught.
        """
        if full is None:
            if os.environ.get("EMBER_VERIFY", "") in ("", "0"):
                return self
            full = True
        if not nx.is_directed_acyclic_graph(self.g):
            raise VerifyError(f"graph {self.name!r} has a cycle: {nx.find_cycle(self.g)}")
        for n in self.g:
            op = self.op(n)
            if op not in OPS:
                raise VerifyError(f"%{n}: unknown op {op!r}")
            edges = sorted((k, u) for u, _, k in self.g.in_edges(n, keys=True))
            keys = [k for k, _ in edges]
            if keys != list(range(len(keys))):
                raise VerifyError(f"%{n} = {op}: operand indices {keys} are not 0..{len(keys) - 1}")
            operands = [u for _, u in edges]
            if op == "fused_output" and self.op(operands[0]) != "fused":
                raise VerifyError(f"%{n} = fused_output reads %{operands[0]}, which is not a fused node")
            if full:
                try:
                    ttype, _ = infer_type(op, [self.type(o) for o in operands], self.attrs(n))
                except ShapeError as e:
                    raise VerifyError(f"%{n} = {op}: {e}") from None
            if tuple(operands) != self.g._node[n]["operands"]:
                raise VerifyError(f"%{n} = {op}: operand list {list(self.g._node[n]['operands'])} is not its "
                                  f"in-edges {operands} (an edge edited outside Graph's methods)")
            if not full:
                if op == "fused":
                    self._check_kernel_plan(n)
                continue
            if ttype != self.type(n):
                raise VerifyError(f"%{n} = {op}: stored type {self.type(n)} but the rule gives {ttype}")
            if op == "fused":
                self.attrs(n)["graph"].verify(full=True)
                self._check_kernel_plan(n)
        for table, op in ((self.inputs, "input"), (self.parameters, "parameter"), (self.states, "state")):
            for name, n in table.items():
                if n not in self.g or self.op(n) != op or self.attrs(n)["name"] != name:
                    raise VerifyError(f"{op} {name!r} does not name a matching {op} node (%{n})")
        for n in self.g:
            if self.op(n) in ("input", "parameter", "state"):
                table = {"input": self.inputs, "parameter": self.parameters, "state": self.states}[self.op(n)]
                if table.get(self.attrs(n)["name"]) != n:
                    raise VerifyError(f"%{n} = {self.op(n)} {self.attrs(n)['name']!r} is not registered")
        for name, n in list(self.outputs.items()) + list(self.updates.items()):
            if n not in self.g:
                raise VerifyError(f"output/update {name!r} refers to a removed node %{n}")
        for name, n in self.updates.items():
            target = self.parameters.get(name, self.states.get(name))
            if target is None or self.type(target) != self.type(n):
                raise VerifyError(f"update {name!r} does not match a parameter or state of its type")
        return self

    def _check_kernel_plan(self, n: int) -> None:
        sub = self.attrs(n)["graph"]
        spec = self.attrs(n)["kernel"]
        problem = spec.check(len(self.operands(n)), sub.g, sub.outputs)
        if problem is not None:
            raise VerifyError(f"%{n} = fused: kernel plan {spec.describe()}: {problem}")
        # every output but "out" is read through exactly one fused_output node of its type
        projected: dict[str, int] = {}
        for u, _ in self.users(n):
            if self.op(u) != "fused_output":
                continue
            name = self.attrs(u)["output"]
            if name not in sub.outputs or name == "out":
                raise VerifyError(f"%{u} = fused_output: %{n} has no extra output {name!r} "
                                  f"(its outputs: {', '.join(sub.outputs)})")
            if name in projected:
                raise VerifyError(f"%{u} = fused_output: output {name!r} of %{n} is already read by %{projected[name]}")
            if self.type(u) != sub.type(sub.outputs[name]):
                raise VerifyError(f"%{u} = fused_output: type {self.type(u)}, but output {name!r} of %{n} "
                                  f"is {sub.type(sub.outputs[name])}")
            projected[name] = u
        if missing := [k for k in sub.outputs if k != "out" and k not in projected]:
            raise VerifyError(f"%{n} = fused: outputs {missing} have no fused_output node (each extra output "
                              f"is a buffer the kernel writes)")

    def __str__(self) -> str:
        from .printer import format_graph
        return format_graph(self)

    def to_dot(self) -> str:
        from .printer import to_dot
        return to_dot(self)


def _copy_multidigraph(g: nx.MultiDiGraph) -> nx.MultiDiGraph:
    """`g.copy()` built on networkx's dicts directly, with the same contents and the same
    iteration orders (nodes, successors, predecessors in the order `add_edges_from` gives them,
    keys), a shallow copy of every node and edge attribute dict; `MultiDiGraph.copy` spent most
    of its time in per-edge `add_edge` calls, and passes copy their input graph."""
    new = g.__class__()
    new.graph.update(g.graph)
    node = {n: d.copy() for n, d in g._node.items()}
    succ: dict[Any, dict] = {n: {} for n in node}
    pred: dict[Any, dict] = {n: {} for n in node}
    for u, nbrs in g._succ.items():
        su = succ[u]
        for v, keys in nbrs.items():
            kd = {k: d.copy() for k, d in keys.items()}
            su[v] = kd
            pred[v][u] = kd  # one key dict for both directions, as networkx keeps it
    new._node = node
    new._adj = succ  # also sets _succ (networkx's descriptor); set below where a version does not
    new._pred = pred
    if new._succ is not succ:
        new._succ = succ
    return new


def _copy_node(sub: Graph, graph: Graph, n: int, operands: Sequence[int], keep_ids: bool) -> int:
    """Node n of `graph` added to `sub` over `operands` of the same types: its type and attributes
    are taken as they are, not inferred again (a checked graph's; a full `verify` re-infers them)."""
    return sub._insert(graph.op(n), operands, graph.type(n), dict(graph.attrs(n)), n if keep_ids else None,
                       **graph.provenance(n))


def subgraph_of(graph: Graph, nodes: Iterable[int], output: int | Sequence[int], name: str = "group", *,
                copy_in: Callable[[int], bool] | None = None,
                mapping: dict[int, int] | None = None, keep_ids: bool = False,
                position: Mapping[int, int] | None = None) -> tuple[Graph, list[int]]:
    """Copies `nodes` of `graph` into a standalone graph computing `output` (one node, its output
    "out"; or several, "out", "out1", "out2", ... in the order given).

    Values used by the group but defined outside it become the subgraph's inputs (named in0,
    in1, ... in order of first use), except operand-free nodes for which `copy_in` says yes
    (e.g. scalar constants), which are copied in. Returns the subgraph and the outer nodes
    feeding its inputs, in order; `mapping`, if given, receives outer node -> subgraph node.
    Nodes keep their provenance (loc, scope, backward); with `keep_ids`, copied nodes also keep
    their ids and the inputs take fresh ids above every id of `graph`.

    `position` (node -> its index in `graph.topo_order()`) lets a caller that cuts many groups
    out of one graph sort the whole graph once, not once per group (which made fusion quadratic
    in the number of kernels).
    """
    members = set(nodes)
    sub = Graph(name)
    if keep_ids:
        sub._next = graph._next
    mapping = {} if mapping is None else mapping
    outer: list[int] = []
    ordered = sorted(members, key=position.__getitem__) if position is not None else \
        [n for n in graph.topo_order() if n in members]
    for n in ordered:
        new_ops = []
        for o in graph.operands(n):
            if o not in mapping:
                if o in members:
                    raise VerifyError(f"group member %{o} used before it is defined")
                if copy_in is not None and not graph.operands(o) and copy_in(o):
                    mapping[o] = _copy_node(sub, graph, o, (), keep_ids)
                else:
                    mapping[o] = sub.add_input(f"in{len(outer)}", graph.type(o))
                    outer.append(o)
            new_ops.append(mapping[o])
        mapping[n] = _copy_node(sub, graph, n, new_ops, keep_ids)
    for i, o in enumerate([output] if isinstance(output, int) else output):
        sub.set_output("out" if i == 0 else f"out{i}", mapping[o])
    return sub, outer
