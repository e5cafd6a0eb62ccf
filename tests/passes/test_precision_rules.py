"""The precision table (`ember.passes.precision.RULES`) against PyTorch's autocast op lists: every op
has a rule; ember's rule follows from the two lists (or says why not); the CPU column is what
torch.autocast("cpu", bfloat16) does on this machine (the dtypes each aten op is called with,
recorded below autocast); the CUDA column is whether PyTorch registers an AutocastCUDA kernel."""
from __future__ import annotations

from pathlib import Path

import pytest

from ember.ir import OPS
from ember.frontends import nn
from ember.passes.precision import CLASSES, MODULE_RULES, RULES, derived, missing_rules

torch = pytest.importorskip("torch")
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

F = torch.nn.functional
DOCS = Path(__file__).resolve().parents[2] / "docs" / "precision.md"


def test_every_op_has_a_rule():
    assert missing_rules() == []
    assert set(RULES) == set(OPS)
    assert all(r.ember in CLASSES for r in RULES.values())


def test_ember_follows_the_lists_or_says_why():
    for op, r in RULES.items():
        if r.ember == "keep":
            continue
        assert (r.ember == derived(r.cuda, r.cpu)) != bool(r.why), op


def test_the_contractions_are_lowered_and_the_softmax_parts_kept_in_float32():
    assert {op for op, r in RULES.items() if r.ember == "lower"} == {"matmul", "conv2d", "conv2d_grad_input",
                                                                      "conv2d_grad_weight"}
    assert {"exp", "log", "sum", "max", "reciprocal"} <= {op for op, r in RULES.items() if r.ember == "float32"}


# per rule: the shapes of its float inputs (made before autocast; positive where the op needs it),
# the call reaching its aten op, and the name that op is dispatched as (matmul reaches `mm`)
_X, _P = (3, 4), (2, 3, 6, 6)
CALLS = {
    **{op: ([_X], getattr(torch, op), op) for op in ("neg", "relu", "sigmoid", "tanh", "abs", "erf", "sin", "cos",
                                                      "floor", "exp", "sqrt", "log", "reciprocal")},
    **{op: ([_X, _X], getattr(torch, op), op) for op in ("add", "sub", "mul", "div", "eq", "ne", "lt", "le", "gt",
                                                          "ge", "maximum", "minimum")},
    "where": ([_X, _X], lambda a, b: torch.where(a > 0, a, b), "where"),
    "sum": ([_X], lambda a: torch.sum(a, dim=1), "sum"),
    "max": ([_X], lambda a: torch.amax(a, dim=1), "amax"),
    "argmax": ([_X], lambda a: torch.argmax(a, dim=1), "argmax"),
    "reshape": ([_X], lambda a: torch.reshape(a, (4, 3)), "view"),
    "transpose": ([_X], lambda a: a.permute(1, 0), "permute"),
    "broadcast_to": ([(1, 4)], lambda a: a.expand(3, 4), "expand"),
    "stop_gradient": ([_X], lambda a: a.detach(), "detach"),
    "matmul": ([_X, (4, 5)], torch.matmul, "mm"),
    "conv2d": ([_P, (4, 3, 3, 3)], F.conv2d, "convolution"),
    "conv2d_grad_input": ([(2, 4, 4, 4), _P, (4, 3, 3, 3)], lambda dy, x, w: torch.ops.aten.convolution_backward(
        dy, x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, True, False]), "convolution_backward"),
    "max_pool2d": ([_P], lambda x: F.max_pool2d(x, 2), "max_pool2d_with_indices"),
    "max_pool2d_grad": ([(2, 3, 3, 3), _P], lambda dy, x: torch.ops.aten.max_pool2d_with_indices_backward(
        dy, x, [2, 2], [2, 2], [0, 0], [1, 1], False, torch.zeros(dy.shape, dtype=torch.int64)),
        "max_pool2d_with_indices_backward"),
}
CALLS["conv2d_grad_weight"] = CALLS["conv2d_grad_input"]


