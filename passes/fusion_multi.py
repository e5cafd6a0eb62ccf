"""Kernels with several outputs (targets whose `FusionCaps.multi_output` is set).

A reduction kernel walks its whole input once per output element; whatever else is computed over
the same reduced domain, or from its results at the output index, can ride along:

1. **Epilogue outputs.** A pointwise group that works at a reduction's output index (every member
   has as many elements as the reduction has outputs, reshapes and elementwise ops only: the
   running-statistics updates of BatchNorm, a per-channel coefficient, an SGD update of a
   per-channel parameter) joins the reduction kernel as a further output, although the
   reduction's own value is read elsewhere too.
2. **Shared domains.** Reduction kernels over the same input shape and the same reduced axes
   become one kernel: reductions that do not depend on each other share one pass over the data
   (several accumulators: BatchNorm's backward sums its gradient and gradient times the
   normalised input together); one that reads another's result (at the output index, broadcast
   over the reduced axes: the variance reading the mean) runs as a later pass of the same
   kernel, so a BatchNorm forward's statistics are one kernel and its values are unchanged.
3. **Independent state updates.** Pointwise kernels of one shape that read only parameters and
   state (each BatchNorm's step counter) become one kernel.

A merge is made only when no other kernel lies on a path between the two (the kernel graph stays
acyclic) and the merged kernel can evaluate every member at the index it is read: a value that
depends on a reduction's result is either at that reduction's output index (elementwise ops and
reshapes of output-sized values) or at the domain's (elementwise ops of domain-shaped values,
reading output-sized ones only through the keepdims shape, which broadcasting aligns with the
kept axes). Codegen (`lowering.lower_reduction`) orders the reductions into passes and checks
the same. Fused nodes record their further outputs in `notes["outputs"]` (the root first).
"""
from __future__ import annotations

import math
from typing import Any

import networkx as nx

from ember.ir import OPS, Graph

from .fusion_recompute import external_reads

Groups = dict[int, tuple[str, set[int], dict[str, Any]]]

ELEMENTWISE = {name for name, op in OPS.items() if op.kind == "elementwise"} - {"random_uniform"}
# reductions that share a pass with others (argmax keeps its own flat loop and index)
MERGEABLE_REDUCTIONS = ("sum", "max")
#: the most kernels the acyclicity check of one merge visits; a merge it cannot settle within
#: them is not made (kernels worth merging are close in the order, so this keeps fusion linear)
SEARCH_LIMIT = 256


def _outputs(root: int, notes: dict[str, Any]) -> list[int]:
    return list(notes.get("outputs", [root]))


