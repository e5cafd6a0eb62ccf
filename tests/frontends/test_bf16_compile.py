"""`compile(..., precision="bf16")` and `--bf16` on the commands: the autocast pass runs first on
every step's graph (training and inference), the step keeps its float32 interface and trains like
float32; the flags are checked against the device in one line."""
from __future__ import annotations

import re

import numpy as np
import pytest

from ember.codegen import cpu_vector
from ember.frontends import compile, nn, optim, plan
from ember.frontends.cli import main as ember_main
from ember.frontends.training import build_model
from ember.ir import bfloat16

X = np.random.default_rng(0).random((8, 1, 28, 28), dtype=np.float32)
Y = np.arange(8) % 10


def _losses(precision: str, device: str = "reference", steps: int = 3) -> tuple[list[float], object]:
    step = compile(build_model("cnn", 0), nn.CrossEntropyLoss(), optim.SGD(lr=0.1), (X, Y), device=device,
                   precision=precision)
    return [step(X, Y) for _ in range(steps)], step


def test_reference_trains_in_bf16_like_float32():
    ref, _ = _losses("float32")
    low, step = _losses("bf16")
    assert np.allclose(low, ref, rtol=1e-2)
    assert low != ref  # it rounded
    graph = step.train_graph
    contractions = [n for n in graph.g if graph.op(n) in ("conv2d", "conv2d_grad_weight", "matmul")]
    assert contractions and all(graph.type(n).dtype == bfloat16 for n in contractions)
    out = step.inference(X)
    assert out.dtype == np.float32 and out.shape == (8, 10)
    assert all(p.data.dtype == np.float32 for p in step.model.parameters())  # master weights


def test_plan_dumps_show_bf16_buffers(tmp_path):
    graphs = plan(build_model("mlp"), nn.CrossEntropyLoss(), optim.SGD(lr=0.1),
                  (np.zeros((4, 784), np.float32), np.zeros(4, np.int64)), device="reference",
                  dump_dir=tmp_path, precision="bf16")
    assert set(graphs) == {"train-4x784", "inference-4x784"}
    dumps = sorted(p.name for p in (tmp_path / "train-4x784").glob("*.txt"))
    assert dumps[:3] == ["00-input.txt", "01-autocast.txt", "02-autodiff.txt"]
    assert "bf16[" in (tmp_path / "train-4x784" / "01-autocast.txt").read_text()


def test_kernels_command_shows_each_buffers_dtype_and_the_product_path(tmp_path):
    assert ember_main(["kernels", "--model", "cnn", "--device", "cpu", "--bf16", "--batch-size", "8",
                       "--out", str(tmp_path)]) == 0
    source = (tmp_path / "cnn-train-8x1x28x28.cpp").read_text()
    graph = (tmp_path / "cnn-train-8x1x28x28.txt").read_text()
    # every buffer's C declaration has its type: bfloat16 activations are uint16_t (their sizes are
    # the step's run-time table; the layout note above the entry names each call's result type)
    assert re.search(r"uint16_t\* const v\d+_conv2d = ", source)
    assert re.search(r"//   call \d+ k\d+_conv2d: .* -> bf16\[8,16,26,26\]", source)
    assert re.search(r"float\* const p_0_weight = ", source)  # the master weight
    dots = set(re.findall(r"choice=bf16\(mr=\d+,nv=\d+,nb=\d+,dot=(\w+),mode=(\w+)\)", graph))
    # the path this CPU has (AMX, AVX512-BF16 or neither), as ember decides it for the step
    dot = cpu_vector.bf16_dot(cpu_vector.resolve())
    assert {d for d, _ in dots} == {dot}
    assert ("_mm512_dpbf16_ps" in source) == (dot != "emulated")
    # the stride-1 convolutions direct (on AMX the tiles take conv2's three; conv1, one input
    # channel, stays on the vectors), the linear layer's x @ W^T read along k (dot), its gradients GEMMs
    assert {m for _, m in dots} == {"direct", "dot", "gemm"} | ({"direct_amx"} if dot == "amx" else set())
    assert len(re.findall(r"choice=bf16\(", graph)) == 8  # the 8 contractions of a CNN step


@pytest.mark.parametrize("command", [["mnist", "--epochs", "1"], ["kernels", "--out", "k"], ["tune"],
                                     ["bench", "--model", "mlp"]])
def test_one_precision_flag_at_most(command, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert ember_main([*command, "--device", "cpu", "--tf32", "--bf16"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("--tf32 and --bf16: choose one precision") and len(err.splitlines()) == 1
