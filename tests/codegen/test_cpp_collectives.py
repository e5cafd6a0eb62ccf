"""The CPU backend has no communicator: a step holding a collective is refused by name."""
from __future__ import annotations

import re

import pytest

from ember.codegen.cpp import render_step
from ember.ir import Graph, TensorType
from ember.passes.fusion import fuse
from ember.passes.memory import plan_memory


def test_cpu_codegen_refuses_all_reduce_with_a_clear_message():
    g = Graph("dp")
    x = g.add_input("x", TensorType((4, 4)))
    r = g.add("all_reduce", [g.add("exp", [x])], reduce="mean", loc="train.py:12")
    g.set_output("y", g.add("neg", [r]))
    planned = plan_memory(fuse(g))
    with pytest.raises(NotImplementedError, match=re.escape("the CPU backend cannot compile 'all_reduce'")) as e:
        render_step(planned)
    message = str(e.value)
    assert "collectives need a communicator" in message
    assert "group='world', reduce='mean'" in message and "train.py:12" in message
