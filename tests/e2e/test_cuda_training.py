"""The CUDA backend end to end (marked `cuda`: run on a GPU; skipped elsewhere).

- CUDA graph replay equals plain launches bit for bit, and two runs give identical losses
  (deterministic kernels: no atomics, fixed reduction orders).
- Against PyTorch on the same GPU (TF32 off), per step from the same weights: before every
  ember step PyTorch float32 (GPU) and float64 (CPU) are loaded with ember's weights and take the
  same step. The loss agrees to 1e-5, and ember's parameter update is as close to the float64
  update as PyTorch float32's is: the median over steps of (ember's relative error / PyTorch
  float32's) is at most 1.5, since the two float32 implementations round differently, each
  landing on either side of the other from step to step (a median near 1 is expected; a ReLU
  mask bit flipping for a value within rounding of 0 moves single steps, hence the median).
- Free running: the loss trajectories of ember and PyTorch float32 from the same weights on the
  same batches stay within 1e-3 over 200 CNN steps and 1e-5 over 200 MLP steps (float32 training
  is chaotic in its first steps; 1e-3 is the upstream project's own alignment bound).
Random MNIST-shaped data keeps these independent of the data files; the accuracy test uses MNIST.
"""
from __future__ import annotations

import numpy as np
import pytest

from ember.frontends import compile, nn, optim
from ember.frontends.training import build_model

pytestmark = pytest.mark.cuda

SHAPES = {"cnn": (1, 28, 28), "resnet8": (1, 28, 28), "mlp": (784,)}


def _batches(name: str, steps: int, batch: int = 64, seed: int = 0):
    rng = np.random.default_rng(seed)
    xs = rng.random((steps, batch, *SHAPES[name]), dtype=np.float32)
    ys = rng.integers(0, 10, (steps, batch)).astype(np.int64)
    return xs, ys


def _step(name: str, device: str = "cuda", lr: float = 0.05):
    model = build_model(name)
    xs, ys = _batches(name, 1)
    return compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=lr), example_inputs=(xs[0], ys[0]), device=device)


@pytest.mark.parametrize("pdl", ["0", "1"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "resnet8"])
def test_graph_replay_equals_plain_launches_bit_for_bit(name, pdl, monkeypatch):
    """With EMBER_CUDA_PDL=1 the replayed graph's kernels are programmatic dependents of the ones
    before them on their streams (runtime/cuda_pdl.py): the same values, bit for bit."""
    monkeypatch.setenv("EMBER_CUDA_PDL", pdl)
    xs, ys = _batches(name, 6)
    replayed, plain = _step(name), _step(name)
    dependent = replayed._example_step()[1]._dependent
    assert any(d is not None for d in dependent) == (pdl == "1")
    executor = plain._example_step()[1]
    for x, y in zip(xs, ys):
        a = float(replayed.run(x, y))
        b = float(executor.run_eager({"x": x, "y": y})["loss"])
        assert a == b
    # `plain` ran its executor directly, behind the TrainStep's back, so its model's arrays were
    # never marked stale: compare what the two storages hold
    for k in replayed.state_dict():
        assert np.array_equal(replayed.storage.read(k), plain.storage.read(k)), k


def test_returned_losses_stay_valid_across_ring_chunks(monkeypatch):
    """Each step's loss is a view of a slot in a device ring (runtime/cuda.py: _LossRing) that is
    never reused: with 3 slots a chunk, 8 steps span three chunks, and every loss held from the
    start still equals the loss the same step gives with plain launches."""
    from ember.runtime import cuda as runtime_cuda
    monkeypatch.setattr(runtime_cuda, "RING_SLOTS", 3)
    xs, ys = _batches("mlp", 8)
    ringed, plain = _step("mlp"), _step("mlp")
    executor = plain._example_step()[1]
    held = [ringed.run(x, y) for x, y in zip(xs, ys)]
    expected = [float(executor.run_eager({"x": x, "y": y})["loss"]) for x, y in zip(xs, ys)]
    assert [float(v) for v in held] == expected
    assert len({int(v.data.ptr) for v in held}) == 8  # eight distinct slots


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_two_runs_give_identical_losses(name):
    xs, ys = _batches(name, 20)
    runs = [[_s(x, y) for _s in [_step(name)] for x, y in zip(xs, ys)] for _ in range(2)]
    assert runs[0] == runs[1]


