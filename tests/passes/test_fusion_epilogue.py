"""Generated pointwise epilogues of contractions (targets whose FusionCaps allow them, as CUDA's):
which groups join a contraction's kernel, which stay apart, and numerics unchanged by fusing."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ember import ir
from ember.passes.fusion import fuse, kernel_counts
from ember.passes.schedule import schedule
from ember.passes.targets import FusionCaps
from models import cnn, mlp, run_both, train_graph

CAPS = FusionCaps(kinds=FusionCaps().kinds | {"softmax_xent", "softmax_xent_grad"},
                  epilogues={"conv2d": frozenset({"bias", "relu", "pointwise"}),
                             "matmul": frozenset({"bias", "relu", "pointwise"}),
                             "conv2d_grad_input": frozenset({"relu_mask", "pointwise"}),
                             "conv2d_grad_weight": frozenset({"pointwise"})},
                  loss_kernels=True)
NO_POINTWISE = FusionCaps(kinds=CAPS.kinds, loss_kernels=True,
                          epilogues={k: v - {"pointwise"} for k, v in CAPS.epilogues.items()})


def _fused(graph: ir.Graph) -> dict[str, tuple[str, ...]]:
    """Kernel name -> epilogues, for every contraction kernel."""
    out = {}
    for n in graph.g:
        if graph.op(n) == "fused":
            spec = graph.attrs(n)["kernel"]
            out[graph.attrs(n)["graph"].name] = spec.epilogues
    return out


def _update_kernel(graph: ir.Graph, name: str) -> ir.KernelSpec:
    return graph.attrs(graph.updates[name])["kernel"]


def test_mlp_sigmoid_and_update_join_their_contractions():
    g = train_graph(mlp(), (64, 784))
    fused = fuse(g, CAPS)
    plain = fuse(g, NO_POINTWISE)
    # bias+sigmoid, the sigmoid backward and the first layer's SGD update ride in matmuls
    assert sum(kernel_counts(plain).values()) - sum(kernel_counts(fused).values()) == 3
    assert _update_kernel(fused, "0.weight").kind == "matmul"
    assert "pointwise" in _update_kernel(fused, "0.weight").epilogues
    # 2.weight is read by the grad-input matmul, which does not run before its grad-weight:
    # updating it in place there would make the gradient kernel wait, so it stays its own kernel
    assert _update_kernel(fused, "2.weight").kind == "pointwise"


def test_cnn_relu_backward_behind_reshape_and_conv1_update():
    g = train_graph(cnn(), (64, 1, 28, 28))
    fused = fuse(g, CAPS)
    kinds = {name: spec for name, spec in _fused(fused).items()}
    assert any(name.endswith("_matmul") and "pointwise" in e for name, e in kinds.items())
    assert _update_kernel(fused, "0.weight").kind == "conv2d_grad_weight"
    for name in ("2.weight", "5.weight"):  # read by a grad-input kernel that runs alongside
        assert _update_kernel(fused, name).kind == "pointwise", name


def test_update_in_a_contraction_is_written_in_place():
    fused = schedule(fuse(train_graph(mlp(), (64, 784)), CAPS))
    node = fused.updates["0.weight"]
    assert fused.notes(node).get("storage") == "parameter" and fused.notes(node).get("name") == "0.weight"
    # ... after every other reader of the old weight (the forward matmul)
    order = fused.meta["schedule"]
    readers = [u for u, _ in fused.users(fused.parameters["0.weight"]) if u != node]
    assert readers and all(order.index(r) < order.index(node) for r in readers)


@pytest.mark.parametrize("model,shape", [(mlp, (64, 784)), (cnn, (8, 1, 28, 28))])
def test_numerics_unchanged(model, shape):
    m = model()
    g = train_graph(m, shape)
    fused = fuse(g, CAPS)
    before, after = run_both(g, fused, m, shape, seed=3)
    np.testing.assert_allclose(after.outputs["loss"], before.outputs["loss"], rtol=1e-6)
    for k in before.updates:
        np.testing.assert_allclose(after.updates[k], before.updates[k], rtol=1e-5, atol=1e-7, err_msg=k)


def test_broadcast_read_of_the_value_is_not_an_epilogue():
    """A group reading the contraction's value at another index (here: broadcast along a new axis)
    cannot run per output element: it stays its own kernel."""
    g = ir.Graph("bcast")
    a = g.add_input("a", ir.TensorType((4, 3)))
    b = g.add_input("b", ir.TensorType((3, 5)))
    c = g.add("matmul", [a, b])
    big = g.add("broadcast_to", [c], shape=(2, 4, 5))
    g.set_output("y", g.add("exp", [big]))
    fused = fuse(g, CAPS)
    assert kernel_counts(fused) == {"matmul": 1, "pointwise": 1}


def test_value_with_another_user_is_not_absorbed():
    g = ir.Graph("fanout")
    a = g.add_input("a", ir.TensorType((4, 3)))
    b = g.add_input("b", ir.TensorType((3, 5)))
    c = g.add("matmul", [a, b])
    g.set_output("y", g.add("exp", [c]))
    g.set_output("c", c)
    assert kernel_counts(fuse(g, CAPS)) == {"matmul": 1, "pointwise": 1}


def test_epilogue_roles_name_their_operands():
    g = ir.Graph("roles")
    a = g.add_input("a", ir.TensorType((4, 3)))
    b = g.add_input("b", ir.TensorType((3, 5)))
    s = g.add_input("s", ir.TensorType((4, 5)))
    g.set_output("y", g.add("mul", [g.add("matmul", [a, b]), g.add("sigmoid", [s])]))
    fused = fuse(g, CAPS)
    assert kernel_counts(fused) == {"matmul": 1}
    (node,) = [n for n in fused.g if fused.op(n) == "fused"]
    spec = fused.attrs(node)["kernel"]
    assert spec.epilogues == ("pointwise",)
    sub = fused.attrs(node)["graph"]
    assert spec.param("epilogue_from") == spec.core and spec.param("epilogue_from") in sub.g
    (role,) = [r for r, _ in spec.roles if r.startswith("in")]
    assert fused.operands(node)[spec.role(role)] == s
    rng = np.random.default_rng(0)
    inputs = {k: rng.standard_normal(fused.type(fused.inputs[k]).shape).astype(np.float32) for k in "abs"}
    np.testing.assert_allclose(ir.run(fused, inputs).outputs["y"], ir.run(g, inputs).outputs["y"], rtol=1e-6)


def _gelu_mlp():
    from ember.frontends import nn
    nn.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 32), nn.GELU(), nn.Linear(32, 10))


def _holding_op(graph: ir.Graph, op: str) -> list[ir.KernelSpec]:
    return [graph.attrs(n)["kernel"] for n in graph.g if graph.op(n) == "fused"
            and any(s.op(m) == op for s in [graph.attrs(n)["graph"]] for m in s.g)]


def test_gelu_is_recomputed_in_the_grad_input_epilogue():
    """GELU's forward is 0.5*x, x/sqrt(2), erf(.)+1 and their product; the backward reads the
    first three. A generated epilogue evaluates elementwise subgraphs at its output element, so it
    recomputes them from x like a pointwise reader does: the forward is one kernel, not four, and
    the grad-input matmul of the second layer evaluates erf itself."""
    g = train_graph(_gelu_mlp(), (16, 20))
    fused = fuse(g, CAPS)
    # the forward GELU's nodes live in two kernels: the forward one and the recomputing epilogue
    gelu_forward = [fused.attrs(n)["kernel"].kind for n in fused.g if fused.op(n) == "fused" and any(
        s.scope(m) == "1" and not s.is_backward(m) for s in [fused.attrs(n)["graph"]] for m in s.g)]
    assert sorted(gelu_forward) == ["matmul", "pointwise"], gelu_forward
    holders = _holding_op(fused, "erf")
    assert sorted(s.kind for s in holders) == ["matmul", "pointwise"]
    (grad_input,) = [s for s in holders if s.kind == "matmul"]
    assert "pointwise" in grad_input.epilogues
    # every operand the epilogue reads is a role of the kernel (the template passes it in)
    for n in fused.g:
        if fused.op(n) == "fused" and fused.attrs(n)["kernel"] is grad_input:
            sub = fused.attrs(n)["graph"]
            roles = {i for _, i in grad_input.roles}
            assert roles == set(range(len(fused.operands(n)))), (grad_input.roles, len(fused.operands(n)))
            assert any(sub.op(m) == "erf" for m in sub.g)
    before, after = run_both(g, fused, _gelu_mlp(), (16, 20), seed=4)
    np.testing.assert_allclose(after.outputs["loss"], before.outputs["loss"], rtol=1e-6)
    for k in before.updates:
        np.testing.assert_allclose(after.updates[k], before.updates[k], rtol=1e-5, atol=1e-7, err_msg=k)


def test_a_template_operand_is_not_recomputed():
    """A cheap value that a contraction reads as its operand (the template loads it from memory)
    stays stored, though its other reader is a generated epilogue."""
    g = ir.Graph("operand")
    a = g.add_input("a", ir.TensorType((4, 3)))
    b = g.add_input("b", ir.TensorType((3, 3)))
    half = g.add("mul", [a, g.add("constant", [], value=np.float32(0.5))])
    c = g.add("matmul", [half, b])
    g.set_output("y", g.add("add", [c, half]))
    fused = fuse(g, CAPS)
    assert kernel_counts(fused) == {"matmul": 1, "pointwise": 1}
    rng = np.random.default_rng(1)
    inputs = {"a": rng.standard_normal((4, 3)).astype(np.float32), "b": rng.standard_normal((3, 3)).astype(np.float32)}
    np.testing.assert_allclose(ir.run(fused, inputs).outputs["y"], ir.run(g, inputs).outputs["y"], rtol=1e-6)


BF16_CAPS = dataclasses.replace(CAPS, epilogue_dtypes=frozenset({"float32", "bfloat16"}))


def _bf16_train_graph(model, x_shape: tuple[int, ...]) -> ir.Graph:
    """`train_graph` under precision "bf16": the forward rewritten by autocast before autodiff."""
    from ember.frontends import functional as F
    from ember.frontends import spec, trace
    from ember.passes.optimizer import SGD
    from ember.passes.pipeline import build_train_graph
    from ember.passes.precision import autocast
    from ember.passes.simplify import simplify
    fwd = trace(lambda x, y: F.cross_entropy(model(x), y), spec(x_shape), spec((x_shape[0],), "int64"),
                modules={"": model})
    return simplify(build_train_graph(autocast(fwd), SGD(lr=0.05)))


def test_a_bfloat16_relu_backward_joins_its_matmul_where_the_target_reads_bfloat16():
    """The CNN's ReLU backward behind the linear layer's grad-input, under precision "bf16": the
    mask (a bfloat16 activation) and the product are bfloat16. With bfloat16 among the caps'
    epilogue dtypes (CUDA's: its templates read bfloat16 through views) the where joins the matmul
    as its generated epilogue; with float32 only, it stays a kernel of its own. Numerics unchanged."""
    g = _bf16_train_graph(cnn(), (4, 1, 28, 28))
    wheres = lambda f: [f.attrs(n)["kernel"] for n in f.g if f.op(n) == "fused" and any(
        s.op(m) == "where" and s.type(m).dtype.name == "bfloat16" for s in [f.attrs(n)["graph"]] for m in s.g)]
    fused = fuse(g, BF16_CAPS)
    # (the first layer's ReLU backward is conv2d_grad_input's relu_mask epilogue either way)
    assert sorted((s.kind, s.epilogues) for s in wheres(fused)) == [("conv2d_grad_input", ("relu_mask",)),
                                                                    ("matmul", ("pointwise",))]
    apart = fuse(g, CAPS)
    assert sorted(s.kind for s in wheres(apart)) == ["conv2d_grad_input", "pointwise"]
    assert sum(kernel_counts(fused).values()) < sum(kernel_counts(apart).values())
    before, after = run_both(g, fused, cnn(), (4, 1, 28, 28), seed=5)
    np.testing.assert_array_equal(after.outputs["loss"], before.outputs["loss"])
    for k in before.updates:
        np.testing.assert_array_equal(after.updates[k], before.updates[k], err_msg=k)


def _bn_net(seed: int = 0):
    """conv - BatchNorm - GELU twice, then max-pool and a linear layer (airbench's block, small)."""
    from ember.frontends import nn
    nn.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.GELU(),
                         nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.GELU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 4 * 4, 10))


