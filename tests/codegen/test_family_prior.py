"""The cost model's prior between kernel families (codegen/family_prior.py): learned from tuning
records, it ranks a kernel's families by what the nearest measured kernels of its kind found, and
the choice table takes it (the dump says so) where no record of the kernel itself exists."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ember.codegen import cuda_choices, family_prior, tuning_db
from ember.codegen.device import H200
from ember.codegen.tuning_db import Record, TuningDB, kernel_key
from ember.frontends import nn, optim, plan


def _g(M, N, K, tf32=False):
    return dict(kind="matmul", epilogues=(), tf32=tf32, M=M, N=N, K=K, batch=1, trans_a=False, trans_b=True,
                rank2=True, broadcast=False)


def _record(times: dict[str, float]) -> Record:
    winner = min(times, key=times.get)
    return Record((winner, ()), {f"{f}(X=1)": t for f, t in times.items()}, {f: 1 for f in times})


FAMS = {"skinny_narrow": 1, "gemm": 1}


def test_an_exact_record_decides_and_a_shape_between_two_takes_the_nearer():
    small, big = _g(64, 10, 9216), _g(4096, 10, 9216)
    records = {kernel_key(small): _record({"gemm": 5.0, "skinny_narrow": 8.0}),
               kernel_key(big): _record({"gemm": 60.0, "skinny_narrow": 30.0})}
    f = cuda_choices.features
    assert min((p := family_prior.predict(records, small, FAMS, f)).scores, key=p.scores.get) == "gemm"
    assert p.nearest == 0.0 and p.neighbours == 2
    assert min((p := family_prior.predict(records, big, FAMS, f)).scores, key=p.scores.get) == "skinny_narrow"
    near_big = family_prior.predict(records, _g(2048, 10, 9216), FAMS, f)
    assert min(near_big.scores, key=near_big.scores.get) == "skinny_narrow"
    near_small = family_prior.predict(records, _g(128, 10, 9216), FAMS, f)
    assert min(near_small.scores, key=near_small.scores.get) == "gemm"
    # scores are log2 time ratios to the best: twice as slow in the only record is 1.0
    one = family_prior.predict({kernel_key(big): records[kernel_key(big)]}, big, FAMS, f)
    assert one.scores == pytest.approx({"skinny_narrow": 0.0, "gemm": 1.0})
    assert "skinny_narrow 1.00x, gemm 2.00x" in one.describe()


def test_a_family_is_scored_by_the_mode_of_the_plan_it_would_run():
    """A CPU convolution family's flat loops win at stride 1 and its generic ones lose; a strided
    kernel gets the generic loops, so the family's stride-1 wins must not rank it first there
    (scored by the family's best, the cost model ran ResNet-8's stride-2 layers 6-19x slower
    than tuned at 16 threads)."""
    from ember.codegen import cpp_choices
    g1 = dict(kind="conv2d", epilogues=(), isa="avx512", N=64, C=32, H=28, W=28, O=32, KH=3, KW=3,
              stride=(1, 1), padding=(1, 1), HO=28, WO=28)
    g2 = dict(g1, stride=(2, 2), HO=14, WO=14)
    times = {"conv_forward(mode=flat,VB=4,OB=4)": 10.0, "conv_forward(mode=generic)": 40.0, "phase(VB=2,OB=8)": 13.0}
    records = {kernel_key(g1): Record(("conv_forward", (("mode", "flat"),)), times, {"conv_forward": 1, "phase": 1})}
    fams, f = {"conv_forward": 1, "phase": 1}, cpp_choices.features
    as_stride_1 = family_prior.predict(records, g2, fams, f, {"conv_forward": "flat", "phase": None})
    assert min(as_stride_1.scores, key=as_stride_1.scores.get) == "conv_forward"
    generic = family_prior.predict(records, g2, fams, f, {"conv_forward": "generic", "phase": None})
    assert min(generic.scores, key=generic.scores.get) == "phase"
    assert generic.scores["conv_forward"] == pytest.approx(np.log2(40.0 / 13.0))
    assert "conv_forward (mode=generic) 3.08x" in generic.describe()
    # a record that never timed the mode says nothing of the family
    flat_only = {kernel_key(g1): Record(("conv_forward", (("mode", "flat"),)),
                                        {k: v for k, v in times.items() if "generic" not in k}, {"conv_forward": 1, "phase": 1})}
    assert family_prior.predict(flat_only, g2, fams, f, {"conv_forward": "generic", "phase": None}) is None
    assert family_prior.plan_mode((("mode", "generic"),)) == "generic" and family_prior.plan_mode((("VB", 2),)) is None


def test_the_cpu_table_ranks_a_strided_convolution_by_the_direct_familys_generic_loops(tmp_path):
    """The wiring: the CPU choice table hands the prior the mode of each modal family's first plan,
    so stride-1 records where the flat loops won do not put the direct family first at stride 2."""
    from ember.codegen import cpp_choices
    table = cpp_choices.TABLE
    g1 = dict(kind="conv2d", epilogues=(), isa="avx512", N=64, C=32, H=28, W=28, O=32, KH=3, KW=3,
              stride=(1, 1), padding=(1, 1), HO=28, WO=28)
    g2 = dict(g1, stride=(2, 2), HO=14, WO=14)
    versions = {f.name: f.version_at(g1) for f in table.families.values() if table.applies(f, g1) is None}
    times = {"conv_forward(mode=flat,VB=4,OB=4)": 10.0, "conv_forward(mode=generic)": 40.0, "phase(VB=2,OB=8)": 13.0,
             "winograd(OB=8,VB=3,RB=17)": 30.0}
    db = TuningDB(tmp_path)
    db.store("cpu", table.device(), kernel_key(g1), Record(("conv_forward", (("mode", "flat"),)), times, versions))
    assert family_prior.plan_mode(table.families["conv_forward"].plans(g2)[0]) == "generic"
    assert table.ranked(g1, db)[0].name == "conv_forward"
    ranked, prior = table._ranked(g2, db)
    assert ranked[0].name == "phase" and "conv_forward (mode=generic)" in prior.describe()


def test_records_that_compare_fewer_than_two_of_the_families_or_another_kind_say_nothing():
    g = _g(64, 10, 9216)
    records = {kernel_key(g): _record({"gemm": 5.0}),  # gemm alone: no comparison
               kernel_key(dict(g, kind="conv2d")): _record({"gemm": 5.0, "skinny_narrow": 1.0})}
    assert family_prior.predict(records, g, FAMS, lambda geo: (0.0,)) is None


def test_a_familys_timings_of_another_version_are_stale():
    g = _g(64, 10, 9216)
    records = {kernel_key(g): _record({"gemm": 5.0, "skinny_narrow": 1.0})}
    assert family_prior.predict(records, g, FAMS, cuda_choices.features) is not None
    assert family_prior.predict(records, g, {"skinny_narrow": 2, "gemm": 1}, cuda_choices.features) is None


def test_a_stale_user_record_does_not_hide_the_shipped_record_of_the_same_kernel(tmp_path):
    """As the exact lookup skips a stale user record for the shipped one, the prior's sample keeps
    both and learns from the first whose families are current."""
    g = _g(64, 10, 9216)
    TuningDB(tmp_path / "shipped").store("cuda", "H200", kernel_key(g), _record({"gemm": 5.0, "skinny_narrow": 8.0}))
    stale = Record(("skinny_narrow", ()), {"gemm(X=1)": 9.0, "skinny_narrow(X=1)": 1.0}, {"gemm": 0, "skinny_narrow": 0})
    db = TuningDB(tmp_path / "user", (tmp_path / "shipped",))
    db.store("cuda", "H200", kernel_key(g), stale)
    records = family_prior.sample(db, "cuda", "H200")
    assert len(records[kernel_key(g)]) == 2  # the user's, then the shipped one
    p = family_prior.predict(records, g, FAMS, cuda_choices.features)
    assert p is not None and min(p.scores, key=p.scores.get) == "gemm" and p.neighbours == 1
    # a current user record comes first
    db.store("cuda", "H200", kernel_key(g), _record({"gemm": 9.0, "skinny_narrow": 1.0}))
    p = family_prior.predict(family_prior.sample(db, "cuda", "H200"), g, FAMS, cuda_choices.features)
    assert min(p.scores, key=p.scores.get) == "skinny_narrow"


def test_records_of_another_precision_say_nothing():
    """TF32 (or bfloat16) records rank families by tensor-core speeds a float32 kernel never sees."""
    g = _g(64, 10, 9216)
    records = {kernel_key(_g(64, 10, 9216, tf32=True)): _record({"gemm": 1.0, "skinny_narrow": 5.0}),
               kernel_key(dict(g, dtype="bfloat16")): _record({"gemm": 1.0, "skinny_narrow": 5.0})}
    assert family_prior.predict(records, g, FAMS, cuda_choices.features) is None
    records[kernel_key(g)] = _record({"gemm": 5.0, "skinny_narrow": 1.0})
    p = family_prior.predict(records, g, FAMS, cuda_choices.features)
    assert p.neighbours == 1 and min(p.scores, key=p.scores.get) == "skinny_narrow"


def _other_devices(monkeypatch, records: dict) -> None:
    """The target's shipped records of every device (`family_prior.sample(None, ...)`) are `records`."""
    monkeypatch.setitem(family_prior._SHIPPED, "cuda", family_prior._IndexedSample(records))


