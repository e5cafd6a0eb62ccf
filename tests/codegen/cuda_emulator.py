"""Runs generated CUDA kernels on the CPU, for tests on a machine without a GPU: the kernel's own
source, compiled by g++ against a small emulation of what it uses of CUDA.

Each CUDA thread of a block is an OS thread (blocks run one after another); `__syncthreads` is a
barrier of the block; shared arrays live in an arena filled with NaN before every block (a read
of something the block did not stage shows); cp.async takes the templates' synchronous path
(`__CUDA_ARCH__` is undefined). The TF32 tensor-core helpers of `mma_tf32.j2` (and the bfloat16
one of `mma_bf16.j2`, m16n8k16) are replaced by an
emulation written from the PTX ISA's fragment tables ("Matrix Fragments for mma.m16n8k8", .tf32):
the 32 lanes of a warp publish their A, B and C registers, meet at a barrier of the warp, and each
computes its own four D elements (A and B truncated to TF32's 19 bits, as the hardware reads
them; sums in double). So a kernel whose fragment indexing, staging or epilogue is wrong gives
wrong numbers here, as it would on the GPU; what this cannot see is timing and the hardware's
rounding inside the mma (it adds in double).
"""
from __future__ import annotations

import ctypes
import re
import subprocess
from pathlib import Path

import numpy as np

from ember.codegen import cuda, cuda_choices
from ember.codegen.cuda_kernels import CudaKernel, counter_words, scratch_offset
from ember.codegen.templates_env import environment

#: bytes a static shared array may take (a block's static limit)
SLOT = 48 * 1024

