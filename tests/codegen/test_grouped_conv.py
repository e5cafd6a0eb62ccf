"""Grouped convolutions (groups 1, 2 and C: depthwise) compiled by every code-generating backend
against the interpreter, on odd sizes, strides 1-3, padding and non-square kernels, with the
epilogues fusion gives them (bias and ReLU on the forward, ReLU's mask on the grad-input); the
CUDA sources, pointwise epilogues included, compile with nvcc without a GPU; and both choice
tables send groups > 1 to the families that serve them (CUDA: the grouped family alone; CPU: the
phase planes first, the generic grouped loops as a candidate), and groups 1 never to the grouped
loops.

Tolerances as tests/codegen/test_cpp_ops.py: rtol 1e-5, atol 1e-5 * sqrt(terms summed)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from ember.ir import Graph, TensorType, run
from ember.passes.fusion import kernel_counts
from models import compiled_targets, plan_for, run_compiled
from nvcc import assert_compiles, nvcc_or_skip

# (n, c, h, w, o, (kh, kw), stride, padding, groups)
CASES = [
    (2, 6, 9, 7, 4, (3, 3), 1, 1, 2),
    (3, 5, 11, 8, 5, (3, 3), 2, 1, 5),      # depthwise, stride 2
    (1, 4, 10, 13, 8, (3, 2), (3, 1), (0, 2), 4),  # two outputs a group, stride 3
    (2, 3, 7, 7, 6, (1, 1), 2, 0, 3),       # 1x1, stride 2
    (2, 6, 8, 9, 6, (5, 3), 1, (2, 1), 3),
    (1, 3, 9, 9, 3, (3, 3), 3, 2, 1),       # groups 1 through the same graph
]


@pytest.fixture(params=compiled_targets())
def device(request) -> str:
    return request.param


def _graph() -> tuple[Graph, dict, dict, dict]:
    """One graph holding every case's forward (+bias, ReLU), grad-input (plain and ReLU-masked)
    and grad-weight, so that one compile covers them all."""
    g = Graph("grouped")
    rng = np.random.default_rng(3)
    inputs, params, tol = {}, {}, {}
    for i, (n, c, h, w, o, (kh, kw), stride, pad, groups) in enumerate(CASES):
        x_t, w_t = TensorType((n, c, h, w)), TensorType((o, c // groups, kh, kw))
        x, wt = g.add_input(f"x{i}", x_t), g.add_parameter(f"w{i}", w_t)
        b = g.add_parameter(f"b{i}", TensorType((o,)))
        at = dict(stride=stride, padding=pad, groups=groups)
        y = g.add("conv2d", [x, wt], **at)
        g.set_output(f"fwd{i}", g.add("relu", [g.add("add", [y, g.add("reshape", [b], shape=(o, 1, 1))])]))
        dy = g.add_input(f"dy{i}", g.type(y))
        gi = g.add("conv2d_grad_input", [dy, wt], input_shape=x_t.shape, **at)
        g.set_output(f"gi{i}", gi)
        mask = g.add_input(f"m{i}", x_t)
        zero = g.add_constant(np.zeros((), np.float32))
        gi_masked = g.add("conv2d_grad_input", [g.add("mul", [dy, g.add_constant(np.float32(0.5))]), wt],
                          input_shape=x_t.shape, **at)
        g.set_output(f"gim{i}", g.add("where", [g.add("gt", [mask, zero]), gi_masked, zero]))
        g.set_output(f"gw{i}", g.add("conv2d_grad_weight", [x, dy], weight_shape=w_t.shape, **at))
        # pointwise consumers of a contraction's value alone (epilogues on CUDA, kernels on the CPU)
        g.set_output(f"fwdp{i}", g.add("sigmoid", [g.add("conv2d", [x, wt], **at)]))
        g.set_output(f"gwp{i}", g.add("mul", [g.add("conv2d_grad_weight", [x, dy], weight_shape=w_t.shape, **at),
                                              g.add_constant(np.float32(0.25))]))
        ho, wo = g.type(y).shape[2:]
        inputs.update({f"x{i}": rng.standard_normal(x_t.shape).astype(np.float32),
                       f"dy{i}": rng.standard_normal(g.type(y).shape).astype(np.float32),
                       f"m{i}": rng.standard_normal(x_t.shape).astype(np.float32)})
        params.update({f"w{i}": rng.standard_normal(w_t.shape).astype(np.float32),
                       f"b{i}": rng.standard_normal((o,)).astype(np.float32)})
        terms = {"fwd": c // groups * kh * kw, "gi": o // groups * kh * kw, "gw": n * ho * wo}
        for k, t in terms.items():
            tol[f"{k}{i}"] = (1e-5, 1e-5 * math.sqrt(t))
        tol[f"gim{i}"], tol[f"fwdp{i}"], tol[f"gwp{i}"] = tol[f"gi{i}"], tol[f"fwd{i}"], tol[f"gw{i}"]
    return g, inputs, params, tol


def test_grouped_convolutions_match_the_interpreter(device):
    g, inputs, params, tol = _graph()
    expect = run(g, inputs, params).outputs
    planned, got = run_compiled(g, device, inputs, params)
    for name, want in expect.items():
        rtol, atol = tol[name]
        np.testing.assert_allclose(got[name], want, rtol=rtol, atol=atol, err_msg=name)
    counts = kernel_counts(planned)
    assert counts["conv2d"] == 2 * len(CASES) and counts["conv2d_grad_weight"] == 2 * len(CASES)
    assert counts["conv2d_grad_input"] == 2 * len(CASES)  # the masked ones with their mask fused


def test_grouped_cuda_sources_compile_with_nvcc(tmp_path):
    """Every grouped kind with the CUDA target's epilogues (bias+ReLU, the ReLU mask, and the
    pointwise ones fusion adds on CUDA) in one source, compiled as NVRTC would."""
    from ember.runtime import target
    nvcc = nvcc_or_skip()
    g, *_ = _graph()
    planned = plan_for(g, "cuda")
    specs = [planned.attrs(n)["kernel"] for n in planned.g if planned.op(n) == "fused"]
    grouped = [s for s in specs if s.choice and s.choice[0] == "grouped"]
    assert len(grouped) == 6 * (len(CASES) - 1)  # groups 1 keeps its own families
    assert {e for s in grouped for e in s.epilogues} >= {"bias", "relu", "relu_mask", "pointwise"}
    src = tmp_path / "grouped.cu"
    src.write_text(target("cuda").source(planned))
    assert_compiles(nvcc, src)


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_choice_tables_send_groups_to_the_grouped_families(target):
    from ember.codegen import cpp_choices, cuda_choices
    table = {"cpu": cpp_choices, "cuda": cuda_choices}[target]
    # the families serving groups > 1, the cost model's first (the CPU's phase planes: tiled)
    grouped, first = {"cpu": ({"grouped", "phase"}, "phase"), "cuda": ({"grouped"}, "grouped")}[target]
    g, *_ = _graph()
    planned = plan_for(g, target)
    for n in planned.g:
        if planned.op(n) != "fused":
            continue
        spec, sub = planned.attrs(n)["kernel"], planned.attrs(n)["graph"]
        if spec.kind not in table.CONVS:
            continue
        families = {f for f, _ in table.candidates(sub, spec)}
        if sub.attrs(spec.core)["groups"] > 1:
            assert families == grouped and spec.choice[0] == first, (sub.name, families)
        else:
            assert "grouped" not in families and families, (sub.name, families)
    ungrouped = next(f for f in table.FAMILIES.values() if "conv2d" in f.kinds and not f.grouped)
    reason = table.TABLE.applies(ungrouped, {"kind": "conv2d", "epilogues": (), "groups": 2, "tf32": False})
    assert reason == "it serves ungrouped convolutions only"
