"""Memory planning: a schedule, buffer liveness and offsets in one arena.

Runs on a fused graph. Decisions are recorded on the graph: `meta["schedule"]` (the kernel
order), and per node `notes["storage"]`:
- "input" / "parameter" / "state" (with `notes["name"]`): memory owned outside the arena;
- "arena" (with `notes["offset"]`, 64-byte aligned): a kernel result living in the arena;
- "alias" (with `notes["alias_of"]`): a reshape, sharing its operand's buffer;
- "constant": a non-scalar constant, held by the runtime.
An update of a parameter or state whose kernel reads the old value only element by element at the
same index is written in place into that parameter's memory (`storage` = "parameter"/"state");
the schedule then puts every other reader of the old value before it. Only a pointwise kernel is
ever written in place: a `collective` kernel's result always gets an arena buffer of its own. `meta["arena_bytes"]` is
the arena's size: the peak of simultaneously live intermediate buffers.
"""
from __future__ import annotations

from ember.ir import OPS, Graph

ALIGN = 64
EXTERNAL = {"input": "input", "parameter": "parameter", "state": "state"}


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _reads_elementwise(graph: Graph, fused: int, source: int) -> bool:
    """True when `fused` reads `source` only at the index it writes (so writing in place is safe)."""
    if graph.op(fused) != "fused" or graph.attrs(fused)["kernel"] != "pointwise":
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


def _schedule(graph: Graph, extra: list[tuple[int, int]]) -> list[int] | None:
    g = graph.g.copy()
    for u, v in extra:
        g.add_edge(u, v, key=-1)
    import networkx as nx
    if not nx.is_directed_acyclic_graph(g):
        return None
    return list(nx.lexicographical_topological_sort(g, key=lambda n: n))


def plan_memory(graph: Graph) -> Graph:
    out = graph.copy()
    # 1. In-place updates, each accepted only if the schedule stays acyclic with its ordering edges.
    inplace: dict[int, tuple[str, str]] = {}
    extra: list[tuple[int, int]] = []
    for name, node in out.updates.items():
        kind = "parameter" if name in out.parameters else "state"
        source = out.parameters.get(name, out.states.get(name))
        if node in inplace or out.op(node) != "fused" or not _reads_elementwise(out, node, source):
            continue
        if node in out.outputs.values() or any(n == node for k, n in out.updates.items() if k != name):
            continue
        edges = [(u, node) for u, _ in out.users(source) if u != node]
        if _schedule(out, extra + edges) is not None:
            extra += edges
            inplace[node] = (kind, name)
    schedule = _schedule(out, extra)
    assert schedule is not None
    position = {n: i for i, n in enumerate(schedule)}

    # 2. Storage classes and aliases.
    base: dict[int, int] = {}
    for n in schedule:
        op = out.op(n)
        notes = out.notes(n)
        if op in EXTERNAL:
            notes.update(storage=EXTERNAL[op], name=out.attrs(n)["name"])
            base[n] = n
        elif op == "constant":
            notes.update(storage="constant")
            base[n] = n
        elif op == "reshape":
            (src,) = out.operands(n)
            notes.update(storage="alias", alias_of=src)
            base[n] = base[src]
        elif n in inplace:
            kind, name = inplace[n]
            notes.update(storage=kind, name=name)
            base[n] = n
        else:
            notes.update(storage="arena")
            base[n] = n

    # 3. Liveness of arena buffers: from the kernel that writes to the last kernel that reads.
    end = len(schedule)
    live: dict[int, list[int]] = {}
    for n in schedule:
        if out.notes(n)["storage"] == "arena":
            live[n] = [position[n], position[n]]
    for n in schedule:
        for o in out.operands(n):
            b = base[o]
            if b in live:
                live[b][1] = max(live[b][1], position[n])
    for n in list(out.outputs.values()) + list(out.updates.values()):
        if base[n] in live:
            live[base[n]][1] = end

    # 4. Offsets: largest first, each at the lowest aligned offset free over its lifetime.
    placed: list[tuple[int, int, int, int]] = []  # (start, stop, offset, size)
    offsets: dict[int, int] = {}
    for n in sorted(live, key=lambda n: (-out.type(n).nbytes, position[n])):
        start, stop = live[n]
        size = _align(max(out.type(n).nbytes, 1))
        busy = sorted((off, off + sz) for s, e, off, sz in placed if not (e < start or stop < s))
        offset = 0
        for lo, hi in busy:
            if offset + size <= lo:
                break
            offset = max(offset, _align(hi))
        offsets[n] = offset
        placed.append((start, stop, offset, size))
        out.notes(n)["offset"] = offset
    arena = max((off + sz for _, _, off, sz in placed), default=0)
    out.meta.update(schedule=schedule, arena_bytes=arena, liveness={n: tuple(v) for n, v in live.items()},
                    buffer_bytes_total=sum(sz for *_, sz in placed))
    return out


def check_plan(graph: Graph) -> None:
    """Raises AssertionError if two arena buffers live at the same time overlap in memory."""
    live = graph.meta["liveness"]
    items = [(n, *live[n], graph.notes(n)["offset"], graph.type(n).nbytes) for n in live]
    for i, (a, s1, e1, o1, z1) in enumerate(items):
        assert o1 % ALIGN == 0, f"%{a} offset {o1} not {ALIGN}-byte aligned"
        assert o1 + z1 <= graph.meta["arena_bytes"]
        for b, s2, e2, o2, z2 in items[i + 1:]:
            if not (e1 < s2 or e2 < s1):
                assert o1 + z1 <= o2 or o2 + z2 <= o1, f"%{a} and %{b} are live together and overlap"
