"""`trace(fn, *example_args) -> Graph`: run `fn` once on symbolic tensors and record the graph."""
from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ember.ir import Graph, TensorType

from .nn import Module
from .tensor import Parameter, Tensor, TraceContext, user_location


def example_type(x: Any) -> TensorType:
    """TensorType of an example argument: a TensorType/spec, an array, or anything array-like."""
    if isinstance(x, TensorType):
        return x
    if isinstance(x, Parameter):
        return TensorType.of(x._data)
    arr = np.asarray(x)
    if arr.dtype == np.float64:
        raise TypeError("example input is float64; ember models are float32: pass x.astype(np.float32)")
    return TensorType.of(arr)


def _arg_names(fn: Callable, n: int) -> list[str]:
    target = fn.forward if isinstance(fn, Module) else fn
    try:
        params = [p.name for p in inspect.signature(target).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = params[:n] if len(params) >= n else [f"arg{i}" for i in range(n)]
    return names


def trace(fn: Callable[..., Any], *example_args: Any, name: str | None = None,
          input_names: list[str] | None = None, modules: Mapping[str, Module] | None = None) -> Graph:
    """Traces `fn` on symbolic inputs typed like `example_args` and returns the Graph.

    Parameters of `fn` (when it is a Module) and of `modules` (prefix -> module, for closures
    over models) get PyTorch-style names; outputs are named "out" for a single tensor, "out0",
    "out1", ... for a tuple, or by key for a dict.
    """
    graph = Graph(name or getattr(fn, "__name__", type(fn).__name__))
    names: dict[int, str] = {}
    module_names: dict[int, str] = {}  # module -> qualified name (its nodes' scope)
    module_types: dict[str, str] = {}  # qualified name -> its class (what a precision rule may be keyed by)
    buffer_names: dict[int, str] = {}  # buffer -> qualified name (its state's name)
    # A list, not a union of dict views: that set needs hashable modules and has no stable order.
    for prefix, mod in ([("", fn)] if isinstance(fn, Module) else []) + list(dict(modules or {}).items()):
        for pname, p in mod.named_parameters(prefix):
            names[id(p)] = pname
        for mname, m in mod.named_modules(prefix):
            module_names.setdefault(id(m), mname)
            module_types.setdefault(mname, type(m).__name__)
        for bname, buf in mod.named_buffers(prefix):
            buffer_names[id(buf)] = bname
    with TraceContext(graph, names, module_names) as ctx:
        ctx.buffer_names.update(buffer_names)
        arg_names = input_names or _arg_names(fn, len(example_args))
        loc = user_location()
        args = [Tensor(graph, graph.add_input(n, example_type(a), loc=loc)) for n, a in zip(arg_names, example_args)]
        result = fn(*args)
    if isinstance(result, Tensor):
        outs = {"out": result}
    elif isinstance(result, (tuple, list)):
        outs = {f"out{i}": r for i, r in enumerate(result)}
    elif isinstance(result, dict):
        outs = dict(result)
    else:
        raise TypeError(f"traced function must return a Tensor, a tuple or a dict of Tensors, got {type(result).__name__}")
    for k, t in outs.items():
        if not isinstance(t, Tensor) or t.graph is not graph:
            raise TypeError(f"output {k!r} is not a tensor of this trace: {t!r}")
        graph.set_output(k, t.node)
    graph.meta["parameters"] = ctx.params  # name -> Parameter, for compile()
    graph.meta["buffers"] = ctx.buffers  # name -> Buffer (module state), for compile()
    graph.meta["modules"] = module_types  # scope -> module class (passes/precision.py: MODULE_RULES)
    return graph.verify()
