"""`compile(..., precision=...)` without a GPU: the choice is checked before any work, and
"tf32" reaches every contraction of the CUDA plan (the kernels `ember kernels --tf32` writes)."""
from __future__ import annotations

import numpy as np
import pytest

from ember.frontends import compile, nn, optim, plan
from ember.frontends.cli import main as ember_main
from ember.frontends.training import build_model
from ember.ir.kernel import CONTRACTIONS

EXAMPLE = (np.zeros((8, 784), np.float32), np.zeros(8, np.int64))


def test_unknown_precision_is_one_line_error():
    with pytest.raises(ValueError, match=r"precision='fp16': expected one of 'float32', 'tf32'"):
        compile(build_model("mlp"), nn.CrossEntropyLoss(), optim.SGD(lr=0.1), EXAMPLE, device="cpu", precision="fp16")


@pytest.mark.parametrize("device", ["cpu", "reference"])
def test_tf32_is_refused_where_there_are_no_tensor_cores(device):
    with pytest.raises(ValueError, match=f"precision='tf32' is not available on device '{device}'"):
        compile(build_model("mlp"), nn.CrossEntropyLoss(), optim.SGD(lr=0.1), EXAMPLE, device=device, precision="tf32")


@pytest.mark.parametrize("precision", ["float32", "tf32"])
def test_cuda_plan_marks_every_contraction(precision):
    graphs = plan(build_model("cnn"), nn.CrossEntropyLoss(), optim.SGD(lr=0.1),
                  (np.zeros((4, 1, 28, 28), np.float32), np.zeros(4, np.int64)), device="cuda", precision=precision)
    for graph in graphs.values():
        specs = [graph.attrs(n)["kernel"] for n in graph.g if graph.op(n) == "fused"]
        contractions = [s for s in specs if s.kind in CONTRACTIONS]
        assert contractions
        assert all(bool(s.param("tf32")) == (precision == "tf32") for s in contractions)
        assert not any(s.param("tf32") for s in specs if s.kind not in CONTRACTIONS)


def test_mnist_tf32_needs_the_cuda_device(capsys):
    assert ember_main(["mnist", "--device", "cpu", "--tf32", "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert "--tf32: TF32 is a CUDA tensor-core mode; --device cpu computes in float32" in err
    assert len(err.strip().splitlines()) == 1
