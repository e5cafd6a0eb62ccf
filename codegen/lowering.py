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
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import numpy as np

from ember.ir import OPS, DType, Graph
from ember.ir.dtypes import as_values

from .indexing import Coord, broadcast_coords, delinearize, linear_c, linear_terms, relinearize, renamed

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
    (the smallest value of an integer type) and "inf".

    A dtype computed in another (bfloat16: stored as 16 bits, computed in float32; see
    `ember.ir.dtypes`) has its C type in memory in `storage` and three more keys:
    "load:<dtype>" (memory -> a float value), "round:<dtype>" (a float value -> the nearest value
    of the dtype, still a float: what every op producing it ends with, as the interpreter rounds
    every such node) and "store:<dtype>" (a float value -> memory)."""
    name: str
    ops: dict[str, str]
    literal: Callable[[Any, str], str]
    storage: dict[str, str] = field(default_factory=dict)

    def ctype(self, dtype: DType) -> str:
        """The C type of `dtype`'s values in memory (buffers, kernel parameters)."""
        return self.storage.get(dtype.name, dtype.ctype)


#: the C type a value of a dtype computed in another is computed in (bfloat16: float)
COMPUTE_CTYPES = {"float32": "float", "float64": "double"}


def value_ctype(dtype: DType) -> str:
    """The C type of `dtype`'s values in generated expressions (bfloat16: float)."""
    return COMPUTE_CTYPES[dtype.compute.name] if dtype.compute_name else dtype.ctype


def narrow(dtype: DType) -> bool:
    """Whether `dtype` is held in fewer bits than it is computed in (bfloat16)."""
    return dtype.compute_name is not None


def has_narrow(graph: Graph) -> bool:
    """Whether any value of the graph or of its kernels is of a narrow dtype (bfloat16)."""
    return any(narrow(graph.type(n).dtype) or (graph.op(n) == "fused" and has_narrow(graph.attrs(n)["graph"]))
               for n in graph.g)


def stored(spelling: Spelling, dtype: DType, value: str) -> str:
    """`value` (an expression of `value_ctype(dtype)`) as stored in a buffer of `dtype`."""
    return spelling.ops[f"store:{dtype.name}"].format(value) if narrow(dtype) else value