def _stored(graph: ir.Graph) -> list[tuple[str, str, str]]:
    """(kernel kind, stored dtype, ops of the kernel's root) of every kernel of 8 channels x 8 x 8
    (the activations), in graph order."""
    out = []
    for n in graph.topo_order():
        if graph.op(n) == "fused" and graph.type(n).shape == (4, 8, 8, 8):
            sub = graph.attrs(n)["graph"]
            out.append((graph.attrs(n)["kernel"].kind, graph.type(n).dtype.name, sub.op(sub.outputs["out"])))
    return out


@pytest.mark.parametrize("caps", [BF16_CAPS, CAPS], ids=["bf16-epilogues", "float32-epilogues"])
def test_a_widened_bfloat16_value_is_stored_narrow_and_widened_by_its_readers(caps):
    caps = dataclasses.replace(caps, store_narrow=True)
    """Under precision "bf16" a convolution's bfloat16 result is widened for BatchNorm, and
    GELU's backward is rounded to bfloat16 and widened again: no kernel stores such a value
    widened (float32: twice the bytes written, and read by every reader), whichever dtypes the
    target's epilogues read; each reader widens the narrow value itself. The interpreter's
    results are unchanged."""
    g = _bf16_train_graph(_bn_net(), (4, 1, 8, 8))
    fused = fuse(g, caps)
    kernels = _stored(fused)
    widened = [(kind, op) for kind, dtype, op in kernels if op == "cast" and dtype == "float32"]
    assert kernels and not widened, kernels
    # a target without the rule (the CPU's) stores them widened, as before
    assert [k for k in _stored(fuse(g, dataclasses.replace(caps, store_narrow=False))) if k[2] == "cast" and k[1] == "float32"]
    assert [dtype for kind, dtype, _ in kernels if kind.startswith("conv2d")] == ["bfloat16"] * 3  # 2 forward, 1 grad-input
    # the BatchNorm statistics and normalisation kernels read the convolutions' bfloat16 values
    readers = [n for n in fused.g if fused.op(n) == "fused" and fused.attrs(n)["kernel"].kind in ("pointwise", "reduction")
               and any(fused.type(o).shape == (4, 8, 8, 8) and fused.op(o) == "fused"
                       and fused.attrs(o)["kernel"].kind == "conv2d" for o in fused.operands(n))]
    assert len(readers) >= 4
    for n in readers:
        for o in fused.operands(n):
            if fused.op(o) == "fused" and fused.attrs(o)["kernel"].kind == "conv2d":
                assert fused.type(o).dtype.name == "bfloat16"
    from models import params_of
    model, rng = _bn_net(), np.random.default_rng(3)
    inputs = {"x": rng.random((4, 1, 8, 8), dtype=np.float32), "y": rng.integers(0, 10, 4)}
    states = {name: np.asarray(v) for name, v in model.state_dict().items() if name not in params_of(model)}
    before, after = (ir.run(graph, inputs, params_of(model), states) for graph in (g, fused))
    np.testing.assert_array_equal(after.outputs["loss"], before.outputs["loss"])
    assert len(before.updates) >= 13  # weights, BatchNorm's affine parameters and statistics
    for k in before.updates:
        np.testing.assert_array_equal(after.updates[k], before.updates[k], err_msg=k)


