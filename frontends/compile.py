"""`compile()`: model + loss + optimizer -> a `TrainStep` that runs one training step per call.

    step = ember.frontends.compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.05),
                                   example_inputs=(x, y), device="cpu")
    loss = step(x, y)            # forward, backward and the update: one compiled step
    logits = step.inference(x)   # the model alone, on the same parameters

The step traces `loss_fn(model(x), y)`, builds the train graph (autodiff, optimizer), runs the
target's passes and hands the result to the device's executor. Parameters, module buffers and
optimizer state live in one `Storage`. On the host its parameter arrays *are* the model's
`Parameter.data` arrays, updated in place; on a device a `_Link` keeps the model's arrays current
lazily (pulled when read after a step, pushed before the next step when they may have been
written), so on every device the model shows the trained values and a value written into it
reaches the next step. Every other compiled graph (a last partial batch, inference at any batch
size) is compiled on first use, cached by input types, and shares that storage.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ember.ir import Graph, TensorType, as_dtype
from ember.passes.optimizer import OptimizerConfig, initial_state
from ember.passes.data_parallel import DEFAULT_BUCKET_BYTES
from ember.passes.pipeline import precision_passes, run_passes, train_passes, with_data_parallel, write_atomic
from ember.runtime import target as get_target
from ember.runtime import target_names
from ember.runtime.comm import broadcast_parameters
from ember.runtime.consistency import agree_on_step
from ember.runtime.executor import Executor, check_class_inputs, class_inputs

from . import plan_cache
from .checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from .nn import Module
from .optim import as_config
from .tensor import RNG_STEP, Buffer, Held, Parameter, model_changed, model_epoch
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


@contextlib.contextmanager
def _collector_paused(pause: bool = True) -> Iterator[None]:
    """Runs a step's compile with Python's cyclic garbage collector off (as it was, after);
    not with `pause` false (tuning: minutes of measurements would keep all their cycles).

    With the collector on, a compile (ViT's at a new batch size: 66 young collections) promotes
    whatever is alive at each collection, the graphs of the passes in flight among it, and that
    regularly set off a full collection, which walks every object of the process: 0.2-0.3 s
    once PyTorch is imported (345k objects), more than the passes themselves. Off, only what the
    compile keeps (about 10k objects) meets the collector, young, after it; its few thousand
    objects in cycles wait until then.
    """
    enabled = pause and gc.isenabled()
    if enabled:
        gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _note_compile_stats(executor: Any, passes_seconds: float, dump: Path | None, cached: bool = False) -> None:
    """Adds the passes' seconds to what the executor measured (rendering, compiler, cache hits)
    and writes it all to `<dump>/compile_stats.json` (atomically) when dumping. `cached`: the
    graph and source came from the plan cache (`passes_s` is then the lookup's time)."""
    stats = {"passes_s": round(passes_seconds, 4), "plan_cached": cached, **getattr(executor, "compile_stats", {})}
    try:
        executor.compile_stats = stats
    except AttributeError:  # an executor that does not take attributes: stats stay unrecorded
        return
    if dump is not None:
        write_atomic(dump / "compile_stats.json", json.dumps(stats, indent=1) + "\n")


def _shape_tag(types: tuple[TensorType, ...]) -> str:
    return "x".join(str(d) for d in types[0].shape) or "scalar"


def _step_tag(key: tuple[tuple[TensorType, ...], bool]) -> str:
    """A training step's shape tag, marked where it was traced with the model in eval mode."""
    types, training = key
    return _shape_tag(types) + ("" if training else " (eval mode)")


def _check_batch(types: "tuple[TensorType, ...] | list[TensorType]", names: tuple[str, ...], what: str) -> None:
    """A batch of 0 samples has nothing to train on (and no kernel has a 0-sized loop to render)."""
    for name, t in zip(names, types):
        if t.shape and t.shape[0] == 0:
            raise ValueError(f"{what}: input {name!r} has a batch of 0 samples (type {t}); expected at least 1")


def _check_model(model: Any, what: str) -> None:
    if not isinstance(model, Module):
        hint = " (a torch module? import it with ember.frontends.from_torch first)" \
            if type(model).__module__.split(".")[0] == "torch" else ""
        raise TypeError(f"{what} expects an ember.frontends.nn.Module, got {type(model).__name__}{hint}")


def _resolve_device(device: Any) -> tuple[Any, int | None]:
    """"cpu" -> (its target, None); "cuda:1" -> (cuda's target, 1), as PyTorch spells a GPU."""
    if not isinstance(device, str):
        raise TypeError(f"device must be a string such as 'cpu' or 'cuda:0', got {type(device).__name__}")
    name, colon, index = device.partition(":")
    target = get_target(name)
    if not colon:
        return target, None
    if not index.isdigit():
        raise ValueError(f"device {device!r}: expected {name!r} or {name}:N with a device index N >= 0")
    if target.select_device is None:
        raise ValueError(f"device {device!r}: device {name!r} takes no index (only devices with several "
                         f"units do: 'cuda:N')")
    return target, int(index)


class _Link:
    """Ties the model's Parameters and Buffers (`tensor.Held`) to one step's storage.

    `version` counts the calls that may have changed the storage (on a device a held array is
    stale when it last matched an older version); `written` holds the arrays the user may have
    written since, pushed before the next call. On the host the arrays are the storage's own:
    nothing is pulled, and only a rebound `.data` is written back (and pointed at storage again).
    """

    def __init__(self, storage: Any) -> None:
        self.storage = storage
        self.device = True  # until a name shows the storage shares host arrays (`attach`)
        self.version = 0
        self.written: dict[str, Held] = {}

    def attach(self, name: str, held: Held, new: bool) -> None:
        """Makes `held` the array behind `name`: added to storage (`new`) or written into it."""
        value = held._read()  # current, also when another step held it until now
        if not isinstance(value, np.ndarray) or not value.flags.c_contiguous or not value.flags.writeable:
            value = held._data = np.array(value, order="C", copy=True)
        if new:
            self.storage.add(name, value)
        elif value is not self.storage.host_array(name):  # two host steps of one model share arrays
            self.storage.write(name, value)
        host = self.storage.host_array(name)
        self.device = host is None
        if host is not None:
            held._data = host
        if held._link is not None and held._link is not self:
            model_changed()  # the step that held it takes it back on its next call
        held._link, held._name, held._seen = self, name, self.version
        self.written.pop(name, None)

    def fetch(self, held: Held, written: bool) -> None:
        if held._seen != self.version:
            self.storage.read(held._name, out=held._data)
            held._seen = self.version
        if written:
            self.written[held._name] = held

    def rebound(self, held: Held) -> None:
        held._seen = self.version  # what the host holds now is the value
        self.written[held._name] = held

    def push(self) -> None:
        for name, held in self.written.items():
            if held._link is not self:
                continue
            value, host = held._data, self.storage.host_array(name)
            if value is host:
                continue
            self.storage.write(name, value)
            want = self.storage.type_of(name).dtype.numpy
            if host is not None:
                held._data = host
            elif not (isinstance(value, np.ndarray) and value.dtype == want and value.flags.c_contiguous
                      and value.flags.writeable):
                held._data = np.array(value, dtype=want, order="C", copy=True)  # later pulls land in it
        self.written.clear()


class _Compiled:
    """What a compiled training step and a compiled inference model share: the device, the
    storage that holds the model's parameters and buffers, their link to the model, and the
    inference graphs compiled per input shape."""

    def __init__(self, model: Module, device: str, dump_dir: str | os.PathLike | None, profile: bool,
                 precision: str, tune: bool | float = False) -> None:
        self.target, self.device_index = _resolve_device(device)
        check_precision(precision, self.target)
        self.precision = precision
        self.tune_budget_s = _check_tune(tune, self.target)
        self.tune_reports: list[Any] = []  # one per tuned step: what `tune` measured and chose
        _check_model(model, "compile()" if isinstance(self, TrainStep) else "compile_inference()")
        if self.target.available is not None:
            self.target.available()
        if self.device_index is not None:
            self.target.select_device(self.device_index)
        self.model = model
        self.device = device
        self.profile = profile
        root = dump_dir if dump_dir is not None else os.environ.get("EMBER_DUMP_DIR") or None
        self.dump_dir = Path(root) if root is not None else None
        self.storage = self.target.storage()
        self._link = _Link(self.storage)
        self._params: dict[str, Held] = {}  # name -> the Parameter or Buffer held in storage
        # what the model held at compile(): a name added later is refused (the step would not train it)
        self._model_names = {name for name, _ in model._named_state()}
        self._inference: dict[tuple[Any, ...], tuple[Graph, Executor]] = {}  # (types, training)
        self._epoch = model_epoch()

    # ---- building ----------------------------------------------------------------------------
    def _bind(self, graph: Graph) -> None:
        """Adds the parameters and buffers the graph's trace touched and any optimizer state not
        yet held to the shared storage."""
        held = {**graph.meta.get("parameters", {}), **graph.meta.get("buffers", {})}
        for name, p in held.items():
            if name in self._params:
                if self._params[name] is not p:
                    raise ValueError(f"parameter name {name!r} now names a different Parameter object")
                continue
            self._link.attach(name, p, new=True)
            self._params[name] = p
        for name, value in initial_state(graph).items():
            if name not in self.storage:
                self.storage.add(name, value)

    def _planned(self, forward: Graph, passes: list, dump: Path | None,
                 extra: str | None = "") -> tuple[Graph, Any, str | None]:
        """(graph after `passes`, its generated source or None, the plan cache's key or None):
        from the plan cache where it holds this trace (`frontends/plan_cache.py`), else the passes
        run (tuning first, with `tune`). extra None: not cacheable (a data-parallel step)."""
        key = None
        if extra is not None and dump is None and self.tune_budget_s is None and plan_cache.enabled():
            device = self.target.device_model() if self.target.device_model is not None else ""
            key = plan_cache.step_key(forward, passes, target=self.target, device=device, profile=self.profile,
                                      extra=f"{extra};precision={self.precision}")
            if key is not None and (found := plan_cache.load(key, forward)) is not None:
                if self.target.prepare_build is not None:
                    self.target.prepare_build(forward, (found[1],))
                return found[0], found[1], None
        if self.target.prepare_build is not None:
            # a step that takes the plans of the steps compiled so far (another batch size,
            # inference beside training) is their sources' variants
            reused = [executor for _, executor in self._compiled()] if "kernel_reuse" in forward.meta else []
            self.target.prepare_build(forward, tuple(getattr(e, "source", None) for e in reused))
        return self._tuned(lambda: run_passes(forward, passes, dump_dir=dump)), None, key

    def _compiled(self) -> list[tuple[Graph, Executor]]:
        """The planned graphs and executors of the steps compiled so far, in the order they were
        compiled."""
        return list(self._inference.values())

    def _reuse_plans(self, forward: Graph) -> str:
        """Gives a new step (another batch size, or inference beside training) the kernel plans of
        the steps compiled so far that it may share (`Target.reusable`: kernels that take the
        batch at run time), and fusion's recompute decisions of the steps of the same graph
        (`meta["recompute_reuse"]`: the byte rule weighs batch-sized and fixed sizes), so its
        kernels are the same code and their objects are not compiled again; returns them as
        text for the plan cache's key ("" when there are none). Not when tuning: a tuned step's
        kernels are measured at their own sizes."""
        if self.target.reusable is None or self.tune_budget_s is not None:
            return ""
        plans: dict[str, Any] = {}
        decided: dict[Any, bool] = {}
        for graph, _ in self._compiled():
            for key, plan in self.target.reusable(graph):
                plans.setdefault(key, plan)
            if graph.name == forward.name:
                for key, recomputed in graph.meta.get("recomputed", ()):
                    decided.setdefault(key, recomputed)
        text = ""
        if plans:
            forward.meta["kernel_reuse"] = tuple(plans.items())
            text += f";reuse={forward.meta['kernel_reuse']!r}"
        if decided:
            forward.meta["recompute_reuse"] = tuple(sorted(decided.items()))
            text += f";recompute={forward.meta['recompute_reuse']!r}"
        return text

    def _executor(self, graph: Graph, dump: Path | None, source: Any, **extra: Any) -> Executor:
        if source is not None:
            extra["source"] = source
        return self.target.executor(graph, self.storage, dump, profile=self.profile, **extra)

    @staticmethod
    def _keep_plan(key: str | None, graph: Graph, executor: Any) -> None:
        if key is not None:
            plan_cache.store(key, graph, getattr(executor, "source", None))

    def _tuned(self, build: Callable[[], Graph]) -> Graph:
        """`build()`'s graph; with tuning on, its kernels measured first (the tuning database then
        holds them) and the graph built again so `select` takes the measured winners."""
        graph = build()
        if self.tune_budget_s is None:
            return graph
        report = self.target.tune(graph, budget_s=self.tune_budget_s)
        self.tune_reports.append(report)
        return build() if report.measured else graph

    def _dump_subdir(self, kind: str, types: tuple[TensorType, ...]) -> Path | None:
        return self.dump_dir / f"{kind}-{_shape_tag(types)}" if self.dump_dir is not None else None

    def _inference_executor(self, types: tuple[TensorType, ...]) -> Executor:
        key = (types, self.model.training)  # train/eval mode changes the graph (BatchNorm)
        hit = self._inference.get(key)
        if hit is None:
            with _collector_paused(self.tune_budget_s is None):
                forward = trace(self.model, *types, name="inference")
                forward.meta["precision"] = self.precision
                if list(forward.outputs) != ["out"]:
                    raise TypeError(f"inference() needs a model returning one tensor, "
                                    f"got outputs {list(forward.outputs)}")
                dump = self._dump_subdir("inference", types)
                t0 = time.perf_counter()
                passes = precision_passes(self.precision) + self.target.passes()
                graph, source, cache_key = self._planned(forward, passes, dump, extra=self._reuse_plans(forward))
                passes_seconds = time.perf_counter() - t0
                self._bind(forward)
                hit = self._inference[key] = (graph, self._executor(graph, dump, source))
                self._keep_plan(cache_key, graph, hit[1])
                _note_compile_stats(hit[1], passes_seconds, dump, cached=source is not None)
        return hit[1]

    def _sync(self) -> None:
        """Before anything runs: the model's current Parameters and Buffers adopted (when an
        assignment in it changed the epoch) and the values the user may have written pushed into
        storage. An untouched training loop does two comparisons here, and copies nothing."""
        if self._epoch != model_epoch():
            self._adopt()
        if self._link.written:
            self._link.push()

    def _adopt(self) -> None:
        """Adopts a Parameter or Buffer assigned in place of a held one with the same shape and
        dtype (its values go into storage, the replaced one keeps its last values in an array of
        its own); refuses any other change to what the step holds, naming it."""
        current = dict(self.model._named_state())
        for name in current:
            if name not in self._model_names:
                raise ValueError(f"{_kind(current[name])} {name!r} was added after compile(), which does not "
                                 f"{_verb(current[name])} it; compile() the model again")
        for name, held in list(self._params.items()):
            now = current.get(name) if name in self._model_names else held  # a loss's own: not the model's
            if now is None:
                raise ValueError(f"{_kind(held)} {name!r} was removed after compile(), which {_verb(held)}s it; "
                                 f"put it back or compile() the model again")
            if now is not held:
                want, got = TensorType.of(held._data), TensorType.of(now._data)
                if type(now) is not type(held) or got != want:
                    by = f"a {type(now).__name__}" if type(now) is not type(held) else str(got)
                    raise ValueError(f"{_kind(held)} {name!r} was replaced after compile() by {by}; the step was "
                                     f"compiled for {want}: assign one of the same shape and dtype, "
                                     f"or compile() the model again")
                last = held._read().copy()
                held._link = None
                held._data = last
                self._link.attach(name, now, new=False)
                self._params[name] = now
            elif held._link is not self._link:  # another step of this model took it over: take it back
                self._link.attach(name, held, new=False)
        self._epoch = model_epoch()

    def inference(self, x: Any, *, host: bool = True) -> Any:
        """The model's output for `x` with the current parameters (no update), as a host array;
        with host=False as the device holds it (a CuPy array on a GPU), without waiting for it,
        so an evaluation that reduces it there reads back one number, not every batch's logits."""
        x = _array(x)
        types = self._types((x,), ("x",))
        self._sync()
        out = self._inference_executor(types)({"x": x})["out"]
        self._link.version += 1  # training mode updates BatchNorm's running statistics
        return out.get() if host and hasattr(out, "__cuda_array_interface__") else out

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

    def state_dict(self) -> "OrderedDict[str, np.ndarray]":
        """Copies of the model's parameters and buffers under PyTorch's names (the same as
        `model.state_dict()`: the model holds the current values on every device)."""
        self._sync()
        return self.model.state_dict()

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """`model.load_state_dict`: the values reach storage before the next step."""
        self._sync()
        self.model.load_state_dict(dict(state), strict=strict)


class TrainStep(_Compiled):
    """A compiled training step bound to a model; see the module docstring."""

    def __init__(self, model: Module, loss_fn: Callable[[Any, Any], Any], optimizer: OptimizerConfig,
                 example_inputs: tuple[Any, Any], device: str = "cpu",
                 dump_dir: str | os.PathLike | None = None, profile: bool = False,
                 communicator: Any = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 precision: str = "float32", tune: bool | float = False,
                 params: Sequence[Parameter] | None = None) -> None:
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, (int, np.integer)) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes {bucket_bytes!r}: expected an integer >= 1 (bytes of gradients "
                             f"per all-reduce bucket; default {DEFAULT_BUCKET_BYTES}, PyTorch DDP's 25 MiB)")
        self.bucket_bytes = int(bucket_bytes)
        # data parallel: this process is one rank of `communicator`'s world (ember.runtime.comm);
        # its train step all-reduces the gradients (passes/data_parallel.py) and averages the loss
        self.comm = communicator if communicator is not None and communicator.size > 1 else None
        if self.comm is not None and device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"data parallel over a communicator runs on devices 'cpu' (MPI) and 'cuda' (NCCL), "
                             f"not {device!r}")
        super().__init__(model, device, dump_dir, profile, precision, tune)  # checks the device and the model
        if len(example_inputs) != 2:
            raise ValueError(f"example_inputs must be (x, y), got {len(example_inputs)} values")
        if not model.parameters():
            raise ValueError(f"compile(): the model ({type(model).__name__}) has no parameters to train; "
                             f"an optimizer needs at least one Parameter (a Linear, Conv2d, ...)")
        self.loss_fn = loss_fn
        self.config = optimizer
        # the optimizer's `params` (None: every parameter); a parameter left out, or with
        # requires_grad False, is frozen: no gradient, no update (as torch.optim leaves it)
        self._trainable: frozenset[int] | None = None
        if params is not None:
            own = {id(p) for p in model.parameters()}
            foreign = [p for p in params if id(p) not in own]
            if foreign:
                raise ValueError(f"the optimizer's params include {len(foreign)} Parameter(s) that are not the model's "
                                 f"(first: {foreign[0]!r}); compile() trains the compiled model's parameters: pass "
                                 f"model.parameters() or a subset of them")
            self._trainable = frozenset(id(p) for p in params)
        self._frozen_now = self._frozen_names()  # what the compiled steps froze (`_adopt` compares)
        self.steps_run = 0  # training steps this step (or the checkpoint it loaded) has run
        # by (input types, the model's training flag): train() and eval() trace different steps
        # (BatchNorm's batch or running statistics, dropout on or off), as PyTorch runs them
        self._steps: dict[tuple[tuple[TensorType, ...], bool], tuple[Graph, Executor]] = {}
        self._by_key: dict[tuple, Executor] = {}
        self._classes: dict[str, int] = {}  # labels input -> number of classes (from the traced one_hot)
        self._example = tuple(example_type(a) for a in example_inputs)
        _check_batch(self._example, ("x", "y"), "example_inputs")
        self._train_executor(self._example)  # compile eagerly: errors surface at compile()
        self._epoch = model_epoch()  # the model as adopted; a later assignment in it changes this
        self.sync_ranks()  # every rank starts from rank 0's parameters and state (checked by hash)

    def _compiled(self) -> list[tuple[Graph, Executor]]:
        return list(self._steps.values()) + super()._compiled()

    @property
    def all_compile_stats(self) -> dict[str, dict[str, Any]]:
        """`compile_stats` of every training step compiled so far, by its input shape ("64x1x28x28"),
        in the order they were compiled: a later batch size (the last partial batch) shows what
        it took beside the first (on the CPU, objects built or found in the cache)."""
        return {_step_tag(key): dict(getattr(ex, "compile_stats", {})) for key, (_, ex) in self._steps.items()}

    @property
    def compile_stats(self) -> dict[str, Any]:
        """Where the example shape's training step compile went: seconds in the passes
        (`passes_s`), rendering (`render_s`) and the compiler (`compiler_s`, cache lookups
        included), and on the CPU how many objects were built or found in the cache."""
        return dict(getattr(self._example_step()[1], "compile_stats", {}))

    def _example_step(self) -> tuple[Graph, Executor]:
        """The training step for the example shapes in the model's current mode, else one compiled
        in the other mode, else (none left after a change of requires_grad) compiled now."""
        self._sync()  # a change of requires_grad since the last step drops the steps it made stale
        hit = self._steps.get((self._example, bool(self.model.training)))
        if hit is None:
            hit = next((v for (types, _), v in self._steps.items() if types == self._example), None)
        if hit is None:
            self._train_executor(self._example)
            hit = self._steps[(self._example, bool(self.model.training))]
        return hit

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
        self._link.version += 1  # the storage changed under the model's arrays

    def _train_executor(self, types: tuple[TensorType, ...]) -> Executor:
        key = (types, bool(self.model.training))
        hit = self._steps.get(key)
        if hit is None:
            with _collector_paused(self.tune_budget_s is None):
                model, loss_fn = self.model, self.loss_fn
                forward = trace(lambda x, y: loss_fn(model(x), y), *types, name="train_step", modules={"": model})
                forward.meta["precision"] = self.precision
                frozen = self._frozen_of(forward)
                dump = self._dump_subdir("train", types)
                passes = precision_passes(self.precision) + train_passes(self.config) + self.target.passes()
                extra = {}
                if self.comm is not None:
                    passes = with_data_parallel(passes, self.comm.size, self.bucket_bytes)
                    extra = {"communicator": self.comm}
                t0 = time.perf_counter()
                reuse = self._reuse_plans(forward)
                extra_key = f"optimizer={self.config!r}{reuse};frozen={frozen!r}" if self.comm is None else None
                graph, source, cache_key = self._planned(forward, passes, dump, extra=extra_key)
                passes_seconds = time.perf_counter() - t0
                self._bind(forward)
                self._bind(graph)
                # Every shape traces the same loss, so one graph fixes which inputs are labels.
                self._classes = class_inputs(forward)
                hit = self._steps[key] = (graph, self._executor(graph, dump, source, **extra))
                self._keep_plan(cache_key, graph, hit[1])
                _note_compile_stats(hit[1], passes_seconds, dump, cached=source is not None)
                if self.comm is not None:
                    # every rank must have compiled the same step (same code, model and settings):
                    # checked before the parameters are broadcast, which a different model would hang
                    agree_on_step(self.comm, hit[1], graph)
        return hit[1]

    def _frozen(self, p: Any) -> bool:
        return isinstance(p, Parameter) and (not p.requires_grad or (self._trainable is not None
                                                                       and id(p) not in self._trainable))

    def _frozen_names(self) -> tuple[str, ...]:
        return tuple(sorted(name for name, p in self.model.named_parameters() if self._frozen(p)))

    def _frozen_of(self, forward: Graph) -> tuple[str, ...]:
        """The traced parameters this step does not train, put in `forward.meta["frozen"]` for the
        autodiff pass; raises when that leaves nothing to train."""
        params = forward.meta.get("parameters", {})
        frozen = tuple(sorted(name for name, p in params.items() if self._frozen(p)))
        if params and len(frozen) == len(params):
            raise ValueError(f"nothing to train: every parameter the loss depends on is frozen (requires_grad False"
                             f"{' or not in the optimizer' + chr(39) + 's params' if self._trainable is not None else ''}"
                             f"): {', '.join(frozen[:4])}{', ...' if len(frozen) > 4 else ''}")
        forward.meta["frozen"] = frozen
        return frozen

    def _adopt(self) -> None:
        super()._adopt()
        frozen = self._frozen_names()
        if frozen != self._frozen_now:  # requires_grad changed: the steps differentiate other parameters
            self._frozen_now = frozen
            self._steps.clear()
            self._by_key.clear()

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
        self._sync()
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
        self._sync()  # first: a new shape traces the model as it is now
        # Per-batch fast path: a dict hit on (shape, dtype, mode) skips building TensorTypes.
        key = (x.shape, x.dtype, y.shape, y.dtype, self.model.training)
        executor = self._by_key.get(key)
        if executor is None:
            executor = self._by_key[key] = self._train_executor(self._types((x, y), ("x", "y")))
        inputs = {"x": x, "y": y}
        if self._classes and check_labels:
            check_class_inputs(self._classes, inputs)
        loss = executor(inputs)["loss"]
        self._link.version += 1  # on a device, the model's arrays are now stale until read
        self.steps_run += 1
        return loss

    # ---- inspecting and checkpointing --------------------------------------------------------
    @property
    def train_graph(self) -> Graph:
        """The training graph for the example inputs, after every pass."""
        return self._example_step()[0]

    @property
    def peak_bytes(self) -> int | None:
        """Planned peak memory of the training step (None where the device plans none)."""
        return getattr(self._example_step()[1], "peak_bytes", None)

    def kernel_times(self) -> list[tuple[str, str, float]]:
        """(kernel, what it implements, seconds summed over calls) of the training step for the
        example shapes; needs compile(..., profile=True) on a device that compiles kernels."""
        executor = self._example_step()[1]
        if not hasattr(executor, "kernel_times"):
            raise RuntimeError(f"device {self.device!r} runs no compiled kernels to time")
        return executor.kernel_times()

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

    def reset_optimizer(self) -> None:
        """Fresh optimizer state, as compile() made it: zero moments and step counters (the
        learning-rate schedule starts again, and the random counter is back at step 0). With new
        weights loaded into the model, the next step starts another run without compiling again."""
        for name in self._state_names():
            self.storage.write(name, np.zeros(self.storage.type_of(name).shape, self.storage.type_of(name).dtype.numpy))
        self.steps_run = 0

    def seed_random(self, seed: int) -> None:
        """Points the random draws of the steps that follow (dropout masks, random translations)
        at stream `seed`: the step counter they are keyed by starts at seed x 2**32, so runs of
        different seeds draw apart from their first step (2**32 steps each) while every draw stays
        a pure function of (seed, step) on every device. No-op for a step that draws nothing."""
        if not 0 <= int(seed) < 2**32:
            raise ValueError(f"seed_random: seed must be in [0, 2**32), got {seed}")
        if RNG_STEP in self._state_names():
            self.storage.write(RNG_STEP, np.array(int(seed) << 32, np.uint64).view(np.int64))

    def save(self, path: str | os.PathLike, **progress: Any) -> None:
        """Writes model, optimizer state and `steps_run` to one safetensors checkpoint,
        atomically (a crash leaves the old file whole). `progress` adds the fields a training
        loop keeps (`epoch`, `step_in_epoch`, `config`, `world_size`, `global_batch`; see
        `ember.frontends.checkpoint`); `step` defaults to `steps_run`."""
        progress.setdefault("step", self.steps_run)
        save_checkpoint(path, self.state_dict(), self.optimizer_state_dict(), **progress)

    def load(self, path: "str | os.PathLike | Checkpoint") -> Checkpoint:
        """Restores what `save` wrote (model, optimizer state, `steps_run`); returns the
        checkpoint for the progress fields. A file of another model or optimizer is refused in one
        line naming it."""
        ckpt = path if isinstance(path, Checkpoint) else load_checkpoint(path)
        try:
            self.load_state_dict(ckpt.model)
            self.load_optimizer_state_dict(ckpt.optimizer)
        except (KeyError, ValueError) as e:
            raise CheckpointError(f"{ckpt.path}: does not fit this model and optimizer: {e}") from None
        self.steps_run = ckpt.step
        return ckpt

    def __repr__(self) -> str:
        return (f"TrainStep(device={self.device!r}, optimizer={self.config}, "
                f"compiled={[_step_tag(k) for k in self._steps]})")


