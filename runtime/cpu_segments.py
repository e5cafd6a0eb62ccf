"""Running a data-parallel CPU step: compiled segments with the communicator's all-reduces
between them.

A step with collectives is compiled as segments (`codegen/cpp.py`): segment 0, the collectives
scheduled after it, segment 1, and so on. The schedule (`passes/schedule.py`, the cpu target
asks for `early_collectives`) puts each gradient bucket's all-reduces right after the bucket's
last gradient and the optimizer updates that read them after the whole backward pass, so a
bucket's reduction can overlap the backward kernels still to run.

Here each group (a bucket, or the loss's mean, at one boundary) gets one flat buffer, allocated
once. At its boundary the group's gradients are copied into it (so the arena may reuse their
memory at once, as the memory plan assumes) and its all-reduce is started: non-blocking
(`start_all_reduce`, MPI_Iallreduce) with `overlap`, else blocking (MPI_Allreduce). The results
are copied out into the planned buffers of the all-reduce nodes just before the first segment
that reads one of them (or at the end: the loss), waiting for the reduction there. No kernel
touches those buffers in between (the memory plan keeps them live from the all-reduce on), so
the later write is safe. Both ways reduce the same flat buffers with the same MPI sum, so they
give the same bits (tested).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ember.ir import Graph
from ember.passes.schedule import collective_groups


def overlap_default() -> bool:
    """`EMBER_COMM_OVERLAP=0` runs every all-reduce blocking at its boundary (for comparison)."""
    return os.environ.get("EMBER_COMM_OVERLAP", "1") not in ("0", "false", "no", "")


@dataclass
class Group:
    op: str
    pairs: list[tuple[np.ndarray, np.ndarray]]  # (gradient view, all-reduce result view)
    flat: np.ndarray
    start_after: int   # the segment after which it starts
    wait_before: int   # the first segment that reads a result (len(segments): the end of the step)
    pending: Any = field(default=None, repr=False)

    def gather(self) -> None:
        at = 0
        for src, _ in self.pairs:
            self.flat[at:at + src.size] = src.reshape(-1)
            at += src.size

    def scatter(self) -> None:
        at = 0
        for _, dst in self.pairs:
            dst.reshape(-1)[...] = self.flat[at:at + dst.size]
            at += dst.size


def _root(graph: Graph, n: int) -> int:
    while graph.notes(n).get("storage") == "alias":
        n = graph.notes(n)["alias_of"]
    return n


def plan_groups(graph: Graph, segments: list[list[Any]], collectives: list[list[tuple[int, int, dict]]],
                view: Callable[[int], np.ndarray]) -> list[Group]:
    """The flat-buffer groups of a segmented step, with where each starts and must be complete.
    `segments`: each segment's kernels (`KernelCode`, whose `node` is the fused node it runs)."""
    group_of = {n: i for i, grp in enumerate(collective_groups(graph)) for n in grp}
    reads = [{_root(graph, o) for k in seg for o in graph.operands(k.node)} for seg in segments]
    groups = []
    for s, calls in enumerate(collectives):
        by_key: dict[tuple, list[tuple[int, int]]] = {}
        for src, dst, attrs in calls:
            if attrs.get("group", "world") != "world":
                raise NotImplementedError(f"the CPU communicator reduces over the whole world only, not group {attrs['group']!r}")
            key = (group_of.get(dst, -dst), attrs["reduce"], graph.type(dst).dtype.name)
            by_key.setdefault(key, []).append((src, dst))
        for (_, op, _), members in by_key.items():
            pairs = [(view(src), view(dst)) for src, dst in members]
            roots = {_root(graph, dst) for _, dst in members}
            wait = next((t for t in range(s + 1, len(segments)) if reads[t] & roots), len(segments))
            flat = np.empty(sum(d.size for _, d in pairs), dtype=pairs[0][1].dtype)
            groups.append(Group(op, pairs, flat, s, wait))
    return groups


class SegmentRunner:
    """Runs the segments of one compiled step and the groups' all-reduces between them."""

    def __init__(self, groups: list[Group], n_segments: int, comm: Any, overlap: bool) -> None:
        self.comm = comm
        self.overlap = overlap and hasattr(comm, "start_all_reduce")
        self.n_segments = n_segments
        self.starts = [[g for g in groups if g.start_after == s] for s in range(n_segments)]
        self.waits = [[g for g in groups if g.wait_before == s] for s in range(n_segments + 1)]
        self.comm_seconds = 0.0    # in the communicator's path: copies, starts, progress, waits
        self.reduce_seconds = 0.0  # inside the all-reduce calls alone (MPI_Allreduce; or Iallreduce, Test, Wait)

    def run(self, segment: Callable[[int], None]) -> None:
        clock = time.perf_counter
        started: list[Group] = []
        for s in range(self.n_segments + 1):
            if self.waits[s]:
                t0 = clock()
                for g in self.waits[s]:
                    if g.pending is not None:
                        g.pending.wait()
                        g.pending = None
                t1 = clock()
                for g in self.waits[s]:
                    g.scatter()
                self.reduce_seconds += t1 - t0
                self.comm_seconds += clock() - t0
            if s == self.n_segments:
                break
            segment(s)
            if not self.starts[s] and not started:
                continue
            t0 = clock()
            reduce = 0.0
            for g in self.starts[s]:
                g.gather()
                t1 = clock()
                if self.overlap:
                    g.pending = self.comm.start_all_reduce(g.flat, g.op)
                    started.append(g)
                else:
                    self.comm.all_reduce(g.flat, g.op)
                reduce += clock() - t1
            t1 = clock()
            # MPI moves a started collective only inside MPI calls: give it a turn at each boundary
            started = [g for g in started if g.pending is not None and not g.pending.test()]
            self.reduce_seconds += reduce + clock() - t1
            self.comm_seconds += clock() - t0
