"""Symbolic index arithmetic for generated loops: coordinates as (var / div) % mod terms.

A loop over a flat index `i` of a tensor of shape S gives coordinates ((i / stride_d) % dim_d);
views (broadcast, transpose, reshape) rearrange or re-linearise them; a contiguous operand's
offset is the linear combination with its own strides. Adjacent terms of one variable merge
(((i/24)%24)*24 + i%24 becomes i%576), so same-shape operands load at plain `i` and the C compiler
sees simple, vectorisable addressing. Shared by the C++ and CUDA renderers.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Callable


@dataclass(frozen=True)
class Term:
    """(var / div) % mod, where mod None means no modulo; `size` is var's range."""
    var: str
    div: int
    mod: int | None
    size: int

    def simplified(self) -> "Term":
        mod = self.mod
        if mod is not None and self.div * mod >= self.size:
            mod = None
        return Term(self.var, self.div, mod, self.size)

    def c(self) -> str:
        t = self.simplified()
        if t.div >= t.size:
            return "0"
        s = t.var if t.div == 1 else f"({t.var} / {t.div})"
        return s if t.mod is None else f"({s} % {t.mod})"


Coord = Term | None  # None: the constant 0 (a broadcast or size-1 axis)


def strides(shape: tuple[int, ...]) -> list[int]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return out[::-1]


def delinearize(var: str, size: int, shape: tuple[int, ...]) -> list[Coord]:
    return [Term(var, st, d, size).simplified() if d != 1 else None for st, d in zip(strides(shape), shape)]


def renamed(coords: list[Coord], var: str, new: str) -> list[Coord]:
    """`coords` with loop variable `var` called `new` (a vector's lane, or its first lane's base)."""
    return [Term(new, c.div, c.mod, c.size) if c is not None and c.var == var else c for c in coords]


def linear_terms(coords: list[Coord], shape: tuple[int, ...]) -> list[tuple[Term, int]]:
    """The row-major offset of `coords` as (term, multiplier) pairs, adjacent terms of a variable merged."""
    terms = sorted(((c.simplified(), st) for c, st in zip(coords, strides(shape)) if c is not None),
                   key=lambda ts: (ts[0].var, ts[0].div))
    merged: list[tuple[Term, int]] = []
    for t, m in terms:
        if merged:
            pt, pm = merged[-1]
            if pt.var == t.var and pt.mod is not None and t.div == pt.div * pt.mod and m == pm * pt.mod:
                mod = None if t.mod is None else pt.mod * t.mod
                merged[-1] = (Term(t.var, pt.div, mod, t.size).simplified(), pm)
                continue
        merged.append((t, m))
    return merged


def linear_c(coords: list[Coord], shape: tuple[int, ...]) -> str:
    """C expression of the row-major offset of `coords` in a contiguous tensor of `shape`."""
    parts = []
    for t, m in linear_terms(coords, shape):
        c = t.c()
        if c != "0":
            parts.append(c if m == 1 else f"{c} * {m}")
    return " + ".join(parts) if parts else "0"


def relinearize(coords: list[Coord], shape: tuple[int, ...], new_shape: tuple[int, ...],
                temp: Callable[[str], str]) -> list[Coord]:
    """Coordinates in `new_shape` of the element at `coords` of `shape` (a reshape of a row-major tensor)."""
    terms = linear_terms(coords, shape)
    size = prod(shape)
    if not terms:
        return [None] * len(new_shape)
    if len(terms) == 1 and terms[0][1] == 1:
        base = terms[0][0]
    else:  # not one clean term: name the flat index and start over from it
        base = Term(temp(linear_c(coords, shape)), 1, None, size)
    out: list[Coord] = []
    for st, d in zip(strides(new_shape), new_shape):
        if d == 1:
            out.append(None)
            continue
        out.append(_split(base, st, d) or Term(temp(base.c()), st, d, size).simplified())
    return out


def _split(base: Term, st: int, d: int) -> Term | None:
    """((v / a) % m / st) % d as one term, when the arithmetic allows it."""
    if base.mod is None:
        return Term(base.var, base.div * st, d, base.size).simplified()
    if base.mod % st:
        return None
    rest = base.mod // st
    if rest % d == 0:
        return Term(base.var, base.div * st, d, base.size).simplified()
    if d % rest == 0:
        return Term(base.var, base.div * st, rest, base.size).simplified()
    return None


def broadcast_coords(coords: list[Coord], shape: tuple[int, ...], operand_shape: tuple[int, ...]) -> list[Coord]:
    """Coordinates into an operand broadcast (NumPy rules) to `shape`."""
    lead = len(shape) - len(operand_shape)
    return [None if d == 1 else coords[lead + i] for i, d in enumerate(operand_shape)]
