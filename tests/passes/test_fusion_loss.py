"""The softmax cross-entropy region (passes/fusion_loss.py): found by provenance in the MNIST
training graphs, fused into two kernels only for a target that asks, the interpreter's values
unchanged by that fusion, and a loss that is not the mean softmax cross-entropy left alone."""
from __future__ import annotations

import numpy as np
import pytest

from ember import ir
from ember.frontends import functional as F
from ember.frontends import nn, spec, trace
from ember.passes.fusion import fuse, kernel_counts
from ember.passes.fusion_loss import find_loss_region
from ember.passes.optimizer import SGD
from ember.passes.pipeline import build_train_graph
from ember.passes.simplify import simplify
from ember.passes.targets import FusionCaps

from models import cnn, mlp, run_both

LOSS_CAPS = FusionCaps(kinds=FusionCaps().kinds | {"softmax_xent", "softmax_xent_grad"}, loss_kernels=True)


def _train_graph(model, x_shape, loss_module):
    fwd = trace(lambda x, y: loss_module(model(x), y), spec(x_shape), spec((x_shape[0],), "int64"), modules={"": model})
    return simplify(build_train_graph(fwd, SGD(lr=0.05)))


class ScaledLoss(nn.Module):
    """A multiple of the cross-entropy: the same primitives, another function."""

    def __init__(self, scale: float = 2.0) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, logits, labels):
        return F.cross_entropy(logits, labels) * self.scale


@pytest.mark.parametrize("model,shape", [(mlp, (16, 784)), (cnn, (4, 1, 28, 28))])
def test_the_loss_region_becomes_two_kernels_with_the_same_values(model, shape):
    m = model()
    g = _train_graph(m, shape, nn.CrossEntropyLoss())
    region = find_loss_region(g)
    assert region is not None and region.loss == g.outputs["loss"]
    assert g.type(region.grad) == g.type(region.logits) == ir.TensorType((shape[0], 10))
    fused = fuse(g, LOSS_CAPS)
    counts = kernel_counts(fused)
    assert counts["softmax_xent"] == 1 and counts["softmax_xent_grad"] == 1
    # thirteen generic kernels (each value stored, the gradient's -1/N broadcast over the batch
    # included: nothing recomputed) became two
    generic = fuse(g, FusionCaps(recompute=False))
    assert sum(counts.values()) == sum(kernel_counts(generic).values()) - 11
    before, after = run_both(g, fused, m, shape, seed=0)
    assert before.outputs["loss"] == after.outputs["loss"]
    for k in before.updates:
        np.testing.assert_array_equal(before.updates[k], after.updates[k])


def test_a_target_that_does_not_ask_keeps_the_generic_kernels():
    g = _train_graph(mlp(), (16, 784), nn.CrossEntropyLoss())
    assert "softmax_xent" not in kernel_counts(fuse(g))


# 1.005 and 0.995: within a loose check's 1e-2, far outside float32 rounding (the region check's 1e-4)
@pytest.mark.parametrize("scale", [2.0, 1.005, 0.995])
def test_another_loss_with_the_same_primitives_is_not_matched(scale):
    g = _train_graph(mlp(), (16, 784), ScaledLoss(scale))
    assert find_loss_region(g) is None
    assert "softmax_xent" not in kernel_counts(fuse(g, LOSS_CAPS))


def test_under_data_parallel_the_loss_all_reduce_stays_outside_the_loss_kernel():
    # the logged loss is all_reduce(mean) of the local loss, in the loss's scope: the loss kernel
    # must feed it, not swallow it (every rank would log its own shard's loss)
    from ember.passes.data_parallel import data_parallel
    g = data_parallel(_train_graph(mlp(), (16, 784), nn.CrossEntropyLoss()), 2)
    out = g.outputs["loss"]
    assert g.op(out) == "all_reduce"
    region = find_loss_region(g)
    assert region is not None and region.loss == g.operands(out)[0] and out not in region.members
    fused = fuse(g, LOSS_CAPS)
    counts = kernel_counts(fused)
    assert counts["softmax_xent"] == 1 and counts["collective"] == 1 + len(g.meta["buckets"][0]["nodes"])
    loss = fused.outputs["loss"]
    assert fused.attrs(loss)["kernel"].kind == "collective"
    assert fused.attrs(fused.operands(loss)[0])["kernel"].kind == "softmax_xent"
