"""The autotuner's loop and the tuning database, without a GPU.

The cuda target's kernels are planned here (no GPU needed) and "measured" by a fake measurer: every
candidate's result is the reference interpreter's on the kernel's subgraph (so all agree), its
time a deterministic function of the choice, and chosen candidates can be corrupted. The loop
must store the fastest correct candidate, reuse the database on a second run, refuse a corrupted
candidate even when it is fastest, stop at its budget, and `select` must then take the stored
winner (and name it in the dump)."""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest

from ember.codegen import cuda_choices, tuning_db
from ember.codegen.tuning_db import Record, TuningDB, choice_text
from ember.frontends import nn, optim, plan
from ember.ir import format_graph, interpreter
from ember.runtime.tuner import Trial, kernels_of, tune_graph


def _fake_us(choice) -> float:
    return 1.0 + int(hashlib.sha256(choice_text(choice).encode()).hexdigest()[:6], 16) / 0xFFFFFF * 10.0


class FakeMeasurer:
    def __init__(self, corrupt=lambda sub, choice: False, fastest=None, slower=1.0):
        self.calls = 0
        self.corrupt, self.fastest, self.slower = corrupt, fastest, slower
        self.asked = []  # the candidates of each call

    def measure(self, sub, spec, choices, *, seed=0):
        self.calls += 1
        self.asked.append(list(choices))
        rng = np.random.default_rng(seed)
        inputs = {k: rng.standard_normal(sub.type(n).shape).astype(np.float32) for k, n in sub.inputs.items()}
        ref = interpreter.run(sub, inputs).outputs["out"]
        trials = []
        for c in choices:
            out = ref.copy()
            if self.corrupt(sub, c):
                out.reshape(-1)[: max(1, out.size // 4)] += 1.0  # a quarter of the outputs wrong
            t = 0.5 if self.fastest is not None and self.fastest(sub, c) else _fake_us(c) * self.slower
            trials.append(Trial(c, t, out))
        return trials


def _graph(batch=8, precision="float32"):
    nn.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 26 * 26, 10))
    example = (np.zeros((batch, 1, 28, 28), np.float32), np.zeros(batch, np.int64))
    return next(iter(plan(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example, device="cuda",
                          precision=precision).values()))


def _tunable(graph):
    return [(sub, spec) for sub, spec in kernels_of(graph)
            if spec.kind != "collective" and len(cuda_choices.candidates(sub, spec)) > 1]


def test_the_tuner_stores_the_fastest_candidate_and_select_takes_it(tmp_path):
    db = TuningDB(tmp_path)
    with tuning_db.using(db):
        graph = _graph()
        measurer = FakeMeasurer()
        report = tune_graph(graph, table=cuda_choices.TABLE, measurer=measurer, db=db, budget_s=60)
        tunable = _tunable(graph)
        assert tunable and report.measured == len({cuda_choices.TABLE.key(s, k) for s, k in tunable})
        data = json.loads((tmp_path / "cuda-nvidia-h200.json").read_text())
        assert data["schema"] == tuning_db.SCHEMA and len(data["records"]) == report.measured
        for sub, spec in tunable:
            rec = db.lookup("cuda", "NVIDIA H200", cuda_choices.TABLE.key(sub, spec), cuda_choices.TABLE.versions(sub, spec))
            cands = cuda_choices.candidates(sub, spec)
            assert rec.choice == min(cands, key=_fake_us)
            assert set(rec.timings_us) == {choice_text(c) for c in cands}
        # planned again: select stamps the stored winners and the dump says they were tuned
        again = _graph()
        for sub, spec in _tunable(again):
            assert spec.choice == min(cuda_choices.candidates(sub, spec), key=_fake_us)
            assert spec.why.startswith("tuned (user)")
        assert "(tuned (user):" in format_graph(again)
        assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_a_second_run_reuses_the_database_and_measures_nothing(tmp_path):
    db = TuningDB(tmp_path)
    with tuning_db.using(db):
        graph = _graph()
        tune_graph(graph, table=cuda_choices.TABLE, measurer=FakeMeasurer(), db=db)
        second = FakeMeasurer()
        report = tune_graph(_graph(), table=cuda_choices.TABLE, measurer=second, db=db)
        assert second.calls == 0 and report.measured == 0 and report.reused == len(report.kernels) > 0
        third = FakeMeasurer()
        assert tune_graph(graph, table=cuda_choices.TABLE, measurer=third, db=db, retune=True).measured > 0
        assert third.calls > 0