def test_where_the_devices_records_say_nothing_of_a_kernel_other_devices_records_decide(tmp_path, monkeypatch):
    """A device tuned in one precision only (here: its one record is of another kind) still ranks
    an untuned kernel's families by what other devices measured (the shipped records), and the
    dump says where the prior came from; a record of its own of the kernel wins over those."""
    g = _g(1024, 10, 9216)
    _other_devices(monkeypatch, {kernel_key(g): _record({"gemm": 9.0, "skinny_narrow": 5.0})})
    db = TuningDB(tmp_path / "user", ())
    db.store("cuda", "H100 test", kernel_key(dict(g, kind="conv2d")), _record({"gemm": 5.0, "skinny_narrow": 1.0}))
    assert family_prior.predict(family_prior.sample(db, "cuda", "H100 test"), g, FAMS, cuda_choices.features) is None
    p = family_prior.predict_for(db, "cuda", "H100 test", g, FAMS, cuda_choices.features)
    assert p is not None and p.elsewhere == 1 and p.nearest == family_prior.ELSEWHERE
    assert min(p.scores, key=p.scores.get) == "skinny_narrow" and "all of them other devices' records" in p.describe()
    db.store("cuda", "H100 test", kernel_key(g), _record({"gemm": 5.0, "skinny_narrow": 9.0}))
    p = family_prior.predict_for(db, "cuda", "H100 test", g, FAMS, cuda_choices.features)
    assert p.nearest == 0.0 and p.elsewhere == 0 and min(p.scores, key=p.scores.get) == "gemm"
    assert "other devices" not in p.describe()  # (another device's record of a kernel the device has is not asked)


