"""CUDA for the `cuda` target: the op spelling table and the step renderer.

One CUDA translation unit per step holds every kernel (compiled once with NVRTC by the runtime);
the step is the ordered list of launches, which the runtime captures into one CUDA graph.
Pointwise and reduction kernels are the target-neutral lowering (`lowering.py`) spelled with
`SPELLING`: a pointwise kernel is one thread an element, or four consecutive elements of a row
where per-row values hoist (a normalisation's per-channel ones); a reduction is one thread an output
when the reduced extent is short, else one block an output with a fixed shared-memory tree, or
several blocks an output whose partials the last of them adds in a fixed order, so results are
deterministic (an atomic counter picks only which block adds). Contractions come from the templates in `cuda_kernels`.
Arguments are named buffers (graph nodes, or a kernel's scratch block), resolved to device
pointers by the runtime; codegen never allocates.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

from ember.ir import Graph, KernelSpec

from . import cuda_choices, cuda_kernels, pool_kernels
from .device import current
from .indexing import Term, delinearize
from .lowering import (C_OPERATORS, Body, Extent, Spelling, bound, c_literal, column_sum, generated_extent,
                       has_narrow, hoisting_rows, lower_pointwise, lower_reduction, max_elements, reduced_axes)
from .templates_env import environment

ENV = environment("cuda")  # shared with the kernel templates
THREADS = 256
COLLECTIVE_PREFIX = "collective:all_reduce:"  # a launch record the communicator carries out
PER_THREAD_MAX = 64  # reduce this many elements or fewer an output in one thread, or in a few lanes:
LANES_MIN = 8  # ... where they are contiguous and more than this many (`_lanes_per_output`)
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")

SPELLING = Spelling("CUDA", {
    **C_OPERATORS,
    "exp": "em_exp({0})", "log": "em_log({0})", "sqrt": "em_sqrt({0})", "sigmoid": "em_sigmoid({0})",
    "tanh": "em_tanh({0})", "abs": "em_abs({0})",
    "erf": "erf({0})",  # CUDA's C++ math overloads: erf(float) is erff
    "sin": "sin({0})", "cos": "cos({0})", "floor": "floor({0})",
    "random_uniform": "em_philox_uniform({0}, {1}, {2}, {3})",  # (seed, stream, step, index): prelude
    "lowest": "em_lowest<{ctype}>()",
    # bfloat16 (templates/cuda/bf16.j2)
    "load:bfloat16": "em_bf16_load({0})", "round:bfloat16": "em_bf16_round({0})",
    "store:bfloat16": "em_bf16_store({0})",
    # vector loads of up to 16 bytes (Body's lanes): the type of `width` elements, the load, a lane
    "vector": "*reinterpret_cast<const {2}*>({0} + ({1}))",
    "vector_store": "*reinterpret_cast<{2}*>({0} + ({1})) = make_{2}({3});",
    "pack:bfloat16": "em_bf16_pack2({0}, {1})",
    "vtype:float32:4": "float4", "vtype:float32:2": "float2",
    "vtype:bfloat16:8": "uint4", "vtype:bfloat16:4": "uint2",
    **{f"lane:float32:{j}": f"{{0}}.{c}" for j, c in enumerate("xyzw")},
    # two bfloat16 values a 32-bit word, the first in its low half (little-endian)
    **{f"lane:bfloat16:{j}": f"__uint_as_float({{0}}.{'xyzw'[j // 2]} {'<< 16' if j % 2 == 0 else '& 0xFFFF0000u'})"
       for j in range(8)},
}, c_literal, storage={"bfloat16": "unsigned short"})


@dataclass(frozen=True)
class LaunchArgs:
    """One launch of the step: a function of the module, its geometry, and its arguments as
    buffer references: ("node", id) for a graph value, ("scratch", id) for a kernel's scratch,
    ("scratch@OFF", id) for the region of it at OFF bytes, ("counters#W", id) for W counter words
    of the kernel's own (`cuda_kernels.counter_role`)."""
    function: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    args: tuple[tuple[str, int], ...]
    kernel: str  # the fused node's kernel name, for profiles and errors
    #: by-value arguments after the buffers, (C type, value): a generated kernel's leading extent
    scalars: tuple[tuple[str, int], ...] = ()


@dataclass
class CudaStepSource:
    code: str
    launches: list[LaunchArgs]
    arena_bytes: int
    kernels: list[tuple[str, str, list[str]]] = field(default_factory=list)  # (name, spec, implements)
    # what the runtime compiles: the prelude every module starts with, and one unit per distinct
    # kernel (its code and the functions it defines); `code` is all of them in one source
    prelude: str = ""
    units: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)


def _signature(sub: Graph, extent: Extent | None = None, index: str = "int") -> str:
    params = [f"const {SPELLING.ctype(sub.type(n).dtype)}* __restrict__ {name}" for name, n in sub.inputs.items()]
    params += [f"{SPELLING.ctype(sub.type(n).dtype)}* {name}" for name, n in sub.outputs.items()]
    params += [f"const {index} {extent.var}"] if extent is not None else []
    return ", ".join(params)


def _out_types(sub: Graph, extent: Extent | None = None) -> str:
    """The outputs' types for a kernel's header comment; with a run-time extent, its leading axis
    is written as the parameter, so the comment is the same at every batch size."""
    def text(n: int) -> str:
        t = sub.type(n)
        if extent is None or not t.shape or t.shape[0] != extent.value:
            return str(t)
        return str(t).replace(f"[{t.shape[0]}", f"[{extent.var}", 1)
    return ", ".join(text(n) for n in sub.outputs.values())


