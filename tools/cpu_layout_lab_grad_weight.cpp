// A channels-innermost (NHWC) convolution grad-weight for the CPU, standalone: the second lab
// behind issue 21's "layouts where they pay" (docs/benchmarks.md, session 36; the forward is
// tools/cpu_layout_lab.cpp). Per block of IB images it packs x into zero-padded
// [row][column][channel] copies and dy into [position][output channel]; a tile of CB input
// channels x OV vectors of 16 output channels of one tap sums x (broadcast) times dy (vectors)
// over the block's positions, into a per-thread partial that the end sums in thread order.
// Checked against a float64 loop; prints the error and the median of 50 timed calls.
//
//   g++ -O3 -march=native -fopenmp -ffp-contract=fast -DCC=32 -DHH=14 -DOO=64 -DSS=2 -DCB=6 -DOV=4 -DIB=8 tools/cpu_layout_lab_grad_weight.cpp -o /tmp/layout_lab_gw && OMP_NUM_THREADS=2 /tmp/layout_lab_gw
//
// 16-lane GCC vectors (AVX-512 registers where the CPU has them, register pairs elsewhere:
// -Wno-psabi). Exit status 1 when the result is wrong.
#include "cpu_layout_lab.h"

#ifndef CB
#define CB 6
#endif
#ifndef OV
#define OV 4
#endif
#ifndef IB
#define IB 4
#endif
constexpr int Q = HO * WO;
constexpr int HP = H + 2 * P + S, WP = W + 2 * P + S;
static_assert(O % (16 * OV) == 0, "");

// acc[c][v] over positions of IB images: xs = packed x (IB images, [row][col][C]), ds = dy^T (IB images, [q][O])
template <int CB_>
static inline void tile(const float* __restrict__ xs, const float* __restrict__ ds, float* __restrict__ dw, int tap, int c0, int o0) {
  const int kh = tap / K, kw = tap % K;
  vf acc[CB_][OV];
  for (int c = 0; c < CB_; c++) for (int v = 0; v < OV; v++) acc[c][v] = vload(dw + ((tap * C) + c0 + c) * O + o0 + 16 * v);
  for (int i = 0; i < IB; i++) {
    const float* xi = xs + (size_t)i * HP * WP * C + (kh * WP + kw) * C + c0;
    const float* di = ds + (size_t)i * Q * O + o0;
    for (int oh = 0; oh < HO; oh++)
      for (int ow = 0; ow < WO; ow++) {
        const float* xq = xi + ((oh * S) * WP + ow * S) * C;
        const float* dq = di + (oh * WO + ow) * O;
        vf d[OV];
        for (int v = 0; v < OV; v++) { d[v] = vload(dq + 16 * v); PIN(d[v]); }
        for (int c = 0; c < CB_; c++) { vf b = vbcast(xq[c]); for (int v = 0; v < OV; v++) acc[c][v] += b * d[v]; }
      }
  }
  for (int c = 0; c < CB_; c++) for (int v = 0; v < OV; v++) vstore(dw + ((tap * C) + c0 + c) * O + o0 + 16 * v, acc[c][v]);
}

void gw(const float* x, const float* dy, float* dw, float* scratch, float* partial) {
  const int T = omp_get_max_threads();
#pragma omp parallel
  {
    const int t = omp_get_thread_num();
    float* xs = scratch + (size_t)t * IB * (HP * WP * C + Q * O);
    float* ds = xs + (size_t)IB * HP * WP * C;
    float* mine = partial + (size_t)t * K * K * C * O;  // [tap][c][o]
    std::memset(mine, 0, sizeof(float) * K * K * C * O);
    // images split into contiguous chunks: a fixed order a thread
    const int per = (N + T - 1) / T, n0 = t * per, n1 = std::min(N, n0 + per);
    for (int nb = n0; nb < n1; nb += IB) {
      const int ib = std::min(IB, n1 - nb);
      std::memset(xs, 0, sizeof(float) * IB * HP * WP * C);
      std::memset(ds, 0, sizeof(float) * IB * Q * O);
      for (int i = 0; i < ib; i++) {
        const float* xn = x + (size_t)(nb + i) * C * H * W;
        float* xi = xs + (size_t)i * HP * WP * C;
        for (int c = 0; c < C; c++) for (int h = 0; h < H; h++) for (int w = 0; w < W; w++) xi[((h + P) * WP + w + P) * C + c] = xn[(c * H + h) * W + w];
        const float* dn = dy + (size_t)(nb + i) * O * Q;
        float* di = ds + (size_t)i * Q * O;
        for (int o = 0; o < O; o++) for (int q = 0; q < Q; q++) di[q * O + o] = dn[o * Q + q];
      }
      for (int tap = 0; tap < K * K; tap++)
        for (int o0 = 0; o0 < O; o0 += 16 * OV) {
          int c0 = 0;
          for (; c0 + CB <= C; c0 += CB) tile<CB>(xs, ds, mine, tap, c0, o0);
          for (; c0 < C; c0++) tile<1>(xs, ds, mine, tap, c0, o0);
        }
    }
#pragma omp barrier
#pragma omp for schedule(static)
    for (int o = 0; o < O; o++)
      for (int c = 0; c < C; c++)
        for (int tap = 0; tap < K * K; tap++) {
          float s = 0;
          for (int u = 0; u < T; u++) s += partial[(size_t)u * K * K * C * O + (tap * C + c) * O + o];
          dw[(o * C + c) * K * K + tap] = s;
        }
  }
}

int main() {
  std::vector<float> x((size_t)N * C * H * W), dy((size_t)N * O * Q), dw(O * C * K * K);
  fill_random(x, 1);
  fill_random(dy, 2);
  const int T = omp_get_max_threads();
  std::vector<float> scratch((size_t)T * IB * (HP * WP * C + Q * O)), partial((size_t)T * K * K * C * O);
  gw(x.data(), dy.data(), dw.data(), scratch.data(), partial.data());
  double err = 0;
  for (int o = 0; o < O; o++) for (int c = 0; c < C; c++) for (int kh = 0; kh < K; kh++) for (int kw = 0; kw < K; kw++) {
    double s = 0;
    for (int n = 0; n < N; n++) for (int i = 0; i < HO; i++) for (int j = 0; j < WO; j++) {
      int ih = i * S + kh - P, iw = j * S + kw - P;
      if (ih >= 0 && ih < H && iw >= 0 && iw < W) s += (double)dy[((size_t)(n * O + o) * HO + i) * WO + j] * x[((size_t)(n * C + c) * H + ih) * W + iw];
    }
    err = std::max(err, std::fabs(dw[((o * C + c) * K + kh) * K + kw] - s));
  }
  double med = median_seconds([&] { gw(x.data(), dy.data(), dw.data(), scratch.data(), partial.data()); });
  printf("grad-weight N%d C%d H%d O%d stride %d CB%d OV%d IB%d: max error %.2e, median %.1f us, %.1f GFLOP/s\n", N, C, H, O, S, CB, OV, IB, err, med * 1e6, FLOPS / med / 1e9);
  return err < 1e-4 * C * K * K ? 0 : 1;
}
