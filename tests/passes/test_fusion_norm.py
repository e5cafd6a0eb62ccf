"""Fusion of normalisation layers (passes/fusion_recompute.py, passes/fusion_multi.py): a
BatchNorm's forward is one statistics kernel and one normalise kernel, its backward one reduction
kernel with several outputs and one pointwise kernel; LayerNorm alike; the values are those of
the graph before fusion (the interpreter runs both); ResNet-8's step stays under 90 kernels on
every target that compiles kernels."""
from __future__ import annotations

import numpy as np
import pytest

from ember import ir
from ember.frontends import functional as F
from ember.frontends import nn
from ember.passes.fusion import fuse, kernel_counts
from ember.passes.memory import check_plan
from ember.passes.targets import FusionCaps

from models import params_of, plan_for, train_graph

MULTI = FusionCaps(multi_output=True)


class ConvBnRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(4, 4, 3, 1, 1)
        self.fc = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x):
        return self.fc(F.flatten(self.conv2(self.relu(self.bn(self.conv1(x)))), 1))


class LinearLn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 24)
        self.ln = nn.LayerNorm(24)
        self.fc2 = nn.Linear(24, 10)

    def forward(self, x):
        return self.fc2(F.relu(self.ln(self.fc1(x))))


def _kernels(g: ir.Graph, scope: str) -> list[int]:
    """The fused nodes computing anything of module `scope` (forward or backward)."""
    return [n for n in g.g if g.op(n) == "fused"
            and any(s.scope(m) == scope for s in [g.attrs(n)["graph"]] for m in s.g)]


def _holding(g: ir.Graph, scope: str, op: str, backward: bool) -> list[int]:
    """The fused nodes holding an `op` node of module `scope`, forward or backward."""
    return [n for n in _kernels(g, scope) if any(
        s.op(m) == op and s.scope(m) == scope and s.is_backward(m) == backward
        for s in [g.attrs(n)["graph"]] for m in s.g)]


def _writer(g: ir.Graph, n: int) -> int:
    """The kernel that computes node n (itself, or the kernel a fused_output reads)."""
    return g.operands(n)[0] if g.op(n) == "fused_output" else n


def _states(model: nn.Module) -> dict[str, np.ndarray]:
    params = params_of(model)
    return {k: v for k, v in model.state_dict().items() if k not in params}


def _same_values(before: ir.Graph, after: ir.Graph, model: nn.Module, x_shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(1)
    inputs = {"x": rng.standard_normal(x_shape).astype(np.float32), "y": rng.integers(0, 10, x_shape[0])}
    want = ir.run(before, inputs, params_of(model), _states(model))
    got = ir.run(after, inputs, params_of(model), _states(model))
    # recomputing a value or moving it into another kernel evaluates the same ops in the same order
    for k in want.outputs:
        np.testing.assert_array_equal(got.outputs[k], want.outputs[k], err_msg=k)
    for k in want.updates:
        np.testing.assert_array_equal(got.updates[k], want.updates[k], err_msg=k)


def test_batch_norm_is_two_kernels_forward_and_two_backward():
    nn.manual_seed(0)
    model = ConvBnRelu()
    g = train_graph(model, (6, 1, 8, 8))
    fused = fuse(g, MULTI)
    (stats,) = _holding(fused, "bn", "sum", backward=False)  # mean and variance: one kernel, two passes
    (grads,) = _holding(fused, "bn", "sum", backward=True)   # every sum of the backward pass: one kernel
    assert fused.attrs(stats)["kernel"].kind == fused.attrs(grads)["kernel"].kind == "reduction"
    assert {_writer(fused, fused.updates[k]) for k in ("bn.running_mean", "bn.running_var")} == {stats}
    assert {_writer(fused, fused.updates[k]) for k in ("bn.weight", "bn.bias")} == {grads}
    others = [n for n in _kernels(fused, "bn") if n not in (stats, grads)]
    kinds = sorted((fused.attrs(n)["kernel"].kind, any(fused.attrs(n)["graph"].is_backward(m)
                                                       for m in fused.attrs(n)["graph"].g)) for n in others)
    # forward: the normalisation (with the ReLU) and the step counter; backward: the input's gradient
    assert kinds == [("pointwise", False), ("pointwise", False), ("pointwise", True)]
    _same_values(g, fused, model, (6, 1, 8, 8))


def test_without_multi_output_kernels_batch_norm_still_recomputes():
    nn.manual_seed(0)
    g = train_graph(ConvBnRelu(), (6, 1, 8, 8))
    single, stored = fuse(g), fuse(g, FusionCaps(recompute=False))
    assert all(len(single.attrs(n)["graph"].outputs) == 1 for n in single.g if single.op(n) == "fused")
    assert len(_kernels(single, "bn")) < len(_kernels(stored, "bn"))
    assert sum(kernel_counts(fuse(g, MULTI)).values()) < sum(kernel_counts(single).values())


def test_layer_norm_statistics_and_gradients_share_kernels():
    nn.manual_seed(0)
    model = LinearLn()
    g = train_graph(model, (16, 12))
    fused = fuse(g, MULTI)
    assert len(_holding(fused, "ln", "sum", backward=False)) == 1  # mean and variance of each row
    # the rows' sums (one kernel, two passes) and the parameters' gradients (over the rows: another
    # domain, one kernel for weight and bias together, their updates as its outputs)
    backward = _holding(fused, "ln", "sum", backward=True)
    assert len(backward) == 2
    assert {_writer(fused, fused.updates[k]) for k in ("ln.weight", "ln.bias")} < set(backward)
    _same_values(g, fused, model, (16, 12))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_planned_batch_norm_updates_in_place_where_no_later_kernel_reads_them(device):
    nn.manual_seed(0)
    planned = plan_for(train_graph(ConvBnRelu(), (6, 1, 8, 8)), device)
    check_plan(planned)
    in_place = {k for k, n in planned.updates.items() if planned.notes(n).get("storage") in ("parameter", "state")
                and planned.notes(n).get("name") == k}
    # the backward's input-gradient kernel reads bn.weight after the kernel that computes its update
    assert {"bn.running_mean", "bn.running_var", "bn.bias", "bn.num_batches_tracked"} <= in_place
    assert "bn.weight" not in in_place
    position = {n: i for i, n in enumerate(planned.meta["schedule"])}
    for n in planned.g:  # a further output is written while its kernel runs: live from then on
        if planned.op(n) == "fused_output" and n in planned.meta["liveness"]:
            assert planned.meta["liveness"][n][0] == position[planned.operands(n)[0]]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_resnet8_step_is_at_most_90_kernels(device):
    from ember.frontends import plan
    from ember.frontends.training.recipes import build_model, make_optimizer
    graphs = plan(build_model("resnet8"), nn.CrossEntropyLoss(), make_optimizer("sgd", 0.05),
                  (np.zeros((64, 1, 28, 28), np.float32), np.zeros(64, np.int64)), device=device)
    (train,) = [g for k, g in graphs.items() if k.startswith("train")]
    # 229 (cpu) and 214 (cuda) before normalisation layers fused; an expert's step has about 70
    assert train.count("fused") <= 90, kernel_counts(train)
