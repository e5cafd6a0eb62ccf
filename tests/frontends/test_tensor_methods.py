"""The Tensor methods and functions a small PyTorch model uses, against torch (float64 traces
run on the interpreter): torch's spellings (`dim=`, `keepdim=`) included."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ember.frontends import functional as F
from ember.frontends import trace
from ember.ir import ShapeError, TensorType, run

X = np.random.default_rng(0).normal(size=(3, 4, 5))
X[0, 0, 0] = np.nan  # NaN stays NaN through clamp, as torch's

CASES = {
    "clamp": (lambda t: t.clamp(-0.5, 0.7), lambda t: t.clamp(-0.5, 0.7)),
    "clamp-min-only": (lambda t: t.clamp(min=0.1), lambda t: t.clamp(min=0.1)),
    "clamp-max-below-min": (lambda t: t.clamp(0.5, -0.5), lambda t: t.clamp(0.5, -0.5)),
    "clip": (lambda t: t.clip(max=0.2), lambda t: t.clip(max=0.2)),
    "relu6": (lambda t: F.relu6(t * 8), lambda t: torch.nn.functional.relu6(t * 8)),
    "hardtanh": (lambda t: F.hardtanh(t, -0.3, 0.4), lambda t: torch.nn.functional.hardtanh(t, -0.3, 0.4)),
    "sum-dim-keepdim": (lambda t: t.sum(dim=1, keepdim=True), lambda t: t.sum(dim=1, keepdim=True)),
    "mean-dim": (lambda t: t.mean(dim=(0, 2)), lambda t: t.mean(dim=(0, 2))),
    "max-dim": (lambda t: t.max(dim=2), lambda t: t.amax(dim=2)),
    "min-dim-keepdim": (lambda t: t.min(dim=1, keepdim=True), lambda t: t.amin(dim=1, keepdim=True)),
    "var-unbiased": (lambda t: t.var(dim=2), lambda t: t.var(dim=2)),
    "var-biased-keepdim": (lambda t: t.var(dim=(1, 2), unbiased=False, keepdim=True),
                           lambda t: t.var(dim=(1, 2), unbiased=False, keepdim=True)),
    "softmax": (lambda t: t.softmax(dim=-1), lambda t: t.softmax(dim=-1)),
    "log_softmax": (lambda t: t.log_softmax(1), lambda t: t.log_softmax(1)),
    "unsqueeze": (lambda t: t.unsqueeze(-1) * 2, lambda t: t.unsqueeze(-1) * 2),
    "squeeze": (lambda t: t.sum(dim=1, keepdim=True).squeeze(1), lambda t: t.sum(dim=1, keepdim=True).squeeze(1)),
    "pow3": (lambda t: t ** 3, lambda t: t ** 3),
    "pow-2": (lambda t: (t.abs() + 1).pow(-2), lambda t: (t.abs() + 1).pow(-2)),
    "pow-half": (lambda t: t.abs().pow(0.5), lambda t: t.abs().pow(0.5)),
    "square-rsqrt": (lambda t: (t.square() + 1).rsqrt(), lambda t: (t.square() + 1).rsqrt()),
    "detach-contiguous": (lambda t: t.detach().contiguous() + t.sin() + t.cos() + t.floor(),
                          lambda t: t.detach().contiguous() + t.sin() + t.cos() + t.floor()),
}


@pytest.mark.parametrize("name", CASES)
def test_matches_torch(name) -> None:
    ours, theirs = CASES[name]
    g = trace(ours, TensorType(X.shape, "float64"))
    got = run(g, {list(g.inputs)[0]: X}).outputs["out"]
    want = theirs(torch.tensor(X)).numpy()
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, equal_nan=True)


def test_size_dim_numel_and_errors() -> None:
    def f(t):
        assert t.size() == (3, 4, 5) and t.size(1) == 4 and t.dim() == 3 and t.numel() == 60
        with pytest.raises(TypeError, match="pass the axis once"):
            t.sum(1, dim=1)
        with pytest.raises(ShapeError, match="unsqueeze: dim 4 out of range"):
            t.unsqueeze(4)
        with pytest.raises(ValueError, match="at least one of min and max"):
            t.clamp()
        with pytest.raises(NotImplementedError, match="exponent 1.5 is not supported"):
            t ** 1.5
        return t.float()
    trace(f, TensorType(X.shape, "float32"))


def test_torch_inside_an_ember_forward_is_named() -> None:
    for call, said in ((torch.relu, "torch.relu was called on an ember Tensor"),
                       (lambda t: torch.cat([t, t]), "torch.cat was called on an ember Tensor"),
                       (lambda t: t @ torch.ones(5, 2), "a torch.Tensor cannot be used in a traced ember forward")):
        with pytest.raises(TypeError, match=said):
            trace(call, TensorType((3, 5), "float32"))


def test_calling_a_model_on_numpy_says_how_to_run_it() -> None:
    from ember.frontends import nn
    with pytest.raises(TypeError, match=r"Linear was called on a NumPy array.*step.inference\(x\).*compile_inference"):
        nn.Linear(4, 2)(np.zeros((3, 4), np.float32))


def test_module_list_and_dict_register_their_modules() -> None:
    from ember.frontends import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
            self.heads = nn.ModuleDict({"cls": nn.Linear(4, 3)})
            self.blocks.append(nn.Linear(4, 4))

        def forward(self, x):
            for block in self.blocks:
                x = block(x).relu()
            return self.heads["cls"](x)

    net = Net()
    assert list(net.state_dict()) == [f"blocks.{i}.{p}" for i in range(3) for p in ("weight", "bias")] + \
        ["heads.cls.weight", "heads.cls.bias"]
    assert len(net.blocks) == 3 and "cls" in net.heads and list(net.heads) == ["cls"]
    g = trace(net, TensorType((2, 4), "float32"))
    assert g.type(g.outputs["out"]).shape == (2, 3)
    with pytest.raises(ValueError, match="keys must be identifiers"):
        net.heads["a.b"] = nn.Linear(1, 1)
