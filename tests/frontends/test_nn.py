"""ember.frontends.nn: PyTorch parameter names, state_dict round trips, default initialisation,
seeding, refused Conv2d options, and the issue's done-when check: the traced MNIST CNN and MLP,
loaded with a PyTorch model's weights, give the same logits through the reference interpreter
(max abs difference <= 1e-5 in float32), on real MNIST test images when they are available.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from ember.frontends import Parameter, manual_seed, nn, spec, trace
from ember.ir import run

MNIST_DIR = Path(__file__).resolve().parents[2].parent / "shared/data/mnist"
LOGITS_TOL = 1e-5


def ember_cnn():
    return nn.Sequential(nn.Conv2d(1, 16, 3), nn.ReLU(), nn.Conv2d(16, 32, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(18432, 10))


def torch_cnn():
    tn = torch.nn
    return tn.Sequential(tn.Conv2d(1, 16, 3), tn.ReLU(), tn.Conv2d(16, 32, 3), tn.ReLU(), tn.Flatten(),
                         tn.Linear(18432, 10))


def ember_mlp():
    return nn.Sequential(nn.Linear(784, 30), nn.Sigmoid(), nn.Linear(30, 10))


def torch_mlp():
    tn = torch.nn
    return tn.Sequential(tn.Linear(784, 30), tn.Sigmoid(), tn.Linear(30, 10))


MODELS = {"cnn": (ember_cnn, torch_cnn, (1, 28, 28)), "mlp": (ember_mlp, torch_mlp, (784,))}


# ---- names and state dicts -------------------------------------------------------------------

@pytest.mark.parametrize("kind", MODELS)
def test_parameter_names_and_shapes_match_pytorch(kind):
    make_e, make_t, _ = MODELS[kind]
    ours = [(k, tuple(p.shape)) for k, p in make_e().named_parameters()]
    theirs = [(k, tuple(p.shape)) for k, p in make_t().named_parameters()]
    assert ours == theirs
    assert list(make_e().state_dict()) == list(make_t().state_dict())


def test_nested_modules_and_no_bias_names_match_pytorch():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(nn.Conv2d(1, 4, 3, bias=False), nn.Tanh())
            self.head = nn.Linear(4, 2, bias=False)

    class TNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.features = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, bias=False), torch.nn.Tanh())
            self.head = torch.nn.Linear(4, 2, bias=False)

    assert [k for k, _ in Net().named_parameters()] == [k for k, _ in TNet().named_parameters()] == \
        ["features.0.weight", "head.weight"]
    assert Net().head.bias is None
    assert len(Net().parameters()) == 2


def test_state_dict_round_trip():
    manual_seed(1)
    a = ember_mlp()
    manual_seed(2)
    b = ember_mlp()
    sd = a.state_dict()
    assert all(isinstance(v, np.ndarray) and v.dtype == np.float32 for v in sd.values())
    sd["0.bias"][:] = 123.0  # a copy: the module is untouched
    assert not np.any(a[0].bias.data == 123.0)
    b.load_state_dict(a.state_dict())
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb
        np.testing.assert_array_equal(va, vb)
    # loading writes in place, so graphs traced earlier keep seeing the module's arrays
    w = b[0].weight
    b.load_state_dict({k: v * 0 for k, v in a.state_dict().items()})
    assert b[0].weight is w and not w.data.any()


def test_state_dict_from_pytorch_and_float64_values_are_cast():
    t = torch_mlp()
    e = ember_mlp()
    e.load_state_dict(t.state_dict())
    for (k, v), (tk, tv) in zip(e.state_dict().items(), t.state_dict().items()):
        assert k == tk and v.dtype == np.float32
        np.testing.assert_array_equal(v, tv.numpy())
    e.load_state_dict({k: v.astype(np.float64) for k, v in e.state_dict().items()})
    assert all(v.dtype == np.float32 for v in e.state_dict().values())


def test_load_state_dict_errors():
    m = ember_mlp()
    sd = m.state_dict()
    missing = {k: v for k, v in sd.items() if k != "2.bias"}
    with pytest.raises(KeyError, match=r"missing \['2.bias'\]"):
        m.load_state_dict(missing)
    with pytest.raises(KeyError, match=r"unexpected \['3.weight'\]"):
        m.load_state_dict({**sd, "3.weight": np.zeros(3)})
    bad = dict(sd)
    bad["0.weight"] = np.zeros((784, 30), np.float32)
    with pytest.raises(ValueError, match=r"0.weight: expected shape \(30, 784\), got \(784, 30\)"):
        m.load_state_dict(bad)
    before = m.state_dict()
    m.load_state_dict({"2.bias": np.ones(10), "extra": np.zeros(1)}, strict=False)
    after = m.state_dict()
    np.testing.assert_array_equal(after["2.bias"], np.ones(10))
    np.testing.assert_array_equal(after["0.weight"], before["0.weight"])


# ---- initialisation --------------------------------------------------------------------------

@pytest.mark.parametrize("layer,fan_in", [
    (lambda: nn.Linear(784, 30), 784), (lambda: nn.Linear(30, 10), 30),
    (lambda: nn.Conv2d(1, 16, 3), 9), (lambda: nn.Conv2d(16, 32, 3), 144), (lambda: nn.Conv2d(3, 8, (3, 5)), 45),
])
def test_init_bounds(layer, fan_in):
    manual_seed(0)
    m = layer()
    bound = 1 / math.sqrt(fan_in)  # kaiming_uniform(a=sqrt(5)): gain sqrt(1/3), bound sqrt(3)*gain/sqrt(fan_in)
    for name, p in m.named_parameters():  # bias: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), the same bound
        assert p.data.dtype == np.float32
        assert np.abs(p.data).max() <= bound, name
    w = m.weight.data
    assert np.abs(w).max() > 0.9 * bound  # uses the whole range, not a part of it
    assert (w > 0).any() and (w < 0).any()


def test_init_distribution_matches_pytorch():
    manual_seed(0)
    torch.manual_seed(0)
    ours, theirs = nn.Linear(400, 500), torch.nn.Linear(400, 500)
    bound = 1 / math.sqrt(400)
    w, tw = ours.weight.data.ravel(), theirs.weight.detach().numpy().ravel()
    for sample in (w, tw):
        assert abs(sample.mean()) < 0.01 * bound
        assert abs(sample.std() - bound / math.sqrt(3)) < 0.01 * bound  # U(-b, b) has std b/sqrt(3)
        hist, _ = np.histogram(sample, bins=10, range=(-bound, bound))
        assert hist.min() > 0.9 * len(sample) / 10  # flat
    assert np.abs(w.std() - tw.std()) < 0.01 * bound


def test_seeding_is_reproducible():
    manual_seed(123)
    a = ember_cnn().state_dict()
    manual_seed(123)
    b = ember_cnn().state_dict()
    manual_seed(124)
    c = ember_cnn().state_dict()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert any(not np.array_equal(a[k], c[k]) for k in a)
    # successive layers draw fresh values
    manual_seed(5)
    l1, l2 = nn.Linear(10, 10), nn.Linear(10, 10)
    assert not np.array_equal(l1.weight.data, l2.weight.data)


# ---- module behaviour ------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [{"dilation": 2}, {"dilation": (1, 2)}])
def test_conv2d_refuses_dilation(kwargs):
    with pytest.raises(NotImplementedError, match="dilation.*not supported") as ei:
        nn.Conv2d(4, 4, 3, **kwargs)
    assert "only dilation=1" in str(ei.value)


def test_conv2d_refuses_groups_that_do_not_divide_the_channels():
    with pytest.raises(ValueError, match="groups=3 must divide in_channels=4 and out_channels=6"):
        nn.Conv2d(4, 6, 3, groups=3)


def test_conv2d_accepts_default_dilation_and_groups():
    m = nn.Conv2d(2, 4, 3, stride=2, padding=1, dilation=1, groups=1)
    assert m.weight.shape == (4, 2, 3, 3)
    g = trace(m, spec((1, 2, 7, 7)))
    assert str(g.type(g.outputs["out"])) == "f32[1,4,4,4]"


def test_grouped_conv2d_has_pytorchs_weight_shape_and_bound():
    m = nn.Conv2d(6, 4, 3, groups=2)
    assert m.weight.shape == (4, 3, 3, 3) and "groups=2" in repr(m)
    assert np.abs(m.weight.data).max() <= 1 / np.sqrt(3 * 9)  # fan_in counts one group's channels
    g = trace(m, spec((1, 6, 5, 5)))
    assert str(g.type(g.outputs["out"])) == "f32[1,4,3,3]"


def test_train_eval_and_containers():
    m = ember_cnn()
    assert m.training and m[0].training
    assert m.eval() is m and not m.training and not m[5].training
    m.train()
    assert m[5].training
    assert len(m) == 6 and isinstance(m[-1], nn.Linear)
    assert "Conv2d(1, 16, kernel_size=(3, 3)" in repr(m) and "in_features=18432" in repr(m)
    with pytest.raises(AttributeError, match="super\\(\\).__init__"):
        class Bad(nn.Module):
            def __init__(self):
                self.w = Parameter(np.zeros(2))
        Bad()


def test_custom_module_traces_with_its_names():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = Parameter(np.full((3,), 2.0))
            self.fc = nn.Linear(3, 2)

        def forward(self, x):
            return self.fc(x * self.scale)

    net = Net()
    g = trace(net, spec((4, 3)))
    assert list(g.parameters) == ["scale", "fc.weight", "fc.bias"]
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    out = run(g, {"x": x}, net.state_dict()).outputs["out"]
    np.testing.assert_allclose(out, (x * 2) @ net.fc.weight.data.T + net.fc.bias.data, rtol=1e-5, atol=1e-6)


# ---- done-when: logits equal PyTorch's ---------------------------------------------------------

def batch(shape: tuple[int, ...], n: int = 64) -> tuple[np.ndarray, str]:
    if MNIST_DIR.exists():
        from ember.runtime.data import load_mnist
        x, _ = load_mnist(MNIST_DIR, "test")
        return x[:n].reshape((n,) + shape), "MNIST test images"
    return np.random.default_rng(0).random((n,) + shape, dtype=np.float32), "random inputs"


@pytest.mark.parametrize("kind", MODELS)
def test_logits_match_pytorch(kind, record_property):
    make_e, make_t, shape = MODELS[kind]
    torch.manual_seed(0)
    tmodel = make_t().eval()
    model = make_e()
    model.load_state_dict(tmodel.state_dict())
    x, source = batch(shape)
    g = trace(model, spec(x.shape))
    logits = run(g, {"x": x}, model.state_dict()).outputs["out"]
    # parameters could equally come from the trace's own record of the module
    same = run(g, {"x": x}, {k: p.data for k, p in g.meta["parameters"].items()}).outputs["out"]
    np.testing.assert_array_equal(logits, same)
    with torch.no_grad():
        ref = tmodel(torch.from_numpy(x)).numpy()
    assert logits.dtype == np.float32 and logits.shape == ref.shape == (64, 10)
    diff = float(np.abs(logits - ref).max())
    record_property(f"{kind}_max_abs_logits_diff", diff)
    print(f"\n{kind}: max |ember - torch| logits = {diff:.3g} on {source}")
    assert diff <= LOGITS_TOL, f"{kind}: logits differ from PyTorch's by {diff} on {source}"
    # and the model's predictions agree
    np.testing.assert_array_equal(logits.argmax(1), ref.argmax(1))
    # float64 reference mode against torch in float64
    t64 = make_t().double().eval()
    t64.load_state_dict(tmodel.state_dict())
    with torch.no_grad():
        ref64 = t64(torch.from_numpy(x).double()).numpy()
    logits64 = run(g, {"x": x}, model.state_dict(), precision="float64").outputs["out"]
    # the float32 weights, widened, are the same in both
    np.testing.assert_allclose(logits64, ref64, rtol=1e-10, atol=1e-10)


def test_mnist_data_present_is_used(mnist_dir):
    x, source = batch((1, 28, 28))
    assert source == "MNIST test images" and x.dtype == np.float32 and 0 <= x.min() and x.max() <= 1


def test_batch_norm_state_dict_loads_pytorch_and_back():
    torch.manual_seed(0)
    tbn = torch.nn.BatchNorm2d(3)
    tbn(torch.randn(4, 3, 2, 5))  # running statistics and num_batches_tracked (a 0-d tensor) move
    bn = nn.BatchNorm2d(3)
    bn.load_state_dict(tbn.state_dict())
    sd = bn.state_dict()
    assert {k: v.shape for k, v in sd.items()} == {k: tuple(v.shape) for k, v in tbn.state_dict().items()}
    twin = torch.nn.BatchNorm2d(3)
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()})
    for k, v in tbn.state_dict().items():
        assert torch.equal(twin.state_dict()[k], v), k


def test_relu6_and_hardtanh_modules_are_the_functions():
    x = np.array([[-2.0, 0.5, 3.0, 7.0]], np.float32)
    for module, want in ((nn.ReLU6(), [[0.0, 0.5, 3.0, 6.0]]), (nn.Hardtanh(-1.0, 2.0), [[-1.0, 0.5, 2.0, 2.0]])):
        g = trace(module, spec((1, 4)))
        np.testing.assert_array_equal(run(g, {"x": x}).outputs["out"], want)
    assert repr(nn.Hardtanh(0, 1)) == "Hardtanh(min_val=0.0, max_val=1.0)"


def test_conv2d_padding_strings_as_pytorch():
    """'same' (stride 1, odd kernels) keeps the size, 'valid' pads nothing; what ember cannot do
    is refused at construction with torch's words (it failed at compile with a parsing error)."""
    from ember.frontends import nn as enn
    assert enn.Conv2d(1, 3, 3, padding="same").padding == (1, 1)
    assert enn.Conv2d(1, 3, (5, 3), padding="same").padding == (2, 1)
    assert enn.Conv2d(1, 3, 3, padding="valid").padding == 0
    with pytest.raises(ValueError, match="padding='same' is not supported for strided convolutions"):
        enn.Conv2d(1, 3, 3, stride=2, padding="same")
    with pytest.raises(NotImplementedError, match=r"even kernel \(2, 2\) pads one side more"):
        enn.Conv2d(1, 3, 2, padding="same")
    with pytest.raises(ValueError, match="invalid padding string 'full'"):
        enn.Conv2d(1, 3, 3, padding="full")


def test_from_torch_maps_padding_same():
    torch = pytest.importorskip("torch")
    from ember.frontends import from_torch
    from ember.frontends.from_torch import TorchImportError
    torch.manual_seed(0)
    tm = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3, padding="same"), torch.nn.ReLU(),
                             torch.nn.Conv2d(3, 2, (1, 5), padding="same"))
    x = torch.randn(2, 2, 6, 7)
    m = from_torch(tm, example_inputs=(x,))
    from ember.frontends import compile_inference
    got = compile_inference(m, x.numpy(), device="reference")(x.numpy())
    np.testing.assert_allclose(got, tm(x).detach().numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(TorchImportError, match="padding='same' with the even kernel"):
        from_torch(torch.nn.Sequential(torch.nn.Conv2d(2, 3, 2, padding="same")), example_inputs=(x,))