class InferenceStep(_Compiled):
    """A model compiled for inference alone (no loss, no optimizer): `step(x)` is the model's
    output for `x` as a host array, each new input shape compiled on first use. It holds the
    model's parameters like a TrainStep: the model shows, and a write into it reaches, the step."""

    def __init__(self, model: Module, example_input: Any, device: str = "cpu",
                 dump_dir: str | os.PathLike | None = None, profile: bool = False,
                 precision: str = "float32", tune: bool | float = False) -> None:
        super().__init__(model, device, dump_dir, profile, precision, tune)
        self._example = (example_type(example_input),)
        _check_batch(self._example, ("x",), "example_input")
        self._inference_executor(self._example)  # compile eagerly: errors surface here
        self._epoch = model_epoch()

    def __call__(self, x: Any) -> np.ndarray:
        return self.inference(x)

    @property
    def graph(self) -> Graph:
        """The inference graph for the example input (in the model's current mode), after every pass."""
        return self._inference[(self._example, self.model.training)][0]

    def __repr__(self) -> str:
        return f"InferenceStep(device={self.device!r}, compiled={[_shape_tag(k[0]) for k in self._inference]})"


def plan(model: Module, loss_fn: Callable[[Any, Any], Any], optimizer: Any, example_inputs: tuple[Any, Any],
         device: str = "cpu", dump_dir: str | os.PathLike | None = None, precision: str = "float32") -> dict[str, Graph]:
    """The training and inference graphs of `model` after every pass of `device`, without
    building or running anything: what `ember kernels` renders. Needs no GPU for device="cuda"."""
    target = get_target(device)
    check_precision(precision, target)
    types = tuple(example_type(a) for a in example_inputs)
    root = Path(dump_dir) if dump_dir is not None else None
    with _collector_paused():
        forward = trace(lambda x, y: loss_fn(model(x), y), *types, name="train_step", modules={"": model})
        forward.meta["precision"] = precision
        passes = precision_passes(precision) + train_passes(as_config(optimizer)) + target.passes()
        train = run_passes(forward, passes, dump_dir=root / f"train-{_shape_tag(types)}" if root else None)
        inference_forward = trace(model, types[0], name="inference")
        inference_forward.meta["precision"] = precision
        inference = run_passes(inference_forward, precision_passes(precision) + target.passes(),
                               dump_dir=root / f"inference-{_shape_tag(types)}" if root else None)
    return {f"train-{_shape_tag(types)}": train, f"inference-{_shape_tag(types)}": inference}


