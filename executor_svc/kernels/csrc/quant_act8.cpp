// The opt-in int8-activation mode of the split-layout quantized matmul (Q8_0 / Q4_0 / Q4_1,
// quant_split.cpp's layout; kernels/quant.py, LLMSERVE_QUANT_ACT=int8): each x row is quantized
// to int8 per group of 32, and a group's 32 products are integer dot products
// (vpmaddubsw + vpmaddwd), so a weight costs a fraction of the fp32 path's unpack, convert and
// two FMAs. Not the default: the result drifts from de-quantize-then-matmul by the activations'
// rounding (docs/benchmarks.md, "int8 activations"), where the fp32 path stays within fp32
// rounding of transformers' GGUF reference.
//
// A row's quantization depends on that row alone, and every output element is one fixed chain,
// so a row gives the same bits whatever the other rows of the call, the threads, or the library
// variant (256-bit AVX2 code everywhere, vpdpbusd for vpmaddubsw + vpmaddwd where the variant
// has AVX-512 VNNI; integer sums are exact in any order):
//   per group g of x: a = max |x_i|, dx = a / 127, xq_i = nearest-even(x_i * (127 / a)) (0 when
//     a = 0); Q4_1 also sx = dx * sum_i xq_i (one rounding)
//   q_i: Q8_0's int8, Q4_0's nibble - 8, Q4_1's nibble; s_g = d_g * dx_g (one rounding)
//   acc (8 lanes) = 0, then
//     Q8_0, each group g ascending: acc = fma(s_g, float(p), acc), p_j (j = 0..7) = the sum of
//       q_i * xq_i over the group's weights 4j..4j+3 (exact int32)
//     Q4_0 / Q4_1, each pair of groups (2k, 2k + 1) ascending (a last odd group paired with
//       zeros): acc = fma([s_2k x4 | s_2k+1 x4], float(p), acc), p_j / p_4+j (j = 0..3) = the
//       sum of q_i * xq_i over the weights 4j..4j+3 and 16+4j..16+4j+3 of group 2k / 2k + 1:
//       two groups' nibbles are one 32-byte load, low nibbles then high ones
//   t (8 lanes) = 0 (Q4_1: for each group g ascending, lane g % 8: t = fma(m_g, sx_g, t))
//   y = (hsum8(acc) + hsum8(t)) + bias, hsum8 = (low + high 128-bit halves), then
//     (c0 + c2) + (c1 + c3)

#include <omp.h>

#include <cstdint>
#include <memory>

#include "quant_common.h"

using namespace llmserve;
using namespace llmserve::quant;

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

namespace {

// Weight rows per pass over one x row, and the passes prefetched ahead. Memory-bound: each
// weight row is 2-3 short streams (quants, scales, minimums) the hardware prefetcher does not
// pick up, so few rows per pass (fewer streams) and a software prefetch into L1 of the pass two
// ahead did best (4-8 rows, 1-8 passes, L1 / L2 hints tried, SmolLM2's shapes, one thread).
constexpr int kOut = 4;
constexpr int64_t kAheadBlocks = 2;

// a / b in one correctly rounded division (fast-math may not rewrite it as a product).
inline float div_exact(float a, float b) {
  __m128 r = _mm_set_ss(a);
  asm("divss %1, %0" : "+x"(r) : "x"(_mm_set_ss(b)));
  return _mm_cvtss_f32(r);
}

inline float hsum8(__m256 a) {
  const __m128 c = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));  // c0 + c2, c1 + c3
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}

