"""CUDA column sums row by row (the `columns` family), without a GPU.

A reduction of float sums over the leading axes into contiguous outputs (a bias's or LayerNorm's
parameter gradients over [rows, features]) is read by the general reduction kernels with a row's
stride an output. The `columns` family walks rows instead: a block is 32 adjacent outputs by 8
row lanes, split along the rows, the last block of a tile adding the double partials in split
order. It is taken where the tuner measured it faster, never by default. Here its launches run
on the CPU through the kernels' own source (cuda_emulator.py) against the interpreter, at one
split and several, twice over the same counters; and its source compiles with nvcc."""
from __future__ import annotations

import numpy as np
import pytest

import cuda_emulator
from ember.codegen import cuda, cuda_choices
from ember.codegen.cuda_kernels import counter_words
from ember.ir import run as interpret
from models import plan_for
from nvcc import assert_compiles, nvcc_or_skip
from test_cpp_column_sums import _layer_norm_grads

rng = np.random.default_rng(11)


def _planned(shape, axes):
    g = _layer_norm_grads(shape, axes)
    planned = plan_for(g, "cuda")
    (node,) = [n for n in planned.g if planned.op(n) == "fused" and planned.attrs(n)["kernel"].kind == "reduction"]
    return g, planned.attrs(node)["graph"], planned.attrs(node)["kernel"]


def _inputs(sub):
    inputs = {k: rng.standard_normal(sub.type(n).shape).astype(np.float32) for k, n in sub.inputs.items()}
    for k, n in sub.inputs.items():  # the per-row divisor (std): away from zero
        if sub.type(n).numel < max(sub.type(m).numel for m in sub.inputs.values()) and sub.type(n).shape[-1] == 1:
            inputs[k] = rng.uniform(0.5, 2.0, inputs[k].shape).astype(np.float32)
    return inputs


def _run(kernel, sub, inputs, lib, counters=None):
    bufs = dict(inputs, **{k: np.full(sub.type(n).shape, np.nan, np.float32) for k, n in sub.outputs.items()})
    if counters is not None:
        bufs.update(counters)
    cuda_emulator.run(lib, 0, kernel, bufs)
    return {k: bufs[k] for k in sub.outputs}


@pytest.mark.parametrize("shape,axes,splits", [((37, 19), (0,), 1), ((37, 19), (0,), 4), ((64, 70), (0,), 3),
                                               ((5, 3, 130), (0, 1), 2), ((7, 16, 64), (0, 1), 5)])
