"""Reverse-mode automatic differentiation: `grad(graph) -> graph` with the backward pass appended.

Each differentiable primitive has one VJP rule in `VJP_RULES` (keyed by op name, as JAX keeps
`primitive_transposes`). A rule is a small graph-building function

    rule(b: Builder, node: int, ct: int, needs: tuple[bool, ...]) -> Sequence[int | None]

that receives the node, the node id of its output cotangent, and which operands want a
cotangent; it returns one cotangent node per operand (None where `needs` is False or the operand
has no gradient). Rules are written with `Builder`, whose helpers undo broadcasting (sum over the
broadcast axes, then reshape) so that every cotangent has exactly its operand's type.

Only nodes that lie on a path from a differentiated parameter to the loss get cotangents, so no
gradient is ever built for inputs or labels (the first convolution's `conv2d_grad_input` never
exists). Where a value fans out, its cotangent contributions are summed with `add` nodes in the
order they were produced (reverse topological order of the users), which is deterministic.

Gradient tags (the contract later passes rely on, e.g. data parallelism finding the gradients to
all-reduce after `simplify`): `grad` marks the node holding each parameter's gradient with the
note `grad_of` = a tuple of parameter names (a tuple because one node can be the gradient of
several parameters, or become so when CSE merges two nodes). `gradients(graph)` reads the tags
back as {parameter name: node}. The tag means "this node's value is the gradient of p"; it does
not mean the node is used only as a gradient: it may also be a cotangent inside the backward
pass, or a forward value (for loss = sum(p * x) the gradient of p *is* x). A pass that replaces
a gradient by something else (its all-reduce) must therefore redirect only the uses that lead to
that parameter's update, never the backward pass's own uses. `simplify` keeps the tags: whenever
it replaces a node by an equal value (CSE, constant folding, algebraic rewrites) it moves the
node's tags onto the replacement (`carry_gradient_tags`), so after autodiff -> optimizer ->
simplify every parameter whose update reads a gradient still has exactly one tagged node. A
parameter the loss does not depend on gets a structural-zero gradient that the optimizer drops;
after DCE it may have no tagged node at all. Passes that rebuild the graph (fusion) do not keep
tags; they run after the passes that need them.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ember.ir import OPS, Graph, TensorType
from ember.ir.dtypes import as_array, as_values

Rule = Callable[["Builder", int, int, tuple[bool, ...]], Sequence["int | None"]]


class Builder:
    """Thin helpers over `Graph.add` used by VJP rules (and by the optimizer pass)."""

    def __init__(self, graph: Graph, loc: str | None = None, scope: str = "", backward: bool = False) -> None:
        self.g = graph
        # provenance of every node built: for a VJP rule, the forward node's source line and module
        # path, marked backward, so gradient nodes point at the user's layer (printed `0 (grad)`)
        self.loc = loc
        self.scope = scope
        self.backward = backward

    @classmethod
    def grad_of(cls, graph: Graph, n: int) -> "Builder":
        """A builder for the gradient nodes of forward node n (its scope and loc, backward)."""
        return cls(graph, graph.loc(n), graph.scope(n), backward=True)

    def _prov(self) -> dict:
        return {"loc": self.loc, "scope": self.scope, "backward": self.backward}

    def op(self, name: str, *operands: int, **attrs) -> int:
        return self.g.add(name, list(operands), **self._prov(), **attrs)

    def type(self, n: int) -> TensorType:
        return self.g.type(n)

    def shape(self, n: int) -> tuple[int, ...]:
        return self.g.type(n).shape

    def scalar(self, value: float, like: int) -> int:
        """A rank-0 constant of `like`'s dtype (broadcasts against anything)."""
        return self.g.add_constant(as_array(value, self.type(like).dtype), **self._prov())

    def zeros(self, ttype: TensorType) -> int:
        """Zeros of `ttype` as a broadcast scalar: no large constant is stored in the graph."""
        z = self.g.add_constant(as_array(0, ttype.dtype), **self._prov())
        return z if ttype.shape == () else self.op("broadcast_to", z, shape=ttype.shape)

    def unbroadcast(self, x: int, shape: tuple[int, ...]) -> int:
        """Sums `x` (a broadcast result) back to `shape`: over leading axes and over axes that
        were 1 in `shape`, then reshapes to restore those unit axes."""
        xs = self.shape(x)
        if xs == tuple(shape):
            return x
        lead = len(xs) - len(shape)
        axes = tuple(range(lead)) + tuple(lead + i for i, d in enumerate(shape) if d == 1 and xs[lead + i] != 1)
        out = self.op("sum", x, axes=axes, keepdims=False) if axes else x
        if self.shape(out) != tuple(shape):
            out = self.op("reshape", out, shape=tuple(shape))
        return out

    def broadcast(self, x: int, shape: tuple[int, ...]) -> int:
        return x if self.shape(x) == tuple(shape) else self.op("broadcast_to", x, shape=tuple(shape))

    def swap_last(self, x: int) -> int:
        r = len(self.shape(x))
        perm = tuple(range(r - 2)) + (r - 1, r - 2)
        return self.op("transpose", x, perm=perm)


