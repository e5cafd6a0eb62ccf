"""The CPU backend's results do not drift: the 100-step CNN loss sequence of

    ember mnist --model cnn --device cpu --limit-steps 100 --log-every 1

is kept in `golden/cnn100_cpu_losses.json`, recorded before the compiler was reshaped into
targets. Compiled code is `-march=native`, so its rounding is a property of the toolchain and CPU
as much as of ember: on the toolchain the golden was recorded with (its fingerprint is the one
the compile cache keys on) the sequence must be **bit-identical**; on any other machine the
test still runs and holds the sequence to the free-running float32 envelope of 1e-3 (the bound
the reliability tests justify: different FMA/vector widths round differently and the first
chaotic steps amplify that), so it can neither fail because of the CPU nor pass a real change.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from ember.codegen import compiler
from ember.frontends.cli import main as ember_main

from conftest import require_mnist
from models import MNIST_DIR

GOLDEN = Path(__file__).parent / "golden" / "cnn100_cpu_losses.json"


def _toolchain() -> str:
    return hashlib.sha256(compiler._identity(tuple(compiler._cxx()), True).encode()).hexdigest()[:16]


@pytest.mark.slow
def test_cnn_100_step_losses_match_the_golden_sequence(tmp_path):
    require_mnist()
    golden = json.loads(GOLDEN.read_text())
    metrics = tmp_path / "m.jsonl"
    rc = ember_main(["mnist", "--model", "cnn", "--device", "cpu", "--limit-steps", "100", "--log-every", "1",
                     "--data", str(MNIST_DIR), "--metrics-file", str(metrics), "--no-progress", "--epochs", "1"])
    assert rc == 0
    losses = [r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if r["type"] == "step"]
    assert len(losses) == len(golden["losses"]) == 100
    if _toolchain() == golden["toolchain"]:
        assert losses == golden["losses"], "bit-identical on the recording toolchain"
    else:
        np.testing.assert_allclose(losses, golden["losses"], rtol=0, atol=1e-3)
