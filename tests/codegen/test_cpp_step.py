"""The compiled step as a whole: cache hits and rebuilds, compile errors, input checking."""
from __future__ import annotations

import os
import re

import numpy as np
import pytest

from ember.codegen import compiler
from ember.codegen import cpp as cpp_codegen
from ember.frontends import compile, nn, optim

from models import cnn, mlp

RTOL32 = 1e-5   # float32 losses of the same step on two devices (summation order differs; measured ~1e-7)
PARAM_TOL = dict(rtol=1e-5, atol=1e-6)  # float32 parameters after a few steps from the same weights


def _step(batch: int = 8):
    x = np.zeros((batch, 784), np.float32)
    y = np.zeros(batch, np.int64)
    return compile(mlp(), nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example_inputs=(x, y), device="cpu")


def test_second_compile_hits_the_cache_and_a_corrupt_library_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    compiler.reset_cache_stats()
    first = _step()
    units = len(first._example_step()[1].source.units)
    assert units >= 3  # the entry, the matmuls, the cheap kernels' groups
    assert compiler.cache_stats("cpp") == {"hits": 0, "misses": 1, "rebuilds": 0}
    assert compiler.cache_stats("obj") == {"hits": 0, "misses": units, "rebuilds": 0}
    second = _step()
    assert compiler.cache_stats("cpp")["hits"] == 1 and compiler.cache_stats("obj")["hits"] == units
    assert second.compile_stats["objects_cached"] == units and second.compile_stats["link_cached"]
    path = first._example_step()[1].artifact.path
    # A truncated entry, written as a new file: the loaded library's own pages stay mapped.
    damaged = path.with_name("damaged.tmp")
    damaged.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    os.replace(damaged, path)
    third = _step()
    assert compiler.cache_stats("cpp")["rebuilds"] == 1 and compiler.cache_stats("obj")["hits"] == 2 * units
    x, y = np.random.default_rng(0).random((8, 784), dtype=np.float32), np.arange(8) % 10
    reference = compile(mlp(), nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example_inputs=(x, y), device="reference")
    np.testing.assert_allclose(third(x, y), reference(x, y), rtol=RTOL32)  # the rebuilt library computes the step


def test_a_template_that_does_not_compile_names_the_source_and_the_error(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    real = cpp_codegen.render_pointwise

    def broken(*args, **kwargs):
        return real(*args, **kwargs).replace("out[i] =", "out[i] = undefined_symbol +", 1)

    monkeypatch.setattr(cpp_codegen, "render_pointwise", broken)
    with pytest.raises(compiler.CompileError) as info:
        _step()
    message = str(info.value)
    assert "undefined_symbol" in message and "source kept at:" in message
    assert info.value.source_path.exists() and "undefined_symbol" in info.value.source_path.read_text()
    # the failing unit is named with the graph's kernels it holds (the units compile in parallel)
    assert "'step.eg_" in message and "_pointwise" in message.splitlines()[0]


def _two_same_convs(classes: int = 10):
    nn.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, classes))


def _compile_cnn(model):
    x, y = np.zeros((4, 3, 6, 6), np.float32), np.zeros(4, np.int64)
    return compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example_inputs=(x, y), device="cpu")


