"""The target registry: a new backend is one record. A toy target registered here (the CPU
executor behind a fusion that may not fold epilogues into contractions, and a 256-byte buffer
alignment) compiles and trains a step, and everything derived from the registry sees it."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import ember.runtime
from ember.frontends import compile, nn, optim
from ember.frontends.cli import build_parser
from ember.passes import pipeline, targets
from ember.passes.fusion import kernel_counts

from models import mlp

TOY = "toy"


@pytest.fixture
def toy_target():
    cpu = ember.runtime.target("cpu")
    record = dataclasses.replace(cpu, name=TOY, description="CPU kernels without contraction epilogues",
                                 fusion=targets.FusionCaps(epilogues={}), alignment=256, pipeline=pipeline.kernels)
    targets.register(record)
    yield record
    targets.unregister(TOY)


def test_a_registered_toy_target_compiles_and_trains_a_step(toy_target):
    rng = np.random.default_rng(0)
    x = rng.random((16, 784), dtype=np.float32)
    y = rng.integers(0, 10, 16)
    toy = compile(mlp(), nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example_inputs=(x, y), device=TOY)
    ref = compile(mlp(), nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example_inputs=(x, y), device="reference")
    for _ in range(3):
        np.testing.assert_allclose(toy(x, y), ref(x, y), rtol=1e-5)
    graph = toy.train_graph
    # the record's data reached the passes: no bias/ReLU epilogue was fused, buffers are 256-aligned
    assert all(not graph.attrs(n)["kernel"].epilogues for n in graph.g if graph.op(n) == "fused")
    assert all(graph.notes(n)["offset"] % 256 == 0 for n in graph.meta["liveness"])
    cpu_graph = compile(mlp(), nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example_inputs=(x, y), device="cpu").train_graph
    # ... where the cpu target's own record folds them (a bias add the toy runs in a generated kernel)
    assert any(cpu_graph.attrs(n)["kernel"].epilogues for n in cpu_graph.g if cpu_graph.op(n) == "fused")
    assert kernel_counts(graph)["matmul"] == kernel_counts(cpu_graph)["matmul"]


def test_cli_device_choices_come_from_the_registry(toy_target):
    args = build_parser().parse_args(["mnist", "--device", TOY])
    assert args.device == TOY


def test_unknown_device_names_the_registered_ones():
    x, y = np.zeros((4, 784), np.float32), np.zeros(4, np.int64)
    with pytest.raises(ValueError, match=r"unknown device 'tpu'; available: reference, cpu"):
        compile(mlp(), nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example_inputs=(x, y), device="tpu")
