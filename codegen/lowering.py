"""Target-neutral lowering of fused subgraphs: index arithmetic, pointwise and reduction bodies.

A pointwise kernel is a loop over its output's flat index; a reduction kernel is a loop over its
outputs with nested loops over the reduced axes. Either way the body is a list of statements
computing subgraph values at symbolic coordinates (`ember.codegen.indexing`), and what differs
between targets is only how an op, a literal or a cast is spelled. So this module produces the
statements from a target's `Spelling` table (keyed by op, one per target: `cpp.SPELLING`,
`cuda.SPELLING`) and each target's wrapper renders the loop around them.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ember.ir import OPS, Graph

from .indexing import Coord, broadcast_coords, delinearize, linear_c, relinearize

# Ops whose value is computed by a spelled expression (the rest are views, constants and inputs,
# which are index arithmetic and need no spelling).
SPELLED = sorted({name for name, op in OPS.items() if op.kind == "elementwise"} | {"one_hot"})
# Reductions a generated reduction kernel implements; each target's template spells their update.
REDUCTIONS = ("sum", "max", "argmax")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")


@dataclass(frozen=True)
class Spelling:
    """How one target writes expressions: `ops[op]` is a format string over the operand
    expressions ({0}, {1}, ...) with {one}, {zero} (literals of the result type) and {ctype};
    `literal(value, ctype)` writes a constant. Extra keys: "floordiv" (integer div), "lowest"
    (the smallest value of an integer type) and "inf"."""
    name: str
    ops: dict[str, str]
    literal: Callable[[Any, str], str]


# Operators and helpers every C-family target spells alike (C++, CUDA C++); a target's table adds
# its math functions to these. em_max/em_min/em_floordiv are NaN- and sign-correct helpers each
# target's prelude defines.
C_OPERATORS = {
    "neg": "(-{0})", "reciprocal": "({one} / {0})", "relu": "({0} < 0 ? {zero} : {0})", "stop_gradient": "{0}",
    "add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "div": "({0} / {1})",
    "floordiv": "em_floordiv({0}, {1})", "maximum": "em_max({0}, {1})", "minimum": "em_min({0}, {1})",
    "eq": "({0} == {1})", "ne": "({0} != {1})", "lt": "({0} < {1})", "le": "({0} <= {1})", "gt": "({0} > {1})",
    "ge": "({0} >= {1})", "cast": "static_cast<{ctype}>({0})", "where": "({0} ? {1} : {2})",
    "one_hot": "static_cast<{ctype}>({0} == {1})",
}


def c_literal(value: Any, ctype: str) -> str:
    """A C/C++/CUDA literal of `value` as `ctype` (shared by the C-family spellings)."""
    v = np.asarray(value).reshape(()).item()
    if ctype == "bool":
        return "true" if v else "false"
    if ctype in ("float", "double"):
        if math.isnan(v):
            return f"{ctype}(NAN)"
        if math.isinf(v):
            return f"({'-' if v < 0 else ''}{ctype}(INFINITY))"
        text = repr(float(np.float32(v))) if ctype == "float" else repr(float(v))
        return f"{text}f" if ctype == "float" else text
    return f"{ctype}({int(v)})"


class Body:
    """Emits statements computing subgraph values at symbolic coordinates, memoised."""

    def __init__(self, sub: Graph, spelling: Spelling, prefix: str = "v", index_type: str = "int64_t") -> None:
        self.sub = sub
        self.index_type = index_type  # the C type of index temporaries (32-bit where the target's sizes allow)
        self.spelling = spelling
        self.lines: list[str] = []
        self.memo: dict[tuple, str] = {}
        self.count = 0
        self.input_index = {n: int(name[2:]) for name, n in sub.inputs.items()}
        self.core: int | None = None  # reduction core: its value is `red` at the output index
        self.prefix = prefix

    def temp(self, expr: str, ctype: str | None = None) -> str:
        if _IDENTIFIER.fullmatch(expr):  # a name already: no `const T v2 = v1;` copies
            return expr
        ctype = ctype or self.index_type
        self.count += 1
        name = f"{self.prefix}{self.count}"
        self.lines.append(f"const {ctype} {name} = {expr};")
        return name

    def spell(self, key: str, args: list[str], ctype: str) -> str:
        lit = self.spelling.literal
        return self.spelling.ops[key].format(*args, one=lit(1, ctype), zero=lit(0, ctype), ctype=ctype)

    def value(self, n: int, coords: list[Coord]) -> str:
        key = (n, tuple(coords))
        if key in self.memo:
            return self.memo[key]
        sub, op, t = self.sub, self.sub.op(n), self.sub.type(n)
        ctype = t.dtype.ctype
        if n == self.core:
            expr = "red"
        elif n in self.input_index:
            expr = f"in{self.input_index[n]}[{linear_c(coords, t.shape)}]"
        elif op == "constant":
            expr = self.spelling.literal(sub.attrs(n)["value"], ctype)
        elif op == "broadcast_to":
            (o,) = sub.operands(n)
            expr = self.value(o, broadcast_coords(coords, t.shape, sub.type(o).shape))
        elif op == "transpose":
            (o,) = sub.operands(n)
            inner: list[Coord] = [None] * t.rank
            for j, p in enumerate(sub.attrs(n)["perm"]):
                inner[p] = coords[j]
            expr = self.value(o, inner)
        elif op == "reshape":
            (o,) = sub.operands(n)
            expr = self.value(o, relinearize(coords, t.shape, sub.type(o).shape, self.temp))
        elif op == "one_hot":
            (o,) = sub.operands(n)
            label = self.value(o, coords[:-1])
            cls = coords[-1].c() if coords[-1] is not None else "0"
            expr = self.spell("one_hot", [label, cls], ctype)
        elif op == "random_uniform":
            # a function of its own element's row-major index (the Philox counter), whatever
            # view reads it; the operand is the scalar step counter
            (o,) = sub.operands(n)
            at = sub.attrs(n)
            index = self.temp(linear_c(coords, t.shape))
            expr = self.spell(op, [f"{at['seed']}u", f"{at['stream']}u", self.value(o, []), index], ctype)
        elif op in self.spelling.ops:
            operands = sub.operands(n)
            if len(operands) == 1:
                args = [self.value(operands[0], coords)]
            else:  # binary ops and where broadcast their operands
                args = [self.value(o, broadcast_coords(coords, t.shape, sub.type(o).shape)) for o in operands]
            spelled = "floordiv" if op == "div" and not t.dtype.is_float else op
            expr = self.spell(spelled, args, ctype)
        else:
            raise NotImplementedError(f"no {self.spelling.name} spelling for op {op!r} inside a fused kernel")
        name = self.temp(expr, ctype)
        self.memo[key] = name
        return name


@dataclass
class PointwiseLowering:
    numel: int
    body: list[str]
    result: str


def lower_pointwise(sub: Graph, spelling: Spelling, index: str = "i", index_type: str = "int64_t") -> PointwiseLowering:
    """The body computing element `index` (a flat output index) of the subgraph's output."""
    t = sub.type(sub.outputs["out"])
    body = Body(sub, spelling, index_type=index_type)
    result = body.value(sub.outputs["out"], delinearize(index, t.numel, t.shape))
    return PointwiseLowering(t.numel, body.lines, result)