# ---- VJP rules -------------------------------------------------------------------------------

def _operands(b: Builder, n: int) -> list[int]:
    return b.g.operands(n)


def _unary(fn: Callable[[Builder, int, int, int], int]) -> Rule:
    """Wraps fn(b, x, y, ct) -> cotangent of x for a one-operand op (y: the node's output)."""
    def rule(b: Builder, n: int, ct: int, needs: tuple[bool, ...]):
        (x,) = _operands(b, n)
        return [fn(b, x, n, ct) if needs[0] else None]
    return rule


def _relu(b: Builder, x: int, y: int, ct: int) -> int:
    # PyTorch's threshold_backward: the gradient passes where the output is > 0 (none at 0).
    return b.op("where", b.op("gt", y, b.scalar(0, y)), ct, b.scalar(0, ct))


def _abs(b: Builder, x: int, y: int, ct: int) -> int:
    # ct * sign(x), with sign(0) = 0 as in PyTorch.
    zero = b.scalar(0, x)
    neg = b.op("where", b.op("lt", x, zero), b.op("neg", ct), b.scalar(0, ct))
    return b.op("where", b.op("gt", x, zero), ct, neg)


def _inexact(b: Builder, value: float, like: int) -> int:
    """A constant not exact in `like`'s dtype, as hi + lo (each exact there): computed in that
    dtype the sum rounds to hi, and the float64 oracle run (`precision="float64"`) sees the
    constant to double precision instead of float32's rounding of it."""
    dtype = b.type(like).dtype
    hi = float(as_values(as_array(value, dtype), dtype))
    lo = float(as_values(as_array(value - hi, dtype), dtype))
    return b.op("add", b.scalar(hi, like), b.scalar(lo, like))


def _binary(fn: Callable[[Builder, int, int, int, int, tuple[bool, ...]], tuple["int | None", "int | None"]]) -> Rule:
    """Wraps fn(b, a, bb, y, ct, needs) -> (ca, cb) in the broadcast result's shape, then sums
    each back to its operand's shape."""
    def rule(b: Builder, n: int, ct: int, needs: tuple[bool, ...]):
        a, c = _operands(b, n)
        ca, cc = fn(b, a, c, n, ct, needs)
        return [b.unbroadcast(ca, b.shape(a)) if needs[0] and ca is not None else None,
                b.unbroadcast(cc, b.shape(c)) if needs[1] and cc is not None else None]
    return rule


def _mul(b, a, c, y, ct, needs):
    return (b.op("mul", ct, c) if needs[0] else None, b.op("mul", ct, a) if needs[1] else None)


def _div(b, a, c, y, ct, needs):
    ca = b.op("div", ct, c) if needs[0] else None
    # PyTorch's formula: -ct * a / (c * c).
    cc = b.op("neg", b.op("div", b.op("mul", ct, a), b.op("mul", c, c))) if needs[1] else None
    return ca, cc


