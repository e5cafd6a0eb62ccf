"""Finding a softmax cross-entropy in a training graph, so a target can run it as one kernel.

`nn.CrossEntropyLoss` traces into a dozen primitives (log-softmax with a max shift, one-hot,
products and sums) and autodiff adds as many for its gradient; on a GPU each would be a launch.
A target whose `FusionCaps.loss_kernels` is set gets the region as two fused nodes instead: the
loss (`softmax_xent`) and the gradient of the logits (`softmax_xent_grad`), each holding the
subgraph it replaces, so the interpreter still evaluates exactly what was traced.

The region is found by provenance (the nodes carrying the loss output's module path, forward and
backward), its boundary must be exactly (logits f32[N,C], labels int[N]) in and (loss, dlogits)
out, and its meaning is checked, not assumed: both subgraphs are run on random inputs through the
NumPy interpreter and must equal the mean softmax cross-entropy and its gradient. Anything else
(a label-smoothing loss, a sum reduction, a loss the user wrote by hand) is left to the generic
kernels.

Collectives are never part of the region: under data parallel the logged loss output is
`all_reduce(mean)` of the local loss, carrying the loss's module path. Were it taken in, the
loss kernel would swallow the all-reduce (the region check runs the interpreter's world of one,
where it is the identity) and every rank would log its own shard's loss; so the region stops at
the collective and the loss kernel's result feeds it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ember.ir import Graph, run, subgraph_of

SOURCES = {"input", "parameter", "state", "constant"}
#: ops that stay outside the region (they are kernels of their own: collectives)
OUTSIDE = SOURCES | {"all_reduce"}


@dataclass(frozen=True)
class LossRegion:
    loss: int            # the scalar loss node (a graph output)
    grad: int            # the node holding d loss / d logits
    logits: int
    labels: int
    loss_members: frozenset[int]
    grad_members: frozenset[int]
    members: frozenset[int]   # every node of the region (the union, plus nodes neither needs)


def _ancestors(graph: Graph, root: int, region: set[int]) -> set[int]:
    out, stack = {root}, [root]
    while stack:
        for o in graph.operands(stack.pop()):
            if o in region and o not in out:
                out.add(o)
                stack.append(o)
    return out


def _scalar_constant(graph: Graph, n: int) -> bool:
    return graph.op(n) == "constant" and graph.type(n).numel <= 1


def _matches(graph: Graph, region: LossRegion) -> bool:
    """Both halves compute the mean softmax cross-entropy and its gradient (float32 tolerance)."""
    n_rows, n_cls = graph.type(region.logits).shape
    rng = np.random.default_rng(0)
    z = (rng.standard_normal((n_rows, n_cls)) * 3).astype(np.float32)
    y = rng.integers(0, n_cls, n_rows).astype(graph.type(region.labels).dtype.numpy)
    shifted = z.astype(np.float64) - z.max(axis=1, keepdims=True)
    logsumexp = np.log(np.exp(shifted).sum(axis=1))
    want_loss = np.mean(logsumexp - shifted[np.arange(n_rows), y])
    soft = np.exp(shifted - logsumexp[:, None])
    soft[np.arange(n_rows), y] -= 1
    want_grad = soft / n_rows
    for root, members, want in ((region.loss, region.loss_members, want_loss),
                                (region.grad, region.grad_members, want_grad)):
        sub, outer = subgraph_of(graph, members, root, "check", copy_in=lambda o: _scalar_constant(graph, o))
        values = {region.logits: z, region.labels: y}
        values.update({o: graph.attrs(o)["value"] for o in outer if graph.op(o) == "constant"})
        if any(o not in values for o in outer):
            return False
        got = run(sub, {f"in{i}": values[o] for i, o in enumerate(outer)}).outputs["out"]
        if np.shape(got) != np.shape(want) or not np.allclose(got, want, rtol=1e-4, atol=1e-6):
            return False
    return True


def find_loss_region(graph: Graph) -> LossRegion | None:
    """The softmax cross-entropy region of a training graph (see the module docstring), or None."""
    for loss in graph.outputs.values():
        while graph.op(loss) == "all_reduce":  # the data-parallel mean of the local loss: look through it
            loss = graph.operands(loss)[0]
        t = graph.type(loss)
        if t.rank != 0 or not t.dtype.is_float or graph.op(loss) in SOURCES:
            continue
        scope = graph.scope(loss)
        if not scope:
            continue
        region = {n for n in graph.g if graph.scope(n) == scope and graph.op(n) not in OUTSIDE}
        external_in = {o for n in region for o in graph.operands(n) if o not in region and graph.op(o) != "constant"}
        used_outside = {n for n in region for u, _ in graph.users(n) if u not in region}
        used_outside |= {n for n in region if n in graph.outputs.values() or n in graph.updates.values()}
        if len(external_in) != 2 or loss not in used_outside or len(used_outside) != 2:
            continue
        (grad,) = used_outside - {loss}
        floats = [o for o in external_in if graph.type(o).dtype.is_float]
        ints = [o for o in external_in if not graph.type(o).dtype.is_float]
        if len(floats) != 1 or len(ints) != 1:
            continue
        logits, labels = floats[0], ints[0]
        if graph.type(logits).rank != 2 or graph.type(grad) != graph.type(logits) \
                or graph.type(logits).dtype.name != "float32" or graph.type(labels).dtype.name != "int64" \
                or graph.type(labels).shape != graph.type(logits).shape[:1] or grad in graph.outputs.values():
            continue
        found = LossRegion(loss, grad, logits, labels, frozenset(_ancestors(graph, loss, region)),
                           frozenset(_ancestors(graph, grad, region)), frozenset(region))
        if found.loss_members | found.grad_members != found.members:
            continue  # part of the region feeds neither output: not the shape we know
        if _matches(graph, found):
            return found
    return None
