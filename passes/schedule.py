"""Scheduling: the order kernels run in, and which updates are written in place.

Runs on a fused graph, before memory planning. Decisions are recorded on the graph:
`meta["schedule"]` (every node, in run order) and, for an update of a parameter or state whose
kernel reads the old value only at the index it writes (element by element; or, in a reduction
kernel, at the output's index: a per-channel parameter), `notes["storage"]` =
"parameter"/"state" with `notes["name"]`: the kernel writes straight into that parameter's memory.
Such an update must run after every other reader of the old value, so each accepted in-place
update adds ordering edges (reader -> update) and is accepted only if the order stays acyclic.
A kernel that reads another's scratch (`notes["reads_scratch_of"]`: a relaid operand) runs after it.
The order is otherwise the deterministic topological order (smallest id first among ready nodes).
One stream for now; a later multi-stream schedule records its streams here too.

Collectives of a data-parallel step (`passes/data_parallel.py`): their readers (the optimizer
updates) run last, when nothing else is ready. The collectives themselves either run as soon as
their whole bucket is ready (`early_collectives=True`, the target record's choice: each bucket's
all-reduce can then overlap the rest of the backward pass, as in PyTorch's DDP; the CPU runtime
starts it non-blocking there and waits before the first update that reads it), or when nothing
else is ready (`early_collectives=False`, the default: every all-reduce meets at one point, one
communicator call per step).
"""
from __future__ import annotations

import heapq

import networkx as nx

from ember.ir import OPS, Graph

from .fusion_multi import reads_at_output_index


def reads_elementwise(graph: Graph, fused: int, source: int, output: str = "out") -> bool:
    """True when `fused` reads `source` only at the index it writes `output` at (so writing that
    output over `source` in place is safe)."""
    if graph.op(fused) != "fused":
        return False
    spec = graph.attrs(fused)["kernel"]
    sub = graph.attrs(fused)["graph"]
    inner = [sub.inputs[f"in{i}"] for i, o in enumerate(graph.operands(fused)) if o == source]
    if spec.kind == "reduction":  # read at the output index only (a per-channel parameter, say)
        return all(reads_at_output_index(sub, spec.core, n) for n in inner)
    # A contraction reads its operands everywhere; with a pointwise epilogue, the epilogue's own
    # operands are read per output element like a pointwise kernel's (the users check below).
    if spec.kind != "pointwise" and "pointwise" not in spec.epilogues:
        return False
    out_type = sub.type(sub.outputs[output])
    if any(sub.type(n).shape != out_type.shape for n in sub.outputs.values()):
        return False  # outputs of several shapes: their flat indices need not meet
    for n in inner:
        if sub.type(n).shape != out_type.shape:
            return False
        for user, _ in sub.users(n):
            if OPS[sub.op(user)].kind != "elementwise" or sub.type(user).shape != out_type.shape:
                return False
    return True


def _readers(graph: Graph, value: int) -> list[int]:
    """The nodes that read `value`'s memory: its users, and through reshape aliases theirs."""
    found, stack = [], [value]
    while stack:
        for u, _ in graph.users(stack.pop()):
            if graph.op(u) == "reshape":
                stack.append(u)
            elif u not in found:
                found.append(u)
    return found


def after_collectives(graph: Graph) -> set[int]:
    """Nodes that read the result of a collective kernel (the updates of a data-parallel step)."""
    late: set[int] = set()
    for n in graph.g:
        if graph.op(n) == "fused" and graph.attrs(n)["kernel"].kind == "collective":
            late |= nx.descendants(graph.g, n)
    return late


def collective_groups(graph: Graph) -> list[list[int]]:
    """The collective kernels that run together: each data-parallel bucket's (`meta["buckets"]`,
    its "reduced" nodes), and every other collective (the loss's mean) alone."""
    coll = {n for n in graph.g if graph.op(n) == "fused" and graph.attrs(n)["kernel"].kind == "collective"}
    groups = []
    for b in graph.meta.get("buckets", []):
        members = sorted(n for n in b.get("reduced", []) if n in coll)
        if members:
            groups.append(members)
    grouped = {n for grp in groups for n in grp}
    return groups + [[n] for n in sorted(coll - grouped)]