def compile(model: Module, loss_fn: Callable[[Any, Any], Any], optimizer: Any,  # noqa: A001 (torch.compile's name)
            example_inputs: tuple[Any, Any], device: str = "cpu",
            dump_dir: str | os.PathLike | None = None, profile: bool = False, communicator: Any = None,
            bucket_bytes: int = DEFAULT_BUCKET_BYTES, precision: str = "float32",
            tune: bool | float = False) -> TrainStep:
    """Compiles one training step of `model` under `loss_fn(model(x), y)` and `optimizer`.

    example_inputs: (x, y) arrays or `spec`s fixing the batch's shapes and dtypes (other shapes
    compile on first use). device: "cpu" (default: compiled C++), "cuda" or "cuda:N" (an NVIDIA
    GPU, as PyTorch spells it), or "reference" (the NumPy interpreter: every op, slowly).
    dump_dir (or $EMBER_DUMP_DIR): the graph after every pass, per compiled step, in
    `<dump_dir>/train-<x shape>/` and `<dump_dir>/inference-<x shape>/`.
    profile: compile timers around every kernel (CPU); read them with `TrainStep.kernel_times()`.
    communicator: an `ember.runtime.comm` communicator of several ranks (`comm.from_env()` under
    `ember launch` or `mpiexec`): data parallel, each rank's batch is its shard of the global one.
    bucket_bytes: with a communicator, the gradients are all-reduced in buckets of at most this
    many bytes (in reverse order of use; default 25 MiB as PyTorch DDP; a larger gradient is a
    bucket alone). Smaller buckets start communicating earlier in the backward pass.
    precision: "float32" (default: exact fp32 arithmetic, so results align with PyTorch's fp32),
    "tf32" (device "cuda": matmuls and convolutions round their operands to TF32 and run on tensor
    cores, accumulating in fp32, as PyTorch's `allow_tf32`; about 1e-3 relative error per product)
    or "bf16" (mixed precision as `torch.autocast(dtype=torch.bfloat16)`: matmuls and convolutions
    on bfloat16 operands accumulating in fp32, activations stored in bfloat16, reductions, softmax,
    the loss and the optimizer in fp32 on fp32 master weights; docs/precision.md).
    tune: True (or a budget in seconds; True is 300 s) measures every candidate kernel of each
    step compiled, on this device, before building it (`ember tune` does the same from the command
    line); the winners go into the tuning database under $EMBER_CACHE_DIR/tuning, which every later
    compile reads, so a model is tuned once per device. `step.tune_reports` says what was chosen.
    """
    return TrainStep(model, loss_fn, as_config(optimizer), tuple(example_inputs), device=device, dump_dir=dump_dir,
                     profile=profile, communicator=communicator, bucket_bytes=bucket_bytes, precision=precision,
                     tune=tune, params=getattr(optimizer, "params", None))


