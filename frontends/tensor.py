"""Traced tensors: Python operators on `Tensor` add nodes to the graph being traced.

A `Tensor` is only a handle (graph, node). `Parameter` holds a module's persistent NumPy array;
it becomes a `parameter` node the first time a traced op touches it, under the name the tracer
registered for it (PyTorch's `0.weight` style names for modules).
"""
from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from ember.ir import Graph, TensorType, as_dtype, float32

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PACKAGE_DIRS = tuple(os.path.join(_ROOT, d) + os.sep for d in ("ir", "passes", "codegen", "runtime", "frontends"))
_state = threading.local()
#: name of the random step counter's state (see `TraceContext.random_draw`)
RNG_STEP = "rng_step"


def user_location() -> str | None:
    """file:line of the user code that built a node (or raised an error) while tracing.

    Inside a built-in module (its `forward` lives in ember) that ember code called (a layer of a
    `Sequential`, a loss module passed to `compile`), that is the line that constructed the module;
    otherwise (a user-defined module's forward, a built-in layer called from one, a plain function)
    it is the innermost frame outside ember: the user's line that made the node.
    """
    stack = getattr(_state, "stack", None)
    if stack and stack[-1].scopes and stack[-1].scopes[-1][1] is not None:
        return stack[-1].scopes[-1][1]
    return caller_location()


@functools.lru_cache(maxsize=None)
def in_ember(filename: str) -> bool:
    """Whether a code object's file belongs to ember's own packages."""
    return os.path.abspath(filename).startswith(_PACKAGE_DIRS)


def caller_location() -> str | None:
    """file:line of the innermost frame outside ember itself.

    Interpreter frames (runpy, importlib) are passed over; when ember itself built the model
    (e.g. `ember bench`), the outermost ember frame is named instead.
    """
    frame = sys._getframe(1)
    fallback = None
    while frame is not None:
        filename = frame.f_code.co_filename
        path = os.path.abspath(filename)
        if path.startswith(_PACKAGE_DIRS):
            fallback = frame
        elif not filename.startswith("<frozen"):
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    return f"{fallback.f_code.co_filename}:{fallback.f_lineno}" if fallback is not None else None


_FORWARD_IN_EMBER: dict[type, bool] = {}


def forward_in_ember(cls: type) -> bool:
    """Whether modules of class `cls` run a `forward` written in ember (a built-in layer)."""
    hit = _FORWARD_IN_EMBER.get(cls)
    if hit is None:
        code = getattr(getattr(cls, "forward", None), "__code__", None)
        hit = _FORWARD_IN_EMBER[cls] = code is not None and in_ember(code.co_filename)
    return hit


