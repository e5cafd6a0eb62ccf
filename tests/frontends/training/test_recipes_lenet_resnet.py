"""The lenet5 and resnet8 recipes: PyTorch's initialisation bit for bit (against the same models
written in PyTorch), the same logits, and training on device="cpu" as in PyTorch (BatchNorm's
running statistics included)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tnn = torch.nn
TF = torch.nn.functional

from ember.frontends import compile, nn, optim  # noqa: E402
from ember.frontends.training import build_model  # noqa: E402
from ember.frontends.training.torch_twins import torch_model  # noqa: E402


def _twin(name):
    return lambda: torch_model(name)


TWINS = {"lenet5": _twin("lenet5"), "resnet8": _twin("resnet8")}  # ember bench's and align's twins



@pytest.mark.parametrize("name", TWINS)
def test_recipe_matches_its_pytorch_twin(name):
    torch.manual_seed(3)
    tm = TWINS[name]()
    model = build_model(name, seed=3)
    ours, theirs = model.state_dict(), tm.state_dict()
    assert list(ours) == list(theirs)
    for k in theirs:
        np.testing.assert_array_equal(ours[k], theirs[k].numpy(), err_msg=k)
    rng = np.random.default_rng(0)
    x0 = rng.random((8, 1, 28, 28), dtype=np.float32)
    y0 = rng.integers(0, 10, 8)
    step = compile(model, nn.CrossEntropyLoss(), optim.SGD(model.parameters(), lr=0.05, momentum=0.9), (x0, y0),
                   device="cpu")
    topt = torch.optim.SGD(tm.parameters(), lr=0.05, momentum=0.9)
    for i in range(3):
        x = rng.random((8, 1, 28, 28), dtype=np.float32)
        y = rng.integers(0, 10, 8)
        loss = step(x, y)
        topt.zero_grad()
        ref = TF.cross_entropy(tm(torch.from_numpy(x)), torch.from_numpy(y))
        ref.backward()
        topt.step()
        assert abs(loss - ref.item()) < 1e-5, (i, loss, ref.item())
    model.eval()
    tm.eval()
    with torch.no_grad():
        np.testing.assert_allclose(step.inference(x0), tm(torch.from_numpy(x0)).numpy(), rtol=1e-4, atol=1e-5)
    for k, v in tm.state_dict().items():
        np.testing.assert_allclose(step.state_dict()[k], v.numpy(), rtol=1e-4, atol=1e-5, err_msg=k)


def test_trainer_evaluates_batch_norm_in_eval_mode():
    from ember.frontends.training import Trainer
    rng = np.random.default_rng(0)
    x = rng.random((16, 1, 28, 28), dtype=np.float32)
    y = rng.integers(0, 10, 16)
    model = build_model("resnet8")
    trainer = Trainer(model, optim.SGD(lr=0.05), (x, y), (x, y), device="reference", batch_size=8, eval_batch_size=8)
    before = {k: v.copy() for k, v in model.state_dict().items()}
    loss, _ = trainer.evaluate()
    assert model.training  # restored
    for k, v in model.state_dict().items():  # evaluation leaves the running statistics alone
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    torch.manual_seed(0)
    tm = torch_model("resnet8").eval()
    tm.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in before.items()})
    with torch.no_grad():
        ref = TF.cross_entropy(tm(torch.from_numpy(x)), torch.from_numpy(y)).item()
    assert abs(loss - ref) < 1e-5
