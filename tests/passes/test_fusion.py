"""Fusion: kernel structure of the MNIST graphs, and the interpreter's output unchanged by fusing."""
from __future__ import annotations

import numpy as np
import pytest

from ember import ir
from ember.frontends import spec, trace
from ember.passes.fusion import fuse, kernel_counts
from ember.passes.targets import FusionCaps
from models import cnn, mlp, run_both, train_graph


def test_pointwise_chain_is_one_kernel():
    g = ir.Graph("chain")
    t = ir.TensorType((8, 5))
    a, b, c = (g.add_input(k, t) for k in "abc")
    g.set_output("y", g.add("relu", [g.add("add", [g.add("mul", [a, b]), c])]))
    fused = fuse(g)
    assert kernel_counts(fused) == {"pointwise": 1}
    rng = np.random.default_rng(0)
    inputs = {k: rng.standard_normal(t.shape).astype(np.float32) for k in "abc"}
    np.testing.assert_array_equal(ir.run(g, inputs).outputs["y"], ir.run(fused, inputs).outputs["y"])


def _fanout(t: ir.TensorType, readers: int, value) -> tuple[ir.Graph, dict]:
    """`value(g, a, b, c)` read by `readers` pointwise kernels (each also reading input d)."""
    g = ir.Graph("fanout")
    a, b, c, d = (g.add_input(k, t) for k in "abcd")
    e = value(g, a, b, c)
    for k in range(readers):
        g.set_output(f"y{k}", g.add(("mul", "sub", "add", "maximum")[k % 4], [e, d]))
    rng = np.random.default_rng(0)
    return g, {k: rng.standard_normal(t.shape).astype(np.float32) for k in "abcd"}


def test_shared_value_is_materialised_once_without_recompute():
    g, _ = _fanout(ir.TensorType((4, 4)), 2, lambda g, a, b, c: g.add("exp", [a]))
    assert kernel_counts(fuse(g, FusionCaps(recompute=False))) == {"pointwise": 3}


@pytest.mark.parametrize("readers,value,kernels", [
    (2, lambda g, a, b, c: g.add("exp", [a]), 2),  # one operand read instead of the value: recomputed
    (2, lambda g, a, b, c: g.add("add", [g.add("mul", [a, b]), c]), 2),  # 3 reads each vs 3 + 1 + 2
    (4, lambda g, a, b, c: g.add("add", [g.add("mul", [a, b]), c]), 5),  # 12 reads vs 3 + 1 + 4: stored
    (2, lambda g, a, b, c: g.add("sigmoid", [g.add("sigmoid", [g.add("sigmoid", [a])])]), 3),  # too much arithmetic
])
def test_cheap_shared_values_are_recomputed_by_their_readers(readers, value, kernels):
    g, inputs = _fanout(ir.TensorType((8, 16)), readers, value)
    fused = fuse(g)
    assert kernel_counts(fused) == {"pointwise": kernels}
    before, after = ir.run(g, inputs), ir.run(fused, inputs)
    for k in before.outputs:  # the same ops in the same order: the same values
        np.testing.assert_array_equal(after.outputs[k], before.outputs[k])


def test_cnn_forward_is_three_kernels():
    fused = fuse(trace(cnn(), spec((64, 1, 28, 28))))
    # conv+bias+relu twice, linear with its bias as a matmul epilogue
    assert kernel_counts(fused) == {"conv2d": 2, "matmul": 1}


def test_mlp_forward_kernels():
    fused = fuse(trace(mlp(), spec((64, 784))))
    assert kernel_counts(fused) == {"matmul": 2, "pointwise": 1}  # the sigmoid stands alone


# The designed structure: contractions with their bias/ReLU epilogues, ReLU's backward as a
# relu_mask epilogue of the grad contractions (dy @ W for conv2's output, conv2's grad-input for
# conv1's: 12 -> 10 pointwise kernels); the loss (log-softmax + cross-entropy, forward and
# backward), bias gradients and SGD updates as pointwise/reduction groups; the loss's cheap
# elementwise values (logits - max, exp, log) recomputed in each kernel that reads them rather than
# stored (10 -> 4 pointwise kernels for the CNN, 11 -> 5 for the MLP). Default FusionCaps: one output
# per kernel. A change here is a change of the fusion design: update on purpose.
CNN_TRAIN_KERNELS = {"conv2d": 2, "conv2d_grad_input": 1, "conv2d_grad_weight": 2, "matmul": 3, "pointwise": 4,
                     "reduction": 8}
MLP_TRAIN_KERNELS = {"matmul": 5, "pointwise": 5, "reduction": 7}


@pytest.mark.parametrize("name,model,shape,expected", [("cnn", cnn, (64, 1, 28, 28), CNN_TRAIN_KERNELS),
                                                       ("mlp", mlp, (64, 784), MLP_TRAIN_KERNELS)])
def test_train_graph_kernels_and_numerics(name, model, shape, expected):
    m = model()
    g = train_graph(m, shape)
    fused = fuse(g)
    counts = kernel_counts(fused)
    assert counts == expected
    assert fused.count("fused") == sum(counts.values())
    assert fused.count() - fused.count("fused") == sum(
        1 for n in fused.g if fused.op(n) in ("input", "parameter", "state", "constant", "reshape"))
    before, after = run_both(g, fused, m, shape, seed=1)
    np.testing.assert_allclose(after.outputs["loss"], before.outputs["loss"], rtol=1e-6)
    for k in before.updates:
        np.testing.assert_allclose(after.updates[k], before.updates[k], rtol=1e-5, atol=1e-7, err_msg=k)


def test_fusion_is_deterministic():
    g = train_graph(mlp(), (16, 784))
    assert ir.format_graph(fuse(g)) == ir.format_graph(fuse(g))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_constant_operand_of_a_one_by_one_matmul_stays_an_operand(device):
    """A batch of one row makes the weight gradient a 1x1 matmul of the mean's constant cotangent:
    a scalar-sized constant, which fusion copies into generated bodies, must still be an operand
    of the matmul template (it was dropped: KeyError in fusion's kernel plan)."""
    import numpy as np

    from ember.frontends import functional as F
    from ember.frontends import nn, optim, plan
    from ember.runtime import target

    model = nn.Linear(1, 1, bias=False)
    graphs = plan(model, lambda out, _: F.mean(out), optim.SGD(lr=0.1),
                  (np.ones((1, 1), np.float32), np.zeros(1, np.int64)), device=device)
    for graph in graphs.values():
        assert target(device).source(graph)
