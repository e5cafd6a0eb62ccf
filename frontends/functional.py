"""Traced functions: the `torch.nn.functional` of ember. Each one adds primitive ops to the graph.

Composite ops (mean, linear, log_softmax, cross_entropy, ...) are written here in terms of the
primitives of `ember.ir.ops`, so the IR stays small and every composite is differentiated through
its primitives.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ember.ir import as_dtype, normalize_axes
from ember.ir import ShapeError, broadcast_shapes

from .tensor import Parameter, Tensor, as_node, current, user_location

Operand = Any  # Tensor | Parameter | np.ndarray | number


def _emit(op: str, operands: Sequence[int], **attrs: Any) -> Tensor:
    ctx = current()
    return Tensor(ctx.graph, ctx.graph.add(op, operands, **ctx.provenance(), **attrs))


def _at() -> str:
    """Where a frontend error happened: the module path (if any) and the user's line."""
    scope = current().scope()
    return (f"\n  in module {scope!r}" if scope else "") + f"\n  at {user_location()}"


def _typed(x: Operand) -> Tensor | Parameter | None:
    return x if isinstance(x, (Tensor, Parameter)) else None


def _nodes(*xs: Operand) -> list[int]:
    like = next((x for x in xs if _typed(x) is not None), None)
    return [as_node(x, like) for x in xs]


def _tensor(x: Operand) -> Tensor:
    ctx = current()
    return Tensor(ctx.graph, as_node(x))


# ---- elementwise -----------------------------------------------------------------------------

def _unary(op: str):
    def f(x: Operand) -> Tensor:
        return _emit(op, _nodes(x))
    f.__name__ = op
    return f


neg, exp, log, sqrt, reciprocal, relu, sigmoid, tanh, abs, erf, sin, cos, floor = (
    _unary(o) for o in ("neg", "exp", "log", "sqrt", "reciprocal", "relu", "sigmoid", "tanh", "abs", "erf",
                        "sin", "cos", "floor"))


def _binary(op: str):
    def f(a: Operand, b: Operand) -> Tensor:
        return _emit(op, _nodes(a, b))
    f.__name__ = op
    return f


add, sub, mul, div, maximum, minimum = (_binary(o) for o in ("add", "sub", "mul", "div", "maximum", "minimum"))
eq, ne, lt, le, gt, ge = (_binary(o) for o in ("eq", "ne", "lt", "le", "gt", "ge"))


def where(cond: Operand, a: Operand, b: Operand) -> Tensor:
    like = next((v for v in (a, b) if _typed(v) is not None), None)  # not `or`: Tensor has no truth value
    return _emit("where", [as_node(cond), as_node(a, like), as_node(b, like)])


def cast(x: Operand, dtype: Any) -> Tensor:
    return _emit("cast", _nodes(x), dtype=as_dtype(dtype))


# ---- layout ----------------------------------------------------------------------------------

def reshape(x: Operand, shape: Sequence[int]) -> Tensor:
    t = _tensor(x)
    shape = [int(d) for d in shape]
    if shape.count(-1) > 1:
        raise ShapeError(f"reshape: at most one -1 allowed, got {tuple(shape)}{_at()}")
    if -1 in shape:
        known = int(np.prod([d for d in shape if d != -1]))
        if known == 0 or t.type.numel % known:
            raise ShapeError(f"reshape: cannot reshape {t.type} to {tuple(shape)}{_at()}")
        shape[shape.index(-1)] = t.type.numel // known
    return _emit("reshape", [t.node], shape=tuple(shape))


def flatten(x: Operand, start_dim: int = 0, end_dim: int = -1) -> Tensor:
    t = _tensor(x)
    rank = len(t.shape)
    if rank == 0:  # as torch: a 0-d tensor flattens to shape (1,)
        return _emit("reshape", [t.node], shape=(1,))
    s, e = (_axes(t, d)[0] for d in (start_dim, end_dim))
    if s > e:
        raise ShapeError(f"flatten: start_dim {start_dim} comes after end_dim {end_dim} for {t.type}"
                         f"{_at()}")
    shape = t.shape[:s] + (int(np.prod(t.shape[s:e + 1])),) + t.shape[e + 1:]
    return _emit("reshape", [t.node], shape=shape)


