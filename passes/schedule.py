"""Scheduling: the order kernels run in, and which updates are written in place.

Runs on a fused graph, before memory planning. Decisions are recorded on the graph:
`meta["schedule"]` (every node, in run order) and, for an update of a parameter or state whose
kernel reads the old value only element by element at the same index, `notes["storage"]` =
"parameter"/"state" with `notes["name"]`: the kernel writes straight into that parameter's memory.
Such an update must run after every other reader of the old value, so each accepted in-place
update adds ordering edges (reader -> update) and is accepted only if the order stays acyclic.
The order is otherwise the deterministic topological order (smallest id first among ready nodes).
One stream for now; a later multi-stream schedule records its streams here too.
"""
from __future__ import annotations

import networkx as nx

from ember.ir import OPS, Graph


def reads_elementwise(graph: Graph, fused: int, source: int) -> bool:
    """True when `fused` reads `source` only at the index it writes (so writing in place is safe)."""
    if graph.op(fused) != "fused":
        return False
    spec = graph.attrs(fused)["kernel"]
    # A contraction reads its operands everywhere; with a pointwise epilogue, the epilogue's own
    # operands are read per output element like a pointwise kernel's (the users check below).
    if spec.kind != "pointwise" and "pointwise" not in spec.epilogues:
        return False
    sub = graph.attrs(fused)["graph"]
    out_type = sub.type(sub.outputs["out"])
    for i, o in enumerate(graph.operands(fused)):
        if o != source:
            continue
        inner = sub.inputs[f"in{i}"]
        if sub.type(inner).shape != out_type.shape:
            return False
        for user, _ in sub.users(inner):
            if OPS[sub.op(user)].kind != "elementwise" or sub.type(user).shape != out_type.shape:
                return False
    return True


def after_collectives(graph: Graph) -> set[int]:
    """Nodes that read the result of a collective kernel (the updates of a data-parallel step)."""
    late: set[int] = set()
    for n in graph.g:
        if graph.op(n) == "fused" and graph.attrs(n)["kernel"].kind == "collective":
            late |= nx.descendants(graph.g, n)
    return late


def order(graph: Graph, extra: list[tuple[int, int]], late: set[int] = frozenset()) -> list[int] | None:
    """The deterministic topological order of `graph` plus `extra` edges, or None if they make a cycle.
    Nodes in `late` run only when nothing else is ready: so the collectives of a data-parallel step
    meet at one point (one communicator call over a flat buffer on the CPU) instead of alternating
    with the updates that read them. Without collectives the order is the plain smallest-id-first."""
    g = graph.g.copy()
    for u, v in extra:
        g.add_edge(u, v, key=-1)
    if not nx.is_directed_acyclic_graph(g):
        return None
    return list(nx.lexicographical_topological_sort(g, key=lambda n: (n in late, n)))


def schedule(graph: Graph) -> Graph:
    """Returns a copy with `meta["schedule"]` and the in-place update decisions."""
    out = graph.copy()
    accepted: set[int] = set()
    extra: list[tuple[int, int]] = []
    late = after_collectives(out)
    for name, node in out.updates.items():
        kind = "parameter" if name in out.parameters else "state"
        source = out.parameters.get(name, out.states.get(name))
        if node in accepted or out.op(node) != "fused" or not reads_elementwise(out, node, source):
            continue
        if node in out.outputs.values() or any(n == node for k, n in out.updates.items() if k != name):
            continue
        edges = [(u, node) for u, _ in out.users(source) if u != node]
        if order(out, extra + edges, late) is not None:
            extra += edges
            accepted.add(node)
            out.notes(node).update(storage=kind, name=name)
    steps = order(out, extra, late)
    assert steps is not None
    out.meta.update(schedule=steps, schedule_edges=extra)
    return out
