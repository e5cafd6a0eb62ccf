// A channels-innermost (NHWC) forward convolution for the CPU, standalone: the lab behind issue
// 21's "layouts where they pay" (docs/benchmarks.md, session 36). It packs each image into a
// zero-padded [row][column][channel] copy, lays the weights out as [tap][channel][output
// channel], and computes tiles of RB output positions of a row (TWO: two rows) x OV vectors of
// 16 output channels, summed over taps and input channels by broadcasting one input value a
// position against the weight vectors; a tile is staged and stored back to NCHW. Checked
// against a float64 loop; prints the error and the median of 50 timed calls.
//
//   g++ -O3 -march=native -fopenmp -ffp-contract=fast -DCC=32 -DHH=14 -DOO=64 -DSS=2 -DRB=7 -DOV=2 tools/cpu_layout_lab.cpp -o /tmp/layout_lab && OMP_NUM_THREADS=2 /tmp/layout_lab
//
// 16-lane GCC vectors: one AVX-512 register each where the CPU has them (timings are meant for
// such CPUs), register pairs elsewhere (-Wno-psabi). Exit status 1 when the result is wrong.
#include "cpu_layout_lab.h"

#ifndef RB
#define RB 7
#endif
#ifndef OV
#define OV 2
#endif
constexpr int HP = H + 2 * P, WP = W + 2 * P;
constexpr int ROWS = 2;  // rows a TWO tile covers
static_assert(O % (16 * OV) == 0, "output channels must fill OV vectors");

// ROWS_ rows x R positions x OV channel vectors; xp at the tile's first input position
template <int ROWS_, int R>
static inline void tile(const float* __restrict__ xp, const float* __restrict__ wp, float* __restrict__ stage) {
  vf acc[ROWS_][R][OV];
  for (int q = 0; q < ROWS_; q++)
    for (int r = 0; r < R; r++)
      for (int v = 0; v < OV; v++) acc[q][r][v] = vf{};
  for (int kh = 0; kh < K; kh++)
    for (int kw = 0; kw < K; kw++) {
      const float* xr = xp + (kh * WP + kw) * C;
      const float* wr = wp + (kh * K + kw) * C * O;
      for (int c = 0; c < C; c++) {
        vf wv[OV];
        for (int v = 0; v < OV; v++) {
          wv[v] = vload(wr + c * O + 16 * v);
          PIN(wv[v]);
        }
        for (int q = 0; q < ROWS_; q++)
          for (int r = 0; r < R; r++) {
            vf b = vbcast(xr[q * S * WP * C + r * S * C + c]);
            for (int v = 0; v < OV; v++) acc[q][r][v] += b * wv[v];
          }
      }
    }
  for (int q = 0; q < ROWS_; q++)
    for (int r = 0; r < R; r++)
      for (int v = 0; v < OV; v++) vstore(stage + (q * R + r) * O + 16 * v, acc[q][r][v]);
}

template <int ROWS_, int R>
static inline void tile_out(const float* xp, const float* wp, float* stage, float* yn, int ob, int oh, int ow) {
  tile<ROWS_, R>(xp + ((oh * S) * WP + ow * S) * C, wp + ob, stage);
  for (int q = 0; q < ROWS_; q++)
    for (int r = 0; r < R; r++)
      for (int o = 0; o < 16 * OV; o++) yn[((ob + o) * HO + oh + q) * WO + ow + r] = stage[(q * R + r) * O + o];
}

static void conv(const float* x, const float* w, float* y, float* wp, float* scratch) {
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int o = 0; o < O; o++)
      for (int c = 0; c < C; c++)
        for (int t = 0; t < K * K; t++) wp[(t * C + c) * O + o] = w[(o * C + c) * K * K + t];
    float* xp = scratch + omp_get_thread_num() * (HP * WP * C + ROWS * WO * O + 64);
    float* stage = xp + HP * WP * C;
#pragma omp for schedule(static)
    for (int n = 0; n < N; n++) {
      std::memset(xp, 0, sizeof(float) * HP * WP * C);
      const float* xn = x + (size_t)n * C * H * W;
      for (int c = 0; c < C; c++)
        for (int i = 0; i < H; i++)
          for (int j = 0; j < W; j++) xp[((i + P) * WP + j + P) * C + c] = xn[(c * H + i) * W + j];
      float* yn = y + (size_t)n * O * HO * WO;
      for (int ob = 0; ob < O; ob += 16 * OV)
        for (int oh = 0; oh < HO; oh++) {
#ifdef TWO
          if (oh + 1 < HO && WO == RB) {
            tile_out<ROWS, RB>(xp, wp, stage, yn, ob, oh, 0);
            oh++;
            continue;
          }
#endif
          int ow = 0;
          for (; ow + RB <= WO; ow += RB) tile_out<1, RB>(xp, wp, stage, yn, ob, oh, ow);
          for (; ow < WO; ow++) tile_out<1, 1>(xp, wp, stage, yn, ob, oh, ow);
        }
    }
  }
}

int main() {
  std::vector<float> x((size_t)N * C * H * W), w(O * C * K * K), y((size_t)N * O * HO * WO);
  fill_random(x, 1);
  fill_random(w, 2);
  std::vector<float> wp(K * K * C * O), scratch(omp_get_max_threads() * (HP * WP * C + ROWS * WO * O + 64));
  conv(x.data(), w.data(), y.data(), wp.data(), scratch.data());
  double err = 0;
  for (int n = 0; n < N; n++)
    for (int o = 0; o < O; o++)
      for (int i = 0; i < HO; i++)
        for (int j = 0; j < WO; j++) {
          double s = 0;
          for (int c = 0; c < C; c++)
            for (int kh = 0; kh < K; kh++)
              for (int kw = 0; kw < K; kw++) {
                int ih = i * S + kh - P, iw = j * S + kw - P;
                if (ih >= 0 && ih < H && iw >= 0 && iw < W)
                  s += (double)x[((n * C + c) * H + ih) * W + iw] * w[((o * C + c) * K + kh) * K + kw];
              }
          err = std::max(err, std::fabs(y[((n * O + o) * HO + i) * WO + j] - s));
        }
  double med = median_seconds([&] { conv(x.data(), w.data(), y.data(), wp.data(), scratch.data()); });
  std::printf("N%d C%d H%d O%d stride %d RB%d OV%d%s: max error %.2e, median %.1f us, %.1f GFLOP/s\n", N, C, H, O, S,
              RB, OV,
#ifdef TWO
              " two rows",
#else
              "",
#endif
              err, med * 1e6, FLOPS / med / 1e9);
  return err < 1e-4 * C * K * K ? 0 : 1;
}