def _select(first: str):
    """maximum/minimum: the gradient goes to the selected operand; at ties it is split in half
    (PyTorch's and JAX's convention)."""
    def fn(b, a, c, y, ct, needs):
        half = b.op("mul", ct, b.scalar(0.5, ct))
        zero = b.scalar(0, ct)
        eq = b.op("eq", a, c)
        out = []
        for want, (lhs, rhs) in zip(needs, ((a, c), (c, a))):
            if not want:
                out.append(None)
                continue
            wins = b.op(first, lhs, rhs)
            out.append(b.op("where", wins, ct, b.op("where", eq, half, zero)))
        return tuple(out)
    return fn


def _where(b: Builder, n: int, ct: int, needs: tuple[bool, ...]):
    cond, a, c = _operands(b, n)
    zero = b.scalar(0, ct)
    ca = b.unbroadcast(b.op("where", cond, ct, zero), b.shape(a)) if needs[1] else None
    cc = b.unbroadcast(b.op("where", cond, zero, ct), b.shape(c)) if needs[2] else None
    return [None, ca, cc]


def _cast(b: Builder, n: int, ct: int, needs: tuple[bool, ...]):
    (x,) = _operands(b, n)
    if not needs[0] or not b.type(x).dtype.is_float:
        return [None]
    return [b.op("cast", ct, dtype=b.type(x).dtype)]


def _keepdims(b: Builder, n: int, ct: int) -> int:
    """The reduction's cotangent reshaped to keepdims form (reduced axes as 1)."""
    attrs = b.g.attrs(n)
    (x,) = _operands(b, n)
    if attrs["keepdims"]:
        return ct
    shape = tuple(1 if i in attrs["axes"] else d for i, d in enumerate(b.shape(x)))
    return b.op("reshape", ct, shape=shape)


def _sum(b: Builder, n: int, ct: int, needs: tuple[bool, ...]):
    (x,) = _operands(b, n)
    return [b.broadcast(_keepdims(b, n, ct), b.shape(x)) if needs[0] else None]


def _max(b: Builder, n: int, ct: int, needs: tuple[bool, ...]):
    # PyTorch's amax backward: the gradient is shared evenly among the maximal elements.
    if not needs[0]:
        return [None]
    (x,) = _operands(b, n)
    attrs = b.g.attrs(n)
    ct_k = _keepdims(b, n, ct)
    y_k = n if attrs["keepdims"] else b.op("reshape", n, shape=b.shape(ct_k))
    mask = b.op("cast", b.op("eq", x, y_k), dtype=b.type(x).dtype)
    count = b.op("sum", mask, axes=attrs["axes"], keepdims=True)
    return [b.op("mul", b.op("div", ct_k, count), mask)]


def _reshape(b: Builder, n: int, ct: int, needs: tuple[bool, ...]):
    (x,) = _operands(b, n)
    return [b.op("reshape", ct, shape=b.shape(x)) if needs[0] else None]


def _transpose(b: Builder, n: int, ct: int, needs: tuple[bool, ...]):
    perm = b.g.attrs(n)["perm"]
    inverse = tuple(int(i) for i in np.argsort(perm))
    return [b.op("transpose", ct, perm=inverse) if needs[0] else None]


def _broadcast_to(b: Builder, n: int, ct: int, needs: tuple[bool, ...]):
    (x,) = _operands(b, n)
    return [b.unbroadcast(ct, b.shape(x)) if needs[0] else None]


def _matmul(b: Builder, n: int, ct: int, needs: tuple[bool, ...]):
    a, c = _operands(b, n)
    ca = b.unbroadcast(b.op("matmul", ct, b.swap_last(c)), b.shape(a)) if needs[0] else None
    cc = b.unbroadcast(b.op("matmul", b.swap_last(a), ct), b.shape(c)) if needs[1] else None
    return [ca, cc]


def _conv_attrs(b: Builder, n: int) -> dict:
    at = b.g.attrs(n)
    return {"stride": at["stride"], "padding": at["padding"], "groups": at["groups"]}