# ops whose result is exactly representable in a narrow dtype whenever their operands are (a
# select, a sign, a max): no rounding after them
_EXACT = frozenset({"relu", "neg", "abs", "maximum", "minimum", "where", "stop_gradient", "one_hot"})


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
    """Emits statements computing subgraph values at symbolic coordinates, memoised.

    With `levels` (loop variable -> nesting depth, 0 outermost), each statement goes to the
    shallowest loop it can run in: the deepest level of the loop variables and temporaries it
    names. So a per-channel operand of a kernel looping over rows and then over a row's
    contiguous elements is loaded, and anything computed from it, once per row (`by_level`).
    `cores` maps reduction nodes to the variables holding their results, each with the flat
    index it may be read at (None: any), which is checked."""

    def __init__(self, sub: Graph, spelling: Spelling, prefix: str = "v", index_type: str = "int64_t",
                 levels: dict[str, int] | None = None, extent: "Extent | None" = None,
                 lanes: tuple[str, int] | None = None) -> None:
        self.sub = sub
        # (loop variable, V): the loop steps by V and lane j of a step is coordinate `{var}_{j}`;
        # an input contiguous along it, at offsets the vector's size divides, is read as
        # vectors of up to 16 bytes (`vector_loads` of them), its lanes taken from them
        self.lanes = lanes
        self.lane_of = {f"{lanes[0]}_{j}": j for j in range(lanes[1])} if lanes else {}
        self.vector_loads = 0
        self.extent = extent  # the kernel's runtime extent: constants that are multiples of it spelled from it
        self.index_type = index_type  # the C type of index temporaries (32-bit where the target's sizes allow)
        self.spelling = spelling
        self.levels = dict(levels or {})
        if lanes and lanes[0] in self.levels:
            self.levels.update({v: self.levels[lanes[0]] for v in self.lane_of})
        self.by_level: list[list[str]] = [[] for _ in range(max(self.levels.values(), default=0) + 1)]
        self.level_of: dict[str, int] = {}
        self.memo: dict[tuple, str] = {}
        self.count = 0
        self.input_index = {n: int(name[2:]) for name, n in sub.inputs.items()}
        self.core: int | None = None  # a contraction's value in its epilogue: `red` at the output index
        self.cores: dict[int, tuple[str, str | None]] = {}
        self.prefix = prefix

    @property
    def lines(self) -> list[str]:
        """Every statement, outermost level first (an order that respects their dependencies)."""
        return [line for level in self.by_level for line in level]

    def level(self, expr: str) -> int:
        return max((self.levels.get(w, self.level_of.get(w, 0)) for w in _IDENTIFIER.findall(expr)), default=0)

    def temp(self, expr: str, ctype: str | None = None) -> str:
        if _IDENTIFIER.fullmatch(expr):  # a name already: no `const T v2 = v1;` copies
            return expr
        ctype = ctype or self.index_type
        self.count += 1
        name = f"{self.prefix}{self.count}"
        level = self.level(expr)
        self.by_level[level].append(f"const {ctype} {name} = {expr};")
        self.level_of[name] = level
        return name

    def spell(self, key: str, args: list[str], ctype: str) -> str:
        lit = self.spelling.literal
        return self.spelling.ops[key].format(*args, one=lit(1, ctype), zero=lit(0, ctype), ctype=ctype)

    def _vector_lane(self, n: int, coords: list[Coord]) -> str | None:
        """Input n's element at lane coordinates, taken from a vector load of its lanes, where the
        target spells one for its dtype and the offset walks the lane variable with stride 1 and
        every other term keeps the vector aligned; else None (a load of its own)."""
        if not self.lanes:
            return None
        t = self.sub.type(n)
        var, step = self.lanes
        width = min(step, 16 // t.dtype.itemsize)
        vtype = self.spelling.ops.get(f"vtype:{t.dtype.name}:{width}")
        terms = linear_terms(coords, t.shape)
        walking = [(term, m) for term, m in terms if term.var in self.lane_of]
        if vtype is None or len(walking) != 1:
            return None
        (term, m), = walking
        if term.div != 1 or term.mod is not None or m != 1 or any(k % width for other, k in terms if other is not term):
            return None
        j = self.lane_of[term.var]
        offset = linear_c(renamed(coords, term.var, var), t.shape) + (f" + {j // width * width}" if j >= width else "")
        key = ("vector", n, offset)
        if key not in self.memo:
            self.vector_loads += 1
            load = self.spelling.ops["vector"].format(f"in{self.input_index[n]}", offset, vtype)
            self.memo[key] = self.temp(load, vtype)
        return self.spelling.ops[f"lane:{t.dtype.name}:{j % width}"].format(self.memo[key])

    def value(self, n: int, coords: list[Coord]) -> str:
        key = (n, tuple(coords))
        if key in self.memo:
            return self.memo[key]
        sub, op, t = self.sub, self.sub.op(n), self.sub.type(n)
        ctype = value_ctype(t.dtype)
        rounded = True  # whether `expr` holds a value of t's dtype already (else it is rounded)
        if n in self.cores:
            expr, at = self.cores[n]
            if at is not None and linear_c(coords, t.shape) != at:
                raise NotImplementedError(f"%{n} {op}: a fused kernel reads this reduction at index "
                                          f"{linear_c(coords, t.shape)}, not at its output's ({at})")
            rounded = op != "sum"  # a narrow sum accumulates in float; a max is one of its values
        elif n == self.core:
            expr = "red"  # a contraction's template rounds its value before the epilogue
        elif n in self.input_index and (lane := self._vector_lane(n, coords)) is not None:
            expr = lane  # a float already (a bfloat16 lane widened)
        elif n in self.input_index:
            expr = f"in{self.input_index[n]}[{linear_c(coords, t.shape)}]"
            if narrow(t.dtype):
                expr = self.spelling.ops[f"load:{t.dtype.name}"].format(expr)
        elif op == "constant":
            value = sub.attrs(n)["value"]
            if narrow(t.dtype):
                expr = self.spelling.literal(as_values(value, t.dtype), ctype)
            else:
                expr = (self.extent.spell(value, ctype, self.spelling) if self.extent is not None else None) \
                    or self.spelling.literal(value, ctype)
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
            rounded = op in _EXACT
        else:
            raise NotImplementedError(f"no {self.spelling.name} spelling for op {op!r} inside a fused kernel")
        if narrow(t.dtype) and not rounded:
            expr = self.spelling.ops[f"round:{t.dtype.name}"].format(expr)
        name = self.temp(expr, ctype)
        self.memo[key] = name
        return name


@dataclass(frozen=True)
class Extent:
    """A size a kernel takes at run time (a parameter named `var`) instead of holding it: the
    leading axis of its loop domain (for the step's activations, the batch), `value` in this
    step. Loop bounds are written as multiples of it, and so are the kernel's float constants
    that are, at this step, a count c = L*m (m one of `factors`) or 1/c or c/(c-1): a mean over
    the batch and some other axes, its reciprocal, an unbiased variance's correction (BatchNorm).
    The code computes those from the parameter, so the kernel of another batch size is the same
    text. Each spelling is checked to give the literal's exact value at this step, so the kernel
    is right for the step it is rendered for whichever way a value is read; reading a constant
    the way the kernel of another batch size reads it only decides whether the two share an
    object (the code's hash says whether they do)."""
    value: int
    var: str = "n"
    #: the multipliers m of the counts c = L*m read as counts over the batch
    factors: frozenset[int] = frozenset({1})
    #: counts that do not involve the batch: a constant equal to one of them (or its reciprocal or
    #: correction) stays a literal even where it is also L*m (a mean over H*W = 49 at L = 7)
    free: frozenset[int] = frozenset()

    @classmethod
    def pointwise(cls, shape: tuple[int, ...], var: str = "n") -> "Extent | None":
        """The extent of a pointwise loop over `shape` (None for a scalar). Without the axes a
        constant came from, counts are read by the layouts' conventions: the axes after the
        second (NCHW's spatial ones, suffix products) count with the batch (BatchNorm: N*H*W)
        or alone (an average pool: H*W); a count that takes in the second axis (C*H*W at L = C)
        is read as one over the batch."""
        if not shape:
            return None
        spatial = frozenset(math.prod(shape[j:]) for j in range(2, len(shape)))
        return cls(shape[0], var, spatial | {1}, spatial)

    @classmethod
    def reduction(cls, shape: tuple[int, ...], axes: tuple[int, ...], var: str = "n") -> "Extent | None":
        """The extent of a reduction of an operand of `shape` over `axes` (None for a scalar):
        where the leading axis is reduced, the counts over the batch are those of the reduced
        axes (a mean of them); where it is kept, the batch alone (a loss's mean over the batch
        whose gradient a per-sample kernel computes), unless the reduced axes count the same."""
        if not shape:
            return None
        reduced = math.prod(shape[a] for a in axes if a != 0)
        if 0 not in axes:
            return cls(shape[0], var, frozenset({1}), frozenset({reduced}))
        return cls(shape[0], var, frozenset({1, reduced}))

    def times(self, count: int) -> str:
        """`count` (a multiple of the extent) as an expression of the parameter."""
        if count % self.value:
            raise ValueError(f"{count} is no multiple of the extent {self.value}")
        k = count // self.value
        return self.var if k == 1 else f"{self.var} * {k}"

    def spell(self, value: Any, ctype: str, spelling: Spelling) -> str | None:
        """`value` as an expression of the parameter where it is c, 1/c or c/(c-1) for a count
        c = L*m over the batch (see the class); None otherwise. L = 1 spells nothing: every whole
        number would match."""
        v = np.asarray(value)
        if ctype not in ("float", "double") or v.size != 1 or self.value < 2 or not self.factors:
            return None
        dt = np.float32 if ctype == "float" else np.float64
        x = dt(v.reshape(()).item())
        if not np.isfinite(x) or x <= 0:
            return None

        def reads(c: int) -> bool:
            return x == dt(c) or x == dt(1) / dt(c) or (c > 1 and x == dt(c) / dt(c - 1))

        if any(reads(c) for c in self.free):
            return None
        as_float = f"static_cast<{ctype}>({{}})"
        for m in sorted(self.factors):
            c = as_float.format(self.times(self.value * m))
            count = self.value * m
            if x == dt(count):
                return c
            if x == dt(1) / dt(count):
                return f"({spelling.literal(1, ctype)} / {c})"
            if count > 1 and x == dt(count) / dt(count - 1):
                return f"({c} / {as_float.format(self.times(count) + ' - 1')})"
        return None


def bound(count: int, extent: Extent | None) -> str:
    """A loop bound: a multiple of the runtime extent where there is one."""
    return extent.times(count) if extent is not None and count % extent.value == 0 else str(count)


def generated_extent(sub: Graph, kind: str, core: int | None = None, fixed: bool = False) -> Extent | None:
    """The size a generated kernel takes at run time: the leading axis of its loop domain (a
    pointwise kernel's output, a reduction's operand), which for the step's activations is the
    batch; None for a scalar domain, or where the domain is `fixed` (a pointwise kernel that
    writes parameters and state alone: their sizes, which no batch size changes). Its value is
    an argument of the kernel (the CPU's `extents`, the last of a CUDA launch's)."""
    if fixed:
        return None
    if kind == "pointwise":
        return Extent.pointwise(sub.type(sub.outputs["out"]).shape)
    return Extent.reduction(sub.type(sub.operands(core)[0]).shape, reduced_axes(sub, core))


@dataclass
class PointwiseLowering:
    numel: int
    body: list[str]                  # every statement of one element (a flat loop over the index)
    result: str                      # the value of "out"
    results: list[tuple[str, str]]   # (output, value) of every output, "out" first
    # the loop structure, when `rows` was given: `rows` rows of `numel // rows` contiguous
    # elements, `hoisted` computed once per row (row variable "p"), `inner` per element ("j")
    rows: int = 1
    hoisted: list[str] = field(default_factory=list)
    inner: list[str] = field(default_factory=list)
    stores: list[tuple[str, str, str]] = field(default_factory=list)  # (output, flat index, value)
    # with `vector` (V lanes a step, the rows form): the statements storing each output's V
    # values as vectors (`vector_stores`) take the place of `stores`
    vector: int = 0
    vector_stores: list[str] = field(default_factory=list)


def _split_coords(shape: tuple[int, ...], rows: int) -> list[Coord]:
    """Coordinates of `shape` under a loop over `rows` rows ("p") of contiguous elements ("j")."""
    total = math.prod(shape)
    acc, k = 1, len(shape)
    while k > 0 and acc * shape[k - 1] <= total // rows:
        acc *= shape[k - 1]
        k -= 1
    if acc * rows != total:
        raise ValueError(f"{rows} rows do not split shape {shape} between its axes")
    return delinearize("p", rows, shape[:k]) + delinearize("j", acc, shape[k:])


def lower_pointwise(sub: Graph, spelling: Spelling, index: str = "i", index_type: str = "int64_t",
                    rows: int = 1, extent: Extent | None = None, vector: int = 0) -> PointwiseLowering:
    """The body computing element `index` (a flat output index) of every output of the subgraph;
    with `rows` > 1, as a loop over rows ("p", a product of leading axes) and over each row's
    contiguous elements ("j"), statements that depend on the row alone hoisted out of the inner loop.
    With `vector` (V > 1 dividing the row; any `rows`), the rows form computing V consecutive
    elements of a row at once (lanes `j_0` .. `j_{V-1}`, `j` a multiple of V): inputs contiguous
    along the row read and every output written as vectors of up to 16 bytes."""
    t = sub.type(sub.outputs["out"])
    if vector:
        if any(sub.type(n).shape != t.shape for n in sub.outputs.values()) or (t.numel // rows) % vector:
            raise ValueError(f"{vector} lanes do not divide the rows of kernel {sub.name}")
        body = Body(sub, spelling, index_type=index_type, levels={"p": 0, "j": 1}, extent=extent, lanes=("j", vector))
        coords = _split_coords(t.shape, rows)
        lanes = [renamed(coords, "j", f"j_{k}") for k in range(vector)]
        results = [(k, [body.value(n, lc) for lc in lanes]) for k, n in sub.outputs.items()]
        flat = f"p * {t.numel // rows} + j"
        stores = [line for k, values in results for line in _vector_stores(spelling, sub, k, flat, values)]
        return PointwiseLowering(t.numel, body.lines, results[0][1][0], [(k, v[0]) for k, v in results], rows,
                                 body.by_level[0], body.by_level[1], [], vector, stores)
    if rows > 1:
        if any(sub.type(n).shape != t.shape for n in sub.outputs.values()):
            raise ValueError("a pointwise kernel loops over rows only when its outputs have one shape")
        body = Body(sub, spelling, index_type=index_type, levels={"p": 0, "j": 1}, extent=extent)
        coords = _split_coords(t.shape, rows)
        results = [(k, body.value(n, coords)) for k, n in sub.outputs.items()]
        flat = f"p * {t.numel // rows} + j"
        return PointwiseLowering(t.numel, body.lines, results[0][1], results, rows, body.by_level[0],
                                 body.by_level[1], [(k, flat, _stored(spelling, sub, k, v)) for k, v in results])
    body = Body(sub, spelling, index_type=index_type, extent=extent)
    results = []
    for k, n in sub.outputs.items():
        u = sub.type(n)
        if u.numel != t.numel:
            raise ValueError(f"pointwise output {k!r} has {u.numel} elements, 'out' {t.numel}")
        results.append((k, body.value(n, delinearize(index, u.numel, u.shape))))
    return PointwiseLowering(t.numel, body.lines, results[0][1], results, 1, [], body.lines,
                             [(k, index, _stored(spelling, sub, k, v)) for k, v in results])


def _stored(spelling: Spelling, sub: Graph, output: str, value: str) -> str:
    return stored(spelling, sub.type(sub.outputs[output]).dtype, value)


def _vector_stores(spelling: Spelling, sub: Graph, output: str, at: str, values: list[str]) -> list[str]:
    """Statements storing an output's consecutive `values` from flat index `at` (a multiple of
    their count) as vectors of up to 16 bytes (bfloat16 values packed two a word)."""
    dtype = sub.type(sub.outputs[output]).dtype
    width = min(len(values), 16 // dtype.itemsize)
    lines = []
    for first in range(0, len(values), width):
        chunk = values[first:first + width]
        if narrow(dtype):  # two a 32-bit word, the first in its low half
            chunk = [spelling.ops[f"pack:{dtype.name}"].format(a, b) for a, b in zip(chunk[::2], chunk[1::2])]
        vtype = spelling.ops[f"vtype:{dtype.name}:{width}"]
        offset = at + (f" + {first}" if first else "")
        lines.append(spelling.ops["vector_store"].format(output, offset, vtype, ", ".join(chunk)))
    return lines


def hoisting_rows(sub: Graph, spelling: Spelling, min_inner: int) -> int:
    """The row count that hoists the most input reads out of a pointwise kernel's inner loop
    (the per-channel operands of a normalisation: rows of H*W under N*C), with rows of at least
    `min_inner` elements; 1 (one flat loop) when no split hoists anything."""
    t = sub.type(sub.outputs["out"])
    if any(sub.type(n).shape != t.shape for n in sub.outputs.values()):
        return 1
    best, best_rows = 0, 1
    for k in range(1, len(t.shape)):
        rows = math.prod(t.shape[:k])
        inner = t.numel // max(rows, 1)
        if rows < 2 or inner < min_inner:
            continue
        low = lower_pointwise(sub, spelling, rows=rows)
        hoisted = sum(line.count("[") for line in low.hoisted)
        if hoisted > best or (hoisted == best and hoisted and rows < best_rows):
            best, best_rows = hoisted, rows
    return best_rows


@dataclass
class Accumulator:
    op: str      # sum | max | argmax
    value: str   # the expression accumulated in the innermost loop
    acc: str     # the accumulator variable
    red: str     # the variable holding the result after the loops (what later statements read)
    ctype: str
    init: str
    # op "m2" (`lower_reduction(moments=True)`): the squared deviations of `value` from their
    # mean (Welford in the loop, Chan's formula where partial results meet), each value taken
    # relative to the variable named here, the output's first value, so that the running and
    # merged means are small however far from zero the values are; its sum beside it stays a
    # plain sum (an outlying first value would cost the sum its precision)
    shift: str = ""
    # with a vector walk (`lower_reduction(vector=V)`): the value at each of the V lanes of a
    # step of the innermost loop (`value` is the first's)
    lanes: list[str] = field(default_factory=list)


@dataclass
class ReductionPass:
    """One walk over the reduced elements: its accumulators, the statements before its loops
    (per output: values computed from earlier passes' results) and inside each loop."""
    pre: list[str]
    levels: list[list[str]]  # statements inside loop d, d = 0 .. len(loops) - 1
    accs: list[Accumulator]


@dataclass
class ReductionLowering:
    outputs: int                      # number of outputs (the outer loop over `o`)
    reduced: int                      # elements reduced into each output
    loops: list[tuple[str, int]]      # nested reduction loops (variable, trip count), outermost first
    passes: list[ReductionPass]       # in order: a pass may read the results of earlier ones
    epilogue: list[str]               # statements after the passes computing the results
    results: list[tuple[str, str]]    # (output, value at `o`), "out" first
    vector: int = 0                   # lanes a step of the innermost loop walks (0: one element a step)

    @property
    def accs(self) -> list[Accumulator]:
        return [a for p in self.passes for a in p.accs]

    @property
    def op(self) -> str:
        """The reduction every accumulator does ("sum", "max", "argmax"), or "mixed"."""
        ops = {a.op for a in self.accs}
        return ops.pop() if len(ops) == 1 else "mixed"

    @property
    def acc_type(self) -> str:
        """The one accumulator type of the kernel, or "" when they differ."""
        types = {a.ctype for a in self.accs}
        return types.pop() if len(types) == 1 else ""


def _passes(sub: Graph, cores: list[int], pairs: dict[int, int]) -> list[list[int]]:
    """Reductions grouped into passes: a reduction that reads another's result runs after it,
    except a centred sum of squares of `pairs`, which runs beside its mean's sum. A pair stays
    in `pairs` only where no other reduction reads either of them and theirs is the last pass
    (the kernel that combines their partials is theirs)."""
    for c2, c1 in list(pairs.items()):
        if any(d not in (c1, c2) and nx.has_path(sub.g, c, d) for c in (c1, c2) for d in cores):
            del pairs[c2]
    while True:
        stage: dict[int, int] = {}
        for c in cores:  # cores in topological order
            before = nx.ancestors(sub.g, c)
            stage[c] = 1 + max((stage[d] for d in cores if d in before and d != pairs.get(c)), default=-1)
        last = max(stage.values())
        late = [c2 for c2, c1 in pairs.items() if stage[c1] != last]
        if not late:
            return [[c for c in cores if stage[c] == s] for s in range(last + 1)]
        for c2 in late:
            del pairs[c2]


def _constant(sub: Graph, n: int) -> float | None:
    if sub.op(n) != "constant" or sub.type(n).numel != 1:
        return None
    return float(np.asarray(as_values(sub.attrs(n)["value"], sub.type(n).dtype)).reshape(-1)[0])  # bfloat16: bits


def _mean_of(sub: Graph, n: int, cores: list[int], count: int) -> int | None:
    """The sum core whose mean node n is (its value divided by `count`, or times 1/count,
    through reshapes and broadcasts), else None."""
    while sub.op(n) in ("reshape", "broadcast_to"):
        (n,) = sub.operands(n)
    if sub.op(n) not in ("div", "mul") or len(sub.operands(n)) != 2:
        return None
    a, b = sub.operands(n)
    if sub.op(n) == "mul" and a not in cores:
        a, b = b, a
    scale = _constant(sub, b)
    if a not in cores or sub.op(a) != "sum" or scale is None:
        return None
    if sub.op(n) == "div":
        return a if scale == count else None
    return a if math.isclose(scale * count, 1.0, rel_tol=1e-6) else None


def centered_squares(sub: Graph, cores: list[int]) -> dict[int, int]:
    """{c2: c1} for each sum c2 of squared deviations from another sum's mean, c2 = sum((y - c1 / n)^2)
    with c1 = sum(y) over the same n elements: a variance (BatchNorm's, LayerNorm's), whose two
    reductions may be accumulated in one walk of y (`lower_reduction(moments=True)`)."""
    pairs: dict[int, int] = {}
    for c2 in cores:
        if sub.op(c2) != "sum":
            continue
        (sq,) = sub.operands(c2)
        if sub.op(sq) != "mul" or len(set(sub.operands(sq))) != 1:
            continue
        (dev,) = set(sub.operands(sq))
        if sub.op(dev) != "sub":
            continue
        y, mean = sub.operands(dev)
        count = math.prod(sub.type(y).shape[a] for a in reduced_axes(sub, c2))
        c1 = _mean_of(sub, mean, cores, count)
        # the deviations and their squares computed wide (a narrow one is rounded, which one walk skips)
        wide = all(sub.type(n).dtype.is_float and not narrow(sub.type(n).dtype) for n in (dev, sq))
        if c1 is not None and sub.operands(c1) == [y] and sub.type(y).shape == sub.type(dev).shape \
                and reduced_axes(sub, c1) == reduced_axes(sub, c2) and sub.type(y).dtype.is_float and wide:
            pairs[c2] = c1
    return pairs


def lower_reduction(sub: Graph, core: int, spelling: Spelling, index_type: str = "int64_t",
                    extent: Extent | None = None, columns: bool = False, moments: bool = False,
                    vector: int = 0) -> ReductionLowering:
    """Loops and bodies of a reduction kernel: each reduction of the subgraph (several, in a kernel
    with several outputs, over one domain) accumulated at the input index, in as few passes as their
    dependencies allow; the outputs computed from the results at the output index (`o`). With
    `columns` (one loop over leading axes, the outputs the contiguous rest), the output loop is
    the innermost: a pass's `pre` holds the statements of a row (the reduced loop's variable
    alone) and its one level those of an element of the row. With `moments` (for a template that
    knows op "m2"), a centred sum of squares (`centered_squares`) is accumulated in its mean's
    pass, as an "m2" accumulator of the sum's values: one walk of the values, not two. With
    `vector` (V > 1, for a template that walks the innermost loop V elements a step), each
    accumulator has its values at the V lanes, the inputs contiguous along the loop read as
    vectors; where the loop's length is not a multiple of V or no input is read as vectors, the
    lowering is the scalar one (`vector` 0)."""
    cores = [n for n in sub.topo_order() if sub.op(n) in REDUCTIONS]
    if core not in cores:
        raise ValueError(f"%{core} is not a reduction of kernel {sub.name}")
    op = sub.op(core)
    in_shape = sub.type(sub.operands(core)[0]).shape
    axes = reduced_axes(sub, core)
    for c in cores:
        if sub.type(sub.operands(c)[0]).shape != in_shape or reduced_axes(sub, c) != axes \
                or (len(cores) > 1 and sub.op(c) == "argmax"):
            raise NotImplementedError(f"kernel {sub.name}: reductions over different domains (or an argmax "
                                      f"among others) cannot share one kernel")
    kept = tuple(d for i, d in enumerate(in_shape) if i not in axes)
    reduced = tuple(in_shape[i] for i in axes)
    outputs = math.prod(kept) if kept else 1
    kept_c = iter(delinearize("o", max(1, outputs), kept))
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
    if columns and (len(loops) != 1 or tuple(axes) != tuple(range(len(axes)))):
        raise ValueError(f"kernel {sub.name}: columns need one loop over the leading axes, not axes {tuple(axes)}")
    levels = {loops[0][0]: 0, "o": 1} if columns else {"o": 0} | {var: d + 1 for d, (var, _) in enumerate(loops)}
    single = len(cores) == 1
    red_of = {c: "red" if single else f"red{k}" for k, c in enumerate(cores)}
    done: dict[int, tuple[str, str | None]] = {}
    passes = []
    pairs = centered_squares(sub, cores) if moments else {}
    walk = vector > 1 and not columns and len(loops) > 1 and loops[-1][1] % vector == 0 and op != "argmax"
    lanes = (loops[-1][0], vector) if walk else None
    lane_coords = [renamed(coords, loops[-1][0], f"{loops[-1][0]}_{j}") for j in range(vector)] if walk else [coords]
    vector_loads = 0
    for s, group in enumerate(_passes(sub, cores, pairs)):
        body = Body(sub, spelling, "p" if single else f"p{s}_", index_type, levels, extent, lanes)
        body.cores = dict(done)
        accs = []
        for c in group:
            (src,) = sub.operands(c)
            ctype = value_ctype(sub.type(src).dtype)
            acc = "acc" if single else f"acc{cores.index(c)}"
            kind, shift = sub.op(c), ""
            if c in pairs:  # the values of its mean's sum, not the squares of their deviations
                (src,) = sub.operands(pairs[c])
                kind, shift = "m2", body.value(src, [None if i in axes else x for i, x in enumerate(coords)])
            values = [body.value(src, lc) for lc in lane_coords]
            accs.append(Accumulator(kind, values[0], acc, red_of[c], ctype, init_value("sum" if kind == "m2" else kind,
                                    ctype, spelling), shift, values if walk else []))
        vector_loads += body.vector_loads
        passes.append(ReductionPass(body.by_level[0], body.by_level[1:], accs))
        done.update({c: (red_of[c], "o" if outputs > 1 else None) for c in group})
    if walk and not vector_loads:  # nothing contiguous along the loop: one element a step
        return lower_reduction(sub, core, spelling, index_type, extent, columns, moments)
    epi = Body(sub, spelling, "e", index_type, extent=extent)
    epi.cores = done
    results = []
    for k, n in sub.outputs.items():
        t = sub.type(n)
        if t.numel != outputs:
            raise NotImplementedError(f"kernel {sub.name}: output {k!r} has {t.numel} elements, not one per "
                                      f"reduction output ({outputs})")
        results.append((k, stored(spelling, t.dtype, epi.value(n, delinearize("o", t.numel, t.shape)))))
    return ReductionLowering(outputs, math.prod(reduced) if reduced else 1, loops, passes, epi.lines, results,
                             vector if walk else 0)


def reduced_axes(sub: Graph, n: int) -> tuple[int, ...]:
    """The axes reduction node n reduces (an argmax its one axis)."""
    attrs = sub.attrs(n)
    return tuple(attrs["axes"]) if sub.op(n) != "argmax" else (attrs["axis"],)


def column_sum(low: ReductionLowering, sub: Graph, core: int, min_outputs: int) -> bool:
    """Whether reduction `core` (lowered as `low`) is a column sum, which both targets may run
    row by row (a row's contiguous outputs side by side): one pass of float sums over the leading
    axes (one loop) into the contiguous rest, at least `min_outputs` of them. A bias's or a
    normalisation's parameter gradient over a [rows, features] activation is one."""
    axes, rank = reduced_axes(sub, core), sub.type(sub.operands(core)[0]).rank
    return (len(low.loops) == 1 and axes == tuple(range(len(axes))) and len(axes) < rank and len(low.passes) == 1
            and all(a.op == "sum" and a.ctype == "float" for a in low.accs) and low.outputs >= min_outputs)


def max_elements(sub: Graph) -> int:
    """The largest tensor a kernel's subgraph touches: whether 32-bit indices are safe."""
    return max(sub.type(n).numel for n in sub.g)


def init_value(op: str, ctype: str, spelling: Spelling) -> str:
    """An accumulator's start value: 0 for a sum, the lowest value for max and argmax."""
    if op == "sum":
        return spelling.literal(0, ctype)
    if ctype in ("float", "double"):
        return spelling.literal(-math.inf, ctype)
    return spelling.ops["lowest"].format(ctype=ctype)
