// Weight-only quantized matmul over GGUF blocks, fp32 activations and accumulation:
// y[M, N] = x[M, K] @ W^T (+ bias[N]) where W is [N rows][row_bytes], each row K / block_size
// GGUF blocks of one type (Q4_K, Q6_K), exactly as a GGUF file stores them. (The 32-weight
// types Q8_0, Q4_0, Q4_1 run in their split layout: quant_split.cpp.) Part of the CPU kernel
// library (kernels/library.py); called from kernels/quant.py.
//
// Every type is read as groups of 32 weights w_k = s * q_k + t (q_k small integers, exact in
// fp32; Q6_K folds its 16-weight scales into q). One output element is then, always in this
// order: acc (16 lanes) = 0; for each group g ascending: acc = fma(s_g, q[0:16] * x[0:16] +
// q[16:32] * x[16:32] (one fma), acc); then hsum(acc) (a fixed tree), then + sum_g t_g * sx_g
// (sx_g = the fixed-tree sum of x over group g), then + bias. Nothing in that chain depends on
// M, the tile a row lands in, or the threads (they split weight rows), so a decode row and the
// same row inside a prefill give the same bits (step invariance, config/numerics.py). The fmas
// are explicit intrinsics so that the compiler's contraction cannot differ between tiles.
//
// Many rows (prefill, batched decode): one group of one weight row is decoded once into
// registers and applied to kRows rows of x (the dequantized tile lives in registers, not in a
// panel), so the decode cost is shared; one row (memory-bound decode): the same code with one.
//
// Also llmserve_quant_dequant_f32: the exact de-quantization of every GGUF type this build reads
// (bit for bit the `gguf` package's numpy reference, products rounded before sums as numpy
// does), for float tensors at load, embedding rows and tests.

#include <omp.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_common.h"
#include "quant_vec.h"

using namespace llmserve;
using namespace llmserve::quant;

