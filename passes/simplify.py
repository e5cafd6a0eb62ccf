"""Graph clean-up: dead code, common subexpressions, constant folding and algebraic identities.

`simplify` runs the four to a fixed point, with `linear_sums.distribute_sums` (a sum's term
`a - mean(a)` over the mean's own axes, whose sum is zero, dropped, so that BatchNorm's mean
gradient waits for no other sum; the one rewrite here that is not exact). Each is also a pure Graph -> Graph function of its
own (`dce`, `cse`, `fold_constants`, `algebraic`), which tests and debugging dumps use. Internally
each has an in-place form on a private copy that reports whether it changed anything, so the
fixed point costs one graph copy in all.

DCE keeps outputs, updates and every input, parameter and state: those are the step's signature
(the runtime binds storage and arguments by them), even when the computation no longer reads one.

Every replacement of a node by an equal value goes through `_replace`, which carries autodiff's
gradient tags (`grad_of`) to the replacement. Collectives are never folded: their value depends
on the other ranks.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ember.ir import IMPLS, OPS, Graph, TensorType
from ember.ir.dtypes import as_array, as_values

from .autodiff import carry_gradient_tags
from .linear_sums import _distribute_sums

SOURCES = ("input", "parameter", "state")

# A fold never creates a constant larger than its largest operand: folding `broadcast_to(scalar)`
# to an activation-sized shape would bloat the graph (and every generated source) with data that
# a broadcast describes in one line. And no size threshold: whether a value folds must not
# depend on the batch size, or a step of another batch size would be another graph (its kernels
# other code, no compiled kernel shared between the two).


def _replace(g: Graph, old: int, new: int) -> None:
    """Points old's uses at `new` (an equal value) and moves old's gradient tags onto it."""
    g.replace_uses(old, new)
    carry_gradient_tags(g, old, new)


# ---- dead code -------------------------------------------------------------------------------

def _dce(g: Graph) -> bool:
    live = set(g.roots())
    for table in (g.inputs, g.parameters, g.states):
        live.update(table.values())
    stack = list(live)
    while stack:
        for o in g.operands(stack.pop()):
            if o not in live:
                live.add(o)
                stack.append(o)
    dead = [n for n in g.g if n not in live]
    for n in dead:
        g.remove(n)
    return bool(dead)


# ---- common subexpressions -------------------------------------------------------------------

def _hashable(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return ("ndarray", v.dtype.str, v.shape, v.tobytes())
    if isinstance(v, (list, tuple)):
        return tuple(_hashable(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _hashable(x)) for k, x in v.items()))
    hash(v)  # raises for values we cannot key on (a fused group's graph)
    return v


def _key(g: Graph, n: int, operands: list[int]) -> Any:
    op = g.op(n)
    if op in SOURCES:
        return None  # named entries are distinct by definition
    try:
        attrs = _hashable(g.attrs(n))
    except TypeError:
        return None
    return (op, tuple(operands), attrs, g.type(n))


def _cse(g: Graph) -> bool:
    seen: dict[Any, int] = {}
    changed = False
    for n in g.topo_order():
        key = _key(g, n, g.operands(n))  # operands already point at the kept duplicates
        if key is None:
            continue
        first = seen.setdefault(key, n)
        if first != n:
            _replace(g, n, first)
            g.remove(n)
            changed = True
    return changed


# ---- constant folding ------------------------------------------------------------------------

def _fold_value(g: Graph, n: int) -> np.ndarray | None:
    op = g.op(n)
    if op in SOURCES or op in ("constant", "fused") or OPS[op].kind == "collective":
        return None
    operands = g.operands(n)
    if not operands or any(g.op(o) != "constant" for o in operands):
        return None
    args = [as_values(g.attrs(o)["value"], g.type(o).dtype) for o in operands]
    t: TensorType = g.type(n)
    if t.numel > max(a.size for a in args):
        return None
    # The interpreter's own kernels, with its result cast, so a fold cannot change semantics.
    with np.errstate(all="ignore"):
        value = np.asarray(IMPLS[op](args, g.attrs(n), t))
    return as_array(as_values(value, t.dtype), t.dtype).reshape(t.shape)


def _fold_constants(g: Graph) -> bool:
    changed = False
    for n in g.topo_order():
        value = _fold_value(g, n)
        if value is None:
            continue
        c = g.add_constant(value, **g.provenance(n))
        _replace(g, n, c)
        changed = True
    if changed:
        _dce(g)
    return changed


# ---- algebraic identities --------------------------------------------------------------------

def _uniform_constant(g: Graph, n: int) -> float | None:
    """The value of a constant whose elements are all equal (looking through broadcast_to)."""
    while g.op(n) == "broadcast_to":
        (n,) = g.operands(n)
    if g.op(n) != "constant":
        return None
    v = as_values(g.attrs(n)["value"], g.type(n).dtype)
    if v.size == 0 or v.dtype == np.bool_:
        return None
    first = v.flat[0]
    return float(first) if np.all(v == first) else None


def _rewrite(g: Graph, n: int) -> int | None:
    """The node that n can be replaced by (possibly new), or None."""
    op, t = g.op(n), g.type(n)
    operands = g.operands(n)

    def same_type(m: int) -> bool:
        return g.type(m) == t

    if op in ("mul", "add", "sub", "div"):
        a, b = operands
        cb, ca = _uniform_constant(g, b), _uniform_constant(g, a)
        neutral = 1.0 if op in ("mul", "div") else 0.0
        if cb == neutral and same_type(a):  # x*1, x+0, x-0, x/1
            return a
        if op in ("mul", "add") and ca == neutral and same_type(b):  # 1*x, 0+x
            return b
        return None
    if op == "neg":
        (x,) = operands
        if g.op(x) == "neg":
            return g.operands(x)[0]
        return None
    if op == "reshape":
        (x,) = operands
        if g.type(x).shape == t.shape:
            return x
        if g.op(x) == "reshape":
            return g.add("reshape", g.operands(x), **g.provenance(n), shape=t.shape)
        return None
    if op == "transpose":
        (x,) = operands
        perm = g.attrs(n)["perm"]
        if perm == tuple(range(len(perm))):
            return x
        if g.op(x) == "transpose":
            inner = g.attrs(x)["perm"]
            composed = tuple(inner[p] for p in perm)  # out[i] = x[..] at axis inner[perm[i]]
            (src,) = g.operands(x)
            if composed == tuple(range(len(composed))):
                return src
            return g.add("transpose", [src], **g.provenance(n), perm=composed)
        if g.op(x) == "matmul" and perm == (1, 0) and len(g.users(x)) == 1 and x not in g.outputs.values():
            # (A B)^T = B^T A^T: the transposes then cancel or fold into the matmul's operand
            # order, so no transposed copy of the product (a weight gradient) is ever made.
            a, b = g.operands(x)
            bt = g.add("transpose", [b], **g.provenance(n), perm=(1, 0))
            at = g.add("transpose", [a], **g.provenance(n), perm=(1, 0))
            return g.add("matmul", [bt, at], **g.provenance(n))
        return None
    if op == "broadcast_to":
        (x,) = operands
        return x if same_type(x) else None
    if op == "cast":
        (x,) = operands
        return x if same_type(x) else None
    return None


def _algebraic(g: Graph) -> bool:
    changed = False
    for n in g.topo_order():
        if n not in g:
            continue
        new = _rewrite(g, n)
        if new is not None and new != n:
            _replace(g, n, new)
            changed = True
    if changed:
        _dce(g)
    return changed


# ---- public pure passes ----------------------------------------------------------------------

def _pure(fn: Callable[[Graph], bool], doc: str) -> Callable[[Graph], Graph]:
    def run(graph: Graph) -> Graph:
        g = graph.copy()
        fn(g)
        return g.verify()
    run.__name__ = fn.__name__.lstrip("_")
    run.__doc__ = doc
    return run


dce = _pure(_dce, "Removes nodes that no output, update or signature entry depends on.")
cse = _pure(_cse, "Merges nodes computing the same op on the same operands with the same attributes.")
fold_constants = _pure(_fold_constants, "Evaluates ops whose operands are all constants (small results only).")
algebraic = _pure(_algebraic, "x*1, x+0, x-0, x/1, neg(neg x), reshape/transpose chains, (AB)^T = B^T A^T, no-op broadcast/cast.")


def simplify(graph: Graph, max_rounds: int = 100) -> Graph:
    """dce, cse, fold_constants, algebraic and distribute_sums, repeated until none changes the graph."""
    g = graph.copy()
    for _ in range(max_rounds):
        changed = False
        for step in (_dce, _cse, _fold_constants, _algebraic, _distribute_sums):
            changed |= step(g)
        if not changed:
            return g.verify()
    raise RuntimeError(f"simplify did not reach a fixed point in {max_rounds} rounds on graph {graph.name!r}")
