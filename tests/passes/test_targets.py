"""passes/targets.py: the registry (lookup, registration order, duplicates, unknown names) and
the completeness of every registered record."""
from __future__ import annotations

import pytest

import ember.runtime  # noqa: F401  (registers reference, cpu and cuda)
from ember.passes import targets


def test_lookup_and_unknown_name():
    assert targets.names()[0] == "reference" and {"cpu", "cuda"} <= set(targets.names())
    assert targets.get("cpu").name == "cpu"
    assert [t.name for t in targets.all_targets()] == targets.names()
    with pytest.raises(ValueError, match=r"unknown device 'nope'; available: reference, "):
        targets.get("nope")


def test_register_refuses_a_second_record_unless_replacing():
    toy = targets.Target("toy-registry", "a test target", pipeline=lambda t: [])
    try:
        assert targets.register(toy) is toy and targets.get("toy-registry") is toy
        with pytest.raises(ValueError, match="already registered"):
            targets.register(targets.Target("toy-registry", "another", pipeline=lambda t: []))
        other = targets.register(targets.Target("toy-registry", "another", pipeline=lambda t: []), replace=True)
        assert targets.get("toy-registry") is other
    finally:
        targets.unregister("toy-registry")
    assert "toy-registry" not in targets.names()


@pytest.mark.parametrize("name", ["reference", "cpu", "cuda"])
def test_each_registered_record_is_complete(name):
    t = targets.get(name)
    assert t.description.strip() and "\n" not in t.description
    passes = t.passes()
    assert passes and all(isinstance(n, str) and callable(p) for n, p in passes)
    assert t.alignment > 0 and t.alignment & (t.alignment - 1) == 0
    assert callable(t.executor) and callable(t.storage)
    assert "float32" in t.precisions
    if t.language is not None:  # a code-generating target: its source, scratch and spelling table
        import importlib
        assert callable(t.source) and (callable(t.kernel_scratch) or callable(t.choose_kernel))
        assert hasattr(importlib.import_module(f"ember.codegen.{t.language}"), "SPELLING")
        assert {"fusion", "select", "schedule", "memory"} <= {n for n, _ in passes}
