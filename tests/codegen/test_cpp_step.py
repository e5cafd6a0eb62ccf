"""The compiled step as a whole: cache hits and rebuilds, compile errors, input checking."""
from __future__ import annotations

import os

import numpy as np
import pytest

from ember.codegen import compiler
from ember.codegen import cpp as cpp_codegen
from ember.frontends import compile, nn, optim

from models import mlp


def _step(batch: int = 8):
    x = np.zeros((batch, 784), np.float32)
    y = np.zeros(batch, np.int64)
    return compile(mlp(), nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example_inputs=(x, y), device="cpu")


def test_second_compile_hits_the_cache_and_a_corrupt_library_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    compiler.reset_cache_stats()
    first = _step()
    assert compiler.cache_stats()["misses"] == 1 and compiler.cache_stats()["hits"] == 0
    _step()
    assert compiler.cache_stats()["hits"] == 1
    path = first._steps[first._example][1].artifact.path
    # A truncated entry, written as a new file: the loaded library's own pages stay mapped.
    damaged = path.with_name("damaged.tmp")
    damaged.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    os.replace(damaged, path)
    third = _step()
    assert compiler.cache_stats()["rebuilds"] == 1
    x = np.random.default_rng(0).random((8, 784), dtype=np.float32)
    assert np.isfinite(third(x, np.arange(8) % 10))


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


def test_inputs_are_checked_against_the_compiled_signature():
    step = _step()
    executor = step._steps[step._example][1]
    with pytest.raises(TypeError, match=r"input 'x': expected f32\[8,784\], got f64\[8,784\]"):
        executor({"x": np.zeros((8, 784)), "y": np.zeros(8, np.int64)})
    with pytest.raises(TypeError, match=r"input 'y': expected i64\[8\], got i64\[9\]"):
        executor({"x": np.zeros((8, 784), np.float32), "y": np.zeros(9, np.int64)})
    with pytest.raises(TypeError, match="missing"):
        executor({"x": np.zeros((8, 784), np.float32)})


def test_partial_batch_gets_its_own_cached_step_sharing_parameters():
    step = _step(8)
    rng = np.random.default_rng(1)
    step(rng.random((8, 784), dtype=np.float32), rng.integers(0, 10, 8))
    before = step.state_dict()["0.weight"].copy()
    step(rng.random((3, 784), dtype=np.float32), rng.integers(0, 10, 3))
    assert len(step._steps) == 2
    assert not np.array_equal(step.state_dict()["0.weight"], before)  # the partial step trained the same weights
