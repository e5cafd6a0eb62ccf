"""NaN and inf in a batch give every code-generating target the reference's result.

The interpreter (and PyTorch: torch.relu(nan) is nan) lets a NaN through ReLU, max pooling and
the loss, so a poisoned batch shows up as a NaN loss. A backend whose ReLU spells max(x, 0) the
NaN-dropping way (x > 0 ? x : 0, CUDA's fmaxf, or an x86 max with its operands in the wrong
order) returns a finite loss while the parameters silently turn NaN: the one failure a
non-finite check on the loss cannot see. The CUDA side without a GPU is checked statically in
test_cuda_nonfinite_sources.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from ember.frontends import compile, nn, optim

from models import compiled_targets

N, H, W = 5, 7, 6  # odd sizes: the kernels' vector tails and partial tiles see the poison too


def _model() -> nn.Module:
    nn.manual_seed(3)
    # every fused-ReLU site: conv + bias + relu, matmul + bias + relu; then max pooling
    return nn.Sequential(nn.Conv2d(2, 5, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, 1), nn.Flatten(),
                         nn.Linear(5 * (H - 1) * (W - 1), 24), nn.ReLU(), nn.Linear(24, 10))


def _batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, 2, H, W)).astype(np.float32)
    x[1, 0, 3, 2] = np.nan
    # inside the image: on its right edge an inf would also meet the CPU grad-weight kernel's
    # padded row pitch (0 * inf), where the reference has no product at all
    x[2, 1, 4, 3] = np.inf
    x[3, 0, 1, 1] = -np.inf
    return x, rng.integers(0, 10, N)


def _assert_same_nonfinite(got: np.ndarray, want: np.ndarray, what: str) -> None:
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{what}: NaN positions")
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want), err_msg=f"{what}: +inf positions")
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=f"{what}: -inf positions")
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-4, atol=1e-5, err_msg=what)


@pytest.mark.parametrize("device", compiled_targets())
def test_nan_and_inf_inputs_give_the_references_logits_loss_and_parameters(device):
    x, y = _batch()
    steps = {d: compile(_model(), nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example_inputs=(x, y), device=d)
             for d in ("reference", device)}
    ref, got = steps["reference"], steps[device]
    with np.errstate(invalid="ignore"):
        want_logits = ref.inference(x)
        # the clean images stay finite; the poisoned ones are NaN in the reference
        assert np.isfinite(want_logits[[0, 4]]).all() and np.isnan(want_logits[1]).all()
        _assert_same_nonfinite(got.inference(x), want_logits, "logits")
        want_loss, got_loss = ref(x, y), got(x, y)
    assert np.isnan(want_loss) and np.isnan(got_loss), (want_loss, got_loss)
    for k, v in ref.state_dict().items():
        _assert_same_nonfinite(np.asarray(got.state_dict()[k]), v, f"parameter {k} after the step")


@pytest.mark.parametrize("device", compiled_targets())
def test_relu_of_a_nan_or_inf_activation_is_the_references(device):
    """A large finite batch through Linear + ReLU, with NaN and +-inf planted in the weights'
    output columns via the bias: whole columns of the pre-activation are NaN, +inf or -inf, so
    every lane of the vector epilogue and its scalar tail sees each value."""
    nn.manual_seed(0)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((37, 70)).astype(np.float32)
    y = rng.integers(0, 10, 37)
    outs = {}
    for d in ("reference", device):
        nn.manual_seed(0)
        model = nn.Sequential(nn.Linear(70, 21), nn.ReLU(), nn.Linear(21, 10))
        model[0].bias.data[[0, 7, 9, 20]] = [np.nan, np.inf, -np.inf, np.nan]
        step = compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example_inputs=(x, y), device=d)
        hidden = compile(nn.Sequential(model[0], model[1]), nn.CrossEntropyLoss(), optim.SGD(lr=0.1),
                         example_inputs=(x, y), device=d)
        with np.errstate(invalid="ignore"):
            outs[d] = hidden.inference(x), step.inference(x)
    want_h, want_out = outs["reference"]
    assert np.isnan(want_h[:, [0, 20]]).all() and np.isposinf(want_h[:, 7]).all() and (want_h[:, 9] == 0).all()
    _assert_same_nonfinite(outs[device][0], want_h, "relu(x @ w.T + b)")
    _assert_same_nonfinite(outs[device][1], want_out, "logits")
