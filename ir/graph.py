"""`Graph`: the one IR that flows through every stage, over a `networkx.MultiDiGraph`.

Nodes are integers; each carries `op`, `attrs`, `type` and `loc` (the user's source line that
built it). An edge u -> v with key i says that u is operand i of v, so a value used twice by one
node gives two parallel edges. Named entry points: `inputs` (fed per call), `parameters` and
`states` (persistent, owned by the runtime), `outputs`, and `updates` (the new value of a
parameter or state, written back at the end of a step).
"""
from __future__ import annotations

import copy as _copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import networkx as nx
import numpy as np

from .dtypes import TensorType
from .ops import OPS, ShapeError, infer_type


class VerifyError(AssertionError):
    """The graph breaks an IR invariant (a pass bug, not a user error)."""


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
    def add(self, op: str, operands: Sequence[int] = (), *, loc: str | None = None, **attrs: Any) -> int:
        """Adds a node after checking its operands and attributes against the op's type rule."""
        for o in operands:
            if o not in self.g:
                raise VerifyError(f"{op}: operand %{o} is not a node of graph {self.name!r}")
        try:
            ttype, attrs = infer_type(op, [self.type(o) for o in operands], attrs)
        except ShapeError as e:
            raise ShapeError(f"{e}\n  at {loc}" if loc else str(e)) from None
        node = self._next
        self._next += 1
        self.g.add_node(node, op=op, attrs=attrs, type=ttype, loc=loc, notes={})
        for i, o in enumerate(operands):
            self.g.add_edge(o, node, key=i)
        return node

    def _add_named(self, table: dict[str, int], op: str, name: str, ttype: TensorType, loc: str | None) -> int:
        if name in self.inputs or name in self.parameters or name in self.states:
            raise ValueError(f"graph {self.name!r} already has an entry named {name!r}")
        table[name] = self.add(op, name=name, type=ttype, loc=loc)
        return table[name]

    def add_input(self, name: str, ttype: TensorType, loc: str | None = None) -> int:
        return self._add_named(self.inputs, "input", name, ttype, loc)

    def add_parameter(self, name: str, ttype: TensorType, loc: str | None = None) -> int:
        return self._add_named(self.parameters, "parameter", name, ttype, loc)

    def add_state(self, name: str, ttype: TensorType, loc: str | None = None) -> int:
        return self._add_named(self.states, "state", name, ttype, loc)

    def add_constant(self, value: Any, dtype: Any = None, loc: str | None = None) -> int:
        arr = np.asarray(value) if dtype is None else np.asarray(value, dtype=TensorType((), dtype).dtype.numpy)
        return self.add("constant", value=arr, loc=loc)

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
    def op(self, n: int) -> str:
        return self.g.nodes[n]["op"]

    def attrs(self, n: int) -> dict[str, Any]:
        return self.g.nodes[n]["attrs"]

    def type(self, n: int) -> TensorType:
        return self.g.nodes[n]["type"]

    def loc(self, n: int) -> str | None:
        return self.g.nodes[n]["loc"]

    def operands(self, n: int) -> list[int]:
        edges = sorted(((k, u) for u, _, k in self.g.in_edges(n, keys=True)))
        return [u for _, u in edges]

    def users(self, n: int) -> list[tuple[int, int]]:
        """(user, operand index) pairs, sorted."""
        return sorted((v, k) for _, v, k in self.g.out_edges(n, keys=True))

    def nodes(self) -> list[int]:
        return self.topo_order()

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
        """A deterministic topological order: among ready nodes, the smallest id first."""
        return list(nx.lexicographical_topological_sort(self.g, key=lambda n: n))

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
        for table in (self.outputs, self.updates):
            for name, n in table.items():
                if n == old:
                    table[name] = new

    def set_operand(self, node: int, index: int, new: int) -> None:
        for u, _, k in list(self.g.in_edges(node, keys=True)):
            if k == index:
                self.g.remove_edge(u, node, key=k)
        self.g.add_edge(new, node, key=index)

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
        new.g = self.g.copy()
        for n in new.g:
            new.g.nodes[n]["attrs"] = dict(new.g.nodes[n]["attrs"])
            new.g.nodes[n]["notes"] = dict(new.g.nodes[n]["notes"])
        for table in ("inputs", "parameters", "states", "outputs", "updates", "meta"):
            setattr(new, table, dict(getattr(self, table)))
        return new

    def annotate(self, n: int, key: str, value: Any) -> None:
        """Records a pass decision on a node (kept apart from the op's checked attributes)."""
        self.g.nodes[n]["notes"][key] = value

    def notes(self, n: int) -> dict[str, Any]:
        return self.g.nodes[n]["notes"]

    # ---- checking ----------------------------------------------------------------------------
    def verify(self) -> "Graph":
        if not nx.is_directed_acyclic_graph(self.g):
            raise VerifyError(f"graph {self.name!r} has a cycle: {nx.find_cycle(self.g)}")
        for n in self.g:
            op = self.op(n)
            if op not in OPS:
                raise VerifyError(f"%{n}: unknown op {op!r}")
            keys = sorted(k for _, _, k in self.g.in_edges(n, keys=True))
            if keys != list(range(len(keys))):
                raise VerifyError(f"%{n} = {op}: operand indices {keys} are not 0..{len(keys) - 1}")
            try:
                ttype, _ = infer_type(op, [self.type(o) for o in self.operands(n)], self.attrs(n))
            except ShapeError as e:
                raise VerifyError(f"%{n} = {op}: {e}") from None
            if ttype != self.type(n):
                raise VerifyError(f"%{n} = {op}: stored type {self.type(n)} but the rule gives {ttype}")
            if op == "fused":
                sub = self.attrs(n)["graph"]
                sub.verify()
                problem = self.attrs(n)["kernel"].check(len(self.operands(n)), sub.g, sub.outputs)
                if problem is not None:
                    raise VerifyError(f"%{n} = fused: kernel plan {self.attrs(n)['kernel'].describe()}: {problem}")
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

    def __str__(self) -> str:
        from .printer import format_graph
        return format_graph(self)

    def to_dot(self) -> str:
        from .printer import to_dot
        return to_dot(self)


def subgraph_of(graph: Graph, nodes: Iterable[int], output: int, name: str = "group", *,
                copy_in: Callable[[int], bool] | None = None,
                mapping: dict[int, int] | None = None) -> tuple[Graph, list[int]]:
    """Copies `nodes` of `graph` into a standalone graph computing `output`.

    Values used by the group but defined outside it become the subgraph's inputs (named in0,
    in1, ... in order of first use), except operand-free nodes for which `copy_in` says yes
    (e.g. scalar constants), which are copied in. Returns the subgraph and the outer nodes
    feeding its inputs, in order; `mapping`, if given, receives outer node -> subgraph node.
    """
    members = set(nodes)
    sub = Graph(name)
    mapping = {} if mapping is None else mapping
    outer: list[int] = []
    for n in graph.topo_order():
        if n not in members:
            continue
        new_ops = []
        for o in graph.operands(n):
            if o not in mapping:
                if o in members:
                    raise VerifyError(f"group member %{o} used before it is defined")
                if copy_in is not None and not graph.operands(o) and copy_in(o):
                    mapping[o] = sub.add(graph.op(o), loc=graph.loc(o), **graph.attrs(o))
                else:
                    mapping[o] = sub.add_input(f"in{len(outer)}", graph.type(o))
                    outer.append(o)
            new_ops.append(mapping[o])
        mapping[n] = sub.add(graph.op(n), new_ops, loc=graph.loc(n), **graph.attrs(n))
    sub.set_output("out", mapping[output])
    return sub, outer