def _retune_after_editing_a_conv_record(tmp_path, edit, edited=lambda conv: None, again=None):
    """Tunes the graph, lets `edit` change its first conv2d record in the database file (`edited`
    then checks it, by the record's key), tunes again without --retune (with `again`, default a
    FakeMeasurer); returns (that key, the database file, the second measurer, its report)."""
    db = TuningDB(tmp_path)
    with tuning_db.using(db):
        tune_graph(_graph(), table=cuda_choices.TABLE, measurer=FakeMeasurer(), db=db)
        path = tmp_path / "cuda-nvidia-h200.json"
        data = json.loads(path.read_text())
        conv = next(k for k in data["records"] if json.loads(k)["kind"] == "conv2d")
        edit(data["records"][conv])
        path.write_text(json.dumps(data))
        edited(conv)
        again = again or FakeMeasurer()
        report = tune_graph(_graph(), table=cuda_choices.TABLE, measurer=again, db=TuningDB(tmp_path))
    return conv, path, again, report


def test_a_record_that_never_measured_a_family_serving_the_kernel_now_is_measured_again(tmp_path):
    """A family added after a kernel was tuned (its record's versions lack it) is compared by the
    next `ember tune` without --retune, its candidates alone beside the reference and the record's
    winner; the record keeps the other families' timings, scaled by how the winner's moved between
    the runs (here the GPU runs 1.5x slower the second time), and their refusals; the other
    kernels' records are reused."""
    before = {}

    def drop_gemm(record):
        assert "gemm" in record["versions"]
        del record["versions"]["gemm"]   # as if gemm had come after the record
        for text in [t for t in record["timings_us"] if t.startswith("gemm(")]:
            del record["timings_us"][text]
        loser = next(t for t in record["timings_us"] if t != choice_text((record["family"], record["plan"])))
        record["rejected"][loser] = "refused earlier"
        del record["timings_us"][loser]
        before.update(json.loads(json.dumps(record)))

    conv, path, again, report = _retune_after_editing_a_conv_record(tmp_path, drop_gemm, again=FakeMeasurer(slower=1.5))
    assert again.calls == 1 and report.measured == 1 and report.reused == len(report.kernels) - 1
    after = json.loads(path.read_text())["records"][conv]
    assert "gemm" in after["versions"]
    asked = again.asked[0]
    winner = (before["family"], tuple(tuple(p) for p in before["plan"]))
    others = {f for f, _ in asked[1:]} - {"gemm"}
    assert any(f == "gemm" for f, _ in asked) and winner in asked
    assert others <= {winner[0]} and sum(f != "gemm" for f, _ in asked[1:]) <= 1, asked
    measured_now = {choice_text(c) for c in asked}
    assert set(before["timings_us"]) - measured_now <= set(after["timings_us"])
    for text, us in before["timings_us"].items():
        if text not in measured_now:  # kept, scaled as the winner's time moved
            assert after["timings_us"][text] == pytest.approx(us * 1.5, rel=1e-3)
    assert set(before["rejected"]) <= set(after["rejected"])
    best = min(after["timings_us"], key=after["timings_us"].get)
    assert choice_text((after["family"], tuple(tuple(p) for p in after["plan"]))) == best
    conv_report = next(k for k in report.kernels if k.status == "measured")
    assert "refused earlier" not in conv_report.rejected.values()  # this run's refusals only


def test_a_record_whose_plan_select_would_refuse_is_measured_again(tmp_path):
    """A record whose plan no longer fits its family (the family's GEMM view of the kernel
    changed since, as strided grad-inputs' did when they went by phase; select then falls back to
    the cost model) is measured again by the next `ember tune` without --retune."""
    stale = ("gemm", (("BM", 7), ("BN", 3), ("BK", 5), ("TM", 2), ("TN", 2), ("splits", 1), ("kchunk", 5)))

    def make_stale(record):
        record["family"], record["plan"] = stale[0], [list(p) for p in stale[1]]

    def read_back(conv):
        assert TuningDB(tmp_path).lookup("cuda", "NVIDIA H200", conv, {}).choice == stale

    conv, path, again, report = _retune_after_editing_a_conv_record(tmp_path, make_stale, read_back)
    assert again.calls == 1 and report.measured == 1 and report.reused == len(report.kernels) - 1
    assert TuningDB(tmp_path).lookup("cuda", "NVIDIA H200", conv, {}).choice != stale


