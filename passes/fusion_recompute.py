"""Recomputing cheap elementwise values in every kernel that reads them, instead of storing them.

A pointwise kernel whose value several generated kernels read (BatchNorm's `x - mean`, read by
the variance and by the normalisation; `dy * weight` and the centred gradient in its backward
pass) costs a launch, a full-tensor write and one read per reader. When its members are cheap
and its readers are pointwise or reduction kernels (which evaluate any elementwise subgraph at
the coordinates they need), each reader can compute the value itself from the kernel's own
operands: the kernel and its buffer disappear, and the readers read those operands instead.

The rule is a cost comparison in bytes moved, per candidate, in producer-first order (so a value
recomputed into its readers can make those readers cheap enough to be recomputed in turn):

- stored: the kernel reads its operands and writes its value once; every reader reads it;
- recomputed: every reader reads the operands it did not read already.

A candidate is recomputed when that moves no more bytes than storing it, its arithmetic per
element is at most `MAX_COST` (`OP_COST` units, so an `exp` counts as several additions and
Philox random numbers are never recomputed), and every reader is a pointwise or reduction
kernel, or a contraction that reads it in its generated `pointwise` epilogue only (evaluated at
each output element like a pointwise kernel; never as an operand its template loads), reading it
directly or through reshape aliases. So GELU's forward parts (0.5x, x/sqrt(2), erf(.)+1), which
its backward reads inside the next layer's grad-input matmul on CUDA, are one forward kernel and
recomputed in that epilogue, not four stored tensors. A value the step returns (an output or
an update) is always stored. Recomputing never changes a value: the readers evaluate the same
ops in the same order, so the interpreter's results before and after are identical.

The byte counts mix sizes that follow the batch with sizes that do not (parameters), so near
break-even the rule can decide differently at another batch size, and the step of that batch
would need other kernels. A step compiled after one of the same model at another batch size
carries that step's decisions (`meta["recompute_reuse"]`, from the graph's
`meta["recomputed"]`: each weighed candidate, by node id and op) and takes them where the
candidate is one again, so that its kernels are the same code.

On targets that ask for it (`FusionCaps.store_narrow`: CUDA), a kernel of any kind whose value is
a widening cast of a value it computes (mixed precision: a bfloat16 convolution's result widened
for the float32 BatchNorm after it, a bfloat16-rounded gradient widened again) stores the narrow
value instead, and each reader widens it itself
(`store_narrow`): the same values, half the bytes written and read. Only where every reader can
(pointwise and reduction kernels; a contraction's generated epilogue where the target's
epilogues read the narrow dtype), so the cast never becomes a kernel of its own.
"""
from __future__ import annotations

from typing import Any

from ember.ir import OPS, Graph

Groups = dict[int, tuple[str, set[int], dict[str, Any]]]

#: per-element cost of an op when recomputed, in units of one addition; ops not listed cost 1,
#: None never recompute (Philox's rounds cost more than the memory they would save)
OP_COST: dict[str, int | None] = {"exp": 8, "log": 8, "tanh": 8, "erf": 8, "sigmoid": 8, "sin": 8, "cos": 8,
                                  "sqrt": 2, "div": 2, "reciprocal": 2, "floor": 2, "random_uniform": None}
#: the most arithmetic per element a recomputed value may cost (each reader repeats it)
MAX_COST = 16
#: the kernel kinds that evaluate an elementwise subgraph at any coordinates (so can recompute)
READER_KINDS = ("pointwise", "reduction")


def external_reads(graph: Graph, members: set[int]) -> set[int]:
    """The values `members` read from outside (scalar constants, which are copied in, left out)."""
    return {o for m in members for o in graph.operands(m) if o not in members
            and not (graph.op(o) == "constant" and graph.type(o).numel <= 1)}


def _cost(graph: Graph, members: set[int], numel: int) -> int | None:
    """Arithmetic per element of the group's full-size members (smaller ones, per channel say,
    are evaluated once per row or hoisted by the loop structure), or None if one may not repeat."""
    total = 0
    for m in members:
        if OPS[graph.op(m)].kind != "elementwise":
            continue
        c = OP_COST.get(graph.op(m), 1)
        if c is None:
            return None
        if graph.type(m).numel == numel:
            total += c
    return total


def _generated_epilogue(groups: Groups, reader: int) -> set[int]:
    """The members of a contraction kernel that its generated (`pointwise`) epilogue evaluates at
    each output element (`notes["epilogue"]`, from `fusion._absorb_pointwise_epilogues`); empty
    for a kernel without one. A value read there is not one of the template's operands."""
    return groups[reader][2].get("epilogue", set())


def _epilogue_reads(graph: Graph, members: set[int], value: int, epilogue_dtypes: frozenset[str]) -> bool:
    """Whether a contraction's generated epilogue may evaluate the group: its value and every
    value it reads in dtypes the target's epilogues take (`FusionCaps.epilogue_dtypes`)."""
    return graph.type(value).dtype.name in epilogue_dtypes and \
        all(graph.type(o).dtype.name in epilogue_dtypes for o in external_reads(graph, members))


