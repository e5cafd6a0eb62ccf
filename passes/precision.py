"""Mixed precision (`precision="bf16"`): which op runs in bfloat16, which in float32, as one table,
and the pass that rewrites a traced graph by it (`torch.autocast(dtype=torch.bfloat16)`'s semantics).

`RULES` says for every op of the IR what it runs in:

- "lower": its float operands are cast to bfloat16; the contractions (matmul, conv2d and its two
  gradients), which multiply bfloat16 operands and accumulate in float32 (the interpreter, the
  tensor cores and `vdpbf16ps` alike) and store a bfloat16 result;
- "float32": its bfloat16 operands are widened to float32: reductions (`sum`, `max`), `exp`,
  `log` and `reciprocal`, so softmax, log-softmax, every loss and the normalisation statistics
  (means and variances are sums) are computed in float32;
- "follow": it runs in its operands' dtype, the widest of them when they differ (PyTorch's type
  promotion); elementwise ops, views, pooling;
- "keep": the pass leaves it as traced (sources, explicit casts, random bits, kernels).

Each rule records where PyTorch's autocast puts the same op (`cuda`, `cpu`: its CUDA and CPU op
lists, "lower", "float32" or "follow" for an op on neither list) and the aten op it was checked
on: ember's rule is "lower" where both lists lower an op, "float32" where either keeps it in
float32 (the CUDA list is the stricter; the CPU list computes softmax and sums in bfloat16),
"follow" otherwise; a rule that departs from that says why (`why`). tests/passes/test_precision_rules.py
checks the CPU column against PyTorch's autocast on this machine and the CUDA column against the
kernels PyTorch registers for it, and docs/precision.md lists the table.

The pass (`autocast`) runs on the traced forward graph, before autodiff, as autocast runs on the
forward: the backward of each op then runs in its forward's dtype (a bfloat16 convolution's two
gradients take bfloat16 operands; the gradient of a cast is the cast back), so parameters,
their gradients and the optimizer stay float32 (master weights) and the bfloat16 copy of a weight
is a cast inside the step. Three more rules keep activations in bfloat16 where autocast does:

- a bias: an `add` of a lowered contraction's result and a parameter seen through views is the
  contraction's bias (PyTorch's `linear` and `conv2d` take it inside the op), so it runs in
  bfloat16 with the bias cast, not in float32;
- casts go below views: a weight is cast once and then transposed, a bias cast before it is
  broadcast;
- a float32 value whose only use is a cast to bfloat16, computed by an op that commutes with
  rounding (relu, max pooling, neg, abs, views: `round(relu(x)) == relu(round(x))`), is computed
  from the bfloat16 operand instead, so a BatchNorm (float32) followed by a ReLU stores the
  ReLU's output in bfloat16, as autocast's BatchNorm would.

A normalisation module is one op in PyTorch and a dozen primitives here, so `MODULE_RULES` holds
its rule, keyed by the module's class (the tracer records each scope's class in
`meta["modules"]`), checked against autocast like the op rules: BatchNorm follows its input
(PyTorch's `batch_norm` is on neither list: a bfloat16 input gives a bfloat16 output), so where
its input is bfloat16, its output leaves the module rounded to bfloat16, its statistics and
normalisation computed in float32 inside (by the op rules); LayerNorm is on the CUDA float32 list
and returns float32, as the op rules give already.

Data augmentation is no layer of PyTorch's model and no op autocast sees (a transform of the
batch), so the modules in `KEPT_MODULES` are left as traced: `RandomTranslate`'s one-hot
grouped convolutions move float32 pixels exactly, and the first layer after it casts them.

The graph's interface does not change: inputs, parameters, states, outputs and updates keep
their dtypes (an output that became bfloat16 is cast back), so the runtime sees no bfloat16.
"""
from __future__ import annotations

from dataclasses import dataclass

from ember.ir import OPS, DType, Graph, bfloat16, float32

