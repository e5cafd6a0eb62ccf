"""A CPU step holding collectives is compiled as segments: the kernels between two collectives
form one `ember_segment` case, and the collectives are left to the runtime's communicator
(recorded on the StepSource, those with no kernel between them at one boundary)."""
from __future__ import annotations

from ember.codegen.cpp import render_step
from ember.ir import Graph, TensorType
from ember.passes.fusion import fuse
from ember.passes.memory import plan_memory


def test_cpu_codegen_splits_the_step_at_collectives():
    g = Graph("dp")
    x = g.add_input("x", TensorType((4, 4)))
    e = g.add("exp", [x])
    r1 = g.add("all_reduce", [e], reduce="mean", loc="train.py:12")
    r2 = g.add("all_reduce", [e], reduce="sum")
    g.set_output("y", g.add("neg", [g.add("add", [r1, r2])]))
    src = render_step(plan_memory(fuse(g)))
    assert len(src.segments) == 2 and len(src.collectives) == 1
    assert sorted(a["reduce"] for _, _, a in src.collectives[0]) == ["mean", "sum"]
    assert "void ember_segment(void* const* ext, char* arena, const int64_t* dims, int64_t segment)" in src.code
    assert "void ember_step(" not in src.code
