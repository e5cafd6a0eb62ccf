"""`compile()`: model + loss + optimizer -> a `TrainStep` that runs one training step per call.

    step = ember.frontends.compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.05),
                                   example_inputs=(x, y), device="reference")
    loss = step(x, y)            # forward, backward and the update: one compiled step
    logits = step.inference(x)   # the model alone, on the same parameters

The step traces `loss_fn(model(x), y)`, builds the train graph (autodiff, optimizer), runs the
target's passes and hands the result to the device's executor. Parameters live in one `Storage`
whose parameter arrays *are* the model's `Parameter.data` arrays, updated in place, so the model
always shows the trained values; optimizer state lives there too. Every other compiled graph (a
last partial batch, inference at any batch size) is compiled on first use, cached by input
types, and shares that storage.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ember.ir import Graph, TensorType, as_dtype
from ember.passes.optimizer import OptimizerConfig, initial_state
from ember.passes.data_parallel import DEFAULT_BUCKET_BYTES
from ember.passes.pipeline import run_passes, train_passes, with_data_parallel
from ember.runtime import target as get_target
from ember.runtime.comm import broadcast_parameters
from ember.runtime.consistency import agree_on_step
from ember.runtime.executor import Executor, check_class_inputs, class_inputs

from .nn import Module
from .optim import as_config
from .tensor import Parameter
from .tracing import example_type, trace


_DEVICE_ARRAY_TYPES: set[type] = set()


def _array(a: Any) -> Any:
    """An array as given when it already is one (NumPy, or a device array), else as NumPy."""
    # Runs twice a step: a device step is ~20 us, so the attribute probe is paid once per type.
    t = type(a)
    if t is np.ndarray or t in _DEVICE_ARRAY_TYPES:
        return a
    if hasattr(a, "__cuda_array_interface__"):
        _DEVICE_ARRAY_TYPES.add(t)
        return a
    return a if isinstance(a, np.ndarray) else np.asarray(a)


def _note_compile_stats(executor: Any, passes_seconds: float, dump: Path | None) -> None:
    """Adds the passes' seconds to what the executor measured (rendering, compiler, cache hits)
    and writes it all to `<dump>/compile_stats.json` (atomically) when dumping."""
    stats = {"passes_s": round(passes_seconds, 4), **getattr(executor, "compile_stats", {})}
    try:
        executor.compile_stats = stats
    except AttributeError:  # an executor that does not take attributes: stats stay unrecorded
        return
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dump, prefix=".compile_stats.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(stats, indent=1) + "\n")
            os.replace(tmp, dump / "compile_stats.json")
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _shape_tag(types: tuple[TensorType, ...]) -> str:
    return "x".join(str(d) for d in types[0].shape) or "scalar"


def _check_batch(types: "tuple[TensorType, ...] | list[TensorType]", names: tuple[str, ...], what: str) -> None:
    """A batch of 0 samples has nothing to train on (and no kernel has a 0-sized loop to render)."""
    for name, t in zip(names, types):
        if t.shape and t.shape[0] == 0:
            raise ValueError(f"{what}: input {name!r} has a batch of 0 samples (type {t}); expected at least 1")


class TrainStep:
    """A compiled training step bound to a model; see the module docstring."""

    def __init__(self, model: Module, loss_fn: Callable[[Any, Any], Any], optimizer: OptimizerConfig,
                 example_inputs: tuple[Any, Any], device: str = "reference",
                 dump_dir: str | os.PathLike | None = None, profile: bool = False,
                 communicator: Any = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 precision: str = "float32") -> None:
        self.target = get_target(device)
        check_precision(precision, self.target)
        self.precision = precision
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, (int, np.integer)) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes {bucket_bytes!r}: expected an integer >= 1 (bytes of gradients "
                             f"per all-reduce bucket; default {DEFAULT_BUCKET_BYTES}, PyTorch DDP's 25 MiB)")
        self.bucket_bytes = int(bucket_bytes)
        # data parallel: this process is one rank of `communicator`'s world (ember.runtime.comm);
        # its train step all-reduces the gradients (passes/data_parallel.py) and averages the loss
        self.comm = communicator if communicator is not None and communicator.size > 1 else None
        if self.comm is not None and device not in ("cpu", "cuda"):
            raise ValueError(f"data parallel over a communicator runs on devices 'cpu' (MPI) and 'cuda' (NCCL), "
                             f"not {device!r}")
        if self.target.available is not None:
            self.target.available()
        if not isinstance(model, Module):
            raise TypeError(f"compile() expects an ember.frontends.nn.Module, got {type(model).__name__}")
        if len(example_inputs) != 2:
            raise ValueError(f"example_inputs must be (x, y), got {len(example_inputs)} values")
        if not model.parameters():
            raise ValueError(f"compile(): the model ({type(model).__name__}) has no parameters to train; "
                             f"an optimizer needs at least one Parameter (a Linear, Conv2d, ...)")
        self.model = model
        self.loss_fn = loss_fn
        self.config = optimizer
        self.device = device
        self.profile = profile
        root = dump_dir if dump_dir is not None else os.environ.get("EMBER_DUMP_DIR") or None
        self.dump_dir = Path(root) if root is not None else None
        self.storage = self.target.storage()
        self._params: dict[str, Parameter] = {}
        self._host: dict[str, np.ndarray] = {}  # name -> the array `Parameter.data` was last synchronised with
        self._steps: dict[tuple[TensorType, ...], tuple[Graph, Executor]] = {}
        self._inference: dict[tuple[Any, ...], tuple[Graph, Executor]] = {}  # (types, training)
        self._by_key: dict[tuple, Executor] = {}
        self._classes: dict[str, int] = {}  # labels input -> number of classes (from the traced one_hot)
        self._example = tuple(example_type(a) for a in example_inputs)
        _check_batch(self._example, ("x", "y"), "example_inputs")
        self._train_executor(self._example)  # compile eagerly: errors surface at compile()
        self.sync_ranks()  # every rank starts from rank 0's parameters and state (checked by hash)

    @property
    def compile_stats(self) -> dict[str, Any]:
        """Where the example shape's training step compile went: seconds in the passes
        (`passes_s`), rendering (`render_s`) and the compiler (`compiler_s`, cache lookups
        included), and on the CPU how many objects were built or found in the cache."""
        return dict(getattr(self._steps[self._example][1], "compile_stats", {}))

    def sync_ranks(self) -> None:
        """Data parallel: rank 0's parameters and optimizer state into every rank, then a check
        that every rank holds the same bits (a collective: every rank calls it; no-op alone).
        Done at the start and after loading a checkpoint."""
        if self.comm is None:
            return
        self._sync()
        if hasattr(self.comm, "broadcast_storage"):  # a device communicator broadcasts device memory
            self.comm.broadcast_storage(self.storage)
        else:
            broadcast_parameters(self.comm, {k: self.storage[k] for k in self.storage})

    # ---- building ----------------------------------------------------------------------------
    def _bind(self, graph: Graph) -> None:
        """Adds the parameters the graph's trace touched (the model's own arrays) and any
        optimizer state not yet held to the shared storage."""
        # buffers (module state) are held like parameters: storage shares the model's arrays
        held = {**graph.meta.get("parameters", {}), **graph.meta.get("buffers", {})}
        for name, p in held.items():
            if name in self._params:
                if self._params[name] is not p:
                    raise ValueError(f"parameter name {name!r} now names a different Parameter object")
                continue
            if not p.data.flags.c_contiguous or not p.data.flags.writeable:
                p.data = np.ascontiguousarray(p.data).copy()
            self._params[name] = p
            self.storage.add(name, p.data)
            self._host[name] = p.data
        for name, value in initial_state(graph).items():
            if name not in self.storage:
                self.storage.add(name, value)

    def _dump_subdir(self, kind: str, types: tuple[TensorType, ...]) -> Path | None:
        return self.dump_dir / f"{kind}-{_shape_tag(types)}" if self.dump_dir is not None else None

    def _train_executor(self, types: tuple[TensorType, ...]) -> Executor:
        hit = self._steps.get(types)
        if hit is None:
            model, loss_fn = self.model, self.loss_fn
            forward = trace(lambda x, y: loss_fn(model(x), y), *types, name="train_step", modules={"": model})
            forward.meta["precision"] = self.precision
            dump = self._dump_subdir("train", types)
            passes = train_passes(self.config) + self.target.passes()
            extra = {}
            if self.comm is not None:
                passes = with_data_parallel(passes, self.comm.size, self.bucket_bytes)
                extra = {"communicator": self.comm}
            t0 = time.perf_counter()
            graph = run_passes(forward, passes, dump_dir=dump)
            passes_seconds = time.perf_counter() - t0
            self._bind(forward)
            self._bind(graph)
            # Every shape traces the same loss, so one graph fixes which inputs are labels.
            self._classes = class_inputs(forward)
            hit = self._steps[types] = (graph, self.target.executor(graph, self.storage, dump, profile=self.profile,
                                                                    **extra))
            _note_compile_stats(hit[1], passes_seconds, dump)
            if self.comm is not None:
                # every rank must have compiled the same step (same code, model and settings):
                # checked before the parameters are broadcast, which a different model would hang
                agree_on_step(self.comm, hit[1], graph)
        return hit[1]

    def _inference_executor(self, types: tuple[TensorType, ...]) -> Executor:
        key = (types, self.model.training)  # train/eval mode changes the graph (BatchNorm)
        hit = self._inference.get(key)
        if hit is None:
            forward = trace(self.model, *types, name="inference")
            forward.meta["precision"] = self.precision
            if list(forward.outputs) != ["out"]:
                raise TypeError(f"inference() needs a model returning one tensor, got outputs {list(forward.outputs)}")
            dump = self._dump_subdir("inference", types)
            t0 = time.perf_counter()
            graph = run_passes(forward, self.target.passes(), dump_dir=dump)
            passes_seconds = time.perf_counter() - t0
            self._bind(forward)
            hit = self._inference[key] = (graph, self.target.executor(graph, self.storage, dump, profile=self.profile))
            _note_compile_stats(hit[1], passes_seconds, dump)
        return hit[1]

    def _sync(self) -> None:
        """Re-adopts a parameter whose `.data` the user rebound to a new array: its values are
        copied into storage and `.data` points at the storage's host array again (where the
        storage has one; on a device `.data` is the host copy last synchronised)."""
        for name, p in self._params.items():
            if p.data is not self._host[name]:
                self.storage.write(name, p.data)
                if self._host[name] is not None and self.storage.host_array(name) is not None:
                    p.data = self._host[name]
                else:
                    self._host[name] = p.data

    def _pull(self) -> None:
        """Brings device-held parameters back into the model's arrays (nothing to do on the host)."""
        for name, p in self._params.items():
            if self.storage.host_array(name) is None:
                np.copyto(p.data, self.storage.read(name))

    def precompile(self, shape: Sequence[int]) -> None:
        """Compiles the training step for inputs `x` of `shape` (labels of the same batch) now,
        e.g. the last partial batch of an epoch, so the epoch does not stall on it mid-way.
        A shape already compiled is a no-op."""
        x_t, y_t = self._example
        shape = tuple(int(d) for d in shape)
        if len(shape) != len(x_t.shape) or shape[1:] != x_t.shape[1:]:
            raise ValueError(f"precompile: shape {shape} does not match the example input {x_t} but in the batch size")
        types = (TensorType(shape, x_t.dtype), TensorType((shape[0], *y_t.shape[1:]), y_t.dtype))
        _check_batch(types, ("x", "y"), "precompile's shape")
        self._train_executor(types)

    # ---- running -----------------------------------------------------------------------------
    def __call__(self, x: Any, y: Any) -> float:
        """One training step on the batch (x, y); returns the loss before the update."""
        return float(self.run(x, y))

    def run(self, x: Any, y: Any, *, check_labels: bool = True) -> Any:
        """One training step; returns the loss where the device holds it (a 0-d NumPy array on the
        host, a CuPy array on a GPU) without waiting for it, so a loop that reads the loss only
        when it logs never stalls the device. Device arrays (CuPy) are accepted as inputs.

        Labels are checked against the number of classes on every call; checking device-resident
        labels waits for the device, so a loop over a dataset whose labels were checked once when
        it was loaded passes `check_labels=False`."""
        x, y = _array(x), _array(y)
        # Per-batch fast path: a dict hit on (shape, dtype) skips building TensorTypes.
        key = (x.shape, x.dtype, y.shape, y.dtype)
        executor = self._by_key.get(key)
        if executor is None:
            executor = self._by_key[key] = self._train_executor(self._types((x, y), ("x", "y")))
        self._sync()
        inputs = {"x": x, "y": y}
        if self._classes and check_labels:
            check_class_inputs(self._classes, inputs)
        return executor(inputs)["loss"]

    def inference(self, x: Any) -> np.ndarray:
        """The model's output for `x` with the current parameters (no update), as a host array."""
        x = _array(x)
        types = self._types((x,), ("x",))
        self._sync()
        out = self._inference_executor(types)({"x": x})["out"]
        return out.get() if hasattr(out, "__cuda_array_interface__") else out

    def _types(self, arrays: tuple[np.ndarray, ...], names: tuple[str, ...]) -> tuple[TensorType, ...]:
        """Input types of a call. A new shape compiles a new step; a new dtype is a user error
        (the model's parameters fix it), reported before any tracing."""
        types = []
        for name, a, want in zip(names, arrays, self._example):
            t = TensorType(tuple(a.shape), as_dtype(a.dtype))
            if t.dtype != want.dtype:
                raise TypeError(f"input {name!r}: expected dtype {want.dtype.name} (as compiled, e.g. {want}), "
                                f"got {t}; convert with .astype(np.{want.dtype.numpy_name})")
            types.append(t)
        _check_batch(types, names, "the batch")
        return tuple(types)

    # ---- inspecting and checkpointing --------------------------------------------------------
    @property
    def train_graph(self) -> Graph:
        """The training graph for the example inputs, after every pass."""
        return self._steps[self._example][0]

    @property
    def peak_bytes(self) -> int | None:
        """Planned peak memory of the training step (None where the device plans none)."""
        return getattr(self._steps[self._example][1], "peak_bytes", None)

    def kernel_times(self) -> list[tuple[str, str, float]]:
        """(kernel, what it implements, seconds summed over calls) of the training step for the
        example shapes; needs compile(..., profile=True) on a device that compiles kernels."""
        executor = self._steps[self._example][1]
        if not hasattr(executor, "kernel_times"):
            raise RuntimeError(f"device {self.device!r} runs no compiled kernels to time")
        return executor.kernel_times()

    def state_dict(self) -> "OrderedDict[str, np.ndarray]":
        """Copies of the model's parameters under PyTorch's names."""
        self._sync()
        self._pull()
        return self.model.state_dict()

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        self._sync()
        self._pull()
        self.model.load_state_dict(dict(state), strict=strict)  # writes into the model's arrays
        for name, p in self._params.items():
            if self.storage.host_array(name) is None:
                self.storage.write(name, p.data)

    def optimizer_state_dict(self) -> dict[str, np.ndarray]:
        """Copies of the optimizer state, flat by name (`<param>.exp_avg`, `step`, ...), so a
        checkpoint is a plain name -> array mapping (safetensors-ready)."""
        return {name: self.storage.read(name) for name in sorted(self._state_names())}

    def load_optimizer_state_dict(self, state: Mapping[str, Any]) -> None:
        names = self._state_names()
        missing, unexpected = sorted(names - set(state)), sorted(set(state) - names)
        if missing or unexpected:
            raise KeyError(f"optimizer state mismatch: missing {missing}, unexpected {unexpected}")
        for name in names:
            value = np.asarray(state[name])
            want = self.storage.type_of(name).shape
            if value.shape != want:
                raise ValueError(f"optimizer state {name!r}: expected shape {want}, got {value.shape}")
            self.storage.write(name, value)

    def _state_names(self) -> set[str]:
        return {name for name in self.storage if name not in self._params}

    def __repr__(self) -> str:
        return (f"TrainStep(device={self.device!r}, optimizer={self.config}, "
                f"compiled={[_shape_tag(t) for t in self._steps]})")


