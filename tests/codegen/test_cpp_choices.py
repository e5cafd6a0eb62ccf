"""The CPU choice table (codegen/cpp_choices.py), checked without compiling.

Random geometries (odd sizes, strides 1-3, padding 0-2, 1x1 to 5x5 kernels, both vector
variants): every convolution and matmul has a family whose plans render, and every plan the tuner
would measure renders with the scratch its family reports. Random small networks through the cpu
target's passes: every kernel of every CPU kind gets a stamped (family, plan), the first of its
candidates. `select` takes a tuning database's record for a kernel (and ignores a stale or unfit
one), the cost model's choice without one; `force` picks a family or refuses in one line."""
from __future__ import annotations

import ctypes
import random
import re

import numpy as np
import pytest

from ember.codegen import cpp_choices, cpu_vector, family_prior, tuning_db
from ember.codegen.tuning_db import Record, TuningDB, choice_text
from ember.frontends import nn, optim, plan
from ember.ir import format_graph
from ember.runtime import target


@pytest.fixture(autouse=True)
def _cost_model_only():
    """These tests are about the table and its cost model: no tuning database takes part unless
    a test gives one."""
    with tuning_db.using(None):
        yield


def _kernels(graph):
    for n in graph.meta["schedule"]:
        if graph.op(n) == "fused":
            yield graph.attrs(n)["graph"], graph.attrs(n)["kernel"]


def _graphs(model, x_shape):
    example = (np.zeros(x_shape, np.float32), np.zeros(x_shape[0], np.int64))
    return plan(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.05, momentum=0.9), example, device="cpu")


# --------------------------------------------------------------------------- geometries

def _conv_geometry(rng: random.Random, kind: str, isa: str) -> dict:
    kh, kw = rng.choice([1, 2, 3, 5]), rng.choice([1, 3, 5])
    sh = rng.choice([1, 1, 2, 3])  # stride 1 and no padding often: the tiled modes need them
    sw = sh if rng.random() < 0.7 else rng.randint(1, 3)
    ph, pw = rng.choice([0, 0, 1, 2]), rng.choice([0, 0, 1, 2])
    h, w = rng.choice([5, 7, 13, 26, 29]), rng.choice([6, 9, 18, 27, 34])
    h, w = max(h, kh), max(w, kw)
    eps = tuple(e for e in sorted(cpp_choices.EPILOGUES[kind]) if rng.random() < 0.5)
    g = dict(kind=kind, epilogues=eps, isa=isa, N=rng.choice([1, 2, 3, 5]), C=rng.choice([1, 3, 8, 16]),
             H=h, W=w, O=rng.choice([1, 4, 13, 32]), KH=kh, KW=kw, stride=(sh, sw), padding=(ph, pw))
    g["HO"], g["WO"] = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    return g


def _matmul_geometry(rng: random.Random, isa: str) -> dict:
    eps = tuple(e for e in ("bias", "relu", "relu_mask") if rng.random() < 0.3)
    return dict(kind="matmul", epilogues=eps, isa=isa, M=rng.choice([1, 3, 7, 30, 64]),
                N=rng.choice([1, 5, 10, 37, 300]), K=rng.choice([1, 9, 64, 130, 2500]), batch=rng.choice([1, 1, 3]),
                trans_a=rng.random() < 0.5, trans_b=rng.random() < 0.5)


def _row_geometry(kind: str, isa: str) -> dict:
    """A stride-1 convolution without padding whose output rows are whole vectors (the row modes)."""
    return dict(kind=kind, epilogues=(), isa=isa, N=2, C=3, H=10, W=34, O=5, KH=3, KW=3, stride=(1, 1),
                padding=(0, 0), HO=8, WO=32)


GEOMETRIES = [(f"{kind}-{isa}-{i}", g) for isa in cpu_vector.VARIANTS for i in range(8)
              for kind, g in [(k, _conv_geometry(random.Random(f"{k}{isa}{i}"), k, isa)) for k in cpp_choices.CONVS]
              + [("matmul", _matmul_geometry(random.Random(f"mm{isa}{i}"), isa))]]
GEOMETRIES += [(f"{kind}-{isa}-rows", _row_geometry(kind, isa)) for isa in cpu_vector.VARIANTS
               for kind in cpp_choices.CONVS]