// Lane j = the sum of products of bytes 4j..4j+3 (u unsigned, s signed), exact.
// With AVX-512 VNNI (the avx512bf16 variant) one vpdpbusd: the same sums, as vpmaddubsw's int16
// pair sums never saturate here (at most 2 * 128 * 127).
inline __m256i dot4(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// One x row quantized, Gp groups (G rounded up to 8; the extra ones zero): xq (32 bytes a
// group, weight order), xp (the Q4 types' pairs of groups, 64 bytes a pair: weights 0-15 of
// groups 2p and 2p + 1, then their weights 16-31, as a pair of Q4 groups' nibbles lie), dx (a
// group's scale), sx (Q4_1's dx * sum xq) and eight (Q4_0, 8 int32 a pair: 8 * the pair lanes'
// sums of xq, subtracted from the nibbles' products).
struct XRow {
  int8_t* xq;
  int8_t* xp;
  float* dx;
  float* sx;
  int32_t* eight;
};

void quantize_row(const float* x, int64_t G, int64_t Gp, XRow r) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t g = 0; g < G; ++g) {
    const float* p = x + 32 * g;
    __m256 v[4], a = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(p + 8 * i);
      a = _mm256_max_ps(a, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    const float id = amax > 0.0f ? div_exact(127.0f, amax) : 0.0f;
    r.dx[g] = div_exact(amax, 127.0f);
    __m256i q[4];
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(id)),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    // packs interleave 128-bit lanes: the permute puts the 32 bytes back in weight order.
    const __m256i w16 = _mm256_packs_epi32(q[0], q[1]), x16 = _mm256_packs_epi32(q[2], q[3]);
    const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16, x16),
                                                  _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i*)(r.xq + 32 * g), b);
    const __m256i lanes = dot4(_mm256_set1_epi8(1), b);
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(lanes), _mm256_extracti128_si256(lanes, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    r.sx[g] = r.dx[g] * (float)_mm_cvtsi128_si32(s);
  }
  for (int64_t g = G; g < Gp; ++g) {
    r.dx[g] = r.sx[g] = 0.0f;
    _mm256_storeu_si256((__m256i*)(r.xq + 32 * g), _mm256_setzero_si256());
  }
  for (int64_t p = 0; p < Gp / 2; ++p) {
    const __m256i a = _mm256_loadu_si256((const __m256i*)(r.xq + 64 * p));
    const __m256i b = _mm256_loadu_si256((const __m256i*)(r.xq + 64 * p + 32));
    const __m256i lo = _mm256_permute2x128_si256(a, b, 0x20);
    const __m256i hi = _mm256_permute2x128_si256(a, b, 0x31);
    _mm256_storeu_si256((__m256i*)(r.xp + 64 * p), lo);
    _mm256_storeu_si256((__m256i*)(r.xp + 64 * p + 32), hi);
    const __m256i ones = _mm256_set1_epi8(1);
    const __m256i sums = _mm256_add_epi32(dot4(ones, lo), dot4(ones, hi));
    _mm256_storeu_si256((__m256i*)(r.eight + 8 * p), _mm256_slli_epi32(sums, 3));
  }
}

// The exact int32 lane sums of a Q8_0 group (32 int8 at q) against xv (32 int8).
inline __m256i q8_dot(const uint8_t* q, __m256i xv) {
  const __m256i w = _mm256_loadu_si256((const __m256i*)q);
  return dot4(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w));
}

// The exact int32 lane sums of a pair of Q4 groups (32 bytes of nibbles in raw) against the
// pair's x halves: lanes 0-3 group 2p, 4-7 group 2p + 1, lane j of a group its weights
// 4j..4j+3 and 16+4j..16+4j+3. The two byte products fit int16 (2 * 2 * 15 * 127).
inline __m256i q4_pair_dot(__m256i raw, __m256i xlo, __m256i xhi) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(raw, m), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xlo), hi, xhi);
#else
  const __m256i p16 =
      _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
  return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
#endif
}

inline void prefetch(const char* p) { _mm_prefetch(p, _MM_HINT_T0); }

