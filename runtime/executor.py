"""The interface every backend's executor implements, the shared parameter/state storage, and the
reference target (the NumPy interpreter).

An executor runs one compiled step: `outputs = executor(inputs)`. Parameters and optimizer
state are not arguments: they live in a target's `Storage` (host arrays here) that several
executors share (the training step, the step compiled for a last partial batch, the inference
step), and every `update` of the graph is written back into those arrays in place at the end of
the call, so a caller holding a host storage's array always sees its current value (a device
storage's values reach the host only through `read`; the frontend's `TrainStep` keeps the model's
arrays current with it).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ember.ir import Graph, TensorType, as_dtype, run
from ember.passes import pipeline, targets


@runtime_checkable
class Executor(Protocol):
    """One compiled step of a graph, bound to a Storage."""

    signature: Mapping[str, TensorType]  # input name -> the type the step was compiled for

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Runs the step once; returns the outputs and writes every update into storage in place."""
        ...


class Storage:
    """Parameters and optimizer state by name, wherever the target keeps them.

    The interface every target's storage implements: `add` adopts a host array, `read` returns
    a host copy (the only way values reach the host: explicit synchronisation), `write` copies a
    host value in, `check` verifies a graph's parameters and states are held with their types.
    """

    def add(self, name: str, array: np.ndarray) -> None:
        raise NotImplementedError

    def read(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """A host copy of `name`, into `out` (a C-contiguous array of its shape and dtype) if given."""
        raise NotImplementedError

    def write(self, name: str, value: np.ndarray) -> None:
        raise NotImplementedError

    def type_of(self, name: str) -> TensorType:
        raise NotImplementedError

    def host_array(self, name: str) -> np.ndarray | None:
        """The live host array holding `name`, where the storage keeps one (None on a device)."""
        return None

    # every storage keeps its values by name in `_arrays` (host or device arrays)
    _arrays: dict[str, Any]

    def __contains__(self, name: object) -> bool:
        return name in self._arrays

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    def check(self, graph: Graph) -> None:
        """Every parameter and state of `graph` is held here with exactly its type."""
        for kind, table in (("parameter", graph.parameters), ("state", graph.states)):
            for name, n in table.items():
                want = graph.type(n)
                if name not in self:
                    raise KeyError(f"storage holds no {kind} {name!r} ({want}) needed by graph {graph.name!r}; "
                                   f"it holds: {sorted(self)}")
                have = self.type_of(name)
                if have != want:
                    raise TypeError(f"storage {kind} {name!r} is {have}, graph {graph.name!r} expects {want}")


class HostStorage(Storage):
    """Host storage: one contiguous NumPy array per name, shared by executors (CPU, reference).

    Arrays are held, not copied: `HostStorage({"w": model_param.data})` makes the step train the
    model's own array. Values are only ever replaced in place (`write`), never rebound.
    """

    def __init__(self, arrays: Mapping[str, np.ndarray] | None = None) -> None:
        self._arrays: dict[str, np.ndarray] = {}
        for name, a in (arrays or {}).items():
            self.add(name, a)

    def add(self, name: str, array: np.ndarray) -> None:
        if name in self._arrays:
            raise KeyError(f"storage already holds {name!r}")
        if not isinstance(array, np.ndarray) or not array.flags.c_contiguous or not array.flags.writeable:
            raise ValueError(f"storage entry {name!r} must be a writeable C-contiguous NumPy array "
                             "(it is updated in place)")
        self._arrays[name] = array

    def __getitem__(self, name: str) -> np.ndarray:
        return self._arrays[name]

    def items(self):
        return self._arrays.items()

    def write(self, name: str, value: np.ndarray) -> None:
        """Copies `value` into the held array (same shape; cast to its dtype)."""
        target = self._arrays[name]
        if np.shape(value) != target.shape:
            raise ValueError(f"storage {name!r}: cannot write shape {np.shape(value)} into {target.shape}")
        np.copyto(target, value, casting="same_kind")

    def read(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            return self._arrays[name].copy()
        np.copyto(out, self._arrays[name])
        return out

    def host_array(self, name: str) -> np.ndarray | None:
        return self._arrays[name]

    def type_of(self, name: str) -> TensorType:
        return TensorType.of(self._arrays[name])


def planned_view(graph: Graph, n: int, arena: Any, constant: Any, stored: Any) -> Any:
    """The array where node n's value lives after a compiled step, from the memory plan's notes:
    a view of `arena` (a NumPy or CuPy byte array), `constant(n)`, or `stored(name)` for memory the
    target's storage owns. Shared by every executor that runs a planned graph."""
    notes, t = graph.notes(n), graph.type(n)
    storage = notes["storage"]
    if storage == "alias":
        return planned_view(graph, notes["alias_of"], arena, constant, stored).reshape(t.shape)
    if storage in ("arena", "input"):
        off = notes["offset"]
        return arena[off:off + t.nbytes].view(t.dtype.numpy).reshape(t.shape)
    if storage == "constant":
        return constant(n)
    return stored(notes["name"])


def check_inputs(signature: Mapping[str, TensorType], inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Validates call arguments against a step's signature; returns them as contiguous arrays.

    Shapes and dtypes must match exactly (a step is compiled for them; nothing is cast silently).
    """
    missing = [k for k in signature if k not in inputs]
    extra = [k for k in inputs if k not in signature]
    if missing or extra:
        raise TypeError(f"step inputs do not match its signature ({', '.join(f'{k}: {t}' for k, t in signature.items())}): "
                        f"missing {missing}, unexpected {extra}")
    out = {}
    for name, want in signature.items():
        value = inputs[name]
        arr = value if isinstance(value, np.ndarray) else np.asarray(value)
        try:
            have = TensorType(arr.shape, as_dtype(arr.dtype))
        except TypeError:
            raise TypeError(f"input {name!r}: expected {want}, got an array of unsupported dtype {arr.dtype}") from None
        if have != want:
            hint = ""
            if have.shape == want.shape:
                hint = f" (convert with .astype(np.{want.dtype.numpy_name}))"
            raise TypeError(f"input {name!r}: expected {want}, got {have}{hint}")
        out[name] = np.ascontiguousarray(arr)
    return out


def class_inputs(graph: Graph) -> dict[str, int]:
    """Inputs that `graph` one-hot encodes (class labels) -> their number of classes.

    one_hot turns a label outside 0..num_classes-1 into a zero row, so a bad label would train
    silently; the step's callers check these inputs with `check_class_inputs`. Read it from a
    graph before fusion, where a one_hot still consumes its input directly.
    """
    by_node = {n: name for name, n in graph.inputs.items()}
    out: dict[str, int] = {}
    for n in graph.nodes():
        if graph.op(n) == "one_hot":
            src = graph.operands(n)[0]
            if src in by_node:
                k = int(graph.attrs(n)["num_classes"])
                name = by_node[src]
                out[name] = min(k, out.get(name, k))
    return out


_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def check_class_inputs(classes: Mapping[str, int], inputs: Mapping[str, Any]) -> None:
    """Raises ValueError naming the first label outside 0..k-1 (PyTorch's cross-entropy raises too).

    A good batch costs one reduction: signed labels viewed as unsigned put every negative one
    above any class count, so `max < k` checks both bounds (this runs every step); the index is
    searched only when a label is bad.
    """
    for name, k in classes.items():
        a = inputs[name]
        if type(a) is np.ndarray and a.dtype == np.int64 and a.flags.c_contiguous and a.size \
                and a.view(np.uint64).max() < k:
            continue  # the usual batch, checked in one reduction
        if hasattr(a, "__cuda_array_interface__"):  # a device array: checked where it lives (one sync)
            if a.size and bool(((a < 0) | (a >= k)).any()):
                a = a.get()  # the index search below, on the host
            else:
                continue
        a = np.asarray(a)
        if a.size == 0 or not np.issubdtype(a.dtype, np.integer):
            continue  # the signature check reports a wrong dtype
        unsigned = _UNSIGNED.get(a.dtype.itemsize) if a.flags.c_contiguous and a.dtype.kind == "i" else None
        if unsigned is not None and a.view(unsigned).max() < k:
            continue
        if unsigned is None and a.min() >= 0 and a.max() < k:
            continue
        flat = a.reshape(-1)
        i = int(np.flatnonzero((flat < 0) | (flat >= k))[0])
        where = i if a.ndim <= 1 else tuple(int(j) for j in np.unravel_index(i, a.shape))
        raise ValueError(f"input {name!r}: label {int(flat[i])} at batch index {where} is out of range "
                         f"for {k} classes (expected 0..{k - 1})")


class ReferenceExecutor:
    """Runs a graph on the NumPy interpreter (`ember.ir.run`): the semantics every backend matches."""

    peak_bytes = None  # no memory plan on the reference device

    def __init__(self, graph: Graph, storage: Storage, dump_dir: Any = None, name: str = "step",
                 profile: bool | None = None) -> None:
        storage.check(graph)
        self.graph = graph
        self.storage = storage
        self.signature: dict[str, TensorType] = {k: graph.type(n) for k, n in graph.inputs.items()}

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        args = check_inputs(self.signature, inputs)
        g = self.graph
        params = {k: self.storage[k] for k in g.parameters}
        states = {k: self.storage[k] for k in g.states}
        res = run(g, args, params, states)
        # Outputs are copied: one may be (a view of) a storage array that the writes below change.
        outputs = {k: np.array(v, copy=True) for k, v in res.outputs.items()}
        # Every update was computed from the old values (run evaluates all before we write any);
        # one that is itself a storage array (an update p <- q) is copied first, or writing q
        # before p would change it.
        held = [a for _, a in self.storage.items()]
        updates = {k: (np.array(v, copy=True) if any(np.may_share_memory(v, a) for a in held) else v)
                   for k, v in res.updates.items()}
        for name, value in updates.items():
            self.storage.write(name, value)
        return outputs


TARGET = targets.register(targets.Target(
    name="reference",
    description="the NumPy interpreter: the semantics every backend matches (slow)",
    pipeline=pipeline.interpreted,
    executor=ReferenceExecutor,
    storage=HostStorage,
    precisions=frozenset({"float32", "bf16"}),  # the interpreter computes bfloat16 (ir/interpreter.py)
))
