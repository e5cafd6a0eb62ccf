"""C++ rendering of a planned graph: one translation unit per step with an `ember_step` entry.

Reads only what the passes recorded on the graph: the `fused` groups (their subgraphs and
`kernel` kinds, contraction notes), `meta["schedule"]`, and each node's storage notes from the
memory plan. Pointwise and reduction kernels are generated here from their subgraphs; the
convolution and matmul kernels come from `cpp_kernels`. Every kernel is preceded by a header
naming the graph nodes it implements (and the user's source lines). The entry point receives the
external buffers (inputs, parameters, states, constants) as `ext[slot]`, the arena, and one
scratch block shared by all kernels (they run one after another).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import numpy as np

from ember.ir import Graph, TensorType

from . import cpp_kernels
from .indexing import Coord, broadcast_coords, delinearize, linear_c, relinearize

_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).resolve().parent / "templates" / "cpp"),
                          undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
PARALLEL_MIN = 32768  # below this many elements an OpenMP team costs more than it saves

UNARY_C = {"neg": "(-{0})", "exp": "em_exp({0})", "log": "std::log({0})", "sqrt": "std::sqrt({0})",
           "reciprocal": "({one} / {0})", "relu": "({0} < 0 ? {zero} : {0})", "sigmoid": "em_sigmoid({0})",
           "tanh": "std::tanh({0})", "abs": "std::abs({0})", "stop_gradient": "{0}"}
BINARY_C = {"add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "div": "({0} / {1})",
            "maximum": "em_max({0}, {1})", "minimum": "em_min({0}, {1})", "eq": "({0} == {1})", "ne": "({0} != {1})",
            "lt": "({0} < {1})", "le": "({0} <= {1})", "gt": "({0} > {1})", "ge": "({0} >= {1})"}


def c_literal(value: Any, ctype: str) -> str:
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


class _Body:
    """Emits C statements computing subgraph values at symbolic coordinates, memoised."""

    def __init__(self, sub: Graph, indent_vars: str = "v") -> None:
        self.sub = sub
        self.lines: list[str] = []
        self.memo: dict[tuple, str] = {}
        self.count = 0
        self.input_index = {n: int(name[2:]) for name, n in sub.inputs.items()}
        self.core: int | None = None  # reduction core: its value is `red` at the output index
        self.prefix = indent_vars

    def temp(self, expr: str, ctype: str = "int64_t") -> str:
        self.count += 1
        name = f"{self.prefix}{self.count}"
        self.lines.append(f"const {ctype} {name} = {expr};")
        return name

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
            expr = c_literal(sub.attrs(n)["value"], ctype)
        elif op in ("broadcast_to",):
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
            expr = f"static_cast<{ctype}>({label} == {cls})"
        elif op == "cast":
            (o,) = sub.operands(n)
            expr = f"static_cast<{ctype}>({self.value(o, coords)})"
        elif op == "where":
            c, a, b = (self.value(o, broadcast_coords(coords, t.shape, sub.type(o).shape)) for o in sub.operands(n))
            expr = f"({c} ? {a} : {b})"
        elif op in UNARY_C:
            (o,) = sub.operands(n)
            expr = UNARY_C[op].format(self.value(o, coords), one=c_literal(1, ctype), zero=c_literal(0, ctype))
        elif op in BINARY_C:
            a, b = (self.value(o, broadcast_coords(coords, t.shape, sub.type(o).shape)) for o in sub.operands(n))
            if op == "div" and not t.dtype.is_float:
                expr = f"em_floordiv({a}, {b})"
            else:
                expr = BINARY_C[op].format(a, b)
        else:
            raise NotImplementedError(f"no C++ lowering for op {op!r} inside a fused group")
        name = self.temp(expr, ctype)
        self.memo[key] = name
        return name


def _signature(sub: Graph, out_type: TensorType, restrict: bool) -> str:
    r = " __restrict__" if restrict else ""
    params = [f"const {sub.type(n).dtype.ctype}*{r} {name}" for name, n in sub.inputs.items()]
    params.append(f"{out_type.dtype.ctype}*{r} out")
    return ", ".join(params)


def render_pointwise(name: str, sub: Graph, restrict: bool = True) -> str:
    out = sub.outputs["out"]
    t = sub.type(out)
    body = _Body(sub)
    result = body.value(out, delinearize("i", t.numel, t.shape))
    return _ENV.get_template("pointwise.j2").render(
        name=name, numel=t.numel, out_type=str(t), params=_signature(sub, t, restrict), body=body.lines,
        result=result, parallel=t.numel >= PARALLEL_MIN)


def render_reduction(name: str, sub: Graph, core: int, restrict: bool = True) -> str:
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
        if runs and runs[-1][-1] == a - 1 and op != "argmax":
            runs[-1].append(a)
        elif runs and op == "argmax":
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
    pro = _Body(sub, "p")
    value = pro.value(src, coords)
    epi = _Body(sub, "e")
    epi.core = core
    result = epi.value(out, delinearize("o", t.numel, t.shape))
    acc_t = sub.type(src).dtype.ctype
    init = {"sum": c_literal(0, acc_t), "max": f"(-{acc_t}(INFINITY))" if acc_t in ("float", "double")
            else f"std::numeric_limits<{acc_t}>::lowest()", "argmax": f"(-{acc_t}(INFINITY))"}[op]
    outputs, red_n = math.prod(kept) if kept else 1, math.prod(reduced) if reduced else 1
    return _ENV.get_template("reduction.j2").render(
        name=name, op=op, reduced=red_n, loops=loops, outputs=outputs, out_type=str(t), params=_signature(sub, t, restrict),
        prologue=pro.lines, value=value, epilogue=epi.lines, result=result, acc_type=acc_t, init=init,
        parallel=outputs >= 2 and outputs * red_n >= PARALLEL_MIN)


@dataclass
class KernelCode:
    index: int
    kind: str
    out_type: str
    implements: list[str]
    code: str
    call: str
    scratch_bytes: int = 0


def _input_index(sub: Graph, n: int) -> int:
    name = sub.attrs(n)["name"]
    return int(name[2:])


def render_contraction(name: str, node_kind: str, sub: Graph, notes: dict[str, Any]) -> tuple[cpp_kernels.KernelSource, list[str]]:
    """Renders conv/matmul kernels; returns the source and the argument order as input names/None."""
    core = notes["core"]
    attrs = sub.attrs(core)
    ops = [_input_index(sub, o) for o in sub.operands(core)] if node_kind != "matmul" else []
    if node_kind == "conv2d":
        (n, c, h, w), (o, _, kh, kw) = sub.type(sub.operands(core)[0]).shape, sub.type(sub.operands(core)[1]).shape
        ks = cpp_kernels.render_conv2d_forward(name, N=n, C=c, H=h, W=w, O=o, KH=kh, KW=kw, stride=attrs["stride"],
                                               padding=attrs["padding"], bias=notes.get("bias") is not None, relu=notes["relu"])
        return ks, [f"in{ops[0]}", f"in{ops[1]}", f"in{notes['bias']}" if notes.get("bias") is not None else None, "out"]
    if node_kind == "conv2d_grad_input":
        (n, c, h, w), (o, _, kh, kw) = attrs["input_shape"], sub.type(sub.operands(core)[1]).shape
        ks = cpp_kernels.render_conv2d_grad_input(name, N=n, C=c, H=h, W=w, O=o, KH=kh, KW=kw,
                                                  stride=attrs["stride"], padding=attrs["padding"])
        return ks, [f"in{ops[0]}", f"in{ops[1]}", "out"]
    if node_kind == "conv2d_grad_weight":
        (n, c, h, w), (o, _, kh, kw) = sub.type(sub.operands(core)[0]).shape, attrs["weight_shape"]
        ks = cpp_kernels.render_conv2d_grad_weight(name, N=n, C=c, H=h, W=w, O=o, KH=kh, KW=kw, stride=attrs["stride"],
                                                   padding=attrs["padding"], bias=False)
        return ks, [f"in{ops[0]}", f"in{ops[1]}", "out", None]
    if node_kind == "matmul":
        *batch, m, k = sub.type(sub.operands(core)[0]).shape
        n = sub.type(core).shape[-1]
        ks = cpp_kernels.render_matmul(name, M=m, N=n, K=k, trans_a=notes["trans_a"], trans_b=notes["trans_b"],
                                       batch=math.prod(batch), bias=notes.get("bias") is not None, relu=notes["relu"])
        return ks, [f"in{notes['a']}", f"in{notes['b']}", f"in{notes['bias']}" if notes.get("bias") is not None else None, "out"]
    raise NotImplementedError(f"no C++ kernel for kind {node_kind!r}")


@dataclass
class StepSource:
    code: str
    slots: list[tuple[str, str]]  # (storage kind, name) per ext slot
    arena_bytes: int
    scratch_bytes: int
    kernels: list[KernelCode] = field(default_factory=list)


def _slots(graph: Graph) -> list[tuple[str, str]]:
    slots = [("input", k) for k in graph.inputs] + [("parameter", k) for k in graph.parameters]
    slots += [("state", k) for k in graph.states]
    slots += [("constant", str(n)) for n in graph.meta["schedule"] if graph.notes(n).get("storage") == "constant"]
    return slots


def _pointer(graph: Graph, n: int, slot_of: dict[tuple[str, str], int]) -> str:
    notes = graph.notes(n)
    ctype = graph.type(n).dtype.ctype
    storage = notes["storage"]
    if storage == "alias":
        return _pointer(graph, notes["alias_of"], slot_of)
    if storage == "arena":
        return f"reinterpret_cast<{ctype}*>(arena + {notes['offset']})"
    key = ("constant", str(n)) if storage == "constant" else (storage, notes["name"])
    return f"static_cast<{ctype}*>(ext[{slot_of[key]}])"


def _attr_text(attrs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in sorted(attrs.items()))


def render_step(graph: Graph, profile: bool = False) -> StepSource:
    """The whole step's C++ source for a fused, memory-planned graph (with per-kernel timers if `profile`)."""
    slots = _slots(graph)
    slot_of = {s: i for i, s in enumerate(slots)}
    kernels: list[KernelCode] = []
    for n in graph.meta["schedule"]:
        if graph.op(n) != "fused":
            continue
        kind, sub, notes = graph.attrs(n)["kernel"], graph.attrs(n)["graph"], graph.notes(n)
        name = f"k{len(kernels)}_{kind}"
        args = [_pointer(graph, o, slot_of) for o in graph.operands(n)]
        out_ptr = _pointer(graph, n, slot_of)
        in_place = notes["storage"] in ("parameter", "state")
        scratch = 0
        if kind == "pointwise":
            code = render_pointwise(name, sub, restrict=not in_place)
            call = f"{name}({', '.join(args + [out_ptr])})"
        elif kind == "reduction":
            code = render_reduction(name, sub, notes["core"], restrict=not in_place)
            call = f"{name}({', '.join(args + [out_ptr])})"
        elif kind == "collective":
            core = notes["core"]
            raise NotImplementedError(
                f"the CPU backend cannot compile {sub.op(core)!r} (%{n}, {_attr_text(sub.attrs(core))}, at {graph.loc(n)}): "
                f"collectives need a communicator, which the single-process CPU step does not have; "
                f"run it through the data-parallel runtime or evaluate it with ember.ir.run_world")
        else:
            ks, order = render_contraction(name, kind, sub, notes)
            named = {f"in{i}": a for i, a in enumerate(args)} | {"out": out_ptr}
            call_args = [named[a] if a is not None else "nullptr" for a in order] + ["reinterpret_cast<float*>(scratch)"]
            code, scratch = ks.code, ks.scratch_bytes
            call = f"{name}({', '.join(call_args)})"
        kernels.append(KernelCode(len(kernels), kind, str(graph.type(n)), notes.get("implements", []), code, call, scratch))
    scratch_bytes = max([k.scratch_bytes for k in kernels] + [0])
    code = _ENV.get_template("step.j2").render(graph_name=graph.name, kernels=kernels, arena_bytes=graph.meta["arena_bytes"],
                                               scratch_bytes=scratch_bytes, profile=profile, slots=[f"{i}={k}:{v}" for i, (k, v) in enumerate(slots)])
    return StepSource(code, slots, graph.meta["arena_bytes"], scratch_bytes, kernels)