def _scalars(extent: Extent | None, index: str) -> tuple[tuple[str, int], ...]:
    return ((index, extent.value),) if extent is not None else ()


def _index_type(sub: Graph) -> str:
    # 64-bit division costs tens of instructions on a GPU; the index arithmetic of a kernel whose
    # tensors all have fewer than 2**31 elements is done in 32 bits.
    return "int" if max_elements(sub) < 2**31 else "int64_t"


#: the shortest row a pointwise kernel takes as rows with its per-row values hoisted (a BatchNorm's
#: per-channel scale computed once for ROW_VALUES elements instead of once each)
MIN_ROW = 8
#: consecutive elements of a row a thread computes in the rows form (the last of a row fewer where
#: they do not divide it): the per-row values (loads, square roots, divisions) once for them
ROW_VALUES = 4


def render_pointwise(name: str, sub: Graph, fixed: bool = False,
                     runtime: bool = False) -> tuple[str, tuple[int, int, int], tuple[int, int, int],
                                                     tuple[tuple[str, int], ...]]:
    """(code, grid, block, by-value arguments). One thread an element, or, where splitting the
    domain into rows (leading axes) of contiguous elements hoists per-row operands (a
    normalisation's per-channel values: `hoisting_rows`), rows with a thread computing
    `ROW_VALUES` consecutive elements of a row (the row's last thread fewer where they do not
    divide it), its per-row values once. Where the batch would be its bound alone, the domain's
    leading extent is an argument (`generated_extent`), so the code is the same at every batch
    size. A kernel with constants that are counts over the batch (a mean's 1/(N*H*W)) keeps them
    literal, and so its size (spelled from the argument they cost a division per element), and
    reductions hold their sizes: with every generated kernel
    taking the batch at run time, ResNet-8's step measured 10% slower on an H200
    (docs/benchmarks.md). A `fixed` domain (the kernel writes parameters and state alone) holds its
    sizes: no batch changes them. With `runtime` (a step whose plans came from a step of another
    batch size) constants over the batch are computed from the argument too: every such step's
    kernel is the same text."""
    index = _index_type(sub)
    extent = generated_extent(sub, "pointwise", fixed=fixed)
    rows = hoisting_rows(sub, SPELLING, MIN_ROW)

    def lower(at: Extent | None):
        # vectors along rows: the hoisting rows, else the batch's (a run-time bound) or one row
        shape = sub.type(sub.outputs["out"]).shape
        along = rows if rows > 1 else shape[0] if at is not None and shape else 1
        step = _pointwise_step(sub, along)
        return lower_pointwise(sub, SPELLING, index_type=index, extent=at, rows=along if step else rows, vector=step)
    low = lower(extent)
    if extent is not None and not runtime and any(
            _names(line, extent.var) for line in low.body + [v for *_, v in low.stores] + low.vector_stores):
        extent = None
        low = lower(None)
    row = low.numel // low.rows
    per_row = row // low.vector if low.vector else math.ceil(row / ROW_VALUES)  # threads a row, in the rows forms
    lane_vars = _lane_vars("j", low.vector, low.inner, index)
    code = ENV.get_template("pointwise.j2").render(
        name=name, numel=bound(low.numel, extent), out_type=_out_types(sub, extent),
        params=_signature(sub, extent, index), body=low.body, stores=low.stores, threads=THREADS, index=index,
        row_form=low.rows > 1, rows=bound(low.rows, extent), row=row, per_thread=ROW_VALUES, per_row=per_row,
        hoisted=low.hoisted, inner=low.inner, vector=low.vector, lane_vars=lane_vars,
        vector_stores=low.vector_stores)
    threads = low.rows * per_row if low.rows > 1 or low.vector else low.numel
    return code, (math.ceil(threads / THREADS), 1, 1), (THREADS, 1, 1), _scalars(extent, index)


def _names(line: str, identifier: str) -> bool:
    return identifier in _IDENTIFIER.findall(line)


def _flat_loop_vars(loops: list[tuple[str, int]], index: str) -> list[str]:
    """Loop variables of nested reduction loops recovered from one flat counter `flat`."""
    lines, inner = [], 1
    for var, size in reversed(loops):
        div = f"flat / {inner}" if inner > 1 else "flat"
        lines.insert(0, f"const {index} {var} = ({div}) % {size};" if var != loops[0][0] else f"const {index} {var} = {div};")
        inner *= size
    return lines


# A split reduction is bandwidth-bound: it needs enough warps in flight on each multiprocessor to
# hide memory latency (measured on an H200: 2 blocks of 256 per SM read a bias gradient's 75 MB at
# 0.7 TB/s), so it is cut into at most about 8 blocks per multiprocessor; but a block also needs
# work enough to pay for its tree and its partial: at least about 12 elements a thread. On an
# H200, BatchNorm's statistics of 64 x 16 x 28 x 28 took 10.8 us in 64 splits an output, 7.2 us in
# 16; 64 x 32 x 14 x 14 8.7 us in 32, 6.5 us in 5-8; at batch 1024 the 64 splits stayed fastest.
REDUCTION_BLOCKS_PER_SM = 8
REDUCTION_MIN_PER_BLOCK = 12 * THREADS


@dataclass(frozen=True)
class ReductionKernel:
    code: str
    #: (function, grid, block, roles after the subgraph's inputs and outputs: scratch, counters)
    launches: tuple[tuple[str, tuple[int, int, int], tuple[int, int, int], tuple[str, ...]], ...]
    scratch_bytes: int
    #: by-value arguments of every launch, after its buffers: the run-time extent (`runtime`)
    scalars: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class ReductionLayout:
    """How a reduction kernel spreads its work: `mode` "thread" (a thread an output), "lanes"
    (`lanes` lanes of a warp an output), "block" (a block an output) or "split" (`splits` blocks
    an output, each `chunk` of the outermost reduced loop)."""
    mode: str
    lanes: int = 0
    splits: int = 1
    chunk: int = 0


