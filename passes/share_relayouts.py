"""Sharing relaid operands between kernels: a grad-weight convolution reads the image of x that the
forward convolution of the same x already relaid into its scratch, instead of relaying x again.

The channels-innermost convolution families (CUDA `nhwc_tc` / `nhwc_wg`) copy their NCHW source to
a bordered NHWC image at the start of their scratch block before their GEMM. A training step's
forward and grad-weight of one layer both read x, so a step relaid every such x twice (airbench's
bf16 step at batch 1024: about 0.3 ms of relayouts of the same bytes). This pass pairs each
grad-weight with a forward on the same x node that precedes it, and asks the target whether the
grad-weight can read the forward's image (`Target.shared_relayout`: the same image size, border,
element and families). Where it can, the grad-weight's `KernelSpec` takes the target's choice and
scratch size, its `why` says so, and its `notes["reads_scratch_of"]` names the forward: the memory
plan keeps that forward's scratch live until its last reader (`plan_memory`), the stream placement
orders writers of it after the reader (`cuda_streams`), and codegen binds the reader's image
argument to the forward's scratch block.

Runs after `select` (the choices are known) and before `schedule` and `memory`.
"""
from __future__ import annotations

import dataclasses

import networkx as nx

from ember.ir import Graph

from .targets import Target


def share_relayouts(graph: Graph, target: Target) -> Graph:
    """The graph with each grad-weight that can read its forward's relaid x marked to (see the
    module docstring); unchanged where the target shares nothing."""
    if target.shared_relayout is None:
        return graph
    out = graph.copy()
    forwards: dict[int, list[int]] = {}  # x's node -> the forward convolutions reading it
    readers = []
    for n in out.g:
        if out.op(n) != "fused":
            continue
        spec = out.attrs(n)["kernel"]
        x = spec.role("x")
        if x is None or spec.kind not in ("conv2d", "conv2d_grad_weight"):
            continue
        if spec.kind == "conv2d":
            forwards.setdefault(out.operands(n)[x], []).append(n)
        else:
            readers.append(n)
    after: dict[int, set[int]] = {}
    for n in readers:
        spec, sub = out.attrs(n)["kernel"], out.attrs(n)["graph"]
        for f in forwards.get(out.operands(n)[spec.role("x")], ()):
            if f not in after:
                after[f] = nx.descendants(out.g, f)
            if n not in after[f]:  # its image must be written before the reader runs
                continue
            shared = target.shared_relayout(out.attrs(f)["graph"], out.attrs(f)["kernel"], sub, spec)
            if shared is None:
                continue
            choice, scratch = shared
            out.attrs(n)["kernel"] = dataclasses.replace(
                spec, choice=choice, scratch_bytes=int(scratch),
                why=f"{spec.why}; x's relaid image read from the scratch of %{f} ({out.attrs(f)['graph'].name})")
            out.notes(n)["reads_scratch_of"] = f
            break
    return out