HEADER = r"""
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

struct dim3 { unsigned x = 0, y = 0, z = 0; };
struct alignas(16) float4 { float x, y, z, w; };  // the GEMM skeleton's vector reads of shared memory
struct alignas(8) float2 { float x, y; };
struct alignas(8) uint2 { unsigned x, y; };  // four bfloat16 values in one access
struct alignas(16) uint4 { unsigned x, y, z, w; };  // a 16-byte copy (eight bfloat16 values)
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline float2 make_float2(float x, float y) { return float2{x, y}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
namespace ember_emu {
thread_local dim3 thread_idx, block_idx;
dim3 grid_dim;  // the launch's (a split reduction on run-time sizes reads its split count there)
std::barrier<>* block_barrier = nullptr;
std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
struct WarpTable { unsigned a[32][4]; unsigned b[32][2]; float c[32][4]; alignas(8) unsigned char shfl[32][8]; };
std::vector<WarpTable> tables;
std::vector<float> arena;  // a block's static shared arrays (SLOT bytes each), then its dynamic shared memory
inline float* shared_array(int slot) { return arena.data() + (size_t)slot * (SLOT / 4); }
// a barrier per (warp, mask) the kernel's shuffles name: the lanes of one output meet alone
std::vector<std::vector<std::pair<unsigned, std::unique_ptr<std::barrier<>>>>> mask_barriers;
std::mutex mask_lock;
inline void shfl_barrier(unsigned warp, unsigned mask) {
  std::barrier<>* b = nullptr;
  {
    std::lock_guard<std::mutex> hold(mask_lock);
    for (auto& [m, bar] : mask_barriers[warp]) if (m == mask) b = bar.get();
    if (!b) {
      mask_barriers[warp].emplace_back(mask, new std::barrier<>(__builtin_popcount(mask)));
      b = mask_barriers[warp].back().second.get();
    }
  }
  b->arrive_and_wait();
}
}  // namespace ember_emu
#define threadIdx ember_emu::thread_idx
#define blockIdx ember_emu::block_idx
#define gridDim ember_emu::grid_dim
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __builtin_assume(...) ((void)0)
#define __restrict__
#define __shared__ static
#define __align__(n) alignas(n)
inline void __syncthreads() { ember_emu::block_barrier->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xFFFFFFFFu) { ember_emu::warp_barriers[threadIdx.x / 32]->arrive_and_wait(); }
inline unsigned __float_as_uint(float x) { unsigned u; std::memcpy(&u, &x, 4); return u; }
inline float __uint_as_float(unsigned u) { float x; std::memcpy(&x, &u, 4); return x; }
inline float __int_as_float(int u) { float x; std::memcpy(&x, &u, 4); return x; }
// a split reduction's arrival counter (blocks run one after another here: any order a GPU could take)
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
template <typename T> T __ldcg(const T* p) { return *p; }
template <typename T> T __ldcs(const T* p) { return *p; }  // cache hints: plain loads here
template <typename T> T __ldg(const T* p) { return *p; }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
// A shuffle: every lane of `mask` publishes its value, meets the others at a barrier of those lanes
// (each lane's barrier below counts its mask's lanes), and reads lane `from(lane)`'s
template <typename T, typename From> T ember_shfl(unsigned mask, T v, From from) {
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  ember_emu::WarpTable& T_ = ember_emu::tables[warp];
  std::memcpy(T_.shfl[lane], &v, sizeof(T));
  ember_emu::shfl_barrier(warp, mask);
  T r;
  std::memcpy(&r, T_.shfl[from(lane) % 32], sizeof(T));
  ember_emu::shfl_barrier(warp, mask);  // every lane has read before any writes again
  return r;
}
template <typename T> T __shfl_xor_sync(unsigned mask, T v, int m) {
  return ember_shfl(mask, v, [m](unsigned lane) { return lane ^ (unsigned)m; });
}
// (ldmatrix's definition without a GPU reads other lanes' row addresses so)
template <typename T> T __shfl_sync(unsigned mask, T v, int src) {
  return ember_shfl(mask, v, [src](unsigned) { return (unsigned)src; });
}
using std::max;
using std::min;
// a launch's argument: the address of a float32 or bfloat16 (uint16 bits) buffer, as the kernel takes it
struct EmuPtr {
  void* p;
  template <typename T> operator T*() const { return static_cast<T*>(p); }
};
namespace ember_emu {
// One m16n8kK mma of a warp: the lanes publish their A, B and C registers, meet at a barrier of
// the warp, and each computes its own four D elements (row g + 8 (i / 2), column 2 t + i % 2, as
// the PTX tables give C and D for every shape) from A(row, k) and B(k, column), which
// `a_at(table, row, k)` and `b_at(table, k, column)` read out of the published registers as
// their fragment layout places them; sums in double.
template <int K, typename FA, typename FB>
inline void mma_warp(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2], FA a_at, FB b_at) {
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  WarpTable& T = tables[warp];
  for (int i = 0; i < 4; ++i) { T.a[lane][i] = a[i]; T.c[lane][i] = c[i]; }
  for (int i = 0; i < 2; ++i) T.b[lane][i] = b[i];
  warp_barriers[warp]->arrive_and_wait();
  const unsigned g = lane / 4, t = lane % 4;
  float d[4];
  for (int i = 0; i < 4; ++i) {
    const unsigned row = g + 8 * (i / 2), col = 2 * t + i % 2;
    double s = T.c[lane][i];
    for (unsigned k = 0; k < (unsigned)K; ++k) s += (double)a_at(T, row, k) * (double)b_at(T, k, col);
    d[i] = (float)s;
  }
  warp_barriers[warp]->arrive_and_wait();  // every lane has read the table
  for (int i = 0; i < 4; ++i) c[i] = d[i];
}
}  // namespace ember_emu
""".replace("SLOT", str(SLOT))

#: what replaces the text of mma_tf32.j2 in a kernel
MMA_EMULATION = r"""
// cvt.rna.tf32.f32: to nearest, ties away from zero (on the magnitude bits), 10 mantissa bits kept
static inline unsigned to_tf32(float x) {
  const unsigned u = __float_as_uint(x);
  if ((u & 0x7f800000u) == 0x7f800000u) return u;
  return (u + 0x1000u) & 0xffffe000u;
}
static inline float tf32_operand(unsigned u) { return __uint_as_float(u & 0xffffe000u); }
// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32, from the PTX ISA's fragment tables:
// lane = 4 g + t holds A (g + 8 (i % 2), t + 4 (i / 2)) in a[i], B (t + 4 i, g) in b[i],
// C and D (g + 8 (i / 2), 2 t + i % 2) in c[i]
static inline void mma_tf32(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  ember_emu::mma_warp<8>(c, a, b,
      [](const ember_emu::WarpTable& T, unsigned row, unsigned k) {
        return tf32_operand(T.a[4 * (row % 8) + k % 4][row / 8 + 2 * (k / 4)]); },
      [](const ember_emu::WarpTable& T, unsigned k, unsigned col) { return tf32_operand(T.b[4 * col + k % 4][k / 4]); });
}
"""

