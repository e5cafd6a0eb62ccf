"""The lenet5 and resnet8 recipes: PyTorch's initialisation bit for bit (against the same models
written in PyTorch), the same logits, and training on device="cpu" as in PyTorch (BatchNorm's
running statistics included)."""
from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tnn = torch.nn
TF = torch.nn.functional

from ember.frontends import compile, nn, optim  # noqa: E402
from ember.frontends.training import build_model  # noqa: E402


def torch_lenet5():
    return tnn.Sequential(tnn.Conv2d(1, 6, 5, padding=2), tnn.ReLU(), tnn.MaxPool2d(2), tnn.Conv2d(6, 16, 5), tnn.ReLU(),
                          tnn.MaxPool2d(2), tnn.Flatten(), tnn.Linear(400, 120), tnn.ReLU(), tnn.Linear(120, 84),
                          tnn.ReLU(), tnn.Linear(84, 10))


class TBlock(tnn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = tnn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = tnn.BatchNorm2d(cout)
        self.relu = tnn.ReLU()
        self.conv2 = tnn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = tnn.BatchNorm2d(cout)
        self.downsample = (tnn.Sequential(tnn.Conv2d(cin, cout, 1, stride, bias=False), tnn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x):
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        return self.relu(out + (self.downsample(x) if self.downsample is not None else x))


class TResNet8(tnn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = tnn.Conv2d(1, 16, 3, 1, 1, bias=False)
        self.bn1 = tnn.BatchNorm2d(16)
        self.relu = tnn.ReLU()
        self.layer1, self.layer2, self.layer3 = TBlock(16, 16, 1), TBlock(16, 32, 2), TBlock(32, 64, 2)
        self.avgpool = tnn.AdaptiveAvgPool2d(1)
        self.fc = tnn.Linear(64, 10)

    def forward(self, x):
        x = self.layer3(self.layer2(self.layer1(self.relu(self.bn1(self.conv1(x))))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


TWINS = {"lenet5": torch_lenet5, "resnet8": TResNet8}


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
    tm = TResNet8().eval()
    tm.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in before.items()})
    with torch.no_grad():
        ref = TF.cross_entropy(tm(torch.from_numpy(x)), torch.from_numpy(y)).item()
    assert abs(loss - ref) < 1e-5
