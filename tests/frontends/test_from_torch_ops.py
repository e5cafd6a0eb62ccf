"""The layers `from_torch` maps beyond the MNIST models (GELU, pooling, LayerNorm, cat, residual,
LogSoftmax + NLLLoss): forward and parameter gradients equal PyTorch's, gradients equal float64
central differences, and a model using all of them trains on device="cpu" as in PyTorch."""
from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tnn = torch.nn
TF = torch.nn.functional

from ember.frontends import TorchImportError, compile, from_torch, nn, optim, trace  # noqa: E402
from ember.frontends import functional as F  # noqa: E402
from ember.ir.interpreter import run  # noqa: E402
from ember.passes.autodiff import grad  # noqa: E402

from alignment import sgd_steps_match_torch  # noqa: E402


class Wrap(tnn.Module):
    """conv -> the layer under test -> flatten -> linear, so every gradient reaches a parameter."""

    def __init__(self, layer: "tnn.Module", channels: int = 3, flat: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = tnn.Conv2d(2, channels, 3, padding=1)
        self.layer = layer
        self.fc = tnn.LazyLinear(4) if flat is None else tnn.Linear(flat, 4)

    def forward(self, x):
        return self.fc(torch.flatten(self.layer(self.conv(x)), 1))


class Cat(tnn.Module):
    def forward(self, x):
        return torch.cat([TF.relu(x), x * 2, x], dim=1)


class Residual(tnn.Module):
    def forward(self, x):
        return TF.gelu(x, approximate="tanh") + x


class Clamps(tnn.Module):
    def forward(self, x):
        return torch.clamp(x, -0.3, 0.4) + x.clamp(min=0.1) + torch.clip(x, max=-0.2) + TF.hardtanh(x, -0.5, 0.6) \
            + TF.relu6(4 * x)


LAYERS = {
    "gelu": (tnn.GELU(), 3 * 6 * 6),
    "relu6": (tnn.ReLU6(), 3 * 6 * 6),
    "hardtanh": (tnn.Hardtanh(-0.25, 0.5), 3 * 6 * 6),
    "clamps": (Clamps(), 3 * 6 * 6),
    "grouped_conv": (tnn.Conv2d(3, 6, 3, stride=2, padding=1, groups=3), 6 * 3 * 3),
    "depthwise_conv": (tnn.Conv2d(3, 3, (3, 2), padding=(1, 0), groups=3, bias=False), 3 * 6 * 5),
    "gelu_tanh": (tnn.GELU(approximate="tanh"), 3 * 6 * 6),
    "avg_pool": (tnn.AvgPool2d(3, stride=2, padding=1), 3 * 3 * 3),
    "max_pool": (tnn.MaxPool2d(2), 3 * 3 * 3),
    "adaptive_avg_pool": (tnn.AdaptiveAvgPool2d(1), 3),
    "layer_norm": (tnn.LayerNorm([6, 6]), 3 * 6 * 6),
    "cat": (Cat(), 9 * 6 * 6),
    "residual": (Residual(), 3 * 6 * 6),
}


def _setup(name: str):
    layer, flat = LAYERS[name]
    tm = Wrap(copy.deepcopy(layer), flat=flat)
    if name == "layer_norm":  # away from its ones/zeros initialisation
        with torch.no_grad():
            tm.layer.weight.uniform_(0.5, 1.5)
            tm.layer.bias.uniform_(-0.5, 0.5)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 2, 6, 6)).astype(np.float32)
    ct = rng.standard_normal((2, 4)).astype(np.float32)
    model = from_torch(tm, torch.from_numpy(x))
    g = grad(trace(lambda x, ct: F.sum(F.mul(model(x), ct)), x, ct, modules={"": model}))
    params = {k: p.data for k, p in model.named_parameters()}
    return tm, model, g, params, x, ct


