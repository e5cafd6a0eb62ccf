"""share_relayouts: a grad-weight reads the bordered images of x and dy that its forward and its
grad-input already relaid.

Structure on CUDA steps planned without a GPU (the channels-innermost families forced): each
grad-weight pairs with the forward of its own geometry on the same x (a 3x3 and a 1x1 convolution
read the same tensor here) and, where the layer's grad-input is the family's, with it on the same
dy; its plan says so, its scratch loses the images, the schedule runs the owners first, the
memory plan keeps their scratch live until the reader and the stream placement orders writers
after it. On a GPU (`cuda` mark) a step that shares equals one that relays them itself, bit for bit.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ember.codegen import cuda_choices
from ember.codegen import cuda_conv_nhwc as cn
from ember.frontends import functional as F
from ember.frontends import nn, optim
from ember.frontends import plan as plan_steps
from ember.passes import targets
from ember.passes.memory import check_plan, plan_memory
from ember.passes.share_relayouts import share_relayouts


class Branches(nn.Module):
    """A stem, then its output read by a 3x3 and a 1x1 convolution (a residual block's shortcut)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(8, 16, 3, padding=1, bias=False)
        self.a = nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.b = nn.Conv2d(16, 16, 1, bias=False)
        self.fc = nn.Linear(16 * 36, 10)

    def forward(self, x):
        h = F.relu(self.stem(x))
        return self.fc(F.flatten(F.relu(self.a(h)) + self.b(h), 1))


FAMILY = {"bf16": "nhwc_wg", "float32": "nhwc_tc"}
EXAMPLE = (np.zeros((2, 8, 6, 6), np.float32), np.zeros(2, np.int64))


def _step(precision: str):
    family = FAMILY[precision]
    with cuda_choices.TABLE.force(conv2d=family, conv2d_grad_input=family, conv2d_grad_weight=family):
        graphs = plan_steps(Branches(), nn.CrossEntropyLoss(), optim.SGD(lr=0.1), EXAMPLE, device="cuda",
                            precision=precision)
    return next(g for k, g in graphs.items() if k.startswith("train"))


def _convs(graph, kind: str) -> list[int]:
    return [n for n in graph.meta["schedule"] if graph.op(n) == "fused" and graph.attrs(n)["kernel"].kind == kind]


def _window(graph, n: int) -> tuple[int, int]:
    sub, spec = graph.attrs(n)["graph"], graph.attrs(n)["kernel"]
    g = cuda_choices.geometry(sub, spec)
    return g["KH"], g["KW"]


@pytest.mark.parametrize("precision", ["bf16", "float32"])
def test_each_grad_weight_reads_the_images_of_the_kernels_of_its_own_layer(precision):
    graph = _step(precision)
    forwards, readers = _convs(graph, "conv2d"), _convs(graph, "conv2d_grad_weight")
    grad_inputs = _convs(graph, "conv2d_grad_input")
    assert len(forwards) == len(readers) == 3 and len(grad_inputs) == 2  # the stem's input needs none
    position = {n: i for i, n in enumerate(graph.meta["schedule"])}
    dy_shared = 0
    for n in readers:
        spec, owners = graph.attrs(n)["kernel"], graph.notes(n)["reads_scratch_of"]
        f = owners["x_image"]
        assert f in forwards and _window(graph, f) == _window(graph, n)
        assert graph.operands(f)[graph.attrs(f)["kernel"].role("x")] == graph.operands(n)[spec.role("x")]
        plan = dict(spec.choice[1])
        assert spec.choice[0] == FAMILY[precision] and plan["XI"] == 1
        assert f"x's relaid image read from the scratch of %{f}" in spec.why
        if "dy_image" in owners:  # the 1x1 layer's and the 3x3's grad-inputs: each its own
            i = owners["dy_image"]
            assert i in grad_inputs and _window(graph, i) == _window(graph, n) and plan["DYI"] == 1
            assert graph.operands(i)[graph.attrs(i)["kernel"].role("dy")] == graph.operands(n)[spec.role("dy")]
            assert position[i] < position[n]
            dy_shared += 1
        assert set(owners) <= {"x_image", "dy_image"}
        g = cuda_choices.geometry(graph.attrs(n)["graph"], spec)
        nplan = cn.NhwcPlan(**plan)
        assert spec.scratch_bytes == cn.scratch_bytes(g, nplan) < cn.scratch_bytes(g, dataclasses.replace(nplan, XI=0, DYI=0))
    assert dy_shared == 2
    # a stamped choice with the image fields is no family's own plan: no tuning record takes it,
    # and the tuner measures it as the family's own (its --families subset keeps it)
    for n in readers:
        sub, spec = graph.attrs(n)["graph"], graph.attrs(n)["kernel"]
        own = cuda_choices.TABLE.own_choice(spec.choice)
        assert own == cn.unshared(spec.choice) != spec.choice and own in cuda_choices.candidates(sub, spec)
        assert cuda_choices.TABLE.fits(sub, spec, own) and not cuda_choices.TABLE.fits(sub, spec, spec.choice)
    # the 3x3 and the 1x1 convolution of the stem's output: each reader its own forward
    assert len({graph.notes(n)["reads_scratch_of"]["x_image"] for n in readers}) == 3
    source = targets.get("cuda").source(graph)
    for n in readers:
        name = graph.attrs(n)["graph"].name
        assert f"{name}_src(" not in source and (f"{name}_dy(" in source) == ("dy_image" not in graph.notes(n)["reads_scratch_of"])


@pytest.mark.parametrize("precision", ["bf16", "float32"])
def test_the_owners_scratch_lives_until_its_reader_and_orders_later_writers(precision):
    from ember.runtime.cuda_streams import kernel_regions
    graph = _step(precision)
    check_plan(graph)
    position = {n: i for i, n in enumerate(graph.meta["schedule"])}
    kernels = [n for n in graph.meta["schedule"] if graph.op(n) == "fused"]
    regions = dict(zip(kernels, kernel_regions(graph, kernels)))
    for n in _convs(graph, "conv2d_grad_weight"):
        for owner in graph.notes(n)["reads_scratch_of"].values():
            start, stop = graph.meta["scratch_liveness"][owner]
            assert start == position[owner] and stop >= position[n]
            off = graph.notes(owner)["scratch_offset"]
            assert ("arena", off, off + graph.attrs(owner)["kernel"].scratch_bytes) in regions[n][0]
            assert (owner, n) in graph.meta["schedule_edges"]


def test_the_pass_is_pure_pairs_only_what_the_target_allows_and_is_cpu_free():
    graph = _step("bf16")
    readers = _convs(graph, "conv2d_grad_weight")
    stripped = graph.copy()
    for n in readers:  # as `select` left them: the tuned or default plan, no image read
        spec = stripped.attrs(n)["kernel"]
        plan = tuple((k, v) for k, v in spec.choice[1] if k not in ("XI", "DYI"))
        stripped.attrs(n)["kernel"] = dataclasses.replace(spec, choice=(spec.choice[0], plan), scratch_bytes=1)
        del stripped.notes(n)["reads_scratch_of"]
    target = targets.get("cuda")
    again = share_relayouts(stripped, target)
    assert [again.notes(n)["reads_scratch_of"] for n in readers] == [graph.notes(n)["reads_scratch_of"] for n in readers]
    assert [again.attrs(n)["kernel"].choice for n in readers] == [graph.attrs(n)["kernel"].choice for n in readers]
    assert all("reads_scratch_of" not in stripped.notes(n) and stripped.attrs(n)["kernel"].scratch_bytes == 1
               for n in readers)
    refused = share_relayouts(stripped, dataclasses.replace(target, shared_relayout=lambda *a: None))
    assert not any("reads_scratch_of" in refused.notes(n) for n in readers)
    assert all(name != "share_relayouts" for name, _ in targets.get("cpu").passes())


def test_a_reader_scheduled_before_the_scratch_it_reads_is_refused():
    graph = _step("float32")
    n = _convs(graph, "conv2d_grad_weight")[0]
    f = graph.notes(n)["reads_scratch_of"]["x_image"]
    bad = graph.copy()
    bad.notes(f)["reads_scratch_of"] = {"x_image": n}  # the forward reading its own grad-weight's scratch
    with pytest.raises(AssertionError, match=f"%{f} reads the scratch of %{n}"):
        plan_memory(bad)


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["bf16", "float32"])
def test_a_step_sharing_the_image_equals_one_relaying_x_itself(precision, monkeypatch):
    pytest.importorskip("cupy")
    from ember.frontends import compile
    monkeypatch.setenv("EMBER_PLAN_CACHE", "0")
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((3, 32, 8, 6, 6)).astype(np.float32)
    ys = rng.integers(0, 10, (3, 32)).astype(np.int64)
    family = FAMILY[precision]
    runs = {}
    for share in (True, False):
        if not share:
            monkeypatch.setattr(cn, "shared_choice", lambda *a: None)
        nn.manual_seed(3)  # the same weights in both steps
        with cuda_choices.TABLE.force(conv2d=family, conv2d_grad_input=family, conv2d_grad_weight=family):
            step = compile(Branches(), nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example_inputs=(xs[0], ys[0]),
                           device="cuda", precision=precision)
            losses = [float(step.run(x, y)) for x, y in zip(xs, ys)]
        graph = step._example_step()[1].graph
        assert sum(len(graph.notes(n).get("reads_scratch_of", {})) for n in graph.g) == (5 if share else 0)
        runs[share] = losses, {k: np.asarray(v) for k, v in step.state_dict().items()}
    assert runs[True][0] == runs[False][0]
    for k, v in runs[True][1].items():
        assert np.array_equal(v, runs[False][1][k]), k