#: what replaces the text of mma_bf16.j2 in a kernel
MMA_BF16_EMULATION = r"""
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, from the PTX ISA's fragment tables: lane
// = 4 g + t holds A (g + 8 (i % 2), 2 t + 8 (i / 2) + h) in half h of a[i], B (2 t + 8 i + h, g)
// in half h of b[i] (the low half first), C and D as m16n8k8's; products exact, sums in double
static inline float bf16_half(unsigned u, unsigned h) { return __uint_as_float(h ? u & 0xFFFF0000u : u << 16); }
static inline void mma_bf16(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  ember_emu::mma_warp<16>(c, a, b,
      [](const ember_emu::WarpTable& T, unsigned row, unsigned k) {
        return bf16_half(T.a[4 * (row % 8) + (k % 8) / 2][row / 8 + 2 * (k / 8)], k % 2); },
      [](const ember_emu::WarpTable& T, unsigned k, unsigned col) {
        return bf16_half(T.b[4 * col + (k % 8) / 2][k / 8], k % 2); });
}
"""

#: what replaces the warpgroup-MMA helpers of wgmma_bf16.j2 (between its marker comments): each
#: thread of a warpgroup computes its own accumulators, as the fragment layout places them, from the
#: operand tiles in shared memory read through the descriptor's addressing (a row's 128 bytes, eight
#: rows 1024 bytes apart, the 16-byte chunk bits XOR the row bits of the address: the 128-byte
#: swizzle); synchronous, so fences, commits and waits are nothing; products exact, sums in double
WGMMA_EMULATION = r"""
static inline void wg_fence() {}
static inline void wg_commit() {}
template <int PENDING> static inline void wg_wait() {}
static inline void wg_proxy_fence() {}
template <int FN> static inline void wg_pin(float (&)[FN][4]) {}
// element (mn, k) of an operand whose descriptor starts at `start`: K-major (`atoms` 0) a 128-byte row
// an mn, eight rows a 1024-byte group; MN-major a 128-byte row of 64 mn a k, eight k a 1024-byte
// group, atoms of 64 mn `atoms` bytes apart; the 16-byte chunk bits XOR the row bits of the address
static inline float wg_operand(const void* start, unsigned mn, unsigned k, unsigned atoms) {
  unsigned long long at = (unsigned long long)start;
  at += atoms ? (mn / 64) * atoms + (k / 8) * 1024 + (k % 8) * 128 + 2 * (mn % 64)
              : (mn / 8) * 1024 + (mn % 8) * 128 + 2 * k;
  at ^= ((at >> 7) & 7) << 4;
  unsigned short v;
  std::memcpy(&v, (const void*)at, 2);
  return __uint_as_float((unsigned)v << 16);
}
template <int FN>
static inline void wg_mma_mn(float (&d)[FN][4], const void* a, const void* b, unsigned a_atoms, unsigned b_atoms) {
  const unsigned t128 = threadIdx.x % 128, w = t128 / 32, lane = t128 % 32, g = lane / 4, t = lane % 4;
  for (int j = 0; j < FN; ++j)
    for (int r = 0; r < 4; ++r) {
      const unsigned row = 16 * w + g + 8 * (r / 2), col = 8 * j + 2 * t + r % 2;
      double s = d[j][r];
      for (unsigned k = 0; k < 16; ++k)
        s += (double)wg_operand(a, row, k, a_atoms) * (double)wg_operand(b, col, k, b_atoms);
      d[j][r] = (float)s;
    }
}
template <int FN>
static inline void wg_mma(float (&d)[FN][4], const void* a, const void* b) { wg_mma_mn(d, a, b, 0u, 0u); }
"""