@pytest.mark.parametrize("tag,g", GEOMETRIES, ids=[t for t, _ in GEOMETRIES])
def test_every_geometry_has_a_family_and_every_tuning_plan_renders_with_its_scratch(tag, g, monkeypatch):
    # the structural order (no measurement at all): the shipped records rank by what they measured
    monkeypatch.setattr(family_prior, "sample", lambda db, target, device: {})
    ranked = cpp_choices.TABLE.ranked(g)
    assert ranked and ranked[0].plans(g), f"no family serves {g}"
    for f in ranked:
        plans, tuning = f.plans(g), f.all_plans(g)
        assert plans and tuning[0] == plans[0], (f.name, plans, tuning[:2])  # the cost model's plan comes first
        assert len(set(tuning)) == len(tuning)
        for p in tuning:
            assert f.fits(g, p), (f.name, p)
            ks, order = f.render("k", None, None, g, p)
            assert ks.scratch_bytes == f.scratch(g, p), (f.name, p)
            assert order[-1] == "scratch" and "out" in order
            mode = dict(p).get("mode")
            if mode is not None:  # the template renders the mode it was given
                head = "\n".join(ks.code.splitlines()[:8])
                assert f"mode {mode}" in head or (mode == "scatter" and "mode" not in head), (head, p)
    if g["kind"] == "matmul" and not g["trans_a"] and g["trans_b"] and "relu_mask" not in g["epilogues"]:
        assert {f.name for f in ranked} == {"matmul_dot", "matmul_axpy"}
    if g["kind"] == "conv2d_grad_input" and g["stride"] != (1, 1):
        gi = cpp_choices.FAMILIES["conv_grad_input"]
        assert [dict(p)["mode"] for p in gi.all_plans(g)] == ["scatter"]
    if g["kind"] in cpp_choices.CONVS:  # strided (and 1x1 grad-weights): phase planes first; else the conv families
        phase = g["stride"] != (1, 1) or g["kind"] == "conv2d_grad_weight" and g["KW"] == 1
        assert (ranked[0].name == "phase") == phase, [f.name for f in ranked]


def test_a_plan_that_does_not_fit_the_geometry_is_not_accepted():
    g = _conv_geometry(random.Random(3), "conv2d", "avx512")
    g.update(stride=(2, 2), padding=(0, 0))
    f = cpp_choices.FAMILIES["conv_forward"]
    assert not f.fits(g, (("mode", "flat"), ("VB", 3), ("OB", 8)))  # flat needs stride 1
    assert not f.fits(g, (("mode", "generic"), ("tiles", 3)))       # no such field
    mm = dict(kind="matmul", epilogues=(), isa="avx2", M=8, N=10, K=100, batch=1, trans_a=False, trans_b=True)
    assert cpp_choices.FAMILIES["matmul_dot"].fits(mm, (("MR", 4), ("NR", 3), ("KC", 104), ("split_cols", False),
                                                        ("parallel", False)))
    assert not cpp_choices.FAMILIES["matmul_dot"].fits(mm, (("MR", 4), ("NR", 11), ("KC", 104),
                                                            ("split_cols", False), ("parallel", False)))
    # more tile rows than M fit (M is a size the kernel takes at run time: a plan of another batch)
    assert cpp_choices.FAMILIES["matmul_dot"].fits(mm, (("MR", 9), ("NR", 3), ("KC", 104),
                                                        ("split_cols", False), ("parallel", False)))
    assert not cpp_choices.FAMILIES["matmul_axpy"].fits(mm, (("MR", 4), ("NV", 1), ("BT", 1), ("pack", False),
                                                             ("parallel", False)))  # B transposed: packed


# --------------------------------------------------------------------------- networks

def _random_net(rng: random.Random):
    c, o = rng.choice([1, 3]), rng.choice([4, 13])
    k, s, p = rng.choice([1, 3, 5]), rng.randint(1, 3), rng.randint(0, 2)
    h = rng.choice([9, 13, 16])
    if h + 2 * p < k:
        h = k
    ho = (h + 2 * p - k) // s + 1
    pooled = ho // 2
    n = rng.choice([1, 3, 64])
    nn.manual_seed(0)
    layers = [nn.Conv2d(c, o, k, stride=s, padding=p), nn.ReLU(), nn.Conv2d(o, 8, 3, padding=1), nn.ReLU()]
    if pooled >= 1:
        layers.append(nn.MaxPool2d(2))
        ho = pooled
    model = nn.Sequential(*layers, nn.Flatten(), nn.Linear(8 * ho * ho, 12), nn.ReLU(), nn.Linear(12, 10))
    return model, (n, c, h, h), f"N{n}_C{c}_O{o}_k{k}_s{s}_p{p}_h{h}"