def _domain(graph: Graph, members: set[int]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(input shape, reduced axes) shared by every reduction in `members`, or None."""
    sigs = set()
    for m in members:
        op = graph.op(m)
        if op == "argmax":
            return None
        if op in MERGEABLE_REDUCTIONS:
            sigs.add((graph.type(graph.operands(m)[0]).shape, tuple(graph.attrs(m)["axes"])))
    return next(iter(sigs)) if len(sigs) == 1 else None


def _at_index(graph: Graph, members: set[int], starts: list[int], domain: tuple[int, ...],
              axes: tuple[int, ...]) -> bool:
    """True when every member depending on `starts` (values with one element per output of the
    reductions over `domain`/`axes`) reads them at that output's index: through elementwise ops
    and reshapes of output-sized values, and into the domain through its keepdims shape only."""
    keep = tuple(1 if i in axes else d for i, d in enumerate(domain))
    n_out = math.prod(keep)
    dependent: set[int] = set()
    stack = list(starts)
    while stack:
        n = stack.pop()
        for u, _ in graph.users(n):
            if u in members and u not in dependent:
                dependent.add(u)
                stack.append(u)
    for m in dependent:
        op, shape = graph.op(m), graph.type(m).shape
        dep_shapes = [graph.type(o).shape for o in graph.operands(m) if o in dependent or o in starts]
        if op in MERGEABLE_REDUCTIONS:
            if graph.type(graph.operands(m)[0]).shape != domain or tuple(graph.attrs(m)["axes"]) != tuple(axes):
                return False
        elif graph.type(m).numel == n_out and shape != domain:  # at the output index
            if op == "reshape":
                continue
            if op not in ELEMENTWISE or any(s != shape and math.prod(s) != 1 for s in dep_shapes):
                return False
        elif shape == domain:  # at the domain's index, output-sized values through keepdims only
            if op != "broadcast_to" and op not in ELEMENTWISE:
                return False
            if any(s not in (domain, keep) and math.prod(s) != 1 for s in dep_shapes):
                return False
        else:
            return False
    return True


def valid_multi(graph: Graph, members: set[int]) -> bool:
    """True when one reduction kernel can compute `members`: every reduction over one domain, and
    each value depending on a reduction's result read at that reduction's output index (see the
    module doc)."""
    sig = _domain(graph, members)
    if sig is None:
        return False
    domain, axes = sig
    if math.prod(d for i, d in enumerate(domain) if i in axes) == 1:
        return False
    return _at_index(graph, members, [m for m in members if graph.op(m) in MERGEABLE_REDUCTIONS], domain, axes)


def reads_at_output_index(sub: Graph, core: int, value: int) -> bool:
    """Whether reduction kernel `sub` (around reduction `core`) reads its input `value` only at
    the index of the output being computed (so that output may be written over `value` in place)."""
    op = sub.op(core)
    if op not in MERGEABLE_REDUCTIONS:
        return False
    domain, axes = sub.type(sub.operands(core)[0]).shape, tuple(sub.attrs(core)["axes"])
    if sub.type(value).numel != math.prod(d for i, d in enumerate(domain) if i not in axes):
        return False
    return _at_index(sub, set(sub.g), [value], domain, axes)


class _KernelGraph:
    """The kernels' dependency graph (through reshape aliases) and a topological order of it, kept
    up to date across merges: a path between two kernels can only pass through kernels placed
    between them, so the acyclicity check of a merge explores that window alone."""

    def __init__(self, graph: Graph, groups: Groups, position: dict[int, int]) -> None:
        self.graph, self.groups = graph, groups
        self.producer = {v: r for r, (_, _, notes) in groups.items() for v in _outputs(r, notes)}
        self.dag = nx.DiGraph()
        self.dag.add_nodes_from(groups)
        for r, (_, members, _) in groups.items():
            for m in members:
                for o in graph.operands(m):
                    if o not in members and (p := self.source(o)) is not None and p != r:
                        self.dag.add_edge(p, r)
        # kernels ordered by their first member: a parameter's gradient sum then sits by the other
        # sums of its layer, not after the whole backward pass where its update's id would put it
        first = {r: min(position[m] for m in ms) for r, (_, ms, _) in groups.items()}
        self.order: list[int | None] = list(nx.lexicographical_topological_sort(self.dag, key=first.__getitem__))
        self.pos = {r: i for i, r in enumerate(self.order)}

    def source(self, value: int) -> int | None:
        """The group that computes `value` (looking through reshape aliases), or None."""
        while value not in self.producer and self.graph.op(value) == "reshape":
            (value,) = self.graph.operands(value)
        return self.producer.get(value)

    def _reaches(self, starts: list[int], target: int) -> bool:
        """Whether a path leads from `starts` to `target`; True (no merge) past SEARCH_LIMIT kernels."""
        limit = self.pos[target]
        seen, stack = set(starts), [s for s in starts if self.pos[s] <= limit]
        while stack:
            n = stack.pop()
            if n == target or len(seen) > SEARCH_LIMIT:
                return True
            for s in self.dag.successors(n):
                if s not in seen and self.pos[s] <= limit:
                    seen.add(s)
                    stack.append(s)
        return False

    def can_merge(self, a: int, b: int) -> bool:
        """No kernel lies on a path between `a` and `b` (merging them keeps the graph acyclic)."""
        first, second = (a, b) if self.pos[a] < self.pos[b] else (b, a)
        return not self._reaches([s for s in self.dag.successors(first) if s != second], second)

    def merge(self, into: int, other: int) -> None:
        """Moves group `other` into group `into` (its outputs after `into`'s)."""
        lo, hi = sorted((self.pos[into], self.pos[other]))
        first = self.order[lo]
        kind, members, notes = self.groups[into]
        _, o_members, o_notes = self.groups.pop(other)
        outputs = _outputs(into, notes) + [v for v in _outputs(other, o_notes) if v not in members]
        members |= o_members
        notes["outputs"] = outputs
        for v in outputs:
            self.producer[v] = into
        # a reshape alias from one half's value to the other's reader is now inside the kernel
        grown = True
        while grown:
            grown = False
            for m in list(members):
                for o in self.graph.operands(m):
                    if o not in members and self.graph.op(o) == "reshape" and self.source(o) == into:
                        members.add(o)
                        grown = True
        # The order stays topological if, between the two, the first one's descendants move after
        # the merged kernel and everything else before it (nothing between reaches the second).
        window = self.order[lo + 1:hi]
        inside = set(window)
        after, stack = set(), [first]
        while stack:
            for s in self.dag.successors(stack.pop()):
                if s in inside and s not in after:
                    after.add(s)
                    stack.append(s)
        for p in list(self.dag.predecessors(other)):
            if p != into:
                self.dag.add_edge(p, into)
        for s in list(self.dag.successors(other)):
            if s != into:
                self.dag.add_edge(into, s)
        self.dag.remove_node(other)
        segment = [n for n in window if n not in after and n is not None] + [into] + \
            [n for n in window if n in after]
        self.order[lo:hi + 1] = segment + [None] * (hi + 1 - lo - len(segment))  # positions after stay
        del self.pos[other]
        for i, n in enumerate(segment, lo):
            self.pos[n] = i


def _output_sized(graph: Graph, members: set[int], n_out: int) -> bool:
    return all(graph.type(m).numel == n_out and (graph.op(m) == "reshape" or graph.op(m) in ELEMENTWISE)
               for m in members)


def merge_multi_output(graph: Graph, groups: Groups) -> None:
    """Epilogue outputs, then shared domains, until nothing changes (see the module doc), in place."""
    position = {n: i for i, n in enumerate(graph.topo_order())}
    kg = _KernelGraph(graph, groups, position)
    changed = True
    while changed:
        changed = _absorb_epilogues(graph, groups, kg, position) | _merge_domains(graph, groups, kg, position)
    _merge_source_only(graph, groups, kg, position)


def _merge_source_only(graph: Graph, groups: Groups, kg: _KernelGraph, position: dict[int, int]) -> None:
    """Pointwise kernels of one shape that read only parameters and state (each BatchNorm's step
    counter increment) become one kernel: they may all run first, so no order is lost."""
    first: dict[tuple[int, ...], int] = {}
    for r in sorted((r for r, g in groups.items() if g[0] == "pointwise"), key=position.__getitem__):
        if any(graph.op(o) not in ("parameter", "state", "constant") for o in external_reads(graph, groups[r][1])):
            continue
        shape = graph.type(r).shape
        if shape in first:
            kg.merge(first[shape], r)
        else:
            first[shape] = r


def _absorb_epilogues(graph: Graph, groups: Groups, kg: _KernelGraph, position: dict[int, int]) -> bool:
    changed = False
    for root in sorted((r for r, g in groups.items() if g[0] == "pointwise"), key=position.__getitem__):
        _, members, notes = groups[root]
        if len(_outputs(root, notes)) > 1:
            continue
        read = {p for m in members for o in graph.operands(m) if o not in members
                and (p := kg.source(o)) is not None and groups[p][0] == "reduction"}
        for r in sorted(read, key=position.__getitem__, reverse=True):
            r_members = groups[r][1]
            sig = _domain(graph, r_members)
            if sig is None:
                continue
            domain, axes = sig
            n_out = math.prod(d for i, d in enumerate(domain) if i not in axes)
            if not _output_sized(graph, members, n_out) or not kg.can_merge(r, root) \
                    or not valid_multi(graph, r_members | members):
                continue
            kg.merge(r, root)
            changed = True
            break
    return changed


def _merge_domains(graph: Graph, groups: Groups, kg: _KernelGraph, position: dict[int, int]) -> bool:
    """Merges reduction kernels of one domain that are near: one reads the other's result, or they
    read a common value (the pairs worth a kernel; looking only there keeps the pass linear)."""
    changed = False
    reductions = sorted((r for r, g in groups.items() if g[0] == "reduction"), key=position.__getitem__)
    signature = {r: _domain(graph, groups[r][1]) for r in reductions}
    readers: dict[int, set[int]] = {}
    for r in reductions:
        for o in external_reads(graph, groups[r][1]):
            readers.setdefault(o, set()).add(r)
    for b in reductions:
        if b not in groups or signature[b] is None:
            continue
        reads = external_reads(graph, groups[b][1])
        near = set(kg.dag.predecessors(b)) | {a for o in reads for a in readers.get(o, ())}
        near = {a for a in near if a in groups and a != b}
        for a in sorted(near, key=lambda r: (abs(kg.pos[r] - kg.pos[b]), kg.pos[r])):
            if signature.get(a) != signature[b] \
                    or not valid_multi(graph, groups[a][1] | groups[b][1]) or not kg.can_merge(a, b):
                continue
            into, other = (a, b) if kg.pos[a] < kg.pos[b] else (b, a)  # named after the first
            kg.merge(into, other)
            for o in external_reads(graph, groups[into][1]):
                readers.setdefault(o, set()).discard(other)
                readers[o].add(into)
            changed = True
            break
    return changed