class _Seen(TorchDispatchMode):
    """The float dtypes the aten op `name` is first called with (below autocast: after its casts)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name, self.dtypes = name, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.dtypes is None and func._schema.name == f"aten::{self.name}":
            self.dtypes = {a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()}
        return func(*args, **(kwargs or {}))


def _cpu_policy(shapes, call, name: str) -> str:
    seen = {}
    for given in (torch.float32, torch.bfloat16):
        args = [(torch.rand(s) + 0.5).to(given) for s in shapes]
        with torch.autocast("cpu", dtype=torch.bfloat16), _Seen(name) as rec:
            call(*args)
        assert rec.dtypes, f"aten::{name} was not called"
        seen[given] = rec.dtypes
    if seen[torch.float32] == {torch.bfloat16}:
        return "lower"
    if seen[torch.bfloat16] == {torch.float32}:
        return "float32"
    return "follow"


def test_every_rule_naming_a_torch_op_is_checked():
    assert {op for op, r in RULES.items() if r.torch and r.ember != "keep"} == set(CALLS)


@pytest.mark.parametrize("op", sorted(CALLS))
def test_cpu_column_is_what_torch_autocast_does(op):
    assert _cpu_policy(*CALLS[op]) == RULES[op].cpu


@pytest.mark.parametrize("op", sorted(op for op, r in RULES.items() if r.torch and r.ember != "keep"))
def test_cuda_column_is_what_torch_registers(op):
    rule = RULES[op]
    registered = torch._C._dispatch_has_kernel_for_dispatch_key(rule.torch, "AutocastCUDA")
    assert registered == (rule.cuda != "follow"), f"{op}: {rule.torch} AutocastCUDA kernel: {registered}"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(rule.torch, "AutocastCPU") == (rule.cpu != "follow")


MODULE_CALLS = {
    "BatchNorm2d": ([(2, 3, 4, 4), (3,), (3,), (3,), (3,)],
                    lambda x, m, v, w, b: F.batch_norm(x, m.float(), v.float(), w.float(), b.float(), training=True),
                    "native_batch_norm"),
    "LayerNorm": ([(2, 3, 4), (4,), (4,)], lambda x, w, b: F.layer_norm(x, (4,), w, b), "native_layer_norm"),
}


def test_module_rules_name_ember_modules_and_follow_the_lists():
    assert set(MODULE_RULES) == set(MODULE_CALLS)
    for cls, r in MODULE_RULES.items():
        assert isinstance(getattr(nn, cls), type) and r.ember == derived(r.cuda, r.cpu), cls


@pytest.mark.parametrize("cls", sorted(MODULE_CALLS))
def test_module_rules_are_what_torch_autocast_does(cls):
    rule = MODULE_RULES[cls]
    shapes, call, name = MODULE_CALLS[cls]
    # the input in bfloat16, the affine parameters and statistics float32, as a model's are
    seen = {}
    for given in (torch.float32, torch.bfloat16):
        args = [(torch.rand(shapes[0]) + 0.5).to(given)] + [torch.rand(s) + 0.5 for s in shapes[1:]]
        with torch.autocast("cpu", dtype=torch.bfloat16), _Seen(name) as rec:
            out = call(*args)
        seen[given] = (rec.dtypes, out.dtype)
    policy = "lower" if seen[torch.float32][0] == {torch.bfloat16} else \
        "float32" if seen[torch.bfloat16][1] == torch.float32 else "follow"
    assert policy == rule.cpu
    assert torch._C._dispatch_has_kernel_for_dispatch_key(rule.torch, "AutocastCUDA") == (rule.cuda != "follow")


def test_docs_list_the_table():
    text = DOCS.read_text()
    for op, r in RULES.items():
        if r.ember != "keep":
            assert f"| `{op}` | {r.ember} |" in text, op
    for cls, r in MODULE_RULES.items():
        assert f"| `nn.{cls}` | {r.ember} |" in text, cls
