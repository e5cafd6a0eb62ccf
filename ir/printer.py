"""Stable text and DOT forms of a `Graph`: one line per node, in the deterministic topological order.

Nodes print under their real ids (`%51`), which passes keep (see `ember.ir.graph`), so a node has
one name in the printer, every pass dump, kernel headers and error messages. With provenance
shown (the default of `show_notes=True`, which pass dumps use) each node line ends in
`  # <scope> [(grad)] <file:line>` (module path, gradient marker, base name of the user's file):

    %5 = add(%2, %4) : f32[64,16,26,26]  # 0 train_mnist.py:14
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .graph import Graph
from .kernel import KernelSpec


def _fmt_value(v: Any) -> str:
    if isinstance(v, Graph):
        return f"<{len(v)} nodes>"
    if isinstance(v, KernelSpec):  # with why its family was chosen (a dump's reader asks; sources do not)
        # epilogues joined to the kind (`matmul+bias`); scratch and choice stay separate words
        return str(v).replace(" +", "+") + (f" ({v.why})" if v.why else "")
    if isinstance(v, np.ndarray):
        if v.size <= 4:
            return np.array2string(v.astype(v.dtype), separator=",", floatmode="unique").replace("\n", "")
        return f"<{v.dtype.name}{list(v.shape)}>"
    if hasattr(v, "name") and hasattr(v, "short"):
        return v.name
    if isinstance(v, str):
        return repr(v)
    return str(v).replace(" ", "")


def format_graph(graph: Graph, *, show_notes: bool = False, show_provenance: bool | None = None,
                 indent: str = "  ") -> str:
    """One line per node. `show_notes` adds pass decisions (`[key=value ...]`); `show_provenance`
    (default: as `show_notes`) adds `# scope file:line`."""
    if show_provenance is None:
        show_provenance = show_notes
    order = graph.topo_order()
    lines = [f"graph {graph.name} {{"]
    for n in order:
        op, attrs = graph.op(n), dict(graph.attrs(n))
        ops = ", ".join(f"%{o}" for o in graph.operands(n))
        if op in ("input", "parameter", "state"):
            head = f"{op} {attrs.pop('name')!r}"
            attrs.pop("type")
        elif op == "constant":
            head = f"constant {_fmt_value(attrs.pop('value'))}"
        else:
            head = f"{op}({ops})"
        sub = attrs.pop("graph", None) if op == "fused" else None
        parts = [head] + [f"{k}={_fmt_value(v)}" for k, v in sorted(attrs.items())]
        notes = graph.notes(n)
        if show_notes and notes:
            parts.append("[" + " ".join(f"{k}={_fmt_value(v)}" for k, v in sorted(notes.items())) + "]")
        where = graph.where(n) if show_provenance else ""
        lines.append(f"{indent}%{n} = {' '.join(parts)} : {graph.type(n)}" + (f"  # {where}" if where else ""))
        if sub is not None:
            lines.extend(indent * 2 + line for line in format_graph(
                sub, show_provenance=show_provenance, indent=indent).splitlines())
    for name, n in graph.outputs.items():
        lines.append(f"{indent}output {name!r} = %{n}")
    for name, n in graph.updates.items():
        lines.append(f"{indent}update {name!r} = %{n}")
    lines.append("}")
    return "\n".join(lines)


def to_dot(graph: Graph) -> str:
    order = graph.topo_order()
    num = {n: n for n in order}  # real ids, as in the text form
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