__all__ = ["Rule", "RULES", "MODULE_RULES", "KEPT_MODULES", "CLASSES", "EXACT", "autocast", "missing_rules",
           "derived"]

CLASSES = ("lower", "float32", "follow", "keep")


@dataclass(frozen=True)
class Rule:
    ember: str                 # what ember runs the op in (one of CLASSES)
    torch: str | None = None   # the aten op PyTorch's autocast lists (None: none corresponds)
    cuda: str = "follow"       # where torch.autocast("cuda") puts it: lower | float32 | follow
    cpu: str = "follow"        # where torch.autocast("cpu") puts it
    why: str = ""              # why ember's rule is not `derived(cuda, cpu)`, when it is not


def derived(cuda: str, cpu: str) -> str:
    """ember's rule from PyTorch's two lists: lower where both lower, float32 where either
    keeps float32, else follow."""
    if cuda == cpu == "lower":
        return "lower"
    return "float32" if "float32" in (cuda, cpu) else "follow"


_BACKWARD = "the gradient of a lowered op: PyTorch runs it in its forward's dtype (bfloat16)"
_FOLLOW = Rule("follow")
RULES: dict[str, Rule] = {
    # contractions
    "matmul": Rule("lower", "aten::matmul", "lower", "lower"),
    "conv2d": Rule("lower", "aten::conv2d", "lower", "lower"),
    "conv2d_grad_input": Rule("lower", "aten::convolution_backward", "follow", "follow", _BACKWARD),
    "conv2d_grad_weight": Rule("lower", "aten::convolution_backward", "follow", "follow", _BACKWARD),
    # float32: autocast's CUDA list (its fp32 and fp32-with-dtype policies)
    "exp": Rule("float32", "aten::exp", "float32", "follow"),
    "log": Rule("float32", "aten::log", "float32", "follow"),
    "reciprocal": Rule("float32", "aten::reciprocal", "float32", "follow"),
    "sum": Rule("float32", "aten::sum.dim_IntList", "float32", "follow"),
    "max": Rule("float32", "aten::amax", "follow", "follow",
                "softmax and log-softmax are built on it (their max shift), and autocast runs those in float32"),
    # follow: elementwise, views, pooling, collectives
    **{op: Rule("follow", f"aten::{op}") for op in ("neg", "sqrt", "relu", "sigmoid", "tanh", "abs", "erf", "sin",
                                                     "cos", "floor")},
    **{op: Rule("follow", f"aten::{op}.Tensor") for op in ("add", "sub", "mul", "div", "eq", "ne", "lt", "le",
                                                            "gt", "ge")},
    "maximum": Rule("follow", "aten::maximum"),
    "minimum": Rule("follow", "aten::minimum"),
    "where": Rule("follow", "aten::where.self"),
    "stop_gradient": Rule("follow", "aten::detach"),
    "argmax": Rule("follow", "aten::argmax"),
    "reshape": Rule("follow", "aten::reshape"),
    "transpose": Rule("follow", "aten::permute"),
    "broadcast_to": Rule("follow", "aten::expand"),
    "max_pool2d": Rule("follow", "aten::max_pool2d"),
    "max_pool2d_grad": Rule("follow", "aten::max_pool2d_with_indices_backward"),
    "all_reduce": _FOLLOW,
    # keep: as traced
    "input": Rule("keep"), "parameter": Rule("keep"), "state": Rule("keep"), "constant": Rule("keep"),
    "cast": Rule("keep", "aten::_to_copy"),
    "one_hot": Rule("keep", "aten::one_hot"),
    "random_uniform": Rule("keep"),
    "fused": Rule("keep"), "fused_output": Rule("keep"),
}

#: rules of modules that are one op in PyTorch, by class name (see the module docstring)
MODULE_RULES: dict[str, Rule] = {
    "BatchNorm2d": Rule("follow", "aten::batch_norm", "follow", "follow"),
    "LayerNorm": Rule("float32", "aten::layer_norm", "float32", "follow"),
}

