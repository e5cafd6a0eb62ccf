"""The pass pipeline: per-target lists, hooks, verification, and dumps (argument and $EMBER_DUMP_DIR)."""
from __future__ import annotations

import numpy as np
import pytest

from ember.ir import Graph, TensorType, VerifyError, run
from ember.passes.optimizer import SGD
from ember.passes.pipeline import build_train_graph, passes_for, run_passes
from ember.passes.simplify import simplify


def _forward() -> Graph:
    g = Graph("fwd")
    x = g.add_input("x", TensorType((4, 3)))
    w = g.add_parameter("w", TensorType((3, 2)))
    y = g.add("mul", [g.add("matmul", [x, w]), g.add_constant(np.float32(1))])  # x@w * 1: simplify's
    g.set_output("out", g.add("sum", [g.add("mul", [y, y])], axes=(0, 1)))
    return g


def test_passes_for_targets() -> None:
    import ember.runtime  # noqa: F401  (registers the backends' targets)
    from ember.passes import targets
    assert targets.names()[:2] == ["reference", "cpu"]
    for target in targets.names():
        names = [name for name, _ in passes_for(target)]
        assert names[0] == "simplify"
    assert [n for n, _ in passes_for("cpu")] == ["simplify", "fusion", "select", "schedule", "memory"]
    passes_for("cpu").append(("extra", simplify))  # a copy: the registry is unchanged
    assert "extra" not in [n for n, _ in passes_for("cpu")]
    with pytest.raises(ValueError, match="unknown device 'tpu'; available: reference, cpu"):
        passes_for("tpu")


def test_hooks_and_dumps(tmp_path) -> None:
    seen = []
    graph = run_passes(_forward(), passes_for("reference"), dump_dir=tmp_path,
                       before=lambda name, g: seen.append(("before", name, len(g))),
                       after=lambda name, g: seen.append(("after", name, len(g))))
    assert seen == [("before", "simplify", 7), ("after", "simplify", len(graph))]
    assert len(graph) == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00-input.dot", "00-input.txt", "01-simplify.dot", "01-simplify.txt"]
    assert (tmp_path / "01-simplify.txt").read_text().startswith("graph fwd {")
    assert (tmp_path / "00-input.dot").read_text().startswith('digraph "fwd"')


def test_build_train_graph_dumps_named_passes_from_the_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("EMBER_DUMP_DIR", str(tmp_path / "dumps"))
    train = build_train_graph(_forward(), SGD(lr=0.1))
    names = sorted(p.name for p in (tmp_path / "dumps").iterdir())
    assert names == ["00-input.dot", "00-input.txt", "01-autodiff.dot", "01-autodiff.txt", "02-optimizer.dot", "02-optimizer.txt"]
    assert "grad:w" in (tmp_path / "dumps" / "01-autodiff.txt").read_text()
    assert set(train.updates) == {"w"} and list(train.outputs) == ["loss"]
    x, w = np.ones((4, 3), np.float32), np.full((3, 2), 0.5, np.float32)
    res = run(train, {"x": x}, {"w": w})
    # loss = sum((x@w)^2) = 8 * 1.5^2; d/dw = 2 * x^T (x@w) = 2 * 4 * 1.5 = 12 per element
    assert float(res.outputs["loss"]) == 18.0
    np.testing.assert_allclose(res.updates["w"], w - 0.1 * 12.0, rtol=1e-6)


def test_no_dumps_without_a_directory(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("EMBER_DUMP_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    run_passes(_forward(), passes_for("reference"))
    assert list(tmp_path.iterdir()) == []


def test_a_pass_that_breaks_the_graph_is_caught() -> None:
    def bad(g: Graph) -> Graph:
        g = g.copy()
        g.outputs["out"] = 10_000  # a dangling output
        return g

    with pytest.raises(VerifyError, match="removed node"):
        run_passes(_forward(), [("bad", bad)])
    with pytest.raises(TypeError, match="returned NoneType"):
        run_passes(_forward(), [("none", lambda g: None)])
