"""C++ for the CPU target: the op spelling table and the step renderer (the step's kernels, each
generated once however often it is called, and an OpenMP `ember_step` entry that calls them in
order; `cpp_units` splits them into translation units that compile in parallel).

Reads only what the passes recorded on the graph: each `fused` node's subgraph and `KernelSpec`,
`meta["schedule"]`, and each node's storage notes from the memory plan. Pointwise and reduction
kernels are the target-neutral lowering (`lowering.py`) spelled with `SPELLING`; contractions
and pooling come from the templates in `cpp_kernels` and `pool_kernels`, each exactly as the
family and plan `select` stamped on its spec (`cpp_choices`). Every call is preceded by a
header naming the graph nodes it implements (and the user's source lines), and so is every
kernel in the dumps. The
entry point receives the external buffers (parameters, states, non-scalar constants) as
`ext[slot]` and the arena, which holds the step's inputs, every intermediate and every kernel's
scratch; each buffer gets a named local.
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from ember.ir import Graph, KernelSpec

from . import cpp_choices, cpp_units, cpu_vector
from .compiler import Unit
from .cpp_kernels import PARALLEL_MIN
from .lowering import (C_OPERATORS, Extent, Spelling, bound, c_literal, column_sum, generated_extent, has_narrow,
                       hoisting_rows, lower_pointwise, lower_reduction, reduced_axes)
from .shapes import ceil_div, round_up
from .templates_env import environment

ENV = environment("cpp")  # shared with the kernel templates
ABI_VERSION = 3  # 3: the entry takes the run-time table (dims), kernels their extents

SPELLING = Spelling("C++", {
    **C_OPERATORS,
    # the math functions and limits are the prelude's (compiler builtins: no <cmath> to parse)
    "exp": "em_exp({0})", "log": "em_log({0})", "sqrt": "em_sqrt({0})", "sigmoid": "em_sigmoid({0})",
    "tanh": "em_tanh({0})", "abs": "em_abs({0})", "erf": "em_erf({0})",
    "sin": "em_sin({0})", "cos": "em_cos({0})", "floor": "em_floor({0})",
    "random_uniform": "em_philox_uniform({0}, {1}, {2}, {3})",  # (seed, stream, step, index): prelude
    "lowest": "em_limits<{ctype}>::lowest",
    # bfloat16 (templates/cpp/bf16.j2)
    "load:bfloat16": "em_bf16_load({0})", "round:bfloat16": "em_bf16_round({0})",
    "store:bfloat16": "em_bf16_store({0})",
}, c_literal, storage={"bfloat16": "uint16_t"})


def _signature(sub: Graph, restrict: bool, extent: Extent | None) -> str:
    r = " __restrict__" if restrict else ""
    params = [f"const {SPELLING.ctype(sub.type(n).dtype)}*{r} {name}" for name, n in sub.inputs.items()]
    params += [f"{SPELLING.ctype(sub.type(n).dtype)}*{r} {name}" for name, n in sub.outputs.items()]
    params += [f"const int64_t {extent.var}"] if extent is not None else []
    return ", ".join(params)


def generated_extents(sub: Graph, kind: str, core: int | None = None, fixed: bool = False) -> tuple[int, ...]:
    extent = generated_extent(sub, kind, core, fixed)
    return (extent.value,) if extent is not None else ()


# The shortest row a pointwise kernel loops over with per-row values hoisted: below this an
# inner loop is too short to vectorise well and one flat loop does better.
MIN_ROW = 16


def render_pointwise(name: str, sub: Graph, restrict: bool = True, fixed: bool = False) -> str:
    """One flat loop, or rows (leading axes) of contiguous elements when that hoists per-row
    operands (a normalisation's per-channel values) out of the vectorised inner loop. The
    leading extent is an argument (`generated_extent`), so is whether a team of threads pays,
    unless the domain is `fixed` (the kernel writes parameters and state alone)."""
    extent = generated_extent(sub, "pointwise", fixed=fixed)
    low = lower_pointwise(sub, SPELLING, rows=hoisting_rows(sub, SPELLING, MIN_ROW), extent=extent)
    numel = bound(low.numel, extent)
    return ENV.get_template("pointwise.j2").render(
        name=name, numel=numel, params=_signature(sub, restrict, extent), rows=bound(low.rows, extent),
        row_form=low.rows > 1, row=low.numel // low.rows, hoisted=low.hoisted, inner=low.inner, stores=low.stores,
        parallel=f"{numel} >= {PARALLEL_MIN}" if extent is not None else low.numel >= PARALLEL_MIN)


# A float sum is added in float partials of at most this many elements of its innermost loop,
# the partials in a double total. One float chain over a whole BatchNorm channel (N*H*W values,
# 73728 at batch 512) lost ~1.4e-6 relative, four times NumPy's pairwise sum, and made speednet's
# update 1.07x less accurate against float64 than PyTorch float32's. A contiguous innermost loop
# is vectorised, so each lane's chain is SUM_CHUNK / lanes (64 or 128 adds); a strided one runs
# in order, so its chunk is shorter. The double add per chunk is the whole cost: a row up to
# SUM_CHUNK long is one partial, as the single float loop summed it.
SUM_CHUNK = 1024
SUM_CHUNK_STRIDED = 64


def render_reduction(name: str, sub: Graph, core: int, restrict: bool = True) -> str:
    """A loop over the outputs, loops over the reduced elements inside; the operand's leading
    extent (kept or reduced) is an argument (`generated_extent`), so is whether threads pay.
    Float sums are blocked: float partials per chunk of the innermost loop, double totals."""
    extent = generated_extent(sub, "reduction", core)
    low = lower_reduction(sub, core, SPELLING, extent=extent)
    axes = reduced_axes(sub, core)
    rank = len(sub.type(sub.operands(core)[0]).shape)
    if column_sum(low, sub, core, COLUMN_MIN_OUTPUTS):
        return _render_columns(name, sub, core, restrict, extent)
    kept_lead = extent is not None and 0 not in tuple(axes)
    outputs = bound(low.outputs, extent) if kept_lead else str(low.outputs)
    # the extent is the first reduced loop's when the leading axis is reduced (runs start at it)
    loops = [(var, bound(size, extent) if extent is not None and not kept_lead and i == 0 else str(size))
             for i, (var, size) in enumerate(low.loops)]
    reduced = " * ".join(b for _, b in loops) or "1"
    work = f"{outputs} * {reduced} * {len(low.passes)}"
    if extent is None:
        parallel: str | bool = low.outputs >= 2 and low.outputs * low.reduced * len(low.passes) >= PARALLEL_MIN
    else:
        parallel = f"{outputs} >= 2 && {work} >= {PARALLEL_MIN}"
    chunk = SUM_CHUNK if axes and max(axes) == rank - 1 else SUM_CHUNK_STRIDED
    inner = loops[-1][1] if loops else "0"
    float_sum = {a.acc: a.op == "sum" and a.ctype == "float" for a in low.accs}
    return ENV.get_template("reduction.j2").render(
        name=name, ops="+".join(dict.fromkeys(a.op for a in low.accs)), reduced=reduced, loops=loops,
        outputs=outputs, params=_signature(sub, restrict, extent), passes=low.passes,
        epilogue=low.epilogue, results=low.results, parallel=parallel, chunk=chunk,
        chunk_loop=not (inner.isdigit() and int(inner) <= chunk),
        blocked_passes=[bool(loops) and all(float_sum[a.acc] for a in p.accs) for p in low.passes],
        total_ctype={a.acc: "double" if float_sum[a.acc] else a.ctype for a in low.accs})


# A reduction into this many contiguous outputs or more, over the leading axes, runs row by row
# with the outputs vectorised (`reduction_columns.j2`): one 16-lane vector of them at least.
# Measured on ViT's step (2 threads, Sapphire Rapids): its column sums (LayerNorm's and the
# linear layers' parameter gradients over the batch's tokens) took 0.95 of 5.2 ms walking each
# output's column with a stride of a row.
COLUMN_MIN_OUTPUTS = 16
COLUMN_BLOCK = 64  # outputs a thread sums at once: 4 vectors of 16, double totals on the stack


def _render_columns(name: str, sub: Graph, core: int, restrict: bool, extent: Extent | None) -> str:
    low = lower_reduction(sub, core, SPELLING, extent=extent, columns=True)
    (row, size), (only,) = low.loops[0], low.passes
    rows = bound(size, extent)  # the leading axis is reduced: the rows count with the batch
    # blocks of outputs: at least two for a team of two where the outputs allow, vectors whole
    block = min(COLUMN_BLOCK, max(COLUMN_MIN_OUTPUTS, round_up(ceil_div(low.outputs, 2), 16)))
    work = f"{rows} * {low.outputs}"
    parallel: str | bool = low.outputs > block and (f"{work} >= {PARALLEL_MIN}" if extent is not None
                                                    else size * low.outputs >= PARALLEL_MIN)
    return ENV.get_template("reduction_columns.j2").render(
        name=name, ops="+".join(dict.fromkeys(a.op for a in low.accs)), rows=rows, outputs=low.outputs, block=block,
        params=_signature(sub, restrict, extent), accs=only.accs, per_row=only.pre, per_element=only.levels[0],
        epilogue=low.epilogue, results=low.results, parallel=parallel, chunk=SUM_CHUNK_STRIDED, row=row)


@dataclass
class KernelCode:
    """One call of the step (`function`'s code may serve several calls)."""
    index: int
    name: str            # the graph's name for this kernel (k12_conv2d): per call, stable across dumps
    kind: str            # its spec, described (`KernelSpec.describe`)
    out_type: str
    implements: list[str]
    code: str
    call: str
    node: int = -1  # the fused node it implements (its operands are what it reads)
    function: str = ""  # the C function it calls: ek_<hash of its code>
    #: what the compiled entry says of the call: the spec without the sizes of this step (its
    #: scratch bytes), so that the entry of another batch size is the same text
    what: str = ""


class _Table:
    """The step's run-time table (`StepSource.dims`, the entry's `dims` argument): the arena
    offsets of its buffers and the sizes its kernels take at run time. The entry reads them
    there rather than holding them, so a step of another batch size (the same graph but for
    its sizes) compiles to the same entry."""

    def __init__(self) -> None:
        self.values: list[int] = []
        self.notes: list[str] = []

    def add(self, value: int, what: str) -> str:
        self.values.append(int(value))
        self.notes.append(what)
        return f"dims[{len(self.values) - 1}]"


@dataclass
class StepSource:
    code: str  # the whole step as one file (`ember kernels`); the library is built from `units`
    slots: list[tuple[str, str]]  # (storage kind, name) per ext slot
    arena_bytes: int
    kernels: list[KernelCode] = field(default_factory=list)
    # a data-parallel step: kernel indices of each segment, and after segment s (but the last) the
    # collectives the runtime runs there, each (operand node, result node, op attributes)
    segments: list[list[int]] = field(default_factory=list)
    collectives: list[list[tuple[int, int, dict]]] = field(default_factory=list)
    # the vector variant the kernels were generated for, and the g++ flags that build them
    isa: cpu_vector.VectorISA = cpu_vector.AVX2
    flags: tuple[str, ...] = ()
    # the translation units (the entry first), the headers they include (name -> text), and
    # the link's flags: what compiler.compile_units builds
    units: list[Unit] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)
    link_flags: tuple[str, ...] = cpp_units.LINK_FLAGS
    functions: list[cpp_units.KernelFunction] = field(default_factory=list)
    #: the run-time table the entry reads (`dims`): buffer offsets and kernel sizes of this step
    dims: list[int] = field(default_factory=list)


def _slots(graph: Graph) -> list[tuple[str, str]]:
    slots = [("parameter", k) for k in graph.parameters] + [("state", k) for k in graph.states]
    slots += [("constant", str(n)) for n in graph.meta["schedule"] if graph.notes(n).get("storage") == "constant"]
    return slots


def local_name(graph: Graph, n: int) -> str:
    """The C identifier of the buffer holding node n's value: named after the value it holds."""
    notes = graph.notes(n)
    storage = notes["storage"]
    if storage == "alias":
        return local_name(graph, notes["alias_of"])
    if storage in ("input", "parameter", "state") and "name" in notes and graph.op(n) in ("input", "parameter", "state"):
        return {"input": "in_", "parameter": "p_", "state": "s_"}[storage] + re.sub(r"\W", "_", notes["name"])
    if storage == "constant":
        return f"const_{n}"
    what = graph.attrs(n)["kernel"].kind if graph.op(n) == "fused" else graph.op(n)
    return f"v{n}_{what}"


def _buffer_decls(graph: Graph, slot_of: dict[tuple[str, str], int], used: list[int], table: _Table) -> list[str]:
    """`T* const name = ...;` for every buffer a kernel touches, once, in schedule order (arena
    offsets from the run-time table)."""
    decls, seen = [], set()
    for n in used:
        while graph.notes(n)["storage"] == "alias":
            n = graph.notes(n)["alias_of"]
        name = local_name(graph, n)
        if name in seen:
            continue
        seen.add(name)
        notes, ctype = graph.notes(n), SPELLING.ctype(graph.type(n).dtype)
        storage = notes["storage"]
        if storage in ("arena", "input"):
            where = f"reinterpret_cast<{ctype}*>(arena + {table.add(notes['offset'], f'{name}: {graph.type(n)}')})"
        else:
            key = ("constant", str(n)) if storage == "constant" else (storage, notes["name"])
            where = f"static_cast<{ctype}*>(ext[{slot_of[key]}])"
        decls.append(f"{ctype}* const {name} = {where};")
    return decls


def _attr_text(attrs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in sorted(attrs.items()))


def render_step(graph: Graph, profile: bool = False, isa: cpu_vector.VectorISA | None = None,
                on_unit: Callable[[Unit, dict[str, str]], None] | None = None) -> StepSource:
    """The whole step's C++ source for a fused, memory-planned graph (with per-kernel timers if
    `profile`), its contraction kernels generated for `isa` (default: `cpu_vector.resolve()`).
    `on_unit` is handed each contraction's unit and the headers it includes as soon as it is
    generated (to start compiling it while the rest are), where the step's flags are known then:
    not for a step with bfloat16 values (its flags depend on how all its contractions multiply)."""
    isa = isa or cpu_vector.resolve()
    early = on_unit if not has_narrow(graph) else None
    early_flags = cpu_vector.cxx_flags(isa)
    early_header = dict([cpp_units.prelude(bf16=False)]) if early else {}
    slots = _slots(graph)
    slot_of = {s: i for i, s in enumerate(slots)}
    kernels: list[KernelCode] = []
    functions: dict[str, cpp_units.KernelFunction] = {}
    used: list[int] = []
    scratch: list[tuple[str, int, int]] = []  # (kernel, arena offset, bytes)
    table = _Table()
    segments: list[list[int]] = [[]]
    collectives: list[list[tuple[int, int, dict]]] = []
    dots: set[str] = set()  # how the bfloat16 contractions multiply (cpu_vector.bf16_dot)
    for n in graph.meta["schedule"]:
        if graph.op(n) != "fused":
            continue
        attrs, notes = graph.attrs(n), graph.notes(n)
        spec, sub = attrs["kernel"], attrs["graph"]
        name = sub.name
        operands = graph.operands(n)
        results = graph.results(n)
        used += operands + results
        args = [local_name(graph, o) for o in operands]
        out = local_name(graph, n)
        outs = [local_name(graph, m) for m in results]
        in_place = any(graph.notes(m)["storage"] in ("parameter", "state") for m in results)
        if spec.kind == "pointwise":
            # an optimizer's update: the parameters' sizes, the same at every batch size, so the
            # code holds them (fixed bounds, no OpenMP region where the work is small)
            fixed = all(graph.notes(m)["storage"] in ("parameter", "state") for m in results)
            code = render_pointwise(name, sub, restrict=not in_place, fixed=fixed)
            call_args, extents = args + outs, generated_extents(sub, "pointwise", fixed=fixed)
        elif spec.kind == "reduction":
            code = render_reduction(name, sub, spec.core, restrict=not in_place)
            call_args, extents = args + outs, generated_extents(sub, "reduction", spec.core)
        elif spec.kind == "collective":
            # not compiled: the step ends a segment here and the runtime's communicator runs it;
            # collectives with no kernel between them meet at one boundary (one flat bucket)
            if sub.op(spec.core) != "all_reduce":
                raise NotImplementedError(f"the CPU backend cannot run {sub.op(spec.core)!r} (%{n}, at {graph.loc(n)})")
            if segments[-1] or not collectives:
                collectives.append([])
                segments.append([])
            collectives[-1].append((operands[0], n, dict(sub.attrs(spec.core))))
            continue
        else:
            # exactly the family and plan `select` stamped on the spec (cpp_choices)
            ks, order = cpp_choices.render_kernel(name, sub, spec, isa)
            if ks.scratch_bytes != spec.scratch_bytes:
                raise AssertionError(f"{name}: template needs {ks.scratch_bytes} scratch bytes ({isa.name}), "
                                     f"the plan reserved {spec.scratch_bytes} (was ${cpu_vector.ENV_VAR} "
                                     f"changed between planning and rendering?)")
            named = {role: args[i] for role, i in spec.roles} | {"out": out, "scratch": "nullptr"}
            if spec.scratch_bytes:
                named["scratch"] = f"{name}_scratch"
                scratch.append((name, notes["scratch_offset"], spec.scratch_bytes))
            call_args = [named[a] if a is not None else "nullptr" for a in order]
            code, extents = ks.code, ks.extents
            if spec.choice is not None and spec.choice[0] == "bf16":
                dots.add(dict(spec.choice[1])["dot"])
        call_args += [table.add(e, f"{name}: extent") for e in extents]
        fname, code, declaration = cpp_units.name_by_content(code, name)
        first = fname not in functions
        fn = functions.setdefault(fname, cpp_units.KernelFunction(fname, spec.kind, code, declaration))
        segments[-1].append(len(kernels))
        kernels.append(KernelCode(len(kernels), name, spec.describe(), str(graph.type(n)), notes.get("implements", []),
                                  code, f"{fname}({', '.join(call_args)})", n, fname,
                                  dataclasses.replace(spec, scratch_bytes=0).describe()))
        fn.calls.append(kernels[-1])
        if early is not None and first and cpp_units.alone(fn):
            early(cpp_units.alone_unit(next(iter(early_header)), fn, early_flags), early_header)
    seg_kernels = [[kernels[i] for i in seg] for seg in segments] if collectives else [kernels]
    header, header_text = cpp_units.prelude(bf16=has_narrow(graph))
    fns = list(functions.values())
    buffers = _buffer_decls(graph, slot_of, used, table)
    buffers += [f"float* const {k}_scratch = reinterpret_cast<float*>(arena + {table.add(offset, f'{k}: {size} scratch bytes')});"
                for k, offset, size in scratch]

    def entry(preamble: str, implements: bool) -> str:
        return ENV.get_template("step.j2").render(
            graph_name=graph.name, kernels=kernels, functions=len(fns), segments=seg_kernels, preamble=preamble,
            profile=profile, slots=[f"{i}={k}:{v}" for i, (k, v) in enumerate(slots)], buffers=buffers,
            abi=ABI_VERSION, table_tag=hashlib.sha256(repr(table.values).encode()).hexdigest()[:12],
            implements=implements)

    flags = cpu_vector.cxx_flags(isa) + cpu_vector.bf16_flags(isa, dots)
    # the compiled entry names no source line (a graph input's is where it was traced: another line
    # for another batch size): the nodes each call implements are in its dumped note
    units = cpp_units.step_units(entry(cpp_units.entry_preamble(header, fns), False), fns, header, flags,
                                 _layout_note(graph, kernels, table, implements=True),
                                 cheap_flags=cpu_vector.auto_vector_flags(isa))
    return StepSource(_layout_note(graph, kernels, table) + entry(cpp_units.single_source(header_text, fns), True),
                      slots, graph.meta["arena_bytes"],
                      kernels, segments if collectives else [list(range(len(kernels)))], collectives,
                      isa, flags, units, {header: header_text}, cpp_units.LINK_FLAGS, fns, table.values)


def _layout_note(graph: Graph, kernels: list[KernelCode], table: _Table, implements: bool = False) -> str:
    """Comment lines on what the entry reads at run time for this step (its sizes): each call's
    kernel and result type (with `implements`, the graph nodes it implements), and the `dims`
    table. For the dumped and one-file copies only: the compiled entry holds no size of the step."""
    lines = [f"// this step ({graph.name}): arena {graph.meta['arena_bytes']} bytes; the calls:"]
    for k in kernels:
        lines.append(f"//   call {k.index} {k.name}: {k.kind} -> {k.out_type}")
        lines += [f"//     implements {line}" for line in k.implements] if implements else []
    lines += ["// the run-time table (dims):"]
    lines += [f"//   dims[{i}] = {v}  ({what})" for i, (v, what) in enumerate(zip(table.values, table.notes))]
    return "\n".join(lines) + "\n"

