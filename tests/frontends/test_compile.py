"""compile() on the reference device: the CNN's joint graph against PyTorch's gradients, training
steps (full and partial batches), inference, state dicts, input checking and dumps."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import torch_threads

from ember.frontends import compile, nn, optim, spec, trace
from ember.ir import TensorType, run
from ember.passes import optimizer as passes_optimizer
from ember.passes.autodiff import grad
from ember.passes.simplify import simplify
from ember.runtime.executor import HostStorage, ReferenceExecutor, check_inputs



@pytest.fixture(scope="module", autouse=True)
def _torch_threads():
    with torch_threads(2):  # this module's figures were measured with 2; restored after it
        yield


def _torch_cnn(c1: int = 16, c2: int = 32, flat: int = 18432) -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Conv2d(1, c1, 3), torch.nn.ReLU(), torch.nn.Conv2d(c1, c2, 3), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(flat, 10))


def _ember_cnn(c1: int = 16, c2: int = 32, flat: int = 18432) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(1, c1, 3), nn.ReLU(), nn.Conv2d(c1, c2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(flat, 10))


def _pair(small: bool = True, seed: int = 0) -> tuple[nn.Module, torch.nn.Module]:
    torch.manual_seed(seed)
    dims = (4, 8, 8 * 8 * 8) if small else (16, 32, 18432)
    tmodel = _torch_cnn(*dims)
    model = _ember_cnn(*dims)
    model.load_state_dict(tmodel.state_dict())
    return model, tmodel


def _batch(n: int, size: int = 12, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.random((n, 1, size, size), dtype=np.float32), rng.integers(0, 10, size=n)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_cnn_joint_graph_gradients_equal_pytorch() -> None:
    """The MNIST CNN, batch 64: every parameter gradient within 1e-5 relative (float32)."""
    model, tmodel = _pair(small=False)
    x, y = _batch(64, 28)
    loss_fn = nn.CrossEntropyLoss()
    joint = simplify(grad(trace(lambda x, y: loss_fn(model(x), y), x, y, modules={"": model})))
    # Only the needed gradients: no grad-input for the first convolution (its input is the image).
    assert joint.count("conv2d_grad_input") == 1 and joint.count("conv2d_grad_weight") == 2
    res = run(joint, {"x": x, "y": y}, {k: p.data for k, p in model.named_parameters()}).outputs
    loss = torch.nn.functional.cross_entropy(tmodel(torch.from_numpy(x)), torch.from_numpy(y))
    loss.backward()
    assert abs(float(res["loss"]) - loss.item()) <= 1e-6 * loss.item()
    for name, p in tmodel.named_parameters():
        err = _rel(res[f"grad:{name}"], p.grad.numpy())
        assert err <= 1e-5, f"gradient of {name}: relative error {err:.2e}"


def _torch_train(tmodel, topt, x, y) -> float:
    topt.zero_grad()
    loss = torch.nn.functional.cross_entropy(tmodel(torch.from_numpy(x)), torch.from_numpy(y))
    loss.backward()
    topt.step()
    return loss.item()


def _assert_same_params(model: nn.Module, tmodel: torch.nn.Module, rtol: float = 1e-6) -> None:
    own = dict(model.named_parameters())
    for name, p in tmodel.named_parameters():
        assert _rel(own[name].data, p.detach().numpy()) <= rtol, name


def test_training_steps_full_and_partial_batches_match_pytorch() -> None:
    model, tmodel = _pair()
    weights = [p.data for p in model.parameters()]
    x, y = _batch(11)
    step = compile(model, nn.CrossEntropyLoss(), optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                   example_inputs=(x[:8], y[:8]), device="reference")
    topt = torch.optim.SGD(tmodel.parameters(), lr=0.1, momentum=0.9)
    for xb, yb in [(x[:8], y[:8]), (x[8:], y[8:]), (x[:8], y[:8])]:  # 8, then a last partial batch of 3
        loss = step(xb, yb)
        want = _torch_train(tmodel, topt, xb, yb)
        assert abs(loss - want) <= 1e-6 * want
        _assert_same_params(model, tmodel)
    assert len(step._steps) == 2  # one compiled step per batch shape, cached
    # The model's own arrays are the ones trained (storage holds them, not copies).
    assert all(a is b for a, b in zip(weights, [p.data for p in model.parameters()]))
    assert all(step.storage[name] is p.data for name, p in model.named_parameters())
    assert step.peak_bytes is None
    assert set(step.train_graph.updates) == {*dict(model.named_parameters()), *(f"{k}.momentum_buffer" for k, _ in model.named_parameters())}


def test_inference_shares_the_trained_parameters() -> None:
    model, tmodel = _pair()
    x, y = _batch(8)
    step = compile(model, nn.CrossEntropyLoss(), optim.Adam(lr=1e-2), example_inputs=(x, y), device="reference")
    before = step.inference(x[:5])
    with torch.no_grad():
        np.testing.assert_allclose(before, tmodel(torch.from_numpy(x[:5])).numpy(), rtol=1e-5, atol=1e-6)
    topt = torch.optim.Adam(tmodel.parameters(), lr=1e-2)
    for _ in range(3):
        step(x, y)
        _torch_train(tmodel, topt, x, y)
    after = step.inference(x[:5])
    assert not np.allclose(before, after)
    with torch.no_grad():
        np.testing.assert_allclose(after, tmodel(torch.from_numpy(x[:5])).numpy(), rtol=1e-5, atol=1e-6)
    step.inference(x)
    assert len(step._inference) == 2


def test_state_dicts_round_trip() -> None:
    model, _ = _pair()
    x, y = _batch(8)
    step = compile(model, nn.CrossEntropyLoss(), optim.AdamW(model.parameters(), lr=1e-2), example_inputs=(x, y), device="reference")
    step(x, y)
    sd, osd = step.state_dict(), step.optimizer_state_dict()
    assert list(sd) == ["0.weight", "0.bias", "2.weight", "2.bias", "5.weight", "5.bias"]
    assert sorted(osd) == sorted(["step"] + [f"{k}.{s}" for k in sd for s in ("exp_avg", "exp_avg_sq")])
    assert osd["step"] == 1
    sd["0.weight"][...] = 123.0  # a copy: the model is untouched
    assert not (model.state_dict()["0.weight"] == 123.0).any()
    sd = step.state_dict()
    losses = [step(x, y) for _ in range(3)]
    step.load_state_dict(sd)
    step.load_optimizer_state_dict(osd)
    assert [step(x, y) for _ in range(3)] == losses  # bit-identical replay
    with pytest.raises(KeyError, match="missing"):
        step.load_optimizer_state_dict({"step": np.zeros((), np.float32)})


def test_rebound_parameter_data_is_adopted() -> None:
    model, _ = _pair()
    x, y = _batch(4)
    step = compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example_inputs=(x, y), device="reference")
    p = model[0].bias
    p.data = np.zeros_like(p.data)  # rebinding, not writing in place
    step(x, y)
    assert p.data is step.storage["0.bias"]


def test_inputs_are_checked_with_clear_errors() -> None:
    model, _ = _pair()
    x, y = _batch(4)
    step = compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example_inputs=(x, y), device="reference")
    with pytest.raises(TypeError, match=r"input 'y': expected dtype int64 .*got i32\[4\]"):
        step(x, y.astype(np.int32))
    with pytest.raises(TypeError, match="input 'x': expected dtype float32"):
        step(x.astype(np.float64), y)
    sig = {"x": TensorType((4, 1, 12, 12)), "y": TensorType((4,), "int64")}
    with pytest.raises(TypeError, match=r"input 'x': expected f32\[4,1,12,12\], got f32\[3,1,12,12\]"):
        check_inputs(sig, {"x": x[:3], "y": y})
    with pytest.raises(TypeError, match=r"missing \['y'\]"):
        check_inputs(sig, {"x": x})
    with pytest.raises(TypeError, match=r"input 'y': expected i64\[4\], got f32\[4\] \(convert with .astype\(np.int64\)\)"):
        check_inputs(sig, {"x": x, "y": y.astype(np.float32)})


def test_reference_executor_writes_updates_in_place() -> None:
    from ember.ir import Graph
    g = Graph()
    a, b = g.add_parameter("a", TensorType((2,))), g.add_parameter("b", TensorType((2,)))
    g.set_update("a", b)  # a swap: each update reads the other's old value
    g.set_update("b", a)
    g.set_output("out", g.add("add", [a, b]))
    arrays = {"a": np.array([1.0, 2.0], np.float32), "b": np.array([3.0, 4.0], np.float32)}
    held = dict(arrays)
    ex = ReferenceExecutor(g, HostStorage(arrays))
    out = ex({})
    np.testing.assert_array_equal(out["out"], [4.0, 6.0])
    np.testing.assert_array_equal(held["a"], [3.0, 4.0])
    np.testing.assert_array_equal(held["b"], [1.0, 2.0])
    with pytest.raises(KeyError, match="holds no parameter 'a'"):
        ReferenceExecutor(g, HostStorage({"b": np.zeros(2, np.float32)}))


def test_compile_dumps_every_pass(tmp_path) -> None:
    model, _ = _pair()
    x, y = _batch(4)
    step = compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example_inputs=(spec((4, 1, 12, 12)), spec((4,), "int64")),
                   dump_dir=tmp_path, device="reference")
    step.inference(x[:2])
    train = sorted(p.name for p in (tmp_path / "train-4x1x12x12").iterdir())
    assert train == ["00-input.dot", "00-input.txt", "01-autodiff.dot", "01-autodiff.txt", "02-optimizer.dot",
                     "02-optimizer.txt", "03-simplify.dot", "03-simplify.txt", "compile_stats.json"]
    inference = sorted(p.name for p in (tmp_path / "inference-2x1x12x12").iterdir())
    assert inference[-2:] == ["01-simplify.txt", "compile_stats.json"]
    assert "conv2d_grad_weight" in (tmp_path / "train-4x1x12x12" / "03-simplify.txt").read_text()


def test_compile_argument_errors() -> None:
    model, _ = _pair()
    x, y = _batch(4)
    with pytest.raises(ValueError, match=r"unknown device 'tpu'; available: reference, cpu"):
        compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example_inputs=(x, y), device="tpu")
    with pytest.raises(TypeError, match="torch optimizer"):
        compile(model, nn.CrossEntropyLoss(), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1),
                example_inputs=(x, y), device="reference")
    with pytest.raises(TypeError, match="float scalar"):
        compile(model, lambda out, y: out, optim.SGD(lr=0.1), example_inputs=(x, y), device="reference")


def test_optim_frontend_configs() -> None:
    model, _ = _pair()
    assert optim.SGD(model.parameters(), lr=0.5, momentum=0.9, nesterov=True).config == \
        passes_optimizer.SGD(lr=0.5, momentum=0.9, nesterov=True)
    assert optim.Adam(lr=3e-4).config == passes_optimizer.Adam(lr=3e-4)
    assert optim.AdamW(model.parameters()).config.weight_decay == 1e-2
    assert optim.Adam(weight_decay=0.1).config.weight_decay == 0.1
    with pytest.raises(ValueError, match="Nesterov"):
        optim.SGD(lr=0.1, nesterov=True)
    with pytest.raises(NotImplementedError, match="amsgrad"):
        optim.Adam(amsgrad=True)
    with pytest.raises(NotImplementedError, match="groups"):
        optim.SGD([{"params": model.parameters()}], lr=0.1)
    with pytest.raises(TypeError, match="iterable of Parameters"):
        optim.SGD(model[0].weight, lr=0.1)
