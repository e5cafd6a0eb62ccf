"""The MNIST models and data location shared by the tests."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np

from ember import ir
from ember.frontends import functional as F
from ember.frontends import nn, spec, trace
from ember.runtime.executor import Storage

REPO = Path(__file__).resolve().parents[1]
# ../shared/data/mnist beside the checkout; EMBER_TEST_MNIST points elsewhere (the GPU machine,
# where ../shared does not travel).
MNIST_DIR = Path(os.environ.get("EMBER_TEST_MNIST") or REPO.parent / "shared" / "data" / "mnist")


def cnn(seed: int = 0) -> nn.Module:
    nn.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 16, 3), nn.ReLU(), nn.Conv2d(16, 32, 3), nn.ReLU(), nn.Flatten(), nn.Linear(18432, 10))


def mlp(seed: int = 0) -> nn.Module:
    nn.manual_seed(seed)
    return nn.Sequential(nn.Linear(784, 30), nn.Sigmoid(), nn.Linear(30, 10))


def train_graph(model: nn.Module, x_shape: tuple[int, ...], lr: float = 0.05) -> ir.Graph:
    """The simplified SGD training graph of `model` under cross-entropy."""
    from ember.passes.optimizer import SGD
    from ember.passes.pipeline import build_train_graph
    from ember.passes.simplify import simplify
    fwd = trace(lambda x, y: F.cross_entropy(model(x), y), spec(x_shape), spec((x_shape[0],), "int64"), modules={"": model})
    return simplify(build_train_graph(fwd, SGD(lr=lr)))


def params_of(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: p.data for k, p in model.named_parameters()}


def run_both(before: ir.Graph, after: ir.Graph, model: nn.Module, x_shape: tuple[int, ...], seed: int):
    """Both training graphs (a pass's input and output) evaluated by the interpreter on one random
    batch (images in [0, 1), labels 0..9) with `model`'s parameters."""
    rng = np.random.default_rng(seed)
    inputs = {"x": rng.random(x_shape, dtype=np.float32), "y": rng.integers(0, 10, x_shape[0])}
    return ir.run(before, inputs, params_of(model)), ir.run(after, inputs, params_of(model))


def cpu_plan(graph, *, simplify: bool = False):
    """`graph` through the cpu target's passes (fusion, kernel selection, schedule, memory), by
    default without simplify, so a test compiles exactly the graph it built."""
    import ember.runtime
    from ember.passes.pipeline import run_passes
    passes = ember.runtime.target("cpu").passes()
    return run_passes(graph, passes if simplify else [p for p in passes if p[0] != "simplify"])


def compiled_targets() -> list:
    """pytest params, one per registered target that generates code; a target that needs
    hardware (its record has an `available` check) is marked with its own name (`cuda`), which
    conftest skips where that hardware is missing."""
    import pytest

    import ember.runtime
    from ember.passes import targets
    return [pytest.param(t.name, id=t.name, marks=[getattr(pytest.mark, t.name)] if t.available else [])
            for t in targets.all_targets() if t.language is not None]


def plan_for(graph, device: str, *, simplify: bool = False):
    """`graph` through `device`'s passes, by default without simplify (a test compiles exactly
    the graph it built)."""
    import ember.runtime
    from ember.passes.pipeline import run_passes
    passes = ember.runtime.target(device).passes()
    return run_passes(graph, passes if simplify else [p for p in passes if p[0] != "simplify"])


def first_and_later(model: str, first_batch: int, later_batch: int, device: str = "cuda",
                    first_untuned: bool = False, first_force: dict | None = None) -> tuple:
    """A recipe model's training step planned at `first_batch`, and at `later_batch` given the
    first one's kernel plans (`Target.reusable`, as `compile` gives them to a later batch size);
    `first_untuned`: the first step planned without a tuning database (the cost model alone);
    `first_force`: kind -> the family the first step's kernels of that kind must take
    (`cuda_choices.force`), the later step free to reuse their plans."""
    import contextlib

    import ember.runtime
    from ember.codegen import cuda_choices, tuning_db
    from ember.frontends.training.recipes import build_model
    from ember.passes.pipeline import run_passes
    target = ember.runtime.target(device)
    with tuning_db.using(None) if first_untuned else contextlib.nullcontext(), \
            cuda_choices.force(**first_force) if first_force else contextlib.nullcontext():
        first = run_passes(train_graph(build_model(model), (first_batch, 1, 28, 28)), target.passes())
    later_graph = train_graph(build_model(model), (later_batch, 1, 28, 28))
    later_graph.meta["kernel_reuse"] = target.reusable(first)
    return first, run_passes(later_graph, target.passes())


def run_compiled(graph, device: str, inputs: dict, params: dict | None = None) -> tuple[object, dict]:
    """Plans `graph` for `device`, runs it once on `inputs`; returns (plan, outputs as NumPy arrays)."""
    import ember.runtime
    target = ember.runtime.target(device)
    planned = plan_for(graph, device)
    storage = target.storage()
    for k, v in (params or {}).items():
        storage.add(k, np.ascontiguousarray(v).copy())
    out = target.executor(planned, storage)(inputs)
    return planned, {k: (v.get() if hasattr(v, "get") else np.asarray(v)) for k, v in out.items()}


FAKE_DEVICE = "fake-device"


class FakeDeviceStorage(Storage):
    """A stand-in for device memory, for tests on a machine without a GPU: it holds its own
    copies (the CPU executor computes on them as a GPU's kernels do on theirs), the host reaches
    them only through `read` and `write` (counted, so a test can see what crossed), and
    `host_array` is None, exactly as for `runtime.cuda.DeviceStorage`."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}
        self.reads = self.writes = 0

    def add(self, name: str, array: np.ndarray) -> None:
        if name in self._arrays:
            raise KeyError(f"storage already holds {name!r}")
        self._arrays[name] = np.array(array, order="C", copy=True)

    def __getitem__(self, name: str) -> np.ndarray:  # the "device pointer" the CPU executor reads
        return self._arrays[name]

    def read(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        self.reads += 1
        if out is None:
            return self._arrays[name].copy()
        np.copyto(out, self._arrays[name])
        return out

    def write(self, name: str, value: np.ndarray) -> None:
        self.writes += 1
        target = self._arrays[name]
        if np.shape(value) != target.shape:
            raise ValueError(f"storage {name!r}: cannot write shape {np.shape(value)} into {target.shape}")
        np.copyto(target, np.asarray(value), casting="same_kind")

    def host_array(self, name: str) -> None:
        return None

    def type_of(self, name: str) -> ir.TensorType:
        return ir.TensorType.of(self._arrays[name])


@contextlib.contextmanager
def fake_device_target():
    """The cpu target's record with `FakeDeviceStorage`, registered as FAKE_DEVICE inside."""
    import dataclasses

    import ember.runtime
    from ember.passes import targets
    targets.register(dataclasses.replace(ember.runtime.target("cpu"), name=FAKE_DEVICE,
                                         description="cpu kernels on device-like storage (tests)",
                                         storage=FakeDeviceStorage))
    try:
        yield FAKE_DEVICE
    finally:
        targets.unregister(FAKE_DEVICE)


def device_fixture(request):
    """The body of a `device` fixture over `storage_targets()`-style params: the device's name,
    with FAKE_DEVICE registered while the test runs."""
    if request.param == FAKE_DEVICE:
        with fake_device_target():
            yield FAKE_DEVICE
    else:
        yield request.param


def storage_targets() -> list:
    """pytest params: the reference, every code-generating target (cuda marked) and FAKE_DEVICE;
    a test takes them through a fixture that registers FAKE_DEVICE (`fake_device_target`)."""
    import pytest
    return [pytest.param("reference", id="reference"), *compiled_targets(), pytest.param(FAKE_DEVICE, id=FAKE_DEVICE)]