def test_a_widened_value_a_template_reads_stays_stored_wide():
    """A widening cast whose value a kernel reads as a template operand (a max-pool here) cannot
    move into that reader: it stays where it is, stored wide (no cast kernel of its own)."""
    g = ir.Graph("widened")
    x = g.add_input("x", ir.TensorType((2, 4, 6, 6)))
    w = g.add_input("w", ir.TensorType((4, 4, 3, 3)))
    xb = g.add("cast", [x], dtype="bfloat16")
    wb = g.add("cast", [w], dtype="bfloat16")
    c = g.add("conv2d", [xb, wb], stride=(1, 1), padding=(1, 1), groups=1)
    wide = g.add("cast", [c], dtype="float32")
    g.set_output("pooled", g.add("max_pool2d", [wide], kernel=(2, 2), stride=(2, 2), padding=(0, 0)))
    g.set_output("doubled", g.add("mul", [wide, g.add("constant", [], value=np.float32(2))]))
    fused = fuse(g, dataclasses.replace(BF16_CAPS, store_narrow=True))
    (conv,) = [n for n in fused.g if fused.op(n) == "fused" and fused.attrs(n)["kernel"].kind == "conv2d"]
    assert fused.type(conv).dtype.name == "float32"
    assert kernel_counts(fused) == {"pointwise": 3, "conv2d": 1, "max_pool2d": 1}
    rng = np.random.default_rng(0)
    inputs = {"x": rng.standard_normal((2, 4, 6, 6)).astype(np.float32),
              "w": rng.standard_normal((4, 4, 3, 3)).astype(np.float32)}
    for k in ("pooled", "doubled"):
        np.testing.assert_array_equal(ir.run(fused, inputs).outputs[k], ir.run(g, inputs).outputs[k])
