"""The CUDA grouped grad-weight by taps, without a GPU.

A block a weight re-read x and dy once a tap, and a depthwise layer's 32-128 filters x 9 taps were
few, long blocks: MobileNet's depthwise grad-weights took 16-40 us each alone on an H200 at 1% of
its FMA rate. By taps, a block takes a filter and a share of the images, each thread every tap of
its positions (dy read once a position), the shares' partials added in order by a second launch.
Here grouped and depthwise geometries (strides 1-3, padding, non-square windows, a share count
of 1 and several, a window too large for taps) run in the CPU emulation of the kernel's own source
(cuda_emulator.py) against the interpreter."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import cuda_emulator
from ember.codegen import grouped_conv
from ember.ir import Graph, TensorType, run

rng = np.random.default_rng(9)

# (n, c, h, w, o, (kh, kw), stride, padding, groups)
CASES = [
    (6, 4, 9, 7, 4, (3, 3), 1, 1, 4),          # depthwise
    (5, 6, 11, 8, 6, (3, 3), 2, 1, 6),         # depthwise, stride 2
    (3, 6, 8, 9, 4, (3, 2), (3, 1), (0, 2), 2),  # two input and two output channels a group
    (4, 3, 7, 7, 6, (5, 5), 1, 2, 3),          # 25 taps: the most taps keeps
    (2, 2, 9, 9, 2, (7, 7), 1, 3, 2),          # 49 taps: a block a weight
]


def _case(n, c, h, w, o, k, stride, pad, groups):
    g = Graph("gw")
    at = dict(stride=stride if isinstance(stride, tuple) else (stride, stride),
              padding=pad if isinstance(pad, tuple) else (pad, pad), groups=groups)
    x = g.add_input("x", TensorType((n, c, h, w)))
    w_shape = (o, c // groups, *k)
    y_t = g.type(g.add("conv2d", [x, g.add_input("w", TensorType(w_shape))], **at))
    dy = g.add_input("dy", y_t)
    g.set_output("gw", g.add("conv2d_grad_weight", [x, dy], weight_shape=w_shape, **at))
    return g, grouped_conv.geometry((n, c, h, w), w_shape, at)


@pytest.mark.parametrize("splits", [None, 1, 3], ids=["planned", "one-share", "three-shares"])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_the_grouped_grad_weight_by_taps_gives_the_interpreters_values(case, splits, tmp_path):
    graph, geo = _case(*case)
    if splits is None:
        splits = grouped_conv.cuda_grad_weight_splits(geo, multiprocessors=2)
        assert (splits == 0) == (geo.KH * geo.KW > grouped_conv.CUDA_TAPS_MAX)
    kernel = grouped_conv.render_cuda("gw", "conv2d_grad_weight", geo, splits=splits)
    assert len(kernel.launches) == (2 if splits > 1 else 1) and (kernel.scratch_bytes > 0) == (splits > 1)
    ins = {k: rng.standard_normal(graph.type(n).shape).astype(np.float32) for k, n in graph.inputs.items() if k != "w"}
    want = run(graph, dict(ins, w=np.zeros(graph.type(graph.inputs["w"]).shape, np.float32))).outputs["gw"]
    bufs = dict(ins, out=np.full(want.shape, np.nan, np.float32))
    cuda_emulator.run(cuda_emulator.build([kernel], tmp_path, "gw"), 0, kernel, bufs)
    terms = geo.N * geo.HO * geo.WO
    np.testing.assert_allclose(bufs["out"], want, rtol=1e-5, atol=1e-5 * np.sqrt(terms))


def test_a_depthwise_layers_images_are_split_until_the_gpu_is_busy():
    geo = grouped_conv.ConvGeometry(64, 32, 28, 28, 32, 3, 3, 1, 1, 1, 1, 28, 28, 32)  # MobileNet's first
    assert grouped_conv.cuda_grad_weight_splits(geo, 132) == 16   # 32 filters x 16 shares of 4 images
    small = dataclasses.replace(geo, N=2, H=7, W=7, HO=7, WO=7)
    assert grouped_conv.cuda_grad_weight_splits(small, 132) == 1  # too few positions to share


def _forward_and_grad_input(n, c, h, w, o, k, stride, pad, groups):
    g = Graph("fw")
    at = dict(stride=(stride, stride), padding=(pad, pad), groups=groups)
    x, wt = g.add_input("x", TensorType((n, c, h, w))), g.add_input("w", TensorType((o, c // groups, *k)))
    y = g.add("conv2d", [x, wt], **at)
    g.set_output("out", y)
    dy = g.add_input("dy", g.type(y))
    g.set_output("dx", g.add("conv2d_grad_input", [dy, wt], input_shape=(n, c, h, w), **at))
    return g, grouped_conv.geometry((n, c, h, w), (o, c // groups, *k), at)


@pytest.mark.parametrize("kind", ["conv2d", "conv2d_grad_input", "conv2d_grad_weight"])
def test_a_grouped_kernel_on_run_time_images_is_one_text_at_every_batch(kind, tmp_path):
    """What a step whose plans came from a step of another batch size runs: the images a by-value
    argument of every launch, one text at 7 and 2 images, the grad-weight keeping the first's
    split count (4 shares of 2 images: two add nothing), the interpreter's values at both."""
    texts = set()
    for n in (7, 2):
        if kind == "conv2d_grad_weight":
            graph, geo = _case(n, 6, 9, 7, 6, (3, 3), 2, 1, 6)
            kernel = grouped_conv.render_cuda("gw", kind, geo, splits=4, runtime_images=True)
            want_key, got_key, fixed = "gw", "out", ("w",)
        else:
            graph, geo = _forward_and_grad_input(n, 6, 9, 7, 6, (3, 3), 2, 1, 6)
            kernel = grouped_conv.render_cuda("gx", kind, geo, runtime_images=True)
            want_key, got_key, fixed = ("out", "out", ("dy",)) if kind == "conv2d" else ("dx", "out", ())
        assert all(ln.scalars == (("int", n),) for ln in kernel.launches)
        texts.add(kernel.code)
        ins = {k: rng.standard_normal(graph.type(v).shape).astype(np.float32) for k, v in graph.inputs.items()}
        want = run(graph, ins).outputs[want_key]
        bufs = {k: v for k, v in ins.items() if k not in fixed} | {got_key: np.full(want.shape, np.nan, np.float32)}
        cuda_emulator.run(cuda_emulator.build([kernel], tmp_path, f"{kind}{n}"), 0, kernel, bufs)
        np.testing.assert_allclose(bufs[got_key], want, rtol=1e-5, atol=1e-4)
    assert len(texts) == 1


def test_a_grouped_plan_of_another_batch_size_fits_and_renders_on_run_time_images():
    from ember.codegen import cuda_choices
    grouped = cuda_choices.FAMILIES["grouped"]
    g = dict(kind="conv2d_grad_weight", epilogues=frozenset(), tf32=False, N=64, C=32, H=14, W=14, O=32, KH=3, KW=3,
             stride=(1, 1), padding=(1, 1), groups=32, HO=14, WO=14)
    (plan,) = cuda_choices._grouped_plans(g)
    small = dict(g, N=3)
    assert grouped.fits_reused(small, plan) and not grouped.fits_reused(small, (("splits", "many"),))
    assert grouped.fits_reused(dict(g, kind="conv2d"), ()) and not grouped.fits_reused(dict(g, kind="conv2d"), plan)
    assert grouped.code_geometry(g) == grouped.code_geometry(small)
