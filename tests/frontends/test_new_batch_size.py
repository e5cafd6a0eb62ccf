"""A new batch size of a compiled model (the last partial batch of an epoch, inference at another
size): every CPU kernel family takes the batch at run time (the convolutions' images, and the
phase family's groups, where random_translate folds the batch; the matmuls' rows, k and batch;
pooling's images; the generated kernels' leading extent; the bf16 family's alike) and the new step
takes the first step's kernel plans, so it is the same code: no object is compiled for it, for
any zoo model, in float32 and bfloat16, and it computes what the interpreter computes at each
size.

What a new batch size still compiles: a batch of 1, whose graph is another one (size-1 axes are
indexed as broadcasts, a mean's 1/N folds to a constant), so its generated kernels differ."""
from __future__ import annotations

import numpy as np
import pytest

from ember.codegen import compiler, cpp_choices, tuning_db
from ember.frontends import compile, compile_inference, nn, optim
from ember.frontends.training.zoo import ZOO, ember_zoo_model, zoo_model

RTOL32 = 1e-5  # float32 losses of the same step on two devices (summation order differs)


def _model(seed: int = 0) -> nn.Module:
    """Every CPU kernel family a batch size reaches: the convolution modes (flat; stride 2 and
    grouped: the phase family), BatchNorm (reductions over the batch, a mean's count), max pooling,
    both matmul forms (x @ W^T and the weight gradient, k = the batch), the mean loss."""
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


def _winograd_model(seed: int = 0) -> nn.Module:
    """3x3 stride-1 convolutions (the winograd family's), BatchNorm, pooling, a linear head."""
    nn.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 16, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 12 * 12, 10))


@pytest.mark.parametrize("families", [("phase", "conv_forward", "pool"), ("winograd", "pool")],
                         ids=["cost_model", "winograd"])
def test_a_new_batch_size_runs_no_compiler_and_trains_as_the_interpreter(cache, families):
    """The cost model's families (no tuning database: the stride-1 convolutions conv_forward's),
    and a model whose convolutions are all the winograd family's (forced), whose three kinds take
    the images at run time."""
    rng = np.random.default_rng(0)
    first = _batch(rng, 12)
    model = _model if "phase" in families else _winograd_model
    forced = {} if "phase" in families else dict.fromkeys(("conv2d", "conv2d_grad_input", "conv2d_grad_weight"),
                                                          "winograd")
    with tuning_db.using(None), cpp_choices.force(**forced):
        step = compile(model(), nn.CrossEntropyLoss(), optim.SGD(lr=0.05, momentum=0.9), example_inputs=first,
                       device="cpu")
    reference = compile(model(), nn.CrossEntropyLoss(), optim.SGD(lr=0.05, momentum=0.9), example_inputs=first,
                        device="reference")
    built = _objects_built()
    assert built > 0 and step.compile_stats["objects_built"] == built
    # fewer images than the grad-weight kernels' 16 slots, more than the first batch, one image
    for n in (7, 20, 12, 1):
        x, y = _batch(rng, n)
        np.testing.assert_allclose(step(x, y), reference(x, y), rtol=RTOL32)
    for (name, got), (_, want) in zip(sorted(step.state_dict().items()), sorted(reference.state_dict().items())):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=name)
    shapes = {types[0].shape[0]: (g, ex) for (types, _), (g, ex) in step._steps.items()}
    first = [k.function for k in shapes[12][1].source.kernels]
    assert {_family(shapes[12][0], k) for k in shapes[12][1].source.kernels} >= set(families)
    for n in (7, 20):
        stats = shapes[n][1].compile_stats
        assert stats["objects_built"] == 0 and stats["objects_cached"] == stats["objects"], (n, stats)
        assert [k.function for k in shapes[n][1].source.kernels] == first
    # batch 1 is a step of its own (size-1 axes index differently) but still a correct one
    assert _objects_built() > built


