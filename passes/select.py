"""Kernel selection: each fused node's scratch size, asked of the target before memory planning.

A contraction template may need scratch memory (per-thread partial sums, split-K partials, packed
panels); how much depends on the template and the shapes, which only the target's code generator
knows. The target record carries that question (`Target.kernel_scratch`); this pass asks it for
every fused node and records the answer in the node's `KernelSpec`, so the memory plan can place
each kernel's scratch in the arena and the arena is the step's whole memory.
"""
from __future__ import annotations

import dataclasses

from ember.ir import Graph

from .targets import Target


def select_kernels(graph: Graph, target: Target) -> Graph:
    out = graph.copy()
    if target.kernel_scratch is None:
        return out
    for n in out.g:
        if out.op(n) != "fused":
            continue
        attrs = out.attrs(n)
        spec = attrs["kernel"]
        scratch = int(target.kernel_scratch(attrs["graph"], spec))
        if scratch != spec.scratch_bytes:
            attrs["kernel"] = dataclasses.replace(spec, scratch_bytes=scratch)
    return out
