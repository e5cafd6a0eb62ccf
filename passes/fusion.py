"""Fusion: group the nodes of a graph into kernels.

Each group becomes one `fused` node holding its subgraph (inputs in0, in1, ... and one output
"out"), with `kernel` its typed plan (`ember.ir.KernelSpec`): the kind a backend emits for it,
the operand roles, the epilogues. What may fuse is the target's `FusionCaps`:

- `conv2d` / `matmul`: the contraction, plus a bias add and a ReLU as epilogue when the graph has
  exactly relu(add(c, bias)) / add(c, bias) / relu(c) with the contraction used only there, and
  the target's template accepts them. The operand roles (and, for matmul, transposes folded into
  trans flags) are recorded in the spec so codegen need not re-match them.
- `conv2d_grad_input` / `conv2d_grad_weight`: one op each; grad-input (and a matmul) also takes
  ReLU's backward as a `relu_mask` epilogue: where(gt(y, 0), c, 0) (autodiff's relu VJP, `c`
  possibly through reshapes) with `c` used only there becomes one kernel reading `y` as its
  `mask` operand, when the target's template accepts it.
- a `pointwise` epilogue (targets whose templates take one): a pointwise group that alone reads
  a contraction's value, at that value's own flat index (through same-shape elementwise ops and
  reshapes only), joins the contraction's kernel, which then evaluates the group per output
  element before the store: a sigmoid backward, ReLU's backward through a reshape, an SGD update.
  An update of a parameter is only absorbed when every other reader of that parameter already
  runs before the contraction: in place, the kernel must wait for them, and a fusion that made a
  gradient kernel wait for an unrelated one would lengthen the step instead of shortening it.
- `reduction`: one sum/max/argmax with the pointwise ops feeding it (prologue, evaluated at the
  reduction's input index) and those consuming it (epilogue, at its output index).
- `pointwise`: elementwise ops of one iteration size, with the views (broadcast_to, transpose,
  reshape) between them absorbed into index arithmetic.
- `max_pool2d` / `max_pool2d_grad`: one op each (a windowed kernel, like the convolutions).
- `collective`: one collective op (`all_reduce`) alone, a kernel boundary: nothing is fused into
  it and it is absorbed into no group. It is a `fused` node like any other kernel (subgraph
  in0 -> all_reduce -> out, its spec's core the op), so the memory planner gives its result an
  arena buffer of its own (never the operand's, never in place) and a backend dispatches on the
  kernel kind: on CUDA one communicator call over that buffer.

After grouping, two cost rules rewrite the groups: a cheap pointwise group whose readers are all
generated kernels (or contractions' generated epilogues) is recomputed in each of them instead of stored (`fusion_recompute.py`, when
`FusionCaps.recompute`; with `FusionCaps.store_narrow`, a group whose value is a widening cast of
its own value then stores the narrow one, the cast joining its readers), and, on targets whose kernels may write several outputs
(`FusionCaps.multi_output`), reductions over one domain share a kernel and pointwise work at a
reduction's output index becomes that kernel's further outputs (`fusion_multi.py`). A group then
records its values in `notes["outputs"]` (its root first); the fused node holds the first ("out")
and each further one is a `fused_output` node that keeps the id of the value it holds.

A value leaves a group (and is materialised) only when something outside the group uses it, so
no group ever needs another group's internals and no cycle can form: groups are grown from a
root towards operands in reverse topological order, absorbing a node only when all its users are
already in the group. Top-level `reshape` nodes stay: they are aliases of their operand's buffer.
Scalar constants are copied into every group that uses them. Deterministic: ids and orders only.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import networkx as nx
import numpy as np

from ember.ir import OPS, Graph, KernelSpec, subgraph_of
from ember.ir.kernel import CONTRACTIONS

from .fusion_loss import find_loss_region
from .fusion_multi import merge_multi_output
from .fusion_recompute import recompute_cheap, store_narrow
from .targets import FusionCaps

ELEMENTWISE = {name for name, op in OPS.items() if op.kind == "elementwise"} | {"one_hot"}
VIEWS = {"broadcast_to", "transpose", "reshape"}
REDUCTIONS = {"sum", "max", "argmax"}
SOURCES = {"input", "parameter", "state", "constant"}
CONV_OPS = {"conv2d", "conv2d_grad_input", "conv2d_grad_weight"}
COLLECTIVES = {name for name, op in OPS.items() if op.kind == "collective"}
# Windowed ops that are a kernel of their own (nothing fuses into them), named by the op.
POOL_OPS = {"max_pool2d", "max_pool2d_grad"}
# Ops no compiled target has a kernel for yet: fusion refuses them with a message pointing at
# device='reference' (the interpreter runs every op). None today.
INTERPRETER_ONLY: set[str] = set()


def _numel(graph: Graph, n: int) -> int:
    return graph.type(n).numel


def _is_zero(graph: Graph, n: int) -> bool:
    """A scalar constant 0 (autodiff's `b.scalar(0, like)`)."""
    if not _inline_constant(graph, n):
        return False
    return bool(np.all(np.asarray(graph.attrs(n)["value"]) == 0))


def _inline_constant(graph: Graph, n: int) -> bool:
    return graph.op(n) == "constant" and _numel(graph, n) <= 1


class _Grouper:
    def __init__(self, graph: Graph, caps: FusionCaps) -> None:
        self.g = graph
        self.caps = caps
        self.owner: dict[int, int] = {}  # node -> root of its group

    def users_inside(self, n: int, members: set[int]) -> bool:
        users = self.g.users(n)
        return bool(users) and all(u in members for u, _ in users) and n not in self.g.outputs.values() \
            and n not in self.g.updates.values()

    def grow(self, members: set[int], start: list[int], numel: int, stop: set[int] = frozenset()) -> None:
        """Absorbs operands reachable from `start` that only the group uses."""
        stack = list(start)
        while stack:
            n = stack.pop()
            for o in self.g.operands(n):
                if o in members or o in self.owner or o in stop or self.g.op(o) in SOURCES:
                    continue
                if not self.users_inside(o, members):
                    continue
                op = self.g.op(o)
                if op in VIEWS or (op in ELEMENTWISE and _numel(self.g, o) == numel):
                    members.add(o)
                    if op != "one_hot":  # one_hot reads its labels at a reduced index: keep them a leaf
                        stack.append(o)

    def bias_operand(self, n: int, axis_from_end: int, channels: int) -> bool:
        """True when `n` (through reshapes) is a vector of `channels` broadcast along one axis."""
        t = self.g.type(n)
        if t.numel != channels or t.rank < axis_from_end:
            return False
        return all(d == 1 for i, d in enumerate(t.shape) if i != t.rank - axis_from_end)

    def contraction_epilogue(self, root: int) -> tuple[int, set[int], dict[str, Any]] | None:
        """Matches relu?(add?(c, bias)) rooted at `root` for c in conv2d/matmul; returns (c, members, notes)."""
        g, members, notes = self.g, {root}, {"relu": False, "bias": None}
        n = root
        if g.op(n) == "relu":
            notes["relu"] = True
            (n,) = g.operands(n)
            if g.op(n) not in ("add", "conv2d", "matmul") or not self.users_inside(n, members) or n in self.owner:
                return None
            members.add(n)
        if g.op(n) == "add":
            a, b = g.operands(n)
            for c, bias in ((a, b), (b, a)):
                if g.op(c) in ("conv2d", "matmul") and c not in self.owner and c != bias \
                        and g.type(c) == g.type(n) and self.users_inside(c, members | {n}):
                    axis, channels = (3, g.type(c).shape[1]) if g.op(c) == "conv2d" else (1, g.type(c).shape[-1])
                    if self.bias_operand(bias, axis, channels) and g.op(bias) not in ("broadcast_to", "transpose"):
                        members.add(n)
                        notes["bias_node"] = bias
                        n = c
                        break
            else:
                return None
        if g.op(n) not in ("conv2d", "matmul") or n in self.owner:
            return None
        if n != root and not self.users_inside(n, members):
            return None
        # Only epilogues the target's template for this contraction accepts.
        if (notes["relu"] and not self.caps.can_fuse_epilogue(g.op(n), "relu")) or \
                ("bias_node" in notes and not self.caps.can_fuse_epilogue(g.op(n), "bias")):
            return None
        members.add(n)
        return n, members, notes

    def relu_mask_epilogue(self, root: int) -> tuple[int, set[int], dict[str, Any]] | None:
        """Matches where(gt(y, 0), reshape*(c), 0) rooted at `root` (ReLU's VJP) for c in
        conv2d_grad_input/matmul; returns (c, members, notes) with notes["relu_mask"] = y."""
        g = self.g
        if g.op(root) != "where":
            return None
        cond, n, other = g.operands(root)
        if g.op(cond) != "gt" or not _is_zero(g, other) or cond in self.owner \
                or not self.users_inside(cond, {root}):
            return None
        y, zero = g.operands(cond)
        if not _is_zero(g, zero) or g.type(y).shape != g.type(root).shape or g.type(y).dtype != g.type(root).dtype:
            return None
        members = {root, cond}
        while g.op(n) == "reshape" and n not in self.owner and self.users_inside(n, members):
            members.add(n)
            (n,) = g.operands(n)
        if g.op(n) not in ("conv2d_grad_input", "matmul") or n in self.owner or not self.users_inside(n, members) \
                or _numel(g, n) != _numel(g, root) or g.type(n).dtype != g.type(root).dtype \
                or not self.caps.can_fuse_epilogue(g.op(n), "relu_mask"):
            return None
        members.add(n)
        return n, members, {"relu": False, "bias": None, "relu_mask": y}

    def claim(self, root: int, members: set[int]) -> None:
        for m in members:
            self.owner[m] = root


def _matmul_operand(graph: Graph, n: int, members: set[int], grouper: _Grouper) -> tuple[int, bool]:
    """Follows a matmul operand through absorbable transpose(last two axes)/reshape views to a leaf."""
    trans = False
    if graph.op(n) == "transpose" and graph.type(n).rank == 2 and grouper.users_inside(n, members) and n not in grouper.owner:
        members.add(n)
        trans = True
        (n,) = graph.operands(n)
    while graph.op(n) == "reshape" and grouper.users_inside(n, members) and n not in grouper.owner:
        members.add(n)
        (n,) = graph.operands(n)
    return n, trans


def _groups(graph: Graph, caps: FusionCaps,
            decided: dict[tuple[int, str], bool]) -> dict[int, tuple[str, set[int], dict[str, Any]]]:
    gr = _Grouper(graph, caps)
    groups: dict[int, tuple[str, set[int], dict[str, Any]]] = {}
    region = find_loss_region(graph) if caps.loss_kernels else None
    if region is not None:  # two kernels share the region's forward nodes: each holds its own copy
        groups[region.loss] = ("softmax_xent", set(region.loss_members), {"logits": region.logits, "labels": region.labels})
        groups[region.grad] = ("softmax_xent_grad", set(region.grad_members),
                               {"logits": region.logits, "labels": region.labels})
        for m in region.members:
            gr.owner[m] = region.loss if m in region.loss_members else region.grad
    reduction_nodes = {n for n in graph.g if graph.op(n) in REDUCTIONS}  # where pointwise groups stop growing
    for root in reversed(graph.topo_order()):
        if root in gr.owner:
            continue
        op = graph.op(root)
        if op in SOURCES or op == "reshape":
            continue
        notes: dict[str, Any] = {}
        m = None
        if op in ("relu", "add", "conv2d", "matmul"):
            m = gr.contraction_epilogue(root)
        elif op == "where":
            m = gr.relu_mask_epilogue(root)
        if m is not None:
            core, members, notes = m
            kind = graph.op(core)
            notes["core"] = core
            if kind == "matmul":
                a, b = graph.operands(core)
                ta, tb = graph.type(a), graph.type(b)
                if ta.rank == 2 and tb.rank == 2:
                    notes["a"], notes["trans_a"] = _matmul_operand(graph, a, members, gr)
                    notes["b"], notes["trans_b"] = _matmul_operand(graph, b, members, gr)
                else:  # batched: operands read as they are (codegen refuses what its templates cannot do)
                    notes.update(a=a, b=b, trans_a=False, trans_b=False)
        elif op in CONV_OPS or op in POOL_OPS:
            kind, members, notes = op, {root}, {"core": root}
        elif op in COLLECTIVES:
            kind, members, notes = "collective", {root}, {"core": root}
        elif op in REDUCTIONS:
            kind, members = "reduction", {root}
            gr.grow(members, [root], graph.type(graph.operands(root)[0]).numel)
            notes["core"] = root
        elif op in ELEMENTWISE or op in VIEWS:
            kind, members = "pointwise", {root}
            gr.grow(members, [root], _numel(graph, root), stop=reduction_nodes)
            # An epilogue over a reduction of the same output size: absorb the reduction and its prologue.
            reductions = [o for m_ in members for o in graph.operands(m_)
                          if graph.op(o) in REDUCTIONS and o not in gr.owner and o not in members]
            has_views = any(graph.op(m_) in VIEWS for m_ in members)  # the reduction is read at its own index only
            for r in sorted(set(reductions)):
                if _numel(graph, r) == _numel(graph, root) and gr.users_inside(r, members) and kind == "pointwise" \
                        and not has_views and graph.type(r).shape == graph.type(root).shape:
                    kind = "reduction"
                    members.add(r)
                    notes["core"] = r
                    gr.grow(members, [r], graph.type(graph.operands(r)[0]).numel)
        else:  # INTERPRETER_ONLY, or an op added without a fusion rule
            raise NotImplementedError(f"fusion has no kernel kind for op {op!r} (%{root}, at {graph.loc(root)}); "
                                      f"compile with device='reference' (the interpreter runs every op)")
        if kind not in caps.kinds:
            raise NotImplementedError(f"the target cannot compile a {kind} kernel (%{root} {op}, at {graph.loc(root)}); "
                                      f"it compiles {', '.join(sorted(caps.kinds))}")
        gr.claim(root, members)
        groups[root] = (kind, members, notes)
    _absorb_pointwise_epilogues(graph, gr, groups, caps)
    if caps.recompute:
        decided.update(recompute_cheap(graph, groups, caps.epilogue_dtypes))
        if caps.store_narrow:
            store_narrow(graph, groups, caps.epilogue_dtypes)
    if caps.multi_output:
        merge_multi_output(graph, groups)
    return groups


def _reads_at_own_index(graph: Graph, members: set[int], value: int) -> bool:
    """True when every member depending on `value` reads it (through same-shape elementwise ops
    and reshapes) at the flat index it writes: the group can run per output element of `value`."""
    stack = [value]
    while stack:
        n = stack.pop()
        for u, _ in graph.users(n):
            if u not in members:
                continue
            op = graph.op(u)
            if op != "reshape" and not (op in ELEMENTWISE and op != "one_hot" and graph.type(u).shape == graph.type(n).shape):
                return False
            stack.append(u)
    return True


def _adds_no_wait(graph: Graph, root: int, members: set[int], core: int) -> bool:
    """False when `root` updates a parameter (or state) that something outside `members` reads
    and that reader is not already before `core`: updating in place inside the contraction's
    kernel would make that kernel wait for the reader."""
    names = [k for k, n in graph.updates.items() if n == root]
    if not names:
        return True
    before = nx.ancestors(graph.g, core)
    for name in names:
        source = graph.parameters.get(name, graph.states.get(name))
        if source is not None and any(u not in members and u not in before for u, _ in graph.users(source)):
            return False
    return True


def _absorb_pointwise_epilogues(graph: Graph, gr: _Grouper, groups: dict[int, tuple[str, set[int], dict[str, Any]]],
                                caps: FusionCaps) -> None:
    """Merges each pointwise group into the contraction whose value only it reads (see the module doc)."""
    for root in [r for r in graph.topo_order() if r in groups and groups[r][0] == "pointwise"]:
        _, members, _ = groups[root]
        if graph.type(root).dtype.name not in caps.epilogue_dtypes:
            continue
        external = {o for m in members for o in graph.operands(m) if o not in members}
        for value in sorted(external):
            if value not in groups or groups[value][0] not in CONTRACTIONS:
                continue
            kind, cmembers, cnotes = groups[value]
            if "pointwise_from" in cnotes or not caps.can_fuse_epilogue(kind, "pointwise") \
                    or not gr.users_inside(value, members) or graph.type(value).numel != graph.type(root).numel \
                    or not _reads_at_own_index(graph, members, value):
                continue
            if any(graph.type(o).dtype.name not in caps.epilogue_dtypes
                   for o in external if not _inline_constant(graph, o)):
                break  # operands the templates cannot read
            merged = cmembers | members
            if not _adds_no_wait(graph, root, merged, cnotes["core"]):
                break
            del groups[value]
            groups[root] = (kind, merged, {**cnotes, "pointwise_from": value, "epilogue": set(members)})
            gr.claim(root, merged)
            break


def _role_nodes(graph: Graph, kind: str, notes: dict[str, Any]) -> set[int]:
    """The outer nodes `_spec` names as roles of a template kernel (they must be operands)."""
    if kind in ("pointwise", "reduction", "collective"):
        return set()
    nodes = {notes[k] for k in ("a", "b", "logits", "labels", "bias_node", "relu_mask") if notes.get(k) is not None}
    if kind not in ("matmul", "softmax_xent", "softmax_xent_grad") and notes.get("core") is not None:
        nodes |= set(graph.operands(notes["core"]))
    return nodes


def _spec(graph: Graph, root: int, kind: str, notes: dict[str, Any], index_of: dict[int, int],
          submap: dict[int, int]) -> KernelSpec:
    """The typed plan of one group: roles are indices of the fused node's operands."""
    core = notes.get("core")
    if kind in ("softmax_xent", "softmax_xent_grad"):
        return KernelSpec(kind, core=submap[root], template=kind,
                          roles=(("logits", index_of[notes["logits"]]), ("labels", index_of[notes["labels"]])))
    if kind in ("pointwise", "reduction", "collective"):
        return KernelSpec(kind, core=submap[core] if core is not None else None)
    if kind == "matmul":
        roles = [("a", index_of[notes["a"]]), ("b", index_of[notes["b"]])]
        params = (("trans_a", bool(notes["trans_a"])), ("trans_b", bool(notes["trans_b"])))
    else:
        names = {"conv2d": ("x", "w"), "conv2d_grad_input": ("dy", "w"), "conv2d_grad_weight": ("x", "dy"),
                 "max_pool2d": ("x",), "max_pool2d_grad": ("x", "dy")}[kind]
        roles = list(zip(names, (index_of[o] for o in graph.operands(core))))
        params = ()
    epilogues = []
    if notes.get("bias_node") is not None:
        roles.append(("bias", index_of[notes["bias_node"]]))
        epilogues.append("bias")
    if notes.get("relu"):
        epilogues.append("relu")
    if notes.get("relu_mask") is not None:
        roles.append(("mask", index_of[notes["relu_mask"]]))
        epilogues.append("relu_mask")
    if notes.get("pointwise_from") is not None:
        # the epilogue's operands: what its members read from outside it, but the contraction's value
        epilogue = notes["epilogue"]
        reads = {o for m in epilogue for o in graph.operands(m) if o not in epilogue} - {notes["pointwise_from"]}
        roles += [(f"in{index_of[o]}", index_of[o]) for o in sorted(reads) if o in index_of]
        epilogues.append("pointwise")
        params += (("epilogue_from", submap[notes["pointwise_from"]]),)
    return KernelSpec(kind, core=submap[core], template=kind, roles=tuple(roles), epilogues=tuple(epilogues),
                      params=params, layouts=("row-major",) * (len(index_of) + 1))


def fuse(graph: Graph, caps: FusionCaps | None = None) -> Graph:
    """Returns a graph whose compute nodes are `fused` groups (plus reshape aliases and sources).

    `caps` (the target's `FusionCaps`; default: everything the CPU backend can do) bounds what
    may fuse: kernel kinds and the epilogues each contraction template accepts.
    """
    decided: dict[tuple[int, str], bool] = {}
    groups = _groups(graph, caps if caps is not None else FusionCaps(), decided)
    # Every kept node keeps its id, and a fused node takes its root's: `%51` and `k51_conv2d` name
    # the same thing in every dump, kernel header and error. A kernel's further outputs are
    # `fused_output` nodes that keep the ids of the values they hold.
    out = Graph.empty_like(graph)
    mapping: dict[int, int] = {}
    results = {r: group_outputs(r, notes) for r, (_, _, notes) in groups.items()}
    producer = {v: r for r, vs in results.items() for v in vs}
    inside = set().union(*(ms for _, ms, _ in groups.values())) if groups else set()
    topo = graph.topo_order()
    position = {n: i for i, n in enumerate(topo)}
    role_nodes = {r: _role_nodes(graph, kind, notes) for r, (kind, _, notes) in groups.items()}
    operands_of_templates = set().union(*role_nodes.values()) if role_nodes else set()
    # a reshape alias inside a kernel (between two of its values) stays an alias too where
    # something outside that kernel reads it
    needed = set(graph.outputs.values()) | set(graph.updates.values()) | {
        o for _, ms, _ in groups.values() for m in ms for o in graph.operands(m) if o not in ms}
    needed |= {o for n in graph.g if n not in inside for o in graph.operands(n)}
    aliases = {n for n in needed if n in inside and graph.op(n) == "reshape"}
    while more := {o for n in aliases for o in graph.operands(n) if o in inside and graph.op(o) == "reshape"} - aliases:
        aliases |= more
    kept = [n for n in topo if (n not in inside or n in aliases) and not (
        _inline_constant(graph, n) and all(u in inside for u, _ in graph.users(n))
        and n not in graph.outputs.values() and n not in operands_of_templates)]
    # Build in an order of the kernels' own dependencies: a kernel with several outputs may feed
    # one whose root comes earlier in the original order.
    order = nx.DiGraph()
    order.add_nodes_from(kept + list(groups))
    for item in order.nodes:
        reads = graph.operands(item) if item not in groups else \
            {o for m in groups[item][1] for o in graph.operands(m) if o not in groups[item][1]}
        for o in reads:
            if o in producer or o in order:
                order.add_edge(producer.get(o, o), item)
            elif not _inline_constant(graph, o):
                raise AssertionError(f"fusion: %{o} is read by %{item} but no kernel computes it")
    for n in nx.lexicographical_topological_sort(order):
        if n in groups:
            kind, members, notes = groups[n]
            submap: dict[int, int] = {}
            # a template's roles (a 1x1 matmul operand that is a constant, say) stay operands:
            # only the scalars a generated body reads are copied in
            roles = role_nodes[n]
            sub, outer = subgraph_of(graph, members, results[n], f"k{n}_{kind}",
                                     copy_in=lambda o: _inline_constant(graph, o) and o not in roles, mapping=submap,
                                     keep_ids=True, position=position)
            index_of = {o: i for i, o in enumerate(outer)}
            spec = dataclasses.replace(_spec(graph, n, kind, notes, index_of, submap), outputs=tuple(sub.outputs))
            node = out.add("fused", [mapping[o] for o in outer], node_id=n, **graph.provenance(n), graph=sub,
                           kernel=spec)
            out.annotate(node, "implements", [f"%{m} {graph.op(m)} {graph.where(m)}".rstrip() for m in sorted(members)])
            mapping[n] = node
            for name, v in zip(list(sub.outputs)[1:], results[n][1:]):
                mapping[v] = out.add("fused_output", [node], node_id=v, **graph.provenance(v), output=name,
                                     type=graph.type(v))
        else:  # sources, constants and reshape aliases, as they are
            mapping[n] = out.clone_node(graph, n, [mapping[o] for o in graph.operands(n)])
    for name in graph.inputs:  # keep the signature order of the original graph
        out.inputs[name] = out.inputs.pop(name)
    for k, n in graph.outputs.items():
        out.set_output(k, mapping[n])
    for k, n in graph.updates.items():
        out.set_update(k, mapping[n])
    # what a step of this graph at another batch size takes (fusion_recompute.py)
    out.meta["recomputed"] = tuple(sorted(decided.items()))
    return out.verify()


def group_outputs(root: int, notes: dict[str, Any]) -> list[int]:
    """The values a group materialises: its root ("out") first, then any further outputs."""
    return list(notes.get("outputs", [root]))


def kernel_counts(graph: Graph) -> dict[str, int]:
    """Number of fused kernels per kind (the structure tests assert these)."""
    counts: dict[str, int] = {}
    for n in graph.g:
        if graph.op(n) == "fused":
            kind = graph.attrs(n)["kernel"].kind
            counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items()))
