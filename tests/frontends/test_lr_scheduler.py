"""`optim.lr_scheduler` through compile(): the rate schedule runs inside the compiled step on
every code-generating target, and a training run follows PyTorch's optimizer + scheduler loop."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from models import compiled_targets

from ember.frontends import compile, nn, optim

STEPS = 30


def _pair():
    nn.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 4))
    tmodel = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 4))
    tmodel.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in model.state_dict().items()})
    return model, tmodel


@pytest.mark.parametrize("device", ["reference"] + compiled_targets())
def test_onecycle_training_follows_torch(device) -> None:
    model, tmodel = _pair()
    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    sched = optim.lr_scheduler.OneCycleLR(opt, max_lr=0.3, total_steps=STEPS)
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(STEPS, 16, 6)).astype(np.float32)
    ys = rng.integers(0, 4, size=(STEPS, 16))
    step = compile(model, nn.CrossEntropyLoss(), opt, example_inputs=(xs[0], ys[0]), device=device)
    topt = torch.optim.SGD(tmodel.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    tsched = torch.optim.lr_scheduler.OneCycleLR(topt, max_lr=0.3, total_steps=STEPS)
    for i in range(STEPS):
        assert sched.lr_at(i) == pytest.approx(tsched.get_last_lr()[0], rel=1e-12)
        loss = step(xs[i], ys[i])
        topt.zero_grad()
        tloss = torch.nn.functional.cross_entropy(tmodel(torch.from_numpy(xs[i])), torch.from_numpy(ys[i]))
        tloss.backward()
        topt.step()
        tsched.step()
        # float32 free-running over 30 steps of a 3-layer model: summation order differs by ulps
        assert loss == pytest.approx(tloss.item(), rel=1e-4), f"step {i}"
    want = {k: v.detach().numpy() for k, v in tmodel.state_dict().items()}
    for k, v in step.state_dict().items():
        np.testing.assert_allclose(v, want[k], rtol=1e-4, atol=1e-5, err_msg=k)
    assert float(step.optimizer_state_dict()["step"]) == STEPS


def test_scheduler_step_is_a_no_op_that_says_so() -> None:
    opt = optim.SGD(lr=0.1)
    sched = optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    before = opt.config
    optim.lr_scheduler.LRScheduler._warned = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched.step()
        sched.step()
    assert opt.config == before
    assert len(caught) == 1 and "inside the compiled step" in str(caught[0].message)
    assert [sched.lr_at(t) for t in range(5)] == [0.1, 0.1, 0.05, 0.05, 0.025]


def test_sequential_warmup_then_cosine_and_repr() -> None:
    opt = optim.AdamW(lr=1e-3)
    warm = optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=4)
    cos = optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    seq = optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[4])
    assert opt.config.schedule == seq.schedule
    assert seq.lr_at(0) == pytest.approx(1e-4) and seq.lr_at(4) == pytest.approx(1e-3)
    assert repr(opt).startswith("AdamW(lr=0.001,")  # not AdamW(AdamW(...))
    with pytest.raises(ValueError, match="same optimizer"):
        optim.lr_scheduler.SequentialLR(optim.SGD(lr=0.1), [warm], milestones=[])
    with pytest.raises(ValueError, match="total_steps OR"):
        optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1)