// R consecutive weight rows (their d in sb, m in mb: R rows of Gp floats) against one quantized
// x row: y[r] for r < R. sc: R * Gp floats of scratch (each group's d * dx).
template <int kType, int R>
inline void rows_pass(const XRow& x, int64_t G, int64_t Gp, const uint8_t* w, int64_t row_bytes,
                      const float* sb, const float* mb, float* sc, const float* bias, float* y) {
  constexpr bool kQ4 = kType != kQ8_0;
  constexpr int64_t kQBytes = kQ4 ? 16 : 32;
  constexpr int64_t kBlock = kType == kQ8_0 ? 34 : kType == kQ4_0 ? 18 : 20;
  const int64_t ld = Gp;  // floats a row in sc
  for (int r = 0; r < R; ++r)
    for (int64_t g = 0; g < Gp; g += 8)
      _mm256_storeu_ps(sc + r * ld + g,
                       _mm256_mul_ps(_mm256_loadu_ps(sb + r * Gp + g), _mm256_loadu_ps(x.dx + g)));
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const char* ahead = (const char*)w + kAheadBlocks * R * row_bytes;
  if constexpr (kQ4) {
    constexpr int64_t kShare = 2 * R * kBlock;  // a pair's share of the pass ahead
    for (int64_t p = 0; p < (G + 1) / 2; ++p) {
#pragma GCC unroll 8
      for (int64_t j = 0; j < kShare; j += 64) prefetch(ahead + p * kShare + j);
      const __m256i xlo = _mm256_loadu_si256((const __m256i*)(x.xp + 64 * p));
      const __m256i xhi = _mm256_loadu_si256((const __m256i*)(x.xp + 64 * p + 32));
      const __m256i eight = kType == kQ4_0 ? _mm256_loadu_si256((const __m256i*)(x.eight + 8 * p))
                                           : _mm256_setzero_si256();
      const bool whole = 2 * p + 1 < G;  // else the row's last group alone (no read past it)
      const __m256i pair_lanes = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const uint8_t* q = w + r * row_bytes + 2 * p * kQBytes;
        const __m256i raw = whole ? _mm256_loadu_si256((const __m256i*)q)
                                  : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i*)q));
        __m256i d = q4_pair_dot(raw, xlo, xhi);
        if constexpr (kType == kQ4_0) d = _mm256_sub_epi32(d, eight);
        // [s_2p x4 | s_2p+1 x4] from the two floats
        const __m256 s2 = _mm256_castps128_ps256(
            _mm_castpd_ps(_mm_load_sd((const double*)(sc + r * ld + 2 * p))));
        acc[r] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(s2, pair_lanes), _mm256_cvtepi32_ps(d),
                                 acc[r]);
      }
    }
  } else {
    constexpr int64_t kShare = R * kBlock;
    for (int64_t g = 0; g < G; ++g) {
#pragma GCC unroll 8
      for (int64_t j = 0; j < kShare; j += 64) prefetch(ahead + g * kShare + j);
      const __m256i xv = _mm256_loadu_si256((const __m256i*)(x.xq + 32 * g));
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m256i d = q8_dot(w + r * row_bytes + g * kQBytes, xv);
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(sc[r * ld + g]), _mm256_cvtepi32_ps(d), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 t = _mm256_setzero_ps();
    if constexpr (kType == kQ4_1)
      for (int64_t g = 0; g < Gp; g += 8)
        t = _mm256_fmadd_ps(_mm256_loadu_ps(mb + r * Gp + g), _mm256_loadu_ps(x.sx + g), t);
    y[r] = (hsum8(acc[r]) + hsum8(t)) + (bias ? bias[r] : 0.0f);
  }
}

// n fp16 at p as fp32 into out, zeros up to np.
inline void halves(const uint8_t* p, int64_t n, int64_t np, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 2 * i))));
  for (; i < n; ++i) out[i] = half(p + 2 * i);
  for (; i < np; ++i) out[i] = 0.0f;
}

// R weight rows from n0 against every x row.
template <int kType, int R>
inline void block(const XRow* xs, int64_t M, int64_t ldy, int64_t G, int64_t Gp,
                  const uint8_t* w, int64_t row_bytes, const float* bias, float* y, float* buf) {
  constexpr int64_t kQBytes = kType == kQ8_0 ? 32 : 16;
  float *sb = buf, *mb = buf + R * Gp, *sc = buf + 2 * R * Gp;
  for (int r = 0; r < R; ++r) {
    halves(w + r * row_bytes + G * kQBytes, G, Gp, sb + r * Gp);
    if (kType == kQ4_1) halves(w + r * row_bytes + G * (kQBytes + 2), G, Gp, mb + r * Gp);
  }
  for (int64_t m = 0; m < M; ++m)
    rows_pass<kType, R>(xs[m], G, Gp, w, row_bytes, sb, mb, sc, bias, y + m * ldy);
}

