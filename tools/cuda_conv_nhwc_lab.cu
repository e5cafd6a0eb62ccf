// A laboratory kernel, not part of ember: a bfloat16 3x3 convolution as an implicit GEMM over
// channels-innermost operands, the shape that lets every stage of a tensor-core GEMM run at its
// rate (tools/cuda_conv_nhwc_lab.py builds it through NVRTC, checks it against PyTorch and times it
// beside cuDNN; ember's own kernels: tools/kernel_times.py). ember's bf16 convolutions gather NCHW operands a
// bfloat16 at a time into registers (one shared buffer, 32-bit fragment reads) and reach about
// 100 TFLOP/s on airbench's layers; here:
//   * x is first copied to a zero-bordered NHWC image, the weights to [o][kh][kw][c], so a GEMM
//     row (an output pixel) reads its k = (kh, kw, c) as runs of C channels: 16-byte cp.async
//     copies with no bounds checks (the border is the padding), STAGES deep;
//   * shared tiles are [row][BK] with an XOR swizzle of their 16-byte chunks, read by ldmatrix
//     (four 8x8 matrices a warp instruction) straight into mma.m16n8k16 fragments;
//   * each warp owns a (FM x 16) x (FN x 8) piece of the BM x BN block tile; fp32 accumulation,
//     the result rounded to bfloat16 and stored NCHW (what ember's bf16 buffers hold).
// The stride-1 grad-input is the same kernel on dy (weights_flipped); with -DSPLITS=S the file
// holds the weight gradient instead (conv_nhwc_grad_weight, below).
// Compile-time sizes come from -D options: N_ C_ H_ W_ O_ KH_ KW_ P_ (padding, both sides), S_
// (stride), BM BN WM WN (warps along M and N) STAGES. Needs C_ and O_ % 8 == 0 (16-byte runs).
typedef unsigned short bf16_t;

#define HP (H_ + 2 * P_)
#define WP (W_ + 2 * P_)
#define HO ((HP - KH_) / S_ + 1)
#define WO ((WP - KW_) / S_ + 1)
#define HWO (HO * WO)
#define KDIM (KH_ * KW_ * C_)
#define MDIM (N_ * HWO)
#define BK 32
#define THREADS (WM * WN * 32)
#define FM (BM / WM / 16)
#define FN (BN / WN / 8)
#define CHUNKS (BK / 8)  // 16-byte chunks in a tile row

static_assert(C_ % 8 == 0 && O_ % 8 == 0, "channel runs of 16 bytes");
static_assert(FM >= 1 && FN >= 2 && FN % 2 == 0 && FM * 16 * WM == BM && FN * 8 * WN == BN, "warp tiling");

// x (N, C, H, W) -> xp (N, HP, WP, C), zero outside the image; a block writes one padded row.
extern "C" __global__ void __launch_bounds__(256) to_padded_nhwc(const bf16_t* __restrict__ x, bf16_t* __restrict__ xp) {
  __shared__ bf16_t row[W_][C_ + 2];  // + 2: the transposed reads step by an odd number of words
  const int n = blockIdx.x / HP, hp = blockIdx.x % HP, h = hp - P_;
  bf16_t* dst = xp + ((long long)n * HP + hp) * WP * C_;
  if (h < 0 || h >= H_) {
    for (int i = threadIdx.x; i < WP * C_; i += blockDim.x) dst[i] = 0;
    return;
  }
  for (int i = threadIdx.x; i < C_ * W_; i += blockDim.x) {
    const int c = i / W_, w = i % W_;
    row[w][c] = x[(((long long)n * C_ + c) * H_ + h) * W_ + w];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < WP * C_; i += blockDim.x) {
    const int w = i / C_ - P_, c = i % C_;
    dst[i] = (w >= 0 && w < W_) ? row[w][c] : (bf16_t)0;
  }
}

// w (O, C, KH, KW) -> wt (O, KH, KW, C): k = (kh, kw, c), channels innermost as in xp.
extern "C" __global__ void __launch_bounds__(256) weights_okkc(const bf16_t* __restrict__ w, bf16_t* __restrict__ wt) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= O_ * KDIM) return;
  const int o = i / KDIM, k = i % KDIM, tap = k / C_, c = k % C_;
  wt[i] = w[(o * C_ + c) * (KH_ * KW_) + tap];
}

// The stride-1 grad-input is this forward convolution of dy (C_ = the layer's O, O_ = its C,
// P_ = KH - 1 - its padding) with the layer's weights w (its O, its C, KH, KW) flipped and
// transposed: wt[c][kh][kw][o] = w[o][c][KH - 1 - kh][KW - 1 - kw], in the sizes of this build.
extern "C" __global__ void __launch_bounds__(256) weights_flipped(const bf16_t* __restrict__ w, bf16_t* __restrict__ wt) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= O_ * KDIM) return;
  const int c = i / KDIM, k = i % KDIM, tap = k / C_, o = k % C_, kh = tap / KW_, kw = tap % KW_;
  wt[i] = w[((o * O_ + c) * KH_ + KH_ - 1 - kh) * KW_ + KW_ - 1 - kw];
}

