"""The CUDA grouped convolutions (the `grouped` family: depthwise included) with bfloat16 operands
(precision "bf16"), without a GPU: MobileNet's depthwise layers had no CUDA family that took
bfloat16, so its bf16 step did not compile. The kernels read bfloat16 through the views of
`bf16.j2`, sum the products in float32, round the convolution's value to bfloat16 (the bias add
rounded again, as the interpreter's ops) and store bfloat16 bits. Here they run in the CPU
emulation of their own source (cuda_emulator.py) against float64 sums of the same bfloat16 values
with the same roundings: equal but for the last bit where a float32 sum lands near a bfloat16
tie; and a MobileNet bf16 step plans its grouped layers on the family and compiles with nvcc."""
from __future__ import annotations

import numpy as np
import pytest

import cuda_emulator
from ember.codegen import cuda, cuda_choices, grouped_conv
from ember.frontends import nn, optim, plan
from ember.frontends.training.zoo import ember_zoo_model
from ember.ir import Graph, TensorType, interpreter
from ember.ir.dtypes import bf16_bits, bf16_values, round_bf16
from ember.runtime.tuner import kernels_of
from nvcc import assert_compiles, nvcc_or_skip

rng = np.random.default_rng(23)

# (n, c, h, w, o, (kh, kw), stride, padding, groups)
CASES = [
    (3, 4, 9, 7, 4, (3, 3), 1, 1, 4),          # depthwise
    (2, 6, 11, 8, 6, (3, 3), 2, 1, 6),         # depthwise, stride 2
    (2, 6, 8, 9, 4, (3, 2), (3, 1), (0, 2), 2),  # two input and two output channels a group
]


def _graph(kind, n, c, h, w, o, k, stride, pad, groups):
    at = dict(stride=stride if isinstance(stride, tuple) else (stride, stride),
              padding=pad if isinstance(pad, tuple) else (pad, pad), groups=groups)
    w_shape = (o, c // groups, *k)
    g = Graph(kind)
    x, wt = g.add_input("x", TensorType((n, c, h, w))), g.add_input("w", TensorType(w_shape))
    y = g.add("conv2d", [x, wt], **at)
    if kind == "conv2d":
        g.set_output("out", y)
    elif kind == "conv2d_grad_input":
        dy = g.add_input("dy", g.type(y))
        g.set_output("out", g.add("conv2d_grad_input", [dy, wt], input_shape=(n, c, h, w), **at))
    else:
        dy = g.add_input("dy", g.type(y))
        g.set_output("out", g.add("conv2d_grad_weight", [x, dy], weight_shape=w_shape, **at))
    return g, grouped_conv.geometry((n, c, h, w), w_shape, at)


def _reference(graph, kind, vals, geo):
    """float64 sums of the bfloat16 values, the convolution rounded to bfloat16, then the
    epilogue's bfloat16 ops (the bias add rounded, ReLU; the ReLU mask)."""
    ins = {k: vals[k] if k in vals else np.zeros(graph.type(n).shape, np.float32) for k, n in graph.inputs.items()}
    conv = round_bf16(interpreter.run(graph, ins, precision="float64").outputs["out"].astype(np.float32))
    if kind == "conv2d":
        return np.maximum(round_bf16(conv + vals["bias"][None, :, None, None]), 0)
    if kind == "conv2d_grad_input":
        return np.where(vals["mask_src"] > 0, conv, 0).astype(np.float32)
    return conv


# the grad-weight a block a weight (0 shares) and by taps over one and three shares of the images
KINDS = [("conv2d", 0), ("conv2d_grad_input", 0)] + [("conv2d_grad_weight", s) for s in (0, 1, 3)]


@pytest.mark.parametrize("kind,splits", KINDS, ids=[f"{k}-{s}" for k, s in KINDS])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_bfloat16_grouped_kernels_give_the_bfloat16_reference(case, kind, splits, tmp_path):
    graph, geo = _graph(kind, *case)
    extra = {"conv2d": dict(bias=True, relu=True), "conv2d_grad_input": dict(relu_mask=True)}.get(kind, {})
    roles = {"conv2d": ("x", "w", "bias"), "conv2d_grad_input": ("dy", "w", "mask_src"),
             "conv2d_grad_weight": ("x", "dy")}[kind]
    kernel = grouped_conv.render_cuda("g", kind, geo, splits=splits, bf16_roles=frozenset(roles + ("out",)), **extra)
    assert "em_bf16_round(v)" in kernel.code
    shapes = {r: graph.type(graph.inputs[r]).shape for r in roles if r in graph.inputs}
    shapes.update({"bias": (geo.O,), "mask_src": shapes.get("dy") and (geo.N, geo.C, geo.H, geo.W)})
    vals = {r: round_bf16(rng.standard_normal(shapes[r]).astype(np.float32)) for r in roles}
    want = _reference(graph, kind, vals, geo)
    bits = {r: bf16_bits(v) for r, v in vals.items()}
    bits["out"] = np.full(want.shape, 0x7FC0, np.uint16)  # NaN: every output must be written
    cuda_emulator.run(cuda_emulator.build([kernel], tmp_path, "gbf16"), 0, kernel, bits)
    got = bf16_values(bits["out"])
    assert np.all(np.isfinite(got)), int(np.isnan(got).sum())
    assert np.max(np.abs(got - want)) <= 2.0 ** -7 * np.max(np.abs(want)), kernel.name
    assert np.mean(got == want) >= 0.97, np.mean(got == want)


def test_a_mobilenet_bf16_step_runs_its_grouped_layers_on_the_family_and_compiles(tmp_path):
    model = ember_zoo_model("mobilenet", width=1 / 8, seed=0)
    example = (np.zeros((8, 1, 28, 28), np.float32), np.zeros(8, np.int64))
    train = next(iter(plan(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.05), example, device="cuda",
                           precision="bf16").values()))
    grouped = [(sub, spec) for sub, spec in kernels_of(train) if spec.choice and spec.choice[0] == "grouped"]
    assert {spec.kind for _, spec in grouped} == set(grouped_conv.CONV_KINDS)
    assert all(cuda_choices.geometry(sub, spec)["dtype"] == "bfloat16" for sub, spec in grouped)
    nvcc = nvcc_or_skip()
    source = cuda.render_step(train)
    path = tmp_path / "mobilenet_bf16.cu"
    path.write_text(source.prelude + "\n".join(code for code, _ in source.units))
    assert_compiles(nvcc, path)
