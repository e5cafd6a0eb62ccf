"""Provenance: every traced node records its module path (`features.0`) and the user's line.

A layer of a Sequential (any built-in module called by ember code) reports the line that
constructed it; a user-defined module's forward reports the line in forward that made the node; a
parameter reports its qualified name and the line that created it (its layer's construction).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from ember.frontends import compile, functional as F, nn, optim, spec, trace
from ember.ir import format_graph
from ember.ir.ops import ShapeError

HERE = Path(__file__).resolve()
SOURCE = HERE.read_text().splitlines()
GOLDEN = HERE.parent / "golden"
sys.path.insert(0, str(HERE.parent))

import cnn_script  # noqa: E402


def line_of(marker: str) -> int:
    hits = [i + 1 for i, line in enumerate(SOURCE) if line.rstrip().endswith(f"# {marker}")]
    assert len(hits) == 1, (marker, hits)
    return hits[0]


def here(marker: str) -> str:
    return f"{HERE.name}:{line_of(marker)}"


def prov(g, n) -> tuple[str, str]:
    """(scope, base-name file:line) of node n."""
    loc = g.loc(n)
    return g.scope(n), (Path(loc.rsplit(":", 1)[0]).name + ":" + loc.rsplit(":", 1)[1]) if loc else None


def by_op(g, op: str) -> list[int]:
    return [n for n in g.topo_order() if g.op(n) == op]


def test_sequential_layers_get_their_index_and_construction_line():
    model = nn.Sequential(nn.Conv2d(1, 4, 3),  # SEQ-CONV
                          nn.ReLU(),  # SEQ-RELU
                          nn.Flatten(),  # SEQ-FLAT
                          nn.Linear(4 * 26 * 26, 10))  # SEQ-LIN
    g = trace(model, spec((2, 1, 28, 28)))  # SEQ-TRACE
    (conv,) = by_op(g, "conv2d")
    assert prov(g, conv) == ("0", here("SEQ-CONV"))
    assert [prov(g, n) for n in by_op(g, "add")] == [("0", here("SEQ-CONV")), ("3", here("SEQ-LIN"))]
    assert prov(g, by_op(g, "relu")[0]) == ("1", here("SEQ-RELU"))
    assert prov(g, by_op(g, "matmul")[0]) == ("3", here("SEQ-LIN"))
    assert prov(g, g.parameters["0.weight"]) == ("0.weight", here("SEQ-CONV"))
    assert prov(g, g.parameters["3.bias"]) == ("3.bias", here("SEQ-LIN"))
    assert prov(g, g.inputs["x"]) == ("", here("SEQ-TRACE"))
    assert not any(g.is_backward(n) for n in g.g)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(8, 6),  # BLOCK-LIN
                                      nn.Tanh())  # BLOCK-TANH
        self.head = nn.Linear(6, 3)  # BLOCK-HEAD
        self.scale = nn.Sequential(nn.ReLU())

    def forward(self, x):
        h = self.features(x)
        h = h * 2.0  # BLOCK-MUL
        return self.head(h)  # BLOCK-CALL-HEAD


def test_nested_sequential_in_a_custom_module():
    g = trace(Block(), spec((5, 8)))
    assert prov(g, by_op(g, "matmul")[0]) == ("features.0", here("BLOCK-LIN"))
    assert prov(g, by_op(g, "tanh")[0]) == ("features.1", here("BLOCK-TANH"))
    # made in the user's forward: that line, the root's path
    (mul,) = by_op(g, "mul")
    assert prov(g, mul) == ("", here("BLOCK-MUL"))
    assert prov(g, g.operands(mul)[1]) == ("", here("BLOCK-MUL"))  # the constant 2.0
    # a built-in layer the user's forward calls: its path, the calling line
    assert prov(g, by_op(g, "matmul")[1]) == ("head", here("BLOCK-CALL-HEAD"))
    assert prov(g, g.parameters["head.weight"]) == ("head.weight", here("BLOCK-HEAD"))
    assert prov(g, g.parameters["features.0.bias"]) == ("features.0.bias", here("BLOCK-LIN"))


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return x + self.fc(x).relu()  # RES-FWD


def test_custom_module_inside_a_sequential_reports_its_forward_line():
    model = nn.Sequential(nn.Linear(4, 4), Residual())
    g = trace(model, spec((2, 4)))
    assert prov(g, by_op(g, "relu")[0]) == ("1", here("RES-FWD"))
    assert prov(g, by_op(g, "add")[-1]) == ("1", here("RES-FWD"))
    assert prov(g, by_op(g, "matmul")[1]) == ("1.fc", here("RES-FWD"))
    assert prov(g, g.parameters["1.fc.weight"])[0] == "1.fc.weight"


class Forgetful(nn.Module):
    def __init__(self):  # never calls super().__init__()
        pass

    def forward(self, x):
        return x * x  # FORGETFUL-FWD


def test_a_module_that_forgets_super_init_still_traces_with_provenance():
    m = Forgetful()  # FORGETFUL-NEW
    assert m._ember_loc.endswith(here("FORGETFUL-NEW"))
    g = trace(nn.Sequential(nn.ReLU(), m), spec((3,)))
    assert prov(g, by_op(g, "mul")[0]) == ("1", here("FORGETFUL-FWD"))


def test_loss_module_nodes_get_its_construction_line_or_the_calling_line():
    model = nn.Linear(4, 3)  # LOSS-MODEL
    criterion = nn.CrossEntropyLoss()  # LOSS-NEW
    step = compile(model, criterion, optim.SGD(lr=0.1), example_inputs=(spec((2, 4)), spec((2,), "int64")), device="reference")
    g = step.train_graph
    (oh,) = by_op(g, "one_hot")
    assert prov(g, oh) == ("CrossEntropyLoss", here("LOSS-NEW"))
    assert prov(g, g.parameters["weight"]) == ("weight", here("LOSS-MODEL"))

    def loss_fn(out, y):
        return criterion(out, y)  # LOSS-CALL

    step = compile(model, loss_fn, optim.SGD(lr=0.1), example_inputs=(spec((2, 4)), spec((2,), "int64")), device="reference")
    (oh,) = by_op(step.train_graph, "one_hot")
    assert prov(step.train_graph, oh) == ("CrossEntropyLoss", here("LOSS-CALL"))

    def functional_loss(out, y):
        return F.cross_entropy(out, y)  # LOSS-F

    step = compile(model, functional_loss, optim.SGD(lr=0.1), example_inputs=(spec((2, 4)), spec((2,), "int64")), device="reference")
    (oh,) = by_op(step.train_graph, "one_hot")
    assert prov(step.train_graph, oh) == ("", here("LOSS-F"))


def test_module_stack_is_cleared_after_an_error_and_outside_tracing():
    bad = nn.Sequential(nn.Linear(3, 2), nn.Linear(5, 1))
    with pytest.raises(ShapeError, match=r"contraction mismatch(.|\n)*in module '1'"):
        trace(bad, spec((1, 3)))
    g = trace(lambda x: x * 3.0, spec((2,)))  # STACK-CLEAR
    (mul,) = by_op(g, "mul")
    assert prov(g, mul) == ("", here("STACK-CLEAR"))


def test_golden_cnn_train_graph_after_simplify_shows_paths_and_lines(tmp_path):
    """The dump of the CNN train graph after simplify (what EMBER_DUMP_DIR writes): module paths,
    `(grad)` on the backward nodes, `optimizer/<param>` on the updates, the user's lines."""
    cnn_script.train_step(tmp_path)
    (d,) = tmp_path.iterdir()
    text = (d / "03-simplify.txt").read_text()
    path = GOLDEN / "cnn_train_simplify.txt"
    if os.environ.get("EMBER_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert str(tmp_path) not in text and str(HERE.parent) not in text  # path-independent
    assert text == path.read_text(), (f"train graph dump differs from {path} (if the change is intended, "
                                      f"regenerate with EMBER_UPDATE_GOLDEN=1):\n{text}")
    step = cnn_script.train_step(None)
    assert format_graph(step.train_graph, show_notes=True) + "\n" == text
    assert "features.2 (grad) cnn_script.py:12" in text and "optimizer/classifier.weight cnn_script.py:15" in text
