"""Stream placement of a CUDA step (runtime/cuda_streams.py), checked without a GPU on the planned
MNIST steps: every pair of kernels that touch overlapping memory (one of them writing) is
ordered, by the stream or by a wait; data dependencies are among them; and independent kernels
do land on other streams (the point of it)."""
from __future__ import annotations

import numpy as np
import pytest

from ember.frontends import nn, optim
from ember.frontends.compile import plan
from ember.frontends.training import build_model
from ember.runtime.cuda_streams import _overlap, dependencies, kernel_regions, place


def _cuda_train_graph(name: str, batch: int = 64):
    shape = (batch, 784) if name == "mlp" else (batch, 1, 28, 28)
    graphs = plan(build_model(name), nn.CrossEntropyLoss(), optim.SGD(lr=0.05),
                  (np.zeros(shape, np.float32), np.zeros(batch, np.int64)), device="cuda")
    return next(g for k, g in graphs.items() if k.startswith("train"))


def _ordered(placements, i: int, j: int) -> bool:
    """Whether kernel i is guaranteed to finish before kernel j starts (i < j)."""
    frontier, seen = [j], set()
    while frontier:
        k = frontier.pop()
        if k == i:
            return True
        if k in seen:
            continue
        seen.add(k)
        frontier += list(placements[k].waits)
        frontier += [m for m in range(k) if placements[m].stream == placements[k].stream][-1:]  # the stream's previous
    return False


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_every_memory_hazard_is_ordered_and_independent_kernels_spread(name):
    graph = _cuda_train_graph(name)
    kernels = [n for n in graph.meta["schedule"] if graph.op(n) == "fused"]
    placements = place(graph, kernels, streams=4)
    regions = kernel_regions(graph, kernels)
    for j in range(len(kernels)):
        for i in range(j):
            (r1, w1), (r2, w2) = regions[i], regions[j]
            hazard = any(_overlap(a, b) for a in w1 for b in r2 + w2) or any(_overlap(a, b) for a in r1 for b in w2)
            if hazard:
                assert _ordered(placements, i, j), f"kernels {i} and {j} touch the same memory but may overlap"
    deps = dependencies(graph, kernels)
    position = {n: k for k, n in enumerate(kernels)}
    for k, n in enumerate(kernels):
        for o in graph.operands(n):
            if o in position:
                assert position[o] in deps[k]
    assert len({p.stream for p in placements}) > 1


def test_one_stream_serialises_everything():
    graph = _cuda_train_graph("mlp")
    kernels = [n for n in graph.meta["schedule"] if graph.op(n) == "fused"]
    assert {p.stream for p in place(graph, kernels, streams=1)} == {0}
