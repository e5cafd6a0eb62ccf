"""How a GPU's TF32 tensor cores round, and what three TF32 products ("3xTF32") cost a float32
dot product's accuracy (a lab, not a test; needs CuPy and an sm_80+ GPU).

    python tools/mma_rounding_lab.py                 # probes, then errors for K = 72 .. 50176
    python tools/mma_rounding_lab.py --ks 576 4096 --tiles 128

3xTF32 writes each float32 operand as big + small (big = x rounded to TF32, small = the rest
rounded to TF32) and sums small*big + big*small + big*big on the tensor cores, leaving out
small*small: a float32 product to about 2^-22 relative (docs/benchmarks.md, session 32, has the
NumPy model). Whether that keeps float32's accuracy depends on how `mma.sync` adds its products
to the accumulator: exactly then rounded to nearest, or truncated (as measured on earlier GPUs).

1. Probes: single mma.m16n8k8 calls whose exact result lies 0.25 / 0.5 / 0.75 of a float32 ulp
   above or below a float32, printed against round-to-nearest and toward zero.
2. Errors against float64 of C = A (16 x K) B (K x 8) over many tiles, relative to each sum's
   natural size (sqrt of the sum of squared products), for: float32 FMA in order (what ember's
   float32 kernels and cuDNN's FP32 paths do), 1xTF32, 3xTF32 accumulating in the mma's own
   accumulator, and 3xTF32 with each k-step's three mma into a zeroed fragment added to the
   running sum by a float32 add (round to nearest: a truncating accumulator then errs per step,
   not per running sum).
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

SOURCE = r"""
static __device__ __forceinline__ unsigned to_tf32(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}
static __device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// One warp a tile: A (tiles, 16, K) row-major, B (tiles, K, 8) row-major, C (tiles, 16, 8), C0 the
// accumulator's start. mode 0: 1xTF32; 1: 3xTF32 in the accumulator; 2: 3xTF32, each k-step into
// a zeroed fragment added by FADD; 3: float32 FMA in k order (one thread per output).
extern "C" __global__ void tile_dot(const float* A, const float* B, const float* C0, float* C, int K, int mode) {
  const int tile = blockIdx.x, lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  const float* a = A + (long long)tile * 16 * K;
  const float* b = B + (long long)tile * K * 8;
  const float* c0 = C0 + tile * 128;
  float* c = C + tile * 128;
  if (mode == 3) {
    for (int o = lane; o < 128; o += 32) {
      const int m = o / 8, n = o % 8;
      float acc = c0[o];
      for (int k = 0; k < K; ++k) acc = fmaf(a[m * K + k], b[k * 8 + n], acc);
      c[o] = acc;
    }
    return;
  }
  float acc[4] = {c0[g * 8 + 2 * t], c0[g * 8 + 2 * t + 1], c0[(g + 8) * 8 + 2 * t], c0[(g + 8) * 8 + 2 * t + 1]};
  for (int k0 = 0; k0 < K; k0 += 8) {
    const float av[4] = {a[g * K + k0 + t], a[(g + 8) * K + k0 + t], a[g * K + k0 + t + 4], a[(g + 8) * K + k0 + t + 4]};
    const float bv[2] = {b[(k0 + t) * 8 + g], b[(k0 + t + 4) * 8 + g]};
    unsigned ab[4], bb[2], as[4], bs[2];
    for (int i = 0; i < 4; ++i) { ab[i] = to_tf32(av[i]); as[i] = to_tf32(av[i] - __uint_as_float(ab[i])); }
    for (int i = 0; i < 2; ++i) { bb[i] = to_tf32(bv[i]); bs[i] = to_tf32(bv[i] - __uint_as_float(bb[i])); }
    if (mode == 0) {
      mma(acc, ab, bb);
    } else if (mode == 1) {
      mma(acc, as, bb); mma(acc, ab, bs); mma(acc, ab, bb);
    } else {
      float step[4] = {0.f, 0.f, 0.f, 0.f};
      mma(step, as, bb); mma(step, ab, bs); mma(step, ab, bb);
      for (int i = 0; i < 4; ++i) acc[i] += step[i];
    }
  }
  c[g * 8 + 2 * t] = acc[0]; c[g * 8 + 2 * t + 1] = acc[1];
  c[(g + 8) * 8 + 2 * t] = acc[2]; c[(g + 8) * 8 + 2 * t + 1] = acc[3];
}
"""

MODES = {0: "1xTF32", 1: "3xTF32, mma accumulates", 2: "3xTF32, FADD per k-step", 3: "float32 FMA in order"}


def run(cp, kernel, a: np.ndarray, b: np.ndarray, c0: np.ndarray, mode: int) -> np.ndarray:
    tiles, _, k = a.shape
    da, db, dc0 = cp.asarray(a), cp.asarray(b), cp.asarray(c0)
    out = cp.zeros((tiles, 16, 8), cp.float32)
    kernel((tiles,), (32,), (da, db, dc0, out, np.int32(k), np.int32(mode)))
    return cp.asnumpy(out)


def probes(cp, kernel) -> None:
    """C[0, 0] = c + 1.5 * 2^-24 * s (one product, the rest zero): 0.75 ulp of 1.0 for s = 1;
    and two products 1 + p with c = 0 (the alignment of products to one another)."""
    ulp = 2.0 ** -23
    print("probe: exact value / float32 nearest / toward zero / mma result (1xTF32)")
    for c, p in ((1.0, 0.75 * ulp), (1.0, 0.25 * ulp), (1.0, 0.5 * ulp), (1.0, -0.25 * ulp), (1.0, -0.75 * ulp),
                 (-1.0, 0.25 * ulp), (-1.0, -0.75 * ulp), (0.0, None)):
        a = np.zeros((1, 16, 8), np.float32)
        b = np.zeros((1, 8, 8), np.float32)
        c0 = np.zeros((1, 16, 8), np.float32)
        if p is None:  # two products 1.0 and 0.75 ulp, accumulator 0
            a[0, 0, 0], b[0, 0, 0], a[0, 0, 1], b[0, 1, 0] = 1.0, 1.0, 0.75 * ulp, 1.0
            exact = 1.0 + 0.75 * ulp
        else:
            c0[0, 0, 0], a[0, 0, 0], b[0, 0, 0] = c, p, 1.0
            exact = c + p
        got = float(run(cp, kernel, a, b, c0, 0)[0, 0, 0])
        rn = float(np.float32(exact))
        rz = float(np.nextafter(np.float32(exact), np.float32(0))) if abs(rn) > abs(exact) else rn
        what = "nearest" if got == rn and rn != rz else "toward zero" if got == rz and rn != rz else \
            "both agree" if rn == rz == got else "neither"
        print(f"  {exact!r:>24} {rn!r:>22} {rz!r:>22} {got!r:>22}  -> {what}")


def errors(cp, kernel, ks: list[int], tiles: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    print("relative error against float64 (each sum over its natural size): rms / max / mean")
    for k in ks:
        for dist in ("normal", "relu"):
            a = rng.standard_normal((tiles, 16, k)).astype(np.float32)
            b = rng.standard_normal((tiles, k, 8)).astype(np.float32)
            if dist == "relu":
                a = np.maximum(a, 0)
            c0 = np.zeros((tiles, 16, 8), np.float32)
            exact = np.einsum("tmk,tkn->tmn", a.astype(np.float64), b.astype(np.float64))
            scale = np.sqrt(np.einsum("tmk,tkn->tmn", a.astype(np.float64) ** 2, b.astype(np.float64) ** 2))
            for mode, name in MODES.items():
                err = (run(cp, kernel, a, b, c0, mode) - exact) / scale
                print(f"  K={k:6d} {dist:6s} {name:26s} {np.sqrt((err ** 2).mean()):.3e} / {np.abs(err).max():.3e} / "
                      f"{err.mean():+.2e}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ks", type=int, nargs="+", default=[72, 576, 2304, 12544, 50176],
                   help="dot-product lengths (multiples of 8)")
    p.add_argument("--tiles", type=int, default=64, help="16x8 output tiles per length (one warp each)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if any(k % 8 for k in args.ks):
        p.error("--ks must be multiples of 8 (the mma's k)")
    import cupy as cp
    kernel = cp.RawKernel(SOURCE, "tile_dot", options=("-std=c++17",))
    print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode())
    probes(cp, kernel)
    errors(cp, kernel, args.ks, args.tiles, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