RUNNER = r"""
namespace ember_emu {
// One OS thread per CUDA thread of a block, kept for every block of the launch (blocks one after
// another, the shared arena poisoned with NaN before each).
template <typename F>
void run_grid(F body, int gx, int gy, int gz, int threads, int static_slots, size_t dyn_bytes) {
  arena.assign((size_t)static_slots * (SLOT / 4) + dyn_bytes / 4 + 1, NAN);
  grid_dim = dim3{(unsigned)gx, (unsigned)gy, (unsigned)gz};
  std::barrier<> bb(threads);
  block_barrier = &bb;
  const int warps = (threads + 31) / 32;
  warp_barriers.clear();
  for (int w = 0; w < warps; ++w) warp_barriers.emplace_back(new std::barrier<>(32));
  tables.assign(warps, WarpTable{});
  mask_barriers.clear();
  mask_barriers.resize(warps);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([=, &bb] {
      thread_idx = dim3{(unsigned)t, 0, 0};
      for (int z = 0; z < gz; ++z)
        for (int y = 0; y < gy; ++y)
          for (int x = 0; x < gx; ++x) {
            if (t == 0) std::fill(arena.begin(), arena.end(), NAN);
            block_idx = dim3{(unsigned)x, (unsigned)y, (unsigned)z};
            bb.arrive_and_wait();  // the arena is poisoned before any thread of the block starts
            body();
            bb.arrive_and_wait();  // every thread is done with the block
          }
    });
  for (auto& th : pool) th.join();
}
}  // namespace ember_emu
""".replace("SLOT", str(SLOT))


def _mma_text(template: str = "mma_tf32.j2") -> str:
    return environment("cuda").get_template(template).render()


def _emulated(kernel: CudaKernel, index: int) -> str:
    """A kernel's source with its TF32 helpers and shared arrays emulated, and its entry
    `emu_launch_<index>(launch, pointers)`."""
    code = kernel.code
    for template, emulation in (("mma_tf32.j2", MMA_EMULATION), ("mma_bf16.j2", MMA_BF16_EMULATION)):
        mma = _mma_text(template)
        if mma in code:
            code = code.replace(mma, emulation)
    code = re.sub(r"// ember:wgmma begin\n.*?// ember:wgmma end\n", lambda m: WGMMA_EMULATION, code, flags=re.S)
    slots = 0

    def to_arena(m: re.Match) -> str:  # `float xs[..]` or `unsigned xs[..]` (bfloat16 pairs)
        nonlocal slots
        slots += 1
        return f"{m.group(1)}* {m.group(2)} = reinterpret_cast<{m.group(1)}*>(ember_emu::shared_array({slots - 1}));"

    def to_arena_2d(m: re.Match) -> str:  # a tile `float As[BK][SA]` (or more axes): a reference to an array in the arena
        nonlocal slots
        slots += 1
        return f"auto& {m.group(2)} = *reinterpret_cast<{m.group(1)}(*){m.group(3)}>(ember_emu::shared_array({slots - 1}));"

    code = re.sub(r"__shared__ __align__\(16\) (float|unsigned) (\w+)\[[^\]]+\];", to_arena, code)
    code = re.sub(r"__shared__ __align__\(16\) (float|unsigned) (\w+)((?:\[[^\]]+\]){2,});", to_arena_2d, code)
    # namespace-scope tables (`static __shared__ int koff_[K]`): one static array, which every
    # block (run one after another) fills in its prologue before reading
    code = code.replace("static __shared__ ", "static ")
    code = code.replace("extern __shared__ __align__(16) float smem[];",
                        f"float* smem = ember_emu::shared_array({slots});")
    calls = []
    for i, ln in enumerate(kernel.launches):
        # by-value arguments (a generated kernel's run-time extent) are the launch's own: written in
        args = ", ".join([f"EmuPtr{{a[{j}]}}" for j in range(len(ln.args))]
                         + [f"({ctype}){value}" for ctype, value in ln.scalars])
        (bx, by, bz), (gx, gy, gz) = ln.block, ln.grid
        assert by == bz == 1 and bx % 32 == 0, ln
        calls.append(f"  if (launch == {i}) ember_emu::run_grid([=] {{ {ln.function}({args}); }}, {gx}, {gy}, {gz}, "
                     f"{bx}, {slots}, {ln.shared_bytes});")
    return (code + f'extern "C" void emu_launch_{index}(int launch, void** a) {{\n' + "\n".join(calls) + "\n}\n")