def test_the_kernels_plans_are_taken_from_the_compiled_step(cache):
    rng = np.random.default_rng(1)
    step = compile(_model(), nn.CrossEntropyLoss(), optim.SGD(lr=0.05), example_inputs=_batch(rng, 64),
                   device="cpu")
    step.precompile((7, 1, 28, 28))
    first, second = (g for g, _ in step._steps.values())

    def choices(graph):
        return [graph.attrs(n)["kernel"].choice for n in graph.meta["schedule"] if graph.op(n) == "fused"]

    # the phase family's grad-weight stacks images by the batch it was planned for: at 7 it keeps
    # 64's stack (short passes)
    assert choices(first) == choices(second)
    whys = {second.attrs(n)["kernel"].why for n in second.meta["schedule"] if second.op(n) == "fused"}
    assert any(w.startswith("reused") for w in whys)
    (ga, ea), (gb, eb) = step._steps.values()
    a, b = ea.source, eb.source
    assert [k.function for k in a.kernels] == [k.function for k in b.kernels]
    # the entry holds none of the step's sizes: they are its run-time table
    assert a.units[0].source == b.units[0].source and a.dims != b.dims
    stats = step.all_compile_stats  # what `ember mnist --verbose` prints for the last partial batch
    assert list(stats) == ["64x1x28x28", "7x1x28x28"] and stats["7x1x28x28"]["objects_built"] == 0


def test_inference_at_other_sizes_shares_the_training_steps_kernels(cache):
    rng = np.random.default_rng(2)
    model = _model()
    step = compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.05), example_inputs=_batch(rng, 16), device="cpu")
    model.eval()
    x = _batch(rng, 9)[0]
    got = step.inference(x)
    built = _objects_built()
    again = step.inference(_batch(rng, 3)[0])
    assert _objects_built() == built and again.shape == (3, 10)
    want = compile_inference(model, x, device="reference")(x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


#: test_zoo.py's widths (compiling stays cheap; the first batch is its too, so the two tests
#: share their compiled objects in a session)
WIDTHS = {"airbench": 1 / 16, "mobilenet": 1 / 8, "vit": 0.25}
#: the zoo models and the precisions they compile in on the CPU (no family serves a grouped
#: bfloat16 convolution: MobileNet's depthwise layers, speednet's random translation)
ZOO_CASES = [(m, "float32") for m in ("resnet8", "mobilenet", "airbench", "vit", "speednet", "cnn", "lenet5")] + \
    [(m, "bf16") for m in ("resnet8", "airbench", "vit", "cnn", "lenet5")]


@pytest.mark.parametrize("name,precision", ZOO_CASES, ids=[f"{m}-{p}" for m, p in ZOO_CASES])
def test_no_zoo_model_compiles_a_kernel_for_a_new_batch_size(name, precision):
    """Each zoo model, compiled for 8 images, then run at 5 (fewer than the grad-weight slots and
    chunks) and 37 (slots of several images): the same kernels, and no object compiled."""
    # speednet: the recipe's model, with its random translation (the PyTorch twin has none)
    model = zoo_model(name) if name == "speednet" else ember_zoo_model(name, WIDTHS.get(name, 1.0), seed=0)
    shape = ZOO[name].input_shape
    rng = np.random.default_rng(3)
    step = compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.05), device="cpu", precision=precision,
                   example_inputs=(rng.random((8, *shape), dtype=np.float32), rng.integers(0, 10, 8)))
    built = _objects_built()
    for n in (5, 37):
        x, y = rng.random((n, *shape), dtype=np.float32), rng.integers(0, 10, n)
        assert np.isfinite(step(x, y))
    assert _objects_built() == built
    (_, first), *others = step._steps.values()
    assert len(others) == 2
    for _, ex in others:
        assert [k.function for k in ex.source.kernels] == [k.function for k in first.source.kernels]
        assert ex.compile_stats["objects_built"] == 0 and ex.compile_stats["link_cached"], ex.compile_stats
