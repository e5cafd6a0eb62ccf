"""`from_torch(module, example_inputs) -> nn.Module`: bring a PyTorch model into ember.

The torch module is captured once with `torch.fx` (symbolic tracing, with the user's stack
traces recorded), and every fx node is checked against the tables below before anything is
built, so an unsupported layer, function or argument fails at import with one line naming the
fx node, the PyTorch call and the user's source line, never as a silently different graph.

The result is an ember `nn.Module` tree mirroring the torch one: a mapped leaf (Linear, Conv2d)
becomes ember's own layer, every other submodule a `_Holder`, so parameters keep the torch names
("0.weight", "features.conv1.bias") and `compile()`, `state_dict()` and checkpoints work as for
a native model. Its forward replays the fx graph with ember ops.

torch is imported only here (it is a test/extra dependency, not one of ember's).
"""
from __future__ import annotations

import operator
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ember.ir import ShapeError

from . import functional as F
from . import nn
from .tensor import Buffer, Parameter, Tensor
from .tracing import trace


class TorchImportError(NotImplementedError):
    """A PyTorch construct that `from_torch` cannot (yet) translate faithfully."""


class _Unsupported(Exception):
    """Raised by a table entry for an argument value it cannot translate (the reason)."""


def _refuse(reason: str) -> None:
    raise _Unsupported(reason)


# ---- modules: torch class name -> builder(torch module) -> ember module ------------------------

def _copy(t: Any) -> np.ndarray:
    """A tensor's values in an array of their own: `.numpy()` shares a CPU tensor's memory, so an
    ember step training it in place would change the torch module (its BatchNorm statistics)."""
    return np.array(t.detach().cpu().numpy(), order="C", copy=True)


def _param(t: Any) -> Parameter:
    # a frozen torch parameter (requires_grad False) stays frozen: ember's steps do not train it
    return Parameter(_copy(t).astype(np.float32, copy=False), requires_grad=bool(getattr(t, "requires_grad", True)))


def _tie(tm: Any, em: nn.Module) -> None:
    """One ember Parameter wherever the torch module holds one Parameter under several names (tied
    weights, `dec.weight = enc.weight`), as torch trains it: one array, one gradient summed over
    its uses."""
    modules = dict(em.named_modules())
    first: dict[int, str] = {}
    for name, p in tm.named_parameters(remove_duplicate=False):
        owner = first.setdefault(id(p), name)
        if owner != name:
            mod, _, leaf = owner.rpartition(".")
            tied = getattr(modules[mod], leaf)
            mod, _, leaf = name.rpartition(".")
            setattr(modules[mod], leaf, tied)


def _linear(m: Any) -> nn.Module:
    e = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
    e.weight = _param(m.weight)
    e.bias = _param(m.bias) if m.bias is not None else None
    return e


def _conv2d(m: Any) -> nn.Module:
    if m.padding_mode != "zeros":
        _refuse(f"padding_mode={m.padding_mode!r} (only 'zeros')")
    if tuple(m.dilation) != (1, 1):
        _refuse(f"dilation={m.dilation} (only dilation=1)")
    try:  # (nn.Conv2d refuses what it cannot do with a padding string: an even 'same' window)
        e = nn.Conv2d(m.in_channels, m.out_channels, m.kernel_size, tuple(m.stride),
                      m.padding if isinstance(m.padding, str) else tuple(m.padding),
                      groups=m.groups, bias=m.bias is not None)
    except NotImplementedError as exc:
        _refuse(str(exc).removeprefix("Conv2d: "))
    e.weight = _param(m.weight)
    e.bias = _param(m.bias) if m.bias is not None else None
    return e


