"""The NumPy reference interpreter: the semantics every pass and backend is tested against.

`run(graph, inputs, parameters, states)` evaluates outputs and updates. With
`precision="float64"` every float32 value is computed in float64 (the oracle for gradient and
tolerance checks); integer and bool values keep their types.

bfloat16 values are computed in float32 (a contraction of bfloat16 operands accumulates in
float32, as the tensor-core and `vdpbf16ps` kernels do) and every bfloat16 node's result is then
rounded to the nearest bfloat16, ties to even (`dtypes.round_bf16`): the value an eager
framework stores after each op. Inside `run` they are float32 arrays (float64 ones under
`precision="float64"`, still rounded: the rounding is part of the graph's meaning); a bfloat16
input or parameter may be given as uint16 bits or as floats (rounded), and a bfloat16 output is
returned as float32 values.

`run` is one process, i.e. a world of size 1, where a collective such as `all_reduce` is the
identity; `ember.ir.world.run_world` runs N ranks of a graph together (a simulated world).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from . import philox
from .dtypes import TensorType, as_values, round_bf16
from .graph import Graph

Impl = Callable[[list[np.ndarray], dict[str, Any], TensorType], np.ndarray]


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # Split by sign so that exp never overflows (and no warning is raised for large |x|).
    out = np.empty_like(x)
    pos = x >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-x[pos]))
    ex = np.exp(x[~pos])
    out[~pos] = ex / (1.0 + ex)
    return out


def _windows(x: np.ndarray, kh: int, kw: int, stride: tuple[int, int], padding: tuple[int, int]) -> np.ndarray:
    """(N, C, Ho, Wo, KH, KW) view of the padded input, one window per output pixel."""
    (sh, sw), (ph, pw) = stride, padding
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw))) if ph or pw else x
    win = sliding_window_view(xp, (kh, kw), axis=(2, 3))
    return win[:, :, ::sh, ::sw]


def _conv2d(args, attrs, t):
    x, w = args
    win = _windows(x, w.shape[2], w.shape[3], attrs["stride"], attrs["padding"])
    win = win[:, :, : t.shape[2], : t.shape[3]]
    return np.ascontiguousarray(np.tensordot(win, w, axes=([1, 4, 5], [1, 2, 3])).transpose(0, 3, 1, 2))


def _conv2d_grad_weight(args, attrs, t):
    x, dy = args
    win = _windows(x, t.shape[2], t.shape[3], attrs["stride"], attrs["padding"])
    win = win[:, :, : dy.shape[2], : dy.shape[3]]
    return np.ascontiguousarray(np.tensordot(dy, win, axes=([0, 2, 3], [0, 2, 3])))


def _conv2d_grad_input(args, attrs, t):
    dy, w = args
    (sh, sw), (ph, pw) = attrs["stride"], attrs["padding"]
    n, c, h, wd = t.shape
    _, _, kh, kw = w.shape
    ho, wo = dy.shape[2], dy.shape[3]
    dxp = np.zeros((n, c, h + 2 * ph, wd + 2 * pw), dtype=dy.dtype)
    for i in range(kh):
        for j in range(kw):
            contrib = np.tensordot(dy, w[:, :, i, j], axes=([1], [0])).transpose(0, 3, 1, 2)
            dxp[:, :, i: i + sh * ho: sh, j: j + sw * wo: sw] += contrib
    return np.ascontiguousarray(dxp[:, :, ph: ph + h, pw: pw + wd])


def _grouped(impl, splits: tuple[int, int], axis_out: int):
    """A convolution op with `groups` > 1: the ungrouped impl on each group's channel blocks, the
    results side by side. `splits` names the channel axis of each operand that is split (1 for an
    activation, 0 for a weight), `axis_out` the result's."""
    def run(args, attrs, t):
        groups = attrs["groups"]
        if groups == 1:
            return impl(args, attrs, t)
        shape = list(t.shape)
        shape[axis_out] //= groups
        blocks = [np.split(a, groups, axis=ax) for a, ax in zip(args, splits)]
        return np.concatenate([impl([b[g] for b in blocks], attrs, t.with_shape(tuple(shape))) for g in range(groups)],
                              axis=axis_out)
    return run