namespace {

// Rows of x per pass over a weight row: their accumulators and the decoded group fit the
// vector registers (32 with AVX-512, 16 with AVX2, where a v16 takes two).
constexpr int64_t kXBytes = 256 * 1024;  // rows of x kept in L2 while the weights pass
#if defined(__AVX512F__)
constexpr int kRows = 8;
#else
constexpr int kRows = 4;
#endif


// One group of 32 weights: q[0:16], q[16:32], scale s and offset t (w = s * q + t).
struct Group {
  vf q0, q1;
  float s, t;
};

// Per type: bytes per block, weights per block, whether t can be non-zero, and the decoder of
// group g (of 32 weights) of a row.
// Q4_K's 6-bit scale and min of sub-block j (0..7) from its 12 packed bytes.
inline void q4k_scale_min(const uint8_t* sc, int j, int* scale, int* min) {
  if (j < 4) {
    *scale = sc[j] & 0x3F;
    *min = sc[j + 4] & 0x3F;
  } else {
    *scale = (sc[j + 4] & 0x0F) | ((sc[j - 4] >> 2) & 0x30);
    *min = (sc[j + 4] >> 4) | ((sc[j] >> 2) & 0x30);
  }
}

struct Q4_K {
  static constexpr int kBytes = 144, kBlock = 256;
  static constexpr bool kMin = true;
  static Group group(const uint8_t* row, int64_t g) {
    const uint8_t* b = row + (g / 8) * kBytes;
    const int j = (int)(g % 8);
    int sc, m;
    q4k_scale_min(b + 4, j, &sc, &m);
    const uint8_t* qs = b + 16 + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    const vf q0 = to_vf<false>(and_bytes(shift_right(load_b16(qs), shift), 0x0F));
    const vf q1 = to_vf<false>(and_bytes(shift_right(load_b16(qs + 16), shift), 0x0F));
    return {q0, q1, half(b) * (float)sc, -(half(b + 2) * (float)m)};
  }
};

struct Q6_K {
  static constexpr int kBytes = 210, kBlock = 256;
  static constexpr bool kMin = false;
  static Group group(const uint8_t* row, int64_t g) {
    const uint8_t* b = row + (g / 8) * kBytes;
    const int j = (int)(g % 8), h = j / 4, s = (j / 2) % 2, e = (j % 2) * 32;
    const uint8_t* ql = b + h * 64 + e;
    const uint8_t* qh = b + 128 + h * 32;
    const int8_t* scales = (const int8_t*)(b + 192) + 2 * j;
    vf q[2];
    for (int half_i = 0; half_i < 2; ++half_i) {
      const b16 lo = and_bytes(shift_right(load_b16(ql + 16 * half_i), 4 * s), 0x0F);
      const b16 hi = and_bytes(shift_right(load_b16(qh + 16 * half_i), 2 * (j % 4)), 0x03);
      // (q - 32) * scale: integers below 2^13, exact in fp32.
      q[half_i] = vmul(vadd(to_vf<false>(or_shifted4(lo, hi)), vsplat(-32.0f)),
                       vsplat((float)scales[half_i]));
    }
    return {q[0], q[1], half(b + 208), 0.0f};
  }
};

// kR rows of x (row stride ldx) against weight row `row`: y[r * ldy] for r < kR.
template <class D, int kR>
inline void rows_dot(const float* x, int64_t ldx, const float* sx, int64_t groups,
                     const uint8_t* row, float bias, float* y, int64_t ldy) {
  vf acc[kR];
  float tacc[kR];
  for (int r = 0; r < kR; ++r) acc[r] = vzero(), tacc[r] = 0.0f;
  for (int64_t g = 0; g < groups; ++g) {
    const Group q = D::group(row, g);
    const vf s = vsplat(q.s);
#pragma GCC unroll 8
    for (int r = 0; r < kR; ++r) {
      const float* xr = x + r * ldx + 32 * g;
      const vf p = vfma(q.q1, vload(xr + 16), vmul(q.q0, vload(xr)));
      acc[r] = vfma(s, p, acc[r]);
      if (D::kMin) tacc[r] = mul_rounded(q.t, sx[r * groups + g]) + tacc[r];
    }
  }
  for (int r = 0; r < kR; ++r) y[r * ldy] = (vsum(acc[r]) + tacc[r]) + bias;
}

// kRows rows of x at once, the offset terms of the rows as one vector (lane r = row r, the
// same product-then-sum per lane as rows_dot's scalar, so the same bits); sxt: this tile's
// group sums, [groups][kRows].
template <class D>
inline void tile_dot(const float* x, int64_t ldx, const float* sxt, int64_t groups,
                     const uint8_t* row, float bias, float* y, int64_t ldy) {
  typedef float vr __attribute__((vector_size(4 * kRows)));
  vf acc[kRows];
  vr tacc{};
  for (int r = 0; r < kRows; ++r) acc[r] = vzero();
  for (int64_t g = 0; g < groups; ++g) {
    const Group q = D::group(row, g);
    const vf s = vsplat(q.s);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const float* xr = x + r * ldx + 32 * g;
      const vf p = vfma(q.q1, vload(xr + 16), vmul(q.q0, vload(xr)));
      acc[r] = vfma(s, p, acc[r]);
    }
    if (D::kMin) {
      vr sxv, prod;
      std::memcpy(&sxv, sxt + g * kRows, sizeof sxv);
      prod = sxv * q.t;
      __asm__("" : "+x"(prod));  // rounded apart, never fused into the sum
      tacc += prod;
    }
  }
  for (int r = 0; r < kRows; ++r) y[r * ldy] = (vsum(acc[r]) + tacc[r]) + bias;
}

// One row of x against kDecodeRows weight rows, interleaved: the same chain per element as
// rows_dot<D, 1> (so the same bits), the chains in flight together and x read once.
constexpr int kDecodeRows = 4;  // 2 before: Q4_K 5-10 % faster on AVX2 (docs/benchmarks.md)
template <class D, int R>
inline void row_dots(const float* x, const float* sx, int64_t groups, const uint8_t* w,
                     int64_t row_bytes, const float* bias, float* y) {
  vf acc[R];
  float t[R];
  for (int r = 0; r < R; ++r) acc[r] = vzero(), t[r] = 0.0f;
  for (int64_t g = 0; g < groups; ++g) {
    const vf x0 = vload(x + 32 * g), x1 = vload(x + 32 * g + 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const Group a = D::group(w + r * row_bytes, g);
      acc[r] = vfma(vsplat(a.s), vfma(a.q1, x1, vmul(a.q0, x0)), acc[r]);
      if (D::kMin) t[r] = mul_rounded(a.t, sx[g]) + t[r];
    }
  }
  for (int r = 0; r < R; ++r) y[r] = (vsum(acc[r]) + t[r]) + (bias ? bias[r] : 0.0f);
}