@pytest.mark.parametrize("name", LAYERS)
def test_forward_and_gradients_match_torch(name):
    tm, model, g, params, x, ct = _setup(name)
    res = run(g, {"x": x, "ct": ct}, params).outputs
    out = tm(torch.from_numpy(x))
    loss = (out * torch.from_numpy(ct)).sum()
    loss.backward()
    np.testing.assert_allclose(res["loss"], loss.item(), rtol=1e-5, atol=1e-5)
    for k, p in tm.named_parameters():
        np.testing.assert_allclose(res[f"grad:{k}"], p.grad.numpy(), rtol=1e-4, atol=1e-5, err_msg=k)


@pytest.mark.parametrize("name", LAYERS)
def test_gradients_match_float64_central_differences(name):
    _, model, g, params, x, ct = _setup(name)
    p64 = {k: v.astype(np.float64) for k, v in params.items()}
    res = run(g, {"x": x, "ct": ct}, p64, precision="float64").outputs
    rng = np.random.default_rng(1)
    h = 1e-6
    for k in [k for k in p64 if k.startswith(("conv.", "layer.weight"))]:
        for idx in [tuple(rng.integers(0, d) for d in p64[k].shape) for _ in range(3)]:
            plus, minus = {**p64, k: p64[k].copy()}, {**p64, k: p64[k].copy()}
            plus[k][idx] += h
            minus[k][idx] -= h
            numeric = (run(g, {"x": x, "ct": ct}, plus, precision="float64").outputs["loss"]
                       - run(g, {"x": x, "ct": ct}, minus, precision="float64").outputs["loss"]) / (2 * h)
            np.testing.assert_allclose(res[f"grad:{k}"][idx], numeric, rtol=1e-5, atol=1e-7, err_msg=f"{k}{idx}")