class TraceContext:
    """The graph being traced, with the names of parameters and modules (keyed by `id`) and the
    module-call stack: (module path, fixed source line or None) per module being called."""

    def __init__(self, graph: Graph, param_names: dict[int, str] | None = None,
                 module_names: dict[int, str] | None = None) -> None:
        self.graph = graph
        self.param_names = dict(param_names or {})
        self.module_names = dict(module_names or {})
        self.param_nodes: dict[int, int] = {}
        self.params: dict[str, "Parameter"] = {}
        self.scopes: list[tuple[str, str | None]] = []
        self.buffer_names: dict[int, str] = {}
        self.buffer_nodes: dict[int, int] = {}
        self.buffers: dict[str, "Buffer"] = {}
        self.rng_node: int | None = None  # the step counter's state node, made by the first draw
        self.rng_streams = 0  # random draws so far: the next draw's Philox stream

    def enter_module(self, module: Any, called_from_ember: bool = True) -> None:
        """Pushes `module` on the module-call stack (`Module.__call__` does this while tracing).

        Its path is its qualified name under the traced root (`features.0`); a module the root does
        not hold (a loss module called in `loss_fn`) is named by its class under the caller's path.
        A built-in module called by ember code (a layer of a `Sequential`, the model or loss called
        by `compile`) fixes the source line of its nodes to the user's line that constructed it;
        otherwise (a user's forward, or a built-in layer called from one) the line is the user's
        frame that made the node (see `user_location`)."""
        name = self.module_names.get(id(module))
        if name is None:
            parent = self.scopes[-1][0] if self.scopes else ""
            name = f"{parent}.{type(module).__name__}" if parent else type(module).__name__
        loc = None
        if called_from_ember and forward_in_ember(type(module)):
            loc = module.__dict__.get("_ember_loc")
        self.scopes.append((name, loc))

    def exit_module(self) -> None:
        self.scopes.pop()

    def scope(self) -> str:
        return self.scopes[-1][0] if self.scopes else ""

    def provenance(self) -> dict[str, Any]:
        """`loc` and `scope` for a node built now, as keywords of `Graph.add`."""
        return {"loc": user_location(), "scope": self.scope()}

    def __enter__(self) -> "TraceContext":
        stack = getattr(_state, "stack", None)
        if stack is None:
            stack = _state.stack = []
        stack.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _state.stack.pop()

    def state_node(self, buf: "Buffer") -> int:
        """The `state` node of a module buffer (BatchNorm's running statistics): persistent, not
        trained, read at the start of the step and written back through `set_state`."""
        node = self.buffer_nodes.get(id(buf))
        if node is None:
            name = self.buffer_names.get(id(buf))
            if name is None:
                raise ValueError("a buffer of a module that is not part of the traced model; "
                                 "register it on a submodule of the model")
            node = self.graph.add_state(name, TensorType.of(buf._data), user_location(), scope=name)
            self.buffer_nodes[id(buf)] = node
            self.buffers[name] = buf
        return node

    def set_state(self, buf: "Buffer", value: Any) -> None:
        """The buffer's value after this step (an update of its state node)."""
        self.state_node(buf)
        self.graph.set_update(self.buffer_names[id(buf)], as_node(value))

    def random_draw(self) -> tuple[int, int]:
        """(step counter node, stream) for one random draw (a dropout mask) in this trace.

        The counter is one int64 scalar `state` named RNG_STEP, shared by every draw and advanced
        by one each step (its update); zero-initialised and not a module buffer, so it is kept with
        the optimizer state (saved in checkpoints, absent from the model's state_dict, which stays
        PyTorch's). Draws are numbered in trace order, the same in every step traced from one
        model (full and partial batches), so each dropout call keeps its own stream of masks."""
        if self.rng_node is None:
            self.rng_node = self.graph.add_state(RNG_STEP, TensorType((), "int64"), user_location())
            one = self.graph.add_constant(np.ones((), np.int64))
            self.graph.set_update(RNG_STEP, self.graph.add("add", [self.rng_node, one]))
        stream = self.rng_streams
        self.rng_streams += 1
        return self.rng_node, stream

    def parameter_node(self, p: "Parameter") -> int:
        node = self.param_nodes.get(id(p))
        if node is None:
            name = self.param_names.get(id(p))
            # scope: the parameter's own qualified name (`0.weight`); loc: where it was created
            # (for a built-in layer, the user's line constructing the layer)
            scope = name or self.scope()
            name = name or f"param{len(self.param_nodes)}"
            loc = getattr(p, "_loc", None) or user_location()
            node = self.graph.add_parameter(name, TensorType.of(p._data), loc=loc, scope=scope)
            self.param_nodes[id(p)] = node
            self.params[name] = p
        return node


def active() -> TraceContext | None:
    """The innermost trace in progress, or None."""
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else None


def current() -> TraceContext:
    stack = getattr(_state, "stack", None)
    if not stack:
        raise RuntimeError("this operation builds a graph and must run inside ember.frontends.trace() "
                           "(or a compiled model); to compute eagerly, use NumPy arrays")
    return stack[-1]


def _axis(axis: Any, dim: Any) -> Any:
    if dim is not None and axis is not None:
        raise TypeError("pass the axis once: as a position, `axis=` or torch's `dim=`")
    return dim if dim is not None else axis


def _keep(keepdims: bool, keepdim: bool | None) -> bool:
    return bool(keepdim) if keepdim is not None else keepdims


