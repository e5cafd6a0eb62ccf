"""Dropout: Philox-4x32-10 masks keyed by (seed, step counter) with the element index as counter.

- The generator is Philox-4x32-10 (Random123's known-answer vectors).
- Masks are bit-identical on the reference interpreter and the compiled CPU step, run to run and
  for 1 and 2 OpenMP threads; every step draws a new mask (the step counter is state advanced
  by the compiled step, kept with the optimizer state); eval mode is the identity.
- The drop fraction is p within 5 standard deviations; kept values are scaled by 1/(1-p).
- The gradient is the cotangent times the same mask (float64 central differences), and training
  matches PyTorch when PyTorch is given ember's mask (its own generator cannot be matched).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ember.frontends import compile, nn, optim, spec, trace
from ember.frontends import functional as F
from ember.ir import Graph, TensorType, interpreter, philox
from ember.ir.ops import ShapeError

KAT = [  # Random123 kat_vectors: counter, key -> output
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,want", KAT)
def test_philox_known_answers(counter, key, want):
    got = philox.philox4x32(tuple(np.uint64(c) for c in counter), key)
    assert tuple(int(w) for w in got) == want


class Drop(nn.Module):
    """x * w, then dropout: with w = 1 and x = 1 the output is the mask times 1/(1-p)."""

    def __init__(self, p: float, seed: int = 0, features: int = 1) -> None:
        super().__init__()
        self.w = nn.Parameter(np.ones(features, np.float32))
        self.drop = nn.Dropout(p, seed=seed)

    def forward(self, x):
        return self.drop(x * self.w)


def _masks(device: str, shape: tuple[int, ...], p: float, steps: int, seed: int = 0) -> list[np.ndarray]:
    """The outputs of `steps` train-mode forward passes of Drop on ones (each advances the counter)."""
    model = Drop(p, seed, shape[-1])
    x = np.ones(shape, np.float32)
    step = compile(model, nn.MSELoss(), optim.SGD(lr=0.0), (x, x), device=device)
    return [step.inference(x) for _ in range(steps)]


def test_mask_fraction_scale_and_new_mask_each_step():
    p, shape = 0.3, (50, 4000)
    outs = _masks("reference", shape, p, 3)
    scale = np.float32(1 / (1 - p))
    for out in outs:
        assert set(np.unique(out)) == {np.float32(0), scale}
        n = out.size
        dropped = np.count_nonzero(out == 0) / n
        assert abs(dropped - p) <= 5 * np.sqrt(p * (1 - p) / n), dropped
    assert not np.array_equal(outs[0], outs[1]) and not np.array_equal(outs[1], outs[2])
    # the interpreter's mask is the generator's, element index as counter
    np.testing.assert_array_equal(outs[0] == 0, philox.uniform(shape, 0, 0, 0) < np.float32(p))


def test_reference_and_cpu_masks_are_bit_identical():
    shape = (64, 700)  # above the C++ kernels' parallel threshold
    ref, cpu = _masks("reference", shape, 0.5, 3, seed=7), _masks("cpu", shape, 0.5, 3, seed=7)
    for a, b in zip(ref, cpu):
        assert a.tobytes() == b.tobytes()


@pytest.mark.cuda
def test_cuda_masks_are_the_reference_masks_bit_for_bit():
    shape = (64, 700)
    for a, b in zip(_masks("reference", shape, 0.5, 3, seed=7), _masks("cuda", shape, 0.5, 3, seed=7)):
        assert a.tobytes() == b.tobytes()


_SCRIPT = """
import json, sys
import numpy as np
sys.path.insert(0, {here!r})
from test_dropout import _masks, _train
from ember.codegen import tuning_db
# No tuning database: its records (and the prior learned from them) are per thread count, so one
# and two threads could compile other kernels; the question here is one program's bits
with tuning_db.using(None):
    masks = _masks("cpu", (64, 700), 0.25, 2)
    print(json.dumps({{"masks": [m.tobytes().hex() for m in masks], "losses": _train("cpu", 4)}}))
