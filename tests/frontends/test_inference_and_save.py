"""compile_inference (a model without loss or optimizer), TrainStep.save/load (the public
checkpoint helper), the default device and PyTorch's "cuda:N" device spelling."""
from __future__ import annotations

import numpy as np
import pytest

from models import compiled_targets

from ember.frontends import InferenceStep, compile, compile_inference, nn, optim
from ember.frontends.checkpoint import CheckpointError


def _model(seed: int = 0) -> nn.Module:
    nn.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))


def _batches(n: int = 6):
    rng = np.random.default_rng(1)
    return [(rng.normal(size=(8, 6)).astype(np.float32), rng.integers(0, 4, 8)) for _ in range(n)]


def test_compile_defaults_to_the_cpu_device():
    x, y = _batches(1)[0]
    step = compile(_model(), nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example_inputs=(x, y))
    assert step.device == "cpu" and step.peak_bytes is not None  # the reference device plans no memory
    assert isinstance(compile_inference(_model(), x), InferenceStep)


@pytest.mark.parametrize("device", ["reference"] + compiled_targets())
def test_compile_inference_matches_the_reference_and_follows_the_model(device):
    model, x = _model(), _batches(1)[0][0]
    infer = compile_inference(model, x, device=device)
    want = compile_inference(_model(), x, device="reference")(x)
    np.testing.assert_allclose(infer(x), want, rtol=1e-6, atol=1e-6)
    assert infer(x[:3]).shape == (3, 4)  # another batch size compiles on first use
    with pytest.raises(TypeError, match="expected dtype float32"):
        infer(x.astype(np.float64))
    model.load_state_dict({k: v * 0 for k, v in model.state_dict().items()})  # a write reaches the step
    assert not infer(x).any()


def test_compile_inference_refuses_a_torch_module():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="compile_inference\\(\\) expects an ember.frontends.nn.Module, got Linear "
                                        "\\(a torch module\\? import it with ember.frontends.from_torch first\\)"):
        compile_inference(torch.nn.Linear(2, 2), np.zeros((1, 2), np.float32))


@pytest.mark.parametrize("device", ["reference"] + compiled_targets())
def test_save_and_load_resume_bit_identically(device, tmp_path):
    batches = _batches()

    def fresh():
        model = _model()
        opt = optim.Adam(lr=1e-2)
        optim.lr_scheduler.CosineAnnealingLR(opt, T_max=6)
        return compile(model, nn.CrossEntropyLoss(), opt, example_inputs=batches[0], device=device)

    straight = fresh()
    losses = [straight(x, y) for x, y in batches]
    first = fresh()
    for x, y in batches[:3]:
        first(x, y)
    first.save(tmp_path / "ck.safetensors", epoch=1)
    assert not list(tmp_path.glob(".*.tmp"))  # written through a temporary file, renamed
    second = fresh()
    ckpt = second.load(tmp_path / "ck.safetensors")
    assert (ckpt.epoch, ckpt.step, second.steps_run) == (1, 3, 3)
    assert [second(x, y) for x, y in batches[3:]] == losses[3:]  # optimizer state and schedule resumed
    other = compile(nn.Sequential(nn.Linear(6, 4)), nn.CrossEntropyLoss(), optim.Adam(lr=1e-2),
                    example_inputs=batches[0], device="reference")
    with pytest.raises(CheckpointError, match="ck.safetensors: does not fit this model and optimizer"):
        other.load(tmp_path / "ck.safetensors")


@pytest.mark.parametrize("device,message", [
    ("cpu:1", "device 'cpu:1': device 'cpu' takes no index"),
    ("cuda:x", "device 'cuda:x': expected 'cuda' or cuda:N"),
    ("tpu", "unknown device 'tpu'"),
])
def test_device_spellings_are_checked(device, message):
    x, y = _batches(1)[0]
    with pytest.raises(ValueError, match=message):
        compile(_model(), nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example_inputs=(x, y), device=device)


@pytest.mark.cuda
def test_cuda_index_selects_the_gpu():
    x, y = _batches(1)[0]
    step = compile(_model(), nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example_inputs=(x, y), device="cuda:0")
    assert np.isfinite(step(x, y))
    import cupy
    count = cupy.cuda.runtime.getDeviceCount()
    with pytest.raises(ValueError, match=f"device 'cuda:{count}': this machine has {count} GPU"):
        compile(_model(), nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example_inputs=(x, y), device=f"cuda:{count}")