def transpose(x: Operand, perm: Sequence[int]) -> Tensor:
    return _emit("transpose", _nodes(x), perm=tuple(int(p) for p in perm))


def swapaxes(x: Operand, a: int, b: int) -> Tensor:
    t = _tensor(x)
    perm = list(range(len(t.shape)))
    perm[a], perm[b] = perm[b], perm[a]
    return transpose(t, perm)


def broadcast_to(x: Operand, shape: Sequence[int]) -> Tensor:
    return _emit("broadcast_to", _nodes(x), shape=tuple(shape))


def unsqueeze(x: Operand, dim: int) -> Tensor:
    """torch.unsqueeze: a new axis of size 1 before `dim` (negative counts from the new rank)."""
    t = _tensor(x)
    rank = len(t.shape) + 1
    if not -rank <= dim < rank:
        raise ShapeError(f"unsqueeze: dim {dim} out of range for {t.type} (expected -{rank}..{rank - 1}){_at()}")
    d = dim % rank
    return reshape(t, t.shape[:d] + (1,) + t.shape[d:])


def squeeze(x: Operand, dim: int | Sequence[int] | None = None) -> Tensor:
    """torch.squeeze: drops the size-1 axes (only those of `dim`, where given; others stay)."""
    t = _tensor(x)
    axes = _axes(t, dim) if dim is not None else tuple(range(len(t.shape)))
    return reshape(t, tuple(d for i, d in enumerate(t.shape) if not (i in axes and d == 1)))


# ---- reductions ------------------------------------------------------------------------------

def _axes(x: Tensor, axis: int | Sequence[int] | None) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(len(x.shape)))
    try:
        return normalize_axes([axis] if isinstance(axis, (int, np.integer)) else list(axis), len(x.shape))
    except ShapeError as e:
        raise ShapeError(f"{e} (operand {x.type}){_at()}") from None


