"""The tuner loop (runtime/tuner.py) with a fake measurer, no compiler or device: it stores the
fastest candidate whose result matches the reference (the cost model's choice), refuses one that
differs beyond rounding or is not finite, reuses what the database holds (the measurer is then not
even built), measures a kernel key once per run, and stops starting kernels when its budget is
spent. The graphs are the cpu target's (`cpp_choices`), planned without compiling."""
from __future__ import annotations

import numpy as np
import pytest

from ember.codegen import cpp_choices, tuning_db
from ember.codegen.tuning_db import TuningDB, choice_text
from ember.frontends import nn, optim, plan
from ember.runtime.tuner import Trial, kernels_of, tune_graph


def _graph(model=None, x_shape=(8, 20), db=None):
    """The training graph planned for the cpu target, its kernels chosen from `db` (None: the cost model)."""
    nn.manual_seed(0)
    model = model or nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16),
                                   nn.ReLU(), nn.Linear(16, 4))
    example = (np.zeros(x_shape, np.float32), np.zeros(x_shape[0], np.int64))
    with tuning_db.using(db):
        return next(iter(plan(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example, device="cpu").values()))


def _tunable(graph):
    return [(s, k) for s, k in kernels_of(graph) if k.kind != "collective" and len(cpp_choices.candidates(s, k)) > 1]


class Fake:
    """Candidate i of a kernel takes 100 - i microseconds (the last is fastest) and returns the same
    result as the others, except where `wrong` (choice -> result transform) says otherwise."""
    built = 0

    def __init__(self, wrong=None):
        type(self).built += 1
        self.calls: list[str] = []
        self.wrong = wrong or {}

    def measure(self, sub, spec, choices, *, seed=0):
        self.calls.append(sub.name)
        ref = np.random.default_rng(seed).standard_normal(7).astype(np.float32)
        out = []
        for i, c in enumerate(choices):
            result = self.wrong.get(c, lambda r: r)(ref.copy())
            out.append(Trial(c, 100.0 - i, result))
        return out


def _tune(graph, db, measurer, **kw):
    return tune_graph(graph, table=cpp_choices.TABLE, measurer=measurer, db=db, **kw)


def test_the_fastest_candidate_is_stored_and_select_takes_it(tmp_path):
    g = _graph()
    db = TuningDB(tmp_path)
    fake = Fake()
    report = _tune(g, db, fake)
    tunable = _tunable(g)
    keys = {cpp_choices.TABLE.key(s, k) for s, k in tunable}
    assert report.measured == len(keys) and len(fake.calls) == len(keys)
    records = db.records("cpu", cpp_choices.device_name())
    assert set(records) == keys
    for sub, spec in tunable:
        cands = cpp_choices.candidates(sub, spec)
        rec = records[cpp_choices.TABLE.key(sub, spec)]
        assert rec.choice == cands[-1] and rec.time_us == 100.0 - (len(cands) - 1)
        assert rec.versions == cpp_choices.TABLE.versions(sub, spec)
    tuned = _graph(db=db)
    for sub, spec in _tunable(tuned):
        assert spec.choice == cpp_choices.candidates(sub, spec)[-1] and spec.why.startswith("tuned (user)")


def test_a_second_run_reuses_the_database_without_building_a_measurer(tmp_path):
    g = _graph()
    db = TuningDB(tmp_path)
    _tune(g, db, Fake())
    Fake.built = 0
    report = _tune(g, db, Fake)  # a factory: built only when something must be measured
    assert Fake.built == 0 and report.measured == 0 and report.reused == len(report.kernels) > 0
    again = Fake()
    assert _tune(g, db, again, retune=True).measured > 0 and again.calls


def test_a_kernel_key_is_measured_once_per_run(tmp_path):
    fake = Fake()
    report = _tune(_graph(), TuningDB(tmp_path), fake)
    statuses = {}
    for k in report.kernels:
        statuses.setdefault(k.key, []).append(k.status)
    assert any(len(s) > 1 for s in statuses.values())  # the 16x16 layers share kernels
    assert all(s[0] == "measured" and set(s[1:]) <= {"reused"} for s in statuses.values())
    assert len(fake.calls) == len(statuses)


def test_a_candidate_whose_result_differs_or_is_not_finite_is_refused(tmp_path):
    g = _graph()
    sub, spec = _tunable(g)[0]
    cands = cpp_choices.candidates(sub, spec)
    wrong = {cands[-1]: lambda r: r + 1e-2 * np.abs(r).max(), cands[-2]: lambda r: np.where(r > 0, np.nan, r)}
    db = TuningDB(tmp_path)
    _tune(g, db, Fake(wrong))
    rec = db.records("cpu", cpp_choices.device_name())[cpp_choices.TABLE.key(sub, spec)]
    assert rec.choice == cands[-3]
    assert "differs from the reference by 1.0e-02" in rec.rejected[choice_text(cands[-1])]
    assert "non-finite" in rec.rejected[choice_text(cands[-2])]
    assert choice_text(cands[-1]) not in rec.timings_us
    # rounding-sized differences pass
    ok = TuningDB(tmp_path / "ok")
    _tune(g, ok, Fake({cands[-1]: lambda r: r * (1 + 1e-6)}))
    assert ok.records("cpu", cpp_choices.device_name())[cpp_choices.TABLE.key(sub, spec)].choice == cands[-1]


def test_no_candidate_that_runs_is_an_error(tmp_path):
    class Broken(Fake):
        def measure(self, sub, spec, choices, *, seed=0):
            return [Trial(c, error="compile: boom") for c in choices]
    with pytest.raises(RuntimeError, match="no candidate ran: .*compile: boom"):
        _tune(_graph(), TuningDB(tmp_path), Broken())


def test_the_budget_stops_starting_kernels(tmp_path):
    db = TuningDB(tmp_path)
    report = _tune(_graph(), db, Fake(), budget_s=1e-9)
    assert report.measured == 0 and report.out_of_budget == len(report.kernels) > 0
    assert db.records("cpu", cpp_choices.device_name()) == {}
    # resumable: the next run measures what was left
    assert _tune(_graph(), db, Fake()).measured > 0


def test_tuning_needs_a_writable_database():
    with pytest.raises(ValueError, match="writable tuning database"):
        _tune(_graph(), TuningDB(None), Fake())
