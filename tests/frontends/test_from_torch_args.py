"""`from_torch` with non-default layer arguments: what an importer most easily drops or swaps.

The other import tests build their layers mostly with default arguments, square images and
convolutions whose stride equals their padding, where a dropped `eps` or a stride passed as the
padding gives the same numbers. Here every argument differs from its default and from the
others, the images are not square, and the forward value and parameter gradients are compared
with PyTorch's; an argument the importer cannot honour must be refused by name.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tnn = torch.nn
TF = torch.nn.functional

from ember.frontends import TorchImportError, from_torch, trace  # noqa: E402
from ember.frontends import functional as F  # noqa: E402
from ember.ir.interpreter import run  # noqa: E402
from ember.passes.autodiff import grad  # noqa: E402


def _assert_matches_torch(tm: "tnn.Module", x: np.ndarray) -> None:
    """Forward value and every parameter gradient of sum(tm(x) * ct), imported vs PyTorch."""
    ct = np.random.default_rng(1).standard_normal(tuple(tm(torch.from_numpy(x)).shape)).astype(np.float32)
    model = from_torch(tm, torch.from_numpy(x))
    g = grad(trace(lambda x, ct: F.sum(F.mul(model(x), ct)), x, ct, modules={"": model}))
    res = run(g, {"x": x, "ct": ct}, {k: p.data for k, p in model.named_parameters()}).outputs
    loss = (tm(torch.from_numpy(x)) * torch.from_numpy(ct)).sum()
    loss.backward()
    np.testing.assert_allclose(res["loss"], loss.item(), rtol=1e-5, atol=1e-5)
    for k, p in tm.named_parameters():
        np.testing.assert_allclose(res[f"grad:{k}"], p.grad.numpy(), rtol=1e-4, atol=1e-5, err_msg=k)


def _image(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(0).standard_normal(shape) * scale).astype(np.float32)


# stride != padding everywhere, so swapping them changes the output shape or values
CONVS = {
    "stride2_pad1": dict(kernel_size=3, stride=2, padding=1),
    "stride1_pad2": dict(kernel_size=3, stride=1, padding=2),
    "rect_kernel": dict(kernel_size=(3, 2), stride=(2, 1), padding=(0, 1)),
    "rect_stride_pad": dict(kernel_size=(2, 4), stride=(1, 3), padding=(2, 0)),
    "no_bias": dict(kernel_size=1, stride=2, padding=0, bias=False),
}


@pytest.mark.parametrize("name", CONVS)
def test_conv2d_arguments_match_torch(name):
    torch.manual_seed(0)
    tm = tnn.Sequential(tnn.Conv2d(2, 3, **CONVS[name]), tnn.ReLU())
    _assert_matches_torch(tm, _image(2, 2, 9, 7))


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_eps_matches_torch(affine):
    # activations of variance 1e-2: eps=1e-2 halves them, the default 1e-5 would not
    torch.manual_seed(0)
    tm = tnn.Sequential(tnn.LayerNorm([5, 7], eps=1e-2, elementwise_affine=affine), tnn.Flatten(), tnn.Linear(35, 3))
    if affine:
        with torch.no_grad():
            tm[0].weight.uniform_(0.5, 1.5)
            tm[0].bias.uniform_(-0.5, 0.5)
    _assert_matches_torch(tm, _image(2, 5, 7, scale=0.1))


class FunctionalLayerNorm(tnn.Module):
    def forward(self, x):
        return TF.layer_norm(x, (7,), eps=0.05)


def test_functional_layer_norm_eps_matches_torch():
    torch.manual_seed(0)
    _assert_matches_torch(tnn.Sequential(FunctionalLayerNorm(), tnn.Linear(7, 2)), _image(3, 7, scale=0.1))


def test_pooling_arguments_match_torch():
    torch.manual_seed(0)
    tm = tnn.Sequential(tnn.Conv2d(1, 2, 3, padding=1), tnn.MaxPool2d((3, 2), stride=(2, 1), padding=(1, 0)),
                        tnn.AvgPool2d((2, 3), stride=(1, 2), padding=(1, 1)))
    _assert_matches_torch(tm, _image(2, 1, 9, 8))


class FunctionalAvgPool(tnn.Module):
    def forward(self, x):
        return TF.avg_pool2d(x, 3, stride=2, padding=1, count_include_pad=False)


def test_avg_pool_that_excludes_padding_is_refused():
    """count_include_pad=False divides border windows by fewer elements: ember's avg_pool2d
    always counts the padding, so the import must refuse, not give other border values."""
    with pytest.raises(TorchImportError, match=r"unsupported argument count_include_pad=False "
                       r"\(only count_include_pad=True\) of AvgPool2d"):
        from_torch(tnn.Sequential(tnn.AvgPool2d(3, stride=2, padding=1, count_include_pad=False)),
                   torch.zeros(1, 1, 7, 6))
    with pytest.raises(TorchImportError, match=r"count_include_pad=False \(only count_include_pad=True\)"):
        from_torch(FunctionalAvgPool(), torch.zeros(1, 1, 7, 6))
