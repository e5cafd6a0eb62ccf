"""CUDA pointwise kernels that take the batch at run time, without a GPU: where the batch is a
pointwise kernel's bound alone, its leading extent is a by-value launch argument, so the kernel is
the same text (the same NVRTC module, which CuPy's cache holds) at every batch size. Kernels with
constants that are counts over the batch, and reductions, hold their sizes (see
`codegen/cuda.render_pointwise`). Numerics run in the CPU emulation of the kernels' own source
(cuda_emulator.py) against the interpreter."""
from __future__ import annotations

import numpy as np
import pytest

import cuda_emulator
from ember.codegen import cuda, cuda_choices
from ember.frontends.training.recipes import build_model
from ember.ir import run
from models import cnn, plan_for, train_graph
from test_multi_output_kernels import _normalise

rng = np.random.default_rng(11)


def _kernels(planned, kind: str) -> dict:
    """name -> (sub, spec) of the fused kernels of `kind` in a planned graph."""
    return {planned.attrs(n)["graph"].name: (planned.attrs(n)["graph"], planned.attrs(n)["kernel"])
            for n in planned.g if planned.op(n) == "fused" and planned.attrs(n)["kernel"].kind == kind}


@pytest.mark.parametrize("shape,axes", [((6, 4, 5, 5), (0, 2, 3)), ((6, 8, 7), (1, 2))])
def test_a_normalisations_pointwise_kernel_is_one_text_for_every_batch(shape, axes, tmp_path):
    """BatchNorm's and LayerNorm's normalize+affine+ReLU kernel reads the statistics, so the batch
    is its bound alone: one text at 6 and 9 images, the batch its argument, the interpreter's
    values at 6. The statistics' reduction holds its sizes."""
    texts = {}
    for batch in (shape[0], 9):
        planned = plan_for(_normalise((batch, *shape[1:]), axes), "cuda")
        ((name, (sub, spec)),) = _kernels(planned, "pointwise").items()
        kernel = cuda_choices.render(name, sub, spec, spec.choice)
        assert [ln.scalars for ln in kernel.launches] == [(("int", batch),)]
        assert f"[{batch}," not in kernel.code  # no type of the batch's size in its comments either
        texts[batch] = kernel.code
        ((rname, (rsub, rspec)),) = _kernels(planned, "reduction").items()
        assert all(ln.scalars == () for ln in cuda_choices.render(rname, rsub, rspec, rspec.choice).launches)
        if batch == shape[0]:
            # positive values: a variance the rsqrt reads is one
            inputs = {k: rng.uniform(0.5, 2.0, sub.type(n).shape).astype(np.float32) for k, n in sub.inputs.items()}
            want = run(sub, inputs).outputs
            bufs = dict(inputs, **{k: np.full(v.shape, np.nan, np.float32) for k, v in want.items()})
            cuda_emulator.run(cuda_emulator.build([kernel], tmp_path, f"norm{len(shape)}"), 0, kernel, bufs)
            for k, v in want.items():
                np.testing.assert_allclose(bufs[k], v, rtol=2e-5, atol=2e-5, err_msg=f"{name}: {k}")
    assert texts[shape[0]] == texts[9]


def test_a_training_steps_pointwise_kernels_are_the_same_modules_at_another_batch():
    """ResNet-8's step at batch 8 and at 5: the pointwise kernels whose bound alone is the batch
    (BatchNorm's normalize, the residual adds, the ReLU masks) take it as their last argument and
    are the same unit text at both sizes (CuPy's cache, keyed by the text, serves the second);
    the others, their parameter updates included, hold their sizes."""
    steps = {}
    for batch in (8, 5):
        planned = plan_for(train_graph(build_model("resnet8"), (batch, 1, 28, 28)), "cuda", simplify=True)
        source = cuda.render_step(planned)
        pointwise = _kernels(planned, "pointwise")
        by_function = {f: code for code, functions in source.units for f in functions}
        units = {la.kernel: by_function[la.function] for la in source.launches}
        with_batch = {la.kernel for la in source.launches if la.scalars and la.kernel in pointwise}
        assert all(la.scalars == (("int", batch),) for la in source.launches if la.kernel in with_batch)
        steps[batch] = (set(pointwise), units, with_batch)
    (pointwise8, units8, batch8), (pointwise5, units5, batch5) = steps[8], steps[5]
    assert batch8 == batch5 and batch8 <= pointwise8 and len(batch8) >= 6, sorted(batch8)
    for name in batch8:
        assert units8[name] == units5[name], name
    assert pointwise8 - batch8  # the updates, and BatchNorm's backward with its 1/(N*H*W)


def _ptx_entries(nvcc: str, source: str, folder) -> dict[str, str]:
    """entry name -> its PTX, of `source` compiled for sm_90 (C++17, as NVRTC compiles it)."""
    import re
    import subprocess
    src, out = folder / "unit.cu", folder / "unit.ptx"
    src.write_text(source)
    r = subprocess.run([nvcc, "-ptx", "-arch=sm_90", "-std=c++17", "-o", str(out), str(src)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    return {m.group(1): m.group(0) for m in re.finditer(r"\.entry (\w+)\(.*?\n\}\n", out.read_text(), re.S)}


def test_an_update_fused_into_a_batch_reduction_contracts_as_the_update_alone(tmp_path):
    """A reduction over the batch whose epilogue is an SGD update (`p - lr * g`, a layer's bias)
    must compute the update as the update's own kernel does, one fma: the data-parallel pass's
    world of one unfuses it and must give the same bits (tests/e2e/test_cuda_data_parallel.py).
    A run-time bound on the loop over the batch broke it once: the compiler, not knowing the loop
    runs, moved the multiply into the loop's exit and left a mul and a sub (a bias 1 ulp off on
    the H200). The same on run-time sizes (a later batch size's kernels, split by their launch's
    count: the compiler is told it is at least 1)."""
    from nvcc import nvcc_or_skip
    nvcc = nvcc_or_skip()
    planned = plan_for(train_graph(cnn(0), (8, 1, 28, 28)), "cuda", simplify=True)
    source = cuda.render_step(planned)
    updates = [n for n in planned.g if planned.op(n) == "fused" and planned.attrs(n)["kernel"].kind == "reduction"
               and any(planned.notes(m).get("storage") == "parameter" for m in planned.results(n))]
    assert len(updates) >= 2  # the biases' gradients, each with its update
    for n in updates:
        sub, spec = planned.attrs(n)["graph"], planned.attrs(n)["kernel"]
        name = sub.name
        (code,) = [code for code, functions in source.units if name in functions]
        ptx = _ptx_entries(nvcc, source.prelude + code, tmp_path)[name]
        assert "fma.rn.f32" in ptx and "sub.f32" not in ptx, f"{name}:\n{ptx[-1500:]}"
        runtime = cuda.render_reduction(name, sub, spec.core, runtime=True)
        for function, ptx in _ptx_entries(nvcc, source.prelude + runtime.code, tmp_path).items():
            assert "fma.rn.f32" in ptx and "sub.f32" not in ptx, f"{function} on run-time sizes:\n{ptx[-1500:]}"