def plan(model: Module, loss_fn: Callable[[Any, Any], Any], optimizer: Any, example_inputs: tuple[Any, Any],
         device: str = "cpu", dump_dir: str | os.PathLike | None = None, precision: str = "float32") -> dict[str, Graph]:
    """The training and inference graphs of `model` after every pass of `device`, without
    building or running anything: what `ember kernels` renders. Needs no GPU for device="cuda"."""
    target = get_target(device)
    check_precision(precision, target)
    types = tuple(example_type(a) for a in example_inputs)
    root = Path(dump_dir) if dump_dir is not None else None
    forward = trace(lambda x, y: loss_fn(model(x), y), *types, name="train_step", modules={"": model})
    forward.meta["precision"] = precision
    train = run_passes(forward, train_passes(as_config(optimizer)) + target.passes(),
                       dump_dir=root / f"train-{_shape_tag(types)}" if root else None)
    inference_forward = trace(model, types[0], name="inference")
    inference_forward.meta["precision"] = precision
    inference = run_passes(inference_forward, target.passes(),
                           dump_dir=root / f"inference-{_shape_tag(types)}" if root else None)
    return {f"train-{_shape_tag(types)}": train, f"inference-{_shape_tag(types)}": inference}


def compile(model: Module, loss_fn: Callable[[Any, Any], Any], optimizer: Any,  # noqa: A001 (torch.compile's name)
            example_inputs: tuple[Any, Any], device: str = "reference",
            dump_dir: str | os.PathLike | None = None, profile: bool = False, communicator: Any = None,
            bucket_bytes: int = DEFAULT_BUCKET_BYTES, precision: str = "float32") -> TrainStep:
    """Compiles one training step of `model` under `loss_fn(model(x), y)` and `optimizer`.

    example_inputs: (x, y) arrays or `spec`s fixing the batch's shapes and dtypes (other shapes
    compile on first use). device: "reference" (NumPy interpreter) or a registered backend.
    dump_dir (or $EMBER_DUMP_DIR): the graph after every pass, per compiled step, in
    `<dump_dir>/train-<x shape>/` and `<dump_dir>/inference-<x shape>/`.
    profile: compile timers around every kernel (CPU); read them with `TrainStep.kernel_times()`.
    communicator: an `ember.runtime.comm` communicator of several ranks (`comm.from_env()` under
    `ember launch` or `mpiexec`): data parallel, each rank's batch is its shard of the global one.
    bucket_bytes: with a communicator, the gradients are all-reduced in buckets of at most this
    many bytes (in reverse order of use; default 25 MiB as PyTorch DDP; a larger gradient is a
    bucket alone). Smaller buckets start communicating earlier in the backward pass.
    precision: "float32" (default: exact fp32 arithmetic, so results align with PyTorch's fp32) or
    "tf32" (device "cuda": matmuls and convolutions round their operands to TF32 and run on tensor
    cores, accumulating in fp32, as PyTorch's `allow_tf32`; about 1e-3 relative error per product).
    """
    return TrainStep(model, loss_fn, as_config(optimizer), tuple(example_inputs), device=device, dump_dir=dump_dir,
                     profile=profile, communicator=communicator, bucket_bytes=bucket_bytes, precision=precision)


PRECISIONS = ("float32", "tf32")


def check_precision(precision: Any, target: Any) -> None:
    """A one-line ValueError unless `precision` is a mode `target` computes in."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {', '.join(map(repr, PRECISIONS))}")
    if precision not in target.precisions:
        raise ValueError(f"precision={precision!r} is not available on device {target.name!r} "
                         f"(it computes in {', '.join(sorted(target.precisions))}); TF32 is a CUDA tensor-core mode")


__all__ = ["compile", "plan", "TrainStep"]
