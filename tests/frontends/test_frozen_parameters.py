"""Which parameters a training step trains, as torch.optim decides it: those in the optimizer's
`params` (all, without it), less those with `requires_grad = False`; a frozen parameter gets no
gradient and keeps its values; changing `requires_grad` after compile() takes effect at the next
step. from_torch keeps torch's frozen parameters frozen and its tied parameters one (session 36's
new-user probe found every parameter trained whatever the optimizer was given, and tied weights
untied)."""
from __future__ import annotations

import numpy as np
import pytest

from ember.frontends import compile, nn, optim

RNG = np.random.default_rng(0)
X = RNG.standard_normal((6, 5)).astype(np.float32)
Y = np.array([0, 1, 2, 0, 1, 2])


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))


def _values(m: nn.Module) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in m.state_dict().items()}


@pytest.mark.parametrize("device", ["reference", "cpu"])
def test_only_the_optimizers_params_are_trained(device):
    m = _mlp()
    before = _values(m)
    step = compile(m, nn.CrossEntropyLoss(), optim.SGD(m[2].parameters(), lr=0.5), (X, Y), device=device)
    for _ in range(2):
        step(X, Y)
    after = _values(m)
    assert all(np.array_equal(after[k], before[k]) for k in ("0.weight", "0.bias")), "a parameter left out trained"
    assert not np.array_equal(after["2.weight"], before["2.weight"])


@pytest.mark.parametrize("device", ["reference", "cpu"])
def test_requires_grad_false_freezes_and_true_again_trains(device):
    m = _mlp()
    m[0].weight.requires_grad = False
    step = compile(m, nn.CrossEntropyLoss(), optim.SGD(lr=0.5), (X, Y), device=device)
    frozen = np.array(m[0].weight.data)
    step(X, Y)
    assert np.array_equal(m[0].weight.data, frozen)
    assert not np.array_equal(np.array(m[0].bias.data), _mlp()[0].bias.data)
    m[0].weight.requires_grad_(True)  # unfrozen after compile(): the next step trains it
    assert step.train_graph.meta["frozen"] == ()  # (its graph, asked before a step, compiled then)
    step(X, Y)
    assert not np.array_equal(m[0].weight.data, frozen)


def test_the_subset_step_matches_pytorch():
    torch = pytest.importorskip("torch")
    from alignment import sgd_steps_match_torch

    from ember.frontends import from_torch
    torch.manual_seed(0)
    tm = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    tm[0].bias.requires_grad_(False)
    m = from_torch(tm, example_inputs=(torch.zeros(6, 5),))
    assert m.state_dict().keys() == tm.state_dict().keys() and not dict(m.named_parameters())["0.bias"].requires_grad
    first = [p for name, p in m.named_parameters() if name.startswith("0.")]
    step = compile(m, nn.CrossEntropyLoss(), optim.SGD(first, lr=0.5), (X, Y), device="cpu")
    sgd_steps_match_torch(step, tm, [tm[0].weight, tm[0].bias], X, Y, lr=0.5)
    for k, v in step.state_dict().items():
        np.testing.assert_allclose(v, tm.state_dict()[k].numpy(), rtol=1e-5, atol=1e-6, err_msg=k)


def test_tied_torch_parameters_stay_one_parameter():
    torch = pytest.importorskip("torch")
    from alignment import sgd_steps_match_torch

    from ember.frontends import from_torch

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.dec = torch.nn.Linear(5, 5, bias=False), torch.nn.Linear(5, 5, bias=False)
            self.dec.weight = self.enc.weight
            self.out = torch.nn.Linear(5, 3)

        def forward(self, x):
            return self.out(self.dec(torch.tanh(self.enc(x))))

    torch.manual_seed(0)
    tm = Tied()
    m = from_torch(tm, example_inputs=(torch.zeros(6, 5),))
    assert m.enc.weight is m.dec.weight
    # listed once, as torch lists it; state_dict keeps both names, as torch's does
    assert [k for k, _ in m.named_parameters()] == [k for k, _ in tm.named_parameters()] == \
        ["enc.weight", "out.weight", "out.bias"]
    assert len(m.parameters()) == 3 and len(list(m.named_parameters(remove_duplicate=False))) == 4
    assert list(m.state_dict()) == list(tm.state_dict())
    step = compile(m, nn.CrossEntropyLoss(), optim.SGD(lr=0.5), (X, Y), device="cpu")
    sgd_steps_match_torch(step, tm, tm.parameters(), X, Y, lr=0.5)
    sd = step.state_dict()
    assert np.array_equal(sd["enc.weight"], sd["dec.weight"])


def test_params_the_step_cannot_train_are_refused_at_compile():
    m, other = _mlp(), _mlp()
    with pytest.raises(ValueError, match=r"the optimizer's params include 4 Parameter\(s\) that are not the model's"):
        compile(m, nn.CrossEntropyLoss(), optim.SGD(other.parameters(), lr=0.1), (X, Y), device="reference")
    for p in m.parameters():
        p.requires_grad = False
    with pytest.raises(ValueError, match="nothing to train: every parameter the loss depends on is frozen"):
        compile(m, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), (X, Y), device="reference")
    with pytest.raises(TypeError, match="requires_grad must be True or False"):
        m[0].weight.requires_grad = "no"
