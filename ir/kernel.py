"""`KernelSpec`: the typed kernel plan that fusion writes on every `fused` node.

Fusion decides what a kernel computes; codegen decides how to spell it. The spec is the whole
contract between the two: the kind of kernel, which template (if any) implements it, the role
of each operand, the epilogues and prologues folded into it, the layouts it reads and writes, its
outputs, and the kernel family, plan and scratch memory the target's kernel selection chose for
it (before memory planning, so the arena covers everything). It is frozen: a pass that changes a decision makes a
new spec with `dataclasses.replace`. The verifier checks it against the fused node's subgraph.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Kinds a fused node may have. Contractions are implemented by templates; pointwise and
# reduction kernels are generated from their subgraphs.
CONTRACTIONS = ("conv2d", "conv2d_grad_input", "conv2d_grad_weight", "matmul")
#: a softmax cross-entropy (mean over the batch) and the gradient of its logits, each one kernel
LOSSES = ("softmax_xent", "softmax_xent_grad")
GENERATED = ("pointwise", "reduction")
#: windowed max pooling and its gradient, one op each (templates like the contractions')
POOLING = ("max_pool2d", "max_pool2d_grad")
#: one collective op (all_reduce) alone: a kernel boundary that a communicator implements
COLLECTIVE = "collective"
KERNEL_KINDS = GENERATED + CONTRACTIONS + POOLING + LOSSES + (COLLECTIVE,)
#: bias: + a per-channel vector; relu: max(., 0); relu_mask: ReLU's backward, where(mask > 0, ., 0)
#: with `mask` (a role: the forward ReLU's output, same shape as the result); pointwise: any
#: elementwise subgraph over the contraction's value (the spec's "epilogue_from" node, read at the
#: output's flat index) and further operands (roles "in<i>"), e.g. a sigmoid backward or an SGD update
EPILOGUES = ("bias", "relu", "relu_mask", "pointwise")


@dataclass(frozen=True)
class KernelSpec:
    kind: str
    #: the subgraph node the kernel is built around (the contraction, or the reduction); None for pointwise
    core: int | None = None
    #: contraction template name (the kind, for contractions); None for generated kernels
    template: str | None = None
    #: (role, subgraph input index) pairs, e.g. (("a", 0), ("b", 1), ("bias", 2))
    roles: tuple[tuple[str, int], ...] = ()
    epilogues: tuple[str, ...] = ()
    prologues: tuple[str, ...] = ()
    #: (name, value) pairs of template parameters, e.g. (("trans_a", False), ("trans_b", True))
    params: tuple[tuple[str, Any], ...] = ()
    #: memory layout per operand then per output ("row-major" for now: the user's NCHW/OIHW)
    layouts: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ("out",)
    scratch_bytes: int = 0
    #: (family, plan as (field, value) pairs) chosen by the target's kernel selection (`select`);
    #: None where the target chooses nothing (codegen then renders its only way)
    choice: tuple[str, tuple[tuple[str, Any], ...]] | None = None
    #: why `choice` was taken: "cost model", "forced", or the tuning measurement that chose it
    #: (shown by dumps and `ember kernels`; not part of what is rendered)
    why: str = field(default="", compare=False)

    def role(self, name: str) -> int | None:
        """The subgraph input index that plays `name`, or None."""
        return dict(self.roles).get(name)

    def param(self, name: str, default: Any = None) -> Any:
        return dict(self.params).get(name, default)

    def __repr__(self) -> str:
        return self.describe()

    def describe(self) -> str:
        """One line for the printer and kernel headers: `matmul[trans_b] +bias +relu`."""
        flags = [k for k, v in self.params if v is True]
        text = self.kind + (f"[{','.join(flags)}]" if flags else "")
        text += "".join(f" +{e}" for e in self.epilogues)
        text += f" scratch={self.scratch_bytes}" if self.scratch_bytes else ""
        if self.choice is not None:
            family, plan = self.choice
            text += f" choice={family}" + (f"({','.join(f'{k}={v}' for k, v in plan)})" if plan else "")
        return text

    def check(self, n_operands: int, sub_nodes: Any, outputs: Any) -> str | None:
        """A reason this spec cannot describe a fused node with these operands/subgraph, or None."""
        if self.kind not in KERNEL_KINDS:
            return f"unknown kernel kind {self.kind!r} (known: {', '.join(KERNEL_KINDS)})"
        if self.kind in CONTRACTIONS + POOLING + LOSSES and self.template is None:
            return f"{self.kind} kernel names no template"
        if self.kind != "pointwise" and self.core is None:
            return f"{self.kind} kernel names no core node"
        if self.core is not None and self.core not in sub_nodes:
            return f"core %{self.core} is not a node of the kernel's subgraph"
        for role, index in self.roles:
            if not 0 <= index < n_operands:
                return f"role {role!r} names operand {index}, but the kernel has {n_operands}"
        for e in self.epilogues:
            if e not in EPILOGUES:
                return f"unknown epilogue {e!r}"
        if tuple(outputs) != self.outputs:
            return f"outputs {self.outputs} do not match the subgraph's {tuple(outputs)}"
        if self.scratch_bytes < 0:
            return "negative scratch size"
        if self.choice is not None:
            c = self.choice
            if not (isinstance(c, tuple) and len(c) == 2 and isinstance(c[0], str) and isinstance(c[1], tuple)
                    and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in c[1])):
                return f"choice {self.choice!r} is not (family, ((field, value), ...))"
        return None