static __device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

static __device__ __forceinline__ void cp16(unsigned dst, const void* src, bool live) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(live ? 16 : 0));
}

static __device__ __forceinline__ void mma16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// acc = the products of k-tiles kt0 .. kt1 - 1, through a STAGES-deep cp.async pipeline: load(stage,
// kt) issues k-tile kt's copies into a stage, frags(stage, kk, af, bfr) reads the fragments of its
// kk-th 16-wide step (the forward and the weight gradient differ only in these two).
template <class Load, class Frags>
static __device__ __forceinline__ void gemm_pipeline(int kt0, int kt1, const Load& load, const Frags& frags,
                                                     float (&acc)[FM][FN][4]) {
#pragma unroll
  for (int i = 0; i < FM; ++i)
#pragma unroll
    for (int j = 0; j < FN; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.f;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (kt0 + s < kt1) load(s, kt0 + s);
    asm volatile("cp.async.commit_group;\n" ::);
  }
  for (int kt = kt0; kt < kt1; ++kt) {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(STAGES - 2));
    __syncthreads();  // the stage computed last is free, this one's copies visible to every thread
    const int next = kt + STAGES - 1;
    if (next < kt1) load((next - kt0) % STAGES, next);
    asm volatile("cp.async.commit_group;\n" ::);
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      unsigned af[FM][4], bfr[FN][2];
      frags((kt - kt0) % STAGES, kk, af, bfr);
#pragma unroll
      for (int i = 0; i < FM; ++i)
#pragma unroll
        for (int j = 0; j < FN; ++j) mma16816(acc[i][j], af[i], bfr[j][0], bfr[j][1]);
    }
  }
  asm volatile("cp.async.wait_group 0;\n" ::);
}

#ifndef SPLITS
static_assert((BM * CHUNKS) % THREADS == 0 && (BN * CHUNKS) % THREADS == 0, "whole chunks a thread");

// byte offset of 16-byte chunk `c` of tile row `r` (rows of BK bfloat16 = 64 bytes): the chunk
// index XOR (r / 2) % 4, so the 8 rows an ldmatrix matrix reads at one chunk hit 8 distinct
// 16-byte bank groups (two 64-byte rows share a 128-byte line)
static __device__ __forceinline__ int swz(int r, int c) { return r * (BK * 2) + ((c ^ ((r >> 1) & 3)) << 4); }