NETS = [_random_net(random.Random(seed)) for seed in range(8)]


def test_every_cpu_kernel_kind_has_a_family():
    kinds = target("cpu").fusion.kinds - set(cpp_choices.TABLE.no_kernel)
    served = {k for f in cpp_choices.FAMILIES.values() for k in f.kinds}
    assert kinds <= served, kinds - served


@pytest.mark.parametrize("idx", range(len(NETS)), ids=[tag for _, _, tag in NETS])
def test_every_kernel_has_a_stamped_family_that_is_the_first_candidate(idx):
    model, x_shape, _ = NETS[idx]
    kinds = set()
    for graph in _graphs(model, x_shape).values():
        for sub, spec in _kernels(graph):
            if spec.kind == "collective":
                continue
            kinds.add(spec.kind)
            assert spec.choice is not None and spec.why.startswith("cost model"), spec
            cands = cpp_choices.candidates(sub, spec)
            assert cands[0] == spec.choice, (spec, cands[:3])
            assert spec.scratch_bytes == cpp_choices.scratch_bytes(sub, spec, spec.choice)
            ks, _ = cpp_choices.render_kernel(sub.name, sub, spec)
            assert ks.scratch_bytes == spec.scratch_bytes
    assert {"conv2d", "conv2d_grad_input", "conv2d_grad_weight", "matmul", "pointwise", "reduction"} <= kinds


def test_the_dump_names_each_kernels_choice_and_why():
    from models import cnn
    graph = next(iter(_graphs(cnn(), (64, 1, 28, 28)).values()))
    text = format_graph(graph)
    families = {spec.choice[0] for _, spec in _kernels(graph) if spec.kind in cpp_choices.TEMPLATED}
    assert len(families) >= 4 and {"matmul_dot", "matmul_axpy"} <= families, families
    for _, spec in _kernels(graph):
        if spec.kind in cpp_choices.TEMPLATED:
            assert f"choice={spec.choice[0]}(" in text and spec.why in text, spec.describe()
    assert "(cost model" in text


# --------------------------------------------------------------------------- the tuning database

def _conv2_record(graph, db: TuningDB, *, pick: int = -1, versions=None, plan_=None):
    """Stores a record for the CNN's second forward convolution naming candidate `pick`."""
    sub, spec = [(s, k) for s, k in _kernels(graph) if k.kind == "conv2d"][-1]
    cands = cpp_choices.candidates(sub, spec)
    choice = (cands[pick][0], plan_ or cands[pick][1])
    rec = Record(choice, {choice_text(choice): 10.0, choice_text(cands[0]): 12.0},
                 versions or cpp_choices.TABLE.versions(sub, spec))
    db.store("cpu", cpp_choices.device_name(), cpp_choices.TABLE.key(sub, spec), rec)
    return sub, spec, choice


def _conv_choices(graph):
    return [spec.choice for _, spec in _kernels(graph) if spec.kind == "conv2d"]


def test_select_takes_the_databases_record_and_the_cost_model_without_one(tmp_path, monkeypatch):
    from models import cnn
    # no other device's records: the prior weighs the shipped ones of the CPU's other thread counts
    # and vector widths in beside a device's own (family_prior.ELSEWHERE)
    monkeypatch.setitem(family_prior._SHIPPED, "cpu", family_prior._IndexedSample({}))
    untuned = next(iter(_graphs(cnn(), (64, 1, 28, 28)).values()))
    db = TuningDB(tmp_path)
    _, spec, choice = _conv2_record(untuned, db)
    assert choice != spec.choice
    for _ in range(2):  # the same choice every time
        with tuning_db.using(db):
            tuned = next(iter(_graphs(cnn(), (64, 1, 28, 28)).values()))
        assert _conv_choices(tuned)[1] == choice
        # the first convolution has no record: the cost model decides it (the record of the second
        # one is its prior's only sample: family_prior)
        first = [s for _, s in _kernels(tuned) if s.kind == "conv2d"][0]
        assert first.why.startswith("cost model (prior of 1 tuned kernel"), first.why
        assert _conv_choices(tuned)[0][0] == choice[0]
    why = [s.why for _, s in _kernels(tuned) if s.kind == "conv2d"][-1]
    assert why.startswith("tuned (user): 10.00 us, best of 2"), why
    assert f"choice={choice_text(choice)}" in format_graph(tuned) and "tuned (user)" in format_graph(tuned)
    with tuning_db.using(None):
        assert _conv_choices(next(iter(_graphs(cnn(), (64, 1, 28, 28)).values()))) == _conv_choices(untuned)