def test_column_sums_row_by_row_give_the_interpreters_values_at_one_split_and_several(shape, axes, splits, tmp_path):
    _, sub, spec = _planned(shape, axes)
    choice = ("columns", (("splits", splits),))
    kernel = cuda_choices.render(sub.name, sub, spec, choice)
    assert "row by row" in kernel.code and kernel.scratch_bytes == cuda_choices.scratch_bytes(sub, spec, choice)
    rows = int(np.prod([shape[a] for a in axes]))
    outputs = int(np.prod(shape)) // rows
    (launch,) = kernel.launches
    made, _ = cuda.column_split_plan(rows, splits)
    assert launch.grid == (-(-outputs // cuda.COLUMN_TILE), made, 1) and made == min(splits, rows)
    counter_roles = [r for r in launch.args if counter_words(r) is not None]
    assert (kernel.scratch_bytes > 0) == (made > 1) and len(counter_roles) == (made > 1)
    inputs = _inputs(sub)
    want = interpret(sub, inputs).outputs
    lib = cuda_emulator.build([kernel], tmp_path, "columns")
    counters = {r: np.zeros(counter_words(r), np.uint32) for r in counter_roles}
    runs = []
    for _ in range(2):  # the same counters twice: each run leaves them zero, the second gives the same bits
        runs.append(_run(kernel, sub, inputs, lib, counters))
        assert not any(c.any() for c in counters.values()), counters
    for k, v in want.items():
        np.testing.assert_allclose(runs[0][k], v, rtol=1e-5, atol=1e-6 * np.sqrt(rows), err_msg=k)
        np.testing.assert_array_equal(runs[0][k], runs[1][k], err_msg=k)


def test_a_column_sum_is_the_general_kernel_unless_measured_and_other_reductions_have_no_columns_family():
    """No record names `columns`: the cost model keeps the general family (no step changes); a
    sum over the last axis, or into fewer than 16 outputs, is no column sum."""
    _, sub, spec = _planned((64, 70), (0,))
    families = [f for f, _ in cuda_choices.candidates(sub, spec)]
    assert families[0] == "reduction" and "columns" in families and spec.choice[0] == "reduction"
    g = cuda_choices.TABLE._geometry(sub, spec)
    assert (g["rows"], g["outputs"], g["sums"]) == (64, 70, 2)
    plans = [p for f, p in cuda_choices.candidates(sub, spec) if f == "columns"]
    assert len(plans) == len(set(plans)) >= 2 and all(cuda_choices.FAMILIES["columns"].fits(g, p) for p in plans)
    for shape, axes in (((64, 70), (1,)), ((64, 8), (0,))):
        _, sub, spec = _planned(shape, axes)
        assert [f for f, _ in cuda_choices.candidates(sub, spec)] == ["reduction"], (shape, axes)


def test_a_forced_columns_choice_is_what_the_step_renders(tmp_path):
    """Forced (as a tuning record would pick it), the step's source has the row-by-row kernel with
    its counters launch role, and its scratch is what select reserved."""
    g = _layer_norm_grads((300, 40), (0,))
    with cuda_choices.force(reduction="columns"):
        planned = plan_for(g, "cuda")
    source = cuda.render_step(planned)
    (node,) = [n for n in planned.g if planned.op(n) == "fused" and planned.attrs(n)["kernel"].kind == "reduction"]
    spec = planned.attrs(node)["kernel"]
    assert spec.choice[0] == "columns" and "row by row" in source.code
    (launch,) = [la for la in source.launches if la.kernel.startswith(planned.attrs(node)["graph"].name)]
    assert any(counter_words(role) == 2 for role, _ in launch.args[len(planned.operands(node)) + 2:])


@pytest.mark.parametrize("splits", [1, 6])
def test_the_columns_kernel_compiles_with_nvcc(splits, tmp_path):
    nvcc = nvcc_or_skip()
    _, sub, spec = _planned((7, 16, 64), (0, 1))
    kernel = cuda_choices.render(sub.name, sub, spec, ("columns", (("splits", splits),)))
    src = tmp_path / "columns.cu"
    src.write_text(cuda.prelude() + kernel.code)
    assert_compiles(nvcc, src)


@pytest.mark.cuda
@pytest.mark.parametrize("shape,axes,splits", [((37, 19), (0,), 1), ((64, 70), (0,), 3), ((7, 16, 64), (0, 1), 5),
                                               ((16384, 64), (0,), 170)])
def test_column_sums_on_the_gpu(shape, axes, splits):
    """The same kernels on a device (the last: ViT's LayerNorm sums at batch 1024 with its cost
    model's plan): outputs and scratch poisoned with NaN, two runs over the same counters
    bit-identical and leaving them zero."""
    cp = pytest.importorskip("cupy")
    import cuda_refs
    _, sub, spec = _planned(shape, axes)
    kernel = cuda_choices.render(sub.name, sub, spec, ("columns", (("splits", splits),)))
    inputs = _inputs(sub)
    want = interpret(sub, inputs).outputs
    module = cuda_refs.compile_module(cp, [cuda.prelude(), kernel.code])
    (launch,) = kernel.launches
    counters = {r: cp.zeros(counter_words(r), cp.uint32) for r in launch.args if counter_words(r) is not None}
    bufs = {**{k: cp.asarray(v) for k, v in inputs.items()}, **counters}
    runs = []
    for _ in range(2):
        bufs.update({k: cp.full(sub.type(n).shape, np.nan, cp.float32) for k, n in sub.outputs.items()})
        scratch = cp.full(max(kernel.scratch_bytes // 4, 1), np.nan, cp.float32)
        cuda_refs.run_launches(cp, module, kernel, bufs, scratch)
        runs.append({k: cp.asnumpy(bufs[k]) for k in sub.outputs})
        assert not any(int(c.any()) for c in counters.values())
    rows = int(np.prod([shape[a] for a in axes]))
    for k, v in want.items():
        np.testing.assert_allclose(runs[0][k], v, rtol=1e-5, atol=1e-6 * np.sqrt(rows), err_msg=k)
        np.testing.assert_array_equal(runs[0][k], runs[1][k], err_msg=k)


@pytest.mark.cuda
def test_the_tuner_measures_both_families_of_a_two_output_column_sum(tmp_path):
    """LayerNorm's weight and bias gradients are one kernel of two outputs: the tuner's measurer
    makes and checks every output, so the `columns` candidates are measured, none refused."""
    from ember.codegen import tuning_db
    from ember.runtime.tuner import tune_graph
    from ember.runtime.tuner_cuda import CudaMeasurer
    planned = plan_for(_layer_norm_grads((4096, 64), (0,)), "cuda")
    db = tuning_db.TuningDB(tmp_path)
    report = tune_graph(planned, table=cuda_choices.TABLE, measurer=CudaMeasurer(), db=db, budget_s=120)
    (k,) = [k for k in report.kernels if k.kind == "reduction" and k.status == "measured"]
    assert not k.rejected, k.rejected
    rec = db.lookup("cuda", cuda_choices.TABLE.device(), k.key, {})
    assert {c.split("(")[0] for c in rec.timings_us} >= {"reduction", "columns"}, rec.timings_us