static __device__ __forceinline__ void ldsm_x4(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

static __device__ __forceinline__ bf16_t to_bf16(float f) {  // round to nearest even (finite values)
  const unsigned u = __float_as_uint(f);
  return (bf16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// out (N, O, HO, WO) = conv(x, w), from xp and wt. grid (M tiles, N tiles); dynamic shared memory
// STAGES x (BM + BN) x BK bfloat16.
extern "C" __global__ void __launch_bounds__(THREADS) conv_nhwc(const bf16_t* __restrict__ xp, const bf16_t* __restrict__ wt,
                                                               bf16_t* __restrict__ out) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
  const unsigned sbase = smem_addr(smem);
  enum { A_BYTES = BM * BK * 2, STAGE_BYTES = (BM + BN) * BK * 2 };

  // This thread's copies: A rows (output pixels) and B rows (output channels), CHUNKS a row.
  enum { A_PER = BM * CHUNKS / THREADS, B_PER = BN * CHUNKS / THREADS };
  long long a_src[A_PER];  // element offset of the pixel's window corner in xp
  bool a_live[A_PER];
  int a_dst[A_PER], a_chunk[A_PER];
#pragma unroll
  for (int i = 0; i < A_PER; ++i) {
    const int idx = tid + i * THREADS, r = idx / CHUNKS, c = idx % CHUNKS;
    const int m = m0 + r;
    a_live[i] = m < MDIM;
    const int mm = a_live[i] ? m : 0;
    const int img = mm / HWO, pix = mm % HWO, ho = pix / WO, wo = pix % WO;
    a_src[i] = (((long long)img * HP + ho * S_) * WP + wo * S_) * C_;
    a_dst[i] = swz(r, c);
    a_chunk[i] = c;
  }
  int b_src[B_PER], b_dst[B_PER], b_chunk[B_PER];
  bool b_live[B_PER];
#pragma unroll
  for (int i = 0; i < B_PER; ++i) {
    const int idx = tid + i * THREADS, r = idx / CHUNKS, c = idx % CHUNKS;
    b_live[i] = n0 + r < O_;
    b_src[i] = (b_live[i] ? n0 + r : 0) * KDIM + c * 8;
    b_dst[i] = swz(r, c);
    b_chunk[i] = c;
  }

  auto load_stage = [&](int stage, int kt) {
    const unsigned sa = sbase + stage * STAGE_BYTES, sb = sa + A_BYTES;
    // a copy that is not live reads nothing (src-size 0) but still names a valid address
#pragma unroll
    for (int i = 0; i < A_PER; ++i) {
      const int k = kt * BK + a_chunk[i] * 8, tap = k / C_, c = k % C_;
      const int kh = tap / KW_, kw = tap % KW_;
      const bool live = a_live[i] && k < KDIM;
      cp16(sa + a_dst[i], live ? xp + a_src[i] + (kh * WP + kw) * C_ + c : xp, live);
    }
#pragma unroll
    for (int i = 0; i < B_PER; ++i) {
      const bool live = b_live[i] && kt * BK + b_chunk[i] * 8 < KDIM;
      cp16(sb + b_dst[i], live ? wt + b_src[i] + kt * BK : wt, live);
    }
  };

  const int wm0 = (warp / WN) * FM * 16, wn0 = (warp % WN) * FN * 8;
  // ldmatrix row addresses: lane l feeds row l % 8 of matrix l / 8
  const int lrow = lane % 8, lmat = lane / 8;
  float acc[FM][FN][4];
  gemm_pipeline(0, (KDIM + BK - 1) / BK, load_stage, [&](int stage, int kk, unsigned (&af)[FM][4], unsigned (&bfr)[FN][2]) {
    const unsigned sa = sbase + stage * STAGE_BYTES, sb = sa + A_BYTES;
#pragma unroll
    for (int i = 0; i < FM; ++i) {
      // matrices: (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15)
      const int r = wm0 + i * 16 + lrow + (lmat & 1) * 8, c = kk * 2 + (lmat >> 1);
      ldsm_x4(sa + swz(r, c), af[i][0], af[i][1], af[i][2], af[i][3]);
    }
#pragma unroll
    for (int j = 0; j < FN; j += 2) {
      // matrices: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
      const int r = wn0 + j * 8 + lrow + (lmat >> 1) * 8, c = kk * 2 + (lmat & 1);
      ldsm_x4(sb + swz(r, c), bfr[j][0], bfr[j][1], bfr[j + 1][0], bfr[j + 1][1]);
    }
  }, acc);

  // accumulator r of fragment (i, j): row g + 8 * (r / 2), column 2 t + r % 2
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int i = 0; i < FM; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = m0 + wm0 + i * 16 + g + 8 * h;
      if (m >= MDIM) continue;
      const int img = m / HWO, pix = m % HWO;
      bf16_t* o_img = out + (long long)img * O_ * HWO + pix;
#pragma unroll
      for (int j = 0; j < FN; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int o = n0 + wn0 + j * 8 + 2 * t + e;
          if (o < O_) o_img[(long long)o * HWO] = to_bf16(acc[i][j][2 * h + e]);
        }
    }
}
#endif  // SPLITS

#ifdef SPLITS
// The weight gradient dw[o][c][kh][kw] = sum over pixels p = (n, ho, wo) of dy[n][o][ho][wo] *
// xp[n][ho*S + kh][wo*S + kw][c]: a GEMM with m = o, n = (kh, kw, c), k = p, from dyt (dy as
// [p][o], to_padded_nhwc with P_ = 0 and C_ = O) and xp. Both tiles are [k][row-of-m-or-n], the
// m or n run innermost (16-byte copies of 8 output or input channels), read by ldmatrix.trans.
// The k range is split SPLITS ways (grid.z); each split writes its fp32 partial, and
// grad_weight_reduce sums them in split order (a fixed order: the same bits every run).
#define KRED (N_ * HWO)
static_assert(BM % 64 == 0 && BN % 64 == 0, "rows of 8 or more chunks (the swizzle)");
enum : int { A_ROW = BM * 2, B_ROW = BN * 2, A_CH = BM / 8, B_CH = BN / 8 };
static_assert((BK * A_CH) % THREADS == 0 && (BK * B_CH) % THREADS == 0, "whole chunks a thread");

// byte offset of chunk c of row r in rows of `row_bytes`: c XOR r % 8, so the 8 rows an ldmatrix
// matrix reads at one chunk hit 8 distinct 16-byte bank groups
static __device__ __forceinline__ int swz_t(int r, int c, int row_bytes) { return r * row_bytes + ((c ^ (r & 7)) << 4); }

static __device__ __forceinline__ void ldsm_x4_t(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

// grid (O tiles, KDIM tiles, SPLITS); partial: SPLITS x O x KDIM floats
extern "C" __global__ void __launch_bounds__(THREADS) conv_nhwc_grad_weight(const bf16_t* __restrict__ dyt, const bf16_t* __restrict__ xp,
                                                                          float* __restrict__ partial) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN, split = blockIdx.z;
  const unsigned sbase = smem_addr(smem);
  enum { A_BYTES = BK * A_ROW, STAGE_BYTES = BK * (A_ROW + B_ROW) };
  enum { A_PER = BK * A_CH / THREADS, B_PER = BK * B_CH / THREADS };
  const int KT = (KRED + BK - 1) / BK, per = (KT + SPLITS - 1) / SPLITS;
  const int kt0 = split * per, kt1 = kt0 + per < KT ? kt0 + per : KT;

  auto load_stage = [&](int stage, int kt) {
    const unsigned sa = sbase + stage * STAGE_BYTES, sb = sa + A_BYTES;
#pragma unroll
    for (int i = 0; i < A_PER; ++i) {
      const int idx = tid + i * THREADS, r = idx / A_CH, c = idx % A_CH;
      const int p = kt * BK + r, o = m0 + c * 8;
      const bool live = p < KRED && o < O_;
      cp16(sa + swz_t(r, c, A_ROW), live ? dyt + (long long)p * O_ + o : dyt, live);
    }
#pragma unroll
    for (int i = 0; i < B_PER; ++i) {
      const int idx = tid + i * THREADS, r = idx / B_CH, c = idx % B_CH;
      const int p = kt * BK + r, n = n0 + c * 8;
      const bool live = p < KRED && n < KDIM;
      const int pp = live ? p : 0, nn = live ? n : 0;
      const int img = pp / HWO, pix = pp % HWO, ho = pix / WO, wo = pix % WO;
      const int tap = nn / C_, ch = nn % C_, kh = tap / KW_, kw = tap % KW_;
      cp16(sb + swz_t(r, c, B_ROW), xp + (((long long)img * HP + ho * S_ + kh) * WP + wo * S_ + kw) * C_ + ch, live);
    }
  };

  const int wm0 = (warp / WN) * FM * 16, wn0 = (warp % WN) * FN * 8;
  const int lrow = lane % 8, lmat = lane / 8;
  float acc[FM][FN][4];
  gemm_pipeline(kt0, kt1, load_stage, [&](int stage, int kk, unsigned (&af)[FM][4], unsigned (&bfr)[FN][2]) {
    const unsigned sa = sbase + stage * STAGE_BYTES, sb = sa + A_BYTES;
#pragma unroll
    for (int i = 0; i < FM; ++i) {
      // matrices (k rows, 8 m): (k 0-7, m 0-7), (k 0-7, m 8-15), (k 8-15, m 0-7), (k 8-15, m 8-15)
      const int r = kk * 16 + (lmat >> 1) * 8 + lrow, c = (wm0 + i * 16) / 8 + (lmat & 1);
      ldsm_x4_t(sa + swz_t(r, c, A_ROW), af[i][0], af[i][1], af[i][2], af[i][3]);
    }
#pragma unroll
    for (int j = 0; j < FN; j += 2) {
      // matrices: (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15)
      const int r = kk * 16 + (lmat & 1) * 8 + lrow, c = (wn0 + j * 8) / 8 + (lmat >> 1);
      ldsm_x4_t(sb + swz_t(r, c, B_ROW), bfr[j][0], bfr[j][1], bfr[j + 1][0], bfr[j + 1][1]);
    }
  }, acc);
  const int g = lane / 4, t = lane % 4;
  float* part = partial + (long long)split * O_ * KDIM;
#pragma unroll
  for (int i = 0; i < FM; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int o = m0 + wm0 + i * 16 + g + 8 * h;
      if (o >= O_) continue;
#pragma unroll
      for (int j = 0; j < FN; ++j) {
        const int n = n0 + wn0 + j * 8 + 2 * t;
        if (n < KDIM) *reinterpret_cast<float2*>(part + (long long)o * KDIM + n) = make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
      }
    }
}

// dw (O, C, KH, KW) fp32 = the SPLITS partials summed in split order.
extern "C" __global__ void __launch_bounds__(256) grad_weight_reduce(const float* __restrict__ partial, float* __restrict__ dw) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;  // over O x KDIM, n innermost
  if (i >= O_ * KDIM) return;
  float v = 0.f;
#pragma unroll 4
  for (int s = 0; s < SPLITS; ++s) v += partial[(long long)s * O_ * KDIM + i];
  const int o = i / KDIM, n = i % KDIM, tap = n / C_, c = n % C_;
  dw[(o * C_ + c) * (KH_ * KW_) + tap] = v;
}
#endif  // SPLITS