def test_a_candidate_that_differs_beyond_rounding_is_refused_even_when_fastest(tmp_path):
    db = TuningDB(tmp_path)
    with tuning_db.using(db):
        graph = _graph()
        # the last candidate of each kernel before tuning (never the reference); taken up front
        # because each stored record feeds the cost model's prior, which may reorder the rest
        bad = {s.name: cuda_choices.candidates(s, k)[-1] for s, k in kernels_of(graph)}

    def pick_bad(sub, c):
        return c == bad[sub.name]

    with tuning_db.using(db):
        report = tune_graph(graph, table=cuda_choices.TABLE, measurer=FakeMeasurer(pick_bad, pick_bad), db=db)
    measured = [k for k in report.kernels if k.status == "measured"]
    assert measured
    for k in measured:
        assert k.choice != bad[k.name]
        assert list(k.rejected) == [choice_text(bad[k.name])]
        assert "differs from the reference" in k.rejected[choice_text(bad[k.name])]


def test_a_kernel_of_several_outputs_is_checked_output_by_output():
    """A column sum's two outputs (LayerNorm's weight and bias gradients) are compared each
    against its own magnitude: one off by more than rounding refuses the candidate, whatever the
    other's scale."""
    from ember.runtime.tuner import _close
    ref = (np.full(8, 1000.0), np.full(8, 1e-3))
    assert _close((ref[0] * (1 + 1e-7), ref[1].copy()), ref, 1e-5) is None
    why = _close((ref[0].copy(), ref[1] * 1.01), ref, 1e-5)
    assert why is not None and why.startswith("output 1: differs from the reference")
    assert _close(ref[0], ref, 1e-5) == "not the reference's outputs"
    assert _close((ref[0],), ref, 1e-5) == "not the reference's outputs"


def test_the_check_against_the_reference_on_finite_and_non_finite_values():
    """Rounding passes and a wrong value fails, relative to the reference's largest magnitude; a
    non-finite value passes only where the reference has a non-finite value (any: NaN and the
    infinities are not told apart), a finite one only where its is finite; a difference too
    large for float32 is still a difference; integer outputs are compared as numbers."""
    from ember.runtime.tuner import _close
    ref = np.linspace(-3, 3, 1000, dtype=np.float32)
    assert _close(ref * np.float32(1 + 1e-6), ref, 1e-5) is None
    assert "differs from the reference by 1.0e-02" in _close(ref + np.float32(0.03), ref, 1e-5)
    bad = ref.copy()
    bad[5] = np.nan
    assert _close(bad, ref, 1e-5).startswith("non-finite values where the reference's are finite")
    bad[5] = np.inf
    assert _close(bad, ref, 1e-5).startswith("non-finite values where the reference's are finite")
    assert _close(ref, bad, 1e-5).startswith("non-finite values where the reference's are finite")
    with_inf = ref.copy()
    with_inf[[7, 9]] = [np.inf, np.nan]
    same = with_inf.copy()
    same[0] *= np.float32(1 + 1e-6)
    assert _close(same, with_inf, 1e-5) is None        # the finite values compared, by their own scale
    assert "differs" in _close(np.where(np.isfinite(with_inf), with_inf + 1, with_inf), with_inf, 1e-5)
    huge = np.array([3e38, -3e38], np.float32)
    assert "differs" in _close(-huge, huge, 1e-5)        # the float32 difference overflows
    idx = np.arange(10, dtype=np.int64)
    assert _close(idx.copy(), idx, 1e-5) is None and "differs" in _close(idx[::-1].copy(), idx, 1e-5)


def test_the_budget_bounds_the_run(tmp_path):
    db = TuningDB(tmp_path)
    measurer = FakeMeasurer()
    report = tune_graph(_graph(), table=cuda_choices.TABLE, measurer=measurer, db=db, budget_s=0.0)
    assert measurer.calls == 0 and report.out_of_budget == len(report.kernels) > 0
    assert not (tmp_path / "cuda-nvidia-h200.json").exists()


