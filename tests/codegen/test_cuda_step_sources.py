"""The `cuda` target without a GPU: `ember kernels` writes every source of the MNIST models'
training and inference steps, and each compiles with `nvcc -cubin -arch=sm_90` warning-free (the
runtime compiles the same source with NVRTC). In CI nvcc must be there; elsewhere a missing nvcc
skips."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from ember.frontends.cli import main as ember_main


def _nvcc() -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("nvcc is not on PATH: CI compiles the generated CUDA sources with it")
        pytest.skip("nvcc is not on PATH")
    return nvcc


@pytest.mark.parametrize("tf32", [False, True], ids=["fp32", "tf32"])
@pytest.mark.parametrize("model", ["cnn", "mlp"])
def test_every_generated_cuda_source_compiles_with_nvcc(model, tf32, tmp_path, capsys):
    nvcc = _nvcc()
    assert ember_main(["kernels", "--model", model, "--device", "cuda", "--out", str(tmp_path)]
                      + (["--tf32"] if tf32 else [])) == 0
    sources = sorted(tmp_path.glob("*.cu"))
    assert [p.name for p in sources] == [f"{model}-inference-{'64x784' if model == 'mlp' else '64x1x28x28'}.cu",
                                         f"{model}-train-{'64x784' if model == 'mlp' else '64x1x28x28'}.cu"]
    for src in sources:
        r = subprocess.run([nvcc, "-cubin", "-arch=sm_90", "-o", str(src.with_suffix(".cubin")), str(src)],
                           capture_output=True, text=True)
        assert r.returncode == 0 and not r.stderr.strip(), f"{src.name}:\n{r.stderr}"
    text = (tmp_path / sources[-1].name).read_text()
    assert "extern \"C\" __global__" in text and "implements" in text
    assert ("mma.sync.aligned.m16n8k8" in text) == tf32  # tensor cores exactly when asked


def test_kernels_command_refuses_a_device_without_sources(tmp_path, capsys):
    assert ember_main(["kernels", "--model", "mlp", "--device", "reference", "--out", str(tmp_path)]) == 2
    assert "generates no source code" in capsys.readouterr().err
