"""A new batch size of a compiled model (the last partial batch of an epoch, inference at another
size): the CPU kernels take the batch at run time and the new step takes the first step's kernel
plans, so it is the same code: no object is compiled for it, and it computes what the
interpreter computes at each size. The phase-plane family (strided and grouped convolutions)
still holds the batch in its code: its kernels (and the entry calling them) are the only objects a
new batch size compiles."""
from __future__ import annotations

import numpy as np
import pytest

from ember.codegen import compiler
from ember.frontends import compile, compile_inference, nn, optim

RTOL32 = 1e-5  # float32 losses of the same step on two devices (summation order differs)


def _plain_model(seed: int = 0) -> nn.Module:
    """Only families that take the batch at run time (stride 1, ungrouped: no phase-plane kernels)."""
    nn.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(8 * 7 * 7, 32), nn.ReLU(), nn.Linear(32, 10))


def _model(seed: int = 0) -> nn.Module:
    """Every CPU kernel family a batch size reaches: the convolution modes (flat, stride 2
    scattering its grad-input, grouped), BatchNorm (reductions over the batch, a mean's count),
    max pooling, both matmul forms (x @ W^T and the weight gradient, k = the batch), the mean loss."""
    nn.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU(),
        nn.Flatten(), nn.Linear(8 * 7 * 7, 32), nn.ReLU(), nn.Linear(32, 10))


def _batch(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    return rng.standard_normal((n, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, n)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    compiler.reset_cache_stats()


def _family(graph, kernel) -> str | None:
    """The kernel family a compiled kernel call was rendered from (None: a generated kind)."""
    spec = graph.attrs(kernel.node)["kernel"] if graph.op(kernel.node) == "fused" else None
    return spec.choice[0] if spec is not None and spec.choice is not None else None


def _objects_built() -> int:
    return compiler.cache_stats("obj")["misses"] + compiler.cache_stats("obj")["rebuilds"]


def test_a_new_batch_size_runs_no_compiler_and_trains_as_the_interpreter(cache):
    rng = np.random.default_rng(0)
    first = _batch(rng, 12)
    step = compile(_model(), nn.CrossEntropyLoss(), optim.SGD(lr=0.05, momentum=0.9), example_inputs=first,
                   device="cpu")
    reference = compile(_model(), nn.CrossEntropyLoss(), optim.SGD(lr=0.05, momentum=0.9), example_inputs=first,
                        device="reference")
    built = _objects_built()
    assert built > 0 and step.compile_stats["objects_built"] == built
    # fewer images than the grad-weight kernels' 16 slots, more than the first batch, one image
    for n in (7, 20, 12, 1):
        x, y = _batch(rng, n)
        np.testing.assert_allclose(step(x, y), reference(x, y), rtol=RTOL32)
    for (name, got), (_, want) in zip(sorted(step.state_dict().items()), sorted(reference.state_dict().items())):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=name)
    shapes = {t[0].shape[0]: (g, ex) for t, (g, ex) in step._steps.items()}
    for n in (7, 20):
        graph, ex = shapes[n]
        stats = ex.compile_stats
        phase = {k.function for k in ex.source.kernels if _family(graph, k) == "phase"}
        # those kernels, and the entry that calls them by their (new) names
        assert phase and stats["objects_built"] <= len(phase) + 1, (n, stats)
        assert stats["objects_cached"] + stats["objects_built"] == stats["objects"]
    # batch 1 is a step of its own (size-1 axes index differently) but still a correct one
    assert _objects_built() > built


def test_the_kernels_plans_are_taken_from_the_compiled_step(cache):
    rng = np.random.default_rng(1)
    step = compile(_plain_model(), nn.CrossEntropyLoss(), optim.SGD(lr=0.05), example_inputs=_batch(rng, 64),
                   device="cpu")
    step.precompile((7, 1, 28, 28))
    first, second = (g for g, _ in step._steps.values())

    def choices(graph):  # the phase family plans for the batch it holds (its image blocks)
        chosen = [graph.attrs(n)["kernel"].choice for n in graph.meta["schedule"] if graph.op(n) == "fused"]
        return [c for c in chosen if c is None or c[0] != "phase"]

    assert choices(first) == choices(second)
    whys = {second.attrs(n)["kernel"].why for n in second.meta["schedule"] if second.op(n) == "fused"}
    assert any(w.startswith("reused") for w in whys)
    (ga, ea), (gb, eb) = step._steps.values()
    a, b = ea.source, eb.source
    assert [k.function for k in a.kernels if _family(ga, k) != "phase"] == \
        [k.function for k in b.kernels if _family(gb, k) != "phase"]
    # the entry holds none of the step's sizes: they are its run-time table
    assert a.units[0].source == b.units[0].source and a.dims != b.dims
    stats = step.all_compile_stats  # what `ember mnist --verbose` prints for the last partial batch
    assert list(stats) == ["64x1x28x28", "7x1x28x28"] and stats["7x1x28x28"]["objects_built"] == 0


def test_inference_at_other_sizes_shares_the_training_steps_kernels(cache):
    rng = np.random.default_rng(2)
    model = _plain_model()
    step = compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.05), example_inputs=_batch(rng, 16), device="cpu")
    model.eval()
    x = _batch(rng, 9)[0]
    got = step.inference(x)
    built = _objects_built()
    again = step.inference(_batch(rng, 3)[0])
    assert _objects_built() == built and again.shape == (3, 10)
    want = compile_inference(model, x, device="reference")(x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