template <int kType>
void work(const XRow* xs, int64_t M, int64_t G, int64_t Gp, const uint8_t* w, int64_t N,
          int64_t row_bytes, const float* bias, float* y, int64_t ldy) {
  std::unique_ptr<float[]> buf(new float[3 * kOut * Gp]);
  const int64_t blocks = N / kOut;
#pragma omp for schedule(static)
  for (int64_t i = 0; i < blocks; ++i)
    block<kType, kOut>(xs, M, ldy, G, Gp, w + i * kOut * row_bytes, row_bytes,
                       bias ? bias + i * kOut : nullptr, y + i * kOut, buf.get());
#pragma omp for schedule(static)
  for (int64_t n = blocks * kOut; n < N; ++n)
    block<kType, 1>(xs, M, ldy, G, Gp, w + n * row_bytes, row_bytes, bias ? bias + n : nullptr,
                    y + n, buf.get());
}

template <int kType>
void run(const float* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* w, int64_t N,
         int64_t row_bytes, const float* bias, float* y, int64_t ldy, int num_threads) {
  IeeeMode caller;
  const int64_t G = K / 32, Gp = (G + 7) / 8 * 8;
  // Per x row and group: 32 bytes of xq and of xp, dx, sx, and half a pair's 8 int32 of eight.
  constexpr int64_t kRowBytes = 32 + 32 + 4 + 4 + 16;
  std::unique_ptr<uint8_t[]> store(new uint8_t[M * Gp * kRowBytes]);
  std::unique_ptr<XRow[]> xs(new XRow[M]);
  for (int64_t m = 0; m < M; ++m) {
    uint8_t* p = store.get() + m * Gp * kRowBytes;
    xs[m] = {(int8_t*)p, (int8_t*)(p + 32 * Gp), (float*)(p + 64 * Gp), (float*)(p + 68 * Gp),
             (int32_t*)(p + 72 * Gp)};
    quantize_row(x + m * ldx, G, Gp, xs[m]);
  }
  if (num_threads > 1 && M * K * N >= (1 << 17)) {
#pragma omp parallel num_threads(num_threads)
    {
      IeeeMode ieee;
      work<kType>(xs.get(), M, G, Gp, w, N, row_bytes, bias, y, ldy);
    }
  } else {
    work<kType>(xs.get(), M, G, Gp, w, N, row_bytes, bias, y, ldy);
  }
}

}  // namespace

// quant_split.cpp's llmserve_quant_gemm_split_f32 with int8 activations (its arguments; type
// without the kActInt8 flag). Returns 0, 1 or 2 as that one.
extern "C" int llmserve_quant_gemm_act8_f32(int type, const float* x, int64_t M, int64_t K,
                                            int64_t ldx, const uint8_t* w, int64_t N,
                                            int64_t row_bytes, const float* bias, float* y,
                                            int64_t ldy, int num_threads) {
  const int nt = num_threads < 1 ? 1 : num_threads;
  switch (type) {
    case kQ8_0: run<kQ8_0>(x, M, K, ldx, w, N, row_bytes, bias, y, ldy, nt); return 0;
    case kQ4_0: run<kQ4_0>(x, M, K, ldx, w, N, row_bytes, bias, y, ldy, nt); return 0;
    case kQ4_1: run<kQ4_1>(x, M, K, ldx, w, N, row_bytes, bias, y, ldy, nt); return 0;
    default: return 2;
  }
}

#else  // no AVX2: the mode is not built (every variant of the library has AVX2)

extern "C" int llmserve_quant_gemm_act8_f32(int, const float*, int64_t, int64_t, int64_t,
                                            const uint8_t*, int64_t, int64_t, const float*,
                                            float*, int64_t, int) {
  return 2;
}

#endif
