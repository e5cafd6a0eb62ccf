"""The C++ and CUDA spellings of random_uniform (each target's philox.j2) give ir/philox.py's bits
at steps past 2**28 and 2**32, where a step truncated to fewer bits would repeat earlier masks.
Both are compiled for the host by g++ (the CUDA copy with __device__ dropped and __umulhi written
out), so the CUDA one is checked without a GPU."""
from __future__ import annotations

import ctypes
import subprocess

import numpy as np

from ember.codegen.templates_env import environment
from ember.ir import philox

STEPS = [0, 2**28 - 1, 2**28 + 3, 2**31 + 1, 2**32 + 5, 2**40 + 2**28 + 9]
SEED, STREAM, N = 0xDEADBEEF, 6, 37

_CUDA_ON_HOST = """#define __device__
#define __forceinline__ inline
static inline unsigned int __umulhi(unsigned int a, unsigned int b) {
  return static_cast<unsigned int>((static_cast<unsigned long long>(a) * b) >> 32);
}
"""


def test_cpp_and_cuda_philox_match_the_interpreter_at_large_steps(tmp_path):
    src = tmp_path / "philox.cpp"
    src.write_text("\n".join([
        "#include <cstdint>",
        "namespace cpp {", environment("cpp").get_template("philox.j2").render(), "}",
        "namespace cu {", _CUDA_ON_HOST, environment("cuda").get_template("philox.j2").render(), "}",
        'extern "C" void draw(int which, uint32_t seed, uint32_t stream, uint64_t step, int n, float* out) {',
        "  for (int i = 0; i < n; ++i)",
        "    out[i] = which ? cu::em_philox_uniform(seed, stream, step, i) : cpp::em_philox_uniform(seed, stream, step, i);",
        "}"]))
    lib = tmp_path / "philox.so"
    subprocess.run(["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    draw = ctypes.CDLL(str(lib)).draw
    draw.argtypes = [ctypes.c_int, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int, ctypes.c_void_p]
    for step in STEPS:
        want = philox.uniform((N,), SEED, step, STREAM)
        for which, target in enumerate(("cpp", "cuda")):
            out = np.empty(N, np.float32)
            draw(which, SEED, STREAM, step, N, out.ctypes.data)
            np.testing.assert_array_equal(out, want, err_msg=f"{target} at step {step}")