class Everything(tnn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = tnn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = tnn.Conv2d(4, 4, 3, padding=1)
        self.norm = tnn.LayerNorm([4, 4])
        self.pool = tnn.MaxPool2d(2)
        self.avg = tnn.AvgPool2d(2)
        self.gap = tnn.AdaptiveAvgPool2d(1)
        self.fc = tnn.Linear(4 * 2 * 2 + 8, 10)

    def forward(self, x):
        h = self.pool(TF.relu(self.conv1(x)))  # 8x8 -> 4x4
        h = TF.gelu(self.conv2(h)) + h  # residual
        h = self.norm(h)
        feats = torch.cat([self.avg(h).flatten(1), self.gap(h).flatten(1), self.gap(-h).view(h.size(0), -1)], 1)
        return TF.log_softmax(self.fc(feats), dim=1)


def test_everything_trains_on_cpu_like_torch():
    tm = Everything()
    ref = copy.deepcopy(tm)
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal((8, 1, 8, 8)).astype(np.float32)
    y0 = rng.integers(0, 10, 8)
    model = from_torch(tm, torch.from_numpy(x0))
    step = compile(model, nn.NLLLoss(), optim.SGD(model.parameters(), lr=0.1), (x0, y0), device="cpu")
    np.testing.assert_allclose(step.inference(x0), ref(torch.from_numpy(x0)).detach().numpy(), rtol=1e-5, atol=1e-5)
    topt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(5):
        x = rng.standard_normal((8, 1, 8, 8)).astype(np.float32)
        y = rng.integers(0, 10, 8)
        ours = step(x, y)
        topt.zero_grad()
        loss = TF.nll_loss(ref(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        topt.step()
        assert abs(ours - loss.item()) < 1e-5, (i, ours, loss.item())


def test_mse_and_nll_losses_match_torch():
    rng = np.random.default_rng(0)
    z = rng.standard_normal((5, 3)).astype(np.float32)
    t = rng.standard_normal((5, 3)).astype(np.float32)
    y = rng.integers(0, 3, 5)
    for reduction in ("mean", "sum"):
        g = trace(lambda z, y: F.nll_loss(F.log_softmax(z, 1), y, reduction), z, y)
        got = run(g, {"z": z, "y": y}).outputs["out"]
        ref = TF.nll_loss(TF.log_softmax(torch.from_numpy(z), 1), torch.from_numpy(y), reduction=reduction)
        np.testing.assert_allclose(got, ref.item(), rtol=1e-6)
        g = trace(lambda z, t: nn.MSELoss(reduction)(z, t), z, t)
        got = run(g, {"z": z, "t": t}).outputs["out"]
        np.testing.assert_allclose(got, TF.mse_loss(torch.from_numpy(z), torch.from_numpy(t), reduction=reduction).item(),
                                   rtol=1e-6)


class OverlappingMax(tnn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = tnn.Conv2d(1, 2, 3)
        self.fc = tnn.Linear(2 * 3 * 3, 3)

    def forward(self, x):
        return self.fc(TF.max_pool2d(self.conv(x), 3, stride=2, padding=1).flatten(1))


class CeilMax(tnn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = tnn.Conv2d(1, 2, 3)
        self.pool = tnn.MaxPool2d(2, ceil_mode=True)
        self.fc = tnn.Linear(2 * 3 * 3, 3)

    def forward(self, x):
        return self.fc(self.pool(torch.relu(self.conv(x))).flatten(1))


@pytest.mark.parametrize("device", ["reference", "cpu"])
@pytest.mark.parametrize("make", [OverlappingMax, CeilMax], ids=["overlapping", "ceil_mode"])
def test_max_pool_trains_like_torch(make, device):
    rng = np.random.default_rng(0)
    _trains_like_torch(make(), rng.standard_normal((4, 1, 7, 7)).astype(np.float32), rng.integers(0, 3, 4), device)


def _trains_like_torch(tm, x: np.ndarray, y: np.ndarray, device: str) -> None:
    """Three SGD steps of `tm` imported and of a copy of it in PyTorch: the same losses and weights."""
    ref = copy.deepcopy(tm)
    model = from_torch(tm, torch.from_numpy(x))
    step = compile(model, nn.CrossEntropyLoss(), optim.SGD(model.parameters(), lr=0.1), (x, y), device=device)
    sgd_steps_match_torch(step, ref, ref.parameters(), x, y, lr=0.1)
    for k, v in ref.state_dict().items():
        np.testing.assert_allclose(step.state_dict()[k], v.numpy(), rtol=1e-5, atol=1e-6, err_msg=k)


def test_refusals_name_the_fx_node():
    with pytest.raises(TorchImportError, match=r"unsupported argument ceil_mode=True \(only ceil_mode=False\) of AvgPool2d"):
        from_torch(tnn.Sequential(tnn.AvgPool2d(2, ceil_mode=True)), torch.zeros(1, 1, 6, 6))
    with pytest.raises(TorchImportError, match=r"output_size=2 \(only 1: global average pooling\)"):
        from_torch(tnn.Sequential(tnn.AdaptiveAvgPool2d(2)), torch.zeros(1, 1, 6, 6))
    with pytest.raises(TorchImportError, match=r"unsupported argument momentum=None .* of BatchNorm2d"):
        from_torch(tnn.Sequential(tnn.BatchNorm2d(1, momentum=None)), torch.zeros(1, 1, 6, 6))


class BN(tnn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = tnn.Conv2d(1, 4, 3)
        self.bn = tnn.BatchNorm2d(4, momentum=0.2)
        self.fc = tnn.Linear(4 * 4 * 4, 10)

    def forward(self, x):
        return self.fc(TF.relu(self.bn(self.conv(x))).flatten(1))


@pytest.mark.parametrize("device", ["reference", "cpu"])
def test_batch_norm_trains_and_tracks_running_stats_like_torch(device):
    tm = BN()
    ref = copy.deepcopy(tm)
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal((8, 1, 6, 6)).astype(np.float32)
    y0 = rng.integers(0, 10, 8)
    model = from_torch(tm, torch.from_numpy(x0))
    assert list(model.state_dict()) == list(tm.state_dict())
    step = compile(model, nn.CrossEntropyLoss(), optim.SGD(model.parameters(), lr=0.1), (x0, y0), device=device)
    topt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(4):
        x = (rng.standard_normal((8, 1, 6, 6)) * 2 + 1).astype(np.float32)
        y = rng.integers(0, 10, 8)
        ours = step(x, y)
        topt.zero_grad()
        loss = TF.cross_entropy(ref(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        topt.step()
        assert abs(ours - loss.item()) < 1e-5, (i, ours, loss.item())
    sd, tsd = step.state_dict(), ref.state_dict()
    for k in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        np.testing.assert_allclose(sd[k], tsd[k].numpy(), rtol=1e-5, atol=1e-6, err_msg=k)
    model.eval()
    ref.eval()
    np.testing.assert_allclose(step.inference(x0), ref(torch.from_numpy(x0)).detach().numpy(), rtol=1e-5, atol=1e-5)


def test_checkpoint_round_trip_keeps_batch_norm_state(tmp_path):
    from ember.frontends.checkpoint import load_checkpoint, save_checkpoint
    rng = np.random.default_rng(0)
    batches = [((rng.standard_normal((8, 1, 6, 6)) + 1).astype(np.float32), rng.integers(0, 10, 8)) for _ in range(4)]

    def fresh():
        model = from_torch(BN(), torch.from_numpy(batches[0][0]))
        return model, compile(model, nn.CrossEntropyLoss(), optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                              batches[0], device="cpu")

    _, a = fresh()
    for x, y in batches[:2]:
        a(x, y)
    save_checkpoint(tmp_path / "ck.safetensors", a.state_dict(), a.optimizer_state_dict(), step=2)
    ck = load_checkpoint(tmp_path / "ck.safetensors")
    assert "bn.running_var" in ck.model and "bn.num_batches_tracked" in ck.model
    _, b = fresh()
    b.load_state_dict(ck.model)
    b.load_optimizer_state_dict(ck.optimizer)
    for x, y in batches[2:]:
        assert a(x, y) == b(x, y)
    for k, v in a.state_dict().items():
        np.testing.assert_array_equal(b.state_dict()[k], v, err_msg=k)


def test_import_copies_parameters_and_buffers_so_training_leaves_torch_untouched():
    tm = BN()
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal((8, 1, 6, 6)).astype(np.float32)
    before = {k: v.clone() for k, v in tm.state_dict().items()}
    model = from_torch(tm, torch.from_numpy(x0))
    step = compile(model, nn.CrossEntropyLoss(), optim.SGD(model.parameters(), lr=0.1), (x0, rng.integers(0, 10, 8)),
                   device="cpu")
    for _ in range(3):
        step((rng.standard_normal((8, 1, 6, 6)) + 1).astype(np.float32), rng.integers(0, 10, 8))
    assert model.state_dict()["bn.num_batches_tracked"] == 3
    after = tm.state_dict()
    assert list(after) == list(before)
    for k, v in before.items():
        assert torch.equal(after[k], v), f"{k} of the torch module changed"
    again = from_torch(tm, torch.from_numpy(x0)).state_dict()  # a second import starts where the first did
    for k, v in before.items():
        np.testing.assert_array_equal(again[k], v.numpy(), err_msg=k)


def test_batch_norm_needs_more_than_one_value_per_channel_when_training():
    torch.manual_seed(0)
    tm = tnn.Sequential(tnn.Conv2d(1, 4, 3), tnn.BatchNorm2d(4), tnn.Flatten(), tnn.Linear(4, 10))  # 3x3 -> 1x1
    one, two = torch.zeros(1, 1, 3, 3), torch.zeros(2, 1, 3, 3)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        tm(one)  # PyTorch refuses one image of a 1x1 map in training mode
    refusal = (r"^BatchNorm2d\(4\) '1' expected more than 1 value per channel when training, got input "
               r"f32\[1,4,1,1\] \(1 image of 1x1\); use a batch of at least 2, or model.eval\(\) \(.*\)$")
    with pytest.raises(ValueError, match=refusal):
        from_torch(tm, one)
    model = from_torch(tm, two)  # two values per channel: fine
    y = np.zeros(1, np.int64)
    with pytest.raises(ValueError, match=refusal):  # a batch of 1 compiled later (e.g. a last partial batch)
        compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), (one.numpy(), y), device="reference")
    step = compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), (two.numpy(), np.zeros(2, np.int64)), device="reference")
    with pytest.raises(ValueError, match=refusal):
        step.precompile((1, 1, 3, 3))
    # eval mode normalises by the running statistics: one image is fine, as in PyTorch
    x = np.random.default_rng(0).standard_normal((1, 1, 3, 3)).astype(np.float32)
    model.eval()
    tm.eval()
    np.testing.assert_allclose(step.inference(x), tm(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-6)
    from_torch(tm, one)


def test_batch_norm_running_var_on_non_square_images_matches_torch():
    # the unbiased variance counts N*H*W values per channel: H != W catches a count from the wrong axis
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((2, 3, 3, 5)) * 3 + 1).astype(np.float32)
    model = nn.Sequential(nn.BatchNorm2d(3), nn.Flatten(), nn.Linear(45, 10))
    step = compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), (x, rng.integers(0, 10, 2)), device="reference")
    step(x, rng.integers(0, 10, 2))
    tbn = tnn.BatchNorm2d(3)
    tbn(torch.from_numpy(x))
    sd = step.state_dict()
    np.testing.assert_allclose(sd["0.running_mean"], tbn.running_mean.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sd["0.running_var"], tbn.running_var.numpy(), rtol=1e-5)


class _Params(nn.Module):
    """Parameters holding given values, and a forward `fn(*parameters)` weighted by the input (so
    that every element has its own cotangent)."""

    def __init__(self, fn, *values: np.ndarray) -> None:
        super().__init__()
        self.fn = fn
        for i, v in enumerate(values):
            setattr(self, f"p{i}", nn.Parameter(np.asarray(v, np.float32)))

    def forward(self, ct):
        return F.sum(F.mul(self.fn(*[getattr(self, f"p{i}") for i in range(len(self._parameters))]), ct))


def _value_and_grads(fn, values, ct):
    model = _Params(fn, *values)
    res = run(grad(trace(lambda ct: model(ct), ct, modules={"": model})), {"ct": ct},
              {k: p.data for k, p in model.named_parameters()}).outputs
    return res["loss"], [res[f"grad:p{i}"] for i in range(len(values))]


def _torch_value_and_grads(fn, values, ct):
    ts = [torch.tensor(np.asarray(v, np.float32), requires_grad=True) for v in values]
    loss = (fn(*ts) * torch.from_numpy(ct)).sum()
    loss.backward()
    return loss.item(), [t.grad.numpy() for t in ts]


@pytest.mark.parametrize("ours,theirs", [
    (lambda x: F.clamp(x, 0.0, 6.0), lambda x: torch.clamp(x, 0.0, 6.0)),
    (lambda x: F.clamp(x, min=0.0), lambda x: x.clamp(min=0.0)),
    (lambda x: F.clamp(x, max=6.0), lambda x: x.clamp(max=6.0)),
    (lambda x: F.clamp(x, 6.0, 0.0), lambda x: torch.clamp(x, 6.0, 0.0)),  # min > max: max everywhere
    (F.relu6, TF.relu6),
    (lambda x: F.hardtanh(x, 0.0, 6.0), lambda x: TF.hardtanh(x, 0.0, 6.0)),
], ids=["clamp", "clamp_min", "clamp_max", "clamp_crossed", "relu6", "hardtanh"])
def test_clamps_value_and_gradient_at_the_bounds_and_nan_are_torchs(ours, theirs):
    """clamp passes the gradient where min <= x <= max and not at NaN; hardtanh (and relu6) only
    strictly inside, and at NaN: torch's two backward rules, exactly, at the ties."""
    x = np.array([-1.0, 0.0, 3.0, 6.0, 7.0, np.nan], np.float32)
    ct = np.arange(1, 7, dtype=np.float32)
    loss, (ours_grad,) = _value_and_grads(ours, [x], ct)  # the NaN input makes the loss NaN, not the gradient
    ref = torch.tensor(x, requires_grad=True)
    out = theirs(ref)
    (out * torch.from_numpy(ct)).sum().backward()
    assert np.isnan(loss) and bool(torch.isnan(out[-1]))
    np.testing.assert_array_equal(ours_grad, ref.grad.numpy())


@pytest.mark.parametrize("case", ["plain", "causal", "bool_mask", "float_mask", "scale", "three_d"])
def test_scaled_dot_product_attention_matches_torch(case):
    rng = np.random.default_rng(0)
    lead = (2, 3) if case != "three_d" else (4,)
    q, k, v = (rng.standard_normal(lead + s).astype(np.float32) for s in ((5, 4), (6, 4), (6, 3)))
    if case == "causal":
        k, v = k[..., :5, :], v[..., :5, :]
    mask = {"bool_mask": rng.random((5, 6)) > 0.3, "float_mask": rng.standard_normal((3, 5, 6)).astype(np.float32)}.get(case)
    if case == "bool_mask":
        mask[:, 0] = True  # every query attends to something
    kwargs = {"is_causal": case == "causal", "scale": 0.7 if case == "scale" else None}
    ct = rng.standard_normal(lead + (5, 3)).astype(np.float32)
    ours = _value_and_grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, mask, **kwargs), [q, k, v], ct)
    tmask = None if mask is None else torch.from_numpy(mask)
    theirs = _torch_value_and_grads(lambda q, k, v: TF.scaled_dot_product_attention(q, k, v, tmask, **kwargs),
                                    [q, k, v], ct)
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(ours[1], theirs[1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("sa,sb", [((2, 5, 3), (3, 4)), ((5, 3), (2, 3, 4)), ((2, 1, 5, 3), (3, 3, 4)), ((3,), (2, 3, 4)),
                                   ((2, 5, 3), (3,))])
def test_matmul_broadcasting_batch_axes_matches_torch(sa, sb):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(sa).astype(np.float32), rng.standard_normal(sb).astype(np.float32)
    ct = rng.standard_normal(np.broadcast_shapes(np.matmul(a, b).shape)).astype(np.float32)
    ours = _value_and_grads(F.matmul, [a, b], ct)
    theirs = _torch_value_and_grads(torch.matmul, [a, b], ct)
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-5, atol=1e-5)
    for x, y in zip(ours[1], theirs[1]):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_batched_attention_layer_compiles_on_cpu_like_torch():
    """A Linear on (B, T, D) inputs, the heads' batched matmuls with a broadcast bias, softmax over
    the last axis and expand, compiled for the CPU, against PyTorch."""
    class Layer(tnn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.q, self.k, self.v = tnn.Linear(8, 8), tnn.Linear(8, 8), tnn.Linear(8, 8)
            self.bias = tnn.Parameter(0.1 * torch.randn(1, 1, 4, 4))
            self.scale = tnn.Parameter(torch.ones(1, 8))
            self.head = tnn.Linear(8, 3)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = (f(x).reshape(b, t, 2, 4).transpose(1, 2) for f in (self.q, self.k, self.v))
            att = (q @ k.transpose(-2, -1) * 0.5 + self.bias).softmax(dim=-1)
            o = (att @ v).transpose(1, 2).reshape(b, t, d) * self.scale.expand(t, -1)
            return self.head(o.mean(dim=1))

    rng = np.random.default_rng(0)
    _trains_like_torch(Layer(), rng.standard_normal((3, 4, 8)).astype(np.float32), rng.integers(0, 3, 3), "cpu")