def test_select_with_a_fixed_database_is_deterministic_and_without_one_is_the_cost_model(tmp_path):
    with tuning_db.using(None):
        cost = _graph()
    sub, spec = _tunable(cost)[0]
    assert spec.why.startswith("cost model") and spec.choice == cuda_choices.candidates(sub, spec)[0]
    other = cuda_choices.candidates(sub, spec)[1]
    db = TuningDB(tmp_path)
    key = cuda_choices.TABLE.key(sub, spec)
    db.store("cuda", "NVIDIA H200", key, Record(other, {choice_text(other): 1.0}, cuda_choices.TABLE.versions(sub, spec)))
    for _ in range(2):
        with tuning_db.using(TuningDB(tmp_path)):
            stamped = {s.name: k for s, k in _tunable(_graph())}
        assert stamped[sub.name].choice == other
    # a record of an older version of the families is stale: the cost model decides
    stale = {f: v + 1 for f, v in cuda_choices.TABLE.versions(sub, spec).items()}
    db.store("cuda", "NVIDIA H200", key, Record(other, {choice_text(other): 1.0}, stale))
    with tuning_db.using(TuningDB(tmp_path)):
        assert {s.name: k for s, k in _tunable(_graph())}[sub.name].choice == spec.choice


def test_a_damaged_database_costs_speed_not_the_compile(tmp_path):
    (tmp_path / "cuda-nvidia-h200.json").write_text("{not json")
    with tuning_db.using(TuningDB(tmp_path)):
        graph = _graph()
    assert all(k.why.startswith("cost model") for _, k in _tunable(graph))
    with pytest.raises(ValueError, match="read-only"):
        TuningDB(None).store("cuda", "x", "k", Record(("gemm", ()), {"gemm": 1.0}, {}))


def test_a_stored_plan_that_does_not_fit_the_kernel_is_ignored(tmp_path):
    with tuning_db.using(None):
        sub, spec = next((s, k) for s, k in _tunable(_graph()) if "gemm" in {f for f, _ in cuda_choices.candidates(s, k)})
    db = TuningDB(tmp_path)
    nonsense = ("gemm", (("BM", 7), ("BN", 3), ("BK", 5), ("TM", 2), ("TN", 2), ("splits", 1), ("kchunk", 5)))
    db.store("cuda", "NVIDIA H200", cuda_choices.TABLE.key(sub, spec),
             Record(nonsense, {choice_text(nonsense): 0.1}, cuda_choices.TABLE.versions(sub, spec)))
    with tuning_db.using(TuningDB(tmp_path)):
        stamped = {s.name: k for s, k in _tunable(_graph())}
    assert stamped[sub.name].choice != nonsense and stamped[sub.name].why.startswith("cost model")


def test_a_database_reads_a_file_again_only_when_another_writer_changed_it(tmp_path):
    reader, writer = TuningDB(tmp_path), TuningDB(tmp_path)
    versions = {"gemm": 1}
    assert reader.lookup("cuda", "NVIDIA H200", "k", versions) is None
    writer.store("cuda", "NVIDIA H200", "k", Record(("gemm", ()), {"gemm": 2.0}, versions))
    assert reader.lookup("cuda", "NVIDIA H200", "k", versions).time_us == 2.0
    held = reader._files[(tmp_path, "cuda-nvidia-h200")]
    assert reader.lookup("cuda", "NVIDIA H200", "k", versions) is held[1]["k"]  # unchanged: not parsed again
    assert tuning_db.default_db() is tuning_db.default_db()