def _early_order(g: "nx.MultiDiGraph", late: set[int], groups: list[list[int]]) -> list[int]:
    """Kahn's algorithm, smallest (late, first group fed, id) first, and a group of collectives as
    soon as all of its members are ready (its members in id order). "First group fed": the
    lowest index of a group the node is an ancestor of, so the kernels producing bucket 0 (the
    last layer's gradients) run before those of bucket 1, and each bucket's all-reduce starts as
    early as the backward pass allows (by id alone, the last layer's weight gradient, a late
    node id, would run after the whole convolution backward pass)."""
    group_of = {n: i for i, grp in enumerate(groups) for n in grp}
    feeds: dict[int, int] = {}
    for n in reversed(list(nx.topological_sort(g))):
        feeds[n] = min([group_of.get(n, len(groups))] + [feeds[v] for v in g.successors(n)])
    key = {n: (n in late, feeds[n], n) for n in g}
    indeg = {n: g.in_degree(n) for n in g}
    waiting = [sum(indeg[n] > 0 for n in grp) for grp in groups]  # members not ready yet
    heap = [key[n] for n, d in indeg.items() if d == 0 and n not in group_of]
    heapq.heapify(heap)
    due = [i for i, w in enumerate(waiting) if w == 0]
    out: list[int] = []

    def emit(n: int) -> None:
        out.append(n)
        for v in g.successors(n):
            indeg[v] -= g.number_of_edges(n, v)
            if indeg[v] == 0:
                if v in group_of:
                    waiting[group_of[v]] -= 1
                    if waiting[group_of[v]] == 0:
                        due.append(group_of[v])
                else:
                    heapq.heappush(heap, key[v])

    while heap or due:
        if due:
            for n in groups[due.pop(0)]:
                emit(n)
        else:
            emit(heapq.heappop(heap)[2])
    return out


def order(graph: Graph, extra: list[tuple[int, int]], late: set[int] = frozenset(),
          groups: list[list[int]] | None = None) -> list[int] | None:
    """The deterministic topological order of `graph` plus `extra` edges, or None if they make a cycle.
    Nodes in `late` run only when nothing else is ready: so the updates of a data-parallel step
    run after the whole backward pass, not between its collectives. With `groups` (collectives),
    each group runs as soon as it is ready; without, the collectives meet at one point (one
    communicator call over a flat buffer on the CPU). Without collectives the order is the plain
    smallest-id-first."""
    g = graph.g.copy()
    for u, v in extra:
        g.add_edge(u, v, key=-1)
    if not nx.is_directed_acyclic_graph(g):
        return None
    if groups:
        return _early_order(g, late, groups)
    return list(nx.lexicographical_topological_sort(g, key=lambda n: (n in late, n)))


def schedule(graph: Graph, early_collectives: bool = False) -> Graph:
    """Returns a copy with `meta["schedule"]` and the in-place update decisions."""
    out = graph.copy()
    accepted: set[int] = set()
    extra: list[tuple[int, int]] = []
    late = after_collectives(out)
    groups = collective_groups(out) if early_collectives else None
    # The accepted ordering edges so far, on a plain DiGraph: a candidate's edges (reader ->
    # update) close a cycle exactly when the update already reaches one of those readers, which
    # a search from the update answers (updates sit at the end of the step, so it visits little)
    # instead of copying and re-sorting the whole graph per candidate (quadratic in kernels).
    reach = nx.DiGraph(out.g)
    # a kernel reading a relaid operand from another's scratch (share_relayouts) runs after it
    for n in out.g:
        for owner in out.notes(n).get("reads_scratch_of", {}).values():
            extra.append((owner, n))
            reach.add_edge(owner, n)
    for name, node in out.updates.items():
        kind = "parameter" if name in out.parameters else "state"
        source = out.parameters.get(name, out.states.get(name))
        # the kernel writing the update: the fused node, or the one a further output belongs to
        kernel, output = (out.operands(node)[0], out.attrs(node)["output"]) if out.op(node) == "fused_output" \
            else (node, "out")
        if node in accepted or out.op(kernel) != "fused" or not reads_elementwise(out, kernel, source, output):
            continue
        if node in out.outputs.values() or any(n == node for k, n in out.updates.items() if k != name):
            continue
        edges = [(u, kernel) for u in _readers(out, source) if u != kernel]
        readers = {u for u, _ in edges}
        if readers and not readers.isdisjoint(nx.descendants(reach, kernel)):
            continue
        reach.add_edges_from(edges)
        extra += edges
        accepted.add(node)
        out.notes(node).update(storage=kind, name=name)
    steps = order(out, extra, late, groups)
    assert steps is not None
    out.meta.update(schedule=steps, schedule_edges=extra)
    return out