def test_another_devices_record_of_the_kernel_outranks_the_devices_own_far_records(tmp_path, monkeypatch):
    """A device tuned on other models has only far records of a new model's kernels (here 16x and 32x
    the rows away): another GPU's record of the very kernel decides, as if `ELSEWHERE` away; the
    device's own record of a shape twice as far as that wins again (a factor of two in M is 1)."""
    g = _g(1024, 10, 9216)
    _other_devices(monkeypatch, {kernel_key(g): _record({"gemm": 9.0, "skinny_narrow": 5.0})})
    db = TuningDB(tmp_path / "user", ())
    for rows in (16384, 32768):
        db.store("cuda", "H100 test", kernel_key(_g(rows, 10, 9216)), _record({"gemm": 5.0, "skinny_narrow": 9.0}))
    p = family_prior.predict_for(db, "cuda", "H100 test", g, FAMS, cuda_choices.features)
    assert min(p.scores, key=p.scores.get) == "skinny_narrow" and p.elsewhere == 1 and p.neighbours == 3
    db.store("cuda", "H100 test", kernel_key(_g(2048, 10, 9216)), _record({"gemm": 5.0, "skinny_narrow": 9.0}))
    p = family_prior.predict_for(db, "cuda", "H100 test", g, FAMS, cuda_choices.features)
    assert min(p.scores, key=p.scores.get) == "gemm" and p.nearest == 1.0
    # a device with no records of its own learns from every shipped record at its plain distance
    p = family_prior.predict_for(TuningDB(tmp_path / "empty", ()), "cuda", "H100 test", g, FAMS, cuda_choices.features)
    assert p.nearest == 0.0 and p.elsewhere == 0 and min(p.scores, key=p.scores.get) == "skinny_narrow"


