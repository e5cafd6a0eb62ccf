"""A sum of a linear combination that holds `a - mean(a)` over the summed axes, without it.

Autodiff writes BatchNorm's mean gradient as one sum over a combination of full-size terms,
`sum(-(dy * g * invstd + 2 * c * (x - mean)))`, where `c` is a per-channel value that comes from
another sum (`sum(dy * g * (x - mean))`). Summed as written, that sum waits for the other: a
second pass over the batch that recomputes (or stores, then reads) the whole expression. But
the sum of `x - mean` over the axes `mean` was taken over is zero, so the second term
contributes nothing (a rounding residue), and PyTorch's formula leaves it out. Without it, and
with the per-channel factors taken outside, the sum is `-invstd * g * sum(dy)`: the bias
gradient's own sum. LayerNorm's backward has the same shape over its last axis.

`distribute_sums` rewrites `sum(e, axes)` where `e` is built from add, sub, neg and
multiplications by factors constant along the summed axes (a per-row value, or a broadcast of
one), and one of its terms is such a centred value (`a - sum(a, axes, keepdims) / count`, as
`functional.mean` writes a mean): that term is dropped, the others summed one by one with their
factors outside. An add or sub is split only where both sides are full-size values of their own
(not a broadcast). Not exact: the dropped term's rounding residue, and the terms summed apart
(the tests bound it against float64).
"""
from __future__ import annotations

import numpy as np

from ember.ir import OPS, Graph

from .autodiff import carry_gradient_tags

#: the most terms one sum is split into (a longer combination stays as it is)
MAX_TERMS = 8

Term = tuple[int, tuple[int, ...], int]  # (full-size base, per-row factors, sign)


def _factor(g: Graph, f: int, shape: tuple[int, ...], axes: tuple[int, ...], dtype) -> bool:
    """Whether `f` broadcasts to `shape` and is constant along every summed axis."""
    t = g.type(f)
    if t.dtype != dtype or t.rank > len(shape):
        return False
    full = (1,) * (len(shape) - t.rank) + tuple(t.shape)
    return all(full[i] == 1 for i in axes) and all(d in (1, shape[i]) for i, d in enumerate(full))


def _after_reduction(g: Graph, n: int, memo: dict[int, bool]) -> bool:
    """Whether node n's value depends on a reduction."""
    stack, order = [n], []
    while stack:
        m = stack.pop()
        if m in memo:
            continue
        memo[m] = False  # provisional, set below once its operands are known
        order.append(m)
        stack.extend(o for o in g.operands(m) if o not in memo)
    for m in reversed(order):
        memo[m] = OPS[g.op(m)].kind == "reduction" or any(memo.get(o, False) for o in g.operands(m))
    return memo[n]


def _terms(g: Graph, e: int, shape: tuple[int, ...], axes: tuple[int, ...], memo: dict[int, bool]) -> list[Term]:
    """`e` as a signed sum of full-size bases times factors (a single term: e itself). Only a
    factor computed from a reduction is taken out (a parameter's stays in its term, so the term's
    sum is not merged with a parameter gradient's own sum, whose update it would have to wait for)."""
    op, dtype = g.op(e), g.type(e).dtype
    full = lambda n: g.type(n).shape == shape and g.type(n).dtype == dtype  # noqa: E731
    if op in ("add", "sub"):
        a, b = g.operands(e)
        # x - mean (a per-row value spread by a broadcast) stays one term: split, its two sums
        # would be large and nearly equal
        if full(a) and full(b) and "broadcast_to" not in (g.op(a), g.op(b)):
            right = _terms(g, b, shape, axes, memo)
            if op == "sub":
                right = [(base, fs, -sign) for base, fs, sign in right]
            return _terms(g, a, shape, axes, memo) + right
    elif op == "neg":
        return [(base, fs, -sign) for base, fs, sign in _terms(g, g.operands(e)[0], shape, axes, memo)]
    elif op == "mul":
        a, b = g.operands(e)
        for x, f in ((a, b), (b, a)):
            if full(f) and g.op(f) == "broadcast_to":  # a per-row value spread over the rows
                f = g.operands(f)[0]
            if full(x) and not full(f) and _factor(g, f, shape, axes, dtype) and _after_reduction(g, f, memo):
                return [(base, fs + (f,), sign) for base, fs, sign in _terms(g, x, shape, axes, memo)]
    return [(e, (), 1)]


def _centred(g: Graph, base: int, axes: tuple[int, ...]) -> bool:
    """Whether `base` is `a - mean(a)` over exactly `axes` (`a - sum(a, axes, keepdims) / count`,
    as `functional.mean` writes it): its sum over `axes` is zero."""
    if g.op(base) != "sub":
        return False
    a, m = g.operands(base)
    if g.op(m) != "div":
        return False
    s, count = g.operands(m)
    if g.op(s) != "sum" or g.operands(s)[0] != a or tuple(g.attrs(s)["axes"]) != axes or not g.attrs(s)["keepdims"]:
        return False
    if g.op(count) != "constant" or g.type(count).numel != 1:
        return False
    shape = g.type(a).shape
    return float(np.asarray(g.attrs(count)["value"]).reshape(())) == float(np.prod([shape[i] for i in axes]))


def _rewrite(g: Graph, s: int, memo: dict[int, bool]) -> int | None:
    (e,) = g.operands(s)
    t, attrs = g.type(e), g.attrs(s)
    if not t.dtype.is_float:
        return None
    axes, keepdims = tuple(attrs["axes"]), bool(attrs["keepdims"])
    terms = _terms(g, e, tuple(t.shape), axes, memo)
    kept = [term for term in terms if not _centred(g, term[0], axes)]
    if len(terms) > MAX_TERMS or not kept or len(kept) == len(terms):
        return None
    terms = kept
    where = g.provenance(s)
    out_shape = g.type(s).shape
    total = None
    for base, factors, sign in terms:
        value = g.add("sum", [base], **where, axes=axes, keepdims=keepdims)
        for f in factors:
            full = (1,) * (t.rank - g.type(f).rank) + tuple(g.type(f).shape)
            like_sum = full if keepdims else tuple(d for i, d in enumerate(full) if i not in axes)
            if g.type(f).shape != like_sum:
                f = g.add("reshape", [f], **where, shape=like_sum)
            value = g.add("mul", [value, f], **where)
        if g.type(value).shape != out_shape:  # a factor of size 1 everywhere left a smaller rank
            value = g.add("broadcast_to", [value], **where, shape=out_shape)
        if total is None:
            total = value if sign > 0 else g.add("neg", [value], **where)
        else:
            total = g.add("add" if sign > 0 else "sub", [total, value], **where)
    return total


def _distribute_sums(g: Graph) -> bool:
    """In place: every sum the rule applies to replaced by its terms' sums; whether any was."""
    memo: dict[int, bool] = {}
    changed = False
    for s in [n for n in g.topo_order() if g.op(n) == "sum"]:
        new = _rewrite(g, s, memo)
        if new is not None:
            g.replace_uses(s, new)
            carry_gradient_tags(g, s, new)
            changed = True
    return changed


def distribute_sums(graph: Graph) -> Graph:
    """Sums holding a centred term `a - mean(a)` over their own axes, without it, the other terms
    summed one by one with factors computed from reductions outside (see the module doc)."""
    g = graph.copy()
    _distribute_sums(g)
    return g.verify()