def compile_inference(model: Module, example_input: Any, device: str = "cpu",
                      dump_dir: str | os.PathLike | None = None, profile: bool = False,
                      precision: str = "float32", tune: bool | float = False) -> InferenceStep:
    """Compiles `model(x)` alone for `device` (no loss, no optimizer): `compile_inference(model,
    x)(x)` is the model's output. `example_input` (an array or a `spec`) fixes the shape and
    dtype; other batch sizes compile on first use. The model's mode (train/eval) at each call
    decides the graph, as for `TrainStep.inference`. `tune`: as for `compile`."""
    return InferenceStep(model, example_input, device=device, dump_dir=dump_dir, profile=profile, precision=precision,
                         tune=tune)


def _kind(held: Held) -> str:
    return "buffer" if isinstance(held, Buffer) else "parameter"


def _verb(held: Held) -> str:
    return "update" if isinstance(held, Buffer) else "train"


PRECISIONS = ("float32", "tf32", "bf16")
#: what each precision is, for the one-line refusal on a device that lacks it
_PRECISION_WHAT = {"tf32": "TF32 is a CUDA tensor-core mode", "bf16": "its kernels have no bfloat16 path",
                   "float32": "float32"}
DEFAULT_TUNE_BUDGET_S = 300.0


def _check_tune(tune: Any, target: Any) -> float | None:
    """The tuning budget in seconds (None: no tuning), or a one-line ValueError."""
    if tune is False or tune is None:
        return None
    if tune is True:
        budget = DEFAULT_TUNE_BUDGET_S
    elif isinstance(tune, (int, float)) and not isinstance(tune, bool) and tune > 0:
        budget = float(tune)
    else:
        raise ValueError(f"tune={tune!r}: expected True, False or a budget in seconds > 0")
    if target.tune is None:
        raise ValueError(f"tune: device {target.name!r} has no kernel choices to measure (devices that tune: "
                         f"{', '.join(t for t in target_names() if get_target(t).tune is not None) or 'none'})")
    return budget


def check_precision(precision: Any, target: Any) -> None:
    """A one-line ValueError unless `precision` is a mode `target` computes in."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {', '.join(map(repr, PRECISIONS))}")
    if precision not in target.precisions:
        raise ValueError(f"precision={precision!r} is not available on device {target.name!r} "
                         f"(it computes in {', '.join(sorted(target.precisions))}); {_PRECISION_WHAT[precision]}")


__all__ = ["compile", "compile_inference", "plan", "TrainStep", "InferenceStep"]