# The three convolution primitives are closed under differentiation. With y = conv(x, w):
#   grad_input(dy, w)  = J_x(w)^T dy     is linear in dy and in w,
#   grad_weight(x, dy) = J_w(x)^T dy     is linear in x and in dy,
# and <ct, grad_input(dy, w)> = <conv(ct, w), dy>, <ct, grad_weight(x, dy)> = <conv(x, ct), dy>,
# which gives every rule below by reading off the adjoint of each bilinear form.

def _conv2d(b: Builder, n: int, ct: int, needs: tuple[bool, ...]):
    x, w = _operands(b, n)
    at = _conv_attrs(b, n)
    cx = b.op("conv2d_grad_input", ct, w, input_shape=b.shape(x), **at) if needs[0] else None
    cw = b.op("conv2d_grad_weight", x, ct, weight_shape=b.shape(w), **at) if needs[1] else None
    return [cx, cw]


def _conv2d_grad_input(b: Builder, n: int, ct: int, needs: tuple[bool, ...]):
    dy, w = _operands(b, n)
    at = _conv_attrs(b, n)
    cdy = b.op("conv2d", ct, w, **at) if needs[0] else None
    cw = b.op("conv2d_grad_weight", ct, dy, weight_shape=b.shape(w), **at) if needs[1] else None
    return [cdy, cw]


def _conv2d_grad_weight(b: Builder, n: int, ct: int, needs: tuple[bool, ...]):
    x, dy = _operands(b, n)
    at = _conv_attrs(b, n)
    cx = b.op("conv2d_grad_input", dy, ct, input_shape=b.shape(x), **at) if needs[0] else None
    cdy = b.op("conv2d", x, ct, **at) if needs[1] else None
    return [cx, cdy]


def _pool_attrs(b: Builder, n: int) -> dict:
    at = b.g.attrs(n)
    return {"kernel": at["kernel"], "stride": at["stride"], "padding": at["padding"], "ceil_mode": at["ceil_mode"]}


def _max_pool2d(b: Builder, n: int, ct: int, needs: tuple[bool, ...]):
    (x,) = _operands(b, n)
    return [b.op("max_pool2d_grad", x, ct, **_pool_attrs(b, n)) if needs[0] else None]


def _max_pool2d_grad(b: Builder, n: int, ct: int, needs: tuple[bool, ...]):
    # Its adjoint in dy is a gather at each window's argmax, an op ember does not have yet; a
    # clear refusal rather than treating the node as a constant (a silently wrong gradient).
    raise NotImplementedError(f"grad: second-order gradients through max pooling are not supported "
                              f"(node %{n} at {b.g.where(n)})")


def _all_reduce(b: Builder, n: int, ct: int, needs: tuple[bool, ...]):
    # In a world of N ranks, y_r = sum_s x_s on every rank r (mean: y_r = (1/N) sum_s x_s). The
    # objective is the sum of the ranks' losses, L = sum_r L_r(y_r) (for data parallelism with a
    # per-shard mean loss, the mean over ranks is what all_reduce(mean) of the gradients gives).
    # Then dL/dx_s = sum_r ct_r * dy_r/dx_s = sum_r ct_r for sum, and (1/N) sum_r ct_r for mean,
    # where ct_r = dL_r/dy_r is rank r's own cotangent, which differs between ranks even though
    # the forward values y_r agree. So the VJP is the same collective over the same group applied
    # to the cotangent. In a world of one rank both sides are the identity.
    at = b.g.attrs(n)
    return [b.op("all_reduce", ct, reduce=at["reduce"], group=at["group"]) if needs[0] else None]