def test_a_stale_or_unfit_record_leaves_the_cost_models_choice(tmp_path):
    from models import cnn
    untuned = next(iter(_graphs(cnn(), (64, 1, 28, 28)).values()))
    stale = TuningDB(tmp_path / "stale")
    _conv2_record(untuned, stale, versions={"conv_forward": 0})
    unfit = TuningDB(tmp_path / "unfit")
    _conv2_record(untuned, unfit, pick=0, plan_=(("mode", "row"), ("VB", 3), ("OB", 8)))  # 24-wide rows: no row mode
    # the reference: a database of this device whose only record is another kernel's, stale (the
    # cost model's prior then has no sample of it either: a database without any record of this
    # device would sample the shipped records)
    other = TuningDB(tmp_path / "other")
    sub, spec = [(s, k) for s, k in _kernels(untuned) if k.kind == "conv2d"][0]
    cands = cpp_choices.candidates(sub, spec)
    other.store("cpu", cpp_choices.device_name(), cpp_choices.TABLE.key(sub, spec),
                Record(cands[0], {choice_text(cands[0]): 1.0}, {cands[0][0]: 0}))
    with tuning_db.using(other):
        no_record = _conv_choices(next(iter(_graphs(cnn(), (64, 1, 28, 28)).values())))
    for db in (stale, unfit):
        with tuning_db.using(db):
            assert _conv_choices(next(iter(_graphs(cnn(), (64, 1, 28, 28)).values()))) == no_record


def test_a_record_lists_and_is_checked_against_the_families_that_apply_to_its_kernel(tmp_path):
    """A float32 convolution's versions name the families that can serve it, not the bfloat16
    family that serves the same kinds; a record that lists another family (as records once did)
    at another version stays valid, while one of its own families at another version is stale."""
    from models import cnn
    untuned = next(iter(_graphs(cnn(), (64, 1, 28, 28)).values()))
    sub, spec = [(s, k) for s, k in _kernels(untuned) if k.kind == "conv2d"][-1]
    versions = cpp_choices.TABLE.versions(sub, spec)
    assert "bf16" in cpp_choices.TABLE.families and "bf16" not in versions
    assert {f for f, _ in cpp_choices.candidates(sub, spec)} == set(versions)
    bf16_version = cpp_choices.TABLE.families["bf16"].version
    other = TuningDB(tmp_path / "other")
    _, _, choice = _conv2_record(untuned, other, versions={**versions, "bf16": bf16_version + 1})
    with tuning_db.using(other):
        assert _conv_choices(next(iter(_graphs(cnn(), (64, 1, 28, 28)).values())))[1] == choice
    own = next(iter(versions))
    stale = TuningDB(tmp_path / "stale")
    _conv2_record(untuned, stale, versions={**versions, own: versions[own] + 1})
    assert stale.lookup("cpu", cpp_choices.device_name(), cpp_choices.TABLE.key(sub, spec), versions) is None


# --------------------------------------------------------------------------- forcing, the device

def test_forcing_a_family_serves_every_kernel_it_applies_to_or_is_refused_in_one_line():
    from models import mlp
    with cpp_choices.force(matmul="matmul_axpy"):
        graphs = _graphs(mlp(), (64, 784))
    assert {s.choice[0] for g in graphs.values() for _, s in _kernels(g) if s.kind == "matmul"} == {"matmul_axpy"}
    with cpp_choices.force("matmul_dot"), pytest.raises(ValueError) as info:
        _graphs(mlp(), (64, 784))  # the backward matmuls are not x @ W^T
    assert "forced family 'matmul_dot' does not apply: it needs a (M, K) @ b (N, K)^T" in str(info.value)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="no CPU kernel family 'fastest'"):
        with cpp_choices.force("fastest"):
            pass


def test_the_device_name_is_the_vector_variant_and_the_steps_thread_count():
    gomp = ctypes.CDLL("libgomp.so.1")
    before = gomp.omp_get_max_threads()
    try:
        for n in (1, 3):
            gomp.omp_set_num_threads(n)
            name = cpp_choices.device_name(cpu_vector.AVX2)
            assert re.fullmatch(rf"[a-z0-9_]+-avx2/{n}t", name), name
    finally:
        gomp.omp_set_num_threads(before)
    assert cpp_choices.device_name(cpu_vector.AVX512).split("/")[0].endswith("-avx512")