def _readers(graph: Graph, groups: Groups, home: dict[int, list[int]], value: int, returned: set[int],
             members: set[int], epilogue_dtypes: frozenset[str] = frozenset({"float32"})) -> dict[int, set[int]] | None:
    """Reader kernel -> the reshape aliases between `value` and it; None when something else
    reads `value` (a template's operand, an output, the step's result). `home`: each node -> the
    kernels evaluating it (several where it is recomputed). A contraction kernel reads it as a
    reader may where only its generated epilogue does (`_generated_epilogue`)."""
    found: dict[int, set[int]] = {}
    epilogue_may_read: bool | None = None  # asked once, at the first epilogue
    stack: list[tuple[int, frozenset[int]]] = [(value, frozenset())]
    while stack:
        n, chain = stack.pop()
        for u, _ in graph.users(n):
            if u in home:
                for reader in home[u]:
                    if groups[reader][0] not in READER_KINDS:
                        if epilogue_may_read is None:
                            epilogue_may_read = _epilogue_reads(graph, members, value, epilogue_dtypes)
                        if not epilogue_may_read or u not in _generated_epilogue(groups, reader):
                            return None
                    found.setdefault(reader, set()).update(chain)
            elif graph.op(u) == "reshape" and u not in returned:
                stack.append((u, chain | {u}))
            else:
                return None
    return found or None


def recompute_cheap(graph: Graph, groups: Groups,
                    epilogue_dtypes: frozenset[str] = frozenset({"float32"})) -> dict[tuple[int, str], bool]:
    """Merges each cheap pointwise group into all its readers (see the module doc), in place;
    returns the decision on each candidate the byte rule weighed (or took from
    `meta["recompute_reuse"]`): (root id, op) -> recomputed."""
    reuse = dict(graph.meta.get("recompute_reuse", ()))
    decided: dict[tuple[int, str], bool] = {}
    returned = set(graph.outputs.values()) | set(graph.updates.values())
    # the group computing each node that a later kernel reads (a value's readers come after it
    # in topological order, so each is in exactly one group when its producer is considered)
    home = _homes(groups)
    for root in [r for r in graph.topo_order() if r in groups]:
        kind, members, notes = groups[root]
        if kind != "pointwise" or root in returned or len(notes.get("outputs", [root])) > 1:
            continue
        numel = graph.type(root).numel
        cost = _cost(graph, members, numel)
        if cost is None or cost > MAX_COST:
            continue
        readers = _readers(graph, groups, home, root, returned, members, epilogue_dtypes)
        if readers is None or root in readers:
            continue
        key = (root, graph.op(root))
        decided[key] = reuse[key] if key in reuse else _saves_bytes(graph, groups, members, root, readers)
        if not decided[key]:
            continue
        _merge_into_readers(groups, members, readers)
        del groups[root]
    return decided


def _homes(groups: Groups) -> dict[int, list[int]]:
    """Each member -> the groups evaluating it."""
    home: dict[int, list[int]] = {}
    for r, (_, ms, _) in groups.items():
        for m in ms:
            home.setdefault(m, []).append(r)
    return home


def _merge_into_readers(groups: Groups, members: set[int], readers: dict[int, set[int]]) -> None:
    for r, chain in readers.items():
        _, rmembers, rnotes = groups[r]
        rmembers.update(members | chain)
        if "epilogue" in rnotes:  # a contraction's generated epilogue evaluates them too
            rnotes["epilogue"] |= members | chain


def store_narrow(graph: Graph, groups: Groups, epilogue_dtypes: frozenset[str] = frozenset({"float32"})) -> list[int]:
    """Each group whose value is a widening cast of one of its own values stores that narrow
    value, and the cast joins every reader (see the module doc), in place; returns the casts moved.
    A group with several outputs, or whose value the step returns, is left as it is."""
    returned = set(graph.outputs.values()) | set(graph.updates.values())
    home = _homes(groups)
    moved = []
    for root in [r for r in graph.topo_order() if r in groups]:
        kind, members, notes = groups[root]
        if graph.op(root) != "cast" or root in returned or len(notes.get("outputs", [root])) > 1:
            continue
        narrow = graph.operands(root)[0]
        if narrow not in members or graph.type(narrow).dtype.itemsize >= graph.type(root).dtype.itemsize:
            continue
        readers = _readers(graph, groups, home, root, returned, {root}, epilogue_dtypes)
        if readers is None or root in readers:
            continue
        _merge_into_readers(groups, {root}, readers)
        notes = dict(notes)
        if "epilogue" in notes:  # a contraction's generated epilogue: the cast leaves it
            notes["epilogue"] = notes["epilogue"] - {root}
            if not notes["epilogue"]:  # it was all the epilogue was: the template stores its own value
                del notes["epilogue"], notes["pointwise_from"]
        del groups[root]
        groups[narrow] = (kind, members - {root}, notes)
        for m in members - {root}:
            home[m] = [narrow if r == root else r for r in home[m]]
        for r in readers:
            home.setdefault(root, []).append(r)
        home[root].remove(root)
        moved.append(root)
    return moved


def _saves_bytes(graph: Graph, groups: Groups, members: set[int], root: int, readers: dict[int, set[int]]) -> bool:
    """Whether recomputing the group in its readers moves no more bytes than storing it."""
    nbytes = {o: graph.type(o).nbytes for o in external_reads(graph, members)}
    stored = sum(nbytes.values()) + graph.type(root).nbytes * (1 + len(readers))
    recomputed = 0
    for r in readers:
        already = external_reads(graph, groups[r][1])
        recomputed += sum(b for o, b in nbytes.items() if o not in already)
    return recomputed <= stored
