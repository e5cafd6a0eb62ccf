"""The CUDA kernel tools in tools/ keep up with the renderers they call: without a GPU, each sweep
command and the kernel bench render every kernel they would time (--dry-run), so a renamed plan
helper or argument in codegen fails here rather than on the next device run."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"
SWEEPS = ("gemm", "gemm-plans", "direct", "direct-occupancy", "direct-staging", "direct-tc", "skinny", "small")


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOLS / script), *args], capture_output=True, text=True, timeout=300)


def test_the_sweep_commands_are_the_ones_tested():
    r = _run("cuda_sweep.py", "--help")
    assert r.returncode == 0, r.stderr
    listed = re.search(r"\{([a-z,-]+)\}", r.stdout)
    assert listed and tuple(listed.group(1).split(",")) == SWEEPS, r.stdout[:400]


@pytest.mark.parametrize("command", SWEEPS)
def test_every_sweep_variant_renders(command):
    r = _run("cuda_sweep.py", command, "--dry-run")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    # one line a variant: its group, its label, the kernel's name and the plan it was rendered with
    assert len(lines) >= 3 and all(re.match(r"batch=\d+ kernel=\S+ .+ \w+: \S", line) for line in lines), lines[:5]
    labels = [line.split(": ")[0] for line in lines]
    assert len(set(labels)) == len(labels), "two variants of one command have the same label and kernel name"


def test_the_kernel_bench_renders_every_kernel():
    r = _run("cuda_kernel_bench.py", "--dry-run", "--batches", "64")
    assert r.returncode == 0, r.stderr[-3000:]
    kernels = [line.split()[1] for line in r.stdout.splitlines()]
    assert {"conv2_gi+mask", "linear_gw", "softmax_xent", "sgd_cnn"} <= set(kernels) and len(kernels) == 15, kernels