VJP_RULES: dict[str, Rule] = {
    "neg": _unary(lambda b, x, y, ct: b.op("neg", ct)),
    "exp": _unary(lambda b, x, y, ct: b.op("mul", ct, y)),
    "log": _unary(lambda b, x, y, ct: b.op("div", ct, x)),
    "sqrt": _unary(lambda b, x, y, ct: b.op("div", ct, b.op("mul", y, b.scalar(2, y)))),
    "reciprocal": _unary(lambda b, x, y, ct: b.op("neg", b.op("mul", ct, b.op("mul", y, y)))),
    "relu": _unary(_relu),
    "sigmoid": _unary(lambda b, x, y, ct: b.op("mul", ct, b.op("mul", b.op("sub", b.scalar(1, y), y), y))),
    "tanh": _unary(lambda b, x, y, ct: b.op("mul", ct, b.op("sub", b.scalar(1, y), b.op("mul", y, y)))),
    "abs": _unary(_abs),
    # d erf(x)/dx = 2/sqrt(pi) * exp(-x^2)
    "erf": _unary(lambda b, x, y, ct: b.op("mul", ct, b.op("mul", _inexact(b, 2 / np.sqrt(np.pi), x),
                                                        b.op("exp", b.op("neg", b.op("mul", x, x)))))),
    "sin": _unary(lambda b, x, y, ct: b.op("mul", ct, b.op("cos", x))),
    "cos": _unary(lambda b, x, y, ct: b.op("neg", b.op("mul", ct, b.op("sin", x)))),
    "add": _binary(lambda b, a, c, y, ct, needs: (ct, ct)),
    "sub": _binary(lambda b, a, c, y, ct, needs: (ct, b.op("neg", ct) if needs[1] else None)),
    "mul": _binary(_mul),
    "div": _binary(_div),
    "maximum": _binary(_select("gt")),
    "minimum": _binary(_select("lt")),
    "where": _where,
    "cast": _cast,
    "sum": _sum,
    "max": _max,
    "reshape": _reshape,
    "transpose": _transpose,
    "broadcast_to": _broadcast_to,
    "matmul": _matmul,
    "conv2d": _conv2d,
    "conv2d_grad_input": _conv2d_grad_input,
    "conv2d_grad_weight": _conv2d_grad_weight,
    "max_pool2d": _max_pool2d,
    "max_pool2d_grad": _max_pool2d_grad,
    "all_reduce": _all_reduce,
}


def missing_rules() -> list[str]:
    """Differentiable ops of the IR without a VJP rule (the completeness check)."""
    return sorted(name for name, op in OPS.items() if op.differentiable and name not in VJP_RULES)


# ---- gradient tags ---------------------------------------------------------------------------

GRAD_TAG = "grad_of"


def tag_gradient(graph: Graph, node: int, *params: str) -> None:
    """Marks `node` as holding the gradient of each of `params` (kept in order, no repeats)."""
    old = graph.notes(node).get(GRAD_TAG, ())
    graph.annotate(node, GRAD_TAG, tuple(dict.fromkeys(old + params)))


def carry_gradient_tags(graph: Graph, old: int, new: int) -> None:
    """Moves `old`'s gradient tags onto `new`, a node computing the same value that replaces it."""
    if old != new and old in graph and graph.notes(old).get(GRAD_TAG):
        tag_gradient(graph, new, *graph.notes(old).pop(GRAD_TAG))


def gradients(graph: Graph) -> dict[str, int]:
    """{parameter name: node holding its gradient}, from the tags, in parameter order."""
    found: dict[str, int] = {}
    for n in graph.g:
        for p in graph.notes(n).get(GRAD_TAG, ()):
            if p in found and found[p] != n:
                raise AssertionError(f"gradient of {p!r} is tagged on two nodes, %{found[p]} and %{n}")
            found[p] = n
    return {p: found[p] for p in graph.parameters if p in found}


# ---- the pass --------------------------------------------------------------------------------

def _active(graph: Graph, order: list[int], seeds: set[int]) -> set[int]:
    """Float nodes whose value depends differentiably on a seed (forward sweep)."""
    active = set(seeds)
    for n in order:
        if n in active or not OPS[graph.op(n)].differentiable or not graph.type(n).dtype.is_float:
            continue
        if any(o in active for o in graph.operands(n)):
            active.add(n)
    return active