def _pool_padded(x: np.ndarray, attrs, out_hw: tuple[int, int]) -> np.ndarray:
    """x padded with -inf: `padding` on each side, plus what ceil_mode's last windows overhang."""
    (kh, kw), (sh, sw), (ph, pw) = attrs["kernel"], attrs["stride"], attrs["padding"]
    extra_h = max(0, (out_hw[0] - 1) * sh + kh - (x.shape[2] + 2 * ph))
    extra_w = max(0, (out_hw[1] - 1) * sw + kw - (x.shape[3] + 2 * pw))
    if not (ph or pw or extra_h or extra_w):
        return x
    return np.pad(x, ((0, 0), (0, 0), (ph, ph + extra_h), (pw, pw + extra_w)), constant_values=-np.inf)


def _pool_windows(x: np.ndarray, attrs, out_hw: tuple[int, int]) -> np.ndarray:
    """(N, C, Ho, Wo, KH*KW) windows of x padded with -inf."""
    kh, kw = attrs["kernel"]
    win = _windows(_pool_padded(x, attrs, out_hw), kh, kw, attrs["stride"], (0, 0))[:, :, : out_hw[0], : out_hw[1]]
    return win.reshape(win.shape[:4] + (kh * kw,))


def _max_pool2d(args, attrs, t):
    # the value of the first maximal element (as PyTorch and the kernels): np.max's pick between
    # -0.0 and +0.0 is unspecified
    win = _pool_windows(args[0], attrs, t.shape[2:])
    return np.take_along_axis(win, win.argmax(axis=-1)[..., None], axis=-1)[..., 0]


def _max_pool2d_grad(args, attrs, t):
    x, dy = args
    (kh, kw), (sh, sw), (ph, pw) = attrs["kernel"], attrs["stride"], attrs["padding"]
    n, c, ho, wo = dy.shape
    first = _pool_windows(x, attrs, (ho, wo)).argmax(axis=-1)  # the first maximum, as PyTorch
    rows = np.arange(ho)[:, None] * sh + first // kw
    cols = np.arange(wo)[None, :] * sw + first % kw
    xp_shape = _pool_padded(x, attrs, (ho, wo)).shape
    dxp = np.zeros((n, c) + xp_shape[2:], dtype=dy.dtype)
    ni, ci = np.arange(n)[:, None, None, None], np.arange(c)[None, :, None, None]
    np.add.at(dxp, (ni, ci, rows, cols), dy)  # overlapping windows may pick the same element
    return dxp[:, :, ph: ph + x.shape[2], pw: pw + x.shape[3]]


def _reduce(fn):
    return lambda a, at, t: np.asarray(fn(a[0], axis=tuple(at["axes"]), keepdims=at["keepdims"]))


def _fused(args, attrs, t):
    sub: Graph = attrs["graph"]
    res = run(sub, dict(zip(sub.inputs, args)), keep_dtypes=True)
    return res.outputs["out"]


def _fused_output(args, attrs, t):
    # `_compute` answers it from the values its fused node left (it needs the node, not its value)
    raise NotImplementedError("fused_output is evaluated by `run` from its fused node's outputs")


# NumPy has no erf: math.erf per element (double precision, then cast), the reference's accuracy
# matters more than its speed.
_erf = np.frompyfunc(math.erf, 1, 1)