template <class D>
void run(const float* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* w, int64_t N,
         int64_t row_bytes, const float* bias, float* y, int64_t ldy, int num_threads) {
  const int64_t groups = K / 32;
  IeeeMode caller;
  // sx[m][g]: the group sums of x, one fixed tree each (only types with an offset use them).
  std::vector<float> sx(D::kMin ? M * groups : 0);
  if (D::kMin)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < groups; ++g)
        sx[m * groups + g] =
            vsum(vadd(vload(x + m * ldx + 32 * g), vload(x + m * ldx + 32 * g + 16)));
  const float* sxp = sx.data();
  // The same sums per tile of kRows rows, group-major, for tile_dot.
  const int64_t tiles = M / kRows;
  std::vector<float> sxt(D::kMin ? tiles * groups * kRows : 0);
  if (D::kMin)
    for (int64_t t = 0; t < tiles; ++t)
      for (int64_t g = 0; g < groups; ++g)
        for (int r = 0; r < kRows; ++r)
          sxt[(t * groups + g) * kRows + r] = sx[(t * kRows + r) * groups + g];
  const float* sxtp = sxt.data();
  const bool parallel = num_threads > 1 && M * K * N >= (1 << 17);
#pragma omp parallel num_threads(num_threads) if (parallel)
  {
    IeeeMode ieee;  // per thread: no flush-to-zero, whichever thread computes a row
  if (M == 1) {
    // A decode: weight rows kDecodeRows at a time (row_dots), the rest one by one.
    const int64_t blocks = N / kDecodeRows;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < blocks; ++i) {
      const int64_t n = i * kDecodeRows;
      row_dots<D, kDecodeRows>(x, sxp, groups, w + n * row_bytes, row_bytes,
                               bias ? bias + n : nullptr, y + n);
    }
#pragma omp for schedule(static)
    for (int64_t n = blocks * kDecodeRows; n < N; ++n)
      row_dots<D, 1>(x, sxp, groups, w + n * row_bytes, row_bytes, bias ? bias + n : nullptr,
                     y + n);
  } else {
    // Row blocks of x that stay in L2 (kXBytes) while every weight row passes over them; a
    // block is whole tiles, so each row is computed by the same tile or single-row code
    // whatever M is, and by the same chain either way.
    int64_t mc = kXBytes / (K * (int64_t)sizeof(float)) / kRows * kRows;
    if (mc < kRows) mc = kRows;
    for (int64_t m0 = 0; m0 < M; m0 += mc) {
      const int64_t m1 = m0 + mc < M ? m0 + mc : M;
#pragma omp for schedule(static)
      for (int64_t n = 0; n < N; ++n) {
        const uint8_t* row = w + n * row_bytes;
        const float b = bias ? bias[n] : 0.0f;
        int64_t m = m0;
        for (; m + kRows <= m1; m += kRows)
          tile_dot<D>(x + m * ldx, ldx, sxtp + m * groups, groups, row, b, y + m * ldy + n,
                      ldy);
        for (; m < m1; ++m)
          rows_dot<D, 1>(x + m * ldx, ldx, sxp + m * groups, groups, row, b, y + m * ldy + n,
                         ldy);
      }
    }
  }
  }
}