def reduction_layout(sub: Graph, core: int, low: Any, runtime: bool = False) -> ReductionLayout:
    """The layout of a reduction kernel at this step's sizes. With `runtime` (the kernel takes
    the batch at run time, `render_reduction`), one that does not depend on the batch, so the
    kernel is the same text at every batch size: where the batch is reduced, split whenever the
    outputs alone are too few blocks (the split count, at most `_split_count`, is the launch's
    and may be 1), else a block an output; where it is kept (the outputs grow with it), a thread,
    lanes or a block an output as the reduced length says, never split."""
    lanes = _lanes_per_output(sub, core, low) if low.reduced <= PER_THREAD_MAX else 0
    if runtime and 0 in reduced_axes(sub, core):
        if _splittable(low):
            return ReductionLayout("split", 0, *_even_chunks(low.loops[0][1], _split_count(low)))
        return ReductionLayout("block")
    if low.reduced <= PER_THREAD_MAX:
        return ReductionLayout("lanes", lanes) if lanes else ReductionLayout("thread")
    splits, chunk = (1, 0) if runtime else _split_plan(low)
    return ReductionLayout("split", 0, splits, chunk) if splits > 1 else ReductionLayout("block")


def _splittable(low: Any) -> bool:
    """Whether the split kernels serve a reduction: sums and maxima (no argmax) over at least two
    loops, whose outputs alone are too few blocks to fill the GPU."""
    return low.op in ("sum", "max", "mixed") and not any(a.op == "argmax" for a in low.accs) and bool(low.acc_type) \
        and len(low.loops) >= 2 and low.outputs < REDUCTION_BLOCKS_PER_SM * current().multiprocessors