def build(kernels: list[CudaKernel], folder: Path, name: str) -> ctypes.CDLL:
    """The kernels' sources with the emulation, compiled into one shared library in `folder`."""
    src, lib = folder / f"{name}.cpp", folder / f"{name}.so"
    # the CUDA prelude's helpers (em_sqrt, em_max, ...), which the generated kinds' bodies call
    src.write_text(HEADER + cuda.prelude(bf16=True) + RUNNER + "".join(_emulated(k, i) for i, k in enumerate(kernels)))
    r = subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", "-Wno-unknown-pragmas",
                        "-o", str(lib), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, f"g++ failed on {src}:\n{r.stderr[-4000:]}"
    return ctypes.CDLL(str(lib))


def run(lib: ctypes.CDLL, index: int, kernel: CudaKernel, buffers: dict[str, np.ndarray]) -> None:
    """Makes the launches of kernel `index` of the library in order on `buffers` (float32 arrays,
    or uint16 ones holding bfloat16 bits, by role, written in place; "scratch" is added, filled
    with NaN, unless given; a counters role (`counter_role`) is zeros of its size unless `buffers` has it, as
    uint32: a caller that passes its own sees what the launches left there)."""
    bufs = dict(buffers)
    if "scratch" not in bufs:  # a caller's own (float32 words) shows what the launches left there
        bufs["scratch"] = np.full(max(kernel.scratch_bytes // 4, 1), np.nan, np.float32)
    for ln in kernel.launches:
        for r in ln.args:
            if (words := counter_words(r)) is not None and r not in bufs:
                bufs[r] = np.zeros(words, np.uint32)
    entry = getattr(lib, f"emu_launch_{index}")
    for i, ln in enumerate(kernel.launches):
        arrays = [bufs[r] if scratch_offset(r) is None else bufs["scratch"][scratch_offset(r) // 4:] for r in ln.args]
        assert all(a.dtype in (np.float32, np.uint16) or (a.dtype == np.uint32 and counter_words(r) is not None)
                   for a, r in zip(arrays, ln.args)) and all(a.flags.c_contiguous for a in arrays)
        ptrs = (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])
        entry(ctypes.c_int(i), ptrs)


def only_kernel(planned, kind: str, choice=None) -> tuple:
    """(subgraph, kernel) of the one kernel of `kind` of a graph planned for CUDA, the kernel as the
    step renders it with `choice` (default its own; roles in0.. out.., then scratch where it
    splits), on the active device."""
    (node,) = [n for n in planned.g if planned.op(n) == "fused" and planned.attrs(n)["kernel"].kind == kind]
    sub, spec = planned.attrs(node)["graph"], planned.attrs(node)["kernel"]
    return sub, cuda_choices.render(sub.name, sub, spec, choice or spec.choice or cuda_choices.choose(sub, spec))


def only_reduction(planned) -> tuple:
    return only_kernel(planned, "reduction")


def check_against_interpreter(sub, kernel: CudaKernel, inputs: dict[str, np.ndarray], folder: Path, name: str,
                              rtol: float, atol: float, roles: dict[str, str] | None = None) -> None:
    """Runs a generated kernel of `sub` on `inputs` (floats; a bfloat16 input's rounded, the
    kernel given its bits) in the emulation and compares every output with the interpreter's (a
    bfloat16 output as its values). `roles`: the kernel's roles -> the subgraph's input and output
    names (`cuda.render_contraction`'s); by default they are those names (in0.., out..)."""
    from ember.ir import run as interpret
    from ember.ir.dtypes import bf16_bits, bf16_values
    want = interpret(sub, inputs).outputs
    narrow = {k for k, n in [*sub.inputs.items(), *sub.outputs.items()] if sub.type(n).dtype.name == "bfloat16"}
    by_name = {k: bf16_bits(v) if k in narrow else v for k, v in inputs.items()}
    by_name.update({k: np.full(v.shape, 0x7FC0, np.uint16) if k in narrow else np.full(v.shape, np.nan, np.float32)
                    for k, v in want.items()})
    roles = roles or {k: k for k in by_name}
    run(build([kernel], folder, name), 0, kernel, {role: by_name[k] for role, k in roles.items() if k in by_name})
    for k, v in want.items():
        got = bf16_values(by_name[k]) if k in narrow else by_name[k]
        np.testing.assert_allclose(got, v, rtol=rtol, atol=atol, err_msg=k)


def tf32(a: np.ndarray) -> np.ndarray:
    """cvt.rna.tf32.f32 in NumPy (finite values): the float32 values rounded to 10 mantissa bits."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return ((u + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)
