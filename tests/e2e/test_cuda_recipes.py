"""lenet5 and resnet8 on the CUDA backend (marked `cuda`: run on a GPU; skipped elsewhere).

Per step from the same weights, as tests/e2e/test_cuda_training.py does for the CNN and MLP, but
against ember's reference device: before every CUDA step the reference step (the NumPy
interpreter, float32) and a float64 PyTorch twin on the CPU are loaded with the CUDA step's
weights (and BatchNorm's running statistics) and take the same step. The loss agrees with the
reference's to 1e-5; the CUDA update is as close to the float64 update as the reference's
float32 update is (median over steps of the ratio of their distances at most 1.5); resnet8's
running statistics agree with the reference's to 1e-6 relative. Also: two CUDA runs of lenet5
give identical losses, and a step with overlapping ceil-mode pooling and Dropout trains like
the reference (the masks' bit-for-bit check is in tests/frontends/test_dropout.py).
"""
from __future__ import annotations

import numpy as np
import pytest

from ember.frontends import compile, nn, optim
from ember.frontends.training import build_model

pytestmark = pytest.mark.cuda

LR = 0.05
DEVICE = "cuda"  # a dry run of these checks elsewhere: set to "cpu"


def _batches(steps: int, batch: int = 64, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (rng.random((steps, batch, 1, 28, 28), dtype=np.float32),
            rng.integers(0, 10, (steps, batch)).astype(np.int64))


def _step(name: str, device: str, x, y):
    return compile(build_model(name), nn.CrossEntropyLoss(), optim.SGD(lr=LR), example_inputs=(x, y), device=device)


def _torch64_update(name: str, state: dict, x, y) -> dict[str, np.ndarray]:
    import torch
    import torch.nn.functional as tF

    from ember.frontends.training.torch_twins import torch_model
    model = torch_model(name).double()
    model.load_state_dict({k: torch.from_numpy(np.asarray(v).astype(np.float64) if np.asarray(v).dtype.kind == "f"
                                               else np.asarray(v)) for k, v in state.items()})
    loss = tF.cross_entropy(model(torch.from_numpy(x).double()), torch.from_numpy(y))
    loss.backward()
    with torch.no_grad():
        return {k: (p - LR * p.grad).numpy() for k, p in model.named_parameters()}


@pytest.mark.parametrize("name,steps", [("lenet5", 12), ("resnet8", 6)])
def test_per_step_from_the_same_weights_matches_the_reference_device(name, steps):
    pytest.importorskip("torch")
    xs, ys = _batches(steps, seed=1)
    cuda = _step(name, DEVICE, xs[0], ys[0])
    ref = _step(name, "reference", xs[0], ys[0])
    params = [k for k, _ in build_model(name).named_parameters()]
    ratios = []
    for x, y in zip(xs, ys):
        state = cuda.state_dict()
        ref.load_state_dict(state)
        upd64 = _torch64_update(name, state, x, y)
        loss_ref = ref(x, y)
        loss = cuda(x, y)
        assert abs(loss - loss_ref) <= 1e-5 * max(1.0, abs(loss_ref)), (loss, loss_ref)
        after, after_ref = cuda.state_dict(), ref.state_dict()
        before = {k: state[k].astype(np.float64) for k in params}
        num_e = sum(np.sum(((after[k] - before[k]) - (upd64[k] - before[k])) ** 2) for k in params)
        num_r = sum(np.sum(((after_ref[k] - before[k]) - (upd64[k] - before[k])) ** 2) for k in params)
        ratios.append(np.sqrt(num_e) / max(np.sqrt(num_r), 1e-30))
        for k in after:
            if "running" in k:
                np.testing.assert_allclose(after[k], after_ref[k], rtol=1e-6, atol=1e-7, err_msg=k)
            elif k.endswith("num_batches_tracked"):
                assert after[k] == after_ref[k]
    assert np.median(ratios) <= 1.5, ratios


def test_lenet5_two_cuda_runs_give_identical_losses():
    xs, ys = _batches(10)
    runs = []
    for _ in range(2):
        step = _step("lenet5", DEVICE, xs[0], ys[0])
        runs.append([step(x, y) for x, y in zip(xs, ys)])
    assert runs[0] == runs[1]


def test_overlapping_ceil_mode_pooling_and_dropout_train_like_the_reference():
    nn.manual_seed(0)

    def model():
        nn.manual_seed(0)
        return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2, 1, ceil_mode=True),
                             nn.Dropout(0.25), nn.Flatten(), nn.Linear(4 * 15 * 15, 10))
    xs, ys = _batches(5, batch=16, seed=2)
    losses = {}
    for device in ("reference", DEVICE):
        step = compile(model(), nn.CrossEntropyLoss(), optim.SGD(lr=LR), (xs[0], ys[0]), device=device)
        losses[device] = [step(x, y) for x, y in zip(xs, ys)]
    np.testing.assert_allclose(losses[DEVICE], losses["reference"], rtol=1e-5, atol=1e-6)