class _Ops:
    """Operator overloads shared by Tensor and Parameter; each forwards to `functional`."""

    # `ndarray <op> Tensor` must defer to our reflected operator; without this NumPy broadcasts the
    # Tensor as an opaque object and returns an object array of per-element graph nodes.
    __array_ufunc__ = None

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # torch hands any call on our objects here; without this its error reads
        # "must be Tensor, not Tensor", naming neither library
        module = getattr(func, "__module__", None) or "torch"
        where = "torch" if module.startswith("torch._C") or module == "torch" else module
        name = f"{where}.{getattr(func, '__name__', func)}"
        raise TypeError(f"{name} was called on an ember Tensor inside a traced forward(); use "
                        f"ember.frontends.functional (e.g. F.relu) or the Tensor's own methods, or import "
                        f"the PyTorch module with ember.frontends.from_torch")

    def __add__(self, o): return F.add(self, o)
    def __radd__(self, o): return F.add(o, self)
    def __sub__(self, o): return F.sub(self, o)
    def __rsub__(self, o): return F.sub(o, self)
    def __mul__(self, o): return F.mul(self, o)
    def __rmul__(self, o): return F.mul(o, self)
    def __truediv__(self, o): return F.div(self, o)
    def __rtruediv__(self, o): return F.div(o, self)
    def __matmul__(self, o): return F.matmul(self, o)
    def __rmatmul__(self, o): return F.matmul(o, self)
    def __neg__(self): return F.neg(self)
    def __lt__(self, o): return F.lt(self, o)
    def __le__(self, o): return F.le(self, o)
    def __gt__(self, o): return F.gt(self, o)
    def __ge__(self, o): return F.ge(self, o)

    @property
    def T(self): return F.transpose(self, tuple(range(len(self.shape)))[::-1])
    @property
    def ndim(self) -> int: return len(self.shape)

    def reshape(self, *shape): return F.reshape(self, shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape)
    def view(self, *shape): return self.reshape(*shape)
    def flatten(self, start_dim: int = 0, end_dim: int = -1): return F.flatten(self, start_dim, end_dim)
    def transpose(self, a: int, b: int): return F.swapaxes(self, a, b)
    def permute(self, *perm): return F.transpose(self, perm[0] if len(perm) == 1 and isinstance(perm[0], (tuple, list)) else perm)
    # torch spells the axis `dim` and the flag `keepdim`; both spellings are accepted
    def sum(self, axis=None, keepdims: bool = False, *, dim=None, keepdim=None):
        return F.sum(self, _axis(axis, dim), _keep(keepdims, keepdim))
    def mean(self, axis=None, keepdims: bool = False, *, dim=None, keepdim=None):
        return F.mean(self, _axis(axis, dim), _keep(keepdims, keepdim))
    def max(self, axis=None, keepdims: bool = False, *, dim=None, keepdim=None):
        return F.max(self, _axis(axis, dim), _keep(keepdims, keepdim))
    def min(self, axis=None, keepdims: bool = False, *, dim=None, keepdim=None):
        return F.min(self, _axis(axis, dim), _keep(keepdims, keepdim))
    def var(self, axis=None, unbiased: bool = True, keepdims: bool = False, *, dim=None, keepdim=None):
        return F.var(self, _axis(axis, dim), unbiased, _keep(keepdims, keepdim))
    def argmax(self, axis: int = -1, *, dim=None): return F.argmax(self, _axis(axis, dim))
    def softmax(self, dim: int = -1): return F.softmax(self, dim)
    def log_softmax(self, dim: int = -1): return F.log_softmax(self, dim)
    def unsqueeze(self, dim: int): return F.unsqueeze(self, dim)
    def squeeze(self, dim=None): return F.squeeze(self, dim)
    def clamp(self, min=None, max=None): return F.clamp(self, min, max)  # noqa: A002
    clip = clamp
    def pow(self, exponent): return F.pow(self, exponent)
    def __pow__(self, exponent): return F.pow(self, exponent)
    def square(self): return F.mul(self, self)
    def size(self, dim: int | None = None): return self.shape if dim is None else self.shape[dim]
    def dim(self) -> int: return len(self.shape)
    def numel(self) -> int: return int(np.prod(self.shape))
    def detach(self): return F.stop_gradient(self)
    def contiguous(self): return self  # ember owns layouts: every value is contiguous as far as a model can tell
    def float(self): return F.cast(self, "float32")
    def relu(self): return F.relu(self)
    def sigmoid(self): return F.sigmoid(self)
    def tanh(self): return F.tanh(self)
    def exp(self): return F.exp(self)
    def log(self): return F.log(self)
    def sqrt(self): return F.sqrt(self)
    def rsqrt(self): return F.reciprocal(F.sqrt(self))
    def reciprocal(self): return F.reciprocal(self)
    def abs(self): return F.abs(self)
    def neg(self): return F.neg(self)
    def sin(self): return F.sin(self)
    def cos(self): return F.cos(self)
    def floor(self): return F.floor(self)
    def astype(self, dtype): return F.cast(self, dtype)


