"""Which kernels of a CUDA step may run at the same time, and on which stream.

The memory plan reuses arena memory along the schedule's order, so two kernels may overlap only
when neither touches memory the other writes. This module derives, for every kernel in schedule
order, the earlier kernels it must wait for from the memory each one reads and writes (read after
write, write after read, write after write, over byte ranges of the arena and of each storage
array), and assigns streams greedily: a kernel continues the stream of the dependency that ran
last on its stream, else takes the least recently used stream of a small pool. Kernels with no
hazard between them then overlap when the step is captured into one CUDA graph, while the
results stay exactly those of running the schedule in order (every kernel is deterministic, and
every pair that could interfere is ordered).
"""
from __future__ import annotations

from dataclasses import dataclass

from ember.ir import Graph

Region = tuple[str, int, int]  # (memory space: "arena" or a storage name, first byte, end byte)


@dataclass(frozen=True)
class Placement:
    stream: int                  # index into the executor's streams (0: the step's own stream)
    waits: tuple[int, ...]       # kernels (positions in the kernel order) to wait for from other streams


def _region(graph: Graph, n: int) -> Region | None:
    notes, t = graph.notes(n), graph.type(n)
    while notes["storage"] == "alias":
        n = notes["alias_of"]
        notes = graph.notes(n)
    if notes["storage"] in ("arena", "input"):
        return ("arena", notes["offset"], notes["offset"] + max(t.nbytes, 1))
    if notes["storage"] in ("parameter", "state"):
        return (notes["name"], 0, 1 << 62)
    return None  # constants: read-only


def _overlap(a: Region, b: Region) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def kernel_regions(graph: Graph, kernels: list[int]) -> list[tuple[list[Region], list[Region]]]:
    """(read, written) regions of each fused node in `kernels`."""
    out = []
    for n in kernels:
        reads = [r for o in graph.operands(n) if (r := _region(graph, o)) is not None]
        writes = [r for m in graph.results(n) if (r := _region(graph, m)) is not None]
        scratch = graph.attrs(n)["kernel"].scratch_bytes
        if scratch:
            off = graph.notes(n)["scratch_offset"]
            writes.append(("arena", off, off + scratch))
        for owner in graph.notes(n).get("reads_scratch_of", {}).values():  # relaid operands (share_relayouts)
            off = graph.notes(owner)["scratch_offset"]
            reads.append(("arena", off, off + graph.attrs(owner)["kernel"].scratch_bytes))
        out.append((reads, writes))
    return out


def dependencies(graph: Graph, kernels: list[int]) -> list[set[int]]:
    """For each kernel (by position), the earlier kernels it must follow."""
    regions = kernel_regions(graph, kernels)
    deps: list[set[int]] = []
    for i, (reads, writes) in enumerate(regions):
        mine = set()
        for j in range(i):
            r2, w2 = regions[j]
            if any(_overlap(a, b) for a in w2 for b in reads + writes) or any(_overlap(a, b) for a in r2 for b in writes):
                mine.add(j)
        deps.append(mine)
    return deps


def place(graph: Graph, kernels: list[int], streams: int = 4) -> list[Placement]:
    """A stream for every kernel and the cross-stream waits it needs (see the module docstring).
    Collectives all go to stream 0: NCCL needs every rank to run them in one order, and calls on
    several streams of one communicator could meet in different orders on different ranks."""
    deps = dependencies(graph, kernels)
    tail: list[int | None] = [None] * streams   # last kernel on each stream
    last_used = [-1] * streams
    out: list[Placement] = []
    for i, d in enumerate(deps):
        continuing = [s for s in range(streams) if tail[s] is not None and tail[s] in d]
        if graph.attrs(kernels[i])["kernel"].kind == "collective":
            stream = 0
        elif continuing:
            stream = max(continuing, key=lambda s: tail[s])  # follow the latest dependency's stream
        else:
            free = [s for s in range(streams) if tail[s] is None or all(tail[s] != j for j in d)]
            stream = min(free, key=lambda s: last_used[s])
        # waits: dependencies not already ordered by running earlier on this same stream
        on_stream = {j for j, p in enumerate(out) if p.stream == stream}
        waits = tuple(sorted(j for j in d if j not in on_stream))
        out.append(Placement(stream, waits))
        tail[stream] = i
        last_used[stream] = i
    return out
