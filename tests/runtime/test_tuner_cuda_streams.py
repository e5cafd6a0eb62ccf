"""The CUDA measurer orders its buffers before its launches, without a GPU.

The measurer runs candidates on a stream of its own, created non-blocking: such a stream does not
wait for the legacy default stream. A buffer made or filled on the default stream (the output's
NaN poison, the zeroed scratch, the random inputs) could then still be landing when the first
launch runs, and its late bytes overwrite the results: on an H200 the last 40-90 of 256 images
came back NaN for every plan of a convolution, and correct candidates were refused at random.
Here a fake CuPy records the stream every allocation, copy and launch is issued on; a launch that
reads a buffer last written on another stream, with no synchronisation between, fails the test.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ember.codegen import cuda_choices, tuning_db
from ember.frontends import nn, optim, plan
from ember.runtime import cuda as runtime_cuda
from ember.runtime.tuner_cuda import CudaMeasurer

DEFAULT = "default"  # the legacy default stream


class FakeArray:
    def __init__(self, fake: "FakeCupy", data: np.ndarray) -> None:
        self.data, self.stream, self.fake = data, fake.current(), fake

    def written(self) -> None:
        self.stream = self.fake.current()


class FakeStream:
    def __init__(self, fake: "FakeCupy", non_blocking: bool = False) -> None:
        self.fake, self.non_blocking = fake, non_blocking

    def __enter__(self) -> "FakeStream":
        self.fake.stack.append(self)
        return self

    def __exit__(self, *exc) -> None:
        self.fake.stack.pop()

    def synchronize(self) -> None:
        pass  # host-side: orders nothing between streams on the device

    def record(self) -> SimpleNamespace:
        return SimpleNamespace(synchronize=lambda: None)

    def begin_capture(self) -> None:
        self.fake.capturing = self

    def end_capture(self) -> SimpleNamespace:
        self.fake.capturing = None
        return SimpleNamespace(launch=lambda stream: None)


class FakeCupy:
    uint8, float32 = np.uint8, np.float32

    def __init__(self) -> None:
        self.stack: list[FakeStream] = []
        self.capturing = None
        self.launches = 0
        self.unordered: list[str] = []
        self.cuda = SimpleNamespace(Stream=lambda non_blocking=False: FakeStream(self, non_blocking),
                                    get_elapsed_time=lambda a, b: 0.01,
                                    Device=lambda index=None: SimpleNamespace(id=0, compute_capability="90"))

    def current(self):
        return self.stack[-1] if self.stack else DEFAULT

    def asarray(self, array) -> FakeArray:
        return FakeArray(self, np.array(array))

    def zeros(self, shape, dtype=np.float32) -> FakeArray:
        return FakeArray(self, np.zeros(shape, dtype))

    def asnumpy(self, array: FakeArray) -> np.ndarray:
        return array.data.copy()

    def ordered(self, array: FakeArray) -> bool:
        """Work issued now on the current stream runs after the last write of `array`."""
        here = self.current()
        if array.stream is here:
            return True
        # a blocking stream waits for the default stream, and the default stream for every blocking one
        blocking = lambda s: s is DEFAULT or not s.non_blocking  # noqa: E731
        return blocking(array.stream) and blocking(here)

    def function(self, name: str):
        def launch(grid, block, args, shared_mem=0):
            self.launches += 1
            for a in args:
                if isinstance(a, FakeArray):
                    if not self.ordered(a):
                        self.unordered.append(name)
                    a.written()
            out = [a for a in args if isinstance(a, FakeArray) and np.issubdtype(a.data.dtype, np.floating)]
            for a in out:
                a.data[...] = np.where(np.isnan(a.data), 0.0, a.data)
        return launch


def _kernel():
    nn.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 26 * 26, 10))
    example = (np.zeros((8, 1, 28, 28), np.float32), np.zeros(8, np.int64))
    with tuning_db.using(None):
        graph = next(iter(plan(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example, device="cuda").values()))
    for n in graph.meta["schedule"]:
        spec = graph.attrs(n).get("kernel") if graph.op(n) == "fused" else None
        if spec is not None and spec.kind in cuda_choices.CONVS:
            return graph.attrs(n)["graph"], spec
    raise AssertionError("no convolution kernel")


def test_every_launch_reads_buffers_ordered_before_it(monkeypatch):
    sub, spec = _kernel()  # planned for the descriptor's H200, before CuPy is faked
    choices = cuda_choices.candidates(sub, spec)[:3]
    fake = FakeCupy()
    monkeypatch.setattr(runtime_cuda, "_cupy", lambda: fake)
    monkeypatch.setattr(runtime_cuda, "compile_units",
                        lambda cp, prelude, units, options: {f: fake.function(f) for _, names in units for f in names})
    trials = CudaMeasurer().measure(sub, spec, choices, seed=0)
    assert fake.launches >= len(choices) and all(t.error is None for t in trials), [t.error for t in trials]
    assert not fake.unordered, f"launches reading buffers written on another stream: {sorted(set(fake.unordered))}"