"""


def _run_with_threads(threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", _SCRIPT.format(here=here)], env=env, capture_output=True, text=True,
                       check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_masks_and_losses_identical_run_to_run_and_for_one_and_two_threads():
    one, two, again = _run_with_threads(1), _run_with_threads(2), _run_with_threads(2)
    assert one == two == again


def test_eval_mode_and_p0_are_the_identity():
    x = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
    for model in (Drop(0.5, features=5).eval(), Drop(0.0, features=5)):
        g = trace(model, x)
        assert "random_uniform" not in {g.op(n) for n in g.g} and not g.states
        np.testing.assert_array_equal(interpreter.evaluate(g, x, parameters={"w": np.ones(5, np.float32)}), x)


def test_p1_drops_everything():
    x = np.ones((3, 4), np.float32)
    out = interpreter.run(trace(Drop(1.0, features=4), x), {"x": x}, {"w": np.ones(4, np.float32)},
                          {"rng_step": np.int64(0)}).outputs["out"]
    np.testing.assert_array_equal(out, np.zeros_like(x))


def test_each_dropout_call_draws_its_own_stream():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(np.ones(300, np.float32))

        def forward(self, x):
            return F.dropout(x * self.w, 0.5) + 2 * F.dropout(x * self.w, 0.5)

    g = trace(Two(), spec((10, 300)))
    streams = sorted(g.attrs(n)["stream"] for n in g.g if g.op(n) == "random_uniform")
    assert streams == [0, 1] and list(g.states) == ["rng_step"] and list(g.updates) == ["rng_step"]
    out = interpreter.run(g, {"x": np.ones((10, 300), np.float32)}, {"w": np.ones(300, np.float32)},
                          {"rng_step": np.int64(3)}).outputs["out"]
    assert len(np.unique(out)) == 4  # both masks differ: 0, 2 (first only), 4 (second only), 6 (both)


def _train(device: str, steps: int) -> list[float]:
    nn.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 300), nn.ReLU(), nn.Dropout(0.3), nn.Linear(300, 5), nn.Dropout(0.1))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 20)).astype(np.float32)
    y = rng.integers(0, 5, 64)
    step = compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), (x, y), device=device)
    losses = [step(x, y) for _ in range(steps)]
    assert int(step.optimizer_state_dict()["rng_step"]) == steps  # the counter lives with the optimizer state
    assert "rng_step" not in step.state_dict()  # the model's state dict stays PyTorch's
    return losses


def test_training_with_dropout_cpu_matches_reference():
    ref, cpu = _train("reference", 5), _train("cpu", 5)
    np.testing.assert_allclose(cpu, ref, rtol=1e-5)


def test_gradient_is_the_same_mask_float64_central_differences():
    from ember.passes.autodiff import grad
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 7))
    w = rng.standard_normal((7,))

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(w.astype(np.float32))

        def forward(self, x):
            return F.sum(F.tanh(F.dropout(x * self.w, 0.4)))

    g = grad(trace(M(), spec((6, 7))))
    states = {"rng_step": np.int64(11)}

    def loss(wv):
        return float(interpreter.run(g, {"x": x}, {"w": wv}, states, precision="float64").outputs["loss"])

    analytic = interpreter.run(g, {"x": x}, {"w": w}, states, precision="float64").outputs["grad:w"]
    eps = 1e-6
    numeric = np.array([(loss(w + eps * e) - loss(w - eps * e)) / (2 * eps) for e in np.eye(7)])
    np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-8)


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(ValueError, match=r"Dropout: p must be in \[0, 1\], got 1.5"):
        nn.Dropout(1.5)
    g = Graph()
    s = g.add_state("rng_step", TensorType((), "int64"))
    f = g.add_input("f", TensorType((2,)))
    with pytest.raises(ShapeError, match="operand is the step counter, an integer scalar"):
        g.add("random_uniform", [f], shape=(2,))
    with pytest.raises(ShapeError, match=r"seed=-1.*\[0, 2\*\*32\)"):
        g.add("random_uniform", [s], shape=(2,), seed=-1)


def test_from_torch_dropout_trains_like_torch_given_embers_masks():
    """PyTorch's generator cannot be matched, so the PyTorch twin multiplies by ember's masks
    (recomputed from the generator for each step) where the imported model has nn.Dropout."""
    torch = pytest.importorskip("torch")
    from ember.frontends import from_torch
    tnn = torch.nn
    torch.manual_seed(0)
    p = 0.4
    tm = tnn.Sequential(tnn.Linear(12, 32), tnn.ReLU(), tnn.Dropout(p), tnn.Linear(32, 3))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 12)).astype(np.float32)
    y = rng.integers(0, 3, 16)
    model = from_torch(tm, torch.from_numpy(x))
    twin = [tm[0], tm[1], None, tm[3]]
    step = compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), (x, y), device="cpu")
    topt = torch.optim.SGD(tm.parameters(), lr=0.1)
    scale = np.float32(1 / (1 - p))
    for i in range(5):
        mask = np.where(philox.uniform((16, 32), 0, i, 0) >= np.float32(p), scale, np.float32(0))
        ours = step(x, y)
        topt.zero_grad()
        h = twin[1](twin[0](torch.from_numpy(x))) * torch.from_numpy(mask)
        loss = torch.nn.functional.cross_entropy(twin[3](h), torch.from_numpy(y))
        loss.backward()
        topt.step()
        assert abs(ours - loss.item()) < 1e-5, (i, ours, loss.item())
    model.eval()
    tm.eval()
    with torch.no_grad():
        np.testing.assert_allclose(step.inference(x), tm(torch.from_numpy(x)).numpy(), rtol=1e-5, atol=1e-6)


def test_from_torch_functional_dropout_follows_the_model_mode():
    torch = pytest.importorskip("torch")
    from ember.frontends import from_torch

    class T(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 300)

        def forward(self, x):
            return torch.nn.functional.dropout(self.fc(x), 0.5, training=self.training)

    tm = T()
    x = np.ones((2, 4), np.float32)
    model = from_torch(tm, torch.from_numpy(x))
    train = trace(model, x)
    assert [train.op(n) for n in train.g].count("random_uniform") == 1
    model.eval()
    assert "random_uniform" not in {g_op for g in [trace(model, x)] for g_op in (g.op(n) for n in g.g)}


def test_a_checkpoint_resumes_the_same_masks():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((16, 20)).astype(np.float32)
    y = rng.integers(0, 5, 16)

    def fresh():
        nn.manual_seed(0)
        model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 5))
        return compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1, momentum=0.9), (x, y), device="cpu")

    straight = fresh()
    losses = [straight(x, y) for _ in range(6)]
    first = fresh()
    assert [first(x, y) for _ in range(3)] == losses[:3]
    model_state, opt_state = first.state_dict(), first.optimizer_state_dict()
    assert int(opt_state["rng_step"]) == 3
    resumed = fresh()
    resumed.load_state_dict(model_state)
    resumed.load_optimizer_state_dict(opt_state)
    assert [resumed(x, y) for _ in range(3)] == losses[3:]


def test_from_torch_resnet_block_with_batch_norm_and_dropout_trains_like_torch_given_embers_masks():
    """A small residual network with BatchNorm and Dropout, imported from PyTorch and trained on
    the cpu device: per step the loss within 1e-5 and the weights and running statistics close
    to PyTorch's, whose Dropout is replaced by ember's masks (the stream of a call is its order)."""
    torch = pytest.importorskip("torch")
    from ember.frontends import from_torch
    tnn = torch.nn
    p = 0.3

    class Net(tnn.Module):
        def __init__(self, drop):
            super().__init__()
            self.conv = tnn.Conv2d(1, 4, 3, padding=1, bias=False)
            self.bn = tnn.BatchNorm2d(4)
            self.conv2 = tnn.Conv2d(4, 4, 3, padding=1, bias=False)
            self.bn2 = tnn.BatchNorm2d(4)
            self.drop = drop
            self.fc = tnn.Linear(4 * 6 * 6, 3)

        def forward(self, x):
            h = torch.relu(self.bn(self.conv(x)))
            h = torch.relu(h + self.bn2(self.conv2(h)))
            return self.fc(self.drop(torch.flatten(h, 1)))

    class Masked(tnn.Module):
        mask = None

        def forward(self, h):
            return h * self.mask

    torch.manual_seed(0)
    tm = Net(tnn.Dropout(p))
    twin = Net(Masked())
    twin.load_state_dict(tm.state_dict())
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((8, 8, 1, 6, 6)).astype(np.float32)
    ys = rng.integers(0, 3, (8, 8))
    model = from_torch(tm, torch.from_numpy(xs[0]))
    step = compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), (xs[0], ys[0]), device="cpu")
    topt = torch.optim.SGD(twin.parameters(), lr=0.1)
    scale = np.float32(1 / (1 - p))
    for i, (x, y) in enumerate(zip(xs, ys)):
        twin.drop.mask = torch.from_numpy(np.where(philox.uniform((8, 144), 0, i, 0) >= np.float32(p), scale,
                                                   np.float32(0)))
        ours = step(x, y)
        topt.zero_grad()
        loss = torch.nn.functional.cross_entropy(twin(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        topt.step()
        assert abs(ours - loss.item()) < 1e-5, (i, ours, loss.item())
    for k, v in twin.state_dict().items():
        np.testing.assert_allclose(step.state_dict()[k], v.numpy(), rtol=1e-5, atol=1e-6, err_msg=k)