IMPLS: dict[str, Impl] = {
    "neg": lambda a, at, t: -a[0],
    "exp": lambda a, at, t: np.exp(a[0]),
    "log": lambda a, at, t: np.log(a[0]),
    "sqrt": lambda a, at, t: np.sqrt(a[0]),
    "reciprocal": lambda a, at, t: 1 / a[0],
    "relu": lambda a, at, t: np.maximum(a[0], 0).astype(a[0].dtype),
    "sigmoid": lambda a, at, t: _sigmoid(a[0]),
    "tanh": lambda a, at, t: np.tanh(a[0]),
    "abs": lambda a, at, t: np.abs(a[0]),
    "erf": lambda a, at, t: np.asarray(_erf(a[0]), dtype=a[0].dtype),
    "sin": lambda a, at, t: np.sin(a[0]),
    "cos": lambda a, at, t: np.cos(a[0]),
    "floor": lambda a, at, t: np.floor(a[0]),
    "add": lambda a, at, t: a[0] + a[1],
    "sub": lambda a, at, t: a[0] - a[1],
    "mul": lambda a, at, t: a[0] * a[1],
    "div": lambda a, at, t: a[0] / a[1] if t.dtype.is_float else np.floor_divide(a[0], a[1]),
    "maximum": lambda a, at, t: np.maximum(a[0], a[1]),
    "minimum": lambda a, at, t: np.minimum(a[0], a[1]),
    "eq": lambda a, at, t: a[0] == a[1],
    "ne": lambda a, at, t: a[0] != a[1],
    "lt": lambda a, at, t: a[0] < a[1],
    "le": lambda a, at, t: a[0] <= a[1],
    "gt": lambda a, at, t: a[0] > a[1],
    "ge": lambda a, at, t: a[0] >= a[1],
    "where": lambda a, at, t: np.where(a[0], a[1], a[2]),
    "cast": lambda a, at, t: a[0].astype(at["dtype"].compute),
    "stop_gradient": lambda a, at, t: a[0],
    "random_uniform": lambda a, at, t: philox.uniform(t.shape, at["seed"], int(a[0]), at["stream"]),
    "sum": _reduce(np.sum),
    "max": _reduce(np.max),
    "argmax": lambda a, at, t: np.argmax(a[0], axis=at["axis"]).astype(np.int64),
    "reshape": lambda a, at, t: a[0].reshape(at["shape"]),
    # np.asarray(order="C"), not np.ascontiguousarray: the latter turns a 0-d result into shape (1,)
    "transpose": lambda a, at, t: np.asarray(a[0].transpose(at["perm"]), order="C"),
    "broadcast_to": lambda a, at, t: np.asarray(np.broadcast_to(a[0], at["shape"]), order="C"),
    "matmul": lambda a, at, t: np.matmul(a[0], a[1]),
    "conv2d": _grouped(_conv2d, (1, 0), 1),
    "conv2d_grad_input": _grouped(_conv2d_grad_input, (1, 0), 1),
    "conv2d_grad_weight": _grouped(_conv2d_grad_weight, (1, 1), 0),
    "max_pool2d": _max_pool2d,
    "max_pool2d_grad": _max_pool2d_grad,
    "one_hot": lambda a, at, t: (a[0][..., None] == np.arange(at["num_classes"])),
    "fused": _fused,
    "fused_output": _fused_output,
    # A single process is a world of one rank: the reduction over the group is the value itself.
    # `ember.ir.world.run_world` evaluates collectives over a simulated world of N ranks.
    "all_reduce": lambda a, at, t: a[0],
}
SOURCES = ("input", "parameter", "state", "constant")


@dataclass
class Result:
    outputs: dict[str, np.ndarray]
    updates: dict[str, np.ndarray]


def _compute_dtype(t: TensorType, precision: str | None) -> np.dtype:
    if precision == "float64" and t.dtype.is_float:
        return np.dtype(np.float64)
    return t.dtype.compute


def _fetch(kind: str, table: Mapping[str, Any], name: str, t: TensorType) -> np.ndarray:
    if name not in table:
        raise KeyError(f"missing {kind} {name!r} ({t}); given: {sorted(table)}")
    value = np.asarray(table[name])
    if value.shape != t.shape:
        raise ValueError(f"{kind} {name!r}: expected shape {t.shape}, got {value.shape}")
    if t.dtype.compute != t.dtype.numpy and value.dtype == t.dtype.numpy:  # bfloat16 bits
        value = as_values(value, t.dtype)
    return value


