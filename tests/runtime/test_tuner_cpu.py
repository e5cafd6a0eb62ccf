"""The CPU tuner (runtime/tuner_cpu.py): candidates built, run and timed on this CPU.

Every family's candidates (a sample of the tuning plans of each kernel of small networks: odd
sizes, strides 1-3, padding, pooling) give the NumPy interpreter's result; the tuner on a small
model stores a winner, reuses it without measuring, refuses a candidate whose result was
corrupted, and keeps to its budget; `compile(..., device="cpu", tune=...)` tunes, then reuses."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

from ember import ir
from ember.codegen import cpp_choices, tuning_db
from ember.codegen.tuning_db import TuningDB, choice_text
from ember.frontends import compile, nn, optim, plan
from ember.runtime.tuner import kernels_of, tune_graph
from ember.runtime.tuner_cpu import CpuMeasurer

#: candidates measured per kernel: the first of each (family, mode), then random others up to this
PER_KERNEL = 5


def _graph(model, x_shape, db=None):
    example = (np.zeros(x_shape, np.float32), np.zeros(x_shape[0], np.int64))
    with tuning_db.using(db):
        return next(iter(plan(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example, device="cpu").values()))


def _net(seed: int):
    rng = random.Random(seed)
    c, o = rng.choice([1, 3]), rng.choice([5, 13])
    k, s, p = rng.choice([1, 3, 5]), [1, 2, 3][seed % 3], rng.randint(0, 2)
    h = rng.choice([9, 11, 17])
    ho = (h + 2 * p - k) // s + 1
    nn.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(c, o, k, stride=s, padding=p), nn.ReLU(), nn.Conv2d(o, 6, 3, padding=1),
                          nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(6 * (ho // 2) ** 2, 7), nn.ReLU(),
                          nn.Linear(7, 10))
    return model, (rng.choice([1, 2, 3]), c, h, h)


def _sample(cands, rng: random.Random) -> list:
    firsts = list({(f, dict(p).get("mode")): (f, p) for f, p in reversed(cands)}.values())
    rest = [c for c in cands if c not in firsts]
    extra = rng.sample(rest, max(0, min(len(rest), PER_KERNEL - len(firsts))))
    return list(dict.fromkeys([cands[0], *firsts, *extra]))


def _reduction_length(g: dict) -> int:
    if g["kind"] in ("conv2d", "conv2d_grad_input"):
        return (g["C"] if g["kind"] == "conv2d" else g["O"]) * g["KH"] * g["KW"]
    if g["kind"] == "conv2d_grad_weight":
        return g["N"] * g["HO"] * g["WO"]
    return g["K"] if g["kind"] == "matmul" else 1


@pytest.mark.parametrize("seed", range(3))
def test_every_family_candidate_matches_the_interpreter(seed):
    model, x_shape = _net(seed)
    graph = _graph(model, x_shape)
    rng = random.Random(seed)
    measurer = CpuMeasurer(rounds=1, target_s=0.0)
    seen, families = set(), set()
    for sub, spec in kernels_of(graph):
        if spec.kind not in cpp_choices.TEMPLATED or (key := cpp_choices.TABLE.key(sub, spec)) in seen:
            continue
        seen.add(key)
        choices = _sample(cpp_choices.candidates(sub, spec), rng)
        ref = ir.run(sub, measurer.inputs(sub, seed=seed)).outputs["out"].astype(np.float64)
        r = _reduction_length(cpp_choices.geometry(sub, spec))
        atol = 1e-5 * math.sqrt(r) * max(1.0, float(np.abs(ref).max()) / math.sqrt(r))
        for trial in measurer.measure(sub, spec, choices, seed=seed):
            what = f"{sub.name} ({spec.describe()}) {choice_text(trial.choice)}"
            assert trial.error is None and trial.time_us > 0, (what, trial.error)
            np.testing.assert_allclose(trial.output, ref, rtol=1e-4, atol=atol, err_msg=what)
            families.add((trial.choice[0], dict(trial.choice[1]).get("mode")))
    assert {"conv_forward", "conv_grad_input", "conv_grad_weight", "matmul_dot", "matmul_axpy", "pool"} <= \
        {f for f, _ in families}
    # the second convolution is stride 1: its grad-input's three modes (ReLU's mask as epilogue)
    assert {("conv_grad_input", m) for m in ("flat", "generic", "scatter")} <= families
    assert {("conv_forward", "generic"), ("conv_grad_weight", "generic")} <= families


# --------------------------------------------------------------------------- the tuner on a small model

def _small():
    nn.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 5), nn.ReLU(), nn.Linear(5, 3)), (6, 12)


class Corrupting(CpuMeasurer):
    """Measures for real, but one non-reference candidate of each kernel returns a wrong result
    and claims to be the fastest: the tuner must refuse it."""
    planted: list = []

    def measure(self, sub, spec, choices, *, seed=0):
        trials = super().measure(sub, spec, choices, seed=seed)
        bad = trials[-1]
        bad.output = bad.output + 0.01 * np.abs(bad.output).max()
        bad.time_us = 1e-3
        type(self).planted.append(bad.choice)
        return trials


def test_the_cpu_tuner_stores_the_fastest_right_candidate_and_reuses_it(tmp_path):
    model, x_shape = _small()
    graph = _graph(model, x_shape)
    db = TuningDB(tmp_path)
    Corrupting.planted = []
    report = tune_graph(graph, table=cpp_choices.TABLE, measurer=lambda: Corrupting(rounds=2, target_s=1e-3), db=db)
    assert report.measured >= 2 and Corrupting.planted
    records = db.records("cpu", cpp_choices.device_name())
    for k in report.kernels:
        rec = records[k.key]
        assert k.status in ("measured", "reused") and rec.choice == k.choice
        assert len(rec.timings_us) >= 2 and rec.time_us == min(rec.timings_us.values())
        refused = [c for c in Corrupting.planted if choice_text(c) in rec.rejected]
        assert refused and "differs from the reference" in rec.rejected[choice_text(refused[0])]
        assert rec.choice not in Corrupting.planted
    # a second run measures nothing: the factory is never called
    again = tune_graph(graph, table=cpp_choices.TABLE, measurer=lambda: pytest.fail("measured again"), db=db)
    assert again.measured == 0 and again.reused == len(report.kernels)
    tuned = _graph(model, x_shape, db=db)
    chosen = {cpp_choices.TABLE.key(s, k): k for s, k in kernels_of(tuned)}
    for k in report.kernels:
        assert chosen[k.key].choice == k.choice and chosen[k.key].why.startswith("tuned (user)")


def test_the_cpu_tuner_keeps_to_its_budget(tmp_path):
    model, x_shape = _small()
    db = TuningDB(tmp_path)
    report = tune_graph(_graph(model, x_shape), table=cpp_choices.TABLE, measurer=CpuMeasurer, db=db, budget_s=1e-9)
    assert report.measured == 0 and report.out_of_budget == len(report.kernels) > 0
    assert db.records("cpu", cpp_choices.device_name()) == {}


def test_compile_tunes_on_the_cpu_then_reuses(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))  # the default database lives under the cache
    model, x_shape = _small()
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal(x_shape).astype(np.float32), rng.integers(0, 3, x_shape[0])
    with tuning_db.using(None):
        reference = compile(_small()[0], nn.CrossEntropyLoss(), optim.SGD(lr=0.1), (x, y), device="cpu")
    step = compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), (x, y), device="cpu", tune=600)  # wall time: a starved machine took 19 s
    (report,) = step.tune_reports
    assert report.measured >= 2 and report.out_of_budget == 0
    assert (tmp_path / "tuning").is_dir()
    for _ in range(3):
        np.testing.assert_allclose(step(x, y), reference(x, y), rtol=1e-5)
    nn.manual_seed(0)
    again = compile(_small()[0], nn.CrossEntropyLoss(), optim.SGD(lr=0.1), (x, y), device="cpu", tune=True)
    assert again.tune_reports[0].measured == 0 and again.tune_reports[0].reused == len(report.kernels)


def test_bf16_candidates_match_the_interpreter_and_are_keyed_apart(tmp_path):
    """precision="bf16": each bfloat16 contraction's candidates (tile heights and widths) run on
    bfloat16 bits and give the interpreter's result within one bfloat16 step; their database key
    names the dtype and the product path, so float32 records never serve them."""
    model, x_shape = _net(1)
    example = (np.zeros(x_shape, np.float32), np.zeros(x_shape[0], np.int64))
    with tuning_db.using(None):
        graph = next(iter(plan(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example, device="cpu",
                               precision="bf16").values()))
    measurer = CpuMeasurer(rounds=1, target_s=0.0)
    kinds = set()
    for sub, spec in kernels_of(graph):
        if spec.kind not in cpp_choices.TEMPLATED or spec.kind.startswith("max_pool"):
            continue
        g = cpp_choices.geometry(sub, spec)
        assert g["dtype"] == "bfloat16" and g["bf16_dot"] in ("emulated", "avx512bf16", "amx")
        assert '"dtype":"bfloat16"' in cpp_choices.TABLE.key(sub, spec)
        choices = cpp_choices.candidates(sub, spec)
        assert {f for f, _ in choices} == {"bf16"} and len(choices) > 1
        ref = ir.run(sub, measurer.inputs(sub)).outputs["out"].astype(np.float64)
        step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(ref), 1e-30))) - 7)
        for trial in measurer.measure(sub, spec, choices):
            assert trial.error is None, trial.error
            assert np.all(np.abs(trial.output - ref) <= step + 1e-6 * np.abs(ref).max()), choice_text(trial.choice)
        kinds.add(spec.kind)
    assert kinds == {"conv2d", "conv2d_grad_input", "conv2d_grad_weight", "matmul"}


def test_cpu_time_measures_the_same_kernel():
    """CpuMeasurer(cpu_time=True) times by the process's CPU time over the threads (for shared
    machines): positive times, the same outputs as the wall-clock measurer's."""
    model, x_shape = _net(1)
    example = (np.zeros(x_shape, np.float32), np.zeros(x_shape[0], np.int64))
    with tuning_db.using(None):
        graph = next(iter(plan(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example, device="cpu").values()))
    sub, spec = next((s, k) for s, k in kernels_of(graph) if k.kind == "conv2d")
    wall, cpu = (CpuMeasurer(rounds=2, target_s=0.001, cpu_time=c).measure(sub, spec, [spec.choice])[0]
                 for c in (False, True))
    assert wall.error is None and cpu.error is None and cpu.time_us > 0
    assert np.array_equal(wall.output, cpu.output)


def test_a_kernel_of_several_outputs_is_measured_with_every_output():
    """LayerNorm's weight and bias gradients (and their updates) are one reduction of several
    outputs: the measurer makes, poisons and reads each, and each matches the interpreter."""
    nn.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 24), nn.LayerNorm(24), nn.ReLU(), nn.Linear(24, 7))
    graph = _graph(model, (37, 20))
    multi = [(sub, spec) for sub, spec in kernels_of(graph) if len(sub.outputs) > 1 and spec.kind == "reduction"]
    assert multi
    measurer = CpuMeasurer()
    for sub, spec in multi:
        (trial,) = measurer.measure(sub, spec, cpp_choices.candidates(sub, spec)[:1])
        assert trial.error is None and trial.time_us > 0, trial.error
        want = ir.run(sub, CpuMeasurer.inputs(sub)).outputs
        assert isinstance(trial.output, tuple) and len(trial.output) == len(want)
        for got, (name, ref) in zip(trial.output, want.items()):
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5, err_msg=f"{sub.name} {name}")
