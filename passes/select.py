"""Kernel selection: which kernel family and plan serves each fused node, and its scratch size,
asked of the target before memory planning.

A target with a choice table (`Target.choose_kernel`: `codegen/cuda_choices`, `codegen/cpp_choices`)
answers (family, plan, scratch bytes, why) per kernel: from the tuning database where it holds a
measurement of this kernel on this device, else from the target's cost model (`codegen/choices`).
The pass stamps that on the node's `KernelSpec` (`choice`, `scratch_bytes`, `why`), so dumps show
it and codegen renders exactly it, once. A target
without one is asked the scratch size alone (`Target.kernel_scratch`).

A step compiled after another of the same model at another batch size carries that step's
reusable plans (`meta["kernel_reuse"]`, from `Target.reusable`): the target takes them where they
fit, before the tuning database and the cost model, so the new step's kernels are the same code
and their compiled objects are shared.

The step's precision (`meta["precision"]`, set by the frontend) is stamped here too: under "tf32"
every contraction's spec gets the `tf32` flag, which the target's templates read (and which
changes the tile plan, so the scratch asked for below is that of the kernel that will run).

A contraction template may need scratch memory (per-thread partial sums, split-K partials, packed
panels); how much depends on the template and the shapes, which only the target's code generator
knows. The target record carries that question; this pass asks it for every fused node and
records the answer in the node's `KernelSpec`, so the memory plan can place each kernel's scratch
in the arena and the arena is the step's whole memory.
"""
from __future__ import annotations

import dataclasses

from ember.ir import Graph
from ember.ir.kernel import CONTRACTIONS

from .targets import Target


def select_kernels(graph: Graph, target: Target) -> Graph:
    out = graph.copy()
    precision = out.meta.get("precision", "float32")
    reuse = out.meta.get("kernel_reuse", ())  # plans of a step of another batch size (`Target.reusable`)
    if precision not in target.precisions:
        raise ValueError(f"device {target.name!r} computes in {', '.join(sorted(target.precisions))}, "
                         f"not precision {precision!r}")
    for n in out.g:
        if out.op(n) != "fused":
            continue
        attrs = out.attrs(n)
        spec = attrs["kernel"]
        if precision == "tf32" and spec.kind in CONTRACTIONS and not spec.param("tf32"):
            spec = attrs["kernel"] = dataclasses.replace(spec, params=spec.params + (("tf32", True),))
        if target.choose_kernel is not None:
            chosen = target.choose_kernel(attrs["graph"], spec, **({"reuse": reuse} if reuse else {}))
            if chosen is not None:
                family, plan, scratch, why = chosen
                spec = attrs["kernel"] = dataclasses.replace(spec, choice=(family, tuple(plan)),
                                                             scratch_bytes=int(scratch), why=why)
            continue
        if target.kernel_scratch is None:
            continue
        scratch = int(target.kernel_scratch(attrs["graph"], spec))
        if scratch != spec.scratch_bytes:
            attrs["kernel"] = dataclasses.replace(spec, scratch_bytes=scratch)
    return out
