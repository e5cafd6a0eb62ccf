"""Programmatic dependent launch without a GPU: every kernel of a rendered step starts by waiting
for the grid before it (the runtime may launch it as that grid's dependent only because of it),
the step's source assembles to sm_90 code that has the wait, and the ctypes launch config the
runtime hands cuLaunchKernelEx has the layout of the CUDA headers' structs."""
from __future__ import annotations

import ctypes
import re
import subprocess
from pathlib import Path

import pytest

from ember.codegen import cuda
from ember.codegen.cuda_kernels import GRID_DEPENDENCY, with_grid_dependency
from ember.frontends.training.recipes import build_model
from ember.runtime import cuda_pdl
from models import plan_for, train_graph
from nvcc import nvcc_or_skip

_KERNEL = re.compile(r'extern "C" __global__ [^;{]*\)\s*\{')


@pytest.mark.parametrize("model,batch", [("cnn", 4), ("resnet8", 3)])
def test_every_kernel_of_a_step_waits_for_the_grid_before_it_first(model, batch):
    planned = plan_for(train_graph(build_model(model), (batch, 1, 28, 28)), "cuda", simplify=True)
    source = cuda.render_step(planned)
    launched = {la.function for la in source.launches}
    defined = set()
    for code, functions in source.units:
        for match in _KERNEL.finditer(code):
            assert code[match.end():].lstrip().startswith(GRID_DEPENDENCY), code[match.start():match.end() + 80]
        defined |= set(functions)
        assert len(_KERNEL.findall(code)) >= len(functions)
    assert launched <= defined | {f for f in launched if f.startswith(cuda.COLLECTIVE_PREFIX)}
    for code, _ in cuda.reused_variants(planned):
        assert all(code[m.end():].lstrip().startswith(GRID_DEPENDENCY) for m in _KERNEL.finditer(code))


def test_the_statement_goes_into_definitions_only():
    code = ('extern "C" __global__ void a(float* x);\n'
            'extern "C" __global__ void __launch_bounds__(128) b(const float* __restrict__ x, int n) {\n  x[0];\n}\n')
    out = with_grid_dependency(code)
    assert out.count(GRID_DEPENDENCY) == 1 and "int n) { " + GRID_DEPENDENCY in out


def test_the_step_assembles_to_the_grid_dependency_instructions(tmp_path):
    nvcc = nvcc_or_skip()
    planned = plan_for(train_graph(build_model("cnn"), (4, 1, 28, 28)), "cuda", simplify=True)
    source = cuda.render_step(planned)
    src = tmp_path / "step.cu"
    src.write_text(source.prelude + "\n".join(code for code, _ in source.units))
    ptx = tmp_path / "step.ptx"
    r = subprocess.run([nvcc, "-ptx", "-arch=sm_90", "-std=c++17", "-o", str(ptx), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    text = ptx.read_text()
    kernels = len(re.findall(r"^\.visible \.entry", text, re.M))
    assert kernels == len({f for _, fs in source.units for f in fs})
    assert text.count("griddepcontrol.wait") == kernels and text.count("griddepcontrol.launch_dependents") == kernels


def test_the_launch_config_has_the_cuda_headers_layout(tmp_path):
    nvcc = nvcc_or_skip()
    candidates = [Path(nvcc).resolve().parent.parent / "include", Path("/usr/local/cuda/include"),
                  *sorted(Path("/usr/local").glob("cuda-*/include"), reverse=True)]
    include = next((c for c in candidates if (c / "cuda.h").exists()), None)
    if include is None:
        pytest.skip(f"no CUDA toolkit headers beside {nvcc}")
    probe = tmp_path / "layout.cpp"
    probe.write_text('#include <cuda.h>\n#include <cstddef>\n#include <cstdio>\nint main() {\n'
                     '  printf("%zu %zu %zu %zu %zu %zu %d\\n", sizeof(CUlaunchConfig), offsetof(CUlaunchConfig, hStream),\n'
                     '         offsetof(CUlaunchConfig, attrs), offsetof(CUlaunchConfig, numAttrs), sizeof(CUlaunchAttribute),\n'
                     '         offsetof(CUlaunchAttribute, value), (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);\n}\n')
    exe = tmp_path / "layout"
    subprocess.run(["g++", "-I", str(include), "-o", str(exe), str(probe)], check=True, capture_output=True)
    want = [int(v) for v in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]
    config, attribute = cuda_pdl._LaunchConfig, cuda_pdl._Attribute
    assert want == [ctypes.sizeof(config), config.stream.offset, config.attrs.offset, config.num_attrs.offset,
                    ctypes.sizeof(attribute), attribute.value.offset, cuda_pdl._PROGRAMMATIC_STREAM_SERIALIZATION]


def test_dependent_launches_are_asked_for_and_only_on_hopper_and_later(monkeypatch):
    monkeypatch.setattr(cuda_pdl, "_load_driver", lambda: object())
    monkeypatch.delenv("EMBER_CUDA_PDL", raising=False)
    assert not cuda_pdl.enabled("sm_90")
    monkeypatch.setenv("EMBER_CUDA_PDL", "1")
    assert not cuda_pdl.enabled("sm_80") and cuda_pdl.enabled("sm_90") and cuda_pdl.enabled("sm_100")
