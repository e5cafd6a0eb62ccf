"""What a training step accepts as inputs: any array layout (the compiled code sees a contiguous
copy that lives for the whole call) and only labels inside 0..num_classes-1 (PyTorch raises for
the others; a one_hot would silently encode them as a zero row)."""
from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest

from ember.frontends import compile, nn, optim
from ember.runtime.data import load_mnist, write_idx

from models import cnn, mlp

RTOL32 = 1e-5  # float32 losses of the same weights and data on two devices (measured ~1e-7)


def _layouts(a: np.ndarray, start: int, n: int) -> dict[str, np.ndarray]:
    """Five ways to hand the same n samples a[start:start+n] to a step."""
    rows = a[start:start + n]
    wide = np.zeros((2 * n,) + a.shape[1:], a.dtype)
    wide[::2] = rows
    frozen = rows.copy()
    frozen.flags.writeable = False
    return {
        "contiguous": rows.copy(),
        "strided": wide[::2],                # step 2 over rows: not contiguous
        "view": a[start:start + n],          # a slice of the dataset: offset into a larger array
        "fortran": np.asfortranarray(rows),  # column-major (for 1-D labels, the same as contiguous)
        "readonly": frozen,
    }


def _data(flat: bool, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    shape = (4 * n, 784) if flat else (4 * n, 1, 28, 28)
    return rng.random(shape, dtype=np.float32), rng.integers(0, 10, 4 * n).astype(np.int64)


def _check_layouts(make, flat: bool, n: int, steps: int, combos) -> None:
    x, y = _data(flat, n)
    xs = [_layouts(x, i * n, n) for i in range(steps)]
    ys = [_layouts(y, i * n, n) for i in range(steps)]
    runs = {d: compile(make(), nn.CrossEntropyLoss(), optim.SGD(lr=0.05), example_inputs=(x[:n], y[:n]), device=d)
            for d in ("reference", "cpu")}
    init = runs["reference"].state_dict()
    expected = None
    for kx, ky in combos:
        losses, logits = {}, {}
        for d, step in runs.items():
            step.load_state_dict(init)
            logits[d] = step.inference(xs[0][kx])
            losses[d] = np.array([step(xs[i][kx], ys[i][ky]) for i in range(steps)])
        np.testing.assert_allclose(logits["cpu"], logits["reference"], rtol=RTOL32, atol=1e-6, err_msg=f"inference, x {kx}")
        np.testing.assert_allclose(losses["cpu"], losses["reference"], rtol=RTOL32, err_msg=f"x {kx}, y {ky}")
        # the same data in any layout is the same step: bit-identical on one device
        expected = losses["cpu"] if expected is None else expected
        np.testing.assert_array_equal(losses["cpu"], expected, err_msg=f"x {kx}, y {ky}")


LAYOUTS = ("contiguous", "strided", "view", "fortran", "readonly")


def test_mlp_step_takes_every_input_layout():
    """Every combination for x and y; before the fix, two converted inputs made C++ read freed memory."""
    _check_layouts(mlp, True, 64, 3, itertools.product(LAYOUTS, LAYOUTS))


def test_cnn_step_takes_non_contiguous_inputs():
    _check_layouts(cnn, False, 16, 2, [("contiguous", "contiguous"), ("strided", "strided"), ("fortran", "readonly"),
                                       ("readonly", "view")])


# ------------------------------------------------------------------------------------ labels

@pytest.fixture(scope="module", params=["reference", "cpu"])
def labelled_step(request):
    """One compiled MLP step per device (compiling per case would dominate the test's time)."""
    x, y = _data(True, 8)
    x, y = x[:8], y[:8]
    return compile(mlp(), nn.CrossEntropyLoss(), optim.SGD(lr=0.05), example_inputs=(x, y), device=request.param), x, y


@pytest.mark.parametrize("bad", [10, 255, -1, 2**40])
def test_step_refuses_out_of_range_labels(labelled_step, bad):
    step, x, y = labelled_step
    before = step.state_dict()
    y_bad = y.copy()
    y_bad[3] = bad
    with pytest.raises(ValueError) as e:
        step(x, y_bad)
    assert str(e.value) == (f"input 'y': label {bad} at batch index 3 is out of range for 10 classes "
                            f"(expected 0..9)")
    for k, v in step.state_dict().items():  # refused before anything ran
        np.testing.assert_array_equal(v, before[k])


def test_partial_batch_step_refuses_out_of_range_labels(labelled_step):
    step, x, y = labelled_step
    with pytest.raises(ValueError, match=r"label -1 at batch index 0 .*expected 0\.\.9"):
        step(x[:5], np.array([-1, 0, 1, 2, 3]))
    assert np.isfinite(step(x, y))  # good labels still train


def _mnist_dir(tmp_path, labels: np.ndarray):
    n = len(labels)
    images = np.random.default_rng(0).integers(0, 256, (n, 28, 28)).astype(np.uint8)
    for split, (img, lbl) in {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
                              "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}.items():
        write_idx(tmp_path / f"{img}.gz", images)
        write_idx(tmp_path / f"{lbl}.gz", labels if split == "test" else np.zeros(n, np.uint8))
    return tmp_path


def test_loader_refuses_out_of_range_labels(tmp_path):
    labels = np.array([0, 1, 2, 3, 4, 10, 255, 9], np.uint8)
    root = _mnist_dir(tmp_path, labels)
    load_mnist(root, "train")
    with pytest.raises(ValueError) as e:
        load_mnist(root, "test")
    assert str(e.value) == ("t10k-labels-idx1-ubyte.gz: label 10 at index 5 is out of range for 10 classes "
                            "(expected 0..9)")


def test_mnist_command_refuses_out_of_range_labels(tmp_path):
    root = _mnist_dir(tmp_path, np.array([0, 1, 2, 3, 4, 10, 255, 9], np.uint8))
    r = subprocess.run([sys.executable, "-m", "ember.frontends.cli", "mnist", "--model", "mlp", "--epochs", "1",
                        "--data", str(root)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode != 0
    assert "t10k-labels-idx1-ubyte.gz: label 10 at index 5 is out of range for 10 classes (expected 0..9)" in r.stderr
