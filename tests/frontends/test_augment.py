"""Random translation inside the step (`F.random_translate`, `nn.RandomTranslate`).

- Each image moves by (dy, dx), each floor(u * (2s + 1)) - s away from 0 with u the Philox draw
  of (seed, step, stream, image): computed here from `ember.ir.philox` alone, the interpreter
  gives exactly that batch; every shift is within [-s, s] and every value in it occurs.
- The reference interpreter and the compiled CPU step give the same bytes for a seed and step;
  the next step moves the images elsewhere; another seed too.
- Eval mode and max_shift 0 are the identity; a model that starts with it trains alike on the
  interpreter and the CPU (nothing is differentiated through the shift).
"""
from __future__ import annotations

import numpy as np
import pytest

from ember.frontends import compile, nn, optim, spec, trace
from ember.ir import interpreter, philox


class Shift(nn.Module):
    """x * w, then the translation: with w = 1 the output is the shifted batch."""

    def __init__(self, max_shift: int, seed: int = 0, channels: int = 1) -> None:
        super().__init__()
        self.w = nn.Parameter(np.ones((channels, 1, 1), np.float32))
        self.move = nn.RandomTranslate(max_shift, seed)

    def forward(self, x):
        return self.move(x * self.w)


def _moved(x: np.ndarray, dy: np.ndarray, dx: np.ndarray) -> np.ndarray:
    """Each image n of x moved down by dy[n] and right by dx[n], zeros where nothing lands."""
    out = np.zeros_like(x)
    h, w = x.shape[2:]
    for n in range(len(x)):
        a, b = int(dy[n]), int(dx[n])
        out[n, :, max(a, 0):h + min(a, 0), max(b, 0):w + min(b, 0)] = \
            x[n, :, max(-a, 0):h + min(-a, 0), max(-b, 0):w + min(-b, 0)]
    return out


def _shifts(n: int, s: int, seed: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    k = 2 * s + 1
    dy, dx = (s - np.floor(philox.uniform((n,), seed, step, stream) * np.float32(k)).astype(int)
              for stream in (0, 1))
    return dy, dx


def _batch(n: int, c: int = 1, size: int = 9) -> np.ndarray:
    return np.random.default_rng(0).random((n, c, size, size)).astype(np.float32) + 1.0  # no zeros of its own


def test_interpreter_moves_each_image_by_its_philox_draw_within_bounds():
    s, seed = 2, 5
    x = _batch(200, c=2)
    g = trace(Shift(s, seed, channels=2), spec(x.shape))
    for step in (0, 7):
        out = interpreter.run(g, {"x": x}, {"w": np.ones((2, 1, 1), np.float32)},
                              {"rng_step": np.int64(step)}).outputs["out"]
        dy, dx = _shifts(len(x), s, seed, step)
        assert set(dy) == set(dx) == set(range(-s, s + 1))  # within bounds, and every shift occurs
        np.testing.assert_array_equal(out, _moved(x, dy, dx))


def _outputs(device: str, x: np.ndarray, s: int, seed: int, steps: int) -> list[np.ndarray]:
    """The batch as `steps` train-mode passes of Shift return it (each advances the counter)."""
    step = compile(Shift(s, seed), nn.MSELoss(), optim.SGD(lr=0.0), (x, x), device=device)
    return [step.inference(x) for _ in range(steps)]


def test_reference_and_cpu_give_the_same_batch_and_each_step_another():
    x = _batch(64, size=28)
    ref, cpu = _outputs("reference", x, 3, 1, 3), _outputs("cpu", x, 3, 1, 3)
    for step, (a, b) in enumerate(zip(ref, cpu)):
        assert a.tobytes() == b.tobytes()
        np.testing.assert_array_equal(a, _moved(x, *_shifts(len(x), 3, 1, step)))
    assert not np.array_equal(cpu[0], cpu[1]) and not np.array_equal(cpu[1], cpu[2])
    assert not np.array_equal(_outputs("cpu", x, 3, 2, 1)[0], cpu[0])  # another seed, another batch


@pytest.mark.cuda
def test_cuda_gives_the_reference_batch_bit_for_bit():
    x = _batch(64, size=28)
    for a, b in zip(_outputs("reference", x, 2, 1, 3), _outputs("cuda", x, 2, 1, 3)):
        assert a.tobytes() == b.tobytes()


def test_eval_mode_and_zero_shift_are_the_identity():
    x = _batch(4)
    for model in (Shift(2).eval(), Shift(0)):
        g = trace(model, x)
        assert "random_uniform" not in {g.op(n) for n in g.g} and not g.states
        np.testing.assert_array_equal(interpreter.evaluate(g, x, parameters={"w": np.ones((1, 1, 1), np.float32)}), x)


def _train(device: str, steps: int) -> list[float]:
    nn.manual_seed(0)
    model = nn.Sequential(nn.RandomTranslate(2), nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 10 * 10, 3))
    rng = np.random.default_rng(0)
    x = rng.random((16, 1, 12, 12)).astype(np.float32)
    y = rng.integers(0, 3, 16)
    step = compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), (x, y), device=device)
    losses = [step(x, y) for _ in range(steps)]
    assert int(step.optimizer_state_dict()["rng_step"]) == steps
    return losses


def test_nothing_is_differentiated_through_the_shift():
    from ember.passes.autodiff import grad
    model = nn.Sequential(nn.RandomTranslate(2), nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(4 * 10 * 10, 3))
    g = grad(trace(lambda x, y: nn.CrossEntropyLoss()(model(x), y), spec((16, 1, 12, 12)), spec((16,), "int64"),
                   modules={"": model}))
    ops = [g.op(n) for n in g.g]
    # forward: the two shift convolutions and the layer's; backward: the layer's weight gradient only
    assert ops.count("conv2d") == 3 and ops.count("conv2d_grad_weight") == 1 and "conv2d_grad_input" not in ops


def test_training_through_it_cpu_matches_reference():
    ref, cpu = _train("reference", 4), _train("cpu", 4)
    np.testing.assert_allclose(cpu, ref, rtol=1e-5)
    assert len(set(ref)) == 4


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(ValueError, match="RandomTranslate: max_shift must be >= 0, got -1"):
        nn.RandomTranslate(-1)
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*32\)"):
        trace(Shift(1, seed=-3), spec((2, 1, 4, 4)))
    with pytest.raises(Exception, match="random_translate expects an NCHW input"):
        trace(lambda x: nn.RandomTranslate(1)(x), spec((2, 16)))


def test_bf16_leaves_the_shift_in_float32():
    """Under precision="bf16" the translation is left as traced (`precision.KEPT_MODULES`): its
    convolutions stay float32 (no bfloat16 kernel family serves a grouped one) and move the
    pixels exactly, as in float32; the layer after it is lowered."""
    from ember.passes.precision import autocast
    model = nn.Sequential(nn.RandomTranslate(2), nn.Conv2d(1, 2, 3))
    g = autocast(trace(model, spec((4, 1, 9, 9))))
    convs = {g.scope(n): g.type(g.operands(n)[0]).dtype.name for n in g.g if g.op(n) == "conv2d"}
    assert convs == {"0": "float32", "1": "bfloat16"}
    x = _batch(16, size=12)
    step = compile(Shift(2, 4), nn.MSELoss(), optim.SGD(lr=0.0), (x, x), device="cpu", precision="bf16")
    assert [step.inference(x).tobytes() for _ in range(2)] == [o.tobytes() for o in _outputs("reference", x, 2, 4, 2)]
