"""Every CUDA kernel template renders and compiles with nvcc for sm_90 (no GPU needed).

The kernels of ``cuda_cases.all_kernels()`` (MNIST CNN/MLP shapes at batch 64 and 1024, odd
geometries with stride, padding and tails, the loss and SGD) are concatenated into a few
translation units, as the runtime will do, and compiled with ``nvcc -cubin -arch=sm_90``;
any nvcc warning fails the test. Also checks the structural contract of every CudaKernel.
"""
from __future__ import annotations

import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

import cuda_cases
from nvcc import assert_compiles, find_nvcc, nvcc_command
from ember.codegen import cuda_kernels as ck

NVCC = find_nvcc()
if NVCC is None and os.environ.get("CI") != "true":
    pytest.skip("nvcc not found (install the CUDA toolkit; required when CI=true)", allow_module_level=True)

CASES = cuda_cases.all_kernels()
GROUPS = 4  # translation units (compiled in parallel)


def test_kernel_contract():
    names = set()
    for k, _ in CASES:
        assert isinstance(k, ck.CudaKernel) and k.name not in names
        names.add(k.name)
        assert k.scratch_bytes >= 0 and k.scratch_bytes % 4 == 0
        for ln in k.launches:
            assert ln.function.startswith(k.name + "_")
            assert re.search(r'extern "C" __global__ void __launch_bounds__\(\d+(, \d+)?\) ' + ln.function + r"\(",
                             k.code), ln.function
            assert all(1 <= g < 2**31 for g in ln.grid) and ln.grid[1] < 65536 and ln.grid[2] < 65536
            assert 1 <= ln.block[0] * ln.block[1] * ln.block[2] <= 1024
            assert ("scratch" in ln.args) == (k.scratch_bytes > 0)
        # No global symbols besides the prefixed kernels: at brace depth 0 only the namespace,
        # extern "C" kernels (signature lines may continue, indented), comments and blanks.
        depth = 0
        for line in k.code.splitlines():
            code = line.split("//")[0]
            if depth == 0 and code.strip() and not code[0].isspace():
                ok = code.startswith(f"namespace ember_cu_{k.name} {{") or code.startswith('extern "C" __global__')
                assert ok or code.startswith("}"), f"{k.name}: top-level code outside namespace ember_cu_{k.name}: {line}"
            depth += code.count("{") - code.count("}")
        assert depth == 0, k.name


def _compile(tmp_path, i, sources):
    src = tmp_path / f"tu{i}.cu"
    src.write_text("\n".join(sources))
    return src, subprocess.run(nvcc_command(NVCC, src), capture_output=True, text=True)


def test_all_kernels_compile_warning_free(tmp_path):
    if NVCC is None:
        pytest.fail("CI=true but nvcc is not installed")
    sources = [k.code for k, _ in CASES]
    chunks = [sources[i::GROUPS] for i in range(GROUPS)]
    with ThreadPoolExecutor(GROUPS) as ex:
        results = list(ex.map(lambda a: _compile(tmp_path, *a), enumerate(chunks)))
    for src, r in results:
        out = (r.stdout + r.stderr).strip()
        assert r.returncode == 0, f"nvcc failed on {src}:\n{out[-6000:]}"
        assert not out, f"nvcc printed diagnostics for {src}:\n{out[-6000:]}"


@pytest.mark.parametrize("bad", [
    lambda: ck.render_conv2d_forward("x y", N=1, C=1, H=3, W=3, O=1, KH=3, KW=3, bias=False, relu=False),
    lambda: ck.render_conv2d_forward("k", N=1, C=1, H=2, W=2, O=1, KH=3, KW=3, bias=False, relu=False),
    lambda: ck.render_conv2d_grad_weight("k", N=0, C=1, H=3, W=3, O=1, KH=3, KW=3, bias=False),
    lambda: ck.render_matmul("k", M=0, N=1, K=1, trans_a=False, trans_b=False),
])
def test_bad_arguments_raise(bad):
    with pytest.raises(ValueError):
        bad()


def test_split_k_used_where_outputs_are_few():
    gw = ck.render_conv2d_grad_weight("gw", N=64, C=16, H=26, W=26, O=32, KH=3, KW=3, bias=True)
    assert len(gw.launches) == 2 and gw.launches[0].grid[2] > 1 and gw.scratch_bytes > 0
    lw = ck.render_matmul("lw", M=64, N=10, K=18432, trans_a=False, trans_b=True, bias=True)
    assert len(lw.launches) == 2
    small = ck.render_matmul("s", M=64, N=30, K=10, trans_a=False, trans_b=False)
    assert len(small.launches) == 1 and small.scratch_bytes == 0


def test_runtime_ring_kernels_compile_after_a_step(tmp_path):
    """The runtime appends its scalar-output ring kernels (runtime/cuda.py) to every step's source
    before NVRTC compiles it: the two must compile together warning-free."""
    from ember.codegen.templates_env import environment
    from ember.runtime import cuda as runtime_cuda
    src = tmp_path / "ring.cu"
    src.write_text(environment("cuda").get_template("prelude.j2").render() + CASES[0][0].code
                   + runtime_cuda._RING_SOURCE)
    assert_compiles(NVCC, src)