def _ancestors_of(graph: Graph, root: int) -> set[int]:
    seen, stack = {root}, [root]
    while stack:
        for o in graph.operands(stack.pop()):
            if o not in seen:
                seen.add(o)
                stack.append(o)
    return seen


def grad(graph: Graph, loss: str = "out", wrt: Sequence[str] | None = None) -> Graph:
    """The joint forward+backward graph.

    Keeps every output of `graph` (the `loss` output renamed "loss") and adds `grad:<name>` for
    each parameter in `wrt` (default: all parameters, in declaration order). A parameter that
    does not influence the loss gets zeros. Each gradient node is tagged (see the module
    docstring: `gradients(graph)` finds them).
    """
    if loss not in graph.outputs:
        raise KeyError(f"grad: graph {graph.name!r} has no output {loss!r}; outputs: {list(graph.outputs)}")
    wrt = list(graph.parameters) if wrt is None else list(wrt)
    for name in wrt:
        if name not in graph.parameters:
            raise KeyError(f"grad: {name!r} is not a parameter of {graph.name!r}; parameters: {list(graph.parameters)}")
        if not graph.type(graph.parameters[name]).dtype.is_float:
            raise TypeError(f"grad: parameter {name!r} is {graph.type(graph.parameters[name])}; only float parameters have gradients")
    g = graph.copy()
    for n in g.g:  # tags of an earlier grad (higher-order use) name gradients of another loss
        g.notes(n).pop(GRAD_TAG, None)
    root = g.outputs[loss]
    lt = g.type(root)
    if lt.shape != () or not lt.dtype.is_float:
        raise TypeError(f"grad: the loss output {loss!r} must be a float scalar, got {lt}")
    if "loss" in g.outputs and loss != "loss":
        raise ValueError(f"grad: output {loss!r} would be renamed 'loss', but an output 'loss' already exists")
    for name in wrt:
        if f"grad:{name}" in g.outputs:
            raise ValueError(f"grad: graph already has an output 'grad:{name}'")

    order = g.topo_order()
    seeds = {g.parameters[p] for p in wrt}
    needed = _active(g, order, seeds) & _ancestors_of(g, root)

    cts: dict[int, list[int]] = {}  # node -> cotangent contributions, in the order produced
    if root in needed:
        cts[root] = [Builder.grad_of(g, root).scalar(1.0, root)]
    for n in reversed(order):
        if n not in needed or n not in cts or g.op(n) in ("parameter", "input", "state", "constant"):
            continue
        b = Builder.grad_of(g, n)
        ct = _accumulate(b, cts, n)
        rule = VJP_RULES.get(g.op(n))
        if rule is None:
            raise NotImplementedError(f"grad: no VJP rule for op {g.op(n)!r} (node %{n} at {g.where(n)})")
        operands = g.operands(n)
        needs = tuple(o in needed for o in operands)
        result = rule(b, n, ct, needs)
        for o, c, want in zip(operands, result, needs):
            if want and c is not None:
                if g.type(c) != g.type(o):  # a rule bug, caught where it happens
                    raise AssertionError(f"VJP rule {g.op(n)!r} gave a {g.type(c)} cotangent for a {g.type(o)} operand")
                cts.setdefault(o, []).append(c)

    outputs = {("loss" if k == loss else k): v for k, v in g.outputs.items()}
    for name in wrt:
        p = g.parameters[name]
        b = Builder.grad_of(g, p)
        outputs[f"grad:{name}"] = _accumulate(b, cts, p) if p in cts else b.zeros(g.type(p))
        tag_gradient(g, outputs[f"grad:{name}"], name)
    g.outputs = outputs
    return g.verify()


def _accumulate(b: Builder, cts: dict[int, list[int]], n: int) -> int:
    """Sums the contributions to n's cotangent left to right (a fixed, deterministic order)."""
    parts = cts[n]
    total = parts[0]
    for p in parts[1:]:
        total = b.op("add", total, p)
    cts[n] = [total]
    return total