def run(graph: Graph, inputs: Mapping[str, Any] = {}, parameters: Mapping[str, Any] = {},
        states: Mapping[str, Any] = {}, *, precision: str | None = None, keep_dtypes: bool = False) -> Result:
    """Evaluates every output and update of `graph`.

    precision: None computes in each value's own dtype; "float64" computes floats in float64.
    keep_dtypes: trust the given arrays' dtypes (used inside fused groups, whose operands were
    computed by the enclosing run in its precision).
    """
    values: dict[int, np.ndarray] = {}
    for n in graph.topo_order():
        values[n] = _finish(graph, n, _compute(graph, n, values, inputs, parameters, states), precision, keep_dtypes)
    return _result(graph, values)


def _compute(graph: Graph, n: int, values: Mapping[int, np.ndarray], inputs: Mapping[str, Any],
             parameters: Mapping[str, Any], states: Mapping[str, Any]) -> Any:
    """Node n's raw value from its operands' values (or from the tables, for a source)."""
    op, attrs, t = graph.op(n), graph.attrs(n), graph.type(n)
    if op == "constant":
        return as_values(attrs["value"], t.dtype) if t.dtype.compute != t.dtype.numpy else attrs["value"]
    if op in ("input", "parameter", "state"):
        table = {"input": inputs, "parameter": parameters, "state": states}[op]
        return _fetch(op, table, attrs["name"], t)
    if op == "fused" and len(attrs["graph"].outputs) > 1:
        # a kernel with several outputs: the extra ones wait under (node, name) for their
        # fused_output readers (`values` is the caller's dict of results)
        sub: Graph = attrs["graph"]
        res = run(sub, dict(zip(sub.inputs, (values[o] for o in graph.operands(n)))), keep_dtypes=True)
        for name, v in res.outputs.items():
            if name != "out":
                values[(n, name)] = v  # type: ignore[index]
        return res.outputs["out"]
    if op == "fused_output":
        (f,) = graph.operands(n)
        return values[(f, attrs["output"])]  # type: ignore[index]
    impl = IMPLS.get(op)
    if impl is None:
        raise NotImplementedError(f"the reference interpreter has no rule for op {op!r}")
    return impl([values[o] for o in graph.operands(n)], attrs, t)


def _finish(graph: Graph, n: int, v: Any, precision: str | None, keep_dtypes: bool) -> np.ndarray:
    """Checks the computed value's shape and casts it to the dtype `run` computes node n in."""
    op, t = graph.op(n), graph.type(n)
    want = _compute_dtype(t, precision)
    v = np.asarray(v)
    if v.shape != t.shape:
        raise AssertionError(f"interpreter bug: %{n} = {op} computed shape {v.shape}, its type is {t}")
    if not keep_dtypes or op not in ("input",):
        if v.dtype != want and not (keep_dtypes and t.dtype.is_float and v.dtype.kind == "f"):
            v = v.astype(want)
    if t.dtype.compute != t.dtype.numpy:
        v = round_bf16(v)  # bfloat16: computed in float, stored rounded (exact values stay as they are)
    return v


def _result(graph: Graph, values: Mapping[int, np.ndarray]) -> Result:
    return Result({k: values[n] for k, n in graph.outputs.items()},
                  {k: values[n] for k, n in graph.updates.items()})


def evaluate(graph: Graph, *args: Any, parameters: Mapping[str, Any] = {}, precision: str | None = None) -> Any:
    """Positional convenience: inputs in declaration order; one output returns an array."""
    res = run(graph, dict(zip(graph.inputs, args)), parameters, precision=precision)
    return next(iter(res.outputs.values())) if len(res.outputs) == 1 else res.outputs
