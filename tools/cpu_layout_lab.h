// What the two channels-innermost convolution labs share (tools/cpu_layout_lab.cpp, the forward;
// tools/cpu_layout_lab_grad_weight.cpp): 16-lane GCC vectors, the convolution's sizes (-D to
// change them: NN images, CC input and OO output channels, HH x HH planes, stride SS, 3x3 window,
// padding 1), random operands and the median of timed calls.
#pragma once
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <omp.h>

typedef float vf __attribute__((vector_size(64)));
typedef float vfu __attribute__((vector_size(64), aligned(4), may_alias));
static inline vf vload(const float* p) { return *reinterpret_cast<const vfu*>(p); }
static inline void vstore(float* p, vf v) { *reinterpret_cast<vfu*>(p) = v; }
static inline vf vbcast(float s) { return vf{s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }
#ifdef __AVX512F__
#define PIN(v) __asm__("" : "+v"(v))  // keep loaded values in registers (as ember's kernels do)
#else
#define PIN(v) ((void)0)  // a 16-lane vector is a register pair (or more) here: no one register to pin
#endif

#ifndef NN
#define NN 64
#endif
#ifndef CC
#define CC 32
#endif
#ifndef HH
#define HH 14
#endif
#ifndef OO
#define OO 64
#endif
#ifndef SS
#define SS 2
#endif
constexpr int N = NN, C = CC, H = HH, W = HH, O = OO, K = 3, S = SS, P = 1;
constexpr int HO = (H + 2 * P - K) / S + 1, WO = (W + 2 * P - K) / S + 1;
constexpr double FLOPS = 2.0 * N * O * C * K * K * HO * WO;

// uniform in [-0.5, 0.5), the same values on every run
static inline void fill_random(std::vector<float>& v, unsigned seed) {
  srand(seed);
  for (auto& e : v) e = rand() / (float)RAND_MAX - 0.5f;
}

// seconds, the median of `calls` timed calls of f
template <class F>
static double median_seconds(F f, int calls = 50) {
  std::vector<double> ts;
  for (int it = 0; it < calls; it++) {
    auto t0 = std::chrono::steady_clock::now();
    f();
    ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}