#: modules whose ops run as traced (data augmentation, outside what autocast sees), by class name
KEPT_MODULES = frozenset({"RandomTranslate"})

#: ops that commute with rounding to bfloat16 (round(op(x)) == op(round(x)), one operand): a
#: float32 one whose only use is a cast to bfloat16 runs on the bfloat16 operand instead
EXACT = frozenset({"relu", "neg", "abs", "max_pool2d", "reshape", "transpose", "broadcast_to", "stop_gradient"})
VIEWS = frozenset({"reshape", "transpose", "broadcast_to"})


def missing_rules() -> list[str]:
    """Ops of the IR without a precision rule (the completeness check)."""
    return sorted(set(OPS) - set(RULES))


class _Rewriter:
    def __init__(self, source: Graph, low: DType) -> None:
        self.src = source
        self.g = Graph.empty_like(source)
        self.low = low
        self.new: dict[int, int] = {}
        self.casts: dict[tuple[int, DType], int] = {}
        self.made: set[int] = set()  # the casts this pass added

    def cast(self, n: int, dtype: DType) -> int:
        """n's value in `dtype` (a float dtype): n itself, a cast (one per value and dtype), or,
        for a view of another value, the same view of that value's cast (casts go below views)."""
        g = self.g
        if g.type(n).dtype == dtype or not g.type(n).dtype.is_float:
            return n
        key = (n, dtype)
        if key in self.casts:
            return self.casts[key]
        op = g.op(n)
        if dtype == self.low and op == "cast" and g.type(g.operands(n)[0]).dtype == self.low:
            out = g.operands(n)[0]  # narrowing a widened bfloat16 value: the value itself
        elif dtype == self.low and op in VIEWS:
            (x,) = g.operands(n)
            out = g.add(op, [self.cast(x, dtype)], **g.provenance(n), **g.attrs(n))
        else:
            out = g.add("cast", [n], **g.provenance(n), dtype=dtype)
            self.made.add(out)
        self.casts[key] = out
        return out

    def is_parameter_view(self, n: int) -> bool:
        while self.g.op(n) in VIEWS:
            (n,) = self.g.operands(n)
        return self.g.op(n) == "parameter"

    def is_lowered(self, n: int) -> bool:
        while self.g.op(n) in VIEWS:
            (n,) = self.g.operands(n)
        return RULES[self.g.op(n)].ember == "lower" and self.g.type(n).dtype == self.low

    def operands(self, n: int) -> list[int]:
        src, g = self.src, self.g
        ops = [self.leaving(self.new[o], src.scope(n)) for o in src.operands(n)]
        if src.meta.get("modules", {}).get(src.scope(n)) in KEPT_MODULES:
            return [self.cast(o, src.type(t).dtype) for o, t in zip(ops, src.operands(n))]
        floats = [o for o in ops if g.type(o).dtype.is_float]
        rule = RULES[src.op(n)].ember
        if rule == "lower":
            return [self.cast(o, self.low) for o in ops]
        if rule == "float32":
            return [self.cast(o, float32) if g.type(o).dtype == self.low else o for o in ops]
        dtypes = {g.type(o).dtype for o in floats}
        if rule != "follow" or len(dtypes) < 2:
            return ops
        if src.op(n) == "add" and len(ops) == 2 and any(
                self.is_lowered(a) and self.is_parameter_view(b) for a, b in (ops, ops[::-1])):
            return [self.cast(o, self.low) for o in ops]  # a contraction's bias
        widest = max((d for d in dtypes if d != self.low), key=lambda d: d.itemsize)
        return [self.cast(o, widest) if g.type(o).dtype == self.low else o for o in ops]

    def run(self) -> Graph:
        src, g = self.src, self.g
        for n in src.topo_order():
            op = src.op(n)
            if op in ("fused", "fused_output"):
                raise ValueError(f"autocast runs on a traced graph, before fusion; graph {src.name!r} has "
                                 f"kernel %{n}")
            self.new[n] = g.clone_node(src, n, self.operands(n))
        for table, setter in ((src.outputs, g.set_output), (src.updates, g.set_update)):
            for name, n in table.items():
                m = self.new[n]
                setter(name, self.cast(m, src.type(n).dtype) if g.type(m) != src.type(n) else m)
        self.drop_unused()
        self.narrow_exact()
        return g

    def leaving(self, o: int, user_scope: str) -> int:
        """Value `o` as a reader in `user_scope` sees it: cast to bfloat16 when it leaves a module
        whose rule is "follow" (`MODULE_RULES`) and every activation entering that module is
        bfloat16 (the module returns its input's dtype)."""
        g = self.g
        scope = g.scope(o)
        rule = MODULE_RULES.get(self.src.meta.get("modules", {}).get(scope, ""))
        if not scope or scope == user_scope or rule is None or rule.ember != "follow" \
                or not g.type(o).dtype.is_float or g.type(o).dtype == self.low:
            return o
        members = {n for n in g.g if g.scope(n) == scope}
        entering = {e for m in members for e in g.operands(m) if e not in members
                    and g.op(e) not in ("parameter", "state", "constant") and g.type(e).dtype.is_float}
        # a widening cast this pass made is the bfloat16 value it widens
        dtypes = {g.type(g.operands(e)[0] if e in self.made else e).dtype for e in entering}
        return self.cast(o, self.low) if dtypes == {self.low} else o

    def drop_unused(self) -> None:
        """Removes the values no output or update reads any more (a float32 view whose readers
        now read a bfloat16 one): a value's readers decide whether it can be narrowed."""
        g = self.g
        live, stack = set(), list(g.roots())
        while stack:
            n = stack.pop()
            if n not in live:
                live.add(n)
                stack.extend(g.operands(n))
        for n in [n for n in g.g if n not in live and g.op(n) not in ("input", "parameter", "state")]:
            g.remove(n)
        self.casts = {k: v for k, v in self.casts.items() if v in g and k[0] in g}

    def narrow_exact(self) -> None:
        """Moves casts to bfloat16 above the ops that commute with rounding (`EXACT`)."""
        g = self.g
        kept = set(g.roots())
        changed = True
        while changed:
            changed = False
            for c in g.topo_order():
                if c not in g or g.op(c) != "cast" or g.type(c).dtype != self.low:
                    continue
                (y,) = g.operands(c)
                users = [u for u, _ in g.users(y)]
                if g.op(y) not in EXACT or y in kept or g.type(y).dtype == self.low or not all(
                        g.op(u) == "cast" and g.type(u).dtype == self.low for u in users):
                    continue
                (x,) = g.operands(y)
                xb = self.cast(x, self.low)
                op, attrs, prov = g.op(y), dict(g.attrs(y)), g.provenance(y)
                for u in users:
                    g.replace_uses(u, y)  # point the casts' readers at y, which becomes the narrow op
                    g.remove(u)
                    self.casts = {k: v for k, v in self.casts.items() if v != u}
                readers = [(v, k) for v, k in g.users(y)]
                g.remove(y)
                narrow = g.add(op, [xb], node_id=y, **prov, **attrs)
                for v, k in readers:
                    g.set_operand(v, k, narrow)
                self.casts = {k: v for k, v in self.casts.items() if k[0] != y}
                changed = True
                break


def autocast(graph: Graph, dtype: DType = bfloat16) -> Graph:
    """The graph with every op run in the precision `RULES` gives it (see the module docstring);
    `dtype` is the lower precision (bfloat16)."""
    if missing := missing_rules():
        raise NotImplementedError(f"autocast: no precision rule for op(s) {', '.join(missing)}")
    return _Rewriter(graph, dtype).run().verify()
