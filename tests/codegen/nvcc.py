"""nvcc for the tests that compile generated CUDA without a GPU: where it is, and how they call it
(a cubin for sm_90a, as the runtime builds for an H100 or H200: warpgroup MMA is sm_90a's; C++17 as NVRTC compiles it at run time; any diagnostic fails)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest


def find_nvcc() -> str | None:
    return shutil.which("nvcc") or ("/usr/local/bin/nvcc" if os.path.exists("/usr/local/bin/nvcc") else None)


def nvcc_or_skip() -> str:
    """nvcc's path; a missing nvcc skips the test, except in CI (CI=true), where it fails."""
    nvcc = find_nvcc()
    if nvcc is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("nvcc is not on PATH: CI compiles the generated CUDA sources with it")
        pytest.skip("nvcc is not on PATH")
    return nvcc


def nvcc_command(nvcc: str, src: Path, out: str = os.devnull) -> list[str]:
    return [nvcc, "-cubin", "-arch=sm_90a", "-std=c++17", "-o", out, str(src)]


def assert_compiles(nvcc: str, src: Path) -> None:
    """`src` compiles with no error, warning or other output."""
    r = subprocess.run(nvcc_command(nvcc, src), capture_output=True, text=True)
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), f"{src.name}:\n{r.stdout}{r.stderr}"
