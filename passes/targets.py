"""The target registry: one record per backend, the only place a backend's choices live.

A `Target` says what a backend is: its name, the passes it runs after autodiff and the optimizer,
what its fusion may do (`FusionCaps`), its buffer alignment, which kernel family and plan serves each
kernel and how big its scratch block is (`choose_kernel`, or `kernel_scratch` alone; asked before
memory planning so the arena covers a step's whole memory), which
spelling table its code generator uses, and the runtime factories (executor, storage). Passes read
a record's data and never import a backend; each backend's runtime module builds its record and
calls `register`; frontends only query (`get`, `names`). So the CLI's `--device` choices, the
benchmarks and backend-parametrised tests follow from what is registered here.

Adding a backend: `codegen/<target>/` (spellings, wrapper, templates), `runtime/<target>.py`
(executor, storage, and the one `register(Target(...))` call), and its module name in
`ember.runtime.BACKENDS` so it is registered on import.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ember.ir import Graph, KernelSpec

Pass = Callable[[Graph], Graph]


@dataclass(frozen=True)
class FusionCaps:
    """What the fusion pass may produce for a target (Inductor asks its backend the same questions)."""
    #: kernel kinds the backend can emit; contractions absent here are refused by fusion, not codegen
    kinds: frozenset[str] = frozenset({"pointwise", "reduction", "conv2d", "conv2d_grad_input",
                                       "conv2d_grad_weight", "matmul", "max_pool2d", "max_pool2d_grad",
                                       "collective"})
    #: contraction kind -> epilogues its template accepts
    epilogues: dict[str, frozenset[str]] = field(default_factory=lambda: {
        "conv2d": frozenset({"bias", "relu"}), "matmul": frozenset({"bias", "relu", "relu_mask"}),
        "conv2d_grad_input": frozenset({"relu_mask"})})
    #: contraction kind -> prologues its template accepts (none yet)
    prologues: dict[str, frozenset[str]] = field(default_factory=dict)
    #: whether one fused node may write several outputs (`passes/fusion_multi.py`: reductions
    #: over one domain in one kernel, pointwise work at a reduction's output index as its outputs)
    multi_output: bool = False
    #: whether cheap elementwise values are recomputed in each generated kernel that reads them
    #: instead of stored (`passes/fusion_recompute.py`: a cost rule in bytes moved)
    recompute: bool = True
    #: whether a kernel whose value is a widening cast of its own value stores the narrow value and
    #: its readers widen it (`fusion_recompute.store_narrow`): half the bytes where memory bound
    #: (CUDA at large batches); on the CPU the tensors mostly stay in cache and it measured no gain
    store_narrow: bool = False
    #: whether a softmax cross-entropy and its gradient become the `softmax_xent` kernels
    #: (`passes/fusion_loss.py`) instead of a dozen generic ones
    loss_kernels: bool = False
    #: the dtypes a `pointwise` epilogue's values and operands may have: the templates read each
    #: operand as a float (bfloat16 through views that widen it) and store the output's dtype
    epilogue_dtypes: frozenset[str] = frozenset({"float32"})

    def can_fuse_epilogue(self, kind: str, epilogue: str) -> bool:
        return epilogue in self.epilogues.get(kind, frozenset())


@dataclass(frozen=True)
class Target:
    name: str
    #: one line for `--help` and error messages
    description: str
    #: (name, pass) pairs run after autodiff and the optimizer; built from the record by `passes()`
    pipeline: Callable[["Target"], Sequence[tuple[str, Pass]]]
    fusion: FusionCaps = field(default_factory=FusionCaps)
    #: byte alignment of every planned buffer
    alignment: int = 64
    #: whether buffers whose lifetimes do not overlap share arena memory (False: memory traded
    #: for kernels that may run concurrently)
    reuse_memory: bool = True
    #: (fused subgraph, spec) -> scratch bytes its kernel needs; None: kernels need none
    kernel_scratch: Callable[[Graph, KernelSpec], int] | None = None
    #: (fused subgraph, spec) -> (family, plan as (field, value) pairs, scratch bytes, why) that
    #: serves the kernel, or None for a kernel it does not render; stamped on the spec by `select`
    #: (and then `kernel_scratch` is not asked). None: the target chooses nothing
    choose_kernel: Callable[..., tuple[str, tuple, int, str] | None] | None = None
    #: (subgraph and spec of a kernel relaying an operand, a grad-weight's subgraph and spec) -> (the
    #: launch role of the image, the grad-weight's choice reading it from that kernel's scratch block,
    #: its scratch bytes), or None where it cannot (`share_relayouts`); None: kernels share nothing
    shared_relayout: Callable[[Graph, KernelSpec, Graph, KernelSpec], tuple[str, tuple, int] | None] | None = None
    #: selected graph -> the plans of its kernels that a step of another batch size may take (the
    #: sizes that change with the batch being arguments of those kernels, not their code), as
    #: `choose_kernel`'s `reuse=`: so that step's kernels are the same code, compiled once. The
    #: frontend puts them in a new step's `meta["kernel_reuse"]`, `select` passes them on. None:
    #: plans are never shared between batch sizes
    reusable: Callable[[Graph], tuple] | None = None
    #: (selected graph, **options) -> a report: measures the candidates of the graph's kernels on
    #: this machine and stores the winners in the tuning database (`ember.runtime.tuner`); None:
    #: the target has nothing to tune
    tune: Callable[..., Any] | None = None
    #: () -> the device model kernels are chosen for ("NVIDIA H200", the CPU's vector variant): the
    #: tuning database's and the plan cache's key; None: one kind of device
    device_model: Callable[[], str] | None = None
    #: name of the codegen spelling table the target's generated kernels use ("cpp", "cuda"), or None
    language: str | None = None
    #: planned graph -> the source code its step compiles (for dumps and `ember kernels`), or None
    source: Callable[[Graph], str] | None = None
    #: runtime factories, registered by the backend's runtime module
    executor: Callable[..., Any] | None = None
    storage: Callable[..., Any] | None = None
    #: () -> None, or raises a one-line error when the target cannot run here (no GPU, ...)
    available: Callable[[], None] | None = None
    #: (traced graph, sources) -> None: called when a step is about to be built, so the target can
    #: start what its compiler needs meanwhile (CUDA: NVRTC worker processes, for a graph large
    #: enough to need them). `sources`: the generated sources its kernels come from, where they
    #: are known: the cached plan's own, or those of the steps whose plans it takes (a later batch
    #: size); empty for a step planned afresh. A target may skip the work where those are built.
    prepare_build: Callable[[Graph, tuple[Any, ...]], None] | None = None
    #: (index) -> None: makes unit `index` of a target with several ("cuda:1") the one this
    #: process runs on, or raises a one-line error; None: the target takes no index
    select_device: Callable[[int], None] | None = None
    #: data parallel: whether each bucket's collectives run as soon as the bucket is ready (its
    #: runtime overlaps them with the rest of the backward pass) or all at one point (`schedule`)
    early_collectives: bool = False
    #: host array -> the same data in the target's memory, for datasets kept on the device (a
    #: batch is then a slice, with no copy per step); None where the step reads host memory
    to_device: Callable[[Any], Any] | None = None
    #: arithmetic modes of the contractions (`compile(..., precision=...)`): "float32" is exact
    #: fp32 everywhere; "tf32" lets matmuls and convolutions round operands to TF32 on tensor cores
    precisions: frozenset[str] = frozenset({"float32"})

    def passes(self) -> list[tuple[str, Pass]]:
        """A fresh list: callers may append to it without changing the record."""
        return list(self.pipeline(self))


_TARGETS: dict[str, Target] = {}


def register(target: Target, *, replace: bool = False) -> Target:
    """Adds `target` to the registry (a second record under one name needs `replace=True`)."""
    if target.name in _TARGETS and not replace:
        raise ValueError(f"target {target.name!r} is already registered")
    _TARGETS[target.name] = target
    return target


def unregister(name: str) -> None:
    _TARGETS.pop(name, None)


def get(name: str) -> Target:
    try:
        return _TARGETS[name]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; available: {', '.join(names())}") from None


def names() -> list[str]:
    """Registered target names, in registration order (reference first)."""
    return list(_TARGETS)


def all_targets() -> list[Target]:
    return list(_TARGETS.values())
