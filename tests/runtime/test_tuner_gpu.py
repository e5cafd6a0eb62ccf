"""The CUDA tuner on a GPU: every candidate of every family builds, runs and agrees with the cost
model's choice (which agrees with the interpreter), and `compile(tune=...)` trains with the winners."""
from __future__ import annotations

import random

import numpy as np
import pytest

from ember.codegen import cuda_choices, tuning_db
from ember.codegen.tuning_db import TuningDB
from ember.frontends import compile as ember_compile
from ember.frontends import nn, optim, plan
from ember.ir import interpreter
from ember.runtime.tuner import TOLERANCE, kernels_of, tune_graph

pytestmark = pytest.mark.cuda


def _net(seed: int):
    rng = random.Random(seed)
    c, o = rng.choice([1, 3]), rng.choice([4, 16, 32])
    k, s, p = rng.choice([1, 3, 5]), rng.randint(1, 2), rng.randint(0, 2)
    h = rng.choice([13, 28])
    ho = (h + 2 * p - k) // s + 1
    nn.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(c, o, k, stride=s, padding=p), nn.ReLU(), nn.Conv2d(o, 8, 3, padding=1),
                          nn.ReLU(), nn.Flatten(), nn.Linear(8 * ho * ho, 10))
    return model, (rng.choice([3, 64, 256]), c, h, h)


@pytest.mark.parametrize("precision", ["float32", "tf32"])
@pytest.mark.parametrize("seed", range(3))
def test_every_candidate_runs_and_agrees_with_the_reference(tmp_path, seed, precision):
    from ember.runtime.tuner_cuda import CudaMeasurer
    model, shape = _net(seed)
    example = (np.zeros(shape, np.float32), np.zeros(shape[0], np.int64))
    db = TuningDB(tmp_path)
    measurer = CudaMeasurer()
    with tuning_db.using(db):
        graph = next(iter(plan(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example, device="cuda",
                               precision=precision).values()))
        report = tune_graph(graph, table=cuda_choices.TABLE, measurer=measurer, db=db, budget_s=300)
    assert report.measured > 0
    for k in report.kernels:
        assert not k.rejected, (k.name, k.rejected)
    # the reference (the cost model's choice) against the interpreter on the same inputs
    for sub, spec in kernels_of(graph):
        if spec.kind not in cuda_choices.CONVS + ("matmul",):
            continue
        first = cuda_choices.candidates(sub, spec)[0]
        trial = measurer.measure(sub, spec, [first], seed=0)[0]
        rng = np.random.default_rng(0)
        inputs = {name: rng.standard_normal(sub.type(n).shape).astype(np.float32) for name, n in sub.inputs.items()}
        ref = interpreter.run(sub, inputs, precision="float64").outputs["out"]
        err = np.max(np.abs(trial.output - ref)) / max(np.max(np.abs(ref)), 1e-30)
        assert err <= TOLERANCE[precision], (sub.name, spec.describe(), err)


def test_compile_with_tune_trains_with_the_measured_winners(tmp_path):
    model, shape = _net(1)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    y = np.arange(shape[0]) % 10
    db = TuningDB(tmp_path)
    with tuning_db.using(db):
        step = ember_compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.05), (x, y), device="cuda", tune=120)
        losses = [step(x, y) for _ in range(3)]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert step.tune_reports and step.tune_reports[0].measured > 0
    graph = step._example_step()[0]
    for sub, spec in kernels_of(graph):
        if len(cuda_choices.candidates(sub, spec)) > 1:
            assert spec.why.startswith("tuned"), (sub.name, spec.why)