def _split_count(low: Any) -> int:
    """How many blocks share one output: 1 unless it is `_splittable`, each output has elements
    enough for several blocks (REDUCTION_MIN_PER_BLOCK each), and the outermost reduced loop (the
    batch, for a bias gradient) can be cut into chunks. The split kernels walk one flat counter,
    so a short innermost loop splits too (BatchNorm's backward over 5x5 planes of 512 images: 32
    blocks of one output each took 52 us of a 505 us step on an H200)."""
    if not _splittable(low):
        return 1
    target_blocks = REDUCTION_BLOCKS_PER_SM * current().multiprocessors
    outer = low.loops[0][1]
    return max(1, min(outer, math.ceil(target_blocks / low.outputs), low.reduced // REDUCTION_MIN_PER_BLOCK))


def _split_plan(low: Any) -> tuple[int, int]:
    """(splits, chunk of the outermost reduced loop each takes) of a reduction kernel; (1, 0)
    for one that is not split (a short one runs a thread or a few lanes an output). The count
    is taken again from the chunk, so that no split is empty."""
    if low.reduced <= PER_THREAD_MAX or (splits := _split_count(low)) == 1:
        return 1, 0
    return _even_chunks(low.loops[0][1], splits)


def _even_chunks(length: int, parts: int) -> tuple[int, int]:
    """(parts, chunk) of `length` cut into at most `parts` equal chunks: the count taken again
    from the chunk, so that none is empty."""
    chunk = math.ceil(length / max(1, min(parts, length)))
    return math.ceil(length / chunk), chunk


def _partial_slots(low: Any) -> list[str]:
    """A split reduction's partials per split and output: each accumulator's, and a variance's
    ("m2") sum of its values less their shift beside its own."""
    return [a.acc for a in low.accs] + [f"{a.acc}_sum" for a in low.accs if a.op == "m2"]


def _split_scratch(low: Any, splits: int) -> int:
    """Bytes of a split reduction's partials: one per slot (`_partial_slots`), split and output."""
    return len(_partial_slots(low)) * splits * low.outputs * _acc_bytes(low)


def _lanes_per_output(sub: Graph, core: int, low: Any) -> int:
    """How many lanes of a warp share an output of a short reduction (at most PER_THREAD_MAX elements
    an output): 16 or 32 (the power of two that covers its elements, at most a warp) where its
    innermost reduced axis is the input's contiguous last axis, else 0 (one thread an output). A
    thread an output reads a row of its own, so a warp's load touches 32 rows' cache lines, and
    1024 outputs are only 4 blocks: ViT's LayerNorm statistics and gradients over 64 features took
    17-26 us each alone on an H200. Lanes side by side read a row's elements together and spread
    the outputs over 8-16x the blocks."""
    if any(a.op == "argmax" for a in low.accs) or low.reduced <= LANES_MIN:
        return 0
    shape = sub.type(sub.operands(core)[0]).shape
    if len(shape) - 1 not in sub.attrs(core)["axes"] or shape[-1] == 1:
        return 0
    return 16 if low.reduced <= 16 else 32


def _acc_bytes(low: Any) -> int:
    return {"float": 4, "double": 8}.get(low.acc_type, 8)


def render_reduction(name: str, sub: Graph, core: int, runtime: bool = False) -> ReductionKernel:
    """A reduction kernel, with every pass and output of a kernel that has several (see lowering).
    With `runtime`, the leading extent of its operand (the batch) is its last argument and its
    layout one that does not depend on it (`reduction_layout`): the text a step of any batch size
    renders, what a step whose plans came from a step of another batch size runs. The kernels a
    step chose for itself hold their sizes: with every generated kernel taking the batch at run
    time, ResNet-8's step measured 10% slower on an H200 (docs/benchmarks.md)."""
    index = _index_type(sub)
    extent = generated_extent(sub, "reduction", core) if runtime else None
    low = lower_reduction(sub, core, SPELLING, index_type=index, extent=extent)
    layout = reduction_layout(sub, core, low, runtime=extent is not None)
    if layout.mode == "split":
        # a variance's two sums in one walk of the values (the split template knows op "m2"), the
        # innermost loop walked in vectors: airbench's BatchNorm statistics read each 100 MB
        # activation twice, two bytes a load (133 us each on an H100)
        low = lower_reduction(sub, core, SPELLING, index_type=index, extent=extent, moments=True,
                              vector=_vector_step(sub, low))
    # the sizes as the code spells them: the batch's (the outermost reduced loop where it is
    # reduced, the outputs where it is kept) an expression of the argument on run-time sizes
    loops: list[tuple[str, int | str]] = list(low.loops)
    reduced: int | str = low.reduced
    outputs: int | str = low.outputs
    batch_reduced = extent is not None and 0 in reduced_axes(sub, core)
    if batch_reduced:
        loops[0] = (loops[0][0], extent.times(loops[0][1]))
        reduced = extent.times(low.reduced)
    elif extent is not None:
        outputs = extent.times(low.outputs)
    accs = low.accs
    common = dict(name=name, ops="+".join(dict.fromkeys(a.op for a in accs)), reduced=reduced, loops=loops,
                  outputs=outputs, out_type=_out_types(sub, None if batch_reduced else extent),
                  params=_signature(sub, extent, index),
                  passes=low.passes, accs=accs, epilogue=low.epilogue, results=low.results, threads=THREADS,
                  index=index)
    scalars = _scalars(extent, index)
    if layout.mode == "split":
        first, (innermost, length), step = low.loops[0][0], low.loops[-1], low.vector
        steps = [(f"{innermost}_v", length // step)] if step else [low.loops[-1]]
        flat_vars = _flat_loop_vars([(f"{first}_off", layout.chunk)] + list(low.loops[1:-1]) + steps, index)
        flat_vars.append(f"const {index} {first} = {first}_begin + {first}_off;")
        if step:  # the lanes' own variables where a load is not a vector's (strided, say)
            flat_vars.append(f"const {index} {innermost} = {innermost}_v * {step};")
            flat_vars += _lane_vars(innermost, step, [x for p in low.passes for level in p.levels for x in level], index)
        lane_sums = {a.acc: _pairwise(a.lanes, a.op) for a in accs if a.lanes and a.op != "m2"}
        lane_sums["y_"] = _pairwise([f"y{j}_" for j in range(step)], "sum") if step else ""
        # the earlier results each launch reads (a pass's, then the epilogue's): only those are combined
        names = [set(_IDENTIFIER.findall(" ".join(p.pre + [x for level in p.levels for x in level]
                                                  + [a.value for a in p.accs]))) for p in low.passes]
        names.append(set(_IDENTIFIER.findall(" ".join(low.epilogue + [v for _, v in low.results]))))
        slot = {acc: k for k, acc in enumerate(_partial_slots(low))}
        if extent is None:
            splits, chunk, last = str(layout.splits), str(layout.chunk), f"{layout.splits - 1}u"
            base = {acc: str(k * layout.splits * low.outputs) for acc, k in slot.items()}
        else:  # the split count is the launch's (gridDim.y), each split's share of the loop follows
            splits, last = "(int)gridDim.y", "gridDim.y - 1u"
            chunk = f"(({loops[0][1]} + (int)gridDim.y - 1) / (int)gridDim.y)"
            base = {acc: "0" if k == 0 else f"{k * low.outputs} * (int)gridDim.y" for acc, k in slot.items()}
        code = ENV.get_template("reduction_split.j2").render(
            **dict(common, params=_signature(sub, None, index)), scalar_params=_scalar_params(extent, index),
            splits=splits, chunk=chunk, outer=loops[0][1], last_split=last, base=base, used=names,
            # a split count the compiler does not know is at least 1 let it move an epilogue's
            # multiply out of its fma (an SGD update 1 ulp off its own kernel's: test_cuda_batch_extents)
            assume="" if extent is None else "__builtin_assume((int)gridDim.y >= 1);",
            inner=math.prod(size for _, size in low.loops[1:]), flat_vars=flat_vars, acc_type=low.acc_type,
            vector=step, lane_sums=lane_sums)
        last_pass = len(low.passes) - 1
        launches = tuple((f"{name}_part{k}", (low.outputs, layout.splits, 1), (THREADS, 1, 1),
                          ("scratch",) + ((cuda_kernels.counter_role(low.outputs),) if k == last_pass else ()))
                         for k in range(len(low.passes)))
        return ReductionKernel(code, launches, _split_scratch(low, layout.splits), scalars)
    # A block an output walks the reduced elements either as nested loops with the innermost
    # (contiguous, where the layout allows) split across the threads, which needs no division
    # and coalesces, or, when the innermost extent is too short to occupy the threads, as one flat
    # counter divided back into loop variables. (On run-time sizes an innermost loop that holds
    # the batch is walked nested whatever its length.)
    argmax = any(a.op == "argmax" for a in accs)
    lanes = layout.lanes
    group = lanes or THREADS  # the threads that share an output
    nested = not argmax and len(low.loops) > 0 and (
        low.loops[-1][1] >= group // 2 or (extent is not None and isinstance(loops[-1][1], str)))
    code = ENV.get_template("reduction.j2").render(**common, per_thread=layout.mode == "thread", lanes=lanes,
                                                   nested=nested, argmax=argmax,
                                                   loop_vars=_flat_loop_vars(low.loops, index),
                                                   flat_index=low.loops[0][0] if low.loops else "0", group=group)
    grid = (math.ceil(low.outputs / THREADS), 1, 1) if layout.mode == "thread" else \
        (math.ceil(low.outputs / (THREADS // lanes)), 1, 1) if lanes else (low.outputs, 1, 1)
    return ReductionKernel(code, ((name, grid, (THREADS, 1, 1), ()),), 0, scalars)


def _lane_vars(var: str, step: int, lines: list[str], index: str) -> list[str]:
    """The definitions of lane variables `<var>_<j>` that `lines` name (loads that are not a
    vector's: strided, say)."""
    named = set(_IDENTIFIER.findall(" ".join(lines)))
    return [f"const {index} {var}_{j} = {var} + {j};" for j in range(step) if f"{var}_{j}" in named]


def _vector_width(values: list[int], length: int, least: int) -> int:
    """Lanes a vector walk takes: 16 bytes of the narrowest of `values` (their float itemsizes: 8
    bfloat16 or 4 float32 values), halved until they divide `length`; 0 where fewer than `least`."""
    step = 16 // min(values, default=16)
    while step >= least and length % step:
        step //= 2
    return step if step >= least else 0


def _float_sizes(sub: Graph, nodes: Any) -> list[int]:
    return [sub.type(n).dtype.itemsize for n in nodes if sub.type(n).dtype.is_float]


def _vector_step(sub: Graph, low: Any) -> int:
    """Elements a step of a split reduction's innermost loop walks (`_vector_width` of its float
    inputs and the loop's length; at least 2)."""
    return _vector_width(_float_sizes(sub, sub.inputs.values()), low.loops[-1][1], 2) if low.loops else 0


def _pointwise_step(sub: Graph, rows: int) -> int:
    """Elements a thread of a pointwise kernel computes as vectors: 16 bytes of its narrowest float
    input or output (8 bfloat16 or 4 float32 values), halved until it divides a row; 0 where not
    even 4 do (the scalar rows form computes 4 a thread), where its outputs' shapes differ or an
    output's dtype has no vector spelling (an integer or boolean one)."""
    outs = [sub.type(n) for n in sub.outputs.values()]
    if any(t.shape != outs[0].shape for t in outs):
        return 0
    step = _vector_width(_float_sizes(sub, [*sub.inputs.values(), *sub.outputs.values()]), outs[0].numel // rows,
                         ROW_VALUES)
    stored = [sub.type(n).dtype for n in sub.outputs.values()]  # each written as vectors of its own type
    if any(f"vtype:{d.name}:{min(step, 16 // d.itemsize)}" not in SPELLING.ops for d in stored):
        return 0
    return step


def _pairwise(values: list[str], op: str) -> str:
    """The lanes' values combined in pairs, then pairs of pairs (a sum's rounding grows with the
    depth, not the count)."""
    while len(values) > 1:
        pairs = [values[i:i + 2] for i in range(0, len(values), 2)]
        values = [p[0] if len(p) == 1 else f"({p[0]} + {p[1]})" if op == "sum" else f"em_max({p[0]}, {p[1]})"
                  for p in pairs]
    return values[0]


def _scalar_params(extent: Extent | None, index: str) -> str:
    """A kernel's by-value parameters after its buffers (and its own scratch and counters)."""
    return f", const {index} {extent.var}" if extent is not None else ""


def pointwise_epilogue(sub: Graph, spec: KernelSpec) -> cuda_kernels.PointwiseEpilogue | None:
    """The generated epilogue of a contraction spec with a `pointwise` one: the subgraph from the
    contraction's value (`red` in the body) to the output, at the flat output index `i`."""
    if "pointwise" not in spec.epilogues:
        return None
    out = sub.outputs["out"]
    t = sub.type(out)
    index = _index_type(sub)
    body = Body(sub, SPELLING, prefix="e", index_type=index)
    body.core = spec.param("epilogue_from")
    result = body.value(out, delinearize("i", t.numel, t.shape))
    inputs = tuple(sorted(i for role, i in spec.roles if role == f"in{i}"))
    return cuda_kernels.PointwiseEpilogue(tuple(body.lines), result, inputs, index, _by_channel(sub, spec, index))


def _by_channel(sub: Graph, spec: KernelSpec, index: str) -> tuple[tuple[str, ...], tuple[str, ...], str] | None:
    """A 4-d (NCHW) output's epilogue at image `img`, channel `o` and pixel `pix` (h * W + w),
    split into the statements of the channel alone and those of each element."""
    t = sub.type(sub.outputs["out"])
    if t.rank != 4:
        return None
    n, c, h, w = t.shape
    body = Body(sub, SPELLING, prefix="e", index_type=index, levels={"o": 0, "img": 1, "pix": 1, "red": 1})
    body.core = spec.param("epilogue_from")
    coords = [Term("img", 1, None, n) if n != 1 else None, Term("o", 1, None, c) if c != 1 else None,
              Term("pix", w, None, h * w) if h != 1 else None, Term("pix", 1, w, h * w).simplified() if w != 1 else None]
    result = body.value(sub.outputs["out"], coords)
    return tuple(body.by_level[0]), tuple(body.by_level[1]), result


def render_contraction(name: str, sub: Graph, spec: KernelSpec) -> tuple[cuda_kernels.CudaKernel, dict[str, str | None]]:
    """The kernel of the family and plan stamped on `spec` (by `select`; chosen here for a spec
    that was not through it); returns it and its roles -> subgraph input names ("out" for the result)."""
    choice = spec.choice or cuda_choices.choose(sub, spec)
    if spec.kind in pool_kernels.POOL_KINDS:  # no epilogues; x (and dy) in, out
        x_t = sub.type(sub.operands(spec.core)[0])
        if x_t.dtype.name not in ("float32", "bfloat16"):
            raise NotImplementedError(f"device='cuda' compiles {spec.kind} for float32 and bfloat16 only, got "
                                      f"{x_t.dtype.name} (at {sub.loc(spec.core) or name}); use float32 or "
                                      f"device='reference'")
        return (cuda_choices.render(name, sub, spec, choice), {**{role: f"in{i}" for role, i in spec.roles}, "out": "out"})
    if unknown := [e for e in spec.epilogues if e not in cuda_choices.EPILOGUES.get(spec.kind, {"pointwise"})]:
        raise NotImplementedError(f"the CUDA {spec.kind} template has no {', '.join(unknown)} epilogue (at {name}); "
                                  f"the target's FusionCaps must not advertise it")
    inputs = {role: f"in{i}" for role, i in spec.roles}
    kernel = cuda_choices.render(name, sub, spec, choice, pointwise_epilogue(sub, spec))
    if spec.kind == "conv2d_grad_input" and "relu_mask" in spec.epilogues:
        inputs["mask_src"] = inputs["mask"]  # the templates' name for the forward ReLU's output
    return kernel, {**inputs, "out": "out"}


def render_loss(name: str, sub: Graph, spec: KernelSpec,
                runtime: bool | None = None) -> tuple[cuda_kernels.CudaKernel, dict[str, str]]:
    """The softmax cross-entropy kernel for a `softmax_xent` spec (the loss, one block: its sum
    has a fixed tree) or the gradient kernel for a `softmax_xent_grad` one (dlogits, one thread a
    row over many blocks), and its roles; with `runtime` (default: as its plan says), the rows a
    by-value argument."""
    n_rows, n_cls = sub.type(sub.inputs[f"in{spec.role('logits')}"]).shape
    runtime = cuda_choices.runtime_plan(spec) if runtime is None else runtime
    roles = {"logits": f"in{spec.role('logits')}", "labels": f"in{spec.role('labels')}"}
    if spec.kind == "softmax_xent_grad":
        return (cuda_kernels.render_softmax_cross_entropy_grad(name, N=n_rows, C=n_cls, runtime_rows=runtime),
                {**roles, "dlogits": "out"})
    kernel = cuda_kernels.render_softmax_cross_entropy(name, N=n_rows, C=n_cls, runtime_rows=runtime)
    return kernel, {**roles, "loss": "out"}


def reduction_facts(sub: Graph, core: int) -> dict[str, Any]:
    """What the reduction families decide on, from the lowering (no rendering): the scratch bytes
    of the one-plan family's split partials (and, under "runtime", of its kernel on run-time
    sizes: a dict, which no database key reads), and, for a column sum (`column_sum`), its rows,
    contiguous outputs and sums (which the `columns` family serves)."""
    low = lower_reduction(sub, core, SPELLING, index_type=_index_type(sub))
    moments = None  # the split form's lowering (its partials' slots), where a layout splits
    facts: dict[str, Any] = {}
    for runtime in (False, True):
        layout = reduction_layout(sub, core, low, runtime=runtime)
        if layout.mode == "split" and moments is None:
            moments = lower_reduction(sub, core, SPELLING, index_type=_index_type(sub), moments=True)
        scratch = _split_scratch(moments, layout.splits) if layout.mode == "split" else 0
        facts.update({"runtime": {"scratch": scratch}} if runtime else {"reduction_scratch": scratch})
    if column_sum(low, sub, core, COLUMN_MIN_OUTPUTS):
        facts.update(rows=low.loops[0][1], outputs=low.outputs, sums=len(low.accs))
    return facts


# Column sums (a bias's or a normalisation's parameter gradient over a [rows, features]
# activation, which the reductions above read with a row's stride an output: ViT's at batch 1024,
# 16384 x 64, took 22-33 us each alone on an H200) may instead run row by row, the `columns`
# family (taken where the tuner measured it faster: `cuda_choices`): a block is COLUMN_TILE
# adjacent outputs, a warp's lanes on one row's contiguous values, by COLUMN_LANES row lanes.
COLUMN_MIN_OUTPUTS = 16
COLUMN_TILE = 32
COLUMN_LANES = THREADS // COLUMN_TILE
COLUMN_MIN_ROWS = 12 * COLUMN_LANES  # a split's rows at least: 12 a thread, as REDUCTION_MIN_PER_BLOCK


def column_splits(rows: int, outputs: int) -> int:
    """The cost model's blocks along the rows of a column sum: enough blocks to fill the GPU
    (REDUCTION_BLOCKS_PER_SM a multiprocessor), each at least COLUMN_MIN_ROWS rows."""
    tiles = math.ceil(outputs / COLUMN_TILE)
    target = REDUCTION_BLOCKS_PER_SM * current().multiprocessors
    return max(1, min(math.ceil(target / tiles), rows // COLUMN_MIN_ROWS))


def column_split_plan(rows: int, splits: int) -> tuple[int, int]:
    """(splits, rows a split takes), no split empty."""
    return _even_chunks(rows, splits)


def column_scratch(rows: int, outputs: int, sums: int, splits: int) -> int:
    """Bytes of a split column sum's double partials: one per sum, split and output."""
    n, _ = column_split_plan(rows, splits)
    return sums * n * outputs * 8 if n > 1 else 0


def render_columns(name: str, sub: Graph, core: int, splits: int) -> ReductionKernel:
    """A column sum row by row (`reduction_columns.j2`), in `splits` blocks along the rows whose
    double partials the last block of each tile adds in split order (a counter a tile)."""
    index = _index_type(sub)
    low = lower_reduction(sub, core, SPELLING, index_type=index, columns=True)
    (row, rows), (only,) = low.loops[0], low.passes
    splits, chunk = column_split_plan(rows, splits)
    tiles = math.ceil(low.outputs / COLUMN_TILE)
    code = ENV.get_template("reduction_columns.j2").render(
        name=name, ops="+".join(dict.fromkeys(a.op for a in only.accs)), rows=rows, outputs=low.outputs,
        out_type=_out_types(sub), params=_signature(sub), accs=only.accs, per_row=only.pre,
        per_element=only.levels[0], epilogue=low.epilogue, results=low.results, row=row, index=index,
        splits=splits, chunk=chunk, tile=COLUMN_TILE, lanes=COLUMN_LANES, threads=THREADS)
    extra = ("scratch", cuda_kernels.counter_role(tiles)) if splits > 1 else ()
    return ReductionKernel(code, ((name, (tiles, splits, 1), (THREADS, 1, 1), extra),),
                           column_scratch(rows, low.outputs, len(only.accs), splits))


def render_reduction_choice(name: str, sub: Graph, spec: KernelSpec) -> ReductionKernel:
    """A reduction kernel of the family stamped on its spec: `columns` (row by row, its plan's
    splits) or the general one (`render_reduction`)."""
    if spec.choice is not None and spec.choice[0] == "columns":
        return render_columns(name, sub, spec.core, dict(spec.choice[1])["splits"])
    return render_reduction(name, sub, spec.core, runtime=cuda_choices.runtime_plan(spec))


def prelude(bf16: bool = False) -> str:
    """The source every module of a step starts with (helpers the kernels share; with `bf16`, the
    bfloat16 ones: only steps that have bfloat16 values)."""
    return ENV.get_template("prelude.j2").render(bf16=bf16)


def _kernel_own(role: str) -> bool:
    """Whether a launch role is memory of the kernel's own (its scratch or counters), not a value."""
    return cuda_kernels.scratch_offset(role) is not None or cuda_kernels.counter_words(role) is not None


def _image_of(graph: Graph, n: int, role: str) -> tuple[str, int]:
    """The buffer a kernel's image argument `role` names: the scratch of the kernel that relaid it."""
    owner = graph.notes(n).get("reads_scratch_of", {}).get(role)
    if owner is None:
        raise AssertionError(f"%{n} ({graph.attrs(n)['graph'].name}) takes a relaid {role} but no "
                             f"notes['reads_scratch_of'] names the kernel holding it")
    return ("scratch", owner)


def _kernel_launches(graph: Graph, n: int, spec: KernelSpec, check_scratch: bool = True) -> tuple[str, list[LaunchArgs]]:
    """The code of fused kernel `n` as `spec` chooses it (its own, or the variant a step of another
    batch size renders: `_reused_variant`), and its launches bound to the graph's nodes; with
    `check_scratch`, the scratch its kernel needs must be what the plan reserved."""
    sub = graph.attrs(n)["graph"]
    name = sub.name
    operands = graph.operands(n)
    node_of = {f"in{i}": ("node", o) for i, o in enumerate(operands)} | {
        out: ("node", m) for out, m in zip(sub.outputs, graph.results(n))}
    launches: list[LaunchArgs] = []
    if spec.kind in ("pointwise", "reduction"):
        args = tuple(node_of[f"in{i}"] for i in range(len(operands))) + tuple(node_of[k] for k in sub.outputs)
        if spec.kind == "pointwise":
            # an update of parameters and state alone keeps their sizes in its code (no batch)
            fixed = _writes_state_alone(graph, n)
            code, grid, block, scalars = render_pointwise(name, sub, fixed=fixed, runtime=cuda_choices.runtime_plan(spec))
            launches.append(LaunchArgs(name, grid, block, 0, args, name, scalars))
        else:
            red = render_reduction_choice(name, sub, spec)
            if check_scratch and red.scratch_bytes != spec.scratch_bytes:
                raise AssertionError(f"{name}: reduction needs {red.scratch_bytes} scratch bytes, "
                                     f"the plan reserved {spec.scratch_bytes}")
            code = red.code
            for function, grid, block, extra in red.launches:
                launches.append(LaunchArgs(function, grid, block, 0, args + tuple((role, n) for role in extra), name,
                                           red.scalars))
        return code, launches
    if spec.kind in ("softmax_xent", "softmax_xent_grad"):
        kernel, roles = render_loss(name, sub, spec)
    else:
        kernel, roles = render_contraction(name, sub, spec)
    if check_scratch and kernel.scratch_bytes != spec.scratch_bytes:
        raise AssertionError(f"{name}: template needs {kernel.scratch_bytes} scratch bytes, "
                             f"the plan reserved {spec.scratch_bytes}")
    for launch in kernel.launches:
        args = tuple(_image_of(graph, n, r) if r in cuda_kernels.IMAGE_ROLES else
                     (roles.get(r, r), n) if _kernel_own(roles.get(r, r)) else node_of[roles[r]] for r in launch.args)
        launches.append(LaunchArgs(launch.function, launch.grid, launch.block, launch.shared_bytes, args, name,
                                   launch.scalars))
    return kernel.code, launches


def render_step(graph: Graph) -> CudaStepSource:
    """Every kernel of a fused, memory-planned graph in one CUDA source, and the launches in order.

    Kernels whose code is the same up to their name (the same convolution shape twice, say) are
    one function: the later ones launch the first one's, with their own buffers."""
    shared = prelude(bf16=has_narrow(graph))
    parts = [shared]
    launches: list[LaunchArgs] = []
    kernels = []
    units: list[tuple[str, tuple[str, ...]]] = []
    defined: dict[str, str] = {}  # code with its kernel's name blanked -> the kernel that defines it
    for n in graph.meta["schedule"]:
        if graph.op(n) != "fused":
            continue
        spec, sub = graph.attrs(n)["kernel"], graph.attrs(n)["graph"]
        name = sub.name
        implements = graph.notes(n).get("implements", [])
        header = f"// ---- {name}: {spec.describe()} -> {graph.type(n)}\n" + "".join(f"//   implements {line}\n" for line in implements)
        if spec.kind == "collective":
            attrs = sub.attrs(spec.core)
            if sub.op(spec.core) != "all_reduce" or attrs["group"] != "world":
                raise NotImplementedError(f"the CUDA step runs all_reduce over the whole world only, not "
                                          f"{sub.op(spec.core)!r} over {attrs.get('group')!r} (%{n}, at {graph.loc(n)})")
            # no kernel: the runtime's communicator (NCCL) reduces in0 into out on the step's stream
            launches.append(LaunchArgs(f"{COLLECTIVE_PREFIX}{attrs['reduce']}", (0, 0, 0), (0, 0, 0), 0,
                                       (("node", graph.operands(n)[0]), ("node", graph.results(n)[0])), name))
            kernels.append((name, spec.describe(), implements))
            continue
        code, mine = _kernel_launches(graph, n, spec)
        functions = tuple(dict.fromkeys(la.function for la in mine))
        canonical = code.replace(name, "\0") if all(f.startswith(name) for f in functions) else None
        if canonical is not None and canonical in defined:
            first = defined[canonical]
            mine = [dataclasses.replace(la, function=first + la.function[len(name):]) for la in mine]
            parts.append(header + f"// (the same code as {first}: its functions are launched)\n")
        else:
            if canonical is not None:
                defined[canonical] = name
            code = cuda_kernels.with_grid_dependency(code)
            units.append((code, functions))
            parts.append(header + code)
        launches.extend(mine)
        kernels.append((name, spec.describe(), implements))
    return CudaStepSource("\n".join(parts), launches, graph.meta["arena_bytes"], kernels, shared, units)


#: the why a step at another batch size stamps on a kernel whose plan it took from this one
#: (`choices.ChoiceTable.decide`): `cuda_choices.runtime_sizes` renders such a GEMM on run-time sizes
REUSED_WHY = "reused: the plan of this kernel at another batch size"


#: the contraction and pooling families whose kernels a step that took their plans renders on run-time sizes
#: (`cuda_choices.runtime_sizes`): another text than the first step's. A hand list, so a test renders
#: every family both ways on the zoo's kernels and fails when it disagrees (test_cuda_runtime_generated)
RUNTIME_VARIANTS = frozenset({"gemm", "gemm_x3", "grouped", "thin", "skinny_narrow", "small_window", "pool"})


def _writes_state_alone(graph: Graph, n: int) -> bool:
    """Whether a fused kernel writes parameters and optimizer state alone (no batch in its sizes)."""
    return all(graph.notes(m).get("storage") in ("parameter", "state") for m in graph.results(n))


def _reused_variant(graph: Graph, n: int) -> tuple[str, tuple[str, ...]] | None:
    """(code, functions) of a kernel as a step of another batch size that takes its plan renders
    it, where that is another text: a contraction or a pooling on run-time sizes, or a generated
    kernel (pointwise, reduction, loss) on run-time sizes; None for the others (a direct forward's
    text is the same at every size)."""
    spec, sub = graph.attrs(n)["kernel"], graph.attrs(n)["graph"]
    if spec.choice is None or cuda_choices.runtime_plan(spec) or cuda_choices.runtime_sizes(spec):
        return None
    reused = cuda_choices.TABLE.reused_choice(sub, spec)
    if reused is None:
        return None
    family, plan = reused
    if family.reused_plan is None and family.name not in RUNTIME_VARIANTS and family.name == spec.choice[0]:
        return None
    if spec.kind == "pointwise" and _writes_state_alone(graph, n):
        return None  # (its code holds no batch: the same text at every size)
    variant = dataclasses.replace(spec, choice=(family.name, tuple(family.as_reused(plan))), why=REUSED_WHY)
    code, launches = _kernel_launches(graph, n, variant, check_scratch=False)
    return code, tuple(dict.fromkeys(la.function for la in launches))


def reused_variants(graph: Graph) -> list[tuple[str, tuple[str, ...]]]:
    """The units (code, functions) of this step's kernels as a step of another batch size that
    takes their plans renders them (GEMMs and the generated kinds on run-time sizes; kernels
    whose code is the same up to their name one function, as `render_step` makes them): what a
    later batch size of the model will look for in the module cache, so a build can make them
    ahead. A kernel whose variant is its own text is among them too (the build finds it)."""
    units: list[tuple[str, tuple[str, ...]]] = []
    defined: set[str] = set()
    for n in graph.meta["schedule"]:
        if graph.op(n) != "fused" or (variant := _reused_variant(graph, n)) is None:
            continue
        code, functions = variant
        canonical = code.replace(graph.attrs(n)["graph"].name, "\0")
        if canonical not in defined:
            defined.add(canonical)
            units.append((cuda_kernels.with_grid_dependency(code), functions))
    return units