def _torch_model(name, state, dtype, device):
    import torch
    from ember.frontends.cli.bench_cuda import _torch_model as make
    model = make(name)
    model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in state.items()})
    return model.to(device=device, dtype=dtype)


def _torch_step(name, state, x, y, dtype, device, lr=0.05):
    import torch
    import torch.nn.functional as tF
    model = _torch_model(name, state, dtype, device)
    loss = tF.cross_entropy(model(torch.from_numpy(x).to(device=device, dtype=dtype)), torch.from_numpy(y).to(device))
    loss.backward()
    with torch.no_grad():
        new = {k: (p - lr * p.grad).cpu().double().numpy() for k, p in model.named_parameters()}
    return float(loss), new


def _update_ratios(name, step, xs, ys) -> list[float]:
    """Per step from the same weights: the loss against PyTorch float32's on the GPU (within
    1e-5), and (ember's update error / PyTorch float32's), both against float64 on the CPU, over
    the parameters (BatchNorm's running statistics are no update)."""
    import torch
    ratios = []
    for x, y in zip(xs, ys):
        before = {k: v.astype(np.float64) for k, v in step.state_dict().items()}
        loss32, upd32 = _torch_step(name, step.state_dict(), x, y, torch.float32, "cuda")
        _, upd64 = _torch_step(name, before, x, y, torch.float64, "cpu")
        loss = step(x, y)
        assert abs(loss - loss32) <= 1e-5 * max(1.0, abs(loss32))
        after = step.state_dict()
        num_e = sum(np.sum(((after[k] - before[k]) - (upd64[k] - before[k])) ** 2) for k in upd64)
        num_t = sum(np.sum(((upd32[k] - before[k]) - (upd64[k] - before[k])) ** 2) for k in upd64)
        ratios.append(np.sqrt(num_e) / max(np.sqrt(num_t), 1e-30))
    return ratios


@pytest.mark.parametrize("name,steps", [("mlp", 30), ("cnn", 30)])
def test_per_step_from_the_same_weights_matches_pytorch(name, steps):
    torch = pytest.importorskip("torch")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    xs, ys = _batches(name, steps, seed=1)
    step = _step(name)
    ratios = _update_ratios(name, step, xs, ys)
    assert np.median(ratios) <= 1.5, ratios


@pytest.mark.parametrize("name", ["cnn", "resnet8"])
def test_a_later_batch_sizes_step_matches_pytorch_from_the_same_weights(name):
    """A step at 37 images compiled after the one at 64 takes its plans: its GEMMs, reductions,
    loss and pointwise kernels run on run-time sizes (the variants the first step builds ahead).
    Per step from the same weights, as above."""
    torch = pytest.importorskip("torch")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from ember.codegen.cuda_choices import RUNTIME
    xs, ys = _batches(name, 8, batch=37, seed=2)
    step = _step(name)
    ratios = _update_ratios(name, step, xs, ys)
    assert np.median(ratios) <= 1.5, ratios
    (later,) = [g for (types, _), (g, _) in step._steps.items() if types[0].shape[0] == 37]
    specs = [later.attrs(n)["kernel"] for n in later.g if later.op(n) == "fused"]
    assert sum(s.choice is not None and tuple(s.choice[1]) == RUNTIME for s in specs) >= 5
    assert sum(s.why.startswith("reused") for s in specs) >= len(specs) // 2