def sum(x: Operand, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    t = _tensor(x)
    return _emit("sum", [t.node], axes=_axes(t, axis), keepdims=keepdims)


def max(x: Operand, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    t = _tensor(x)
    return _emit("max", [t.node], axes=_axes(t, axis), keepdims=keepdims)


def mean(x: Operand, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
    t = _tensor(x)
    axes = _axes(t, axis)
    count = int(np.prod([t.shape[a] for a in axes]))
    return div(sum(t, axes, keepdims), float(count))


def argmax(x: Operand, axis: int = -1) -> Tensor:
    t = _tensor(x)
    (a,) = _axes(t, axis)
    return _emit("argmax", [t.node], axis=a)


# ---- contractions ----------------------------------------------------------------------------

def matmul(a: Operand, b: Operand) -> Tensor:
    """NumPy matmul semantics, 1-D operands included (promoted, then the added axis removed).

    Batch axes that broadcast reach the `matmul` op already equal, as the kernels take them: a
    2-D right operand (x @ W of a (B, T, D) x) folds the left one's batch axes into its rows,
    otherwise the operands are broadcast_to their common batch shape (the VJP sums them back)."""
    ta, tb = _tensor(a), _tensor(b)
    squeeze = []
    if len(ta.shape) == 1:
        ta = reshape(ta, (1,) + ta.shape)
        squeeze.append(-2)
    if len(tb.shape) == 1:
        tb = reshape(tb, tb.shape + (1,))
        squeeze.append(-1)
    if ta.shape[:-2] != tb.shape[:-2] and len(tb.shape) == 2 and ta.shape[-1] == tb.shape[0]:
        rows = _emit("matmul", [reshape(ta, (-1, ta.shape[-1])).node, tb.node])
        out = reshape(rows, ta.shape[:-1] + tb.shape[-1:])
    else:
        if ta.shape[:-2] != tb.shape[:-2]:
            try:
                batch = broadcast_shapes(ta.shape[:-2], tb.shape[:-2])
            except ShapeError as e:
                raise ShapeError(f"matmul: batch axes of {ta.type} and {tb.type} do not broadcast ({e}){_at()}") from None
            ta, tb = (broadcast_to(t, batch + t.shape[-2:]) if t.shape[:-2] != batch else t for t in (ta, tb))
        out = _emit("matmul", [ta.node, tb.node])
    if squeeze:
        shape = list(out.shape)
        for ax in sorted(squeeze):
            del shape[len(shape) + ax if ax == -1 else len(shape) - 2]
        out = reshape(out, shape)
    return out


def linear(x: Operand, weight: Operand, bias: Operand | None = None) -> Tensor:
    """y = x @ weight.T + bias, weight of shape (out, in) as in PyTorch."""
    y = matmul(x, transpose(weight, (1, 0)))
    return add(y, bias) if bias is not None else y


def conv2d(x: Operand, weight: Operand, bias: Operand | None = None, stride: int | Sequence[int] = 1,
           padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1, groups: int = 1) -> Tensor:
    """2-D convolution, NCHW input and OIHW weight (PyTorch's layout and semantics): with `groups`
    G the weight is (O, C/G, KH, KW) and channel block g of the input meets only output block g
    (G == C: a depthwise convolution)."""
    if np.any(np.asarray(dilation) != 1):
        raise NotImplementedError(f"conv2d: dilation={dilation} is not supported yet (only dilation=1){_at()}")
    y = _emit("conv2d", _nodes(x, weight), stride=stride, padding=padding, groups=int(groups))
    if bias is not None:
        o = y.shape[1]
        y = add(y, reshape(bias, (o, 1, 1)))
    return y


# ---- losses and activations ------------------------------------------------------------------

def stop_gradient(x: Operand) -> Tensor:
    """x, seen by autodiff as a constant (no gradient flows through it)."""
    return _emit("stop_gradient", _nodes(x))


def min(x: Operand, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    return neg(max(neg(x), axis, keepdims))


def var(x: Operand, axis: int | Sequence[int] | None = None, unbiased: bool = True, keepdims: bool = False) -> Tensor:
    """torch.var: the mean squared deviation, over n - 1 when `unbiased` (Bessel's correction)."""
    t = _tensor(x)
    axes = _axes(t, axis)
    count = int(np.prod([t.shape[a] for a in axes])) if axes else 1
    d = sub(t, mean(t, axes, keepdims=True))
    total = sum(mul(d, d), axes, keepdims)
    return div(total, float(count - 1 if unbiased else count))


def _is_scalar(v: Any) -> bool:
    return _typed(v) is None and np.ndim(v) == 0


def clamp(x: Operand, min: float | Operand | None = None, max: float | Operand | None = None) -> Tensor:  # noqa: A002
    """torch.clamp: min(max(x, min), max), so min > max gives max and NaN stays NaN. With number
    bounds the gradient is torch's too: it passes where min <= x <= max (both ends included)
    and nowhere else (not at NaN); tensor bounds are max/min ops, whose gradient is split at ties."""
    if min is None and max is None:
        raise ValueError(f"clamp: at least one of min and max must be given{_at()}")
    t = _tensor(x)
    if not all(_is_scalar(b) for b in (min, max) if b is not None):
        if min is not None:
            t = maximum(t, min)
        if max is not None:
            t = minimum(t, max)
        return t
    value = t  # the forward value, held (no gradient) where x is outside [min, max] or NaN
    if min is not None:
        value = where(lt(value, min), min, value)
    if max is not None:
        value = where(gt(value, max), max, value)
    held = stop_gradient(value)
    if min is not None and max is not None:
        return where(ge(t, min), where(le(t, max), t, held), held)
    return where(ge(t, min), t, held) if min is not None else where(le(t, max), t, held)


clip = clamp


def hardtanh(x: Operand, min_val: float = -1.0, max_val: float = 1.0) -> Tensor:
    """torch's hardtanh: the value of clamp, but the gradient passes only strictly inside
    (min_val, max_val) (and at NaN), as torch's hardtanh_backward."""
    t = _tensor(x)
    return where(le(t, min_val), min_val, where(ge(t, max_val), max_val, t))


def relu6(x: Operand) -> Tensor:
    """torch's relu6: hardtanh(x, 0, 6)."""
    return hardtanh(x, 0.0, 6.0)


def pow(x: Operand, exponent: float) -> Tensor:  # noqa: A001
    """x ** exponent for the exponents a model uses: small integers (products), 0.5 and -0.5."""
    t = _tensor(x)
    e = float(exponent)
    if e == 0.5:
        return sqrt(t)
    if e == -0.5:
        return reciprocal(sqrt(t))
    n = int(e)
    if e != n or not -16 <= n <= 16:  # (`abs` here is the traced op)
        raise NotImplementedError(f"pow: exponent {exponent} is not supported (integers up to 16, 0.5 and -0.5){_at()}")
    n = n if n >= 0 else -n
    if n == 0:
        return add(mul(t, 0.0), 1.0)
    result, base = None, t
    while n:  # square-and-multiply: the rounding of torch's pow differs by ulps, not more
        if n & 1:
            result = base if result is None else mul(result, base)
        n >>= 1
        if n:
            base = mul(base, base)
    return reciprocal(result) if e < 0 else result


def log_softmax(x: Operand, axis: int = -1) -> Tensor:
    """Stable log-softmax: x - m - log(sum(exp(x - m))) with m = max(x).

    The result does not depend on m (any shift cancels), so m is a stop_gradient: the backward
    pass is then PyTorch's g - softmax * sum(g), without differentiating through the max.
    """
    t = _tensor(x)
    shifted = sub(t, stop_gradient(max(t, axis, keepdims=True)))
    return sub(shifted, log(sum(exp(shifted), axis, keepdims=True)))


def softmax(x: Operand, axis: int = -1) -> Tensor:
    t = _tensor(x)
    e = exp(sub(t, stop_gradient(max(t, axis, keepdims=True))))
    return div(e, sum(e, axis, keepdims=True))


def scaled_dot_product_attention(query: Operand, key: Operand, value: Operand, attn_mask: Operand | None = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None) -> Tensor:
    """torch's F.scaled_dot_product_attention, written out: softmax(q @ k^T * scale + mask) @ v
    over (..., L, E) queries, (..., S, E) keys and (..., S, Ev) values, scale 1/sqrt(E) unless
    given. `attn_mask` is a bool mask (True: attend) or an additive float one, broadcast to
    (..., L, S); `is_causal` masks the keys after each query; `dropout_p` drops attention
    weights with `dropout` (ember's masks, not torch's)."""
    q, k, v = _tensor(query), _tensor(key), _tensor(value)
    if len(q.shape) < 2 or len(k.shape) < 2 or len(v.shape) < 2 or q.shape[-1] != k.shape[-1] \
            or k.shape[-2] != v.shape[-2]:
        raise ShapeError(f"scaled_dot_product_attention expects query (..., L, E), key (..., S, E) and value "
                         f"(..., S, Ev), got {q.type}, {k.type} and {v.type}{_at()}")
    if is_causal and attn_mask is not None:
        raise ValueError(f"scaled_dot_product_attention: give attn_mask or is_causal, not both (as torch){_at()}")
    factor = float(1.0 / np.sqrt(q.shape[-1])) if scale is None else float(scale)
    scores = mul(matmul(q, swapaxes(k, -2, -1)), factor)
    if is_causal:
        attn_mask = np.tril(np.ones((q.shape[-2], k.shape[-2]), dtype=bool))
    if attn_mask is not None:
        mask = _tensor(attn_mask) if _typed(attn_mask) is not None else np.asarray(attn_mask)
        if isinstance(mask, np.ndarray) and mask.dtype.kind == "f":
            mask = mask.astype(scores.dtype.numpy)  # an additive mask in the scores' dtype
        if mask.dtype.name == "bool":
            scores = where(mask, scores, np.asarray(-np.inf, scores.dtype.numpy))
        else:
            scores = add(scores, mask)
    weights = softmax(scores, -1)
    if dropout_p:
        weights = dropout(weights, dropout_p)
    return matmul(weights, v)


def one_hot(labels: Operand, num_classes: int, dtype: Any = "float32") -> Tensor:
    return _emit("one_hot", _nodes(labels), num_classes=num_classes, dtype=as_dtype(dtype))


def cross_entropy(logits: Operand, labels: Operand, reduction: str = "mean", label_smoothing: float = 0.0) -> Tensor:
    """PyTorch's F.cross_entropy for (N, C) logits and (N,) integer class labels; with
    `label_smoothing` e the target is (1 - e) on the label plus e / C on every class, as torch's.
    (A smoothed loss is not the plain softmax cross-entropy, so it runs on the generic kernels.)"""
    z, y = _tensor(logits), _tensor(labels)
    if len(z.shape) != 2:
        raise ShapeError(f"cross_entropy expects (N, C) logits, got {z.type}{_at()}")
    if y.dtype.is_float or y.shape != z.shape[:1]:
        raise ShapeError(f"cross_entropy expects integer labels of shape ({z.shape[0]},), got {y.type} "
                         f"for logits {z.type}{_at()}")
    smoothing = float(label_smoothing)
    if not 0.0 <= smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be between 0.0 and 1.0, got {label_smoothing}{_at()}")
    log_p = log_softmax(z, 1)
    target = one_hot(y, z.shape[1], z.dtype)
    if smoothing:
        target = add(mul(target, 1.0 - smoothing), smoothing / z.shape[1])
    picked = sum(mul(log_p, target), 1)
    return _reduce_loss(neg(picked), reduction)


def mse_loss(pred: Operand, target: Operand, reduction: str = "mean") -> Tensor:
    p, t = _tensor(pred), _tensor(target)
    if p.shape != t.shape:
        raise ShapeError(f"mse_loss: prediction {p.type} and target {t.type} differ in shape{_at()}")
    d = sub(p, t)
    return _reduce_loss(mul(d, d), reduction)


def nll_loss(log_probs: Operand, labels: Operand, reduction: str = "mean") -> Tensor:
    """PyTorch's F.nll_loss for (N, C) log-probabilities and (N,) integer labels (no weights)."""
    z, y = _tensor(log_probs), _tensor(labels)
    if len(z.shape) != 2 or y.dtype.is_float or y.shape != z.shape[:1]:
        raise ShapeError(f"nll_loss expects (N, C) log-probabilities and (N,) integer labels, got {z.type} "
                         f"and {y.type}{_at()}")
    return _reduce_loss(neg(sum(mul(z, one_hot(y, z.shape[1], z.dtype)), 1)), reduction)


def gelu(x: Operand, approximate: str = "none") -> Tensor:
    """PyTorch's GELU: x * Phi(x) with the exact erf, or its tanh approximation."""
    t = _tensor(x)
    if approximate == "none":
        return mul(mul(t, 0.5), add(erf(mul(t, float(1 / np.sqrt(2.0)))), 1.0))
    if approximate == "tanh":
        inner = mul(add(t, mul(mul(mul(t, t), t), 0.044715)), float(np.sqrt(2.0 / np.pi)))
        return mul(mul(t, 0.5), add(tanh(inner), 1.0))
    raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")


def dropout(x: Operand, p: float = 0.5, training: bool = True, seed: int = 0) -> Tensor:
    """PyTorch's dropout: in training, each element is zeroed with probability p and the rest
    scaled by 1/(1-p); otherwise (or for p=0) the identity.

    The mask is `random_uniform(step) >= p`: Philox-4x32-10 keyed by `seed` and the step counter
    (a state the compiled step advances, so every step draws a new mask), with the element index
    as the counter, so the masks are the same on every device and thread count and from run to
    run. They cannot be PyTorch's (its generator is another algorithm, with other state). The
    gradient is the cotangent times the same mask and scale (mul's VJP: the mask is a constant)."""
    if not 0.0 <= float(p) <= 1.0:
        raise ValueError(f"dropout: p must be in [0, 1], got {p}{_at()}")
    if not 0 <= int(seed) < 2**32:
        raise ValueError(f"dropout: seed must be in [0, 2**32), got {seed}{_at()}")
    t = _tensor(x)
    if not training or p == 0:
        return t
    if not t.dtype.is_float:
        raise ShapeError(f"dropout needs a floating-point input, got {t.type}{_at()}")
    step, stream = current().random_draw()
    u = _emit("random_uniform", [step], shape=t.shape, seed=int(seed), stream=stream)
    if t.dtype != u.dtype:
        u = cast(u, t.dtype)
    # PyTorch's scale, 1/(1-p) rounded to the input's dtype; p=1 keeps nothing (scale unused)
    scale = np.asarray(1.0 / (1.0 - p) if p < 1 else 0.0, dtype=t.dtype.numpy)
    keep = ge(u, float(p))
    return mul(t, where(keep, scale, np.zeros((), t.dtype.numpy)))


def random_translate(x: Operand, max_shift: int, training: bool = True, seed: int = 0) -> Tensor:
    """Data augmentation inside the step: in training, each image of an NCHW batch is moved by
    (dy, dx) pixels, each drawn uniformly from [-max_shift, max_shift] (its channels alike), the
    uncovered border filled with zeros; otherwise (or for max_shift 0) the identity.

    The shifts come from `random_uniform` (Philox keyed by `seed` and the step counter, one draw
    per axis and image), so every target moves the same image by the same pixels. The move
    itself is two grouped convolutions (one group per image plane, a one-hot column of taps,
    then a one-hot row), ops every target already compiles: a product with one tap of 1 and
    the others 0 is exact, so the shifted batch is bit-identical everywhere. Nothing is
    differentiated through it (the taps are drawn, the input is data)."""
    s = int(max_shift)
    if s < 0:
        raise ValueError(f"random_translate: max_shift must be >= 0, got {max_shift}{_at()}")
    if not 0 <= int(seed) < 2**32:
        raise ValueError(f"random_translate: seed must be in [0, 2**32), got {seed}{_at()}")
    t = _nchw("random_translate", x)
    if not training or s == 0:
        return t
    if not t.dtype.is_float:
        raise ShapeError(f"random_translate needs a floating-point input, got {t.type}{_at()}")
    n, c, h, w = t.shape
    k = 2 * s + 1
    planes = reshape(t, (1, n * c, h, w))
    for taps_shape, padding in (((n * c, 1, k, 1), (s, 0)), ((n * c, 1, 1, k), (0, s))):
        step, stream = current().random_draw()
        u = _emit("random_uniform", [step], shape=(n,), seed=int(seed), stream=stream)
        # u <= 1 - 2**-24 and k is odd, so u * k rounds below k: the tap index is in [0, k)
        tap = cast(floor(mul(u, float(k))), "int64")
        pick = reshape(one_hot(tap, k, t.dtype), (n, 1, k))
        taps = reshape(broadcast_to(pick, (n, c, k)), taps_shape)
        # tap j reads the pixel j - s away: the image moves by s - j
        planes = conv2d(planes, taps, padding=padding, groups=n * c)
    return reshape(planes, t.shape)


def _nchw(name: str, x: Operand) -> Tensor:
    t = _tensor(x)
    if len(t.shape) != 4:
        raise ShapeError(f"{name} expects an NCHW input, got {t.type}{_at()}")
    return t


def adaptive_avg_pool2d(x: Operand, output_size: int | Sequence[int]) -> Tensor:
    """Only output size 1 (global average pooling): the mean over H and W, kept as 1x1."""
    if tuple(np.atleast_1d(output_size)) not in ((1,), (1, 1)):
        raise NotImplementedError(f"adaptive_avg_pool2d: output_size={output_size} is not supported "
                                  f"(only 1){_at()}")
    return mean(_nchw("adaptive_avg_pool2d", x), (2, 3), keepdims=True)


def avg_pool2d(x: Operand, kernel_size: int | Sequence[int], stride: int | Sequence[int] | None = None,
               padding: int | Sequence[int] = 0) -> Tensor:
    """PyTorch's avg_pool2d (count_include_pad=True, ceil_mode=False): a convolution of every
    channel on its own with a constant 1/(kh*kw) kernel, so it reuses conv2d's kernels and VJPs."""
    t = _nchw("avg_pool2d", x)
    kh, kw = (int(kernel_size),) * 2 if np.isscalar(kernel_size) else tuple(int(k) for k in kernel_size)
    n, c, h, w = t.shape
    weight = np.full((1, 1, kh, kw), 1.0 / (kh * kw), dtype=t.dtype.numpy)
    y = conv2d(reshape(t, (n * c, 1, h, w)), weight, None, stride if stride is not None else (kh, kw), padding)
    return reshape(y, (n, c) + y.shape[2:])


def max_pool2d(x: Operand, kernel_size: int | Sequence[int], stride: int | Sequence[int] | None = None,
               padding: int | Sequence[int] = 0, ceil_mode: bool = False) -> Tensor:
    """PyTorch's max_pool2d (dilation 1): the `max_pool2d` op, whose gradient goes to each
    window's first maximal element as in PyTorch (ties are common after a ReLU: all-zero
    windows). Every target has a kernel for it, overlapping windows, padding and ceil_mode
    included."""
    t = _nchw("max_pool2d", x)
    k = (int(kernel_size),) * 2 if np.isscalar(kernel_size) else tuple(int(v) for v in kernel_size)
    s = k if stride is None else ((int(stride),) * 2 if np.isscalar(stride) else tuple(int(v) for v in stride))
    p = (int(padding),) * 2 if np.isscalar(padding) else tuple(int(v) for v in padding)
    return _emit("max_pool2d", [t.node], kernel=k, stride=s, padding=p, ceil_mode=bool(ceil_mode))


def layer_norm(x: Operand, normalized_shape: int | Sequence[int], weight: Operand | None = None,
               bias: Operand | None = None, eps: float = 1e-5) -> Tensor:
    """PyTorch's layer_norm over the trailing `normalized_shape` axes (biased variance)."""
    t = _tensor(x)
    dims = (int(normalized_shape),) if np.isscalar(normalized_shape) else tuple(int(d) for d in normalized_shape)
    if tuple(t.shape[len(t.shape) - len(dims):]) != dims:
        raise ShapeError(f"layer_norm: normalized_shape {dims} does not match the trailing axes of {t.type}{_at()}")
    axes = tuple(range(len(t.shape) - len(dims), len(t.shape)))
    centred = sub(t, mean(t, axes, keepdims=True))
    # times the reciprocal deviation, as PyTorch computes it (rstd): no division per element
    y = mul(centred, reciprocal(sqrt(add(mean(mul(centred, centred), axes, keepdims=True), float(eps)))))
    if weight is not None:
        y = mul(y, weight)
    return add(y, bias) if bias is not None else y


def concat(xs: Sequence[Operand], axis: int = 0) -> Tensor:
    """torch.cat, as a sum of matmuls with constant 0/1 placement matrices along `axis` (moved
    last): exact for finite values (each output is one x * 1 plus zeros), differentiable through
    matmul (whose VJP is the slice), and compiled by every backend with no new kernel. A NaN or
    inf in one piece spreads to the others (0 * inf); the O(D^2) cost suits small models."""
    ts = [_tensor(v) for v in xs]
    if not ts:
        raise ValueError(f"concat needs at least one tensor{_at()}")
    rank = len(ts[0].shape)
    (a,) = _axes(ts[0], axis)
    for t in ts[1:]:
        if len(t.shape) != rank or any(d != e for i, (d, e) in enumerate(zip(t.shape, ts[0].shape)) if i != a):
            raise ShapeError(f"concat: {t.type} and {ts[0].type} differ outside axis {a}{_at()}")
    if len(ts) == 1:
        return ts[0]
    perm = tuple(i for i in range(rank) if i != a) + (a,)
    inverse = tuple(int(i) for i in np.argsort(perm))
    total = int(np.sum([t.shape[a] for t in ts]))
    out, start = None, 0
    for t in ts:
        d = t.shape[a]
        place = np.zeros((d, total), dtype=t.dtype.numpy)
        place[np.arange(d), start + np.arange(d)] = 1
        part = matmul(transpose(t, perm), place)
        out = part if out is None else add(out, part)
        start += d
    return transpose(out, inverse)


def _reduce_loss(x: Tensor, reduction: str) -> Tensor:
    if reduction == "mean":
        return mean(x)
    if reduction == "sum":
        return sum(x)
    if reduction == "none":
        return x
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


__all__ = [n for n in dir() if not n.startswith("_") and n not in ("annotations", "Sequence", "Any", "np",
           "as_dtype", "normalize_axes", "ShapeError", "broadcast_shapes", "Parameter",
           "Tensor", "as_node", "current", "user_location", "Operand")]