def _cnn_graph(batch):
    nn.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 26 * 26, 10))
    example = (np.zeros((batch, 1, 28, 28), np.float32), np.zeros(batch, np.int64))
    return plan(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.05), example, device="cuda")[f"train-{batch}x1x28x28"]


def _linear_forward(graph):
    for n in graph.meta["schedule"]:
        if graph.op(n) == "fused" and graph.attrs(n)["kernel"].kind == "matmul" \
                and graph.attrs(n)["kernel"].param("trans_b"):
            return graph.attrs(n)["graph"], graph.attrs(n)["kernel"]
    raise AssertionError("no forward matmul")


@pytest.mark.parametrize("winner", ["gemm", "skinny_narrow"])
def test_the_table_follows_a_neighbouring_measurement_and_says_so(tmp_path, monkeypatch, winner):
    """A database with one measured neighbour (the same layer at batch 64): an untuned batch 96
    takes the family that won there, and its stamp names the prior."""
    _other_devices(monkeypatch, {})  # (no other device's records: the shipped ones would be weighed in)
    with tuning_db.using(None):
        sub, spec = _linear_forward(_cnn_graph(64))
    g = cuda_choices._geometry(sub, spec)
    loser = "gemm" if winner == "skinny_narrow" else "skinny_narrow"
    data = {"schema": tuning_db.SCHEMA, "target": "cuda", "device": H200.name,
            "records": {kernel_key(g): _record({winner: 5.0, loser: 9.0}).to_json()}}
    (tmp_path / f"{tuning_db.device_slug('cuda', H200.name)}.json").write_text(json.dumps(data))
    db = TuningDB(None, (tmp_path,))
    with tuning_db.using(db):
        graph = _cnn_graph(96)
    spec96 = _linear_forward(graph)[1]
    assert spec96.choice[0] == winner
    assert spec96.why.startswith("cost model (prior of 1 tuned kernel (nearest 0.6)")
    assert f"{winner} 1.00x" in spec96.why


def test_without_a_comparing_record_the_general_family_comes_first():
    """The structural order: a specialised family (skinny, direct) only where measurements say so."""
    g = _g(1024, 10, 9216)
    fams, prior = cuda_choices.TABLE._ranked(g, db=TuningDB(None, ()))  # no records here: the shipped ones
    assert prior is not None  # the shipped H200 records compare them
    table = cuda_choices.TABLE
    structural = sorted((f for f in table.families.values() if table.applies(f, g) is None),
                        key=lambda f: (not f.preferred(g), f.priority))
    assert structural[0].name == "gemm" and "skinny_narrow" in [f.name for f in structural]