def test_identical_kernels_are_one_function_called_with_different_buffers(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    step = _compile_cnn(_two_same_convs())
    src = step._example_step()[1].source
    defined = re.findall(r"^EMBER_KERNEL void (ek_[0-9a-f]{12})\(", src.code, flags=re.M)  # definitions: one each
    assert len(defined) == len(set(defined)) == len(src.functions) < len(src.kernels)
    calls = [k.function for k in src.kernels]
    assert sorted(set(calls)) == sorted(defined)
    # the second and third convolutions (same shapes, bias and ReLU) are one kernel, called twice
    convs = [k for k in src.kernels if k.kind.startswith("conv2d ")]
    assert len(convs) == 3 and convs[1].function == convs[2].function != convs[0].function
    assert convs[1].call != convs[2].call  # with different buffers
    # each call still names the graph nodes it implements: in the entry's dumped note and the
    # one-file form; the compiled entry names no source line (another batch size's inputs are
    # traced elsewhere: the same entry serves both)
    entry, note = src.units[0].source, src.units[0].note
    for k in convs:
        assert f"// call {k.index} {k.name}: conv2d" in entry and f"// call {k.index} {k.name}\n" in src.code
        assert k.implements and all(f"//     implements {line}" in note and f"//   implements {line}" in src.code
                                    and line not in entry for line in k.implements)
    x, y = np.random.default_rng(0).random((4, 3, 6, 6), dtype=np.float32), np.arange(4) % 10
    reference = compile(_two_same_convs(), nn.CrossEntropyLoss(), optim.SGD(lr=0.1),
                        example_inputs=(x, y), device="reference")
    for _ in range(2):
        np.testing.assert_allclose(step(x, y), reference(x, y), rtol=RTOL32)


def test_profile_times_every_call_also_of_a_shared_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    x, y = np.random.default_rng(0).random((4, 3, 6, 6), dtype=np.float32), np.arange(4) % 10
    step = compile(_two_same_convs(), nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example_inputs=(x, y),
                   device="cpu", profile=True)
    src = step._example_step()[1].source
    step(x, y)
    times = step.kernel_times()
    assert [name for name, _, _ in times] == [k.name for k in src.kernels]  # per call, by the graph's names
    assert all(sec > 0 for _, _, sec in times) and all(what.startswith("%") for _, what, _ in times)
    convs = [k for k in src.kernels if k.kind.startswith("conv2d ")]
    assert convs[1].function == convs[2].function and times[convs[1].index][2] != times[convs[2].index][2]


def test_a_model_that_differs_in_one_layer_rebuilds_only_the_units_that_changed(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    first = _compile_cnn(_two_same_convs())
    compiler.reset_cache_stats()
    second = _compile_cnn(_two_same_convs(classes=12))  # the head and the loss change; the convolutions do not
    before = {u.source for u in first._example_step()[1].source.units}
    after = second._example_step()[1].source.units
    changed = [u for u in after if u.source not in before]
    assert 0 < len(changed) < len(after) and compiler.cache_stats("obj") == {
        "hits": len(after) - len(changed), "misses": len(changed), "rebuilds": 0}
    assert second.compile_stats["objects_built"] == len(changed)
    assert not any(u.name.startswith("ek_") and "conv2d" in u.what for u in changed)  # every convolution reused


def test_inputs_are_checked_against_the_compiled_signature():
    step = _step()
    executor = step._example_step()[1]
    with pytest.raises(TypeError, match=r"input 'x': expected f32\[8,784\], got f64\[8,784\]"):
        executor({"x": np.zeros((8, 784)), "y": np.zeros(8, np.int64)})
    with pytest.raises(TypeError, match=r"input 'y': expected i64\[8\], got i64\[9\]"):
        executor({"x": np.zeros((8, 784), np.float32), "y": np.zeros(9, np.int64)})
    with pytest.raises(TypeError, match="missing"):
        executor({"x": np.zeros((8, 784), np.float32)})


def test_partial_batch_gets_its_own_cached_step_sharing_parameters():
    step = _step(8)
    x = np.zeros((8, 784), np.float32)
    reference = compile(mlp(), nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example_inputs=(x, np.zeros(8, np.int64)), device="reference")
    rng = np.random.default_rng(1)
    for n in (8, 3, 8):  # full, partial, full: the partial step trained the same weights
        xb, yb = rng.random((n, 784), dtype=np.float32), rng.integers(0, 10, n)
        np.testing.assert_allclose(step(xb, yb), reference(xb, yb), rtol=RTOL32)
    assert len(step._steps) == 2
    for k, v in reference.state_dict().items():
        np.testing.assert_allclose(step.state_dict()[k], v, **PARAM_TOL, err_msg=k)


@pytest.mark.parametrize("opt", [
    lambda: optim.SGD(lr=0.1, momentum=0.9),
    lambda: optim.SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    lambda: optim.Adam(lr=1e-2),
    lambda: optim.AdamW(lr=1e-2, weight_decay=0.1),
], ids=["momentum", "nesterov-wd", "adam", "adamw"])
def test_optimizers_on_cpu_match_the_reference(opt):
    """Optimizer state (momentum buffers, Adam moments, the step count) and weight decay,
    compiled, against the interpreter from the same weights over four steps."""
    rng = np.random.default_rng(3)
    batches = [(rng.random((8, 784), dtype=np.float32), rng.integers(0, 10, 8)) for _ in range(4)]
    runs = {d: compile(mlp(), nn.CrossEntropyLoss(), opt(), example_inputs=batches[0], device=d) for d in ("reference", "cpu")}
    for x, y in batches:
        np.testing.assert_allclose(runs["cpu"](x, y), runs["reference"](x, y), rtol=RTOL32)
    for k, v in runs["reference"].state_dict().items():
        np.testing.assert_allclose(runs["cpu"].state_dict()[k], v, **PARAM_TOL, err_msg=k)
    for k, v in runs["reference"].optimizer_state_dict().items():
        np.testing.assert_allclose(runs["cpu"].optimizer_state_dict()[k], v, **PARAM_TOL, err_msg=k)


_THREADS_SCRIPT = """
import numpy as np, sys
sys.path.insert(0, sys.argv[1])
from models import cnn
from ember.codegen import tuning_db
from ember.frontends import compile, nn, optim
rng = np.random.default_rng(0)
batches = [(rng.random((16, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, 16)) for _ in range(3)]
# no tuning database: its records and prior are per thread count (other kernels, other sums)
with tuning_db.using(None):
    step = compile(cnn(), nn.CrossEntropyLoss(), optim.SGD(lr=0.05), example_inputs=batches[0], device="cpu")
print(repr([step(x, y) for x, y in batches]), repr(float(np.abs(step.state_dict()["5.weight"]).sum())))
"""


def test_whole_cnn_step_is_bit_identical_with_1_and_2_threads():
    """Determinism does not depend on the thread count: every kernel splits work so that each
    output's summation order is fixed, so a whole CNN step gives the same bits on 1 and 2 threads
    (the same kernels: compiled without the tuning database, whose records are per thread count)."""
    import subprocess
    import sys
    from pathlib import Path
    tests = str(Path(__file__).resolve().parents[1])
    out = {}
    for n in ("1", "2"):
        env = {**os.environ, "OMP_NUM_THREADS": n}
        r = subprocess.run([sys.executable, "-c", _THREADS_SCRIPT, tests], env=env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr
        out[n] = r.stdout
    assert out["1"] == out["2"]


def test_kernel_naming_marks_the_same_words_as_the_regex():
    """`cpp_units._mark_name` finds the kernel's name with str.find: it must mark exactly the
    whole words `<name>` and `ember_k_<name>` that `\\b(ember_k_)?<name>\\b` matches."""
    import random
    from ember.codegen.cpp_units import _PLACEHOLDER, _mark_name
    rng = random.Random(0)
    pieces = ["k1", "k1_x", "_", "ember_k_", "ember_", " ", "(", ")", "1", "a", "é", "x"]
    for _ in range(20000):
        name = rng.choice(["k1", "k1_x", "_k1", "ember_k_k1", "k1_"])
        code = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        want = re.sub(rf"\b(ember_k_)?{re.escape(name)}\b", lambda m: (m.group(1) or "") + _PLACEHOLDER, code)
        assert _mark_name(code, name) == want, (code, name)


def test_contraction_units_are_handed_over_as_generated_and_no_unit_parses_cmath(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    nn.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 6 * 6, 10), nn.LogSoftmax(dim=1))
    step = _compile_cnn(model)
    executor = step._example_step()[1]
    units = executor.source.units
    # BatchNorm's sqrt and the rest are the prelude's builtins: <cmath> (0.1 s of parsing) in no unit
    assert not any("std::" in u.source or "<cmath>" in u.source for u in units)
    handed: list = []
    again = cpp_codegen.render_step(executor.graph, on_unit=lambda unit, headers: handed.append((unit, headers)))
    alone = {u.name: u for u in units if u.name.startswith("ek_")}
    assert alone and sorted(u.name for u, _ in handed) == sorted(alone)  # each contraction, once
    for unit, headers in handed:
        final = alone[unit.name]
        assert (unit.source, unit.flags) == (final.source, final.flags) and headers == again.headers
