"""A simulated world of ranks: the reference semantics of collectives.

`run_world(graph, inputs_per_rank, parameters, states)` evaluates N ranks of the same graph (SPMD,
as data-parallel training runs it) in lockstep: node by node in the graph's deterministic
topological order, every rank computes the node with the interpreter's own kernels, except for a
collective, which takes the operand values of all the ranks of each group and hands every rank
its result. A `fused` node whose subgraph holds a collective is evaluated the same way, in
lockstep inside the subgraph.

`all_reduce` combines the ranks' values left to right in rank order, ((x0 + x1) + x2) + ..., in
the value's dtype, and `mean` then divides by the group's size: a fixed order, so the result is
deterministic and bit-identical on every rank. (A backend's ring or tree all-reduce adds in
another order; it matches this within rounding.)

The plain `ember.ir.run` is a world of one rank, where every collective is the identity.

Groups: an op's `group` attribute names a partition of the ranks (`groups={"pairs": [[0, 1],
[2, 3]]}`); each rank reduces with the members of its own part. The default has one group,
"world", holding every rank.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .dtypes import TensorType
from .graph import Graph
from .interpreter import Result, _compute, _finish, _result
from .ops import OPS

# op -> fn(values of one group's ranks in rank order, attrs, result type) -> one value per rank
Collective = Callable[[list[np.ndarray], dict[str, Any], TensorType], list[np.ndarray]]


def _all_reduce(values: list[np.ndarray], attrs: dict[str, Any], t: TensorType) -> list[np.ndarray]:
    total = values[0]
    for v in values[1:]:  # rank order, left to right: deterministic
        total = total + v
    total = np.asarray(total)
    if attrs["reduce"] == "mean":
        total = np.asarray(total / np.asarray(len(values), dtype=total.dtype))
    return [total.copy() for _ in values]


COLLECTIVES: dict[str, Collective] = {
    "all_reduce": _all_reduce,
}


def is_collective(op: str) -> bool:
    return OPS[op].kind == "collective"


def has_collective(graph: Graph) -> bool:
    """True when `graph` (or a fused group inside it) holds a collective op."""
    for n in graph.g:
        op = graph.op(n)
        if is_collective(op) or (op == "fused" and has_collective(graph.attrs(n)["graph"])):
            return True
    return False


def _per_rank(kind: str, table: Mapping[str, Any] | Sequence[Mapping[str, Any]], world_size: int) -> list[Mapping[str, Any]]:
    if isinstance(table, Mapping):
        return [table] * world_size
    tables = list(table)
    if len(tables) != world_size:
        raise ValueError(f"run_world: {len(tables)} {kind} tables given for a world of {world_size} ranks")
    return tables


def _partitions(groups: Mapping[str, Sequence[Sequence[int]]] | None, world_size: int) -> dict[str, list[list[int]]]:
    out = {"world": [list(range(world_size))]}
    for name, parts in (groups or {}).items():
        parts = [sorted(int(r) for r in part) for part in parts]
        ranks = sorted(r for part in parts for r in part)
        if ranks != list(range(world_size)) or any(not part for part in parts):
            raise ValueError(f"run_world: group {name!r} must split ranks 0..{world_size - 1} into non-empty "
                             f"disjoint parts, got {parts}")
        out[name] = parts
    return out


def _lockstep(graph: Graph, inputs: list[Mapping[str, Any]], parameters: list[Mapping[str, Any]],
              states: list[Mapping[str, Any]], parts: dict[str, list[list[int]]], precision: str | None,
              keep_dtypes: bool) -> list[dict[int, np.ndarray]]:
    world_size = len(inputs)
    values: list[dict[int, np.ndarray]] = [{} for _ in range(world_size)]
    for n in graph.topo_order():
        op, attrs, t = graph.op(n), graph.attrs(n), graph.type(n)
        if is_collective(op):
            group = attrs.get("group", "world")
            if group not in parts:
                raise KeyError(f"run_world: %{n} = {op} reduces over group {group!r}, which the world does not "
                               f"define; groups: {sorted(parts)}")
            (o,) = graph.operands(n)
            raw: list[Any] = [None] * world_size
            for part in parts[group]:
                for r, v in zip(part, COLLECTIVES[op]([values[r][o] for r in part], attrs, t)):
                    raw[r] = v
        elif op == "fused" and has_collective(attrs["graph"]):
            sub: Graph = attrs["graph"]
            sub_inputs = [dict(zip(sub.inputs, (values[r][o] for o in graph.operands(n)))) for r in range(world_size)]
            sub_values = _lockstep(sub, sub_inputs, [{}] * world_size, [{}] * world_size, parts, None, True)  # as `_fused`
            raw = [sub_values[r][sub.outputs["out"]] for r in range(world_size)]
        else:
            raw = [_compute(graph, n, values[r], inputs[r], parameters[r], states[r]) for r in range(world_size)]
        for r in range(world_size):
            values[r][n] = _finish(graph, n, raw[r], precision, keep_dtypes)
    return values


def run_world(graph: Graph, inputs_per_rank: Sequence[Mapping[str, Any]],
              parameters: Mapping[str, Any] | Sequence[Mapping[str, Any]] = {},
              states: Mapping[str, Any] | Sequence[Mapping[str, Any]] = {}, *, world_size: int | None = None,
              groups: Mapping[str, Sequence[Sequence[int]]] | None = None,
              precision: str | None = None) -> list[Result]:
    """Evaluates `graph` on every rank of a simulated world; returns one `Result` per rank.

    inputs_per_rank: one inputs mapping per rank (e.g. each rank's shard of the batch).
    parameters, states: one mapping shared by every rank (as after a broadcast from rank 0), or a
    sequence of one mapping per rank. world_size: defaults to len(inputs_per_rank) and must
    equal it when given. groups: extra named partitions of the ranks (see the module docstring).
    precision: as for `ember.ir.run`.
    """
    inputs = list(inputs_per_rank)
    if world_size is None:
        world_size = len(inputs)
    if world_size < 1:
        raise ValueError(f"run_world: world_size must be >= 1, got {world_size}")
    if len(inputs) != world_size:
        raise ValueError(f"run_world: {len(inputs)} input tables given for a world of {world_size} ranks")
    values = _lockstep(graph, inputs, _per_rank("parameter", parameters, world_size),
                       _per_rank("state", states, world_size), _partitions(groups, world_size), precision, False)
    return [_result(graph, v) for v in values]
