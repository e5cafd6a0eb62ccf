"""`from_torch`: PyTorch models imported into ember compute and train as in PyTorch; anything not
translatable fails at import with one line naming the fx node, the call and the user's line."""
from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tnn = torch.nn
TF = torch.nn.functional

from ember.frontends import TorchImportError, compile, from_torch, nn, optim  # noqa: E402

THIS = __file__.rsplit("/", 1)[-1]


def torch_cnn() -> "tnn.Module":
    torch.manual_seed(0)
    return tnn.Sequential(tnn.Conv2d(1, 16, 3), tnn.ReLU(), tnn.Conv2d(16, 32, 3), tnn.ReLU(), tnn.Flatten(),
                          tnn.Linear(18432, 10))


class TorchMLP(tnn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = tnn.Linear(784, 30)
        self.fc2 = tnn.Linear(30, 10)

    def forward(self, x):
        x = x.view(x.size(0), -1)
        return self.fc2(torch.sigmoid(self.fc1(x)))


def _batch(n: int, shape: tuple[int, ...], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.random((n,) + shape, dtype=np.float32), rng.integers(0, 10, n).astype(np.int64)


def _forward(tm, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return tm(torch.from_numpy(x)).numpy()


@pytest.mark.parametrize("make,shape", [(torch_cnn, (1, 28, 28)), (TorchMLP, (1, 28, 28))], ids=["cnn", "mlp"])
def test_logits_match_torch(make, shape):
    tm = make()
    x, y = _batch(8, shape)
    model = from_torch(tm, (torch.from_numpy(x),))
    step = compile(model, nn.CrossEntropyLoss(), optim.SGD(model.parameters(), lr=0.05), (x, y), device="reference")
    np.testing.assert_allclose(step.inference(x), _forward(tm, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make,shape", [(torch_cnn, (1, 28, 28)), (TorchMLP, (1, 28, 28))], ids=["cnn", "mlp"])
def test_trains_like_torch_on_cpu(make, shape):
    tm = make()
    ref = copy.deepcopy(tm)
    x0, y0 = _batch(16, shape)
    model = from_torch(tm, (torch.from_numpy(x0),))
    step = compile(model, nn.CrossEntropyLoss(), optim.SGD(model.parameters(), lr=0.05), (x0, y0), device="cpu")
    topt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for i in range(10):
        x, y = _batch(16, shape, seed=i)
        ours = step(x, y)
        topt.zero_grad()
        loss = TF.cross_entropy(ref(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        topt.step()
        assert abs(ours - loss.item()) < 1e-5, (i, ours, loss.item())


def test_state_dict_names_equal_torch_and_round_trip():
    tm = TorchMLP()
    model = from_torch(tm, torch.zeros(2, 1, 28, 28))
    sd = model.state_dict()
    assert list(sd) == list(tm.state_dict())
    for k, v in tm.state_dict().items():
        np.testing.assert_array_equal(sd[k], v.numpy())
    cnn = from_torch(torch_cnn(), torch.zeros(2, 1, 28, 28))
    assert list(cnn.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias", "5.weight", "5.bias"]
    other = TorchMLP()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    model.load_state_dict(other.state_dict())  # torch tensors load by the same names
    x, _ = _batch(4, (1, 28, 28))
    step = compile(model, nn.CrossEntropyLoss(), optim.SGD(model.parameters(), lr=0.05), _batch(4, (1, 28, 28)), device="reference")
    np.testing.assert_allclose(step.inference(x), _forward(other, x), rtol=1e-5, atol=1e-5)


class Nested(tnn.Module):
    """Nested Sequential, a custom submodule with a direct parameter, residual add, functional calls."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.features = tnn.Sequential(tnn.Conv2d(3, 4, 3, padding=1), tnn.Tanh())
        self.scale = tnn.Parameter(torch.tensor([0.5]))
        self.head = tnn.Sequential(tnn.Flatten(), tnn.Sequential(tnn.Linear(4 * 6 * 6, 5)))

    def forward(self, x):
        h = self.features(x)
        h = F_relu_then_add(h, x.sum(1, keepdim=True))
        h = torch.flatten(h, 1).reshape(h.shape[0], 4, 6, 6)
        return TF.log_softmax(self.head(h * self.scale), dim=1)


def F_relu_then_add(h, skip):
    return TF.relu(h) + skip  # residual add with broadcasting


def test_nested_modules_functions_and_gradients():
    tm = Nested()
    x = np.random.default_rng(0).standard_normal((2, 3, 6, 6)).astype(np.float32)
    model = from_torch(tm, torch.from_numpy(x))
    assert [k for k, _ in model.named_parameters()] == [k for k, _ in tm.named_parameters()]
    y = np.array([1, 3])
    step = compile(model, nn.NLLLoss(), optim.SGD(model.parameters(), lr=0.1), (x, y), device="reference")
    np.testing.assert_allclose(step.inference(x), _forward(tm, x), rtol=1e-5, atol=1e-6)
    loss = step(x, y)
    ref = TF.nll_loss(tm(torch.from_numpy(x)), torch.from_numpy(y))
    ref.backward()
    assert abs(loss - ref.item()) < 1e-6
    for k, p in tm.named_parameters():  # one SGD step: new = old - lr * grad
        np.testing.assert_allclose(dict(model.named_parameters())[k].data, (p - 0.1 * p.grad).detach().numpy(),
                                   rtol=1e-5, atol=1e-6)


# ---- one test per class of failure -----------------------------------------------------------

class Unsupported(tnn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = tnn.GRU(4, 4)

    def forward(self, x):
        return self.rnn(x)


def test_unsupported_module_names_node_call_and_line():
    with pytest.raises(TorchImportError) as e:
        from_torch(Unsupported(), torch.zeros(2, 3, 4))
    msg = str(e.value)
    assert "\n" not in msg
    assert "unsupported module torch.nn.modules.rnn.GRU" in msg and "fx node 'rnn'" in msg
    assert f"{THIS}:" in msg and "return self.rnn(x)" in msg and "supported modules: AdaptiveAvgPool2d, AvgPool2d, BatchNorm2d, Conv2d" in msg


class BadFunction(tnn.Module):
    def forward(self, x):
        return torch.cumsum(x, 1)


def test_unsupported_function():
    with pytest.raises(TorchImportError, match=r"unsupported function at fx node 'cumsum' \(call_function "
                       r"function torch.cumsum\), .*test_from_torch.py:\d+: return torch.cumsum\(x, 1\)"):
        from_torch(BadFunction(), torch.zeros(2, 3))


class BadMethod(tnn.Module):
    def forward(self, x):
        return x.cumsum(1)


def test_unsupported_method():
    with pytest.raises(TorchImportError, match=r"unsupported tensor method .cumsum\(\) at fx node 'cumsum'"):
        from_torch(BadMethod(), torch.zeros(2, 3))


class BadArgument(tnn.Module):
    def forward(self, x):
        return torch.add(x, x, alpha=2)


class BadModuleArgument(tnn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = tnn.Conv2d(2, 2, 3, dilation=2)

    def forward(self, x):
        return self.conv(x)


class Slicing(tnn.Module):
    def forward(self, x):
        return x[:, 1:]


def test_unsupported_arguments():
    with pytest.raises(TorchImportError, match=r"unsupported argument alpha=2 \(only alpha=1\) at fx node 'add'"):
        from_torch(BadArgument(), torch.zeros(2, 3))
    with pytest.raises(TorchImportError, match=r"unsupported argument dilation=\(2, 2\) .* of Conv2d at "
                       r"fx node 'conv'.*return self.conv\(x\)"):
        from_torch(BadModuleArgument(), torch.zeros(1, 2, 5, 5))
    with pytest.raises(TorchImportError, match=r"tensor indexing/slicing .* at fx node 'getitem'"):
        from_torch(Slicing(), torch.zeros(2, 3))


class Branchy(tnn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x
        return -x


def test_control_flow_gets_torch_message_and_advice():
    with pytest.raises(TorchImportError, match=r"torch.fx cannot trace Branchy: symbolically traced variables cannot "
                       r"be used as inputs to control flow; branch on Python values only"):
        from_torch(Branchy(), torch.zeros(2, 3))


class SlicedEmbedding(tnn.Module):  # a ViT's positional embedding cut to the tokens present
    def __init__(self) -> None:
        super().__init__()
        self.pos = tnn.Parameter(torch.zeros(1, 8, 3))

    def forward(self, x):
        return x + self.pos[:, :x.shape[1]]


class UsesLen(tnn.Module):
    def forward(self, x):
        return x * len(x)


def test_what_fx_or_ember_cannot_take_is_one_import_error():
    """A sliced parameter and len() of a traced tensor (a TypeError and fx's RuntimeError escaped
    before: session 36's probe) are TorchImportErrors naming the node or fx's reason."""
    with pytest.raises(TorchImportError, match=r"tensor indexing/slicing .* at fx node 'getitem_1' .*self.pos\[:, "):
        from_torch(SlicedEmbedding(), torch.zeros(2, 5, 3))
    with pytest.raises(TorchImportError, match=r"torch.fx cannot trace UsesLen: .*take sizes as constructor arguments"):
        from_torch(UsesLen(), torch.zeros(2, 3))


class WithBuffer(tnn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("offset", torch.ones(3))

    def forward(self, x):
        return x + self.offset


def test_buffers_are_refused():
    with pytest.raises(TorchImportError, match=r"unsupported buffer or constant tensor .* at fx node 'offset' "
                       r"\(get_attr attribute self.offset\), .*return x \+ self.offset"):
        from_torch(WithBuffer(), torch.zeros(2, 3))


def test_not_a_torch_module():
    with pytest.raises(TypeError, match="expects a torch.nn.Module"):
        from_torch(nn.Linear(2, 2), np.zeros((1, 2), np.float32))


@pytest.mark.parametrize("loss", ["CrossEntropyLoss", "NLLLoss", "MSELoss"])
def test_torch_loss_modules_import_as_loss_functions(loss):
    rng = np.random.default_rng(0)
    z = rng.standard_normal((6, 4)).astype(np.float32)
    y = rng.standard_normal((6, 4)).astype(np.float32) if loss == "MSELoss" else rng.integers(0, 4, 6)
    for reduction in ("mean", "sum"):
        tl = getattr(tnn, loss)(reduction=reduction)
        ours = from_torch(tl, (torch.from_numpy(z), torch.from_numpy(y)))
        from ember.frontends import trace
        from ember.ir.interpreter import run
        got = run(trace(ours, z, y, input_names=["z", "y"]), {"z": z, "y": y}).outputs["out"]
        np.testing.assert_allclose(got, tl(torch.from_numpy(z), torch.from_numpy(y)).item(), rtol=1e-6)
    with pytest.raises(TorchImportError, match=r"unsupported argument label_smoothing=0.1 \(only label_smoothing=0.0\) "
                       r"at fx node 'cross_entropy'"):
        from_torch(tnn.CrossEntropyLoss(label_smoothing=0.1), (torch.from_numpy(z), torch.from_numpy(y)))


def test_imported_loss_trains_an_imported_model():
    tm = TorchMLP()
    ref = copy.deepcopy(tm)
    x, y = _batch(8, (1, 28, 28))
    model = from_torch(tm, torch.from_numpy(x))
    loss_fn = from_torch(tnn.CrossEntropyLoss(), (torch.zeros(8, 10), torch.from_numpy(y)))
    step = compile(model, loss_fn, optim.SGD(model.parameters(), lr=0.05), (x, y), device="reference")
    topt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for _ in range(2):
        ours = step(x, y)
        topt.zero_grad()
        loss = tnn.CrossEntropyLoss()(ref(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        topt.step()
        assert abs(ours - loss.item()) < 1e-5


class InplaceShared(tnn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.relu = tnn.ReLU(inplace=True)

    def forward(self, x):
        y = x * 2
        z = self.relu(y)
        return y + z  # torch's y is the relu'd y here


class InplaceAlone(tnn.Module):
    def forward(self, x):
        return TF.relu(x * 2, inplace=True) + 1


def test_inplace_is_refused_only_when_the_input_is_read_again():
    with pytest.raises(TorchImportError, match=r"inplace=True on 'mul', which is also read by \['add'\] at fx node 'relu'"):
        from_torch(InplaceShared(), torch.zeros(2, 3))
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    from ember.frontends import trace
    from ember.ir.interpreter import evaluate
    model = from_torch(InplaceAlone(), torch.from_numpy(x))
    np.testing.assert_allclose(evaluate(trace(model, x), x), _forward(InplaceAlone(), x), rtol=1e-6)


def test_dropout_is_the_identity_in_eval_mode_and_draws_masks_in_training():
    # training against PyTorch with ember's masks: tests/frontends/test_dropout.py
    torch.manual_seed(0)
    tm = tnn.Sequential(tnn.Linear(4, 3), tnn.Dropout(0.5))
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    model = from_torch(tm.eval(), torch.from_numpy(x))
    assert not model.training
    step = compile(model, nn.MSELoss(), optim.SGD(lr=0.1), (x, np.zeros((2, 3), np.float32)), device="reference")
    np.testing.assert_allclose(step.inference(x), _forward(tm, x), rtol=1e-6)
    model.train()
    out = step.inference(x)
    kept = out != 0
    np.testing.assert_allclose(out[kept], 2 * _forward(tm, x)[kept], rtol=1e-6)


class TwoHeads(tnn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = tnn.Linear(4, 3), tnn.Linear(4, 2)

    def forward(self, x):
        return self.a(x), self.b(x)


def test_a_model_returning_several_values_is_refused_at_import():
    with pytest.raises(TorchImportError, match=r"^from_torch: the model returns a tuple \(a, b\), not one tensor, "
                                              r"at .*test_from_torch.py:\d+: return self.a\(x\), self.b\(x\); "
                                              r"return one tensor \(compile\(\) trains loss_fn\(model\(x\), y\)\)$"):
        from_torch(TwoHeads(), torch.zeros(2, 4))


def test_from_torch_without_pytorch_names_the_extra(monkeypatch):
    import sys

    from ember.frontends import from_torch
    monkeypatch.setitem(sys.modules, "torch", None)  # an import of torch now fails as if it were missing
    with pytest.raises(ModuleNotFoundError, match=r"from_torch needs PyTorch: pip install 'ember\[torch\]'"):
        from_torch(object(), ())
