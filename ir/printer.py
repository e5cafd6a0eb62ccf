"""Stable text and DOT forms of a `Graph`: one line per node, in the deterministic topological order.

Node ids are renumbered in print order (%0, %1, ...) so that the text of two graphs built the same
way is identical whatever ids earlier editing left behind; that makes golden tests possible.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .graph import Graph


def _fmt_value(v: Any) -> str:
    if isinstance(v, Graph):
        return f"<{len(v)} nodes>"
    if isinstance(v, np.ndarray):
        if v.size <= 4:
            return np.array2string(v.astype(v.dtype), separator=",", floatmode="unique").replace("\n", "")
        return f"<{v.dtype.name}{list(v.shape)}>"
    if hasattr(v, "name") and hasattr(v, "short"):
        return v.name
    if isinstance(v, str):
        return repr(v)
    return str(v).replace(" ", "")


def format_graph(graph: Graph, *, show_notes: bool = False, indent: str = "  ") -> str:
    order = graph.topo_order()
    num = {n: i for i, n in enumerate(order)}
    lines = [f"graph {graph.name} {{"]
    for n in order:
        op, attrs = graph.op(n), dict(graph.attrs(n))
        ops = ", ".join(f"%{num[o]}" for o in graph.operands(n))
        if op in ("input", "parameter", "state"):
            head = f"{op} {attrs.pop('name')!r}"
            attrs.pop("type")
        elif op == "constant":
            head = f"constant {_fmt_value(attrs.pop('value'))}"
        else:
            head = f"{op}({ops})"
        sub = attrs.pop("graph", None) if op == "fused" else None
        extra = " ".join(f"{k}={_fmt_value(v)}" for k, v in sorted(attrs.items()))
        notes = graph.notes(n)
        if show_notes and notes:
            extra += " [" + " ".join(f"{k}={_fmt_value(v)}" for k, v in sorted(notes.items())) + "]"
        lines.append(f"{indent}%{num[n]} = {head}{' ' + extra if extra else ''} : {graph.type(n)}")
        if sub is not None:
            lines.extend(indent * 2 + line for line in format_graph(sub, indent=indent).splitlines())
    for name, n in graph.outputs.items():
        lines.append(f"{indent}output {name!r} = %{num[n]}")
    for name, n in graph.updates.items():
        lines.append(f"{indent}update {name!r} = %{num[n]}")
    lines.append("}")
    return "\n".join(lines)


def to_dot(graph: Graph) -> str:
    order = graph.topo_order()
    num = {n: i for i, n in enumerate(order)}
    lines = [f'digraph "{graph.name}" {{', "  node [shape=box, fontname=monospace];"]
    for n in order:
        op = graph.op(n)
        label = f"%{num[n]} {op}"
        if op in ("input", "parameter", "state"):
            label += f" {graph.attrs(n)['name']}"
        label += f"\\n{graph.type(n)}"
        style = ', style=filled, fillcolor="#e8f0ff"' if op in ("input", "parameter", "state", "constant") else ""
        lines.append(f'  n{num[n]} [label="{label}"{style}];')
    for u, v, k in sorted(graph.g.edges(keys=True), key=lambda e: (num[e[1]], e[2])):
        lines.append(f'  n{num[u]} -> n{num[v]} [label="{k}"];')
    for name, n in list(graph.outputs.items()) + [(f"update {k}", v) for k, v in graph.updates.items()]:
        lines.append(f'  "out:{name}" [shape=ellipse]; n{num[n]} -> "out:{name}";')
    lines.append("}")
    return "\n".join(lines) + "\n"
