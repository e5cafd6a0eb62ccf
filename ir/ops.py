"""The primitive op set: each op defined once, with its attribute schema and its type rule.

Every backend, pass and rule table is keyed by the names registered here, so a completeness
test can ask each table for every op. Type rules run when a node is created; a bad shape raises
`ShapeError` naming the op and the operand types (the graph adds the user's source line).

Convolution: `conv2d` (NCHW input, OIHW weight) has two companions, `conv2d_grad_input` and
`conv2d_grad_weight`, as primitives of their own rather than compositions of pad/flip/dilate.
Each is the shape of kernel a backend wants to emit directly (DESIGN.md measures the three conv2
kernels separately and fuses bias-grad into grad-weight); a composition would force every backend
to pattern-match it back. The three are closed under differentiation (each one's VJP is made of
the other two), so higher-order gradients need nothing more. `groups` splits the channels as
PyTorch does: input channel block g (C/groups channels) meets output channel block g (O/groups)
only, so the weight is (O, C/groups, KH, KW) and groups == C is a depthwise convolution; the
three ops carry it alike, and each one's VJP keeps it. Dilation is refused by the frontend with a
clear error; the IR has no attribute for it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .dtypes import DType, TensorType, as_dtype, bool_, float32


class ShapeError(TypeError):
    """An op was applied to operands (or attributes) its type rule rejects."""


REQUIRED = object()


@dataclass(frozen=True)
class Attr:
    convert: Callable[[Any], Any]
    default: Any = REQUIRED


@dataclass(frozen=True)
class OpDef:
    name: str
    arity: int | None  # None: any number of operands
    kind: str  # source | elementwise | reduction | layout | contraction | index | collective | fused
    infer: Callable[[list[TensorType], dict[str, Any]], TensorType]
    attrs: dict[str, Attr] = field(default_factory=dict)
    differentiable: bool = True  # a VJP rule is owed (completeness test)
    int_ok: bool = False  # elementwise ops accepting integer operands


OPS: dict[str, OpDef] = {}


def _defop(name: str, arity: int | None, kind: str, attrs: dict[str, Attr] | None = None, **flags: Any):
    def register(infer):
        OPS[name] = OpDef(name, arity, kind, infer, attrs or {}, **flags)
        return infer
    return register


# ---- attribute converters -------------------------------------------------------------------

def _ints(v: Any) -> tuple[int, ...]:
    return tuple(int(i) for i in (v if isinstance(v, (tuple, list)) else (v,)))


def _pair(v: Any) -> tuple[int, int]:
    t = _ints(v)
    if len(t) == 1:
        t = t * 2
    if len(t) != 2:
        raise ValueError(f"expected an int or a pair, got {v!r}")
    return t  # type: ignore[return-value]


def _name(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise ValueError(f"expected a non-empty name, got {v!r}")
    return v


def _ttype(v: Any) -> TensorType:
    if not isinstance(v, TensorType):
        raise ValueError(f"expected a TensorType, got {v!r}")
    return v


def _array(v: Any) -> np.ndarray:
    a = np.array(v, copy=True)
    as_dtype(a.dtype)
    a.setflags(write=False)
    return a


ATTR_CONVERTERS = {"ints": _ints, "pair": _pair, "name": _name, "type": _ttype, "array": _array,
                   "dtype": as_dtype, "bool": bool, "int": int}


# ---- helpers for rules ----------------------------------------------------------------------

def broadcast_shapes(*shapes: Sequence[int]) -> tuple[int, ...]:
    rank = max(len(s) for s in shapes)
    out = []
    for i in range(rank):
        dims = {s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0}
        dims.discard(1)
        if len(dims) > 1:
            raise ShapeError(f"shapes {' and '.join(str(tuple(s)) for s in shapes)} do not broadcast")
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def _same_dtype(types: Sequence[TensorType]) -> DType:
    dtypes = {t.dtype for t in types}
    if len(dtypes) != 1:
        raise ShapeError(f"operand dtypes differ ({', '.join(t.dtype.name for t in types)}); cast one explicitly")
    return types[0].dtype


def _float_only(name: str, t: TensorType) -> None:
    if not t.dtype.is_float:
        raise ShapeError(f"{name} needs a floating-point operand, got {t.dtype.name}")


def normalize_axes(axes: Sequence[int] | None, rank: int) -> tuple[int, ...]:
    if axes is None:
        return tuple(range(rank))
    out = []
    for a in axes:
        if not -rank <= a < rank:
            raise ShapeError(f"axis {a} out of range for rank {rank}")
        out.append(a % rank)
    if len(set(out)) != len(out):
        raise ShapeError(f"repeated axis in {tuple(axes)}")
    return tuple(sorted(out))


def conv_out_dim(size: int, k: int, stride: int, pad: int) -> int:
    return (size + 2 * pad - k) // stride + 1


# ---- sources ---------------------------------------------------------------------------------

def _source_rule(types, attrs):
    return attrs["type"]


for _src in ("input", "parameter", "state"):
    _defop(_src, 0, "source", {"name": Attr(_name), "type": Attr(_ttype)}, differentiable=False)(_source_rule)


@_defop("constant", 0, "source", {"value": Attr(_array)}, differentiable=False)
def _constant(types, attrs):
    return TensorType.of(attrs["value"])


# ---- elementwise -----------------------------------------------------------------------------

UNARY = ("neg", "exp", "log", "sqrt", "reciprocal", "relu", "sigmoid", "tanh", "abs", "erf",  # erf: exact GELU
         "sin", "cos", "floor")  # cos and floor: learning-rate schedules computed inside the step
BINARY = ("add", "sub", "mul", "div", "maximum", "minimum")
COMPARE = ("eq", "ne", "lt", "le", "gt", "ge")


# Arithmetic on bool that NumPy and PyTorch both refuse (or that would change the result's
# dtype): rejected by the rule rather than failing later in the interpreter or a backend.
_NO_BOOL = ("neg", "sub", "div")


def _no_bool(name: str, types: Sequence[TensorType]) -> None:
    if name in _NO_BOOL and any(t.dtype == bool_ for t in types):
        raise ShapeError(f"{name} is not defined on bool operands; cast to a numeric dtype first")


def _unary_rule(name):
    def rule(types, attrs):
        if name not in ("neg", "abs", "relu"):
            _float_only(name, types[0])
        _no_bool(name, types)
        return types[0]
    return rule


for _u in UNARY:
    # floor's derivative is zero almost everywhere (torch gives zeros): no gradient flows through it
    _defop(_u, 1, "elementwise", int_ok=_u in ("neg", "abs", "relu"), differentiable=_u != "floor")(_unary_rule(_u))


def _binary_rule(name):
    def rule(types, attrs):
        dtype = _same_dtype(types)
        _no_bool(name, types)
        return TensorType(broadcast_shapes(*(t.shape for t in types)), dtype)
    return rule


for _b in BINARY:
    _defop(_b, 2, "elementwise", int_ok=True)(_binary_rule(_b))


def _compare_rule(types, attrs):
    _same_dtype(types)
    return TensorType(broadcast_shapes(*(t.shape for t in types)), bool_)


for _c in COMPARE:
    _defop(_c, 2, "elementwise", differentiable=False, int_ok=True)(_compare_rule)


@_defop("where", 3, "elementwise", int_ok=True)
def _where(types, attrs):
    cond, a, b = types
    if cond.dtype != bool_:
        raise ShapeError(f"where's condition must be bool, got {cond.dtype.name}")
    dtype = _same_dtype([a, b])
    return TensorType(broadcast_shapes(cond.shape, a.shape, b.shape), dtype)


@_defop("stop_gradient", 1, "elementwise", differentiable=False, int_ok=True)
def _stop_gradient(types, attrs):
    """The identity whose value autodiff treats as a constant (JAX's lax.stop_gradient): used
    where a result provably does not depend on a term, e.g. the max shift inside log-softmax."""
    return types[0]


@_defop("cast", 1, "elementwise", {"dtype": Attr(as_dtype)}, int_ok=True)
def _cast(types, attrs):
    return types[0].with_dtype(attrs["dtype"])


def _u32(v: Any) -> int:
    v = int(v)
    if not 0 <= v < 2**32:
        raise ValueError(f"expected an integer in [0, 2**32), got {v}")
    return v


@_defop("random_uniform", 1, "elementwise", {"shape": Attr(_ints), "seed": Attr(_u32, 0), "stream": Attr(_u32, 0)},
        differentiable=False, int_ok=True)
def _random_uniform(types, attrs):
    """float32 uniform in [0, 1) of `shape`, element i a pure function of (seed, step, stream, i)
    (Philox-4x32-10, `ember.ir.philox`): the same bits on every backend and thread count. The
    operand is the step counter (an integer scalar state the step advances), so every step draws
    anew; `stream` tells apart the draws of one step (one per dropout call). Elementwise so that
    it fuses into the kernel that uses it; its index is its own output's row-major index."""
    (step,) = types
    if step.dtype.is_float or step.dtype == bool_ or step.rank != 0:
        raise ShapeError(f"random_uniform's operand is the step counter, an integer scalar; got {step}")
    if any(d < 0 for d in attrs["shape"]):
        raise ShapeError(f"random_uniform: negative dimension in shape {attrs['shape']}")
    return TensorType(attrs["shape"], float32)


# ---- reductions ------------------------------------------------------------------------------

def _reduce_rule(types, attrs):
    (t,) = types
    axes = normalize_axes(attrs["axes"], t.rank)
    if tuple(attrs["axes"]) != axes:
        raise ShapeError(f"axes must be given sorted and non-negative, got {attrs['axes']} (normalised {axes})")
    if attrs["keepdims"]:
        shape = tuple(1 if i in axes else d for i, d in enumerate(t.shape))
    else:
        shape = tuple(d for i, d in enumerate(t.shape) if i not in axes)
    return t.with_shape(shape)


for _r in ("sum", "max"):
    _defop(_r, 1, "reduction", {"axes": Attr(_ints), "keepdims": Attr(bool, False)}, int_ok=True)(_reduce_rule)


@_defop("argmax", 1, "reduction", {"axis": Attr(int)}, differentiable=False, int_ok=True)
def _argmax(types, attrs):
    (t,) = types
    (axis,) = normalize_axes([attrs["axis"]], t.rank)
    return TensorType(tuple(d for i, d in enumerate(t.shape) if i != axis), as_dtype("int64"))


# ---- layout ----------------------------------------------------------------------------------

@_defop("reshape", 1, "layout", {"shape": Attr(_ints)}, int_ok=True)
def _reshape(types, attrs):
    (t,) = types
    shape = attrs["shape"]
    if int(np.prod(shape, dtype=np.int64)) != t.numel or any(d < 0 for d in shape):
        raise ShapeError(f"cannot reshape {t} ({t.numel} elements) to {shape}")
    return t.with_shape(shape)


@_defop("transpose", 1, "layout", {"perm": Attr(_ints)}, int_ok=True)
def _transpose(types, attrs):
    (t,) = types
    perm = attrs["perm"]
    if sorted(perm) != list(range(t.rank)):
        raise ShapeError(f"perm {perm} is not a permutation of the {t.rank} axes of {t}")
    return t.with_shape(tuple(t.shape[p] for p in perm))


@_defop("broadcast_to", 1, "layout", {"shape": Attr(_ints)}, int_ok=True)
def _broadcast_to(types, attrs):
    (t,) = types
    shape = attrs["shape"]
    if len(shape) < t.rank or broadcast_shapes(t.shape, shape) != shape:
        raise ShapeError(f"cannot broadcast {t} to {shape}")
    return t.with_shape(shape)


# ---- contractions ----------------------------------------------------------------------------

@_defop("matmul", 2, "contraction")
def _matmul(types, attrs):
    a, b = types
    dtype = _same_dtype(types)
    if not dtype.is_float:
        raise ShapeError(f"matmul needs floating-point operands, got {dtype.name}")
    if a.rank < 2 or b.rank < 2:
        raise ShapeError(f"matmul needs operands of rank >= 2, got {a} and {b}")
    if a.shape[-1] != b.shape[-2]:
        raise ShapeError(f"matmul contraction mismatch: {a} @ {b} ({a.shape[-1]} != {b.shape[-2]})")
    batch = broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return TensorType(batch + (a.shape[-2], b.shape[-1]), dtype)


_CONV_ATTRS = {"stride": Attr(_pair, (1, 1)), "padding": Attr(_pair, (0, 0)), "groups": Attr(int, 1)}


def _check_conv(name: str, x: TensorType, w: TensorType, attrs) -> tuple[int, int, int, int]:
    _same_dtype([x, w])
    _float_only(name, x)
    if x.rank != 4 or w.rank != 4:
        raise ShapeError(f"{name} needs a 4-D NCHW input and a 4-D OIHW weight, got {x} and {w}")
    groups = attrs["groups"]
    if groups < 1 or w.shape[0] % groups:
        raise ShapeError(f"{name}: groups must be >= 1 and divide the {w.shape[0]} output channels, got groups={groups}")
    if x.shape[1] != w.shape[1] * groups:
        per_group = f" ({w.shape[1]} per group x {groups} groups)" if groups != 1 else ""
        raise ShapeError(f"{name}: input has {x.shape[1]} channels but the weight expects {w.shape[1] * groups}"
                         f"{per_group} ({x} vs {w})")
    (sh, sw), (ph, pw) = attrs["stride"], attrs["padding"]
    if sh < 1 or sw < 1 or ph < 0 or pw < 0:
        raise ShapeError(f"{name}: stride must be >= 1 and padding >= 0, got stride {attrs['stride']} padding {attrs['padding']}")
    ho = conv_out_dim(x.shape[2], w.shape[2], sh, ph)
    wo = conv_out_dim(x.shape[3], w.shape[3], sw, pw)
    if ho < 1 or wo < 1:
        raise ShapeError(f"{name}: kernel {w.shape[2:]} larger than the padded input {x.shape[2:]}")
    return x.shape[0], w.shape[0], ho, wo


@_defop("conv2d", 2, "contraction", dict(_CONV_ATTRS))
def _conv2d(types, attrs):
    x, w = types
    n, o, ho, wo = _check_conv("conv2d", x, w, attrs)
    return TensorType((n, o, ho, wo), x.dtype)


@_defop("conv2d_grad_input", 2, "contraction", {**_CONV_ATTRS, "input_shape": Attr(_ints)})
def _conv2d_grad_input(types, attrs):
    dy, w = types
    xt = TensorType(attrs["input_shape"], dy.dtype)
    expected = _check_conv("conv2d_grad_input", xt, w, attrs)
    if dy.shape != expected:
        raise ShapeError(f"conv2d_grad_input: output gradient {dy} does not match conv output shape {expected}")
    return xt


@_defop("conv2d_grad_weight", 2, "contraction", {**_CONV_ATTRS, "weight_shape": Attr(_ints)})
def _conv2d_grad_weight(types, attrs):
    x, dy = types
    wt = TensorType(attrs["weight_shape"], x.dtype)
    expected = _check_conv("conv2d_grad_weight", x, wt, attrs)
    if dy.shape != expected:
        raise ShapeError(f"conv2d_grad_weight: output gradient {dy} does not match conv output shape {expected}")
    return wt


# ---- pooling ---------------------------------------------------------------------------------
# Windowed like conv2d (kind "contraction": no pass branches on it; fusion gives each its own
# kernel kind). max_pool2d pads with -inf; max_pool2d_grad(x, dy) sends each window's cotangent
# to the window's first maximal element (row-major), PyTorch's choice, so both need x. ceil_mode
# is PyTorch's: the output size rounds up, and a last window that would start in the right
# padding is dropped; the elements a window overhangs count as -inf.

_POOL_ATTRS = {"kernel": Attr(_pair), "stride": Attr(_pair), "padding": Attr(_pair, (0, 0)),
               "ceil_mode": Attr(bool, False)}


def pool_out_dim(size: int, k: int, stride: int, pad: int, ceil_mode: bool) -> int:
    """PyTorch's pooling output size (torch's pooling_output_shape)."""
    if not ceil_mode:
        return conv_out_dim(size, k, stride, pad)
    out = -(-(size + 2 * pad - k) // stride) + 1
    if (out - 1) * stride >= size + pad:  # the last window would start inside the right padding
        out -= 1
    return out


def _pool_out(name: str, x: TensorType, attrs) -> tuple[int, int, int, int]:
    _float_only(name, x)
    if x.rank != 4:
        raise ShapeError(f"{name} needs a 4-D NCHW input, got {x}")
    (kh, kw), (sh, sw), (ph, pw) = attrs["kernel"], attrs["stride"], attrs["padding"]
    if min(kh, kw, sh, sw) < 1 or ph < 0 or pw < 0 or 2 * ph > kh or 2 * pw > kw:
        raise ShapeError(f"{name}: kernel and stride must be >= 1 and padding at most half the kernel, got kernel "
                         f"{attrs['kernel']} stride {attrs['stride']} padding {attrs['padding']}")
    ceil = attrs["ceil_mode"]
    ho, wo = pool_out_dim(x.shape[2], kh, sh, ph, ceil), pool_out_dim(x.shape[3], kw, sw, pw, ceil)
    if ho < 1 or wo < 1:
        raise ShapeError(f"{name}: kernel {attrs['kernel']} larger than the padded input {x.shape[2:]}")
    return x.shape[0], x.shape[1], ho, wo


@_defop("max_pool2d", 1, "contraction", dict(_POOL_ATTRS))
def _max_pool2d(types, attrs):
    (x,) = types
    return x.with_shape(_pool_out("max_pool2d", x, attrs))


@_defop("max_pool2d_grad", 2, "contraction", dict(_POOL_ATTRS))
def _max_pool2d_grad(types, attrs):
    x, dy = types
    _same_dtype(types)
    if dy.shape != _pool_out("max_pool2d_grad", x, attrs):
        raise ShapeError(f"max_pool2d_grad: output gradient {dy} does not match the pooled shape of {x}")
    return x


# ---- indexing --------------------------------------------------------------------------------

@_defop("one_hot", 1, "index", {"num_classes": Attr(int), "dtype": Attr(as_dtype, float32)}, differentiable=False, int_ok=True)
def _one_hot(types, attrs):
    (t,) = types
    if t.dtype.is_float or t.dtype == bool_:
        raise ShapeError(f"one_hot needs integer labels, got {t.dtype.name}")
    if attrs["num_classes"] < 1:
        raise ShapeError(f"one_hot needs num_classes >= 1, got {attrs['num_classes']}")
    return TensorType(t.shape + (attrs["num_classes"],), attrs["dtype"])


# ---- collectives ----------------------------------------------------------------------------
# A collective combines the values that every rank of a named group holds for the same node. Its
# meaning needs a world of ranks: `ember.ir.world.run_world` evaluates N ranks in lockstep, and
# the plain single-process `run` is a world of size 1 (all_reduce is then the identity). Passes
# must not constant-fold a collective, and fusion keeps each one a kernel of its own.

REDUCE_OPS = ("sum", "mean")


def _reduce_op(v: Any) -> str:
    if v not in REDUCE_OPS:
        raise ValueError(f"expected one of {', '.join(REDUCE_OPS)}, got {v!r}")
    return v


@_defop("all_reduce", 1, "collective", {"reduce": Attr(_reduce_op), "group": Attr(_name, "world")})
def _all_reduce(types, attrs):
    """Every rank of `group` gets the sum (or mean) over the group's ranks of its operand."""
    (t,) = types
    _float_only("all_reduce", t)
    return t


# ---- fusion groups ---------------------------------------------------------------------------

def _kernel_spec(v: Any) -> Any:
    from .kernel import KernelSpec
    if isinstance(v, str):  # shorthand for a generated kernel without a core (tests, hand-built graphs)
        v = KernelSpec(v)
    if not isinstance(v, KernelSpec):
        raise ValueError(f"expected a KernelSpec, got {type(v).__name__}")
    return v


@_defop("fused", None, "fused", {"graph": Attr(lambda g: g), "kernel": Attr(_kernel_spec, "pointwise")},
        differentiable=False, int_ok=True)
def _fused(types, attrs):
    sub = attrs["graph"]
    ins = [sub.type(n) for n in sub.inputs.values()]
    if [t for t in ins] != list(types):
        raise ShapeError(f"fused group expects operands {[str(t) for t in ins]}, got {[str(t) for t in types]}")
    # a kernel with several outputs (`KernelSpec.outputs`) is typed by its first, "out"; each
    # further one is read through a `fused_output` node
    return sub.type(sub.outputs["out"])


@_defop("fused_output", 1, "fused", {"output": Attr(_name), "type": Attr(_ttype)}, differentiable=False, int_ok=True)
def _fused_output(types, attrs):
    """Output `output` (not "out") of the multi-output fused node it reads: the buffer that kernel
    writes besides its own. Its type is an attribute, checked against the kernel's subgraph by the
    verifier (a type rule sees operand types only)."""
    if attrs["output"] == "out":
        raise ShapeError("fused_output: output 'out' is the fused node's own value; read the fused node")
    return attrs["type"]


# ---- checking --------------------------------------------------------------------------------

def check_attrs(op: OpDef, attrs: dict[str, Any]) -> dict[str, Any]:
    unknown = set(attrs) - set(op.attrs)
    if unknown:
        raise ShapeError(f"{op.name}: unknown attribute(s) {sorted(unknown)}; expected {sorted(op.attrs)}")
    out = {}
    for key, spec in op.attrs.items():
        if key in attrs and attrs[key] is not None:
            try:
                out[key] = spec.convert(attrs[key])
            except (TypeError, ValueError) as e:
                raise ShapeError(f"{op.name}: bad attribute {key}={attrs[key]!r}: {e}") from None
        elif spec.default is REQUIRED:
            raise ShapeError(f"{op.name}: missing attribute {key!r}")
        else:
            out[key] = spec.default
    return out


def infer_type(name: str, types: Sequence[TensorType], attrs: dict[str, Any]) -> tuple[TensorType, dict[str, Any]]:
    """Validates operands and attributes of op `name`; returns (result type, normalised attrs)."""
    op = OPS.get(name)
    if op is None:
        raise ShapeError(f"unknown op {name!r}")
    try:
        if op.arity is not None and len(types) != op.arity:
            raise ShapeError(f"{name} takes {op.arity} operand(s), got {len(types)}")
        attrs = check_attrs(op, attrs)
        if op.kind == "elementwise" and not op.int_ok:
            for t in types:
                _float_only(name, t)
        return op.infer(list(types), attrs), attrs
    except ShapeError as e:
        msg = str(e)
        if not msg.startswith(name):
            msg = f"{name}: {msg}"
        shown = ", ".join(str(t) for t in types)  # only on failure: formatting every type was a cost per node
        raise ShapeError(f"{msg} (operands: {shown or 'none'})") from None