class Tensor(_Ops):
    __slots__ = ("graph", "node")

    def __init__(self, graph: Graph, node: int) -> None:
        self.graph = graph
        self.node = node

    @property
    def type(self) -> TensorType:
        return self.graph.type(self.node)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.type.shape

    @property
    def dtype(self):
        return self.type.dtype

    def __repr__(self) -> str:
        return f"Tensor(%{self.node}: {self.type})"

    def __bool__(self) -> bool:
        raise TypeError("a traced Tensor has no value at trace time, so it cannot be used in `if`/`while`; "
                        "use ember.frontends.functional.where for data-dependent choices")

    def __hash__(self) -> int:
        return id(self)


#: bumped whenever a module's Parameter, Buffer or submodule is (re)assigned, or a held array is
#: taken over by another compiled step: a step compares it with the value it last checked, so
#: noticing a model change costs one comparison per step, not a walk of the model
_MODEL_EPOCH = [0]


def model_changed() -> None:
    _MODEL_EPOCH[0] += 1


def model_epoch() -> int:
    return _MODEL_EPOCH[0]


class Held:
    """The array of a Parameter or Buffer, kept current with the compiled step that holds it.

    On the host (cpu, reference) the step trains this very array, so nothing is ever copied. On a
    device the step's storage owns the values; its link (`frontends.compile`) bumps a version
    after every step, and `data` pulls the array when it is older than that. Reading `data` also
    marks the array as written, since the caller may write into what it got; the next step pushes
    it. So only what the user touches is copied, and an untouched training loop copies nothing.
    """

    _link: Any = None  # the link of the compiled step holding this array (None: not compiled)
    _name: str = ""  # its name in that step's storage
    _seen: int = -1  # the link's version the host array was last current at

    @property
    def data(self) -> np.ndarray:
        link = self._link
        if link is not None and link.device:
            link.fetch(self, written=True)
        return self._data

    @data.setter
    def data(self, value: Any) -> None:
        self._data = value
        if self._link is not None:
            self._link.rebound(self)

    def _read(self) -> np.ndarray:
        """The current values, for a caller that only copies them (nothing to push back)."""
        link = self._link
        if link is not None and link.device:
            link.fetch(self, written=False)
        return self._data

    def _assign(self, value: np.ndarray) -> None:
        """Overwrites every value in place; nothing is pulled first, since nothing old survives."""
        self._data[...] = value
        if self._link is not None:
            self._link.rebound(self)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._data.shape

    def __getstate__(self) -> dict[str, Any]:
        """A copy (`copy.deepcopy`, pickle) holds the current values and no step's link."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("_link", "_name", "_seen")}
        state["_data"] = self._read()
        return state


class Parameter(Held, _Ops):
    """A trainable array (float32 by default) owned by a Module. `requires_grad = False` (or
    `requires_grad_(False)`) freezes it, as in PyTorch: a training step then neither computes its
    gradient nor updates it; a step compiled before the change is compiled again at its next call."""

    _requires_grad = True

    def __init__(self, data: Any, dtype: Any = float32, requires_grad: bool = True) -> None:
        # order="C", not ascontiguousarray: that makes a 0-d array 1-d
        self.data = np.asarray(data, dtype=as_dtype(dtype).numpy, order="C")
        self._loc = caller_location()  # the user's line creating it (or the layer holding it)
        self._requires_grad = bool(requires_grad)

    @property
    def requires_grad(self) -> bool:
        return self._requires_grad

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"requires_grad must be True or False, got {value!r}")
        if bool(value) != self._requires_grad:
            self._requires_grad = bool(value)
            model_changed()  # a compiled step notices at its next call and compiles again

    def requires_grad_(self, requires_grad: bool = True) -> "Parameter":
        self.requires_grad = requires_grad
        return self

    @property
    def dtype(self):
        return as_dtype(self._data.dtype)

    def numpy(self) -> np.ndarray:
        return self.data

    def __repr__(self) -> str:
        return f"Parameter({TensorType.of(self._data)})"


class Buffer(Held):
    """A module's persistent, untrained array (PyTorch's buffer): running statistics. Traced as a
    graph `state`; `compile()` holds it in storage next to the parameters and the step updates it."""

    def __init__(self, data: Any, dtype: Any = float32) -> None:
        self.data = np.asarray(data, dtype=TensorType((), dtype).dtype.numpy, order="C")

    @property
    def dtype(self):
        return as_dtype(self._data.dtype)

    def __repr__(self) -> str:
        return f"Buffer(shape={self.shape}, dtype={self._data.dtype})"


def _scalar_fits(x: Any, dtype) -> bool:
    """Whether a Python/NumPy scalar takes the dtype of the tensor it meets without changing value
    class: any number for a float tensor, integers (and bools) for an integer tensor, bools for a
    bool tensor. Otherwise (`int_tensor + 0.5`) the scalar keeps its own dtype and the op's rule
    reports the dtype mismatch, rather than the constant being silently truncated to 0."""
    if dtype.is_float:
        return True
    if dtype.name == "bool":
        return isinstance(x, (bool, np.bool_))
    return isinstance(x, (bool, int, np.integer, np.bool_))


def as_node(x: Any, like: "Tensor | Parameter | None" = None) -> int:
    """Lifts a Tensor, Parameter, NumPy array or Python scalar into a node of the current graph."""
    ctx = current()
    if isinstance(x, Tensor):
        if x.graph is not ctx.graph:
            raise ValueError(f"{x!r} belongs to another traced graph ({x.graph.name!r}); "
                             "tensors cannot cross trace() calls")
        return x.node
    if isinstance(x, Parameter):
        return ctx.parameter_node(x)
    if isinstance(x, Buffer):
        return ctx.state_node(x)
    if isinstance(x, (bool, int, float, np.number, np.bool_)) and like is not None and _scalar_fits(x, like.dtype):
        return ctx.graph.add_constant(np.asarray(x, dtype=like.dtype.numpy), **ctx.provenance())
    if isinstance(x, (np.ndarray, bool, int, float, np.number, np.bool_)):
        arr = np.asarray(x)
        if arr.dtype == np.float64 and not (like is not None and like.dtype.name == "float64"):
            arr = arr.astype(np.float32)  # Python floats default to the model's float32
        return ctx.graph.add_constant(arr, **ctx.provenance())
    if type(x).__module__.split(".")[0] == "torch":
        raise TypeError(f"a torch.{type(x).__name__} cannot be used in a traced ember forward(); pass .numpy() for a "
                        f"constant, wrap trainable values in ember.frontends.Parameter, or import the module with from_torch")
    raise TypeError(f"cannot use {type(x).__name__} as a traced operand; expected a Tensor, Parameter, array or number")


def spec(shape: Sequence[int], dtype: Any = float32) -> TensorType:
    """An example-input placeholder for trace()/compile(): shape and dtype, no data."""
    return TensorType(tuple(shape), as_dtype(dtype))


from . import functional as F  # noqa: E402  (functional imports Tensor from here)