class _Fn(nn.Module):
    """A parameterless torch layer, replayed as one ember function."""

    def __init__(self, name: str, fn: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.name, self.fn = name, fn

    def forward(self, x: Tensor) -> Tensor:
        return self.fn(x)

    def extra_repr(self) -> str:
        return self.name


def _fn(fn: Callable[..., Tensor]) -> Callable[[Any], nn.Module]:
    """A builder for a parameterless layer whose checks and forward are `fn(m)`."""
    def build(m: Any) -> nn.Module:
        return _Fn(type(m).__name__, fn(m))
    return build


def _dim(m: Any) -> int:
    if m.dim is None:  # torch's implicit-dim legacy: refused rather than guessed
        _refuse("dim=None (pass dim explicitly)")
    return m.dim


def _dropout(m: Any) -> nn.Module:
    return nn.Dropout(m.p)  # training/eval follows the imported model's mode, as in PyTorch


def _pool_checks(kind: str, ceil_mode: bool = False, count_include_pad: bool = True, divisor_override: Any = None,
                 dilation: Any = 1, return_indices: bool = False) -> None:
    _no("ceil_mode", ceil_mode, False)
    _no("count_include_pad", count_include_pad, True)
    _no("divisor_override", divisor_override, None)
    if np.any(np.asarray(dilation) != 1):
        _refuse(f"dilation={dilation} (only 1)")
    _no("return_indices", return_indices, False)


def _avg_pool(m: Any) -> Callable[[Tensor], Tensor]:
    _pool_checks("AvgPool2d", m.ceil_mode, m.count_include_pad, m.divisor_override)
    return lambda x: F.avg_pool2d(x, m.kernel_size, m.stride, m.padding)


def _max_pool(m: Any) -> Callable[[Tensor], Tensor]:
    _pool_checks("MaxPool2d", dilation=m.dilation, return_indices=m.return_indices)  # ceil_mode: the op's
    return lambda x: F.max_pool2d(x, m.kernel_size, m.stride, m.padding, m.ceil_mode)


def _adaptive_avg(m: Any) -> Callable[[Tensor], Tensor]:
    if tuple(np.atleast_1d(m.output_size)) not in ((1,), (1, 1)):
        _refuse(f"output_size={m.output_size} (only 1: global average pooling)")
    return lambda x: F.adaptive_avg_pool2d(x, 1)


def _layer_norm(m: Any) -> nn.Module:
    if not m.elementwise_affine:
        return _Fn("LayerNorm", lambda x: F.layer_norm(x, m.normalized_shape, None, None, m.eps))
    e = nn.LayerNorm(m.normalized_shape, m.eps, bias=m.bias is not None)
    e.weight = _param(m.weight)
    e.bias = _param(m.bias) if m.bias is not None else None
    return e


def _batch_norm(m: Any) -> nn.Module:
    if m.momentum is None:
        _refuse("momentum=None (cumulative averaging; only a float momentum)")
    if not m.track_running_stats:
        _refuse("track_running_stats=False (only True)")
    e = nn.BatchNorm2d(m.num_features, m.eps, m.momentum, affine=m.affine)
    if m.affine:
        e.weight, e.bias = _param(m.weight), _param(m.bias)
    e.running_mean = Buffer(_copy(m.running_mean))
    e.running_var = Buffer(_copy(m.running_var))
    e.num_batches_tracked = Buffer(_copy(m.num_batches_tracked), "int64")
    return e


MODULES: dict[str, Callable[[Any], nn.Module]] = {
    "Linear": _linear,
    "Conv2d": _conv2d,
    "ReLU": _fn(lambda m: F.relu),
    "Sigmoid": _fn(lambda m: F.sigmoid),
    "Tanh": _fn(lambda m: F.tanh),
    "Identity": _fn(lambda m: lambda x: x),
    "Flatten": _fn(lambda m: lambda x: F.flatten(x, m.start_dim, m.end_dim)),
    "Softmax": _fn(lambda m: lambda x, d=_dim(m): F.softmax(x, d)),
    "LogSoftmax": _fn(lambda m: lambda x, d=_dim(m): F.log_softmax(x, d)),
    "Dropout": _dropout,
    "GELU": _fn(lambda m: lambda x: F.gelu(x, m.approximate)),
    "ReLU6": _fn(lambda m: F.relu6),
    "Hardtanh": _fn(lambda m: lambda x: F.hardtanh(x, m.min_val, m.max_val)),
    "AvgPool2d": _fn(_avg_pool),
    "MaxPool2d": _fn(_max_pool),
    "AdaptiveAvgPool2d": _fn(_adaptive_avg),
    "LayerNorm": _layer_norm,
    "BatchNorm2d": _batch_norm,
}


# ---- functions and methods: torch callable -> ember implementation ----------------------------
# Each implementation takes the torch signature (defaults included) and refuses, via _refuse,
# any argument value it cannot reproduce.

def _no(name: str, value: Any, ok: Any) -> None:
    if value != ok:
        _refuse(f"{name}={value!r} (only {name}={ok!r})")


def _relu(x: Tensor, inplace: bool = False) -> Tensor:
    return F.relu(x)  # inplace only changes aliasing, which a traced graph does not have


def _flatten(x: Tensor, start_dim: int = 0, end_dim: int = -1) -> Tensor:
    return F.flatten(x, start_dim, end_dim)


def _softmax(fn: Callable[[Tensor, int], Tensor]) -> Callable[..., Tensor]:
    def f(x: Tensor, dim: int | None = None, _stacklevel: int = 3, dtype: Any = None) -> Tensor:
        if dim is None:
            _refuse("dim=None (pass dim explicitly)")
        _no("dtype", dtype, None)
        return fn(x, dim)
    return f


def _view(x: Tensor, *shape: Any) -> Tensor:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    return F.reshape(x, shape)


def _size(x: Tensor, dim: int | None = None) -> Any:
    return x.shape if dim is None else x.shape[dim]


def _reduce(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    def f(x: Tensor, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Tensor:
        _no("dtype", dtype, None)
        return fn(x, dim, keepdim)
    return f


def _dropout_fn(x: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False, *,
                model_training: bool = True) -> Tensor:
    # fx records `training=self.training` as the value it had when traced, so the replaying
    # model's own mode (`model_training`, passed by TorchModel.forward) decides as well: eval
    # mode is always the identity, as the PyTorch model would be after .eval()
    return F.dropout(x, p, training and model_training)


# functions that also receive the replaying model's training mode (keyword `model_training`)
_MODE_AWARE = (_dropout_fn,)


def _arith(op: Callable[[Any, Any], Any]) -> Callable[..., Any]:
    """torch.add / Tensor.add with torch's alpha; plain Python operators on ints (shapes) too."""
    def f(a: Any, b: Any, *, alpha: Any = 1) -> Any:
        _no("alpha", alpha, 1)
        return op(a, b)
    return f


def _avg_pool2d(x: Tensor, kernel_size: Any, stride: Any = None, padding: Any = 0, ceil_mode: bool = False,
                count_include_pad: bool = True, divisor_override: Any = None) -> Tensor:
    _pool_checks("avg_pool2d", ceil_mode, count_include_pad, divisor_override)
    return F.avg_pool2d(x, kernel_size, stride if stride not in (None, ()) else None, padding)


def _max_pool2d(x: Tensor, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1,
                ceil_mode: bool = False, return_indices: bool = False) -> Tensor:
    _pool_checks("max_pool2d", dilation=dilation, return_indices=return_indices)
    return F.max_pool2d(x, kernel_size, stride if stride not in (None, ()) else None, padding, ceil_mode)


def _loss_checks(weight: Any, size_average: Any, reduce: Any, ignore_index: int = -100,
                 label_smoothing: float = 0.0) -> None:
    # ignore_index keeps torch's default: ember's label check refuses a label outside [0, C) anyway
    _no("weight", weight, None)
    _no("size_average", size_average, None)
    _no("reduce", reduce, None)
    _no("ignore_index", ignore_index, -100)
    _no("label_smoothing", label_smoothing, 0.0)


def _cross_entropy(input: Tensor, target: Tensor, weight: Any = None, size_average: Any = None,
                   ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
                   label_smoothing: float = 0.0) -> Tensor:
    _loss_checks(weight, size_average, reduce, ignore_index, label_smoothing)
    return F.cross_entropy(input, target, reduction)


def _nll_loss(input: Tensor, target: Tensor, weight: Any = None, size_average: Any = None,
              ignore_index: int = -100, reduce: Any = None, reduction: str = "mean") -> Tensor:
    _loss_checks(weight, size_average, reduce, ignore_index)
    return F.nll_loss(input, target, reduction)


def _mse_loss(input: Tensor, target: Tensor, size_average: Any = None, reduce: Any = None,
              reduction: str = "mean", weight: Any = None) -> Tensor:
    _loss_checks(weight, size_average, reduce)
    return F.mse_loss(input, target, reduction)


def _clamp(x: Tensor, min: Any = None, max: Any = None) -> Tensor:  # noqa: A002 (torch's names)
    return F.clamp(x, min, max)


def _hardtanh(x: Tensor, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False) -> Tensor:
    return F.hardtanh(x, min_val, max_val)


def _relu6(x: Tensor, inplace: bool = False) -> Tensor:
    return F.relu6(x)


def _sdpa(query: Tensor, key: Tensor, value: Tensor, attn_mask: Any = None, dropout_p: float = 0.0,
          is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> Tensor:
    _no("enable_gqa", enable_gqa, False)
    return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale)


def _expand(x: Tensor, *sizes: Any) -> Tensor:
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        sizes = tuple(sizes[0])
    lead = len(sizes) - len(x.shape)
    if lead < 0:
        _refuse(f"expand to {tuple(sizes)}: fewer sizes than the {len(x.shape)} axes of the tensor")
    shape = tuple(x.shape[i - lead] if d == -1 and i >= lead else int(d) for i, d in enumerate(sizes))
    return F.broadcast_to(x, shape)


def _cat(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    return F.concat(list(tensors), dim)


def _getattr(x: Any, name: str) -> Any:
    if isinstance(x, Tensor) and name not in ("shape", "ndim"):
        _refuse(f"tensor attribute {name!r} (only .shape, .ndim)")
    return getattr(x, name)


def _getitem(x: Any, i: Any) -> Any:
    if isinstance(x, (Tensor, Parameter)):  # (a parameter read by forward, e.g. a positional embedding sliced)
        _refuse("tensor indexing/slicing (only shapes may be indexed)")
    return x[i]


def _torch_functions() -> tuple[dict[Any, Callable[..., Any]], dict[str, Callable[..., Any]]]:
    import torch
    import torch.nn.functional as TF
    functions: dict[Any, Callable[..., Any]] = {
        TF.relu: _relu, torch.relu: _relu,
        torch.sigmoid: F.sigmoid, TF.sigmoid: F.sigmoid,
        torch.tanh: F.tanh, TF.tanh: F.tanh,
        torch.exp: F.exp, torch.log: F.log, torch.sqrt: F.sqrt, torch.abs: F.abs,
        torch.flatten: _flatten, torch.reshape: _view,
        TF.linear: F.linear,
        TF.softmax: _softmax(F.softmax), torch.softmax: _softmax(F.softmax),
        TF.log_softmax: _softmax(F.log_softmax), torch.log_softmax: _softmax(F.log_softmax),
        TF.dropout: _dropout_fn,
        torch.erf: F.erf, TF.gelu: lambda x, approximate="none": F.gelu(x, approximate),
        torch.clamp: _clamp, torch.clip: _clamp, TF.hardtanh: _hardtanh, TF.relu6: _relu6,
        TF.scaled_dot_product_attention: _sdpa,
        TF.avg_pool2d: _avg_pool2d, TF.max_pool2d: _max_pool2d,
        TF.adaptive_avg_pool2d: F.adaptive_avg_pool2d,
        TF.layer_norm: lambda x, normalized_shape, weight=None, bias=None, eps=1e-5:
            F.layer_norm(x, normalized_shape, weight, bias, eps),
        torch.cat: _cat, torch.concat: _cat,
        TF.cross_entropy: _cross_entropy, TF.nll_loss: _nll_loss, TF.mse_loss: _mse_loss,
        torch.add: _arith(operator.add), torch.sub: _arith(operator.sub),
        torch.mul: F.mul, torch.div: F.div, torch.matmul: F.matmul,
        torch.mean: _reduce(F.mean), torch.sum: _reduce(F.sum),
        operator.add: operator.add, operator.sub: operator.sub, operator.mul: operator.mul,
        operator.truediv: operator.truediv, operator.floordiv: operator.floordiv,
        operator.neg: operator.neg, operator.matmul: operator.matmul,
        operator.getitem: _getitem, getattr: _getattr,
    }
    methods: dict[str, Callable[..., Any]] = {
        "view": _view, "reshape": _view, "flatten": _flatten,
        "size": _size, "dim": lambda x: len(x.shape),
        "contiguous": lambda x, memory_format=None: x,
        "relu": _relu, "sigmoid": F.sigmoid, "tanh": F.tanh, "exp": F.exp, "log": F.log,
        "sqrt": F.sqrt, "abs": F.abs,
        "softmax": _softmax(F.softmax), "log_softmax": _softmax(F.log_softmax),
        "add": _arith(operator.add), "sub": _arith(operator.sub), "mul": F.mul, "div": F.div,
        "matmul": F.matmul, "mean": _reduce(F.mean), "sum": _reduce(F.sum),
        "permute": lambda x, *p: F.transpose(x, p[0] if len(p) == 1 and isinstance(p[0], (tuple, list)) else p),
        "transpose": lambda x, a, b: F.swapaxes(x, a, b),
        "t": lambda x: F.transpose(x, (1, 0)),
        "clamp": _clamp, "clip": _clamp, "expand": _expand,
    }
    return functions, methods


# ---- the imported module ---------------------------------------------------------------------

class _Holder(nn.Module):
    """A torch container or custom module: holds the children and direct parameters under the
    torch names; its computation is part of the root's replayed fx graph."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        object.__setattr__(self, "_kind", kind)

    def extra_repr(self) -> str:
        return self._kind


_TORCH_FILE = re.compile(r"[/\\](torch|torch_\w+)[/\\]")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in \S+\n\s*(.*)')


def _user_line(node: Any) -> str:
    """The user's source line of an fx node: the innermost stack frame outside torch itself."""
    frames = _FRAME.findall(node.stack_trace or "")
    user = [f for f in frames if not _TORCH_FILE.search(f[0])]
    if not user:  # e.g. a layer of a torch Sequential: only torch's own frames made the node
        return "no user source line (called by PyTorch's own code)"
    path, line, code = user[-1]  # frames run outermost first: the last is the line that made the node
    return f"{path}:{line}: {code.strip()}"


def _call_name(node: Any) -> str:
    if node.op == "call_module":
        return f"module self.{node.target}"
    if node.op == "get_attr":
        return f"attribute self.{node.target}"
    if node.op == "call_method":
        return f"method Tensor.{node.target}"
    return f"function {_function_name(node.target)}"


_PUBLIC_NAMES: dict[int, str] = {}


def _function_name(t: Any) -> str:
    """torch.cumsum, torch.nn.functional.relu, operator.add: how the user would spell it (the
    public name of the object, since torch's own __module__ is often a C binding's)."""
    if not _PUBLIC_NAMES:
        import torch
        import torch.nn.functional as TF
        for prefix, space in (("torch", torch), ("torch.nn.functional", TF)):  # F's name wins
            for n in dir(space):
                if not n.startswith("_"):
                    _PUBLIC_NAMES[id(getattr(space, n))] = f"{prefix}.{n}"
    if id(t) in _PUBLIC_NAMES:
        return _PUBLIC_NAMES[id(t)]
    mod = getattr(t, "__module__", None) or ""
    name = getattr(t, "__qualname__", getattr(t, "__name__", repr(t)))
    if mod in ("_operator", "operator"):
        mod = "operator"
    elif mod.startswith("torch._C") or not mod or "_VariableFunctions" in name:
        mod, name = "torch", getattr(t, "__name__", name)  # torch.cumsum, not its C binding's class
    return f"{mod}.{name}"


def _fail(node: Any, what: str, hint: str = "") -> TorchImportError:
    return TorchImportError(f"from_torch: {what} at fx node {node.name!r} ({node.op} {_call_name(node)}), "
                            f"{_user_line(node)}" + (f"; {hint}" if hint else ""))


class TorchModel(nn.Module):
    """An ember module replaying a PyTorch module's fx graph (see the module docstring)."""

    def __init__(self, graph_module: Any, functions: dict[Any, Callable[..., Any]],
                 methods: dict[str, Callable[..., Any]], torch_name: str) -> None:
        super().__init__()
        object.__setattr__(self, "_fx", graph_module.graph)
        object.__setattr__(self, "_functions", functions)
        object.__setattr__(self, "_methods", methods)
        object.__setattr__(self, "_torch_name", torch_name)

    def _resolve(self, path: str) -> Any:
        obj: Any = self
        for part in path.split("."):
            obj = obj._modules[part] if part in obj._modules else getattr(obj, part)
        return obj

    def forward(self, x: Tensor, *rest: Tensor) -> Any:
        # `x` named: compile() traces a one-input model's input under the name "x"
        from torch.fx.node import map_arg
        env: dict[Any, Any] = {}
        it = iter((x,) + rest)
        for node in self._fx.nodes:
            args = map_arg(node.args, lambda n: env[n])
            kwargs = map_arg(node.kwargs, lambda n: env[n])
            if node.op == "placeholder":
                env[node] = next(it)
            elif node.op == "get_attr":
                env[node] = self._resolve(node.target)
            elif node.op == "output":
                return args[0]
            else:
                fn = (self._resolve(node.target) if node.op == "call_module" else
                      self._methods[node.target] if node.op == "call_method" else self._functions[node.target])
                if fn in _MODE_AWARE:
                    kwargs = {**kwargs, "model_training": self.training}
                try:
                    env[node] = fn(*args, **kwargs)
                except _Unsupported as e:
                    raise _fail(node, f"unsupported argument {e}") from None
                except TypeError as e:
                    if "argument" not in str(e):  # a signature mismatch: an argument the table does not take
                        raise
                    raise _fail(node, f"unsupported arguments ({e})") from None
                except TorchImportError:
                    raise
                except (NotImplementedError, ShapeError) as e:  # ember refused it: say which torch call
                    raise _fail(node, str(e).splitlines()[0]) from None
        raise AssertionError("fx graph without an output node")

    def extra_repr(self) -> str:
        return f"from torch {self._torch_name}"


def _mirror(tm: Any, em: nn.Module, prefix: str, called: dict[str, Any]) -> None:
    """Copies tm's direct parameters onto em, then its children (mapped if called, else held)."""
    for name, p in tm.named_parameters(recurse=False):
        setattr(em, name, _param(p))
    buffers = [n for n, _ in tm.named_buffers(recurse=False)]
    if buffers:
        raise TorchImportError(f"from_torch: module {prefix or 'the root'} ({type(tm).__name__}) has buffers "
                               f"{buffers} outside a mapped layer (ember imports buffers only for BatchNorm2d)")
    for name, child in tm.named_children():
        path = f"{prefix}.{name}" if prefix else name
        if path in called:
            setattr(em, name, called[path])
            continue
        holder = _Holder(type(child).__name__)
        setattr(em, name, holder)
        _mirror(child, holder, path, called)


def _check_inplace(gm: Any, node: Any) -> None:
    """An in-place op changes its input for every later reader; the replay is out of place, so it
    is faithful only when nothing else reads that input (`self.relu(out)` in a ResNet block)."""
    if node.op == "call_module":
        inplace = getattr(gm.get_submodule(node.target), "inplace", False)
    elif node.op in ("call_function", "call_method"):
        inplace = bool(node.kwargs.get("inplace", False)) or (
            node.op == "call_function" and len(node.args) > 1 and node.args[-1] is True
            and getattr(node.target, "__name__", "") in ("relu", "dropout"))
    else:
        return
    src = node.args[0] if node.args else None
    if inplace and hasattr(src, "users") and len(src.users) > 1:
        raise _fail(node, f"inplace=True on {src.name!r}, which is also read by "
                          f"{sorted(u.name for u in src.users if u is not node)}",
                    "use inplace=False (ember computes out of place)")


def from_torch(module: Any, example_inputs: Sequence[Any] | Any) -> nn.Module:
    """An ember `nn.Module` computing what the PyTorch `module` computes, starting from its
    parameters (same names). Raises `TorchImportError` (one line: fx node, PyTorch call, user's
    source line) for anything it cannot translate faithfully."""
    try:
        import torch
        import torch.fx
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
        raise ModuleNotFoundError("from_torch needs PyTorch: pip install 'ember[torch]'") from None

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"from_torch expects a torch.nn.Module, got {type(module).__name__}")
    examples = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    tracer = torch.fx.Tracer()
    tracer.record_stack_traces = True  # fills node.stack_trace: the user's line in every error
    try:
        graph = tracer.trace(module)
    except (torch.fx.proxy.TraceError, RuntimeError, TypeError) as e:
        # (fx raises RuntimeError for len() of a traced tensor, TypeError for a traced size given
        # to a factory such as torch.ones(n, n): what it cannot trace, not a fault of the model)
        raise TorchImportError(
            f"from_torch: torch.fx cannot trace {type(module).__name__}: {e}; branch on Python values only (not "
            f"tensor values), take sizes as constructor arguments (not len() or a tensor's values), or compute "
            f"that part outside the model") from e
    gm = torch.fx.GraphModule(tracer.root, graph)
    functions, methods = _torch_functions()
    called: dict[str, nn.Module] = {}
    params = dict(module.named_parameters())
    for node in graph.nodes:
        _check_inplace(gm, node)
        if node.op == "call_module":
            tm = gm.get_submodule(node.target)
            build = MODULES.get(type(tm).__name__) if type(tm).__module__.startswith("torch.nn") else None
            if build is None:
                raise _fail(node, f"unsupported module {type(tm).__module__}.{type(tm).__name__}",
                            f"supported modules: {', '.join(sorted(MODULES))}")
            if node.target not in called:
                try:
                    called[node.target] = build(tm)
                except _Unsupported as e:
                    raise _fail(node, f"unsupported argument {e} of {type(tm).__name__}") from None
        elif node.op == "get_attr" and node.target not in params:
            raise _fail(node, "unsupported buffer or constant tensor read by forward (ember imports buffers only "
                        "inside BatchNorm2d)", "hold it as an nn.Parameter with requires_grad=False (imported "
                        "frozen: never trained)")
        elif node.op == "call_method" and node.target not in methods:
            raise _fail(node, f"unsupported tensor method .{node.target}()",
                        f"supported methods: {', '.join(sorted(methods))}")
        elif node.op == "output" and not isinstance(node.args[0], torch.fx.Node):
            # compile() trains loss_fn(model(x), y); tracing a tuple through the loss fails far from here
            out = node.args[0]
            parts = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else (out,)
            nodes = [p for p in parts if isinstance(p, torch.fx.Node)]
            names = ", ".join(p.name if isinstance(p, torch.fx.Node) else repr(p) for p in parts)
            where = _user_line(nodes[-1]) if nodes else _user_line(node)  # fx records no line for the output
            raise TorchImportError(f"from_torch: the model returns a {type(out).__name__} ({names}), not one "
                                   f"tensor, at {where}; return one tensor (compile() trains loss_fn(model(x), y))")
        elif node.op == "call_function" and node.target not in functions:
            raise _fail(node, "unsupported function", "supported functions: "
                        + ", ".join(sorted({_function_name(f) for f in functions})))
    model = TorchModel(gm, functions, methods, type(module).__name__)
    _mirror(module, model, "", called)
    _tie(module, model)
    model.train(module.training)
    expected, got = list(module.state_dict()), list(model.state_dict())
    if sorted(expected) != sorted(got):  # a builder bug, caught at import rather than at load
        raise AssertionError(f"from_torch: state names {got} differ from torch's {expected}")
    # one trace now, on the example inputs: shape errors surface here, with the fx node named
    trace(model, *[_example(x) for x in examples])
    return model


def _example(x: Any) -> Any:
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x)
