"""Data parallelism: `data_parallel(graph, world_size, bucket_bytes) -> graph`.

Runs after autodiff -> optimizer -> simplify, on the step of ONE rank (its shard of the global
batch). It inserts one `all_reduce(mean)` over the group "world" per parameter gradient, found by
the tags autodiff puts on them (`autodiff.gradients`), makes every optimizer update read the
reduced gradient instead of the local one, and averages the logged loss over the ranks.

Buckets are metadata, not a graph-level flat buffer: the IR has no concat op, and a reshape+concat bucket
would force the memory planner to copy every gradient into it. So each gradient gets an
all_reduce of its own, depending on that gradient alone (the scheduler may place it right after
the gradient is computed), and the pass groups them into buckets recorded on the graph:
`meta["buckets"]` (a list of {"params", "nodes", "bytes"}) and the note `bucket` on each
all_reduce. A bucket holds parameters in reverse order of their first use in the forward pass
(the order in which the backward pass finishes their gradients, as PyTorch's DDP orders them),
filled greedily up to `bucket_bytes` (a gradient larger than that is a bucket alone); each
bucket records its all_reduce nodes (`"reduced"`). A runtime coalesces a bucket's all_reduces
into one communicator call over a flat buffer. `schedule` runs the readers of collectives (the
updates) after the backward pass and, for a target that asks (`early_collectives`: the CPU),
each bucket's all_reduces as soon as the bucket is complete, its producers first, so the
bucket's reduction overlaps the rest of the backward pass (`ember.runtime.cpu_segments`).

Which uses are redirected: autodiff's tag contract says a tagged node may also be a cotangent
inside the backward pass or a forward value, so only uses outside the "local" part of the step
(the ancestors of every gradient and every output) read the reduced value: those are the
optimizer's. `updates` entries that are the gradient itself are redirected too.

Loss: every output listed in `average` (default: every scalar float output, i.e. the logged loss)
is replaced by its all_reduce(mean), so every rank logs the global batch's mean loss (for equal
shards the mean of the shard means is the whole batch's mean).
"""
from __future__ import annotations

from collections.abc import Sequence

from ember.ir import Graph

from .autodiff import gradients

DEFAULT_BUCKET_BYTES = 25 * 2**20  # PyTorch DDP's default bucket_cap_mb


def _ancestors(graph: Graph, roots: Sequence[int]) -> set[int]:
    seen, stack = set(roots), list(roots)
    while stack:
        for o in graph.operands(stack.pop()):
            if o not in seen:
                seen.add(o)
                stack.append(o)
    return seen


def _use_order(graph: Graph) -> dict[str, int]:
    """Position (in topological order) of each parameter's first user."""
    pos = {n: i for i, n in enumerate(graph.topo_order())}
    first: dict[str, int] = {}
    for name, p in graph.parameters.items():
        users = [pos[u] for u, _ in graph.users(p)]
        first[name] = min(users) if users else len(pos)
    return first


def plan_buckets(graph: Graph, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[dict]:
    """The buckets of the tagged gradients of `graph`: [{"params": [...], "nodes": [...], "bytes": n}]."""
    if bucket_bytes <= 0:
        raise ValueError(f"data_parallel: bucket_bytes must be > 0, got {bucket_bytes}")
    found = gradients(graph)
    first = _use_order(graph)
    order = sorted(found, key=lambda p: (-first[p], list(graph.parameters).index(p)))
    buckets: list[dict] = []
    seen: set[int] = set()
    for p in order:
        node = found[p]
        if node in seen:  # one node is the gradient of several parameters: reduced once
            for b in buckets:
                if node in b["nodes"]:
                    b["params"].append(p)
            continue
        seen.add(node)
        nbytes = graph.type(node).nbytes
        if not buckets or (buckets[-1]["bytes"] + nbytes > bucket_bytes and buckets[-1]["nodes"]):
            buckets.append({"params": [], "nodes": [], "bytes": 0})
        b = buckets[-1]
        b["params"].append(p)
        b["nodes"].append(node)
        b["bytes"] += nbytes
    return buckets


def data_parallel(graph: Graph, world_size: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES, *,
                  average: Sequence[str] | None = None) -> Graph:
    """One rank's step of an SPMD data-parallel world of `world_size` ranks (see the module docstring)."""
    if world_size < 1:
        raise ValueError(f"data_parallel: world_size must be >= 1, got {world_size}")
    dp = graph.copy(graph.name)
    if average is None:
        average = [k for k, n in dp.outputs.items() if dp.type(n).shape == () and dp.type(n).dtype.is_float]
    buckets = plan_buckets(dp, bucket_bytes)
    local = _ancestors(dp, [n for b in buckets for n in b["nodes"]] + list(dp.outputs.values()))
    for i, b in enumerate(buckets):
        reduced = []
        for node in b["nodes"]:
            users = [(u, k) for u, k in dp.users(node) if u not in local]
            ar = dp.add("all_reduce", [node], reduce="mean", group="world", loc=dp.loc(node),
                        scope=dp.scope(node), backward=True)
            dp.annotate(ar, "bucket", i)
            for u, k in users:
                dp.set_operand(u, k, ar)
            for name, n in dp.updates.items():
                if n == node:
                    dp.updates[name] = ar
            reduced.append(ar)
        b["reduced"] = reduced
    for name in average:
        n = dp.outputs[name]
        dp.outputs[name] = dp.add("all_reduce", [n], reduce="mean", group="world", loc=dp.loc(n), scope=dp.scope(n))
    dp.meta["world_size"] = world_size
    dp.meta["buckets"] = buckets
    return dp.verify()