@dataclass
class ReductionLowering:
    op: str                       # sum | max | argmax
    outputs: int                  # number of outputs (the outer loop over `o`)
    reduced: int                  # elements reduced into each output
    loops: list[tuple[str, int]]  # nested reduction loops (variable, trip count), outermost first
    prologue: list[str]           # statements in the innermost loop computing `value`
    value: str
    epilogue: list[str]           # statements after the loops computing `result` from `red`
    result: str
    acc_type: str


def lower_reduction(sub: Graph, core: int, spelling: Spelling, index_type: str = "int64_t") -> ReductionLowering:
    """Loops and bodies of a reduction kernel: prologue at the input index, epilogue at the output's."""
    out = sub.outputs["out"]
    t = sub.type(out)
    op, attrs = sub.op(core), sub.attrs(core)
    (src,) = sub.operands(core)
    in_shape = sub.type(src).shape
    axes = attrs["axes"] if op != "argmax" else (attrs["axis"],)
    kept = tuple(d for i, d in enumerate(in_shape) if i not in axes)
    reduced = tuple(in_shape[i] for i in axes)
    kept_c = iter(delinearize("o", max(1, math.prod(kept)), kept))
    # Adjacent reduced axes share one loop (runs), so the innermost loop walks contiguous memory
    # where the layout allows and the compiler vectorises it; argmax needs one flat counter.
    runs: list[list[int]] = []
    for a in axes:
        if runs and (op == "argmax" or runs[-1][-1] == a - 1):
            runs[-1].append(a)
        else:
            runs.append([a])
    loops, red_coord = [], {}
    for j, run_axes in enumerate(runs):
        shape = tuple(in_shape[a] for a in run_axes)
        var = f"r{j}"
        loops.append((var, math.prod(shape)))
        red_coord.update(zip(run_axes, delinearize(var, max(1, math.prod(shape)), shape)))
    coords = [red_coord[i] if i in axes else next(kept_c) for i in range(len(in_shape))]
    pro = Body(sub, spelling, "p", index_type)
    value = pro.value(src, coords)
    epi = Body(sub, spelling, "e", index_type)
    epi.core = core
    result = epi.value(out, delinearize("o", t.numel, t.shape))
    return ReductionLowering(op, math.prod(kept) if kept else 1, math.prod(reduced) if reduced else 1, loops,
                             pro.lines, value, epi.lines, result, sub.type(src).dtype.ctype)


def max_elements(sub: Graph) -> int:
    """The largest tensor a kernel's subgraph touches: whether 32-bit indices are safe."""
    return max(sub.type(n).numel for n in sub.g)


def reduction_init(lowering: ReductionLowering, spelling: Spelling) -> str:
    """The accumulator's start value: 0 for a sum, the lowest value for max and argmax."""
    acc = lowering.acc_type
    if lowering.op == "sum":
        return spelling.literal(0, acc)
    if acc in ("float", "double"):
        return spelling.literal(-math.inf, acc)
    return spelling.ops["lowest"].format(ctype=acc)
