"""The speedrun recipe: speednet is its PyTorch twin (PyTorch's initialisation bit for bit, the
same losses under training and logits in eval mode, its translation off), and every setting of
every recipe is an option of `ember mnist`."""
from __future__ import annotations

import numpy as np
import pytest

from ember.frontends import compile, nn, optim
from ember.frontends.cli import build_parser
from ember.frontends.training import build_model
from ember.frontends.training.recipes import RECIPES, SpeedNet


def test_speednet_is_its_pytorch_twin():
    torch = pytest.importorskip("torch")
    from ember.frontends.training.torch_twins import torch_model
    torch.manual_seed(5)
    tm = torch_model("speednet")
    model = build_model("speednet", seed=5, translate=0)
    assert list(model.state_dict()) == list(tm.state_dict())
    for k, v in tm.state_dict().items():
        np.testing.assert_array_equal(model.state_dict()[k], v.numpy(), err_msg=k)
    rng = np.random.default_rng(0)
    x0, y0 = rng.random((16, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, 16)
    # SGD: Adam divides by the root of tiny second moments, so float rounding of near-zero
    # gradients turns into visible steps, which is not what this test is about
    step = compile(model, nn.CrossEntropyLoss(label_smoothing=0.1), optim.SGD(lr=0.05, momentum=0.9), (x0, y0))
    topt = torch.optim.SGD(tm.parameters(), lr=0.05, momentum=0.9)
    for i in range(3):
        x, y = rng.random((16, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, 16)
        loss = step(x, y)
        topt.zero_grad()
        ref = torch.nn.functional.cross_entropy(tm(torch.from_numpy(x)), torch.from_numpy(y), label_smoothing=0.1)
        ref.backward()
        topt.step()
        assert abs(loss - ref.item()) < 1e-5, (i, loss, ref.item())
    model.eval()
    tm.eval()
    with torch.no_grad():
        np.testing.assert_allclose(step.inference(x0), tm(torch.from_numpy(x0)).numpy(), rtol=1e-4, atol=1e-4)


def test_speednet_translates_in_training_only():
    model = SpeedNet(max_shift=2)
    assert model.augment.max_shift == 2 and not model.augment._parameters
    assert list(build_model("speednet", translate=3).state_dict()) == list(model.state_dict())


def test_every_recipe_setting_is_an_mnist_option():
    parser = build_parser()
    mnist = next(a for a in parser._actions if a.dest == "command").choices["mnist"]
    dests = {a.dest: a for a in mnist._actions}
    for name, recipe in RECIPES.items():
        for device in ("cpu", "cuda"):
            for key, value in recipe.settings_for(device).items():
                assert key in dests, (name, key)
                action = dests[key]
                if action.choices is not None:
                    assert value in action.choices, (name, key, value)
                elif action.type is not None:
                    assert action.type(str(value)) == value, (name, key, value)