def test_a_kernel_without_a_record_takes_the_plan_tuned_for_its_sizes_with_other_epilogues(tmp_path):
    """Kernels of the same sizes with other epilogues (a bfloat16 convolution that now stores its
    own dtype instead of a widened one) run the same main loop: where the database has no record
    of the kernel itself, it takes the plan measured for them (the dump says so), never a stale
    one, and the tuner still measures the kernel itself."""
    with tuning_db.using(None):
        sub, spec = next((s, k) for s, k in _tunable(_graph()) if k.kind == "conv2d")
    assert spec.epilogues == ("bias", "relu")
    other = cuda_choices.candidates(sub, spec)[-1]
    key = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(cuda_choices.TABLE.key(sub, spec)).items()}
    versions = cuda_choices.TABLE.versions(sub, spec)

    def store(epilogues, versions):
        db = TuningDB(tmp_path)
        db.store("cuda", "NVIDIA H200", tuning_db.kernel_key({**key, "epilogues": tuple(epilogues)}),
                 Record(other, {choice_text(other): 1.0}, versions))
        return db

    with tuning_db.using(TuningDB(tmp_path)):  # empty: the cost model, with the shipped records' prior
        predicted = {s.name: k for s, k in _tunable(_graph())}[sub.name].choice
    store(["bias"], {f: v + 1 for f, v in versions.items()})  # stale: not taken
    with tuning_db.using(TuningDB(tmp_path)):
        assert {s.name: k for s, k in _tunable(_graph())}[sub.name].choice == predicted
    assert predicted != other
    store(["pointwise"], versions)
    store(["bias"], versions)
    with tuning_db.using(TuningDB(tmp_path)):
        stamped = {s.name: k for s, k in _tunable(_graph())}[sub.name]
    assert stamped.choice == other
    assert stamped.why.startswith("tuned (user)") and stamped.why.endswith("with epilogues [bias]")  # the nearest set
    TuningDB(tmp_path).store("cuda", "NVIDIA H200", "{not a key", Record(other, {choice_text(other): 1.0}, versions))
    with tuning_db.using(TuningDB(tmp_path)):  # a damaged key costs its record, never the compile
        assert {s.name: k for s, k in _tunable(_graph())}[sub.name].choice == other
    db = TuningDB(tmp_path)
    measurer = FakeMeasurer()
    with tuning_db.using(db):
        tune_graph(_graph(), table=cuda_choices.TABLE, measurer=measurer, db=db)
    assert db.lookup("cuda", "NVIDIA H200", cuda_choices.TABLE.key(sub, spec), versions).choice == \
        min(cuda_choices.candidates(sub, spec), key=_fake_us)  # measured: a record of its own now


def test_a_run_narrowed_to_some_families_measures_them_beside_the_reference_and_the_stamped_choice(tmp_path):
    """`families` (`ember tune --families`): each kernel a family of them serves is measured on
    that family's candidates, the cost model's first and the stamped choice only; the record lists
    the families measured, so a run without `families` measures the others; a kernel none of them
    serves is skipped."""
    db = TuningDB(tmp_path)
    with tuning_db.using(db):
        graph = _graph()
        narrow = FakeMeasurer()
        report = tune_graph(graph, table=cuda_choices.TABLE, measurer=narrow, db=db, families={"small_window"})
        tunable = _tunable(graph)
        served = [(s, k) for s, k in tunable if any(f == "small_window" for f, _ in cuda_choices.candidates(s, k))]
        assert served and len(served) < len(tunable)
        assert {r.name for r in report.kernels if r.status == "skipped"} == \
            {s.name for s, k in tunable} - {s.name for s, _ in served}
        for sub, spec in served:
            cands = cuda_choices.candidates(sub, spec)
            asked = next(a for a in narrow.asked if cands[0] in a and set(a) <= set(cands))
            assert set(asked) == {c for i, c in enumerate(cands) if i == 0 or c[0] == "small_window" or c == spec.choice}
            rec = db.lookup("cuda", "NVIDIA H200", cuda_choices.TABLE.key(sub, spec), cuda_choices.TABLE.versions(sub, spec))
            assert set(rec.versions) == {f for f, _ in asked} and rec.choice == min(asked, key=_fake_us)
        with pytest.raises(ValueError, match="no kernel family nope"):
            tune_graph(graph, table=cuda_choices.TABLE, measurer=FakeMeasurer(), db=db, families={"nope"})
        full = FakeMeasurer()
        again = tune_graph(_graph(), table=cuda_choices.TABLE, measurer=full, db=db)
        assert {r.name for r in again.kernels if r.status == "measured"} >= {s.name for s, _ in served}
        for sub, spec in served:
            cands = cuda_choices.candidates(sub, spec)
            rec = db.lookup("cuda", "NVIDIA H200", cuda_choices.TABLE.key(sub, spec), cuda_choices.TABLE.versions(sub, spec))
            assert set(rec.versions) == set(cuda_choices.TABLE.versions(sub, spec))
            assert {choice_text(c) for c in cands} == set(rec.timings_us) | set(rec.rejected)
