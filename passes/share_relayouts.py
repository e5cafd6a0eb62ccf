"""Sharing relaid operands between kernels: a grad-weight convolution reads the images of x and dy
that the forward and the grad-input of the same layer already relaid into their scratch, instead
of relaying them again.

The channels-innermost convolution families (CUDA `nhwc_tc` / `nhwc_wg`) copy their NCHW source to
a bordered NHWC image at the start of their scratch block before their GEMM: the forward x, the
grad-input dy. A training step's grad-weight of the layer reads both x and dy, and relaid them
once more (airbench's bf16 step at batch 1024: about 0.3 ms each of relayouts of the same bytes).
This pass pairs each grad-weight with a forward on the same x node and a grad-input on the same
dy node, and asks the target whether the grad-weight can read that kernel's image
(`Target.shared_relayout`: the same image size, border, element and families). Where it can,
the grad-weight's `KernelSpec` takes the target's choice and scratch size, its `why` says so, and
`notes["reads_scratch_of"]` maps the image's launch role to the kernel holding it: the schedule
runs that kernel first, the memory plan keeps its scratch live until its last reader
(`plan_memory`), the stream placement orders writers of it after the reader (`cuda_streams`),
and codegen binds the reader's image argument to that scratch block.

Runs after `select` (the choices are known) and before `schedule` and `memory`.
"""
from __future__ import annotations

import dataclasses

import networkx as nx

from ember.ir import Graph

from .targets import Target

#: the kinds whose images a grad-weight may read, by the operand role both read
OWNERS = {"x": "conv2d", "dy": "conv2d_grad_input"}


def share_relayouts(graph: Graph, target: Target) -> Graph:
    """The graph with each grad-weight that can read another kernel's relaid operand marked to (see
    the module docstring); unchanged where the target shares nothing."""
    if target.shared_relayout is None:
        return graph
    out = graph.copy()
    owners: dict[tuple[str, int], list[int]] = {}  # (role, the operand's node) -> kernels relaying it
    readers = []
    for n in out.g:
        if out.op(n) != "fused":
            continue
        spec = out.attrs(n)["kernel"]
        if spec.kind == "conv2d_grad_weight":
            readers.append(n)
        for role, kind in OWNERS.items():
            if spec.kind == kind and spec.role(role) is not None:
                owners.setdefault((role, out.operands(n)[spec.role(role)]), []).append(n)
    # the data edges and the orderings accepted so far: an owner must be able to run before its
    # reader, so the reader may not reach it (a path would close a cycle with the schedule's edge)
    order = nx.DiGraph(out.g)
    for n in readers:
        for role in OWNERS:
            spec, sub = out.attrs(n)["kernel"], out.attrs(n)["graph"]
            for owner in owners.get((role, out.operands(n)[spec.role(role)]), ()):
                if nx.has_path(order, n, owner):
                    continue
                shared = target.shared_relayout(out.attrs(owner)["graph"], out.attrs(owner)["kernel"], sub, spec)
                if shared is None:
                    continue
                image, choice, scratch = shared
                out.attrs(n)["kernel"] = dataclasses.replace(
                    spec, choice=choice, scratch_bytes=int(scratch),
                    why=f"{spec.why}; {role}'s relaid image read from the scratch of %{owner} "
                        f"({out.attrs(owner)['graph'].name})")
                out.notes(n)["reads_scratch_of"] = {**out.notes(n).get("reads_scratch_of", {}), image: owner}
                order.add_edge(owner, n)
                break
    return out
