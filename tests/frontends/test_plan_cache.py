"""The plan cache (frontends/plan_cache.py): a second compile of the same trace loads the planned
graph and source instead of running the passes, and anything the plan depends on changes the key."""
from __future__ import annotations

import numpy as np
import pytest

from ember.codegen import tuning_db
from ember.frontends import compile as ember_compile
from ember.frontends import nn, optim, plan_cache, trace
from ember.frontends.optim import as_config
from ember.frontends.tracing import example_type
from ember.passes.pipeline import train_passes
from ember.runtime import target


@pytest.fixture(autouse=True)
def _cache_on(monkeypatch, tmp_path):
    monkeypatch.setenv("EMBER_PLAN_CACHE", "1")
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))


class Scaled(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 5)
        self.scale = scale

    def forward(self, x):
        return self.fc(x * self.scale)


def _data():
    rng = np.random.default_rng(0)
    return rng.standard_normal((8, 12)).astype(np.float32), rng.integers(0, 5, 8)


def _compile(model, lr=0.1, **kw):
    x, y = _data()
    return ember_compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=lr), (x, y), **kw)


def _losses(step, n=3):
    x, y = _data()
    return [step(x, y) for _ in range(n)]


def _fresh(scale=1.0):
    nn.manual_seed(0)
    return Scaled(scale)


def test_a_second_compile_loads_the_plan_and_trains_identically():
    first = _compile(_fresh())
    assert first.compile_stats["plan_cached"] is False
    second = _compile(_fresh())
    assert second.compile_stats["plan_cached"] is True and second.compile_stats["render_s"] == 0.0
    assert _losses(first) == _losses(second)
    # the cached step trains the model it was compiled for (its live parameters, not pickled copies)
    model = _fresh()
    step = _compile(model)
    before = model.fc.weight.data.copy()
    _losses(step, 1)
    assert not np.array_equal(before, model.fc.weight.data)


def test_what_the_plan_depends_on_changes_the_key():
    _compile(_fresh())
    assert _compile(_fresh(), lr=0.2).compile_stats["plan_cached"] is False      # the optimizer
    assert _compile(_fresh(2.0)).compile_stats["plan_cached"] is False          # a constant's value
    nn.manual_seed(0)
    other = _compile(nn.Sequential(nn.Linear(12, 5)))                           # the graph
    assert other.compile_stats["plan_cached"] is False
    assert _compile(_fresh(2.0)).compile_stats["plan_cached"] is True


def test_a_compile_inside_force_does_not_take_a_plan_chosen_without_it():
    """`force` (experiments, comparisons) changes the kernels' families: a plan cached by an
    unforced compile of the same model must not serve it, nor its plan serve a later unforced one."""
    from ember.codegen import cpp_choices
    plain = _compile(_fresh())
    with cpp_choices.force(matmul="matmul_axpy"):
        forced = _compile(_fresh())
        assert forced.compile_stats["plan_cached"] is False
        assert _compile(_fresh()).compile_stats["plan_cached"] is True   # the same force: its own entry
    assert _compile(_fresh()).compile_stats["plan_cached"] is True       # the unforced entry again
    assert _losses(plain) == pytest.approx(_losses(forced), rel=1e-5)


def test_a_damaged_entry_is_a_miss_and_a_dump_bypasses_the_cache(tmp_path):
    _compile(_fresh())
    for entry in (tmp_path / "cache" / "plans").rglob("*.pkl"):
        entry.write_bytes(b"not a pickle")
    step = _compile(_fresh())
    assert step.compile_stats["plan_cached"] is False and np.all(np.isfinite(_losses(step)))
    dumped = _compile(_fresh(), dump_dir=tmp_path / "dump")
    assert dumped.compile_stats["plan_cached"] is False
    assert (tmp_path / "dump").is_dir()


def test_the_tuning_database_and_the_device_take_part_in_the_key(tmp_path):
    x, y = _data()
    model = _fresh()
    forward = trace(lambda a, b: nn.CrossEntropyLoss()(model(a), b), example_type(x), example_type(y))
    cuda = target("cuda")
    passes = train_passes(as_config(optim.SGD(lr=0.1))) + cuda.passes()
    keys = set()
    for db in (None, tuning_db.TuningDB(tmp_path / "a"), tuning_db.TuningDB(tmp_path / "b")):
        with tuning_db.using(db):
            keys.add(plan_cache.step_key(forward, passes, target=cuda, device="NVIDIA H200", profile=False))
    assert len(keys) == 2  # no database vs an empty one differ; two empty ones are the same
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "cuda-nvidia-h200.json").write_text("{}")
    with tuning_db.using(tuning_db.TuningDB(tmp_path / "b")):
        keys.add(plan_cache.step_key(forward, passes, target=cuda, device="NVIDIA H200", profile=False))
        keys.add(plan_cache.step_key(forward, passes, target=cuda, device="NVIDIA A100", profile=False))
        keys.add(plan_cache.step_key(forward, passes, target=cuda, device="NVIDIA A100", profile=True))
    assert len(keys) == 5


def test_the_target_is_told_where_a_steps_kernels_come_from(monkeypatch):
    """`Target.prepare_build` (CUDA starts its NVRTC workers there unless those kernels were all
    built ahead) gets no sources for a step planned afresh, the cached plan's source for a cached
    plan, and the compiled steps' sources for a later batch size that takes their plans."""
    import dataclasses

    from ember.passes import targets
    prepared = []
    cpu = targets.get("cpu")
    monkeypatch.setitem(targets._TARGETS, "cpu", dataclasses.replace(
        cpu, prepare_build=lambda graph, sources: prepared.append((graph.name, sources))))
    first = _compile(_fresh())
    assert first.compile_stats["plan_cached"] is False and prepared == [("train_step", ())]
    step = _compile(_fresh())
    assert step.compile_stats["plan_cached"] is True and len(prepared) == 2
    (_, executor), = step._steps.values()
    assert prepared[1][1] == (executor.source,) and executor.source is not None
    x, _ = _data()
    step.precompile((x.shape[0] - 1, *x.shape[1:]))
    assert len(prepared) == 3 and prepared[2][1] == (executor.source,)
