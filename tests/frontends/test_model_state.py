"""The model always holds the current values, on every device: reading a parameter, a BatchNorm
running statistic or the optimizer state after steps gives the trained values, and writing one
(in place, by rebinding `.data`, by `load_state_dict`) reaches the next step. FAKE_DEVICE keeps
its own copies as a GPU does (`models.FakeDeviceStorage`), so the device path runs here without
one; the `cuda` case runs where a GPU is. Also: a parameter replaced after compile() is adopted
(same shape and dtype) or refused in one line."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from ember.frontends import compile, nn, optim
from ember.frontends import functional as F
from ember.frontends.tensor import Parameter

from models import FAKE_DEVICE, device_fixture, storage_targets


class Net(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        nn.manual_seed(seed)
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 10)

    def forward(self, x):
        return self.fc(F.flatten(F.relu(self.bn(self.conv(x))), 1))


@pytest.fixture(params=storage_targets())
def device(request):
    yield from device_fixture(request)


def _batches(n: int = 3, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [((rng.standard_normal((8, 1, 6, 6)) * 2 + 1).astype(np.float32), rng.integers(0, 10, 8))
            for _ in range(n)]


def _compile(model: nn.Module, device: str):
    return compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1, momentum=0.9), _batches(1)[0], device=device)


def test_the_model_reads_the_trained_values(device):
    model, twin = Net(), Net()
    step, ref = _compile(model, device), _compile(twin, "reference")
    before = model.state_dict()
    for x, y in _batches():
        step(x, y)
        ref(x, y)
    want = twin.state_dict()
    got = model.state_dict()
    assert list(got) == list(want)
    for k in want:
        # conv.bias feeds the BatchNorm, whose mean subtraction cancels it: its gradient is zero
        # up to rounding (exactly zero where the sums round alike), so it may keep its value
        if k != "conv.bias":
            assert not np.array_equal(got[k], before[k]), f"{k} still holds its initial value"
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5, err_msg=k)
    # every way of reading: a parameter's and a buffer's .data, the step's state_dict
    np.testing.assert_array_equal(model.fc.weight.data, got["fc.weight"])
    np.testing.assert_array_equal(model.bn.running_var.data, got["bn.running_var"])
    assert model.bn.num_batches_tracked.data.shape == () and int(model.bn.num_batches_tracked.data) == 3
    copied = copy.deepcopy(model)  # the current values, and no longer tied to the step
    assert all(p._link is None for _, p in copied._named_state())
    step(*_batches(1, seed=1)[0])
    for k, v in copied.state_dict().items():
        np.testing.assert_array_equal(v, got[k], err_msg=k)
    got = model.state_dict()
    for k, v in step.state_dict().items():
        np.testing.assert_array_equal(v, got[k], err_msg=k)
    ref(*_batches(1, seed=1)[0])
    osd, ref_osd = step.optimizer_state_dict(), ref.optimizer_state_dict()
    for k in ref_osd:
        np.testing.assert_allclose(osd[k], ref_osd[k], rtol=1e-4, atol=1e-5, err_msg=k)


def test_writes_reach_the_next_step(device):
    model = Net()
    step = _compile(model, device)
    batches = _batches()
    sd0, osd0 = model.state_dict(), step.optimizer_state_dict()
    losses = [step(x, y) for x, y in batches]
    after = model.state_dict()
    # model.load_state_dict (parameters and BatchNorm statistics) and the optimizer state back
    # to the start: the same steps again give bit-identical losses and state
    model.load_state_dict(sd0)
    step.load_optimizer_state_dict(osd0)
    assert [step(x, y) for x, y in batches] == losses
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(v, after[k], err_msg=k)
    # the same through the step's own state dicts
    step.load_state_dict(sd0)
    step.load_optimizer_state_dict(osd0)
    assert [step(x, y) for x, y in batches] == losses
    # writing into .data in place, and rebinding .data
    x = batches[0][0]
    model.fc.weight.data[...] = 0.0
    model.fc.bias.data = np.full(10, 2.0, np.float32)
    np.testing.assert_array_equal(step.inference(x), np.full((8, 10), 2.0, np.float32))
    model.eval()
    model.bn.running_mean.data[...] = 1.0
    model.bn.running_var.data = np.full(4, 4.0, np.float32)
    model.fc.weight.data[...] = 0.0
    model.fc.weight.data[0, :] = 1.0
    conv = _conv3x3(x, model.conv.weight.data, model.conv.bias.data)  # then BatchNorm by the written statistics
    bn = (conv - 1.0) / np.sqrt(4.0 + 1e-5) * model.bn.weight.data[:, None, None] + model.bn.bias.data[:, None, None]
    want0 = np.maximum(bn, 0).reshape(8, -1).sum(1) + 2.0
    np.testing.assert_allclose(step.inference(x)[:, 0], want0, rtol=1e-4, atol=1e-4)


def _conv3x3(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A valid 3x3 convolution of (N, 1, H, W) images, in NumPy."""
    n, _, hh, ww = x.shape
    out = np.zeros((n, w.shape[0], hh - 2, ww - 2), np.float64)
    for i in range(3):
        for j in range(3):
            out += x[:, :, i:i + hh - 2, j:j + ww - 2] * w[None, :, 0, i, j, None, None]
    return out + b[None, :, None, None]