@pytest.mark.parametrize("name,steps,bound", [("mlp", 200, 1e-5), ("cnn", 200, 1e-3)])
def test_free_running_stays_within_the_envelope(name, steps, bound):
    torch = pytest.importorskip("torch")
    import torch.nn.functional as tF
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    xs, ys = _batches(name, steps, seed=2)
    step = _step(name)
    model = _torch_model(name, step.state_dict(), torch.float32, "cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    diffs = []
    for x, y in zip(xs, ys):
        opt.zero_grad()
        loss = tF.cross_entropy(model(torch.from_numpy(x).cuda()), torch.from_numpy(y).cuda())
        loss.backward()
        opt.step()
        diffs.append(abs(step(x, y) - float(loss)))
    assert max(diffs) <= bound, max(diffs)


def test_mnist_one_epoch_on_the_gpu_reaches_the_accuracy_bar(tmp_path):
    from conftest import require_mnist
    from models import MNIST_DIR

    from ember.frontends.cli import main
    require_mnist()
    metrics = tmp_path / "m.jsonl"
    assert main(["mnist", "--model", "cnn", "--device", "cuda", "--epochs", "1", "--data", str(MNIST_DIR),
                 "--metrics-file", str(metrics), "--no-progress"]) == 0
    import json
    epoch = [r for r in map(json.loads, metrics.read_text().splitlines()) if r["type"] == "epoch"][-1]
    assert epoch["test_acc"] >= 0.965, epoch


def test_training_evaluation_and_partial_batch_steps_share_one_stream_and_repeat_exactly():
    """The training step, the step of the last partial batch and the inference step share the
    parameters on the device: run back to back without host waits they must still give the same
    figures every time (they are ordered on one stream)."""
    import cupy

    from ember.frontends.training import Trainer, make_optimizer
    rng = np.random.default_rng(3)
    x = rng.random((64 * 20 + 32, 1, 28, 28), dtype=np.float32)
    y = rng.integers(0, 10, len(x)).astype(np.int64)
    test = (x[:500], y[:500])
    runs = []
    for _ in range(2):
        t = Trainer(build_model("cnn"), make_optimizer("sgd", 0.05), (x, y), test, device="cuda", log_every=0)
        rec = t.fit(1)[-1]
        runs.append((rec["train_loss"], rec["test_loss"], rec["test_acc"]))
        cupy.cuda.Device().synchronize()
    assert runs[0] == runs[1]


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_tf32_steps_stay_within_tf32_rounding_of_float32(name):
    """precision="tf32" (tensor cores) against float32, per step from the same weights (free
    running is chaotic in the first steps and would measure that, not TF32): TF32 rounds each
    operand to 10 mantissa bits (2**-11 relative), so each product is off by up to ~1e-3 of
    itself and a step's loss and parameter update move by about that much: the loss within
    2e-3 relative and the update within 2e-2 (relative L2 over all parameters) of float32's. The
    update must also differ measurably (> 1e-5): equal updates would mean TF32 never ran. Two
    TF32 runs are identical (deterministic like float32)."""
    xs, ys = _batches(name, 20, seed=4)
    fp32 = _step(name)

    def tf32_step():
        step = compile(build_model(name), nn.CrossEntropyLoss(), optim.SGD(lr=0.05), example_inputs=(xs[0], ys[0]),
                       device="cuda", precision="tf32")
        graph = step.train_graph
        specs = [graph.attrs(n)["kernel"] for n in graph.g if graph.op(n) == "fused"]
        assert all(s.param("tf32") for s in specs if s.kind in ("conv2d", "conv2d_grad_input", "conv2d_grad_weight",
                                                                 "matmul"))
        return step

    tf32, again = tf32_step(), tf32_step()
    rel_updates = []
    for x, y in zip(xs, ys):
        before = fp32.state_dict()
        tf32.load_state_dict(before)
        again.load_state_dict(before)
        loss32, loss_tf = float(fp32(x, y)), float(tf32(x, y))
        assert float(again(x, y)) == loss_tf
        assert abs(loss_tf - loss32) <= 2e-3 * abs(loss32), (loss_tf, loss32)
        after32, after_tf = fp32.state_dict(), tf32.state_dict()
        num = np.sqrt(sum(np.sum(((after_tf[k] - before[k]) - (after32[k] - before[k])).astype(np.float64) ** 2)
                          for k in before))
        den = np.sqrt(sum(np.sum((after32[k] - before[k]).astype(np.float64) ** 2) for k in before))
        rel_updates.append(num / den)
    assert max(rel_updates) <= 2e-2, rel_updates
    assert min(rel_updates) > 1e-5, rel_updates