// The exact de-quantization of one row of K weights into out.
void dequant_row(int type, const uint8_t* row, int64_t K, float* out) {
  switch (type) {
    case kF32:
      std::memcpy(out, row, K * 4);
      return;
    case kF16:
      for (int64_t k = 0; k < K; ++k) out[k] = half(row + 2 * k);
      return;
    case kBF16:
      for (int64_t k = 0; k < K; ++k) {
        const uint32_t bits = (uint32_t)(row[2 * k] | (row[2 * k + 1] << 8)) << 16;
        std::memcpy(out + k, &bits, 4);
      }
      return;
    default:
      break;
  }
  for (int64_t g = 0; g < K / 32; ++g) {
    float* o = out + 32 * g;
    if (type == kQ8_0) {
      const uint8_t* b = row + g * 34;
      const float d = half(b);
      for (int i = 0; i < 32; ++i) o[i] = (float)(int8_t)b[2 + i] * d;
    } else if (type == kQ4_0 || type == kQ4_1) {
      const bool q41 = type == kQ4_1;
      const uint8_t* b = row + g * (q41 ? 20 : 18);
      const float d = half(b), m = q41 ? half(b + 2) : 0.0f;
      const uint8_t* qs = b + (q41 ? 4 : 2);
      for (int i = 0; i < 32; ++i) {
        const int q = i < 16 ? qs[i] & 0xF : qs[i - 16] >> 4;
        o[i] = q41 ? mul_rounded(d, (float)q) + m : d * (float)(q - 8);
      }
    } else if (type == kQ4_K) {
      const uint8_t* b = row + (g / 8) * 144;
      const int j = (int)(g % 8);
      int sc, mn;
      q4k_scale_min(b + 4, j, &sc, &mn);
      const float d = half(b) * (float)sc, dm = half(b + 2) * (float)mn;
      const uint8_t* qs = b + 16 + 32 * (j / 2);
      for (int i = 0; i < 32; ++i)
        o[i] = mul_rounded(d, (float)((qs[i] >> (4 * (j % 2))) & 0xF)) - dm;
    } else {  // kQ6_K
      const uint8_t* b = row + (g / 8) * 210;
      const int j = (int)(g % 8), h = j / 4, s = (j / 2) % 2, e = (j % 2) * 32;
      const float d = half(b + 208);
      for (int i = 0; i < 32; ++i) {
        const int lo = (b[h * 64 + e + i] >> (4 * s)) & 0xF;
        const int hi = (b[128 + h * 32 + i] >> (2 * (j % 4))) & 0x3;
        const float scale = mul_rounded(d, (float)((const int8_t*)(b + 192))[2 * j + i / 16]);
        o[i] = scale * (float)((lo | (hi << 4)) - 32);
      }
    }
  }
}

}  // namespace

// y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W^T (+ bias [N] when not null), W
// as N rows of row_bytes bytes of `type` blocks. Returns 0; 1 for arguments it rejects, 2 for
// a type it does not take (the Python side names it).
extern "C" int llmserve_quant_gemm_f32(int type, const float* x, int64_t M, int64_t K,
                                       int64_t ldx, const uint8_t* w, int64_t N,
                                       int64_t row_bytes, const float* bias, float* y,
                                       int64_t ldy, int num_threads) {
  if (M < 0 || K <= 0 || K % 32 || N <= 0 || ldx < K || ldy < N) return 1;
  if (M == 0) return 0;
  const int nt = num_threads < 1 ? 1 : num_threads;
  switch (type) {
    case kQ4_K:
      if (K % 256) return 1;
      run<Q4_K>(x, M, K, ldx, w, N, row_bytes, bias, y, ldy, nt);
      return 0;
    case kQ6_K:
      if (K % 256) return 1;
      run<Q6_K>(x, M, K, ldx, w, N, row_bytes, bias, y, ldy, nt);
      return 0;
    default:
      return 2;
  }
}

// out [num, K] (row stride ldo) = the de-quantized rows rows[0..num) of W (N rows of row_bytes
// bytes of `type`, K weights each); rows null = rows 0..num. Returns 0, 1 or 2 as above.
extern "C" int llmserve_quant_dequant_f32(int type, const uint8_t* w, int64_t N, int64_t K,
                                          int64_t row_bytes, const int64_t* rows, int64_t num,
                                          float* out, int64_t ldo) {
  if (K <= 0 || N <= 0 || ldo < K) return 1;
  if (type != kF32 && type != kF16 && type != kBF16 && type != kQ8_0 && type != kQ4_0 &&
      type != kQ4_1 && type != kQ4_K && type != kQ6_K)
    return 2;
  if (K % 32 && type != kF32 && type != kF16 && type != kBF16) return 1;
  if ((type == kQ4_K || type == kQ6_K) && K % 256) return 1;
  for (int64_t i = 0; i < num; ++i) {
    const int64_t r = rows ? rows[i] : i;
    if (r < 0 || r >= N) return 1;
    dequant_row(type, w + r * row_bytes, K, out + i * ldo);
  }
  return 0;
}