def test_an_untouched_training_loop_copies_nothing(device):
    if device != FAKE_DEVICE:
        pytest.skip("counts the copies of the device-like storage")
    model = Net()
    step = _compile(model, device)
    storage = step.storage
    entries = len(model.state_dict())
    batches = _batches(5)
    step(*batches[0])
    storage.reads = storage.writes = 0
    for x, y in batches:
        step(x, y)
    assert (storage.reads, storage.writes) == (0, 0)
    w = model.fc.weight.data  # one pull; the next step pushes it back (the caller may have written)
    assert (storage.reads, storage.writes) == (1, 0)
    assert model.fc.weight.data is w  # pulled into the same array
    step(*batches[0])
    assert (storage.reads, storage.writes) == (1, 1)
    model.state_dict()  # read-only: pulls what is stale, pushes nothing
    step(*batches[0])
    step(*batches[0])
    assert (storage.reads, storage.writes) == (1 + entries, 1)


def test_a_replaced_parameter_of_the_same_shape_is_adopted(device):
    model, twin = Net(), Net()
    step, ref = _compile(model, device), _compile(twin, "reference")
    batches = _batches()
    step(*batches[0])
    ref(*batches[0])
    old = model.fc
    old_values = old.state_dict()
    nn.manual_seed(7)
    model.fc = nn.Linear(64, 10)
    nn.manual_seed(7)
    twin.fc = nn.Linear(64, 10)
    model.conv.bias = Parameter(np.full(4, 0.5, np.float32))
    twin.conv.bias = Parameter(np.full(4, 0.5, np.float32))
    fresh = model.fc.state_dict()
    for x, y in batches[1:]:
        np.testing.assert_allclose(step(x, y), ref(x, y), rtol=1e-4)
    assert not np.array_equal(model.fc.weight.data, fresh["weight"])  # the new layer is trained
    got, want = model.state_dict(), twin.state_dict()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5, err_msg=k)
    for k, v in step.state_dict().items():
        np.testing.assert_array_equal(v, got[k], err_msg=k)
    for k, v in old.state_dict().items():  # the replaced layer keeps its values, untouched by later steps
        np.testing.assert_array_equal(v, old_values[k], err_msg=k)


def test_a_replaced_parameter_of_another_shape_or_structure_is_refused():
    x, y = _batches(1)[0]
    model = Net()
    step = _compile(model, "reference")
    model.fc.weight = Parameter(np.zeros((5, 64), np.float32))
    with pytest.raises(ValueError, match=r"^parameter 'fc.weight' was replaced after compile\(\) by f32\[5,64\]; "
                                         r"the step was compiled for f32\[10,64\]"):
        step(x, y)
    model = Net()
    step = _compile(model, "reference")
    model.fc = nn.Linear(64, 10, bias=False)
    with pytest.raises(ValueError, match=r"^parameter 'fc.bias' was removed after compile\(\)"):
        step(x, y)
    model = Net()
    step = _compile(model, "reference")
    model.bn.running_mean = nn.Buffer(np.zeros(4, np.float64), "float64")
    with pytest.raises(ValueError, match=r"^buffer 'bn.running_mean' was replaced after compile\(\) by f64\[4\]"):
        step.inference(x)
    model = Net()
    step = _compile(model, "reference")
    model.head = nn.Linear(10, 2)
    with pytest.raises(ValueError, match=r"^parameter 'head.weight' was added after compile\(\)"):
        step(x, y)


def test_two_steps_of_one_model_take_turns(device):
    # each step takes the model's current values when it runs: alternating them trains like one
    # (plain SGD: no optimizer state, which each step keeps its own of)
    def sgd(m, dev):
        return compile(m, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), _batches(1)[0], device=dev)
    model, twin = Net(), Net()
    a, b, ref = sgd(model, device), sgd(model, "reference"), sgd(twin, "reference")
    for x, y in _batches(4):
        a(x, y)
        b(x, y)
        ref(x, y)
        ref(x, y)
    got, want = model.state_dict(), twin.state_dict()
    assert int(got["bn.num_batches_tracked"]) == 8
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5, err_msg=k)
